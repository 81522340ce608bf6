"""What the HTTP tests' MCP clients share: the protocol versions and ``_meta`` they send, a raw
2026-07-28 call, sending a request as a real client does (a 503 with ``Retry-After`` is
retried), reading the JSON-RPC reply out of a JSON or SSE response, opening a session, waiting
for a file a test tool writes, unique tags, and ``shmtool dump --json`` of a registry."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from .gunicorn_harness import REPO_ROOT, wait_until

LEGACY = "2025-11-25"
MODERN = "2026-07-28"
ACCEPT = "application/json, text/event-stream"


def meta(client: str) -> dict[str, Any]:
    """The ``_meta`` of a 2026-07-28 request from client ``client``."""
    return {"io.modelcontextprotocol/protocolVersion": MODERN,
            "io.modelcontextprotocol/clientInfo": {"name": client, "version": "1"},
            "io.modelcontextprotocol/clientCapabilities": {}}


def modern_call_bytes(tool: str, arguments: dict[str, Any], rid: int = 1, *,
                      client: str = "t", host: str = "127.0.0.1") -> bytes:
    """A 2026-07-28 ``tools/call`` of ``tool`` as raw HTTP/1.1 bytes, for tests that need the
    socket itself (its close, what else is sent on it)."""
    body = json.dumps({"jsonrpc": "2.0", "id": rid, "method": "tools/call",
                       "params": {"name": tool, "arguments": arguments,
                                  "_meta": meta(client)}}).encode()
    return (f"POST /mcp HTTP/1.1\r\nHost: {host}\r\nAccept: {ACCEPT}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"MCP-Protocol-Version: {MODERN}\r\nMcp-Method: tools/call\r\nMcp-Name: {tool}\r\n"
            f"\r\n").encode() + body


RETRY_FOR = 20.0  # seconds a client keeps retrying a 503 that carries Retry-After
MAX_RETRY_WAIT = 1.0  # seconds, the longest wait between two tries (whatever Retry-After says)


def send(method: str, url: str, *, retry_for: float = RETRY_FOR, timeout: float = 20.0,
         **kw: Any) -> httpx.Response:
    """``httpx.request(method, url, **kw)`` as a real client sends it: a 503 that carries
    ``Retry-After`` (the server is briefly unable to answer: a registry lock held, Redis slow)
    is sent again after the wait it asks for (at most :data:`MAX_RETRY_WAIT`), until
    ``retry_for`` seconds have passed; then the last answer is returned. ``retry_for=0``: the
    first answer, for a test whose point is the 503."""
    end = time.monotonic() + retry_for
    while True:
        r = httpx.request(method, url, timeout=timeout, **kw)
        after = r.headers.get("retry-after")
        left = end - time.monotonic()
        if r.status_code != 503 or after is None or left <= 0:
            return r
        try:
            wait = float(after)
        except ValueError:
            wait = MAX_RETRY_WAIT
        time.sleep(max(0.0, min(wait, MAX_RETRY_WAIT, left)))


def reply_of(r: httpx.Response) -> dict[str, Any]:
    """The JSON-RPC message of a reply sent as application/json or as an SSE stream."""
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        for line in r.text.splitlines():
            if line.startswith("data:"):
                msg = json.loads(line[5:])
                if "id" in msg:
                    return msg
        raise AssertionError(f"no reply in the event stream: {r.text!r}")
    return r.json()


def open_session(url: str, headers: dict[str, str], client: str = "t") -> dict[str, str]:
    """``initialize`` (2025-11-25) then ``notifications/initialized`` at ``url`` with
    ``headers``; returns them with the session's ``mcp-session-id`` added."""
    with httpx.Client(timeout=10) as h:
        r = h.post(url, headers=headers, json={
            "jsonrpc": "2.0", "id": 0, "method": "initialize",
            "params": {"protocolVersion": LEGACY, "capabilities": {},
                       "clientInfo": {"name": client, "version": "0"}}})
        assert r.status_code == 200, r.text
        hdrs = dict(headers, **{"mcp-session-id": r.headers["mcp-session-id"]})
        r = h.post(url, headers=hdrs,
                   json={"jsonrpc": "2.0", "method": "notifications/initialized"})
        assert r.status_code == 202, r.text
    return hdrs


def wait_file(path: str, deadline: float) -> str:
    """The text of ``path`` once it exists (polling until ``deadline``)."""
    def read() -> str | None:
        try:
            return Path(path).read_text()
        except FileNotFoundError:
            return None
    return wait_until(read, deadline, interval=0.002, what=path)


def tag() -> str:
    """A unique tag for the files one tool call writes."""
    return "t" + uuid.uuid4().hex[:10]


def dump(name: str) -> dict[str, Any]:
    """``shmtool dump NAME --json``, run in a subprocess, parsed."""
    out = subprocess.run([sys.executable, "-m", "shmcancel.shmtool", "dump", name, "--json"],
                         capture_output=True, text=True, timeout=30, cwd=REPO_ROOT, check=True)
    return json.loads(out.stdout)
