"""The app tests/integration/test_gunicorn_hooks.py serves with the example's gunicorn.conf.py:
the example's MCP tools at ``/mcp``, plus two plain endpoints that look inside the worker.

- ``GET /whoami``: ``{"pid", "registry", "threads"}``: the worker and the name of the registry
  ``shmcancel.shm.registry.current()`` gives it (``null`` when it has none).
- ``GET /hold-lock``: takes the registry lock and keeps it until the worker dies (the test
  SIGKILLs it); answers only if the lock cannot be taken.
"""

from __future__ import annotations

import json
import os
import threading
import time

from examples.gunicorn.app import app as mcp_app
from shmcancel.shm import registry


def _json(start_response, status: str, obj: object) -> list[bytes]:
    body = json.dumps(obj).encode()
    start_response(status, [("Content-Type", "application/json"),
                            ("Content-Length", str(len(body)))])
    return [body]


def app(environ, start_response):
    path = environ.get("PATH_INFO", "")
    if path == "/whoami":
        reg = registry.current()
        return _json(start_response, "200 OK", {
            "pid": os.getpid(), "registry": None if reg is None else reg.name,
            "threads": threading.active_count()})
    if path == "/hold-lock":
        reg = registry.current()
        if reg is None:
            return _json(start_response, "500 Internal Server Error", {"error": "no registry"})
        with reg.lock:
            while True:  # until SIGKILL; keep gunicorn's worker timeout away meanwhile
                time.sleep(0.05)
    return mcp_app(environ, start_response)
