"""Races in stopping a tool whose client left (contract §6.3, mcp/stop.py) against a real gunicorn:
trace hooks in the worker's app (tests/apps/stop_race_app.py) pin each thread to the point the
race needs; no sleeps order anything. Waits poll with deadlines."""

from __future__ import annotations

import json
import os
import platform
import signal
import socket
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.gunicorn_harness import Gunicorn, alive, wait_until
from helpers.mcp_client import tag, wait_file

from shmcancel.mcp import jsonrpc

pytestmark = pytest.mark.integration

CONF = "tests/apps/transport_conf.py"
GRACE = 0.5  # stream_cancel_timeout


def send_call(port: int, tool: str, args: dict[str, Any], *,
              meta: dict[str, Any] | None = None, rcvbuf: int | None = None) -> socket.socket:
    """Open a connection and send one ``tools/call`` to ``/stateless``; the socket is the
    client. ``rcvbuf``: its receive buffer, set before it connects (the window it offers)."""
    params: dict[str, Any] = {"name": tool, "arguments": args}
    if meta is not None:
        params["_meta"] = meta
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                       "params": params}).encode()
    head = ("POST /stateless HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            "Accept: application/json, text/event-stream\r\nMCP-Protocol-Version: 2025-11-25\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    s = socket.socket()
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(20)
    s.connect(("127.0.0.1", port))
    s.sendall(head + body)
    return s


def read_all(s: socket.socket) -> bytes:
    """Everything the server sends on ``s`` until it closes the connection."""
    data = b""
    while chunk := s.recv(1 << 20):
        data += chunk
    return data


def test_a_tool_that_ends_as_the_last_wait_times_out_does_not_lose_its_worker(
        shm_name: str, tmp_path: Path) -> None:
    """``gthread``, ``graceful_timeout`` 0: the tool did not take ``RequestStopped`` (stuck in C),
    so the worker was asked to exit; the stop thread's last wait is over, and it is to
    ``_exit``, just as the tool ends and calls ``stop()``. The process must not be
    ``_exit``-ed under it: its tool ended, so the graceful exit it was asked for goes on (code
    0), its pool joined."""
    env = {"SHMCANCEL_TEST_DIR": str(tmp_path), "SHMCANCEL_TEST_STREAM_CANCEL_TIMEOUT": str(GRACE)}
    with Gunicorn("tests.apps.stop_race_app:app", registry_name=shm_name, config=CONF, env=env,
                  workers=1, worker_class="gthread", threads=2,
                  extra_args=["--graceful-timeout", "0"]) as g:
        (worker,) = g.worker_pids()
        t = tag()
        s = send_call(g.port, "held", {"tag": t})
        wait_file(f"{tmp_path}/{t}.started", time.monotonic() + 10)
        s.close()
        # grace, RequestStopped's second, graceful_timeout 0 and its second, then the exit
        wait_until(lambda: not alive(worker), time.monotonic() + GRACE + 1 + 1 + 10,
                   what="the worker asked to exit to exit")
        g.wait_workers(1, time.monotonic() + 15)
        log = g.log()
        assert "stop-race: the stop thread's last wait is over" in log, g.log_tail()
        assert "held caught RequestStopped" in log, g.log_tail()
        assert "stop-race: the stop thread returned" in log, g.log_tail()
        assert "exiting now" not in log, g.log_tail()
        assert f"Worker (pid:{worker}) exited with code" not in log, g.log_tail()


def _in_sendto(pid: int) -> bool:
    """Whether process ``pid``'s main thread is blocked in ``sendto`` (x86-64: syscall 44)."""
    try:
        with open(f"/proc/{pid}/syscall") as f:
            return f.read().split()[0] == "44"
    except (OSError, IndexError):
        return False


def _chunked(body: bytes) -> tuple[bytes, bool]:
    """A chunked body's data and whether it ended properly; ``AssertionError`` on broken
    framing. Data cut short (the connection closed inside a chunk) is returned as far as it
    came."""
    data, rest = b"", body
    while rest:
        size_line, sep, rest = rest.partition(b"\r\n")
        assert sep and size_line and all(c in b"0123456789abcdefABCDEF" for c in size_line), \
            (size_line[:40], data[-80:])
        n = int(size_line, 16)
        if n == 0:
            assert rest == b"\r\n", rest[:80]
            return data, True
        data += rest[:n]
        if len(rest) < n + 2:
            assert len(rest) <= n, rest[n:]  # cut inside the chunk, or before its CRLF
            return data, False
        assert rest[n:n + 2] == b"\r\n", (rest[n:n + 80], data[-80:])
        rest = rest[n + 2:]
    return data, False


@pytest.mark.skipif(platform.machine() != "x86_64", reason="reads the syscall number")
def test_a_sync_worker_quit_in_the_middle_of_an_event_does_not_corrupt_the_stream(
        shm_name: str, tmp_path: Path) -> None:
    """``sync``: gunicorn's quit (``SIGQUIT``: a quick shutdown sends it to every worker)
    lands while the tool's progress notification is being written to a client that reads
    slowly; its ``SystemExit`` interrupts the write with part of the event sent. After half a
    chunk no byte may follow on the connection: the call's ``-32603`` event there made the
    stream corrupt (a client may read a wrong message); cut short, it is a plain transport
    error."""
    env = {"SHMCANCEL_TEST_DIR": str(tmp_path)}
    with Gunicorn("tests.apps.stop_race_app:app", registry_name=shm_name, config=CONF, env=env,
                  workers=1) as g:
        (worker,) = g.worker_pids()
        t, size = tag(), 8 << 20
        with send_call(g.port, "shout", {"tag": t, "size": size},
                       meta={"progressToken": "p"}, rcvbuf=4096) as s:
            wait_file(f"{tmp_path}/{t}.started", time.monotonic() + 10)
            wait_until(lambda: _in_sendto(worker), time.monotonic() + 10,
                       what="the worker to block writing the event")
            os.kill(worker, signal.SIGQUIT)
            data = read_all(s)
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and b"chunked" in head.lower(), head
        events, complete = _chunked(body)
        event = b"event: message\ndata: " + jsonrpc.encode({
            "jsonrpc": "2.0", "method": "notifications/progress",
            "params": {"progressToken": "p", "progress": 1, "message": "x" * size}}) + b"\n\n"
        assert not complete and 0 < len(events) < len(event), (complete, len(events))
        assert events == event[:len(events)], events[-200:]
        wait_until(lambda: not alive(worker), time.monotonic() + 10, what="the worker to exit")
        assert "Error handling request" not in g.log(), g.log_tail()


def test_a_sync_worker_quit_before_an_event_is_written_still_answers_the_call(
        shm_name: str, tmp_path: Path) -> None:
    """``sync``: gunicorn's quit lands in the tool's progress notification before any byte of it
    is written (as it is encoded). Nothing on the wire is cut: the call is answered (``-32603``,
    its worker exiting), not hung up on with an empty reply."""
    env = {"SHMCANCEL_TEST_DIR": str(tmp_path)}
    with Gunicorn("tests.apps.stop_race_app:app", registry_name=shm_name, config=CONF, env=env,
                  workers=1) as g:
        (worker,) = g.worker_pids()
        with send_call(g.port, "quit_before_write", {"tag": tag()},
                       meta={"progressToken": "p"}) as s:
            data = read_all(s)
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), data[:300]
        events, complete = _chunked(body) if b"chunked" in head.lower() else (body, True)
        assert complete, events[-200:]
        (line,) = [ln for ln in events.split(b"\n") if ln.startswith(b"data: ")]
        answer = json.loads(line[len(b"data: "):])
        assert answer["id"] == 1 and answer["error"]["code"] == -32603, answer
        wait_until(lambda: not alive(worker), time.monotonic() + 10, what="the worker to exit")
