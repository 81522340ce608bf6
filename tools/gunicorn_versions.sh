#!/usr/bin/env bash
# Run the gunicorn tests (hooks, SDK, refused bodies, disconnects and stuck tools) against other
# gunicorn versions, each in its own venv (build/venv-gunicorn-VERSION, git-ignored): by default
# 23.0.0, the oldest supported, where child_exit still runs inside the master's SIGCHLD handler
# and a gthread worker keeps other counts of its connections (mcp/stop.py reads them).
# Usage: tools/gunicorn_versions.sh [VERSION...] [-- PYTEST_ARGS]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
versions=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do versions+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
[ ${#versions[@]} -gt 0 ] || versions=(23.0.0)
rc=0
for v in "${versions[@]}"; do
    venv="build/venv-gunicorn-$v"
    if [ ! -x "$venv/bin/python" ]; then
        "$PY" -m venv "$venv"
    fi
    "$venv/bin/python" -m pip install --quiet --upgrade pip
    "$venv/bin/python" -m pip install --quiet -e '.[test]' "gunicorn==$v"
    got=$("$venv/bin/python" -c 'import gunicorn; print(gunicorn.__version__)')
    if [ "$got" != "$v" ]; then
        echo "gunicorn $v: installed $got instead" >&2
        exit 1
    fi
    echo "== gunicorn $v"
    "$venv/bin/python" -m pytest -n auto --maxprocesses 4 --dist loadfile \
        tests/integration/test_gunicorn_hooks.py tests/integration/test_sdk.py \
        tests/integration/test_refused_bodies.py tests/mcp/test_disconnect.py "$@" || rc=1
done
exit "$rc"
