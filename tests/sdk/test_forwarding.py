"""Forwarding a session's request to the worker holding it (``shmcancel.sdk._routing.Router``),
over real Unix sockets with real uvicorn servers in one process: a worker that forwards many
long-lived streams still forwards the next request at once, and an owner that dies during a
forward is a 503 with ``Retry-After`` (or the end of its stream), never a 500."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from pathlib import Path
from typing import Any

import httpx
import pytest

from shmcancel.sdk import _routing
from shmcancel.sdk._routing import Router

STREAMS = 120  # more than httpx's default pool of 100 connections per client


def _scope(method: str) -> dict[str, Any]:
    return {"type": "http", "method": method, "path": "/mcp", "raw_path": b"/mcp",
            "query_string": b"", "headers": [(b"host", b"127.0.0.1")],
            "client": ("127.0.0.1", 1234)}


class _Owner:
    """An owner worker's app: a GET is a stream that stays open until released; a POST is
    answered 200 at once, or held for as long as ``stall`` is set."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.stall = asyncio.Event()
        self.streams = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        if scope["method"] == "GET":
            self.streams += 1
            await send({"type": "http.response.body", "body": b": open\n\n", "more_body": True})
            await self.release.wait()
        elif self.stall.is_set():
            await self.release.wait()
        await send({"type": "http.response.body", "body": b"ok", "more_body": False})


async def _forward(router: Router, token: str, method: str, gone: asyncio.Event,
                   body: bytes = b"{}") -> list[Any]:
    sent: list[Any] = []

    async def receive() -> dict[str, Any]:
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Any) -> None:
        sent.append(message)

    await router.forward(token, _scope(method), body if method == "POST" else None, receive,
                         send)
    return sent


def test_a_forward_after_many_held_streams_is_served_at_once(
        short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHMCANCEL_SDK_SOCKET_DIR", str(short_tmp))

    async def main() -> None:
        app = _Owner()
        owner, here = Router(app), Router(app)
        await owner.ensure()
        gone = asyncio.Event()
        streams = [asyncio.create_task(_forward(here, owner.token, "GET", gone))
                   for _ in range(STREAMS)]
        try:
            for _ in range(2000):
                if app.streams >= STREAMS:
                    break
                await asyncio.sleep(0.01)
            assert app.streams == STREAMS, (app.streams, [t for t in streams if t.done()][:2])
            async with asyncio.timeout(5):  # httpx's default pool: 10 s, then PoolTimeout
                sent = await _forward(here, owner.token, "POST", gone)
            assert sent[0]["status"] == 200
            assert b"".join(m.get("body", b"") for m in sent[1:]) == b"ok"
        finally:
            app.release.set()
            gone.set()
            await asyncio.gather(*streams, return_exceptions=True)
            owner.close()

    asyncio.run(main())


CALL = b'{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"sleep"}}'
EVENT = b'event: message\ndata: {"jsonrpc":"2.0","method":"notifications/progress"}\n\n'
CRLF_EVENT = EVENT.replace(b"\n", b"\r\n")  # as the SDK's server (sse-starlette) ends lines
ANSWER = b'event: message\r\ndata: {"jsonrpc":"2.0","id":7,"result":{}}\r\n\r\n'
BIG = "L" * 100_000  # more than the TAIL_MAX bytes kept of an event
# as the SDK writes them (pydantic's field order): a log notification, a request of the
# server's, the call's answer, each over TAIL_MAX
BIG_EVENTS = {
    "a big notification": {"jsonrpc": "2.0", "method": "notifications/message",
                           "params": {"level": "info", "data": BIG}},
    "a big request": {"jsonrpc": "2.0", "id": 0, "method": "sampling/createMessage",
                      "params": {"messages": [BIG], "maxTokens": 1}},
    "a big answer": {"jsonrpc": "2.0", "id": 7,
                     "result": {"content": [{"type": "text", "text": BIG}]}}}


def _event(msg: dict[str, Any]) -> bytes:
    return b"event: message\r\ndata: " + json.dumps(msg, separators=(",", ":")).encode() \
        + b"\r\n\r\n"


@pytest.mark.parametrize("dies", ["before its answer", "mid-body", "between events",
                                  "between CRLF events", "mid-event", "mid-CRLF-event",
                                  "after its answer", "between events, a big notification last",
                                  "between events, a big request last", "after a big answer",
                                  "mid-big-event"])
def test_an_owner_that_dies_during_a_forward(short_tmp: Path, monkeypatch: pytest.MonkeyPatch,
                                            dies: str) -> None:
    """The owner's socket closes as a killed worker's does. Before the response head the
    forwarding worker answers 503 with ``Retry-After`` (nothing for the server to turn into a
    500). After it, an event stream stopped between two events gets the call's JSON-RPC error
    as one more event and ends (a reviewer's SDK client got a dropped stream, and the server
    logged two tracebacks per forward); one stopped inside an event too, that event ended
    first under an event type clients ignore (its data cut, or a big answer's perhaps: it was
    left cut, with no answer); any other answer is left incomplete, so the server
    drops the client's connection as the owner dropped its own (a clean end would pass a body,
    or an event, cut short off as whole). An event longer than the bytes kept of it is read
    from its head: a big notification last got no error (taken for the answer). Never raises
    into the server."""
    monkeypatch.setenv("SHMCANCEL_SDK_SOCKET_DIR", str(short_tmp))
    token = "1x000000000000"
    sse = dies not in ("before its answer", "mid-body")
    sent_by_owner = {"mid-body": b"hello", "between events": EVENT,
                     "between CRLF events": CRLF_EVENT + b": ping\r\n\r\n" + CRLF_EVENT,
                     "mid-event": EVENT + EVENT[:30],
                     "mid-CRLF-event": CRLF_EVENT + CRLF_EVENT[:-2],  # its blank line cut
                     "after its answer": CRLF_EVENT + ANSWER,
                     "mid-big-event": _event(BIG_EVENTS["a big answer"])[:-3],
                     **{f"between events, {k} last": CRLF_EVENT + _event(v)
                        for k, v in BIG_EVENTS.items() if k != "a big answer"},
                     "after a big answer": CRLF_EVENT + _event(BIG_EVENTS["a big answer"]),
                     }.get(dies)

    async def main() -> list[Any]:
        async def owner(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            if sent_by_owner is not None:
                ctype = b"content-type: text/event-stream\r\n" if sse else b""
                writer.write(b"HTTP/1.1 200 OK\r\n" + ctype + b"transfer-encoding: chunked\r\n"
                             b"\r\n" + f"{len(sent_by_owner):x}\r\n".encode() + sent_by_owner
                             + b"\r\n")
                await writer.drain()
            writer.transport.abort()

        path = os.path.join(_routing.server_dir(), f"{token}.sock")  # where forwards look
        server = await asyncio.start_unix_server(owner, path=path)
        gone = asyncio.Event()
        try:
            async with asyncio.timeout(15):
                return await _forward(Router(_Owner()), token, "POST", gone, CALL)
        finally:
            gone.set()
            server.close()

    sent = asyncio.run(main())
    head = sent[0]
    if dies == "before its answer":
        assert head["status"] == 503 and (b"retry-after", b"1") in head["headers"]
        assert b"-32000" in sent[-1]["body"]
        return
    assert head["status"] == 200
    bodies = b"".join(m.get("body", b"") for m in sent[1:])
    assert bodies.startswith(sent_by_owner)
    if sse:
        assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
        last = bodies[len(sent_by_owner):]
        if dies.startswith("after"):  # answered: ended as it stood, no second answer
            assert last == b""
            return
        if dies.startswith("mid"):  # the cut event is ended first, as no message
            void, last = last.split(_routing.VOID_EVENT, 1)
            assert void == (b"\r\n" if dies == "mid-event" else b""), void
        assert last.startswith(b"event: message\r\ndata: ") and last.endswith(b"\r\n\r\n")
        error = json.loads(last.split(b"data: ", 1)[1])
        assert error["id"] == 7 and error["error"]["code"] == -32000
    else:  # incomplete: the server drops the connection
        assert bodies == sent_by_owner
        assert all(m.get("more_body", True) for m in sent[1:])


def test_a_token_naming_no_worker_is_a_404_without_a_client(
        short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A session id shaped like one this server mints but naming no worker (a random token, as
    anyone can forge, or a worker gone and swept) is a plain 404, answered before a forwarding
    client is built for it: building one takes ~16 ms of the worker's event loop (an SSL
    context), which also runs every call's cancellation poll, so a flood of forged ids would
    hold up cancellations."""
    monkeypatch.setenv("SHMCANCEL_SDK_SOCKET_DIR", str(short_tmp))

    def no_client(*a: object, **kw: object) -> None:
        raise AssertionError("a forwarding client was built for a worker that is not there")

    monkeypatch.setattr(httpx, "AsyncClient", no_client)

    async def main() -> list[dict]:
        async with asyncio.timeout(15):
            return await _forward(Router(_Owner()), "1x0123456789ab", "POST", asyncio.Event())

    sent = asyncio.run(main())
    assert sent[0]["status"] == 404


def test_the_forwarding_client_gives_up_an_idle_connection_before_the_owner_closes_it(
        short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pooled connection reused just as the owner's server closes it for idleness fails the
    forward (``ReadError``: a 503 for a live session); with equal timeouts (httpx's and
    uvicorn's 5 s defaults) that race was open at every connection's edge. The client's
    ``keepalive_expiry`` must be well under the server's ``timeout_keep_alive``, as built."""
    monkeypatch.setenv("SHMCANCEL_SDK_SOCKET_DIR", str(short_tmp))

    async def main() -> tuple[float, float]:
        owner, here = Router(_Owner()), Router(_Owner())
        await owner.ensure()
        try:
            client = here._client(owner.path)
            expiry = client._transport._pool._keepalive_expiry  # httpcore's pool
            assert owner._servers
            return expiry, owner._servers[-1].config.timeout_keep_alive
        finally:
            owner.close()
            for c in here._clients.values():
                await c.aclose()

    expiry, idle = asyncio.run(main())
    assert expiry is not None and expiry + 5 <= idle, (expiry, idle)


def _dead_peer_sockets(under: Path) -> int:
    """This process's connected Unix stream sockets to a socket file under ``under`` whose peer
    has closed (a peek reads EOF): descriptors held open for nothing. Only this test's: sockets
    earlier tests of the process left to the garbage collector are not counted."""
    import socket

    n = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            s = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue
        with s:
            if s.family != socket.AF_UNIX or s.type != socket.SOCK_STREAM:
                continue
            with contextlib.suppress(OSError):  # listening, unconnected, nothing to read
                peer = s.getpeername()
                if isinstance(peer, str) and peer.startswith(f"{under}{os.sep}"):
                    n += s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    return n


def test_connections_to_a_worker_that_is_gone_are_closed(
        short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bounded everything (descriptors): forwards to a worker keep pooled connections to it
    (up to 32). Once that worker was gone (recycled by ``max_requests``, a ``HUP``, a crash),
    they stayed open in every worker that had forwarded to it: the client was kept until 64
    other workers' clients evicted it, or dropped (a 404 for a session of the gone worker)
    without being closed, its sockets left to the cyclic garbage collector. Now a client for a
    worker whose socket is gone is closed (once its forwards under way end) when it is
    dropped, and when a client for a new worker is made."""
    monkeypatch.setenv("SHMCANCEL_SDK_SOCKET_DIR", str(short_tmp))

    async def main() -> tuple[int, int, int]:
        app = _Owner()
        first, second, here = Router(app), Router(app), Router(app)
        await first.ensure()
        gone = asyncio.Event()
        app.stall.set()  # concurrent forwards: each its own pooled connection
        calls = [asyncio.create_task(_forward(here, first.token, "POST", gone))
                 for _ in range(8)]
        for _ in range(500):
            if len(first._servers[-1].server_state.connections) >= 8:
                break
            await asyncio.sleep(0.01)
        app.release.set()
        async with asyncio.timeout(30):
            await asyncio.gather(*calls)
        app.stall.clear()
        first.close()  # the worker goes: its socket and its connections
        assert first._tasks
        async with asyncio.timeout(30):
            await asyncio.gather(*first._tasks)
        for _ in range(500):
            if _dead_peer_sockets(short_tmp) >= 8:
                break
            await asyncio.sleep(0.01)
        left_by_the_gone_worker = _dead_peer_sockets(short_tmp)
        await second.ensure()  # its replacement, forwarded to
        await _forward(here, second.token, "POST", gone)
        after_new_worker = _dead_peer_sockets(short_tmp)
        sent = await _forward(here, first.token, "POST", gone)  # a gone worker's session
        assert sent[0]["status"] == 404
        after = _dead_peer_sockets(short_tmp)
        second.close()
        for c in here._clients.values():
            await c.aclose()
        return left_by_the_gone_worker, after_new_worker, after

    left, after_new_worker, after = asyncio.run(main())
    assert left >= 8
    assert after_new_worker == 0 and after == 0, (left, after_new_worker, after)


def test_a_forward_carries_the_clients_headers_only_and_adds_none_to_the_answer(
        short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hop is invisible: httpx's default headers (``Accept: */*``, ``Accept-Encoding``,
    ``User-Agent``, ``Connection``) were merged into every forward, so a request without
    ``Accept``, which its own worker refuses 406, was served when another worker forwarded it;
    and the owner's internal server added its ``Date`` and ``Server`` to the answer, which the
    public server then doubled."""
    monkeypatch.setenv("SHMCANCEL_SDK_SOCKET_DIR", str(short_tmp))
    seen: list[list[tuple[bytes, bytes]]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(list(scope["headers"]))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok", "more_body": False})

    async def main() -> list[Any]:
        owner, here = Router(app), Router(app)
        await owner.ensure()
        try:
            return await _forward(here, owner.token, "POST", asyncio.Event())
        finally:
            owner.close()

    sent = asyncio.run(main())
    names = sorted(k.lower() for k, _ in seen[0])
    assert not {b"accept", b"accept-encoding", b"user-agent", b"connection"} & set(names), names
    assert b"host" in names and b"content-length" in names
    head = sent[0]
    assert head["status"] == 200
    assert not {b"date", b"server"} & {k.lower() for k, _ in head["headers"]}, head["headers"]
