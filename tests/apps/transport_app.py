"""The app test_http.py and test_disconnect.py serve with gunicorn (``transport_conf.py``).

``/mcp``: an MCP server with sessions; ``/stateless``: the same tools without sessions (anonymous
clients share the ``ip:`` scope). Tools record what they observe as files in
``$SHMCANCEL_TEST_DIR`` — ``<tag>.started`` (``pid``) and ``<tag>.cancelled`` (the
``time.monotonic()`` at which ``cancelled(conn)`` was first seen true; CLOCK_MONOTONIC is
system-wide, so the test process can compare it with its own clock).
"""

from __future__ import annotations

import os
import time

import shmcancel
from shmcancel import errors
from shmcancel.server import McpServer, ToolError, progress, wait_cancelled

OUT = os.environ.get("SHMCANCEL_TEST_DIR", "/tmp")
POLL = 0.002  # seconds between two looks at the cancellation flag


def _record(tag: object, what: str, text: str) -> None:
    if not isinstance(tag, str) or not tag.isidentifier():
        return
    path = os.path.join(OUT, f"{tag}.{what}")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _seconds(params: dict) -> float:
    s = params.get("seconds", 1.0)
    if isinstance(s, bool) or not isinstance(s, int | float) or not 0 <= s <= 30:
        raise ToolError(errors.INVALID_PARAMS, '"seconds" must be a number from 0 to 30')
    return float(s)


def build(sessions: bool, path: str) -> McpServer:
    server = McpServer(name="transport-test", version="1.0", sessions=sessions, path=path,
                       body_timeout=float(os.environ.get("SHMCANCEL_TEST_BODY_TIMEOUT", "10")),
                       max_body_bytes=int(os.environ.get("SHMCANCEL_TEST_MAX_BODY", "1000000")))

    @server.tool("echo", input_schema={"type": "object",
                                       "properties": {"text": {"type": "string"}}})
    def echo(conn, params):
        return str(params.get("text", ""))

    @server.tool("count", input_schema={"type": "object", "properties": {
        "n": {"type": "integer", "x-mcp-header": "N"}}})
    def count(conn, params):
        """Its integer argument is mirrored in ``Mcp-Param-N`` on the 2026-07-28 wire."""
        return str(params.get("n"))

    @server.tool("whoami")
    def whoami(conn, params):
        return str(os.getpid())

    @server.tool("sleep")
    def sleep(conn, params):
        """Sleep ``seconds``, polling cancellation every 2 ms; -32800 when cancelled."""
        seconds, tag = _seconds(params), params.get("tag")
        _record(tag, "started", str(os.getpid()))
        deadline = time.monotonic() + seconds
        while True:
            if shmcancel.cancelled(conn):
                _record(tag, "cancelled", repr(time.monotonic()))
                raise ToolError(errors.REQUEST_CANCELLED, "Request cancelled")
            left = deadline - time.monotonic()
            if left <= 0:
                return f"slept {seconds:g}s"
            time.sleep(min(POLL, left))

    @server.tool("waiter")
    def waiter(conn, params):
        """One ``wait_cancelled`` of ``seconds`` (no poll): ends early only when woken."""
        seconds, tag = _seconds(params), params.get("tag")
        _record(tag, "started", str(os.getpid()))
        if wait_cancelled(conn, seconds):
            _record(tag, "cancelled", repr(time.monotonic()))
            raise ToolError(errors.REQUEST_CANCELLED, "Request cancelled")
        return f"waited {seconds:g}s"

    @server.tool("nap")
    def nap(conn, params):
        """Sleep ``seconds`` without looking at cancellation (a tool busy computing): only the
        transport's own look when it returns can answer it ``-32800``. With ``progress``
        true, one progress notification first (the reply becomes an SSE stream); ``pad``
        characters added to the text it returns (a large answer)."""
        seconds, tag = _seconds(params), params.get("tag")
        if params.get("progress"):
            progress(conn, 0, 1, "napping")
        _record(tag, "started", str(os.getpid()))
        time.sleep(seconds)
        pad = params.get("pad", 0)
        return f"napped {seconds:g}s" + "x" * (pad if type(pad) is int and pad > 0 else 0)

    @server.tool("nested")
    def nested(conn, params):
        """A result nested ``depth`` levels deep (past the interpreter's recursion limit, JSON
        cannot encode it), after ``steps`` progress notifications; in a ``content`` list when
        ``content`` is true, else as structured content."""
        depth, steps = params.get("depth", 5000), params.get("steps", 0)
        if isinstance(depth, bool) or not isinstance(depth, int) or not 0 <= depth <= 100_000:
            raise ToolError(errors.INVALID_PARAMS, '"depth" must be an integer from 0 to 100000')
        value: dict = {}
        for _ in range(depth):
            value = {"x": value}
        for i in range(1, steps + 1 if isinstance(steps, int) else 1):
            progress(conn, i, steps)
        if params.get("content"):
            return {"content": [{"type": "text", "text": "deep"}], "deep": value}
        return value

    @server.tool("steps")
    def steps(conn, params):
        """Report ``n`` progress steps (SSE when the client asked for progress), then return."""
        n = params.get("n", 3)
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= 100:
            raise ToolError(errors.INVALID_PARAMS, '"n" must be an integer from 0 to 100')
        sent = sum(progress(conn, i, n, f"step {i}") for i in range(1, n + 1))
        return f"{sent} of {n} sent"

    @server.tool("raises")
    def raises(conn, params):
        """Raise the named exception: one a tool can raise by mistake (a ``BaseException``)."""
        import asyncio
        kinds = {"KeyboardInterrupt": KeyboardInterrupt, "GeneratorExit": GeneratorExit,
                 "CancelledError": asyncio.CancelledError, "ValueError": ValueError}
        raise kinds[params["kind"]]("raised by the tool")

    @server.tool("leaves_lock")
    def leaves_lock(conn, params):
        """Take the registry lock and leave the hold behind, as an exception that lands as
        the lock's release is entered (a signal handler's) does."""
        from shmcancel.shm import registry
        registry.current().lock.__enter__()
        return str(os.getpid())

    @server.tool("stubborn")
    def stubborn(conn, params):
        """Ignore cancellation (but record seeing it) for ``seconds``."""
        seconds, tag = _seconds(params), params.get("tag")
        _record(tag, "started", str(os.getpid()))
        deadline = time.monotonic() + seconds
        seen = False
        while time.monotonic() < deadline:
            if not seen and shmcancel.cancelled(conn):
                seen = True
                _record(tag, "cancelled", repr(time.monotonic()))
            time.sleep(0.005)
        _record(tag, "finished", "")
        return "stubborn done"

    return server


mcp = build(True, "/mcp")
stateless = build(False, "/stateless")


def app(environ, start_response):
    if environ.get("PATH_INFO", "").rstrip("/") == "/stateless":
        return stateless(environ, start_response)
    return mcp(environ, start_response)
