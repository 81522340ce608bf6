"""gunicorn config of the example server built on the official MCP SDK.

From the repository root::

    .venv/bin/gunicorn -c examples/sdk/gunicorn.conf.py

serves ``http://127.0.0.1:8001/mcp`` with three ``uvicorn_worker.UvicornWorker`` workers sharing
one cancellation registry. ``SHMCANCEL_SDK_STATELESS=1`` serves it stateless with JSON responses.
"""

import os

import shmcancel
import shmcancel.gunicorn
from shmcancel.gunicorn import child_exit, on_exit, post_fork, when_ready  # noqa: F401

pythonpath = os.path.dirname(os.path.abspath(__file__))
wsgi_app = "app:app"
proc_name = "shmcancel-sdk-example"
bind = "127.0.0.1:8001"
workers = 3
worker_class = "uvicorn_worker.UvicornWorker"
timeout = 90
control_socket_disable = True

shmcancel.gunicorn.configure(config=shmcancel.Config(ttl=300.0))
