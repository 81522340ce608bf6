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
VENV=${VENV:-$ROOT/.venv}
run_dir=$ROOT/build/peers/sdk-run
# shellcheck source=tools/peers/lib.sh
. tools/peers/lib.sh
trap stop_server EXIT
trap 'exit 130' INT TERM
peers_install
rm -rf "$run_dir"
mkdir -p "$run_dir"

# run LABEL WORKERS BARE: the everything-style app (bare: without shmcancel.sdk), then the suite.
run() {
    local label=$1 workers=$2 bare=$3
    SHMCANCEL_SDK_BENCH_BARE=$bare start_server "$label" examples/sdk/gunicorn.conf.py "$workers" \
        --pythonpath "$ROOT/tools" sdk_everything_app:app
    "$NODE22" "$CONFORMANCE" server --url "$url" -o "$run_dir/$label" \
        >"$run_dir/conformance-$label.log" 2>&1 || true
    stop_server
}

run bare 1 1
run sdk 3 0

"$VENV/bin/python" - "$run_dir" <<'EOF'
import pathlib, sys
sys.path.insert(0, "tools/peers")
import results
run_dir = pathlib.Path(sys.argv[1])


def table(label):
    return {name: ("PASS" if passed else "FAIL", "" if passed else detail)
            for name, (passed, detail) in results.scenarios(run_dir / label).items()}


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
