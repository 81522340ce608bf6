"""The transport over real HTTP: gunicorn on loopback (3 ``sync`` workers, and once ``gthread``),
tests/apps/transport_app.py, httpx clients, one connection per request as separate clients
would be. Waits poll with deadlines; tools report through files (see the app's docstring)."""

from __future__ import annotations

import json
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers.background import Background
from helpers.gunicorn_harness import Gunicorn, alive, wait_until
from helpers.mcp_client import ACCEPT, LEGACY, MODERN, dump, meta, reply_of, tag, wait_file

from shmcancel import errors
from shmcancel.shm.registry import Registry

pytestmark = pytest.mark.integration

APP = "tests.apps.transport_app:app"
CONF = "tests/apps/transport_conf.py"
META = meta("t")
LATENCY_BOUND = 0.100  # seconds, contract §6.1 with a 2 ms tool poll, measured at the client

latencies: dict[str, list[float]] = {}


# ------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def outdir() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="shmcancel-http-") as d:
        yield d


def start(name: str, outdir: str, **kw: Any) -> Gunicorn:
    env = {"SHMCANCEL_TEST_DIR": outdir, **kw.pop("env", {})}
    return Gunicorn(APP, registry_name=name, config=CONF, env=env, **kw)


@pytest.fixture(scope="module")
def server(module_shm_name: str, outdir: str) -> Iterator[Gunicorn]:
    with start(module_shm_name, outdir, workers=3, worker_class="sync") as g:
        g.initial_workers = set(g.worker_pids())  # type: ignore[attr-defined]
        yield g


# ------------------------------------------------------------------------------ a small client


class Client:
    """A 2025-11-25 client: each request on its own connection."""

    def __init__(self, url: str, *, session: bool = True) -> None:
        self.url = url
        self.sid: str | None = None
        if session:
            r = self.post({"jsonrpc": "2.0", "id": 0, "method": "initialize",
                           "params": {"protocolVersion": LEGACY, "capabilities": {},
                                      "clientInfo": {"name": "http-test", "version": "1"}}},
                          version=None)
            assert r.status_code == 200, r.text
            self.sid = r.headers["mcp-session-id"]
            assert self.post({"jsonrpc": "2.0",
                              "method": "notifications/initialized"}).status_code == 202

    def headers(self, version: str | None = LEGACY) -> dict[str, str]:
        h = {"Accept": ACCEPT, "Content-Type": "application/json"}
        if version is not None:
            h["MCP-Protocol-Version"] = version
        if self.sid is not None:
            h["Mcp-Session-Id"] = self.sid
        return h

    def post(self, obj: Any, version: str | None = LEGACY, timeout: float = 15.0) -> httpx.Response:
        return httpx.post(self.url, content=json.dumps(obj).encode(),
                          headers=self.headers(version), timeout=timeout)

    def call(self, id: Any, tool: str, args: dict) -> dict[str, Any]:
        r = self.post({"jsonrpc": "2.0", "id": id, "method": "tools/call",
                       "params": {"name": tool, "arguments": args}})
        return reply_of(r)

    def cancel(self, id: Any) -> httpx.Response:
        return self.post({"jsonrpc": "2.0", "method": "notifications/cancelled",
                          "params": {"requestId": id, "reason": "test"}})


# ------------------------------------------------------------------------------ cancellation


def cancel_flow(g: Gunicorn, outdir: str, label: str, rounds: int = 5) -> None:
    """A sleep on one connection, notifications/cancelled on another: -32800 within 100 ms of
    the notification's 202; a namesake in a second session keeps running."""
    a, b = Client(g.url), Client(g.url)
    for _ in range(rounds):
        ta, tb = tag(), tag()
        call_a = Background(lambda ta=ta: a.call(1, "sleep", {"seconds": 10, "tag": ta}))
        call_b = Background(lambda tb=tb: b.call(1, "sleep", {"seconds": 0.4, "tag": tb}))
        call_a.start()
        call_b.start()
        deadline = time.monotonic() + 10
        wait_file(f"{outdir}/{ta}.started", deadline)
        wait_file(f"{outdir}/{tb}.started", deadline)
        r = a.cancel(1)
        acked = time.monotonic()
        assert r.status_code == 202 and r.content == b""
        reply = call_a.result()
        assert reply["error"]["code"] == errors.REQUEST_CANCELLED, reply
        assert reply["id"] == 1
        latency = max(0.0, call_a.done_at - acked)  # type: ignore[operator]
        latencies.setdefault(label, []).append(latency)
        assert latency < LATENCY_BOUND, f"reply {latency * 1000:.1f} ms after the 202"
        seen = float(Path(f"{outdir}/{ta}.cancelled").read_text())
        assert seen - acked < LATENCY_BOUND
        # the same id in the other session was not touched
        other = call_b.result()
        assert other.get("result", {}).get("content", [{}])[0].get("text") == "slept 0.4s", other
        assert not os.path.exists(f"{outdir}/{tb}.cancelled")
    lat = latencies[label]
    print(f"\n[{label}] cancel latency (202 -> -32800 reply): "
          f"median {statistics.median(lat) * 1000:.1f} ms, max {max(lat) * 1000:.1f} ms, "
          f"n={len(lat)}")


def test_a_hold_of_the_lock_left_by_a_request_is_released_at_its_end(server: Gunicorn) -> None:
    """A hold of the registry lock outlived its block in a request (gunicorn's quit raised as
    the release was entered, before any line of it; here a tool leaves one): it stayed taken
    by the worker, which served on, and every other worker's write timed out (503) from then
    on. The transport releases it as the request ends, and logs it."""
    c = Client(server.url)
    pid = int(c.call(1, "leaves_lock", {})["result"]["content"][0]["text"])
    reg = Registry.attach(server.registry_name)
    try:
        wait_until(lambda: reg.lock.owner() is None, time.monotonic() + 5,
                   what="the lock to be free")
        with reg.lock:  # takes it at once: no holder
            pass
    finally:
        reg.close()
    assert alive(pid)
    wait_until(lambda: "a hold of the registry lock outlived its block" in server.log(),
               time.monotonic() + 5, what="the error logged")
    for i in range(3):  # every worker goes on serving calls
        assert c.call(2 + i, "echo", {"text": "x"})["result"]["content"][0]["text"] == "x"


@pytest.mark.slow
def test_cancel_across_workers_sync(server: Gunicorn, outdir: str) -> None:
    pids = set(server.worker_pids())
    cancel_flow(server, outdir, "sync x3")
    assert set(server.worker_pids()) == pids
    state = dump(server.registry_name)
    assert state["cancellations"] == [] and state["in_flight"] == []


@pytest.mark.slow
def test_cancel_across_workers_gthread(shm_name: str, outdir: str) -> None:
    with start(shm_name, outdir, workers=2, worker_class="gthread", threads=4) as g:
        cancel_flow(g, outdir, "gthread 2x4", rounds=3)
        state = dump(g.registry_name)
        assert state["cancellations"] == [] and state["in_flight"] == []


def test_cancel_for_an_id_not_in_flight_records_nothing(server: Gunicorn, outdir: str) -> None:
    c = Client(server.url)
    t = tag()
    # a long sleep, ended by its own cancel below: no race with the dumps however slow they are
    running = Background(lambda: c.call(5, "sleep", {"seconds": 30, "tag": t}))
    running.start()
    wait_file(f"{outdir}/{t}.started", time.monotonic() + 10)
    for rid in (6, "5x", 10**12, "x" * 256):
        r = c.cancel(rid)
        assert r.status_code == 202, (rid, r.text)
    state = dump(server.registry_name)
    assert state["cancellations"] == []
    assert [(row["request_id"], row["alive"]) for row in state["in_flight"]] == [("5", True)]
    assert c.cancel(5).status_code == 202  # still running: the others cancelled nothing
    assert running.result()["error"]["code"] == errors.REQUEST_CANCELLED
    state = dump(server.registry_name)
    assert state["cancellations"] == [] and state["in_flight"] == []


def test_a_cancel_reaches_every_namesake_in_flight(server: Gunicorn, outdir: str) -> None:
    """contract §6.1: a ``notifications/cancelled`` recorded (202) while a request of that id
    is in flight in the caller's scope cancels it. A client racing itself (the same id twice
    at once in its session) has two; the first to see the row ended and, because the row
    predated its end, took it while the other still ran: that one answered its result, and
    whether it was cancelled hung on which of them polled first. ``nap`` does not poll, so
    the first (``sleep``) always ends before the transport's look at the end of ``nap``."""
    c = Client(server.url)
    ta, tb = tag(), tag()
    polling = Background(lambda: c.call(5, "sleep", {"seconds": 20, "tag": ta}))
    busy = Background(lambda: c.call(5, "nap", {"seconds": 1.5, "tag": tb}))
    polling.start()
    busy.start()
    deadline = time.monotonic() + 10
    wait_file(f"{outdir}/{ta}.started", deadline)
    wait_file(f"{outdir}/{tb}.started", deadline)
    assert c.cancel(5).status_code == 202
    assert polling.result()["error"]["code"] == errors.REQUEST_CANCELLED
    reply = busy.result()
    assert reply.get("error", {}).get("code") == errors.REQUEST_CANCELLED, reply
    state = dump(server.registry_name)  # the last one to end cleared the row
    assert state["cancellations"] == [] and state["in_flight"] == []


def test_session_delete_cancels_its_calls(server: Gunicorn, outdir: str) -> None:
    c = Client(server.url)
    t = tag()
    call = Background(lambda: c.call(1, "sleep", {"seconds": 10, "tag": t}))
    call.start()
    wait_file(f"{outdir}/{t}.started", time.monotonic() + 10)
    r = httpx.delete(server.url, headers=c.headers(), timeout=10)
    assert (r.status_code, r.content) == (204, b"")
    assert call.result()["error"]["code"] == errors.REQUEST_CANCELLED
    assert c.post({"jsonrpc": "2.0", "id": 2, "method": "ping"}).status_code == 404



def test_session_delete_cancels_every_call_past_the_scope_quota(shm_name: str,
                                                                outdir: str) -> None:
    """contract §6.1: DELETE ends a session "and cancels every request still in flight in it".
    With more calls in flight than ``max_rows_per_scope`` (2 here), the DELETE recorded the
    quota's worth of cancellations and stopped: the other calls ran to their end (10 s here)
    in a session that no longer existed. The quota bounds what a client asks for
    (``notifications/cancelled``, 429); a DELETE's rows are bounded by the calls in flight and
    each ends with its call."""
    n = 4
    with start(shm_name, outdir, workers=1, worker_class="gthread", threads=n + 2,
               env={"SHMCANCEL_TEST_MAX_ROWS_PER_SCOPE": "2"}) as g:
        c = Client(g.url)
        tags = [tag() for _ in range(n)]
        calls = [Background(lambda i=i, t=t: c.call(i, "sleep", {"seconds": 10, "tag": t}))
                 for i, t in enumerate(tags, 1)]
        for call in calls:
            call.start()
        deadline = time.monotonic() + 10
        for t in tags:
            wait_file(f"{outdir}/{t}.started", deadline)
        r = httpx.delete(g.url, headers=c.headers(), timeout=10)
        assert (r.status_code, r.content) == (204, b"")
        deleted = time.monotonic()
        for call in calls:
            assert call.result()["error"]["code"] == errors.REQUEST_CANCELLED
        assert max(call.done_at for call in calls) - deleted < 5  # type: ignore[operator]
        state = dump(g.registry_name)
        assert state["cancellations"] == [] and state["in_flight"] == []

WAKE_BOUND = 1.0  # seconds: a woken tool ends well within it (unwoken, it would wait 25 s)


@pytest.mark.parametrize("how", ["notification", "delete"])
def test_a_cancellation_wakes_a_waiting_tool_in_another_worker(server: Gunicorn, outdir: str,
                                                                how: str) -> None:
    """The notification (or the session's DELETE) is served by another sync worker: its ring
    wakes the tool, which waits once for 25 s without polling."""
    c = Client(server.url)
    t = tag()
    call = Background(lambda: c.call(1, "waiter", {"seconds": 25, "tag": t}))
    call.start()
    wait_file(f"{outdir}/{t}.started", time.monotonic() + 10)
    if how == "notification":
        assert c.cancel(1).status_code == 202
    else:
        assert httpx.delete(server.url, headers=c.headers(), timeout=10).status_code == 204
    acked = time.monotonic()
    assert call.result(timeout=10)["error"]["code"] == errors.REQUEST_CANCELLED
    assert call.done_at - acked < WAKE_BOUND  # type: ignore[operator]


@pytest.mark.parametrize("wire", ["legacy", "modern"])
def test_a_disconnect_wakes_a_waiting_tool(shm_name: str, outdir: str, wire: str) -> None:
    with start(shm_name, outdir, workers=2, worker_class="gthread", threads=4) as g:
        t = tag()
        params: dict[str, Any] = {"name": "waiter", "arguments": {"seconds": 25, "tag": t}}
        headers = {"MCP-Protocol-Version": LEGACY}
        if wire == "modern":
            params["_meta"] = META
            headers = {"MCP-Protocol-Version": MODERN, "Mcp-Method": "tools/call",
                       "Mcp-Name": "waiter"}
        else:
            headers["Mcp-Session-Id"] = Client(g.url).sid or ""
        body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                           "params": params}).encode()
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        host, port = g.url.split("//")[1].split("/")[0].split(":")
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(f"POST /mcp HTTP/1.1\r\nHost: {host}\r\nAccept: {ACCEPT}\r\n"
                      f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                      f"{head}\r\n".encode() + body)
            wait_file(f"{outdir}/{t}.started", time.monotonic() + 10)
        closed = time.monotonic()
        seen = float(wait_file(f"{outdir}/{t}.cancelled", closed + 10))
        assert seen - closed < WAKE_BOUND


def test_progress_is_streamed_as_sse(server: Gunicorn) -> None:
    c = Client(server.url)
    body = {"jsonrpc": "2.0", "id": 3, "method": "tools/call",
            "params": {"name": "steps", "arguments": {"n": 3}, "_meta": {"progressToken": 11}}}
    r = c.post(body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    msgs = [json.loads(line[5:]) for line in r.text.splitlines() if line.startswith("data:")]
    assert [m.get("method") for m in msgs] == ["notifications/progress"] * 3 + [None]
    assert msgs[2]["params"] == {"progressToken": 11, "progress": 3, "total": 3,
                                 "message": "step 3"}
    assert msgs[3]["id"] == 3 and msgs[3]["result"]["content"][0]["text"] == "3 of 3 sent"


def test_modern_wire_over_http(server: Gunicorn) -> None:
    h = {"Accept": ACCEPT, "Content-Type": "application/json", "MCP-Protocol-Version": MODERN,
         "Mcp-Method": "server/discover"}
    body = {"jsonrpc": "2.0", "id": 1, "method": "server/discover", "params": {"_meta": META}}
    r = httpx.post(server.url, json=body, headers=h, timeout=10)
    assert r.status_code == 200 and "mcp-session-id" not in r.headers
    res = r.json()["result"]
    assert MODERN in res["supportedVersions"] and res["resultType"] == "complete"
    assert res["ttlMs"] >= 0 and res["cacheScope"] in ("public", "private")
    body = {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
            "params": {"name": "echo", "arguments": {"text": "hi"}, "_meta": META}}
    r = httpx.post(server.url, json=body, timeout=10,
                   headers={**h, "Mcp-Method": "tools/call", "Mcp-Name": "echo"})
    assert r.json()["result"]["content"][0]["text"] == "hi"
    assert r.json()["result"]["resultType"] == "complete"
    for verb in ("GET", "DELETE"):
        assert httpx.request(verb, server.url, headers=h, timeout=10).status_code == 405


# ------------------------------------------------------------------------------ bad input


def _rpc(**kw: Any) -> bytes:
    return json.dumps({"jsonrpc": "2.0", **kw}).encode()


def _call(params: Any, id: Any = 1) -> bytes:
    return _rpc(id=id, method="tools/call", params=params)


# (name, path, extra headers or None to drop the session, body, status, code)
BAD = [
    ("malformed json", {}, b'{"jsonrpc": "2.0", "id": 1,', 400, errors.PARSE_ERROR),
    ("invalid utf-8", {}, b'{"jsonrpc":"2.0","id":1,"method":"\xff"}', 400, errors.PARSE_ERROR),
    ("deep nesting", {}, b"[" * 100_000 + b"]" * 100_000, 400, errors.PARSE_ERROR),
    ("batch", {}, b"[" + _rpc(id=1, method="ping") + b"]", 400, errors.INVALID_REQUEST),
    ("float id", {}, _rpc(id=1.5, method="ping"), 400, errors.INVALID_REQUEST),
    ("bool id", {}, _rpc(id=True, method="ping"), 400, errors.INVALID_REQUEST),
    ("object id", {}, _rpc(id={"a": 1}, method="ping"), 400, errors.INVALID_REQUEST),
    ("over-long id", {}, _rpc(id="i" * 257, method="ping"), 200, errors.INVALID_REQUEST),
    ("method not a string", {}, _rpc(id=1, method=["ping"]), 400, errors.INVALID_REQUEST),
    ("params not an object", {}, _rpc(id=1, method="tools/list", params=[1]), 200,
     errors.INVALID_PARAMS),
    ("tool name not a string", {}, _call({"name": 5}), 200, errors.INVALID_PARAMS),
    ("unknown tool", {}, _call({"name": "nope", "arguments": {}}), 200, errors.INVALID_PARAMS),
    ("cancel params not an object", {},
     _rpc(method="notifications/cancelled", params="1"), 400, errors.INVALID_PARAMS),
    ("cancel requestId float", {},
     _rpc(method="notifications/cancelled", params={"requestId": 1.5}), 400,
     errors.INVALID_PARAMS),
    ("unknown method", {}, _rpc(id=1, method="nope/nope"), 200, errors.METHOD_NOT_FOUND),
    ("no session", {"Mcp-Session-Id": None}, _rpc(id=1, method="ping"), 400,
     errors.INVALID_REQUEST),
    ("unknown session", {"Mcp-Session-Id": "A" * 32}, _rpc(id=1, method="ping"), 404,
     errors.INVALID_REQUEST),
    # one that cannot name a session (no minted id has a space, none is over 128 characters) is
    # unknown too: 404, on which a client opens a new session (it was 400, a transport failure)
    ("malformed session", {"Mcp-Session-Id": "bad id"}, _rpc(id=1, method="ping"), 404,
     errors.INVALID_REQUEST),
    ("over-long session", {"Mcp-Session-Id": "A" * 129}, _rpc(id=1, method="ping"), 404,
     errors.INVALID_REQUEST),
    # contract §6.1 "unknown → 404" holds for a client's JSON-RPC response too (it was 202)
    ("response, no session", {"Mcp-Session-Id": None}, _rpc(id=1, result={}), 400,
     errors.INVALID_REQUEST),
    ("response, unknown session", {"Mcp-Session-Id": "A" * 32}, _rpc(id=1, result={}), 404,
     errors.INVALID_REQUEST),
    ("unsupported version", {"MCP-Protocol-Version": "2024-01-01"}, _rpc(id=1, method="ping"),
     400, errors.UNSUPPORTED_PROTOCOL_VERSION),
    ("wrong content type", {"Content-Type": "text/plain"}, _rpc(id=1, method="ping"), 415,
     errors.INVALID_REQUEST),
    ("accept html only", {"Accept": "text/html"}, _rpc(id=1, method="ping"), 406,
     errors.INVALID_REQUEST),
    ("body over the limit", {}, b" " * 1_000_001, 413, errors.INVALID_REQUEST),
    ("foreign origin", {"Origin": "http://evil.example"}, _rpc(id=1, method="ping"), 403,
     errors.INVALID_REQUEST),
    ("rebinding look-alike origin", {"Origin": "http://localhost.evil.example:8000"},
     _rpc(id=1, method="ping"), 403, errors.INVALID_REQUEST),
    ("null origin", {"Origin": "null"}, _rpc(id=1, method="ping"), 403, errors.INVALID_REQUEST),
    ("modern header mismatch",
     {"MCP-Protocol-Version": MODERN, "Mcp-Method": "tools/list", "Mcp-Name": "echo"},
     _call({"name": "echo", "arguments": {}, "_meta": META}), 400, errors.HEADER_MISMATCH),
    ("modern unknown method", {"MCP-Protocol-Version": MODERN, "Mcp-Method": "nope"},
     _rpc(id=1, method="nope", params={"_meta": META}), 404, errors.METHOD_NOT_FOUND),
    ("modern missing _meta", {"MCP-Protocol-Version": MODERN, "Mcp-Method": "tools/list"},
     _rpc(id=1, method="tools/list"), 400, errors.INVALID_PARAMS),
    # contract §6.2: the header rung (-32020) comes before the version rung (-32022); a client
    # that disagrees with itself is told so (-32022 is what an auto client does not fall back
    # from). A version header sent twice reaches the app joined by gunicorn.
    ("modern body, version header of no revision",
     {"MCP-Protocol-Version": "2099-01-01", "Mcp-Method": "tools/list"},
     _rpc(id=1, method="tools/list", params={"_meta": META}), 400, errors.HEADER_MISMATCH),
    ("modern body, version header twice",
     {"MCP-Protocol-Version": f"{MODERN},{MODERN}", "Mcp-Method": "tools/list"},
     _rpc(id=1, method="tools/list", params={"_meta": META}), 400, errors.HEADER_MISMATCH),
]


@pytest.fixture(scope="module")
def bad_input_client(server: Gunicorn) -> Client:
    return Client(server.url)


@pytest.mark.parametrize("name, hdrs, body, status, code", BAD, ids=[b[0] for b in BAD])
def test_bad_input_over_http(server: Gunicorn, bad_input_client: Client, name: str,
                             hdrs: dict[str, str | None], body: bytes, status: int,
                             code: int) -> None:
    h: dict[str, str] = bad_input_client.headers()
    for k, v in hdrs.items():
        if v is None:
            h.pop(k, None)
        else:
            h[k] = v
    r = httpx.post(server.url, content=body, headers=h, timeout=15)
    assert r.status_code == status, r.text[:300]
    assert r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["code"] == code


@pytest.mark.parametrize("name, args, problem", [
    ("echo", "x", '"arguments" must be an object'),
    ("sleep", {"seconds": "x"}, '"seconds"'),   # the tool raises ToolError(INVALID_PARAMS)
    ("sleep", {"seconds": -1}, '"seconds"'),
])
def test_invalid_arguments_are_a_tool_execution_error(server: Gunicorn,
                                                      bad_input_client: Client, name: str,
                                                      args: Any, problem: str) -> None:
    """contract §5: the request was read, so HTTP 200; the problem is a result with isError that
    names it (an SDK client would raise a transport error on a 400)."""
    r = httpx.post(server.url, content=_call({"name": name, "arguments": args}),
                   headers=bad_input_client.headers(), timeout=15)
    assert r.status_code == 200, r.text[:300]
    result = r.json()["result"]
    assert result["isError"] is True
    text = result["content"][0]["text"]
    assert text.startswith(f"Invalid arguments for tool {name}: ") and problem in text, text


@pytest.mark.parametrize("version, body, code", [
    (LEGACY, _call({"name": "nope", "arguments": {}}), errors.INVALID_PARAMS),
    (LEGACY, _rpc(id=1, method="nope/nope"), errors.METHOD_NOT_FOUND),
    (LEGACY, _call({"name": "echo", "arguments": {}, "_meta": {"progressToken": [1]}}),
     errors.INVALID_PARAMS),
    (MODERN, _call({"name": "nope", "arguments": {}, "_meta": META}), errors.INVALID_PARAMS),
], ids=["unknown tool", "unknown method", "bad progress token", "modern unknown tool"])
def test_an_error_read_as_a_request_follows_accept(server: Gunicorn, bad_input_client: Client,
                                                   version: str, body: bytes,
                                                   code: int) -> None:
    """contract §5/§6.1: a request that was read is answered with HTTP 200, as
    ``application/json`` or as a ``text/event-stream``; a client that accepts only the event
    stream (not refused: 406 is for accepting neither) gets its error reply as an event, as it
    gets results, not as a JSON body it said it does not take."""
    h = {**bad_input_client.headers(version), "Accept": "text/event-stream"}
    if version == MODERN:
        h.pop("Mcp-Session-Id", None)
        h["Mcp-Method"], h["Mcp-Name"] = "tools/call", "nope"
    r = httpx.post(server.url, content=body, headers=h, timeout=15)
    assert r.status_code == 200, r.text[:300]
    assert r.headers["content-type"].startswith("text/event-stream"), r.headers
    msg = reply_of(r)
    assert (msg["id"], msg["error"]["code"]) == (1, code), msg


@pytest.mark.parametrize("n, header, status", [
    (10**400, "1", 400),              # an integer past float range, another value: a mismatch
    (10**400, "1" + "0" * 400, 200),  # the same value: it matches, the tool runs
    (42, "42", 200),
], ids=["huge mismatch", "huge match", "small match"])
def test_an_integer_param_header_past_float_range_is_no_5xx(server: Gunicorn, n: int,
                                                           header: str, status: int) -> None:
    """contract §5/§6.2: an ``Mcp-Param-*`` header is compared with the integer argument it
    mirrors; an argument too large for a float (JSON carries it; Python reads up to 4300
    digits) is compared as an integer, never an OverflowError answered 500 with a traceback."""
    h = {"Accept": ACCEPT, "Content-Type": "application/json", "MCP-Protocol-Version": MODERN,
         "Mcp-Method": "tools/call", "Mcp-Name": "count", "Mcp-Param-N": header}
    body = _call({"name": "count", "arguments": {"n": n}, "_meta": META}, id=4)
    logged = len(server.log())
    r = httpx.post(server.url, content=body, headers=h, timeout=15)
    assert r.status_code == status, r.text[:300]
    msg = r.json()
    if status == 200:
        assert msg["result"]["content"][0]["text"] == str(n)
    else:
        assert (msg["id"], msg["error"]["code"]) == (4, errors.HEADER_MISMATCH), msg
    assert "Traceback" not in server.log()[logged:]


def test_loopback_origin_is_served(server: Gunicorn, bad_input_client: Client) -> None:
    """contract §6.0: a page on loopback (any port) passes the default Origin check."""
    for origin in (f"http://127.0.0.1:{server.port}", "http://localhost:5173", "https://[::1]"):
        h = {**bad_input_client.headers(), "Origin": origin}
        r = httpx.post(server.url, content=_rpc(id=1, method="ping"), headers=h, timeout=15)
        assert (r.status_code, r.json().get("result")) == (200, {}), (origin, r.text[:300])


@pytest.mark.parametrize("length", [b"50000000", b"9" * 19, b"9" * 40])
def test_huge_declared_length_is_refused_before_reading(server: Gunicorn, length: bytes) -> None:
    """contract §5: an oversized body is 413, however many digits its Content-Length has (one
    of more than 18 digits was answered 400 "Invalid Content-Length")."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"POST /mcp HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Accept: application/json\r\nContent-Length: " + length + b"\r\n\r\n{")
        out = b""
        while chunk := s.recv(65536):  # a sync worker closes the connection after its reply
            out += chunk
    assert out.startswith(b"HTTP/1.1 413"), out[:200]
    assert b'"code":-32600' in out


def test_a_small_length_with_leading_zeros_is_not_413(server: Gunicorn) -> None:
    """contract §5: 413 is for an oversized body. ``Content-Length`` is ``1*DIGIT`` (RFC 9110),
    so ``000…0150`` declares 150 bytes: served, not refused as too large for its digit count."""
    body = _rpc(id=1, method="tools/list", params={"_meta": META})
    length = b"0" * 20 + str(len(body)).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"POST /mcp HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Accept: application/json\r\nMCP-Protocol-Version: " + MODERN.encode()
                  + b"\r\nMcp-Method: tools/list\r\nContent-Length: " + length + b"\r\n\r\n"
                  + body)
        out = b""
        while chunk := s.recv(65536):  # a sync worker closes the connection after its reply
            out += chunk
    assert out.startswith(b"HTTP/1.1 200"), out[:300]
    assert b'"tools":' in out


def test_chunked_body_over_the_limit_is_413(server: Gunicorn) -> None:
    def chunks() -> Iterator[bytes]:
        for _ in range(20):
            yield b" " * 60_000

    r = httpx.post(server.url, content=chunks(), timeout=15,
                   headers={"Content-Type": "application/json", "Accept": ACCEPT})
    assert r.status_code == 413 and r.json()["error"]["code"] == errors.INVALID_REQUEST


@pytest.mark.parametrize("method", ["ping", "tools/call"])
def test_a_body_shorter_than_its_length_is_refused_not_run(server: Gunicorn,
                                                           bad_input_client: Client,
                                                           method: str) -> None:
    """A client that declares more bytes than it sends, then half-closes: the message is
    incomplete (RFC 9112 §6.3), so it is 400 and the tool does not run; it was answered 200
    with the echo's result when it happened to be whole JSON."""
    params = {"name": "echo", "arguments": {"text": "never-run"}} if method == "tools/call" \
        else None
    body = _rpc(id=5, method=method, **({"params": params} if params else {}))
    head = "".join(f"{k}: {v}\r\n" for k, v in bad_input_client.headers().items())
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(f"POST /mcp HTTP/1.1\r\nHost: x\r\n{head}Content-Length: {len(body) + 60}"
                  f"\r\nConnection: close\r\n\r\n".encode() + body)
        s.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    assert out.startswith(b"HTTP/1.1 400"), out[:300]
    assert b"never-run" not in out and b'"code":-32600' in out


def _nested_calls(url: str, headers: dict[str, str]) -> list[tuple[int, dict[str, Any]]]:
    """The ``nested`` tool's result too deep for JSON, as structured content, in a ``content``
    result, and at the end of an SSE stream its progress opened: each reply's status and
    message."""
    out = []
    for n, args in enumerate([{"depth": 5000}, {"depth": 5000, "content": True},
                              {"depth": 5000, "steps": 2}], start=1):
        body = {"name": "nested", "arguments": args}
        if "steps" in args:
            body["_meta"] = {"progressToken": "deep"}
        try:
            r = httpx.post(url, content=_call(body, id=n), headers=headers, timeout=15)
        except httpx.TransportError as e:  # e.g. a stream cut short
            out.append((-1, {"transport error": repr(e)}))
        else:
            out.append((r.status_code, reply_of(r)))
    return out


@pytest.mark.parametrize("worker_class", ["sync", "gthread"])
def test_a_tool_result_too_deep_for_json_is_an_internal_error_not_a_500(
        shm_name: str, outdir: str, worker_class: str) -> None:
    """contract §5: a request that was read gets HTTP 200 carrying its response; a tool result
    JSON cannot carry is ``-32603`` (as one with a set in it is), also when it is nested
    past the interpreter's recursion limit (``RecursionError``, not ``ValueError``), and on an
    SSE stream already opened. The workers serve on; nothing is left in flight."""
    with start(shm_name, outdir, workers=2, worker_class=worker_class, threads=4) as g:
        pids = set(g.worker_pids())
        replies = _nested_calls(g.url, Client(g.url).headers())
        assert [status for status, _ in replies] == [200, 200, 200], replies
        for n, (_, reply) in enumerate(replies, start=1):
            assert reply["id"] == n and reply["error"]["code"] == errors.INTERNAL_ERROR, reply
        assert dump(shm_name)["in_flight"] == []
        assert set(g.worker_pids()) == pids
        assert "Internal Server Error" not in g.log() and "internal error handling" \
            not in g.log(), g.log_tail()


BASE_EXCEPTIONS = ("KeyboardInterrupt", "GeneratorExit", "CancelledError")


@pytest.mark.parametrize("worker_class", ["sync", "gthread"])
def test_a_tool_raising_a_base_exception_is_a_tool_error_not_a_500(
        shm_name: str, outdir: str, worker_class: str) -> None:
    """contract §5: a request that was read gets HTTP 200 carrying its response. A tool's own
    ``BaseException`` (asyncio's ``CancelledError`` leaking out of an ``asyncio.run``, a stray
    ``KeyboardInterrupt``: under gunicorn no signal raises one) escaped as gunicorn's HTML 500.
    It is the tool's error now, as an ``Exception`` is; the workers serve on."""
    with start(shm_name, outdir, workers=2, worker_class=worker_class, threads=4) as g:
        pids = set(g.worker_pids())
        c = Client(g.url)
        for n, kind in enumerate(BASE_EXCEPTIONS, start=1):
            r = c.post({"jsonrpc": "2.0", "id": n, "method": "tools/call",
                        "params": {"name": "raises", "arguments": {"kind": kind}}})
            assert r.status_code == 200, (kind, r.status_code, r.text[:300])
            reply = reply_of(r)
            assert reply["id"] == n and reply["result"]["isError"] is True, reply
            assert kind in reply["result"]["content"][0]["text"], reply
        assert c.call(9, "echo", {"text": "still here"})["result"]["content"][0]["text"] \
            == "still here"
        assert dump(shm_name)["in_flight"] == []
        assert set(g.worker_pids()) == pids
        assert "Internal Server Error" not in g.log(), g.log_tail()


def test_workers_survive_bad_input(server: Gunicorn, bad_input_client: Client) -> None:
    """After everything above (this test runs last in the module): same workers, serving."""
    pids = set(server.worker_pids())
    assert pids == server.initial_workers  # type: ignore[attr-defined]
    assert len(pids) == 3
    seen = set()
    for _ in range(12):
        reply = bad_input_client.call(9, "whoami", {})
        seen.add(int(reply["result"]["content"][0]["text"]))
    assert seen <= pids
    assert set(server.worker_pids()) == pids
    assert "Traceback" not in server.log()


@pytest.mark.slow
@pytest.mark.parametrize("worker_class", ["sync", "gthread"])
def test_a_body_that_stalls_is_a_4xx_before_the_worker_timeout(shm_name: str,
                                                              worker_class: str) -> None:
    """A client that sends its headers and part of its body, then nothing, keeping the
    connection open (slowloris): the body read had no deadline, so a ``sync`` worker stayed
    blocked until gunicorn's worker ``timeout`` killed it, and gunicorn answered that client
    500 with a traceback in the log (contract §5: no bad input yields a 5xx); a ``gthread``
    worker's thread stayed blocked for good. The example server, with a worker timeout of 14 s
    (the transport reads a body for at most ``body_timeout``, 10 s by default)."""
    with Gunicorn(None, registry_name=shm_name, config="examples/gunicorn/gunicorn.conf.py",
                  workers=1, worker_class=worker_class, threads=2,
                  extra_args=["--timeout", "14"]) as g:
        pid = g.worker_pids()
        with socket.create_connection(("127.0.0.1", g.port), timeout=30) as s:
            s.sendall(b"POST /mcp HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Accept: application/json\r\nContent-Length: 100\r\n\r\n"
                      b'{"jsonrpc":"2.0",')
            t0 = time.monotonic()
            out = b""
            while chunk := s.recv(65536):
                out += chunk
            took = time.monotonic() - t0
        status = int(out.split(b" ", 2)[1]) if out.startswith(b"HTTP/1.1 ") else None
        assert status is not None and 400 <= status < 500, (out[:300], took)
        assert b'"code":-32600' in out
        assert took < 13, took
        assert g.worker_pids() == pid  # the worker was not killed
        assert "Traceback" not in g.log() and "WORKER TIMEOUT" not in g.log()


@pytest.mark.slow
@pytest.mark.parametrize("worker_class", ["sync", "gthread"])
def test_a_body_that_trickles_is_a_4xx_before_the_worker_timeout(shm_name: str,
                                                                worker_class: str) -> None:
    """A client that sends its body one byte every 3 s (slowloris under the per-read timeout):
    ``body_timeout`` (10 s) was only checked between two reads of the body, and one read waits
    for all the bytes it asks for, each ``recv`` with a fresh timeout; so the body read outlived
    its deadline, a ``sync`` worker until gunicorn's worker ``timeout`` (20 s here) killed it
    (a 503 to that client, the worker replaced; contract §5: no bad input yields a 5xx), a
    ``gthread`` thread for as long as the client kept trickling."""
    with start(shm_name, tempfile.gettempdir(), workers=1, worker_class=worker_class,
               threads=1 if worker_class == "sync" else 2, extra_args=["--timeout", "20"]) as g:
        pid = g.worker_pids()
        with socket.create_connection(("127.0.0.1", g.port), timeout=3) as s:
            s.sendall(b"POST /mcp HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Accept: application/json\r\nContent-Length: 100\r\n\r\n{")
            t0 = time.monotonic()
            out = b""
            while time.monotonic() - t0 < 25:
                try:
                    chunk = s.recv(65536)
                except TimeoutError:
                    s.sendall(b" ")  # one byte every 3 s: each recv of the server gets one
                    continue
                if not chunk:
                    break
                out += chunk
            took = time.monotonic() - t0
        status = int(out.split(b" ", 2)[1]) if out.startswith(b"HTTP/1.1 ") else None
        assert status == 408, (out[:300], took)
        assert b'"code":-32600' in out
        assert took < 15, took
        assert g.worker_pids() == pid  # the worker was not killed
        assert "Traceback" not in g.log() and "WORKER TIMEOUT" not in g.log()
