"""``shmcancel.sdk`` (contract §9): the example server built on the official MCP SDK (examples/sdk,
its own gunicorn.conf.py, ``uvicorn_worker.UvicornWorker`` workers) driven by the official SDK
client.

Cancellation is proven on the server side, through a read-only attachment of the registry: the
call's in-flight row appears while the tool runs and goes when the tool has ended (the row is
removed in the middleware's ``finally``, after the tool returned or raised), and nothing is left
in either table afterwards.

Both servers run on three workers: the cancel lands on whichever worker accepts it, and a stateful
session's requests are served by the worker holding the session whichever worker accepts them
(the SDK's issue #520).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import stat
import time
from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import pytest
from helpers.aio import until
from helpers.background import Background
from helpers.gunicorn_harness import Gunicorn, wait_until
from helpers.mcp_client import open_session
from helpers.rows import in_flight_rows
from helpers.stalled_lock import stalled_lock
from mcp import Client

from shmcancel import Registry
from shmcancel.sdk._routing import registry_dir, socket_dir

CONF = "examples/sdk/gunicorn.conf.py"
SLEEP = 30.0  # what the abandoned call asks for
STOPPED_WITHIN = 2.0  # seconds from abandonment to the row's removal (generous: loaded machine)
MODES = {"2025-11-25": "legacy", "2026-07-28": "2026-07-28"}

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module", params=["stateful", "stateless"])
def server(request, module_shm_name) -> Iterator[tuple[str, Gunicorn, Registry]]:
    kind = request.param
    env = {"SHMCANCEL_SDK_STATELESS": "1" if kind == "stateless" else "0"}
    with Gunicorn(None, registry_name=module_shm_name, config=CONF, workers=3,
                  worker_class="uvicorn_worker.UvicornWorker", env=env) as g, \
            Registry.attach(module_shm_name, readonly=True) as reg:
        yield kind, g, reg


def rows(reg: Registry) -> list[tuple[str, str]]:
    return [k for k, _ in in_flight_rows(reg)]


def cancellation_rows(reg: Registry) -> list[tuple[str, str]]:
    return [k for k, _ in reg.table("cancellations").scan()]


@pytest.mark.parametrize("wire", list(MODES))
def test_echo(server, wire):
    _, g, reg = server

    async def main() -> str:
        async with Client(g.url, mode=MODES[wire]) as c:
            tools = {t.name for t in (await c.list_tools()).tools}
            assert {"echo", "sleep", "sleep_sync"} <= tools
            r = await c.call_tool("echo", {"text": "héllo"})
            assert not r.is_error
            return r.content[0].text

    assert anyio.run(main) == "héllo"
    assert rows(reg) == []


@pytest.mark.parametrize("seconds", [-1, 60.5, 1e308])
@pytest.mark.parametrize("tool", ["sleep", "sleep_sync"])
def test_a_sleep_out_of_range_names_the_problem_without_a_traceback(server, tool, seconds):
    """A client's out-of-range ``seconds`` is a tool execution error naming the problem
    (contract §5), not the SDK's anonymous "Error executing tool" with two tracebacks logged
    at ERROR for each such request (the example raised a plain ValueError)."""
    _, g, reg = server
    before = len(g.log())

    async def main() -> Any:
        async with Client(g.url, mode="legacy") as c:
            return await c.call_tool(tool, {"seconds": seconds})

    r = anyio.run(main)
    assert r.is_error and (f"Invalid arguments for tool {tool}: seconds must be between 0 "
                           "and 60") in r.content[0].text, r
    log = g.log()[before:]
    assert "Traceback" not in log and "ERROR" not in log, log[-3000:]
    assert rows(reg) == []


@pytest.mark.parametrize("tool", ["sleep", "sleep_sync"])
@pytest.mark.parametrize("wire", list(MODES))
def test_abandoned_call_stops(server, wire, tool):
    """The client abandons a 30 s call (legacy: it posts ``notifications/cancelled``; 2026-07-28:
    it closes the call's connection): the tool ends well before 30 s and nothing is left."""
    kind, g, reg = server
    assert rows(reg) == []

    async def main() -> float:
        async with Client(g.url, mode=MODES[wire]) as c:
            await c.list_tools()
            async with anyio.create_task_group() as tg:
                tg.start_soon(c.call_tool, tool, {"seconds": SLEEP})
                await until(lambda: rows(reg), 10, "the call to be in flight")
                tg.cancel_scope.cancel()
            abandoned = time.monotonic()
            gone = await until(lambda: not rows(reg), 10, "the tool to stop")
            # The server writes the call's -32800 just after the row goes. The SDK client (2.3.0)
            # fails its exit (BrokenResourceError) when a response lands while it closes, and
            # nothing it exposes says the response has landed: give it time to, before leaving.
            await anyio.sleep(0.3)
            return gone - abandoned

    took = anyio.run(main)
    print(f"\n{kind}/{wire}/{tool}: in-flight row gone {took * 1000:.1f} ms after abandonment")
    assert took < STOPPED_WITHIN, took
    assert rows(reg) == []
    assert cancellation_rows(reg) == []


@pytest.mark.parametrize("server", ["stateful"], indirect=True)
def test_namesake_in_another_session_untouched(server):
    """Two sessions run a call with the same JSON-RPC id; cancelling one leaves the other running
    to its normal end (the rows are scoped by session)."""
    _kind, g, reg = server

    async def main() -> None:
        async with Client(g.url, mode="legacy") as a, Client(g.url, mode="legacy") as b:
            await a.list_tools()
            await b.list_tools()
            done: list[str] = []

            async def b_call() -> None:
                r = await b.call_tool("sleep", {"seconds": 1.5})
                done.append(r.content[0].text)

            async with anyio.create_task_group() as tg:
                tg.start_soon(b_call)
                async with anyio.create_task_group() as ta:
                    ta.start_soon(a.call_tool, "sleep", {"seconds": SLEEP})
                    await until(lambda: len(rows(reg)) == 2, 10, "both calls in flight")
                    ids = {rid for _, rid in rows(reg)}
                    assert len(ids) == 1, rows(reg)  # namesakes: the same id in two sessions
                    ta.cancel_scope.cancel()
                await until(lambda: len(rows(reg)) == 1, STOPPED_WITHIN, "a's call to stop")
            assert done == ["slept 1.5 s"]

    anyio.run(main)
    assert rows(reg) == []
    assert cancellation_rows(reg) == []


def test_cancel_notification_bounds(server):
    """What the layer answers itself still gets the SDK's checks: a cancel notification with a
    foreign Origin is refused (403), an oversized body is 413, and neither writes a row."""
    kind, g, reg = server
    headers = {"content-type": "application/json", "accept": "application/json, text/event-stream"}
    note = {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 1}}

    async def main() -> None:
        async with Client(g.url, mode="legacy") as c, anyio.create_task_group() as tg:
            await c.list_tools()
            tg.start_soon(c.call_tool, "sleep", {"seconds": SLEEP})
            await until(lambda: rows(reg), 10, "the call to be in flight")
            scope, rid = rows(reg)[0]
            hdrs = dict(headers, origin="http://evil.example")
            if kind == "stateful":
                hdrs["mcp-session-id"] = scope.removeprefix("session:")
            note["params"] = {"requestId": int(rid)}
            async with httpx.AsyncClient() as h:
                r = await h.post(g.url, json=note, headers=hdrs)
                assert r.status_code == 403, r.text
                big = b'{"jsonrpc":"2.0","method":"notifications/cancelled","params":{"x":"' \
                    + b"x" * (5 * 1024 * 1024) + b'"}}'
                r = await h.post(g.url, content=big, headers=headers)
                assert r.status_code == 413, r.status_code
            await anyio.sleep(0.1)
            assert rows(reg), "the call was cancelled by a refused notification"
            assert cancellation_rows(reg) == []
            tg.cancel_scope.cancel()
        await until(lambda: not rows(reg), 10, "the call to stop")

    anyio.run(main)


LEGACY_HEADERS = {"content-type": "application/json",
                  "accept": "application/json, text/event-stream",
                  "mcp-protocol-version": "2025-11-25"}


@pytest.mark.parametrize("tool", ["sleep", "sleep_sync"])
def test_cancel_on_a_fresh_connection(server, tool):
    """Three workers: a ``notifications/cancelled`` posted on a fresh connection (so on any worker:
    over six rounds, almost surely on another worker than the call's at least once) stops the
    call, which is answered ``-32800`` with HTTP 200 (JSON when stateless, an SSE event in a
    stateful session) carrying the notification's reason, made text as contract §4.2 says (a
    non-string is its repr, as on the WSGI transport); nothing is left. A notification for an
    id nobody runs is the SDK's to answer (202) and writes no row."""
    kind, g, reg = server
    headers, scope = _legacy_client(kind, g)

    async def one(rid: int) -> float:
        call = {"jsonrpc": "2.0", "id": rid, "method": "tools/call",
                "params": {"name": tool, "arguments": {"seconds": SLEEP}}}
        reason: object = "test" if rid % 2 else 42
        note = {"jsonrpc": "2.0", "method": "notifications/cancelled",
                "params": {"requestId": rid, "reason": reason}}
        async with httpx.AsyncClient(timeout=20) as h, anyio.create_task_group() as tg:
            answer: list[httpx.Response] = []

            async def post_call() -> None:
                answer.append(await h.post(g.url, json=call, headers=headers))

            tg.start_soon(post_call)
            await until(lambda: (scope, str(rid)) in rows(reg), 10, "the call")
            async with httpx.AsyncClient(timeout=10) as h2:  # a connection of its own
                sent = time.monotonic()
                r = await h2.post(g.url, json=note, headers=headers)
                assert r.status_code == 202, r.text
            await until(lambda: answer, STOPPED_WITHIN, "the call's answer")
            took = time.monotonic() - sent
        assert answer[0].status_code == 200, answer[0].text
        text = answer[0].text
        body = json.loads(text[text.index("{"):text.rindex("}") + 1])  # JSON, or one SSE event
        assert body["id"] == rid and body["error"]["code"] == -32800, body
        assert body["error"].get("data") == {"reason": str(reason)}, body
        return took

    async def main() -> list[float]:
        return [await one(1000 + i) for i in range(6)]

    took = anyio.run(main)
    print(f"\n{kind}/{tool}: answered -32800 "
          f"{', '.join(f'{t * 1000:.1f}' for t in took)} ms after the notification was sent")
    assert rows(reg) == []
    assert cancellation_rows(reg) == []

    async def stray() -> int:
        note = {"jsonrpc": "2.0", "method": "notifications/cancelled",
                "params": {"requestId": 4242}}
        async with httpx.AsyncClient(timeout=10) as h:
            return (await h.post(g.url, json=note, headers=headers)).status_code

    assert anyio.run(stray) == 202
    assert cancellation_rows(reg) == []


def test_an_id_the_registry_cannot_key_is_refused_and_its_cancel_is_a_400(server):
    """A string id over 256 UTF-8 bytes: the SDK takes it, the registry cannot key it (contract
    §4.1), so the call ran untracked, deaf to every cancellation, while a cancel naming it got
    202. The call is refused with ``-32600`` before its tool runs; its cancel is 400 ``-32602``
    (contract §6.1), as is one whose id is no id at all (a float, a bool, an array, an object:
    the SDK answered those 202). An id of 256 bytes is served as any other."""
    kind, g, reg = server
    headers, _ = _legacy_client(kind, g)

    def answer(r: httpx.Response) -> dict:
        text = r.text  # JSON, or one SSE event
        return json.loads(text[text.index("{"):text.rindex("}") + 1])

    long_id, ok_id = "x" * 257, "é" * 128  # 257 bytes; 256 bytes
    with httpx.Client(timeout=20) as h:
        r = h.post(g.url, headers=headers, json={
            "jsonrpc": "2.0", "id": long_id, "method": "tools/call",
            "params": {"name": "sleep", "arguments": {"seconds": 5}}})
        assert r.status_code == 200, r.text
        body = answer(r)
        assert body["id"] == long_id and body["error"]["code"] == -32600, body
        r = h.post(g.url, headers=headers, json={
            "jsonrpc": "2.0", "method": "notifications/cancelled",
            "params": {"requestId": long_id}})
        assert r.status_code == 400 and r.json()["error"]["code"] == -32602, r.text
        for bad in (1.5, True, [1], {"a": 1}):  # no request has such an id: 400, as WSGI's
            r = h.post(g.url, headers=headers, json={
                "jsonrpc": "2.0", "method": "notifications/cancelled",
                "params": {"requestId": bad}})
            assert r.status_code == 400 and r.json()["error"]["code"] == -32602, (bad, r.text)
        r = h.post(g.url, headers=headers, json={
            "jsonrpc": "2.0", "method": "notifications/cancelled", "params": {}})
        assert r.status_code == 202, r.text  # naming nothing: nothing to cancel
        r = h.post(g.url, headers=headers, json={
            "jsonrpc": "2.0", "id": ok_id, "method": "tools/call",
            "params": {"name": "echo", "arguments": {"text": "kept"}}})
        body = answer(r)
        assert body["id"] == ok_id and body["result"]["content"][0]["text"] == "kept", body
    assert rows(reg) == []
    assert cancellation_rows(reg) == []


def _legacy_client(kind: str, g: Gunicorn) -> tuple[dict[str, str], str]:
    """A 2025-era client's headers and the scope its calls run in: a fresh session's when the
    server is stateful, else its address's."""
    if kind != "stateful":
        return dict(LEGACY_HEADERS), "ip:127.0.0.1"
    with httpx.Client(timeout=10) as h0:
        headers = _initialize(h0, g.url)
    return headers, "session:" + headers["mcp-session-id"].split("-", 1)[1]


def _initialize(h: httpx.Client, url: str) -> dict[str, str]:
    r = h.post(url, headers=LEGACY_HEADERS, json={
        "jsonrpc": "2.0", "id": 0, "method": "initialize",
        "params": {"protocolVersion": "2025-11-25", "capabilities": {},
                   "clientInfo": {"name": "test", "version": "0"}}})
    assert r.status_code == 200, r.text
    hdrs = dict(LEGACY_HEADERS, **{"mcp-session-id": r.headers["mcp-session-id"]})
    r = h.post(url, headers=hdrs, json={"jsonrpc": "2.0", "method": "notifications/initialized"})
    assert r.status_code == 202, r.text
    return hdrs


@pytest.mark.parametrize("server", ["stateful"], indirect=True)
def test_session_on_fresh_connections(server):
    """The #520 repro: 12 requests of one session, each on a fresh connection (so on any of the
    three workers), all succeed; then its DELETE (on a fresh connection too) ends it for every
    worker."""
    _kind, g, _reg = server
    with httpx.Client(timeout=10) as h:
        hdrs = _initialize(h, g.url)
    statuses = []
    for i in range(12):
        with httpx.Client(timeout=10) as h:
            r = h.post(g.url, headers=hdrs, json={
                "jsonrpc": "2.0", "id": i + 1, "method": "tools/call",
                "params": {"name": "echo", "arguments": {"text": f"n{i}"}}})
            statuses.append(r.status_code)
            assert f'"n{i}"' in r.text, r.text
            # the SDK repeats the session id in its answers, and clients adopt it: a forwarded
            # answer must carry it unchanged (the TypeScript SDK client follows it)
            assert r.headers.get("mcp-session-id", hdrs["mcp-session-id"]) == \
                hdrs["mcp-session-id"]
    assert statuses == [200] * 12
    with httpx.Client(timeout=10) as h:
        assert h.delete(g.url, headers=hdrs).status_code == 200
    for _ in range(3):
        with httpx.Client(timeout=10) as h:
            r = h.post(g.url, headers=hdrs, json={"jsonrpc": "2.0", "id": 99,
                                                  "method": "tools/list"})
            assert r.status_code == 404, r.text


@pytest.mark.parametrize("server", ["stateful"], indirect=True)
def test_a_get_naming_a_last_event_id_without_an_event_store_opens_a_fresh_stream(server):
    """The example keeps no events to replay. The SDK (mcp 2.3.0) answered such a GET with no
    response at all, which uvicorn turns into a 500 (and logs an ERROR): the stream now opens
    as a plain GET, on whichever worker the request lands (forwarded to the session's)."""
    _kind, g, _reg = server
    before = len(g.log())
    with httpx.Client(timeout=10) as h:
        hdrs = _initialize(h, g.url)
    opened = 0
    for _ in range(6):  # fresh connections: served here and forwarded
        with httpx.Client(timeout=10) as h, h.stream(
                "GET", g.url, headers={**hdrs, "accept": "text/event-stream",
                                       "last-event-id": "abc"}) as r:
            # 409: the SDK has not yet seen the previous stream's client leave (one at a time)
            assert r.status_code in (200, 409), r.read()
            if r.status_code == 200:
                assert r.headers["content-type"].startswith("text/event-stream")
                opened += 1
    assert opened, "no stream opened"
    log = g.log()[before:]
    assert "without starting response" not in log and " 500" not in log, log[-2000:]
    with httpx.Client(timeout=10) as h:
        assert h.delete(g.url, headers=hdrs).status_code == 200


def test_concurrent_sdk_calls_in_one_session(server):
    """The #520 repro with the SDK client: 8 concurrent calls of one session (the client opens
    connections as it needs them, and its GET stream) all succeed."""
    _kind, g, reg = server

    async def main() -> list[str]:
        out: list[str] = []
        async with Client(g.url, mode="legacy") as c:
            async def one(i: int) -> None:
                r = await c.call_tool("sleep", {"seconds": 0.2})
                assert not r.is_error, r
                out.append(r.content[0].text)

            async with anyio.create_task_group() as tg:
                for i in range(8):
                    tg.start_soon(one, i)
        return out

    for _ in range(2):
        assert anyio.run(main) == ["slept 0.2 s"] * 8
    assert rows(reg) == []


@pytest.mark.parametrize("server", ["stateful"], indirect=True)
def test_worker_killed_with_its_sessions(server):
    """A worker SIGKILLed while it holds a session: that session answers 404 at once on every
    worker (no hang), the worker's rows are reaped, and another worker's session keeps working."""
    _kind, g, reg = server
    by_token: dict[str, dict[str, str]] = {}
    with httpx.Client(timeout=10):
        for _ in range(30):  # fresh connections until two workers hold a session each
            with httpx.Client(timeout=10) as h1:
                hdrs = _initialize(h1, g.url)
            by_token.setdefault(hdrs["mcp-session-id"].split("-")[0], hdrs)
            if len(by_token) >= 2:
                break
        assert len(by_token) >= 2, by_token
        (victim_token, victim), (_, survivor) = list(by_token.items())[:2]
        victim_pid = int(victim_token.split("x")[0], 16)
        assert victim_pid in g.worker_pids()

        async def start_call() -> None:
            async with httpx.AsyncClient(timeout=20) as ah, anyio.create_task_group() as tg:
                async def call() -> None:
                    # The worker dies under it: the connection breaks; forwarded by another
                    # worker, a 503 when the owner died before its answer began, else the
                    # call's JSON-RPC error as the last event of the stream it had begun.
                    try:
                        r = await ah.post(g.url, headers=victim, json={
                            "jsonrpc": "2.0", "id": 5, "method": "tools/call",
                            "params": {"name": "sleep", "arguments": {"seconds": SLEEP}}})
                    except httpx.HTTPError:
                        return
                    if r.status_code == 200:
                        last = r.text.rstrip().rsplit("data: ", 1)[-1]
                        error = json.loads(last)
                        assert (error["id"], error["error"]["code"]) == (5, -32000), r.text
                        return
                    assert r.status_code == 503, r.text

                tg.start_soon(call)
                await until(lambda: any(r[0].startswith("session:") for r in rows(reg)), 10,
                            "the victim's call in flight")
                os.kill(victim_pid, signal.SIGKILL)

        anyio.run(start_call)
        for _ in range(6):
            with httpx.Client(timeout=10) as h1:
                t = time.monotonic()
                r = h1.post(g.url, headers=victim, json={"jsonrpc": "2.0", "id": 6,
                                                         "method": "tools/list"})
                assert r.status_code == 404, r.text
                assert time.monotonic() - t < 5
            with httpx.Client(timeout=10) as h1:
                r = h1.post(g.url, headers=survivor, json={"jsonrpc": "2.0", "id": 7,
                                                           "method": "tools/list"})
                assert r.status_code == 200, r.text
    deadline = time.monotonic() + 10
    while rows(reg) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert rows(reg) == []
    g.wait_workers(3, time.monotonic() + 30)


@pytest.mark.parametrize("server", ["stateful"], indirect=True)
def test_a_workers_socket_removed_behind_its_back_is_bound_again(server):
    """An operator, or a cleaner of old files under /tmp, removes a worker's socket while it
    serves: the worker binds it again within a few seconds, so the sessions it holds stay
    reachable from every worker. It never did: those sessions were 404 on the other workers
    for the rest of the worker's life, and it kept minting more."""
    _kind, g, _reg = server
    with httpx.Client(timeout=10) as h0:
        hdrs = _initialize(h0, g.url)
    token = hdrs["mcp-session-id"].split("-")[0]
    path = os.path.join(registry_dir(socket_dir(), g.registry_name), f"{token}.sock")
    assert os.path.exists(path)
    os.unlink(path)
    deadline = time.monotonic() + 10
    while not os.path.exists(path):
        assert time.monotonic() < deadline, "the worker's socket was not bound again"
        time.sleep(0.05)
    for i in range(12):  # fresh connections: most land on the other two workers
        with httpx.Client(timeout=10) as h1:
            r = h1.post(g.url, headers=hdrs, json={"jsonrpc": "2.0", "id": 100 + i,
                                                   "method": "tools/list"})
            assert r.status_code == 200, r.text
    # the SDK's rich log handler wraps long lines
    assert "was removed while it served; bound again" in " ".join(g.log().split()), g.log_tail()


@pytest.mark.parametrize("server", ["stateful"], indirect=True)
def test_a_socket_directory_replaced_by_a_symlink_is_refused_when_binding_again(server,
                                                                                 tmp_path):
    """Whoever removed the sockets may have replaced their directory: a worker binding again
    checks it afresh (it trusted its first check, and bound into a symlinked, world-writable
    directory, where another user could swap in a socket of their own and read every request
    the other workers forward). Refused, logged once; bound again once the directory is
    sound."""
    _kind, g, _reg = server
    with httpx.Client(timeout=10) as h0:
        hdrs = _initialize(h0, g.url)
    token = hdrs["mcp-session-id"].split("-")[0]
    d = registry_dir(socket_dir(), g.registry_name)
    path = os.path.join(d, f"{token}.sock")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o777)
    deadline = time.monotonic() + 15  # every worker started (a start refused stops gunicorn)
    while len(names := sorted(n for n in os.listdir(d) if n.endswith(".sock"))) < 3:
        assert time.monotonic() < deadline, os.listdir(d)
        time.sleep(0.05)
    shutil.rmtree(d)
    os.symlink(elsewhere, d)
    planted = []  # what the other user binds there: sockets named after the workers' tokens
    try:
        for n in names:
            p = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            p.bind(str(elsewhere / n))
            p.listen(16)
            p.setblocking(False)
            planted.append(p)
        deadline = time.monotonic() + 10
        while "cannot be served" not in " ".join(g.log().split()):
            assert time.monotonic() < deadline, g.log_tail()
            time.sleep(0.05)
        statuses = set()
        for i in range(9):  # fresh connections: most land on another worker than the owner
            with httpx.Client(timeout=10) as h1:
                statuses.add(h1.post(g.url, headers=hdrs, json={
                    "jsonrpc": "2.0", "id": 20 + i, "method": "tools/list"}).status_code)
        assert statuses <= {200, 404}, statuses
        for p in planted:  # nothing was forwarded to them
            with pytest.raises(BlockingIOError):
                p.accept()
        assert sorted(os.listdir(elsewhere)) == names  # no worker bound there
    finally:
        for p in planted:
            p.close()
        os.unlink(d)
    deadline = time.monotonic() + 15
    # every worker's (the tests after this one mint sessions on all three)
    while not (os.path.exists(path) and len(g.worker_pids()) == 3 and len(
            [n for n in os.listdir(d) if n.endswith(".sock")]) == 3):
        assert time.monotonic() < deadline, "not bound again once the directory was sound"
        time.sleep(0.05)
    assert stat.S_IMODE(os.lstat(d).st_mode) == 0o700 and not os.path.islink(d)
    with httpx.Client(timeout=10) as h1:
        r = h1.post(g.url, headers=hdrs, json={"jsonrpc": "2.0", "id": 9,
                                               "method": "tools/list"})
        assert r.status_code == 200, r.text


def _all_bound(g: Gunicorn, d: str, within: float = 15) -> list[str]:
    """The socket names in ``d`` once each of ``g``'s three workers has bound its own."""
    deadline = time.monotonic() + within
    while True:
        with contextlib.suppress(OSError):
            names = sorted(n for n in os.listdir(d) if n.endswith(".sock"))
            if len(names) == 3 and len(g.worker_pids()) == 3:
                return names
        assert time.monotonic() < deadline, "not every worker's socket is bound"
        time.sleep(0.05)


def test_a_socket_directory_replaced_by_a_file_is_a_404_not_a_500(shm_name, short_tmp):
    """The socket directory removed and a file made in its place: a request naming another
    worker (any client can make up a token) made the forward's check of the directory fail
    with an OSError (its makedirs), an HTTP 500 and a traceback each. It is that worker
    unreachable: 404. Once the file goes, the workers bind again. (A server of its own, with
    a socket directory of its own: the run's is shared by the servers of other test files.)"""
    base = str(short_tmp / "socks")
    env = {"SHMCANCEL_SDK_STATELESS": "0", "SHMCANCEL_SDK_SOCKET_DIR": base}
    with Gunicorn(None, registry_name=shm_name, config=CONF, workers=3,
                  worker_class="uvicorn_worker.UvicornWorker", env=env) as g:
        d = registry_dir(base, shm_name)
        _all_bound(g, d)
        shutil.rmtree(base)
        with open(base, "w"):
            pass
        try:
            deadline = time.monotonic() + 10
            while "cannot be served" not in " ".join(g.log().split()):
                assert time.monotonic() < deadline, g.log_tail()
                time.sleep(0.05)
            statuses = set()
            for i in range(6):
                with httpx.Client(timeout=10) as h1:
                    statuses.add(h1.post(g.url, headers={
                        **LEGACY_HEADERS, "mcp-session-id": f"{i + 1:x}x0123456789ab-abc"},
                        json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"}).status_code)
            assert statuses == {404}, statuses
        finally:
            os.unlink(base)
        _all_bound(g, d)


@pytest.mark.parametrize("server", ["stateless"], indirect=True)
def test_stateless_namesake_from_another_address_untouched(server):
    """Stateless, anonymous: two clients on different addresses run a call with the same id;
    cancelling one (from its own address) leaves the other running to its end."""
    _kind, g, reg = server

    async def main() -> None:
        call = {"jsonrpc": "2.0", "id": 77, "method": "tools/call",
                "params": {"name": "sleep", "arguments": {"seconds": SLEEP}}}
        other = {"jsonrpc": "2.0", "id": 77, "method": "tools/call",
                 "params": {"name": "sleep_sync", "arguments": {"seconds": 1.5}}}
        note = {"jsonrpc": "2.0", "method": "notifications/cancelled",
                "params": {"requestId": 77}}
        b_transport = httpx.AsyncHTTPTransport(local_address="127.0.0.2")
        answers: dict[str, dict] = {}
        async with httpx.AsyncClient(timeout=20) as a, \
                httpx.AsyncClient(timeout=20, transport=b_transport) as b, \
                anyio.create_task_group() as tg:
            async def post(name: str, h: httpx.AsyncClient, body: dict) -> None:
                answers[name] = (await h.post(g.url, json=body, headers=LEGACY_HEADERS)).json()

            tg.start_soon(post, "a", a, call)
            tg.start_soon(post, "b", b, other)
            await until(lambda: {("ip:127.0.0.1", "77"), ("ip:127.0.0.2", "77")}
                        <= set(rows(reg)), 10, "both calls in flight")
            async with httpx.AsyncClient(timeout=10) as h:
                assert (await h.post(g.url, json=note, headers=LEGACY_HEADERS)).status_code == 202
            await until(lambda: "a" in answers, STOPPED_WITHIN, "a's answer")
            assert answers["a"]["error"]["code"] == -32800, answers
            assert "b" not in answers and ("ip:127.0.0.2", "77") in rows(reg)
        assert answers["b"]["result"]["content"][0]["text"] == "slept 1.5 s", answers

    anyio.run(main)
    assert rows(reg) == []
    assert cancellation_rows(reg) == []


def _legacy_call(g: Gunicorn, headers: dict[str, str], rid: int, answers: dict[int, Any],
                 h: httpx.AsyncClient) -> Any:
    async def post() -> None:
        body = {"jsonrpc": "2.0", "id": rid, "method": "tools/call",
                "params": {"name": "sleep", "arguments": {"seconds": SLEEP}}}
        r = await h.post(g.url, json=body, headers=headers)
        text = r.text
        answers[rid] = json.loads(text[text.index("{"):text.rindex("}") + 1])

    return post


def test_a_cancel_answered_by_shmcancel_passes_the_sdks_checks_first(server):
    """A notification shmcancel answers itself (its call is in flight) meets the SDK's own
    checks first: without the Accept the SDK asks for it is the SDK's 406 and cancels nothing.
    And a method name spelled with JSON escapes (as PHP's json_encode writes ``/``) is the same
    name: it cancels (on a stateless server the SDK would ignore it)."""
    kind, g, reg = server
    headers, scope = _legacy_client(kind, g)

    async def main() -> None:
        answers: dict[int, Any] = {}
        async with httpx.AsyncClient(timeout=20) as h, anyio.create_task_group() as tg:
            tg.start_soon(_legacy_call(g, headers, 501, answers, h))
            await until(lambda: (scope, "501") in rows(reg), 10, "the call")
            plain = ('{"jsonrpc": "2.0", "method": "notifications/cancelled", '
                     '"params": {"requestId": 501}}')
            escaped = plain.replace("/", "\\/")
            async with httpx.AsyncClient(timeout=10) as h2:
                r = await h2.post(g.url, content=plain,
                                  headers=dict(headers, accept="text/html"))
                assert r.status_code == 406, r.text
                await anyio.sleep(0.2)  # a wrongly recorded cancel would end it meanwhile
                assert (scope, "501") in rows(reg) and not answers
                r = await h2.post(g.url, content=escaped, headers=headers)
                assert r.status_code == 202, r.text
            await until(lambda: 501 in answers, STOPPED_WITHIN, "the call's answer")
        assert answers[501]["error"]["code"] == -32800, answers

    anyio.run(main)
    assert rows(reg) == []
    assert cancellation_rows(reg) == []


@pytest.mark.parametrize("server", ["stateful"], indirect=True)
def test_a_sessionless_cancel_never_reaches_another_clients_call(server):
    """Stateful: a 2026-07-28 call runs in its client's address scope (that wire has no
    session). A 2025-era ``notifications/cancelled`` without a session is the SDK's to refuse
    (400), even when a call with its id runs in that address scope: it cancels nothing."""
    _kind, g, reg = server

    async def main() -> None:
        async with Client(g.url, mode="2026-07-28") as c, anyio.create_task_group() as tg:
            tg.start_soon(c.call_tool, "sleep", {"seconds": SLEEP})
            await until(lambda: rows(reg), 10, "the call to be in flight")
            (scope, rid), = rows(reg)
            assert scope == "ip:127.0.0.1"
            note = {"jsonrpc": "2.0", "method": "notifications/cancelled",
                    "params": {"requestId": int(rid) if rid.isdigit() else rid}}
            async with httpx.AsyncClient(timeout=10) as h:
                r = await h.post(g.url, json=note, headers=LEGACY_HEADERS)
            assert r.status_code == 400, r.text
            await anyio.sleep(0.2)  # a wrongly recorded cancel would end it meanwhile
            assert rows(reg) == [(scope, rid)] and cancellation_rows(reg) == []
            tg.cancel_scope.cancel()
        await until(lambda: not rows(reg), 10, "the call to stop")
        await anyio.sleep(0.3)  # the SDK client's exit race (see test_abandoned_call_stops)

    anyio.run(main)
    assert cancellation_rows(reg) == []


@pytest.mark.parametrize("server", ["stateful"], indirect=True)
def test_another_servers_session_is_unknown_here(server, shm_name):
    """Two servers of one user on one host share the socket directory's parent, not their
    workers: a session of server B sent to server A's port is A's 404, never served by B's
    worker (nor can a cancel sent to A reach B's call)."""
    _kind, a, _reg = server
    with Gunicorn(None, registry_name=shm_name, config=CONF, workers=2,
                  worker_class="uvicorn_worker.UvicornWorker",
                  env={"SHMCANCEL_SDK_STATELESS": "0"}) as b, httpx.Client(timeout=10) as h:
        hdrs = _initialize(h, b.url)
        ping = {"jsonrpc": "2.0", "id": 1, "method": "ping"}
        assert h.post(b.url, headers=hdrs, json=ping).status_code == 200
        for _ in range(6):  # any of A's workers
            with httpx.Client(timeout=10) as fresh:
                r = fresh.post(a.url, headers=hdrs, json=ping)
            assert r.status_code == 404, r.text


def test_deeply_nested_json_naming_the_cancel_is_a_400(server):
    """A body the SDK refuses as JSON (nesting past the parser's depth) is its 400 also when it
    names ``notifications/cancelled`` or holds an escape (so shmcancel parses it first)."""
    kind, g, _reg = server
    headers, _scope = _legacy_client(kind, g)
    deep = "[" * 100_000 + "]" * 100_000
    bodies = ['{"method": "notifications/cancelled", "params": ' + deep + "}",
              '{"method": "x\\/y", "params": ' + deep + "}"]
    with httpx.Client(timeout=10) as h:
        for body in bodies:
            r = h.post(g.url, content=body, headers=headers)
            assert r.status_code == 400, (r.status_code, r.text[:200])


@pytest.mark.parametrize("server", ["stateful"], indirect=True)
def test_delete_stops_a_sync_tool_of_the_session(server):
    """``DELETE`` ends the session and cancels its calls (contract §6.1): a sync tool, whose
    thread the SDK's task cancellation cannot reach, sees ``raise_if_cancelled()`` fire and its
    row goes well before its 30 s."""
    kind, g, reg = server
    headers, scope = _legacy_client(kind, g)

    async def main() -> float:
        async with httpx.AsyncClient(timeout=40) as h, anyio.create_task_group() as tg:
            async def post_call() -> None:
                with contextlib.suppress(httpx.HTTPError):
                    await h.post(g.url, headers=headers, json={
                        "jsonrpc": "2.0", "id": 3, "method": "tools/call",
                        "params": {"name": "sleep_sync", "arguments": {"seconds": SLEEP}}})

            tg.start_soon(post_call)
            await until(lambda: (scope, "3") in rows(reg), 10, "the call")
            async with httpx.AsyncClient(timeout=10) as h2:
                t0 = time.monotonic()
                r = await h2.delete(g.url, headers=headers)
                assert r.status_code in (200, 204), r.text
            gone = await until(lambda: (scope, "3") not in rows(reg), 10, "the tool to stop")
            tg.cancel_scope.cancel()
            return gone - t0

    took = anyio.run(main)
    assert took < STOPPED_WITHIN, took
    assert rows(reg) == []


@pytest.mark.slow
def test_a_stalled_registry_lock_never_stalls_a_workers_event_loop(shm_name, spawn):
    """A live process holding the registry lock (stopped: contract §4.3) makes a write wait
    ``lock_timeout``. A ``tools/call`` whose key goes to the shared table (an id too long for
    the worker's lane) must not wait on the worker's event loop: every other request of that
    worker (here ``tools/list``, which needs no lock) was held up to ``lock_timeout`` behind it,
    and so was every cancellation poll (contract §9: within the poll interval)."""
    lock_timeout = 2.0
    env = {"SHMCANCEL_SDK_STATELESS": "1", "SHMCANCEL_TEST_LOCK_TIMEOUT": str(lock_timeout)}
    headers = {"Accept": "application/json, text/event-stream",
               "Content-Type": "application/json", "MCP-Protocol-Version": "2025-11-25"}
    with Gunicorn("app:app", registry_name=shm_name, config="tests/apps/transport_conf.py",
                  workers=1, worker_class="uvicorn_worker.UvicornWorker", env=env,
                  extra_args=["--pythonpath", "examples/sdk"]) as g:

        def post(body: dict[str, Any]) -> tuple[httpx.Response, float]:
            t0 = time.monotonic()
            r = httpx.post(g.url, json=body, headers=headers, timeout=30)
            return r, time.monotonic() - t0

        def echo(rid: Any) -> dict[str, Any]:
            return {"jsonrpc": "2.0", "id": rid, "method": "tools/call",
                    "params": {"name": "echo", "arguments": {"text": "x"}}}

        assert post(echo(1))[0].status_code == 200  # the worker has claimed its lane
        with stalled_lock(spawn, shm_name):
            long_call = Background(lambda: post(echo("L" * 120)))
            long_call.start()
            waits = []
            deadline = time.monotonic() + 4 * lock_timeout
            while long_call.done_at is None and time.monotonic() < deadline:
                r, took = post({"jsonrpc": "2.0", "id": 2, "method": "tools/list"})
                assert r.status_code == 200, r.text
                waits.append(took)
            r, _ = long_call.result(timeout=10)
            assert r.status_code == 200, r.text
            assert max(waits) < lock_timeout / 2, (waits, g.log_tail())


@pytest.mark.slow
def test_a_session_deleted_while_the_registry_lock_is_stalled_stops_its_sync_calls(
        shm_name, spawn):
    """A ``DELETE`` ends the session (the SDK answers first), then its calls are cancelled in
    the registry (contract §6.1, §9). When a live process holds the lock past ``lock_timeout``
    (contract §4.3), no row can be written: the worker that owns the session, which runs all
    of its calls, stops them itself. A sync tool (which the SDK cannot interrupt) ends at its
    next ``raise_if_cancelled()`` instead of sleeping on; its row goes once the lock is free."""
    lock_timeout = 1.0
    env = {"SHMCANCEL_SDK_STATELESS": "0", "SHMCANCEL_TEST_LOCK_TIMEOUT": str(lock_timeout)}
    legacy = {"content-type": "application/json",
              "accept": "application/json, text/event-stream",
              "mcp-protocol-version": "2025-11-25"}
    with Gunicorn("app:app", registry_name=shm_name, config="tests/apps/transport_conf.py",
                  workers=1, worker_class="uvicorn_worker.UvicornWorker", env=env,
                  extra_args=["--pythonpath", "examples/sdk"]) as g, \
            Registry.attach(shm_name, readonly=True) as reg:
        hdrs = open_session(g.url, legacy)
        call = Background(lambda: httpx.post(g.url, headers=hdrs, timeout=60, json={
            "jsonrpc": "2.0", "id": 5, "method": "tools/call",
            "params": {"name": "sleep_sync", "arguments": {"seconds": SLEEP}}}))
        call.start()
        wait_until(lambda: rows(reg), time.monotonic() + 10, what="the call to start")
        with stalled_lock(spawn, shm_name):
            r = httpx.delete(g.url, headers=hdrs, timeout=10)
            assert r.status_code == 200, r.text
            wait_until(lambda: "the deleted session's" in g.log(),
                       time.monotonic() + 10 * lock_timeout,
                       what="the deleted session's cancellation to meet the stalled lock")
        # the lock is free again: the stopped call's end lands (a sleeping one would not end)
        wait_until(lambda: not rows(reg), time.monotonic() + 5, what="the call's row to go")
        call.join(10)
        assert not call.is_alive(), "the stopped call's request never finished"


def test_a_long_cancel_with_an_escaped_method_name_cancels(server):
    """A ``notifications/cancelled`` whose method name is spelled with JSON escapes (PHP's
    json_encode writes ``\\/`` for every ``/``) is that notification at any size the server
    takes, a long reason included: it stops the call (contract §9), answered ``-32800``. The
    SDK ignores it on a stateless server, and cannot stop a sync tool on a stateful one."""
    kind, g, reg = server
    headers, scope = _legacy_client(kind, g)
    note = ('{"jsonrpc":"2.0","method":"notifications\\/cancelled",'
            '"params":{"requestId":601,"reason":"' + "r" * 100_000 + '"}}')

    async def main() -> None:
        answers: dict[int, Any] = {}

        async def post() -> None:
            async with httpx.AsyncClient(timeout=40) as h:
                r = await h.post(g.url, headers=headers, json={
                    "jsonrpc": "2.0", "id": 601, "method": "tools/call",
                    "params": {"name": "sleep_sync", "arguments": {"seconds": SLEEP}}})
                text = r.text
                answers[601] = json.loads(text[text.index("{"):text.rindex("}") + 1])

        async with anyio.create_task_group() as tg:
            tg.start_soon(post)
            await until(lambda: (scope, "601") in rows(reg), 10, "the call")
            async with httpx.AsyncClient(timeout=10) as h2:
                r = await h2.post(g.url, content=note, headers=headers)
                assert r.status_code == 202, r.text
            try:
                await until(lambda: 601 in answers, STOPPED_WITHIN, "the call's answer")
            finally:
                tg.cancel_scope.cancel()  # on failure: not the sync tool's 30 s
        assert answers[601]["error"]["code"] == -32800, answers

    anyio.run(main)
    assert rows(reg) == []
    assert cancellation_rows(reg) == []

