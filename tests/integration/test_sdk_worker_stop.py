"""A call still running when its SDK worker stops (gunicorn ``HUP``): its SSE stream ended as the
server's exit began (``sse_starlette`` ends every stream at once) and its session dies with the
worker, so no answer of it can arrive; a sync tool ran on unheard until it ended or gunicorn's
``graceful_timeout`` (30 s) killed the worker, its in-flight row held all the while. It is
stopped at the app's lifespan shutdown: the worker exits at once and no row stays."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers.gunicorn_harness import Gunicorn, alive, wait_until
from helpers.mcp_client import modern_call_bytes, open_session
from helpers.rows import in_flight_count

from shmcancel import errors
from shmcancel.shm.registry import Registry

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

CONF = "examples/sdk/gunicorn.conf.py"
HEADERS = {"content-type": "application/json", "accept": "application/json, text/event-stream",
           "mcp-protocol-version": "2025-11-25"}
TOOL_SECONDS = 60  # far past gunicorn's graceful_timeout: only the stop ends it in time
STREAM_APP = "tests.apps.sdk_stream_app:app"  # the example's tools and add_stream_tools'
# log_then_sleep: its log notification is an event over the 64 KiB kept of one (TAIL_MAX)
BIG_LOG = {"size": 100_000, "seconds": TOOL_SECONDS}


def _stateful(short_tmp: Path, kind: str, workers: int, target: str | None = None,
              extra_args: tuple[str, ...] = ()) -> Gunicorn:
    """The SDK example (or the app ``target``), stateful, on ``workers`` uvicorn workers, its
    registry named after ``kind`` and unique, its workers' sockets under ``short_tmp``;
    ``extra_args`` go to gunicorn."""
    return Gunicorn(target, registry_name=f"{kind}-{uuid.uuid4().hex[:10]}", config=CONF,
                    workers=workers, worker_class="uvicorn_worker.UvicornWorker",
                    env={"SHMCANCEL_SDK_STATELESS": "0",
                         "SHMCANCEL_SDK_SOCKET_DIR": str(short_tmp / "socks")},
                    extra_args=extra_args)


def _json_app(short_tmp: Path, kind: str) -> Gunicorn:
    """The test app answering with JSON (``json_response=True``), stateful, on 2 uvicorn
    workers, as :func:`_stateful`."""
    return Gunicorn("tests.apps.sdk_json_app:app", registry_name=f"{kind}-{uuid.uuid4().hex[:10]}",
                    config=CONF, workers=2, worker_class="uvicorn_worker.UvicornWorker",
                    env={"SHMCANCEL_SDK_SOCKET_DIR": str(short_tmp / "socks")})


def test_a_sync_call_running_at_a_hup_is_stopped_with_its_worker(short_tmp: Path) -> None:
    with _stateful(short_tmp, "sdkstop", 1) as g, \
            Registry.attach(g.registry_name, readonly=True) as reg:
        [old] = g.worker_pids()
        session = open_session(g.url, HEADERS, "stop")
        done: dict[str, Any] = {}

        def call() -> None:
            try:
                with httpx.Client(timeout=TOOL_SECONDS + 30) as h:
                    done["r"] = h.post(g.url, headers=session, json={
                        "jsonrpc": "2.0", "id": 1, "method": "tools/call",
                        "params": {"name": "sleep_sync", "arguments": {"seconds": TOOL_SECONDS}}})
            except httpx.HTTPError as e:
                done["error"] = e

        t = threading.Thread(target=call, daemon=True)
        t.start()
        wait_until(lambda: in_flight_count(reg) == 1, time.monotonic() + 20,
                   what="the call in flight")
        g.signal(signal.SIGHUP)
        # the stop: within the tool's 10 ms poll and the worker's exit, not the 30 s of
        # gunicorn's graceful_timeout (nor the tool's 60 s)
        wait_until(lambda: not alive(old), time.monotonic() + 15,
                   what="the HUP'd worker's exit")
        assert in_flight_count(reg) == 0
        t.join(30)
        assert not t.is_alive()
        # whatever reached the client, it is not the tool's result (which never came)
        assert "slept" not in getattr(done.get("r"), "text", ""), done


def _worker_of(conn: socket.socket, pids: list[int]) -> int | None:
    """The worker whose socket is the server's end of this test's connection ``conn`` (read
    from ``/proc/net/tcp`` and the workers' descriptors)."""
    ours, theirs = conn.getsockname()[1], conn.getpeername()[1]
    inode = None
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            parts = line.split()
            # the server's end: its port, and its remote end is us (another process's client
            # may use that local port too, towards another server; a closed one's inode is 0)
            if (int(parts[1].split(":")[1], 16) == theirs
                    and int(parts[2].split(":")[1], 16) == ours and parts[9] != "0"):
                inode = parts[9]
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}") == f"socket:[{inode}]":
                        return pid
    return None


def _call_request(host: str, tool: str, session_id: str | None = None,
                  arguments: dict[str, Any] | None = None) -> bytes:
    """A raw HTTP/1.1 ``POST`` of ``tools/call`` ``tool`` (id 7, ``arguments``, by default
    :data:`TOOL_SECONDS`) to ``host`` (``name:port``), in session ``session_id`` if given."""
    if arguments is None:
        arguments = {"seconds": TOOL_SECONDS}
    body = json.dumps({"jsonrpc": "2.0", "id": 7, "method": "tools/call",
                       "params": {"name": tool, "arguments": arguments}}).encode()
    sid = f"Mcp-Session-Id: {session_id}\r\n" if session_id is not None else ""
    return (f"POST /mcp HTTP/1.1\r\nHost: {host}\r\n"
            f"Accept: application/json, text/event-stream\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n{sid}"
            "MCP-Protocol-Version: 2025-11-25\r\n\r\n").encode() + body


def _get_request(host: str, session_id: str) -> bytes:
    """A raw HTTP/1.1 ``GET`` of session ``session_id``'s event stream from ``host``."""
    return (f"GET /mcp HTTP/1.1\r\nHost: {host}\r\nAccept: text/event-stream\r\n"
            f"Mcp-Session-Id: {session_id}\r\n"
            "MCP-Protocol-Version: 2025-11-25\r\n\r\n").encode()


def _connect_past(owner: int, pids: list[int], host: str, port: int,
                  rcvbuf: int | None = None) -> tuple[socket.socket, int]:
    """A connection accepted by a worker other than ``owner`` (its receive buffer ``rcvbuf``
    bytes when given), and that worker's pid. The kernel hands a connection to whichever worker
    wakes first, and one can win every time (under load it did, 40 tries in a row): ``owner``
    is stopped (``SIGSTOP``) until another worker has accepted, so it cannot take it."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(10)
    os.kill(owner, signal.SIGSTOP)
    try:
        s.connect((host, port))
        carrier = wait_until(lambda: _worker_of(s, pids), time.monotonic() + 10,
                             what="another worker to accept the connection")
    except BaseException:
        s.close()
        raise
    finally:
        os.kill(owner, signal.SIGCONT)
    assert carrier != owner
    return s, carrier


def test_a_worker_stopped_alone_ends_the_streams_it_forwards(short_tmp: Path) -> None:
    """A worker carrying a GET stream of a session another worker holds (forwarded there:
    the official client opens one after initializing, so most sessions of a server with
    several workers) could not finish uvicorn's drain when stopped alone (``TERM``,
    ``max_requests``): the stream never ends, and the worker stayed until gunicorn's
    ``timeout`` (90 s here) killed it, its client's stream cut. It ends the forwarded stream
    as it begins to exit, as sse_starlette ends the SDK's own, and exits at once."""
    with _stateful(short_tmp, "sdkfwd", 2) as g:
        pids = [int(p) for p in g.worker_pids()]
        session = open_session(g.url, HEADERS, "fwd")
        owner = int(session["mcp-session-id"].split("x", 1)[0], 16)
        assert owner in pids
        host, port = g.url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
        head = _get_request(f"{host}:{port}", session["mcp-session-id"])
        s, carrier = _connect_past(owner, pids, host, int(port))
        try:
            s.sendall(head)
            got = s.recv(65536)
            assert got.startswith(b"HTTP/1.1 200"), got
            t0 = time.monotonic()
            os.kill(carrier, signal.SIGTERM)
            s.settimeout(15)
            while s.recv(65536):  # the stream ends (chunked end, then the close)
                pass
            wait_until(lambda: not alive(carrier), time.monotonic() + 15,
                       what="the stopped worker's exit")
            assert time.monotonic() - t0 < 15  # not gunicorn's timeout (90 s)
            # its replacement booted: a TERM it gets before that is lost (the stop waits 30 s)
            g.wait_workers(2, time.monotonic() + 20)
        finally:
            s.close()


def test_a_worker_exiting_answers_forwarded_requests_404() -> None:
    """While a session's worker drains, a request forwarded to it got sse_starlette's empty
    event stream (its client's call "ended without a response"), not the 404 that tells the
    client its session is gone with the worker: its socket server now answers 404."""
    import asyncio

    from shmcancel.sdk._routing import Router

    class Exiting:
        should_exit = True

        def handle_exit(self, sig: int, frame: Any) -> None:  # pragma: no cover
            pass

    served: list[Any] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:  # pragma: no cover
        served.append(scope)

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:  # pragma: no cover
        return {"type": "http.request", "body": b"", "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/mcp", "headers": []}
    old = signal.signal(signal.SIGTERM, Exiting().handle_exit)
    try:
        asyncio.run(Router(app)._internal(scope, receive, send))
    finally:
        signal.signal(signal.SIGTERM, old)
    assert not served and sent[0]["status"] == 404
    asyncio.run(Router(app)._internal(dict(scope), receive, send))  # not exiting: served
    assert len(served) == 1


@pytest.mark.parametrize("last", ["a big answer", "a big log"])
def test_a_stream_ended_at_the_exit_after_a_big_event(last: str) -> None:
    """The SDK ends a call's event stream while the worker exits, its last event longer than
    the 64 KiB kept of one (``TAIL_MAX``), sent in chunks: the call's answer (a large result
    just before the stop) gets no second answer; a log notification is not taken for the
    answer (the stream ended with none): the call's ``-32800`` follows it."""
    import asyncio

    from shmcancel.sdk._asgi import _ending_at_exit
    from shmcancel.sdk._calls import Exchange

    class Exiting:
        should_exit = True

        def handle_exit(self, sig: int, frame: Any) -> None:  # pragma: no cover
            pass

    big = "x" * 100_000
    msg = ({"jsonrpc": "2.0", "id": 7, "result": {"content": [{"type": "text", "text": big}]}}
           if last == "a big answer" else
           {"jsonrpc": "2.0", "method": "notifications/message",
            "params": {"level": "info", "data": big}})
    event = b"event: message\r\ndata: " + json.dumps(msg).encode() + b"\r\n\r\n"
    body = json.dumps({"jsonrpc": "2.0", "id": 7, "method": "tools/call",
                       "params": {"name": "t", "arguments": {}}}).encode()
    sent: list[Any] = []

    async def send(message: Any) -> None:
        sent.append(message)

    async def main() -> None:
        tx = _ending_at_exit(send, Exchange(), body)
        await tx({"type": "http.response.start", "status": 200,
                  "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
        for i in range(0, len(event), 4096):
            await tx({"type": "http.response.body", "body": event[i:i + 4096],
                      "more_body": True})
        await tx({"type": "http.response.body", "body": b"", "more_body": False})

    old = signal.signal(signal.SIGTERM, Exiting().handle_exit)
    try:
        asyncio.run(main())
    finally:
        signal.signal(signal.SIGTERM, old)
    stream = b"".join(m.get("body", b"") for m in sent[1:])
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    answers = [m for m in _events(stream) if m.get("id") == 7]
    assert len(answers) == 1, stream[-300:]
    if last == "a big log":
        assert answers[0]["error"]["code"] == errors.REQUEST_CANCELLED, answers


@pytest.mark.parametrize("tool", ["sleep", "sleep_sync"])
def test_a_json_call_forwarded_to_a_worker_stopped_alone_gets_its_error(
        short_tmp: Path, tool: str) -> None:
    """A call with a JSON response (``json_response=True``), forwarded to its session's worker,
    which is stopped alone (``TERM``, ``max_requests``) while it runs: the worker stops the call
    at its lifespan shutdown, but tore the SDK's session manager down before the stopped call
    had answered, and its client got the SDK's HTTP 500 ``-32603`` ("Session terminated before
    the request completed"). It gets the call's own JSON-RPC error, with its id."""
    with _json_app(short_tmp, "sdkjson") as g, \
            Registry.attach(g.registry_name, readonly=True) as reg:
        pids = [int(p) for p in g.worker_pids()]
        session = open_session(g.url, HEADERS, "json")
        owner = int(session["mcp-session-id"].split("x", 1)[0], 16)
        assert owner in pids
        host, port = g.url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
        request = _call_request(f"{host}:{port}", tool, session["mcp-session-id"])
        s, _ = _connect_past(owner, pids, host, int(port))
        try:
            resp, t0 = _stopped_answer(s, reg, request, owner)
            text = resp.read()
            took = time.monotonic() - t0
        finally:
            s.close()
        assert resp.status == 200, (resp.status, text)
        msg = json.loads(text)
        assert msg["id"] == 7 and msg["error"]["code"] == errors.REQUEST_CANCELLED, msg
        assert msg["error"]["data"] == {"reason": "the worker is stopping"}, msg
        assert took < 10, took  # not gunicorn's timeout (90 s), nor the tool's 60 s
        wait_until(lambda: not alive(owner), time.monotonic() + 15,
                   what="the stopped worker's exit")
        assert in_flight_count(reg) == 0
        # its replacement booted: a TERM it gets before that is lost (the stop waits 30 s)
        g.wait_workers(2, time.monotonic() + 20)


CLEANUP = 1.0  # seconds sleep_then_clean_up runs on once cancelled: past the exit's start


def test_a_cancelled_json_call_still_cleaning_up_at_the_stop_gets_its_error(
        short_tmp: Path) -> None:
    """A forwarded call with a JSON response, cancelled (``notifications/cancelled``) just
    before its session's worker is stopped alone, its tool still running its cleanup: the
    poller had forgotten it once its cancel scope was cancelled, so the shutdown waited for
    no answer and tore the SDK's session manager down at once: its client got HTTP 500. It
    gets its ``-32800``, with its id."""
    with _json_app(short_tmp, "sdkjcc") as g, \
            Registry.attach(g.registry_name, readonly=True) as reg:
        pids = [int(p) for p in g.worker_pids()]
        session = open_session(g.url, HEADERS, "jcc")
        owner = int(session["mcp-session-id"].split("x", 1)[0], 16)
        host, port = g.url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
        request = _call_request(f"{host}:{port}", "sleep_then_clean_up",
                                session["mcp-session-id"],
                                {"seconds": TOOL_SECONDS, "cleanup": CLEANUP})
        s, _ = _connect_past(owner, pids, host, int(port))
        try:
            s.sendall(request)
            wait_until(lambda: in_flight_count(reg) == 1, time.monotonic() + 20,
                       what="the call in flight")
            with httpx.Client(timeout=10) as c:
                r = c.post(g.url, headers=session, json={
                    "jsonrpc": "2.0", "method": "notifications/cancelled",
                    "params": {"requestId": 7, "reason": "user stop"}})
            assert r.status_code == 202, r.text
            termed_at = time.monotonic()
            os.kill(owner, signal.SIGTERM)
            s.settimeout(30)
            resp = http.client.HTTPResponse(s)
            resp.begin()
            text = resp.read()
        finally:
            s.close()
        assert resp.status == 200, (resp.status, text)
        msg = json.loads(text)
        assert msg["id"] == 7 and msg["error"]["code"] == errors.REQUEST_CANCELLED, msg
        assert time.monotonic() - termed_at < 10
        wait_until(lambda: not alive(owner), termed_at + 10, what="the stopped worker's exit")
        assert in_flight_count(reg) == 0
        g.wait_workers(2, time.monotonic() + 20)


def _events(stream: bytes) -> list[dict[str, Any]]:
    """The JSON-RPC messages of an event stream's ``data`` lines, in order."""
    text = stream.replace(b"\r\n", b"\n").decode()
    return [json.loads(line[5:]) for line in text.split("\n") if line.startswith("data:")
            and line[5:].strip()]


def _stopped_with_its_error(g: Gunicorn, reg: Registry, stream: bytes, termed_at: float,
                            worker: int, workers: int) -> None:
    """The call (id 7) whose worker was ``TERM``ed at ``termed_at`` (monotonic seconds) got one
    answer in ``stream``, its ``-32800`` "the worker is stopping", within 10 s (not gunicorn's
    ``timeout``, nor the tool's 60 s); the worker exited within 10 s (well before
    ``graceful_timeout``, 30 s), leaving no row, and its replacement booted (a ``TERM`` it gets
    before that is lost: the stop waits 30 s)."""
    answers = [m for m in _events(stream) if m.get("id") == 7]
    assert len(answers) == 1, stream  # one answer, never a second one
    [msg] = answers
    assert msg["error"]["code"] == errors.REQUEST_CANCELLED, msg
    assert msg["error"]["data"] == {"reason": "the worker is stopping"}, msg
    assert time.monotonic() - termed_at < 10
    wait_until(lambda: not alive(worker), termed_at + 10, what="the stopped worker's exit")
    assert in_flight_count(reg) == 0
    g.wait_workers(workers, time.monotonic() + 20)


@pytest.mark.parametrize("forwarded", [False, True], ids=["direct", "forwarded"])
@pytest.mark.parametrize("tool", ["sleep", "sleep_sync", "log_then_sleep"])
def test_an_sse_call_on_a_worker_stopped_alone_gets_its_error(
        short_tmp: Path, tool: str, forwarded: bool) -> None:
    """A stateful call answered as an event stream, running in its session's worker when that
    worker is stopped alone (``TERM``, ``max_requests``), accepted there or by another worker
    that forwards it: sse_starlette ended the stream as the exit began and the call was stopped
    later, at the lifespan shutdown, its answer going nowhere: the client's stream ended with
    no response to its request, and an official client waits for one until its own timeout
    (60 s for the TS SDK's). The stream ends with the call's own JSON-RPC error, its only
    answer; also when its last event so far is longer than the bytes kept of one (a 100 KB
    log notification: it was taken for the answer)."""
    big = tool == "log_then_sleep"
    with _stateful(short_tmp, "sdksse", 2, target=STREAM_APP if big else None) as g, \
            Registry.attach(g.registry_name, readonly=True) as reg:
        pids = [int(p) for p in g.worker_pids()]
        session = open_session(g.url, HEADERS, "sse")
        owner = int(session["mcp-session-id"].split("x", 1)[0], 16)
        assert owner in pids
        [other] = [p for p in pids if p != owner]
        host, port = g.url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
        request = _call_request(f"{host}:{port}", tool, session["mcp-session-id"],
                                BIG_LOG if big else None)
        # The session's GET stream, held by its worker as an official client opens it: the
        # worker's drain waits for it until sse_starlette ends every stream at once (without
        # it, a worker holding no connection of its own ran its lifespan shutdown at once, and
        # the stopped call's answer could beat the end of its forwarded stream).
        get = _get_request(f"{host}:{port}", session["mcp-session-id"])
        g_sock, _ = _connect_past(other, pids, host, int(port))
        # forwarded: accepted by the other worker; direct: by the owner (the other stopped)
        try:
            g_sock.sendall(get)
            assert g_sock.recv(65536).startswith(b"HTTP/1.1 200")
            s, carrier = _connect_past(owner if forwarded else other, pids, host, int(port))
        except BaseException:
            g_sock.close()
            raise
        assert carrier == (other if forwarded else owner)
        try:
            stream, termed_at = _stopped_stream(s, reg, request, owner,
                                                after=b"L" * 1000 if big else None)
        finally:
            s.close()
            g_sock.close()
        _stopped_with_its_error(g, reg, stream, termed_at, owner, 2)


STATELESS_SSE_APP = "tests.apps.sdk_stateless_sse_app:app"


def _stopped_answer(s: socket.socket, reg: Registry, request: bytes,
                    worker: int) -> tuple[http.client.HTTPResponse, float]:
    """Send ``request`` (raw HTTP/1.1) on ``s``, ``TERM`` ``worker`` once the call is in flight,
    and read the response's head: the response, and when the ``TERM`` was sent
    (``time.monotonic()``)."""
    s.sendall(request)
    wait_until(lambda: in_flight_count(reg) == 1, time.monotonic() + 20,
               what="the call in flight")
    termed_at = time.monotonic()
    os.kill(worker, signal.SIGTERM)
    s.settimeout(30)
    resp = http.client.HTTPResponse(s)
    resp.begin()
    return resp, termed_at


def _stopped_stream(s: socket.socket, reg: Registry, request: bytes, worker: int,
                    after: bytes | None = None) -> tuple[bytes, float]:
    """:func:`_stopped_answer`, an event stream read to its end: the stream, and when the
    ``TERM`` was sent; with ``after``, sent once a line of the stream holds it."""
    if after is None:
        resp, termed_at = _stopped_answer(s, reg, request, worker)
        head = b""
    else:
        s.sendall(request)
        s.settimeout(30)
        resp = http.client.HTTPResponse(s)
        resp.begin()
        head = line = b""
        while after not in line:
            line = resp.readline()
            assert line, head
            head += line
        termed_at = time.monotonic()
        os.kill(worker, signal.SIGTERM)
    assert resp.status == 200, (resp.status, resp.read())
    assert resp.getheader("content-type", "").startswith("text/event-stream")
    # the whole stream: a clean end (IncompleteRead otherwise)
    return head + resp.read(), termed_at


def _stopped_stream_alone(g: Gunicorn, reg: Registry, request: bytes,
                          after: bytes | None = None) -> tuple[bytes, float, int]:
    """:func:`_stopped_stream` on the server's only worker: also that worker's pid."""
    [worker] = [int(p) for p in g.worker_pids()]
    host, port = g.url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        return (*_stopped_stream(s, reg, request, worker, after), worker)


@pytest.mark.parametrize("tool", ["sleep", "sleep_sync", "log_then_sleep"])
def test_a_stateless_sse_call_on_a_stopped_worker_gets_its_error(tool: str) -> None:
    """A stateless server's call answered as an event stream (``stateless_http=True`` without
    ``json_response``), running when its worker is stopped (``TERM``, ``max_requests``): as a
    stateful one's, its stream was ended by sse_starlette as the exit began and the call was
    stopped only at the lifespan shutdown, its client's stream ending with no answer. It ends
    with the call's own JSON-RPC error, its only answer, and the worker exits at once."""
    name = f"sdkssl-{uuid.uuid4().hex[:10]}"
    with Gunicorn(STATELESS_SSE_APP, registry_name=name, config=CONF, workers=1,
                  worker_class="uvicorn_worker.UvicornWorker") as g, \
            Registry.attach(name, readonly=True) as reg:
        host = g.url.split("//", 1)[1].split("/", 1)[0]
        big = tool == "log_then_sleep"  # its last event over the 64 KiB kept of one
        request = _call_request(host, tool, None, BIG_LOG if big else None)
        stream, termed_at, worker = _stopped_stream_alone(g, reg, request,
                                                          b"L" * 1000 if big else None)
        _stopped_with_its_error(g, reg, stream, termed_at, worker, 1)


FLOOD = {"seconds": TOOL_SECONDS, "size": 100_000}  # 10 MB/s of log notifications
SMALL_RCVBUF = 4096  # bytes: the client's receive buffer, full at once


def _server_send_queue(conn: socket.socket) -> int | None:
    """The bytes queued unsent on the server's end of this test's connection ``conn`` (the
    ``tx_queue`` of ``/proc/net/tcp``), or None when not found."""
    ours, theirs = conn.getsockname()[1], conn.getpeername()[1]
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            parts = line.split()
            if (int(parts[1].split(":")[1], 16) == theirs
                    and int(parts[2].split(":")[1], 16) == ours and parts[9] != "0"):
                return int(parts[4].split(":")[0], 16)
    return None


def _wait_stalled(conn: socket.socket) -> None:
    """Return once the server's end of ``conn`` has bytes queued that stay unsent (the client
    reads nothing): every buffer up to the server's is full, its sends wait for the client."""
    seen: list[int | None] = []

    def stalled() -> bool:
        seen.append(_server_send_queue(conn))
        return len(seen) > 5 and bool(seen[-1]) and len(set(seen[-5:])) == 1

    wait_until(stalled, time.monotonic() + 20, what="the server's sends to wait for the client")


def _slow_read_stream(connect: Any, reg: Registry, request: bytes,
                      worker: int) -> tuple[bytes, float]:
    """Send ``request`` on the connection ``connect(rcvbuf)`` makes (a ``socket`` with the
    receive buffer given, connected), read nothing until the server's sends wait for the client
    (the call floods its stream), ``TERM`` ``worker``, still read nothing until the exit
    stopped the call (its row gone: the exit cancelled the stream's writer in its send), then
    read the stream to its end (a clean end: IncompleteRead otherwise): the stream, and when
    the ``TERM`` was sent."""
    s = connect(SMALL_RCVBUF)
    try:
        s.sendall(request)
        _wait_stalled(s)
        termed_at = time.monotonic()
        os.kill(worker, signal.SIGTERM)
        wait_until(lambda: in_flight_count(reg) == 0, time.monotonic() + 10,
                   what="the exit to stop the call")
        s.settimeout(30)
        resp = http.client.HTTPResponse(s)
        resp.begin()
        assert resp.status == 200, resp.status
        return resp.read(), termed_at
    finally:
        s.close()


def _small_rcvbuf_socket(rcvbuf: int) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    return s


@pytest.mark.parametrize("forwarded", [False, True], ids=["direct", "forwarded"])
def test_a_stream_stalled_by_a_slow_client_at_the_stop_gets_its_error(
        short_tmp: Path, forwarded: bool) -> None:
    """A call's event stream whose client reads slowly (its events fill every buffer on the
    way) when its worker is stopped alone: the exit cancelled sse_starlette in a send waiting
    for the client, after which it sends no end: the stream was cut (no chunked end) with no
    answer, forwarded or not. It ends with the call's ``-32800``, its only answer, once the
    client reads."""
    with _stateful(short_tmp, "sdkslow", 2, target=STREAM_APP) as g, \
            Registry.attach(g.registry_name, readonly=True) as reg:
        pids = [int(p) for p in g.worker_pids()]
        session = open_session(g.url, HEADERS, "slow")
        owner = int(session["mcp-session-id"].split("x", 1)[0], 16)
        [other] = [p for p in pids if p != owner]
        host, port = g.url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
        request = _call_request(f"{host}:{port}", "flood", session["mcp-session-id"], FLOOD)

        def connect(rcvbuf: int) -> socket.socket:
            s, carrier = _connect_past(owner if forwarded else other, pids, host, int(port),
                                       rcvbuf)
            assert carrier == (other if forwarded else owner)
            return s

        stream, termed_at = _slow_read_stream(connect, reg, request, owner)
        _stopped_with_its_error(g, reg, stream, termed_at, owner, 2)


def test_an_answer_held_by_a_slow_client_at_the_stop_is_the_streams_answer(
        short_tmp: Path) -> None:
    """A call that finished, its answer's send waiting for a slow client (an 8 MB event before
    it fills every buffer) when its worker is stopped alone: the exit cancelled that send,
    which wrote nothing, and the stream was ended with ``-32800`` "the worker is stopping",
    telling the client a call that ran to its end did not (it may retry a tool that is not
    idempotent). The answer in hand is written first, and is the stream's only answer."""
    with _stateful(short_tmp, "sdkheld", 2, target=STREAM_APP) as g, \
            Registry.attach(g.registry_name, readonly=True) as reg:
        session = open_session(g.url, HEADERS, "held")
        owner = int(session["mcp-session-id"].split("x", 1)[0], 16)
        host, port = g.url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
        request = _call_request(f"{host}:{port}", "big_then_done", session["mcp-session-id"],
                                {"size": 8_000_000})
        pids = [int(p) for p in g.worker_pids()]
        [other] = [p for p in pids if p != owner]
        s, _ = _connect_past(other, pids, host, int(port), SMALL_RCVBUF)  # to the owner
        try:
            s.sendall(request)
            wait_until(lambda: in_flight_count(reg) == 0, time.monotonic() + 20,
                       what="the call to finish")  # its answer's send waits for the client
            _wait_stalled(s)
            termed_at = time.monotonic()
            os.kill(owner, signal.SIGTERM)
            # read nothing until its exit began (the send was cancelled at the signal; uvicorn
            # then waits for this connection)
            wait_until(lambda: f"[{owner}] [INFO] Waiting for connections to close" in g.log()
                       or None, time.monotonic() + 10, what="the owner's exit to begin")
            s.settimeout(30)
            resp = http.client.HTTPResponse(s)
            resp.begin()
            assert resp.status == 200, resp.status
            stream = resp.read()
        finally:
            s.close()
        answers = [m for m in _events(stream) if m.get("id") == 7]
        assert len(answers) == 1, stream[-500:]
        assert answers[0].get("result", {}).get("content", [{}])[0].get("text") == "done", \
            answers[0]
        wait_until(lambda: not alive(owner), termed_at + 10, what="the stopped worker's exit")
        g.wait_workers(2, time.monotonic() + 20)


def test_a_stateless_stream_stalled_by_a_slow_client_at_the_stop_gets_its_error() -> None:
    """:func:`test_a_stream_stalled_by_a_slow_client_at_the_stop_gets_its_error` on a
    stateless server answering with event streams."""
    name = f"sdksls-{uuid.uuid4().hex[:10]}"
    with Gunicorn(STATELESS_SSE_APP, registry_name=name, config=CONF, workers=1,
                  worker_class="uvicorn_worker.UvicornWorker") as g, \
            Registry.attach(name, readonly=True) as reg:
        [worker] = [int(p) for p in g.worker_pids()]
        host, port = g.url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)

        def connect(rcvbuf: int) -> socket.socket:
            s = _small_rcvbuf_socket(rcvbuf)
            s.connect((host, int(port)))
            return s

        stream, termed_at = _slow_read_stream(
            connect, reg, _call_request(f"{host}:{port}", "flood", None, FLOOD), worker)
        _stopped_with_its_error(g, reg, stream, termed_at, worker, 1)


MODERN_SSE_AFTER = 15.0  # seconds: the SDK (mcp 2.3.0) commits a silent 2026-07-28 call to SSE


def test_a_modern_sse_call_on_a_stopping_worker_keeps_its_one_answer() -> None:
    """A 2026-07-28 call on a server with SSE responses is answered as an event stream the SDK
    writes itself (no sse_starlette: a silent call's, once it ran past 15 s), which the exit does
    not end: its worker drains it, and it ends with the call's answer while the worker exits.
    That end is not taken for one the exit cut short: no second answer follows."""
    name = f"sdkmod-{uuid.uuid4().hex[:10]}"
    seconds = MODERN_SSE_AFTER + 2
    with Gunicorn(STATELESS_SSE_APP, registry_name=name, config=CONF, workers=1,
                  worker_class="uvicorn_worker.UvicornWorker") as g, \
            Registry.attach(name, readonly=True) as reg:
        host = g.url.split("//", 1)[1].split("/", 1)[0]
        stream, termed_at, worker = _stopped_stream_alone(
            g, reg, modern_call_bytes("sleep", {"seconds": seconds}, 7, host=host))
        took = time.monotonic() - termed_at
        answers = [m for m in _events(stream) if m.get("id") == 7]
        assert len(answers) == 1, stream  # its answer, and nothing after it
        assert answers[0]["result"]["structuredContent"] == {"result": f"slept {seconds:g} s"}
        assert took < seconds + 10, took
        wait_until(lambda: not alive(worker), time.monotonic() + 15,
                   what="the stopped worker's exit")
        assert in_flight_count(reg) == 0
        g.wait_workers(1, time.monotonic() + 20)


# uvicorn counts a request once its response is complete (never the running call's): the
# session's 2, then 4 more
MAX_REQUESTS = 6


def test_an_sse_call_on_a_worker_at_its_request_limit_gets_its_error(short_tmp: Path) -> None:
    """A worker reaching gunicorn's ``max_requests`` while an SSE call runs in it: uvicorn left
    its main loop without setting ``should_exit``, so nothing saw an exit: the stream was not
    ended, the call ran on and the drain waited for it until gunicorn's ``timeout`` (90 s)
    killed the worker, the stream cut with no answer and the call's row left until reaped. The
    limit is an exit as a ``TERM`` is: the stream ends with the call's ``-32800``, the worker
    exits at once and no row stays."""
    with _stateful(short_tmp, "sdkmax", 1,
                   extra_args=("--max-requests", str(MAX_REQUESTS))) as g, \
            Registry.attach(g.registry_name, readonly=True) as reg:
        [worker] = [int(p) for p in g.worker_pids()]
        session = open_session(g.url, HEADERS, "max")  # requests 1 and 2
        host = g.url.split("//", 1)[1].split("/", 1)[0]
        h, port = host.rsplit(":", 1)
        with socket.create_connection((h, int(port)), timeout=10) as s:
            s.sendall(_call_request(host, "sleep", session["mcp-session-id"]))
            wait_until(lambda: in_flight_count(reg) == 1, time.monotonic() + 20,
                       what="the call in flight")
            with httpx.Client(timeout=10) as c:
                for i in range(MAX_REQUESTS - 2):
                    r = c.post(g.url, headers=session, json={
                        "jsonrpc": "2.0", "id": 100 + i, "method": "tools/list"})
                    assert r.status_code == 200, r.text
            limit_at = time.monotonic()
            s.settimeout(30)
            resp = http.client.HTTPResponse(s)
            resp.begin()
            assert resp.status == 200
            stream = resp.read()
        _stopped_with_its_error(g, reg, stream, limit_at, worker, 1)


def test_a_worker_stopped_alone_ends_a_busy_stream_it_forwards(short_tmp: Path) -> None:
    """A worker forwarding a call's event stream that gets an event every 0.2 s (a tool's
    progress), ``TERM``ed alone: it looked for its exit only when no event had come for 0.25 s,
    so it never ended that stream: the call's stream went on until the call ended, and the
    worker with it. It ends with the request's ``-32000`` at the next event, and the worker
    exits at once."""
    seconds = 30  # the tool's, far past the bound below
    with _stateful(short_tmp, "sdkbusy", 2, target=STREAM_APP) as g:
        pids = [int(p) for p in g.worker_pids()]
        session = open_session(g.url, HEADERS, "busy")
        owner = int(session["mcp-session-id"].split("x", 1)[0], 16)
        host, port = g.url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
        s, carrier = _connect_past(owner, pids, host, int(port))
        try:
            s.sendall(_call_request(f"{host}:{port}", "progress_sleep",
                                    session["mcp-session-id"], {"seconds": seconds}))
            s.settimeout(30)
            resp = http.client.HTTPResponse(s)
            resp.begin()
            assert resp.status == 200
            head = b""
            while b"step 2" not in head:  # forwarded events are flowing
                line = resp.readline()
                assert line, head
                head += line
            termed_at = time.monotonic()
            os.kill(carrier, signal.SIGTERM)
            stream = head + resp.read()  # a clean end (IncompleteRead otherwise)
            took = time.monotonic() - termed_at
        finally:
            s.close()
        answers = [m for m in _events(stream) if m.get("id") == 7]
        assert len(answers) == 1, stream[-400:]
        assert answers[0]["error"]["code"] == errors.SERVER_ERROR, answers
        assert took < 10, took
        wait_until(lambda: not alive(carrier), termed_at + 10, what="the stopped worker's exit")
        g.wait_workers(2, time.monotonic() + 20)


@pytest.mark.parametrize("cut", ["in its data", "after its data line"])
def test_a_stream_ended_inside_an_event(cut: str) -> None:
    """An event stream ended early inside an event (a forward whose owner went mid-event) was
    left cut: no end, no answer. The event is ended first: a cut answer (unparseable) under an
    event type clients ignore, then the request's error; an answer cut only before its blank
    line as it is (whole), nothing after it."""
    import asyncio

    from shmcancel.sdk._routing import EventTail, end_event_stream

    answer = json.dumps({"jsonrpc": "2.0", "id": 7, "result": {"content": []}}).encode()
    head = b"event: message\r\ndata: " + answer + b"\r\n"
    before = b"event: message\r\ndata: {\"jsonrpc\": \"2.0\", \"method\": \"x\"}\r\n\r\n"
    sent_so_far = before + (head[:len(head) // 2] if cut == "in its data" else head)
    body = json.dumps({"jsonrpc": "2.0", "id": 7, "method": "tools/call",
                       "params": {"name": "t", "arguments": {}}}).encode()
    tail = EventTail()
    tail.feed(sent_so_far)
    sent: list[Any] = []

    async def send(message: Any) -> None:
        sent.append(message)

    asyncio.run(end_event_stream(send, tail, body, {"code": -32000, "message": "gone"}))
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    stream = sent_so_far + b"".join(m["body"] for m in sent)
    # as an SSE client reads it: events end at a blank line; only "message" events count
    messages = []
    for event in stream.replace(b"\r\n", b"\n").split(b"\n\n"):
        lines = event.split(b"\n")
        kind = [ln[6:].strip() for ln in lines if ln.startswith(b"event:")]
        data = b"\n".join(ln[5:].strip() for ln in lines if ln.startswith(b"data:"))
        if data and (not kind or kind[-1] == b"message"):
            messages.append(json.loads(data))
    answers = [m for m in messages if m.get("id") == 7]
    assert len(answers) == 1, stream
    if cut == "in its data":
        assert answers[0]["error"]["code"] == -32000
    else:
        assert answers[0]["result"] == {"content": []}
