"""gunicorn config for tests/apps/transport_app.py: the shmcancel hooks and a registry whose
``stream_cancel_timeout`` is short, so the disconnect tests run quickly. The harness passes
``-b``, ``-w``, ``-k``, ``--threads`` and the app on the command line."""

import os
import sys

import shmcancel
import shmcancel.gunicorn
from shmcancel.gunicorn import child_exit, on_exit, post_fork, when_ready  # noqa: F401

control_socket_disable = True
timeout = 30
graceful_timeout = 5

shmcancel.gunicorn.configure(config=shmcancel.Config(
    stream_cancel_timeout=float(os.environ.get("SHMCANCEL_TEST_STREAM_CANCEL_TIMEOUT", "0.5")),
    max_rows_per_scope=int(os.environ.get("SHMCANCEL_TEST_MAX_ROWS_PER_SCOPE", "16")),
    ttl=float(os.environ.get("SHMCANCEL_TEST_TTL", "300")),
    janitor_interval=float(os.environ.get("SHMCANCEL_TEST_JANITOR_INTERVAL", "60")),
    lock_timeout=float(os.environ.get("SHMCANCEL_TEST_LOCK_TIMEOUT", "10")),
    session_ttl=float(os.environ.get("SHMCANCEL_TEST_SESSION_TTL", "3600")),
    sessions_per_client=int(os.environ.get("SHMCANCEL_TEST_SESSIONS_PER_CLIENT", "32")),
))


if os.environ.get("SHMCANCEL_TEST_RINGS_ONLY") == "1":
    # nothing looks at a worker's waits but a ring (tests/helpers/rings.py): a missing ring shows
    def post_fork(server, worker):
        shmcancel.gunicorn.post_fork(server, worker)
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from helpers.rings import set_rings_only
        set_rings_only()
