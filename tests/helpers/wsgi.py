"""Calling a WSGI app in-process: ``environ_for`` builds a real environ, ``run`` calls the app
(checked by ``wsgiref.validate``) and returns a ``Reply``."""

from __future__ import annotations

import io
import json
import sys
from typing import Any
from wsgiref.validate import validator

ACCEPT_BOTH = "application/json, text/event-stream"


class Reply:
    def __init__(self, status: str, headers: list[tuple[str, str]], body: bytes) -> None:
        self.status = int(status.split()[0])
        self.headers = {k.lower(): v for k, v in headers}
        self.body = body

    @property
    def json(self) -> Any:
        assert self.headers.get("content-type", "").startswith("application/json"), self.headers
        return json.loads(self.body)

    def events(self) -> list[Any]:
        assert self.headers["content-type"].startswith("text/event-stream")
        out = []
        for block in self.body.decode().split("\n\n"):
            data = [line[5:].strip() for line in block.splitlines() if line.startswith("data:")]
            if data:
                out.append(json.loads("\n".join(data)))
        return out

    def __repr__(self) -> str:
        return f"<Reply {self.status} {self.headers} {self.body[:300]!r}>"


def environ_for(method: str = "POST", body: bytes | None = b"", *, path: str = "/mcp",
                headers: dict[str, str] | None = None,
                content_type: str | None = "application/json",
                content_length: str | None = "auto", extra: dict | None = None) -> dict[str, Any]:
    env: dict[str, Any] = {
        "REQUEST_METHOD": method, "SCRIPT_NAME": "", "PATH_INFO": path, "QUERY_STRING": "",
        "SERVER_NAME": "testserver", "SERVER_PORT": "80", "SERVER_PROTOCOL": "HTTP/1.1",
        "REMOTE_ADDR": "203.0.113.7", "wsgi.version": (1, 0), "wsgi.url_scheme": "http",
        "wsgi.input": io.BytesIO(body or b""), "wsgi.errors": sys.stderr,
        "wsgi.multithread": False, "wsgi.multiprocess": True, "wsgi.run_once": False,
        "HTTP_ACCEPT": ACCEPT_BOTH,
    }
    if content_type is not None:
        env["CONTENT_TYPE"] = content_type
    if content_length == "auto":
        env["CONTENT_LENGTH"] = str(len(body or b""))
    elif content_length is not None:
        env["CONTENT_LENGTH"] = content_length
    for k, v in (headers or {}).items():
        key = k.upper().replace("-", "_")
        if v is None:
            env.pop("HTTP_" + key, None)
        else:
            env["HTTP_" + key] = v
    env.update(extra or {})
    return env


def run(app: Any, env: dict[str, Any], *, validate: bool = True) -> Reply:
    captured: dict[str, Any] = {}
    written: list[bytes] = []

    def start_response(status, headers, exc_info=None):
        captured["status"], captured["headers"] = status, headers
        return written.append

    wsgi = validator(app) if validate else app
    it = wsgi(env, start_response)
    try:
        for chunk in it:
            written.append(chunk)
    finally:
        if hasattr(it, "close"):
            it.close()
    return Reply(captured["status"], captured["headers"], b"".join(written))
