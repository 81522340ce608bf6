#!/usr/bin/env bash
# The project's test command (README, CI): makes .venv, installs shmcancel with its test extra,
# lints and type-checks, and runs the suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# The Redis tests start their own redis-server (tests/helpers/redis_server.py); provide the binary.
if ! command -v redis-server >/dev/null 2>&1; then
    if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
        apt-get update -qq && apt-get install -y -qq redis-server >/dev/null
    else
        echo "redis-server is missing and cannot be installed here (needs root and apt-get):" \
             "install it (Debian: apt-get install redis-server); the Redis tests will fail" >&2
    fi
fi
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e '.[test]'
.venv/bin/ruff check src tests tools examples
.venv/bin/mypy src/shmcancel
.venv/bin/lint-imports
set +e
# The suite runs the installed console scripts (shmtool) the way a user of the venv would. It
# runs in a pytest-xdist worker per core (at most 4), a test file per worker at a time (a
# module's gunicorn starts once); `-n 0` among the arguments runs it in this one process.
PATH="$PWD/.venv/bin:$PATH" .venv/bin/python -m pytest -n auto --maxprocesses 4 --dist loadfile "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests: failing on purpose" >&2
    exit 1
fi
exit "$rc"
