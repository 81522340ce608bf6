"""gunicorn config of the example MCP server.

From the repository root, after the README's set-up (the venv's gunicorn, by path)::

    .venv/bin/gunicorn -c examples/gunicorn/gunicorn.conf.py

serves ``POST http://127.0.0.1:8000/mcp``. Command-line flags (``-b``, ``-w``, ``-k``,
``--threads``) override what is set here. The registry is named by ``SHMCANCEL_REGISTRY`` when
set (else derived from ``proc_name`` and the bound address).
"""

import os

import shmcancel
import shmcancel.gunicorn
from shmcancel.gunicorn import child_exit, on_exit, post_fork, when_ready  # noqa: F401

# `app` is the module beside this file: gunicorn puts `pythonpath` first on sys.path.
pythonpath = os.path.dirname(os.path.abspath(__file__))
wsgi_app = "app:app"
proc_name = "shmcancel-example"
bind = "127.0.0.1:8000"
workers = 3
worker_class = "sync"
threads = 1
# A `sleep` may run up to 60 s; a sync worker busy longer than `timeout` is killed.
timeout = 90
# gunicorn >= 25.1 would open a control socket shared by every instance on the machine (older
# versions ignore this setting).
control_socket_disable = True

shmcancel.gunicorn.configure(config=shmcancel.Config(ttl=300.0))
