"""A WSGI app for tests/test_gunicorn_hooks.py (placeholder until the MCP server lands)."""

from __future__ import annotations

import json
import os


def app(environ, start_response):
    body = json.dumps({"pid": os.getpid()}).encode()
    start_response("200 OK", [("Content-Type", "application/json"),
                              ("Content-Length", str(len(body)))])
    return [body]
