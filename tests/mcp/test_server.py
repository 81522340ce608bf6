"""The WSGI transport in-process: real environ dicts (checked by ``wsgiref.validate``), a real
registry, real threads and sockets; no mocks. The HTTP-level tests against gunicorn are in
test_http.py and test_disconnect.py."""

from __future__ import annotations

import base64
import contextlib
import gc
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from helpers.background import lock_held
from helpers.rows import in_flight_count
from helpers.wsgi import Reply, environ_for, run

import shmcancel
from shmcancel import InvalidRegistryName, errors
from shmcancel.config import Config
from shmcancel.mcp import disconnect, wake
from shmcancel.mcp.sessions import SessionStore
from shmcancel.mcp.stop import RequestStopped
from shmcancel.mcp.wire import (
    CLIENT_CAPABILITIES_META_KEY,
    CLIENT_INFO_META_KEY,
    SERVER_INFO_META_KEY,
)
from shmcancel.mcp.wire import PROTOCOL_VERSION_META_KEY as PV_KEY
from shmcancel.server import McpServer, ToolError, progress
from shmcancel.shm.registry import Registry

MODERN = "2026-07-28"
DEADLINE = 5.0

# ------------------------------------------------------------------------------ the app


class Signals:
    """Per-test rendezvous between a running tool and the test (no sleeps as sync)."""

    def __init__(self) -> None:
        self.started: dict[str, threading.Event] = {}
        self.release: dict[str, threading.Event] = {}
        self.saw_cancel: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    def ev(self, table: dict[str, threading.Event], tag: str) -> threading.Event:
        with self._lock:
            return table.setdefault(tag, threading.Event())


def make_server(reg: Any, signals: Signals, **kw: Any) -> McpServer:
    server = McpServer(name="test-server", version="9.9", registry=reg, **kw)

    @server.tool("echo", description="echo", input_schema={
        "type": "object", "properties": {"text": {"type": "string"}}})
    def echo(conn, params):
        return params.get("text", "")

    @server.tool("wait")
    def wait(conn, params):
        """Run until cancelled (then -32800) or released (then "released")."""
        tag = params["tag"]
        signals.ev(signals.started, tag).set()
        release = signals.ev(signals.release, tag)
        end = time.monotonic() + DEADLINE
        while time.monotonic() < end:
            if shmcancel.cancelled(conn):
                signals.ev(signals.saw_cancel, tag).set()
                if params.get("finish_anyway"):
                    return "finished anyway"
                raise ToolError(errors.REQUEST_CANCELLED, "Request cancelled")
            if release.wait(0.002):
                return "released"
        return "deadline"

    @server.tool("stubborn")
    def stubborn(conn, params):
        """Ignore cancellation; run until released or 10 s pass."""
        tag = params["tag"]
        signals.ev(signals.started, tag).set()
        release = signals.ev(signals.release, tag)
        end = time.monotonic() + 10
        while time.monotonic() < end and not release.is_set():
            if shmcancel.cancelled(conn):
                signals.ev(signals.saw_cancel, tag).set()
            time.sleep(0.002)
        return "stubborn done"

    @server.tool("boom")
    def boom(conn, params):
        raise RuntimeError("kaput")

    @server.tool("interrupt")
    def interrupt(conn, params):
        raise KeyboardInterrupt

    @server.tool("unprintable")
    def unprintable(conn, params):
        """An exception whose ``str()`` raises (its argument's ``repr`` does)."""
        class Opaque:
            def __repr__(self) -> str:
                raise RuntimeError("no repr")
        raise ValueError(Opaque())

    @server.tool("garbage")
    def garbage(conn, params):
        return params.get("value", 42)

    @server.tool("notjson")
    def notjson(conn, params):
        return {"content": [{"type": "text", "text": "x"}], "bad": {1, 2}}

    @server.tool("fail")
    def fail(conn, params):
        raise ToolError(params.get("code", -32050), "it failed", {"why": "test"})

    @server.tool("progress")
    def prog(conn, params):
        sent = [progress(conn, i, 3, f"step {i}") for i in range(1, 4)]
        return json.dumps(sent)

    return server


# ------------------------------------------------------------------------------ WSGI client


def post(app: Any, obj: Any, *, headers: dict[str, str] | None = None, raw: bytes | None = None,
         **kw: Any) -> Reply:
    body = raw if raw is not None else json.dumps(obj).encode()
    return run(app, environ_for("POST", body, headers=headers, **kw))


def rpc(id: Any, method: str, params: Any = None) -> dict[str, Any]:
    m: dict[str, Any] = {"jsonrpc": "2.0", "id": id, "method": method}
    if params is not None:
        m["params"] = params
    return m


def note(method: str, params: Any = None) -> dict[str, Any]:
    m: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
    if params is not None:
        m["params"] = params
    return m


INIT = rpc(0, "initialize", {"protocolVersion": "2025-11-25", "capabilities": {},
                             "clientInfo": {"name": "t", "version": "1"}})
META = {PV_KEY: MODERN, CLIENT_INFO_META_KEY: {"name": "t", "version": "1"},
        CLIENT_CAPABILITIES_META_KEY: {}}


def modern(app: Any, id: Any, method: str, params: dict | None = None, *,
           name: str | None = None, headers: dict | None = None, **kw: Any) -> Reply:
    p = dict(params or {})
    p.setdefault("_meta", META)
    h = {"MCP-Protocol-Version": MODERN, "Mcp-Method": method}
    if name is not None:
        h["Mcp-Name"] = name
    h.update(headers or {})
    return post(app, rpc(id, method, p), headers=h, **kw)


# ------------------------------------------------------------------------------ fixtures


@pytest.fixture
def reg(shm_name: str) -> Iterator[Registry]:
    r = Registry.create(shm_name, Config(capacity=256, max_rows=256, in_flight_capacity=64,
                                         session_capacity=8, max_rows_per_scope=2,
                                         stream_cancel_timeout=0.3))
    try:
        yield r
    finally:
        r.close()


@pytest.fixture
def signals() -> Signals:
    return Signals()


@pytest.fixture
def app(reg: Registry, signals: Signals) -> McpServer:
    return make_server(reg, signals)


@pytest.fixture
def stateless(reg: Registry, signals: Signals) -> McpServer:
    return make_server(reg, signals, sessions=False)


def session(app: Any) -> str:
    r = post(app, INIT)
    assert r.status == 200, r
    sid = r.headers["mcp-session-id"]
    assert post(app, note("notifications/initialized"),
                headers={"Mcp-Session-Id": sid, "MCP-Protocol-Version": "2025-11-25"}).status == 202
    return sid


def legacy_headers(sid: str | None) -> dict[str, str]:
    h = {"MCP-Protocol-Version": "2025-11-25"}
    if sid is not None:
        h["Mcp-Session-Id"] = sid
    return h


def tables_empty(reg: Registry) -> bool:
    return in_flight_count(reg) == 0 and reg.table("cancellations").count() == 0


class Call(threading.Thread):
    """A POST run in a thread (a request blocked in its tool), its Reply kept."""

    def __init__(self, app: Any, env: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.app, self.env = app, env
        self.reply: Reply | None = None
        self.done_at: float | None = None

    def run(self) -> None:
        self.reply = run(self.app, self.env)
        self.done_at = time.monotonic()

    def result(self) -> Reply:
        self.join(DEADLINE + 5)
        assert self.reply is not None, "request did not finish"
        return self.reply


def start_call(app: Any, id: Any, tool: str, args: dict, headers: dict | None = None,
               extra: dict | None = None) -> Call:
    body = json.dumps(rpc(id, "tools/call", {"name": tool, "arguments": args})).encode()
    c = Call(app, environ_for("POST", body, headers=headers, extra=extra))
    c.start()
    return c


def wait_ev(ev: threading.Event) -> None:
    assert ev.wait(DEADLINE), "timed out"


# ------------------------------------------------------------------------------ legacy wire


def test_a_hold_around_the_app_is_not_taken_for_one_the_request_left(
        stateless: McpServer, reg: Registry, caplog: pytest.LogCaptureFixture) -> None:
    """The transport ends a hold of the registry lock that a request left behind (a signal
    handler's exception as the release was entered), down to the depth at the request's start:
    a middleware holding the lock around the app keeps its hold, whether the request left one
    or not, and only a hold the request left is logged."""
    @stateless.tool("leaves_lock")
    def leaves_lock(conn, params):
        reg.lock.__enter__()
        return "left"

    def body(tool: str) -> bytes:
        return json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                           "params": {"name": tool, "arguments": {"text": "x"}}}).encode()

    for tool, leaks in (("echo", False), ("leaves_lock", True)):
        caplog.clear()
        with reg.lock:
            reply = run(stateless, environ_for("POST", body(tool)), validate=False)
            assert reply.status == 200 and "result" in reply.json, reply
            assert reg.lock.held_by_me() and reg.lock.owner() is not None
        assert not reg.lock.held_by_me() and reg.lock.owner() is None
        assert any("outlived its block" in r.getMessage() for r in caplog.records) == leaks
    caplog.clear()
    reply = run(stateless, environ_for("POST", body("leaves_lock")), validate=False)
    assert reply.status == 200 and not reg.lock.held_by_me() and reg.lock.owner() is None
    assert any("outlived its block" in r.getMessage() for r in caplog.records)


def test_legacy_handshake_and_methods(app: McpServer, reg: Registry) -> None:
    r = post(app, INIT)
    assert r.status == 200
    res = r.json["result"]
    assert r.json["id"] == 0
    assert res["protocolVersion"] == "2025-11-25"
    assert res["serverInfo"] == {"name": "test-server", "version": "9.9"}
    assert res["capabilities"] == {"tools": {"listChanged": False}}
    assert "resultType" not in res
    sid = r.headers["mcp-session-id"]
    assert len(sid) >= 22 and all(0x21 <= ord(ch) <= 0x7E for ch in sid)
    h = legacy_headers(sid)
    assert post(app, note("notifications/initialized"), headers=h).status == 202
    assert post(app, rpc(1, "ping"), headers=h).json == {"jsonrpc": "2.0", "id": 1, "result": {}}
    tools = post(app, rpc(2, "tools/list"), headers=h).json["result"]["tools"]
    assert {t["name"] for t in tools} >= {"echo", "wait", "boom"}
    echo = next(t for t in tools if t["name"] == "echo")
    assert echo["inputSchema"]["type"] == "object" and echo["description"] == "echo"
    r = post(app, rpc("c", "tools/call", {"name": "echo", "arguments": {"text": "hé"}}), headers=h)
    assert r.json == {"jsonrpc": "2.0", "id": "c",
                      "result": {"content": [{"type": "text", "text": "hé"}], "isError": False}}
    assert tables_empty(reg)


@pytest.mark.parametrize("requested, answered", [
    ("2025-11-25", "2025-11-25"), ("2025-06-18", "2025-06-18"), ("2025-03-26", "2025-03-26"),
    ("2024-11-05", "2025-11-25"), ("2099-01-01", "2025-11-25"), ("", "2025-11-25"),
])
def test_initialize_negotiates_version(app: McpServer, requested: str, answered: str) -> None:
    r = post(app, rpc(1, "initialize", {"protocolVersion": requested, "capabilities": {},
                                        "clientInfo": {"name": "c", "version": "0"}}))
    assert r.json["result"]["protocolVersion"] == answered


def test_sessions_are_shared_between_workers(app: McpServer, reg: Registry, signals: Signals,
                                             shm_name: str) -> None:
    other = make_server(shm_name, signals)  # another "worker": attaches the registry by name
    sid = session(app)
    r = post(other, rpc(1, "tools/call", {"name": "echo", "arguments": {"text": "x"}}),
             headers=legacy_headers(sid))
    assert r.status == 200 and r.json["result"]["content"][0]["text"] == "x"


def test_session_errors(app: McpServer) -> None:
    call = rpc(1, "tools/list")
    r = post(app, call, headers=legacy_headers(None))
    assert (r.status, r.json["error"]["code"], r.json["id"]) == (400, errors.INVALID_REQUEST, 1)
    r = post(app, call, headers=legacy_headers("nope-" + "0" * 30))
    assert (r.status, r.json["error"]["code"]) == (404, errors.INVALID_REQUEST)
    for bad in ("x" * 129, "has space", "é"):  # names no session: unknown, 404 (§5), not 400
        r = post(app, call, headers=legacy_headers(bad))
        assert (r.status, r.json["error"]["code"], r.json["id"]) == (404, errors.INVALID_REQUEST,
                                                                     1), bad
    # notifications need the session too
    r = post(app, note("notifications/cancelled", {"requestId": 1}), headers=legacy_headers(None))
    assert r.status == 400


def test_stateless_legacy_mints_no_session(stateless: McpServer) -> None:
    r = post(stateless, INIT)
    assert r.status == 200 and "mcp-session-id" not in r.headers
    r = post(stateless, rpc(1, "tools/list"), headers=legacy_headers("whatever"))
    assert r.status == 200 and r.json["result"]["tools"]
    r = run(stateless, environ_for("DELETE", None, headers=legacy_headers("whatever")))
    assert r.status == 405


def test_get_and_other_methods_are_405(app: McpServer) -> None:
    for method in ("GET", "PUT", "PATCH", "OPTIONS"):
        r = run(app, environ_for(method, None, content_type=None, content_length=None))
        assert r.status == 405 and "POST" in r.headers["allow"], method
        assert r.json["error"]["code"] == errors.INVALID_REQUEST
    r = run(app, environ_for("GET", None, headers={"MCP-Protocol-Version": MODERN}))
    assert r.status == 405 and r.headers["allow"] == "POST"


def test_wrong_path_is_404(app: McpServer) -> None:
    assert post(app, INIT, path="/other").status == 404


def test_delete_ends_the_session_and_cancels_its_requests(app: McpServer, reg: Registry,
                                                          signals: Signals) -> None:
    sid = session(app)
    other = session(app)
    h = legacy_headers(sid)
    calls = [start_call(app, i, "wait", {"tag": f"d{i}"}, h) for i in (1, 2)]
    bystander = start_call(app, 1, "wait", {"tag": "other"}, legacy_headers(other))
    for tag in ("d1", "d2", "other"):
        wait_ev(signals.ev(signals.started, tag))
    r = run(app, environ_for("DELETE", None, headers=h, content_type=None))
    assert r.status == 204
    for c in calls:
        reply = c.result()
        assert reply.json["error"]["code"] == errors.REQUEST_CANCELLED
    assert not signals.ev(signals.saw_cancel, "other").is_set()
    assert bystander.is_alive()
    signals.ev(signals.release, "other").set()
    assert bystander.result().json["result"]["content"][0]["text"] == "released"
    # the session is gone everywhere
    assert post(app, rpc(3, "ping"), headers=h).status == 404
    assert run(app, environ_for("DELETE", None, headers=h)).status == 404
    assert run(app, environ_for("DELETE", None, headers=legacy_headers(None))).status == 400
    assert tables_empty(reg)



def test_a_session_minted_for_a_principal_is_unknown_to_another(app: McpServer,
                                                                   signals: Signals) -> None:
    """A leaked session id is no key to another principal's session: bob's requests with
    alice's session id (a call, a cancel of her running call, a DELETE), and those of a caller
    without a principal (a server whose authentication is optional), are answered 404, as for
    a session they do not know, and her session and call carry on."""
    alice, bob = ({"shmcancel.principal": {"id": who}} for who in ("alice", "bob"))
    r = post(app, INIT, extra=alice)
    assert r.status == 200, r
    h = legacy_headers(r.headers["mcp-session-id"])
    assert post(app, note("notifications/initialized"), headers=h, extra=alice).status == 202
    call = start_call(app, 1, "wait", {"tag": "alice"}, h, extra=alice)
    wait_ev(signals.ev(signals.started, "alice"))
    assert post(app, rpc(2, "ping"), headers=h, extra=bob).status == 404
    assert post(app, note("notifications/cancelled", {"requestId": 1}), headers=h,
                extra=bob).status == 404
    assert run(app, environ_for("DELETE", None, headers=h, content_type=None,
                                extra=bob)).status == 404
    assert post(app, rpc(3, "ping"), headers=h, extra=alice).status == 200
    assert not signals.ev(signals.saw_cancel, "alice").is_set()
    # nor a request without a principal (an optional-auth server's anonymous caller)
    assert post(app, rpc(4, "ping"), headers=h).status == 404
    assert post(app, note("notifications/cancelled", {"requestId": 1}),
                headers=h).status == 404
    assert run(app, environ_for("DELETE", None, headers=h, content_type=None)).status == 404
    assert not signals.ev(signals.saw_cancel, "alice").is_set()
    assert run(app, environ_for("DELETE", None, headers=h, content_type=None,
                                extra=alice)).status == 204
    assert call.result().json["error"]["code"] == errors.REQUEST_CANCELLED
    # minted anonymously: its own address, authenticated since, may use it; elsewhere not
    h = legacy_headers(session(app))
    assert post(app, rpc(5, "ping"), headers=h, extra=bob).status == 200
    assert post(app, rpc(6, "ping"), headers=h,
                extra={**bob, "REMOTE_ADDR": "198.51.100.1"}).status == 404
    # anonymous, from any address (an anonymous client's address moves)
    assert post(app, rpc(7, "ping"), headers=h,
                extra={"REMOTE_ADDR": "198.51.100.1"}).status == 200


def test_delete_landing_between_a_calls_session_check_and_its_tracking_cancels_it(
        app: McpServer, reg: Registry, signals: Signals, monkeypatch: pytest.MonkeyPatch) -> None:
    """contract §6.1: a DELETE cancels every request still in flight in its session. A
    ``tools/call`` checks its session (``begin_call``) and only then is tracked
    (``Cancellation.begin``); a DELETE landing in between (another worker) found nothing in
    flight to cancel, and the call then ran its whole course in a session that no longer
    existed (up to 60 s for the example's ``sleep``). Now it is answered ``-32800`` and its
    tool never runs."""
    sid = session(app)
    h = legacy_headers(sid)
    c = app._process_state().cancellation
    begin = c.begin

    def delete_first(request_id: object, scope: str) -> Any:
        if scope == "session:" + sid:
            r = run(app, environ_for("DELETE", None, headers=h, content_type=None))
            assert r.status == 204
        return begin(request_id, scope)

    monkeypatch.setattr(c, "begin", delete_first)
    signals.ev(signals.release, "late").set()  # a tool that did run would return at once
    reply = start_call(app, 1, "wait", {"tag": "late"}, h).result()
    assert reply.status == 200
    assert reply.json["error"]["code"] == errors.REQUEST_CANCELLED, reply.json
    assert not signals.ev(signals.started, "late").is_set(), "the tool ran"
    assert post(app, rpc(3, "ping"), headers=h).status == 404
    assert tables_empty(reg)


@pytest.fixture
def short_reg(shm_name: str) -> Iterator[Registry]:
    """A registry whose lock waits 0.3 s for a live holder (``lock_timeout``)."""
    r = Registry.create(shm_name, Config(capacity=64, max_rows=64, in_flight_capacity=16,
                                         session_capacity=4, lock_timeout=0.3))
    try:
        yield r
    finally:
        r.close()


def stall_session_delete(monkeypatch: pytest.MonkeyPatch, app: McpServer, *, after: bool
                         ) -> contextlib.ExitStack:
    """Make the next session delete of ``app`` meet a stalled lock: another thread takes the
    registry lock and keeps it, before the delete (which then times out) or, ``after``, once it
    is done; until the returned stack is closed. Later deletes run as they are."""
    st = app._process_state()
    stall = contextlib.ExitStack()
    delete = st.sessions.delete

    def stalled(session_id: str) -> bool:
        monkeypatch.setattr(st.sessions, "delete", delete)
        if not after:
            stall.enter_context(lock_held(st.registry, hold_for=DEADLINE))
        done = delete(session_id)
        if after:
            stall.enter_context(lock_held(st.registry, hold_for=DEADLINE))
        return done

    monkeypatch.setattr(st.sessions, "delete", stalled)
    return stall


def call_in_a_session(app: McpServer, signals: Signals, tool: str, tag: str
                      ) -> tuple[dict[str, str], Call]:
    """A new session of ``app``'s, its headers, and call 1 of ``tool`` (tagged ``tag``) running
    in it, its tool started."""
    h = legacy_headers(session(app))
    call = start_call(app, 1, tool, {"tag": tag}, h)
    wait_ev(signals.ev(signals.started, tag))
    return h, call


def waiting_tool(app: McpServer, signals: Signals) -> None:
    """Give ``app`` the tool ``waiter``: it waits in ``wait_cancelled`` (30 s), then answers
    ``-32800`` if cancelled, else ``"slept"``."""
    @app.tool("waiter")
    def waiter(conn, params):
        signals.ev(signals.started, params["tag"]).set()
        if shmcancel.server.wait_cancelled(conn, 30):
            raise ToolError(errors.REQUEST_CANCELLED, "Request cancelled")
        return "slept"


def test_a_delete_stalled_after_ending_the_session_has_cancelled_its_calls(
        short_reg: Registry, signals: Signals, monkeypatch: pytest.MonkeyPatch) -> None:
    """contract §6.1, §5: a DELETE whose registry lock stalls (a live holder, past
    ``lock_timeout``) is answered 503 "retry later". It ended the session, then cancelled its
    calls, a lock each: a stall landing in between left the calls running, and the client's
    retry found no session (404). The calls are now cancelled before the session goes (and
    again after, for a call that began meanwhile): whatever the 503, none in flight before the
    DELETE runs on."""
    app = make_server(short_reg, signals)
    h, call = call_in_a_session(app, signals, "wait", "s")
    with stall_session_delete(monkeypatch, app, after=True) as stall:
        r = run(app, environ_for("DELETE", None, headers=h, content_type=None))
        # 503 when the pass after the session went met the stall; 204 when the call, cancelled
        # by the pass before, had already ended (its lane row goes without the lock)
        assert r.status == 204 or (r.status == 503 and r.headers["retry-after"]), r
        stall.close()
        reply = call.result()
    assert reply.json["error"]["code"] == errors.REQUEST_CANCELLED, reply.json
    assert run(app, environ_for("DELETE", None, headers=h)).status == 404


@pytest.fixture
def cancelled_events() -> Iterator[list[dict[str, Any]]]:
    """The metadata of every ``request cancelled`` event emitted during the test."""
    seen: list[dict[str, Any]] = []
    shmcancel.telemetry.attach("test-server-cancelled", ("shmcancel", "request", "cancelled"),
                               lambda e, m, md, cfg: seen.append(md))
    try:
        yield seen
    finally:
        shmcancel.telemetry.detach("test-server-cancelled")


def test_two_racing_deletes_report_each_call_cancelled_once(
        app: McpServer, signals: Signals, monkeypatch: pytest.MonkeyPatch,
        cancelled_events: list[dict[str, Any]]) -> None:
    """contract §4.7, §6.1: two DELETEs of one session racing (a client's retry, two workers):
    one ends it (204), the other finds it gone (404). Both cancelled its calls before ending
    it, each emitting the call's event, so a call was reported cancelled twice, once by a
    DELETE that ended nothing. Only the DELETE that ends the session reports its calls."""
    st = app._process_state()
    h, call = call_in_a_session(app, signals, "stubborn", "r")
    delete = st.sessions.delete
    other: list[Reply] = []

    def the_other_delete_first(session_id: str) -> bool:
        monkeypatch.setattr(st.sessions, "delete", delete)
        other.append(run(app, environ_for("DELETE", None, headers=h, content_type=None)))
        return delete(session_id)

    try:
        monkeypatch.setattr(st.sessions, "delete", the_other_delete_first)
        r = run(app, environ_for("DELETE", None, headers=h, content_type=None))
        assert (other[0].status, r.status) == (204, 404), (other, r)
        wait_ev(signals.ev(signals.saw_cancel, "r"))
    finally:
        signals.ev(signals.release, "r").set()
        call.join(DEADLINE)
    assert [e["request_id"] for e in cancelled_events] == ["1"], cancelled_events


def test_a_session_whose_row_a_stalled_writer_holds_is_503_not_404(
        short_reg: Registry, signals: Signals) -> None:
    """contract §5: a lock held past ``lock_timeout`` by a live process is 503 with
    ``Retry-After``; §6.1: 404 is for a session that does not exist. A live writer stopped in
    the middle of a write to the session's bucket sends the session's lock-free read to the
    lock, which times out: that was read as "no such session", so the client was told 404 (an
    SDK client drops its session for good) and a call in it was cancelled "session deleted"."""
    app = make_server(short_reg, signals)
    sid = session(app)
    h = legacy_headers(sid)
    assert post(app, rpc(1, "ping"), headers=h).status == 200
    table = app._process_state().sessions._table
    b = table.prepare(sid).b
    holding, release = threading.Event(), threading.Event()

    def writer_stopped_mid_write() -> None:
        with short_reg.lock:
            v = table._ver[b]
            table._ver[b] = v + 1  # odd: a write to the session's bucket under way
            holding.set()
            release.wait(DEADLINE)
            table._ver[b] = v + 2  # the write done

    t = threading.Thread(target=writer_stopped_mid_write, daemon=True)
    t.start()
    assert holding.wait(DEADLINE)
    try:
        for r in (post(app, rpc(2, "ping"), headers=h),
                  post(app, rpc(3, "tools/call", {"name": "echo", "arguments": {"text": "x"}}),
                       headers=h),
                  run(app, environ_for("DELETE", None, headers=h, content_type=None))):
            assert r.status == 503 and r.headers["retry-after"], r
    finally:
        release.set()
        t.join(DEADLINE)
    r = post(app, rpc(4, "tools/call", {"name": "echo", "arguments": {"text": "x"}}), headers=h)
    assert r.status == 200 and r.json["result"]["content"][0]["text"] == "x", r


def test_a_delete_retried_after_a_stall_reports_each_call_cancelled_once(
        short_reg: Registry, signals: Signals, monkeypatch: pytest.MonkeyPatch,
        cancelled_events: list[dict[str, Any]]) -> None:
    """contract §4.7, §5: a DELETE whose session step meets a stalled lock is answered 503
    "retry later", and the session stays; its calls were cancelled already. The retry
    cancelled them again and reported each a second time: a DELETE answered 503 reports
    nothing, the retry that ends the session reports every call once."""
    app = make_server(short_reg, signals)
    h, call = call_in_a_session(app, signals, "stubborn", "s")
    try:
        with stall_session_delete(monkeypatch, app, after=False):
            r = run(app, environ_for("DELETE", None, headers=h, content_type=None))
            assert r.status == 503 and r.headers["retry-after"], r
        assert run(app, environ_for("DELETE", None, headers=h, content_type=None)).status == 204
        wait_ev(signals.ev(signals.saw_cancel, "s"))
        assert [e["request_id"] for e in cancelled_events] == ["1"], cancelled_events
    finally:
        signals.ev(signals.release, "s").set()
        call.join(DEADLINE)


def waiting_in_a_session(app: McpServer, signals: Signals) -> tuple[dict[str, str], Call]:
    """A session's headers and its call 1 of ``waiter`` once the tool waits in
    ``wait_cancelled`` (with ``rings_only``, only a ring ends that wait)."""
    waiting_tool(app, signals)
    h, call = call_in_a_session(app, signals, "waiter", "w")
    end = time.monotonic() + DEADLINE
    while wake.waiting() < 1:
        assert time.monotonic() < end, "the tool never waited"
        time.sleep(0.001)
    return h, call


def assert_woken_and_cancelled(call: Call) -> None:
    call.join(DEADLINE)
    assert not call.is_alive(), "the waiting call was not woken"
    assert call.reply is not None
    assert call.reply.json["error"]["code"] == errors.REQUEST_CANCELLED, call.reply.json


def test_a_delete_stalled_after_ending_the_session_wakes_its_waiting_calls(
        short_reg: Registry, signals: Signals, monkeypatch: pytest.MonkeyPatch,
        rings_only: None) -> None:
    """README: ``wait_cancelled`` returns as soon as its call is cancelled (the DELETE rings
    the doorbells). A DELETE that cancelled the calls, ended the session, then met a stalled
    lock in its pass after (503) rang no bell: the retry finds no session (404) and rings
    none either, so a call waiting in ``wait_cancelled`` slept its whole wait."""
    app = make_server(short_reg, signals)
    h, call = waiting_in_a_session(app, signals)
    with stall_session_delete(monkeypatch, app, after=True):
        r = run(app, environ_for("DELETE", None, headers=h, content_type=None))
        assert r.status == 503, r
    assert_woken_and_cancelled(call)


def test_a_notification_wakes_the_call_it_cancels(short_reg: Registry, signals: Signals,
                                                  rings_only: None) -> None:
    """README: ``wait_cancelled`` returns as soon as its call is cancelled: the worker that
    records a ``notifications/cancelled`` rings the doorbells of the processes running it. With
    nothing else looking at the waits (``rings_only``), a notification that did not ring would
    leave the call waiting its 30 s."""
    app = make_server(short_reg, signals)
    h, call = waiting_in_a_session(app, signals)
    assert post(app, note("notifications/cancelled", {"requestId": 1}), headers=h).status == 202
    assert_woken_and_cancelled(call)


def test_a_delete_stalled_in_its_first_pass_wakes_the_calls_it_cancelled(
        short_reg: Registry, signals: Signals, monkeypatch: pytest.MonkeyPatch,
        rings_only: None) -> None:
    """README: ``wait_cancelled`` returns as soon as its call is cancelled. A DELETE's first
    pass cancels its calls one lock each; a stall landing after the first of them (503) left
    that call cancelled but rang no bell (only a pass that returned was rung for), so the call
    waiting in ``wait_cancelled`` slept its whole wait, and the retry need never come."""
    reg = short_reg
    app = make_server(reg, signals)
    waiting_tool(app, signals)
    st = app._process_state()
    store = st.cancellation._store
    record = store.record
    stall = contextlib.ExitStack()
    recorded: list[str] = []

    def record_then_stall(scope: str, rid: str, *a: Any, **kw: Any) -> bool:
        done = record(scope, rid, *a, **kw)
        if done and not recorded:
            recorded.append(rid)
            stall.enter_context(lock_held(reg, hold_for=DEADLINE))  # another thread keeps it
        return done

    calls: dict[str, Any] = {}
    try:
        sid = session(app)
        h = legacy_headers(sid)
        for i in (1, 2):
            calls[str(i)] = start_call(app, i, "waiter", {"tag": f"w{i}"}, h)
            wait_ev(signals.ev(signals.started, f"w{i}"))
        end = time.monotonic() + DEADLINE
        while wake.waiting() < 2:  # their waits registered: only a ring ends them (rings_only)
            assert time.monotonic() < end, "the tools never waited"
            time.sleep(0.001)
        monkeypatch.setattr(store, "record", record_then_stall)
        r = run(app, environ_for("DELETE", None, headers=h, content_type=None))
        assert r.status == 503, r
        assert recorded, "the first pass recorded nothing"
        call = calls[recorded[0]]
        call.join(DEADLINE)  # the stall still on: only the bell wakes it
        assert not call.is_alive(), "the call the first pass cancelled was not woken"
        assert call.reply is not None
        assert call.reply.json["error"]["code"] == errors.REQUEST_CANCELLED, call.reply.json
    finally:
        stall.close()
        monkeypatch.undo()
        if calls:
            run(app, environ_for("DELETE", None, headers=h, content_type=None))
        for c in calls.values():
            c.join(DEADLINE)


def test_a_handler_raising_on_a_deletes_event_leaves_no_call_of_the_session_running(
        app: McpServer, signals: Signals, monkeypatch: pytest.MonkeyPatch) -> None:
    """contract §4.7: a handler's ``BaseException`` (a signal's SystemExit, KeyboardInterrupt)
    propagates out of the call that emitted the event, so an event is emitted only once the
    state it reports is written. A DELETE reported its first pass's calls right after the
    session went, before its pass after (and before telling other hosts): a handler raising
    there left a call begun in between running in the ended session, the retry answered 404.
    The events now come once every write of the DELETE is done."""
    st = app._process_state()
    h, early = call_in_a_session(app, signals, "wait", "early")
    delete = st.sessions.delete
    late: list[Any] = []

    def a_call_begins_first(session_id: str) -> bool:  # after the first pass, before the end
        late.append(start_call(app, 2, "wait", {"tag": "late"}, h))
        wait_ev(signals.ev(signals.started, "late"))
        return delete(session_id)

    def interrupted(event: Any, measurements: Any, metadata: Any, config: Any) -> None:
        raise KeyboardInterrupt  # a signal arriving while the handler runs

    monkeypatch.setattr(st.sessions, "delete", a_call_begins_first)
    shmcancel.telemetry.attach("test-server-interrupted", ("shmcancel", "request", "cancelled"),
                               interrupted)
    try:
        with pytest.raises(KeyboardInterrupt):
            run(app, environ_for("DELETE", None, headers=h, content_type=None))
        shmcancel.telemetry.detach("test-server-interrupted")
        assert early.result().json["error"]["code"] == errors.REQUEST_CANCELLED
        assert late, "no call began"
        assert run(app, environ_for("DELETE", None, headers=h)).status == 404  # the retry
        reply = late[0].result()
        assert reply.json.get("error", {}).get("code") == errors.REQUEST_CANCELLED, reply.json
    finally:
        shmcancel.telemetry.detach("test-server-interrupted")
        for tag in ("early", "late"):
            signals.ev(signals.release, tag).set()
        for c in (early, *late):
            c.join(DEADLINE)


def test_a_delete_stalled_after_ending_the_session_reports_its_calls_once(
        short_reg: Registry, signals: Signals, monkeypatch: pytest.MonkeyPatch,
        cancelled_events: list[dict[str, Any]]) -> None:
    """contract §4.7: a DELETE whose pass after the session went meets a stalled lock (503) has
    ended the session: its retry finds none (404) and reports nothing, so the calls its first
    pass cancelled are reported by it, once, though the events come after its writes."""
    app = make_server(short_reg, signals)
    h, call = call_in_a_session(app, signals, "stubborn", "s")
    try:
        with stall_session_delete(monkeypatch, app, after=True):
            r = run(app, environ_for("DELETE", None, headers=h, content_type=None))
            assert r.status == 503, r
        assert run(app, environ_for("DELETE", None, headers=h)).status == 404
        assert [e["request_id"] for e in cancelled_events] == ["1"], cancelled_events
    finally:
        signals.ev(signals.release, "s").set()
        call.join(DEADLINE)


def test_client_posted_responses_are_accepted_on_legacy(app: McpServer) -> None:
    sid = session(app)
    r = post(app, {"jsonrpc": "2.0", "id": 5, "result": {}}, headers=legacy_headers(sid))
    assert r.status == 202 and r.body == b""


# ---------------------------------------------------------------- notifications/cancelled


def test_cancel_notification_cancels_a_call_in_flight(app: McpServer, reg: Registry,
                                                      signals: Signals) -> None:
    sid = session(app)
    h = legacy_headers(sid)
    c = start_call(app, 7, "wait", {"tag": "t"}, h)
    wait_ev(signals.ev(signals.started, "t"))
    t0 = time.monotonic()
    r = post(app, note("notifications/cancelled", {"requestId": 7, "reason": "user hit stop"}),
             headers=h)
    assert r.status == 202 and r.body == b""
    reply = c.result()
    assert reply.json["error"]["code"] == errors.REQUEST_CANCELLED
    assert reply.json["id"] == 7
    assert reply.json["error"].get("data", {}).get("reason") == "user hit stop"
    assert c.done_at is not None and c.done_at - t0 < 0.5
    assert tables_empty(reg)


def test_cancel_notification_by_string_id_matches_int(app: McpServer, signals: Signals) -> None:
    sid = session(app)
    c = start_call(app, 8, "wait", {"tag": "s"}, legacy_headers(sid))
    wait_ev(signals.ev(signals.started, "s"))
    post(app, note("notifications/cancelled", {"requestId": "8"}), headers=legacy_headers(sid))
    assert c.result().json["error"]["code"] == errors.REQUEST_CANCELLED


def test_cancel_from_another_session_does_nothing(app: McpServer, reg: Registry,
                                                  signals: Signals) -> None:
    a, b = session(app), session(app)
    c = start_call(app, 1, "wait", {"tag": "a"}, legacy_headers(a))
    wait_ev(signals.ev(signals.started, "a"))
    r = post(app, note("notifications/cancelled", {"requestId": 1}), headers=legacy_headers(b))
    assert r.status == 202
    # nothing in flight in b's scope: nothing recorded
    assert reg.table("cancellations").count() == 0
    signals.ev(signals.release, "a").set()
    assert c.result().json["result"]["content"][0]["text"] == "released"


# (params, status, code): contract §6.1's table
CANCEL_TABLE = [
    ("absent", 202, None),
    ({}, 202, None),
    ({"requestId": None}, 202, None),
    ({"requestId": 999}, 202, None),            # not in flight: nothing recorded
    ({"requestId": "x" * 256}, 202, None),
    ({"requestId": 1.5}, 400, errors.INVALID_PARAMS),
    ({"requestId": True}, 400, errors.INVALID_PARAMS),
    ({"requestId": {"a": 1}}, 400, errors.INVALID_PARAMS),
    ({"requestId": [1]}, 400, errors.INVALID_PARAMS),
    ({"requestId": "x" * 257}, 400, errors.INVALID_PARAMS),
    ({"requestId": 1, "reason": 5}, 202, None),  # reason: any value, made text (contract §4.2)
    ([1, 2], 400, errors.INVALID_PARAMS),
    ("str", 400, errors.INVALID_PARAMS),
    (None, 400, errors.INVALID_PARAMS),
    (7, 400, errors.INVALID_PARAMS),
]


@pytest.mark.parametrize("params, status, code", CANCEL_TABLE)
def test_cancel_notification_table(app: McpServer, reg: Registry, params: Any, status: int,
                                   code: int | None) -> None:
    sid = session(app)
    msg = {"jsonrpc": "2.0", "method": "notifications/cancelled"}
    if params != "absent":
        msg["params"] = params
    r = post(app, msg, headers=legacy_headers(sid))
    assert r.status == status
    if code is None:
        assert r.body == b""
    else:
        assert r.json["error"]["code"] == code and r.json["id"] is None
    assert reg.table("cancellations").count() == 0


def test_cancel_quota_is_429(app: McpServer, reg: Registry, signals: Signals) -> None:
    sid = session(app)
    h = legacy_headers(sid)
    # three namesake-free calls that keep running after being cancelled (max_rows_per_scope=2)
    calls = [start_call(app, i, "stubborn", {"tag": f"q{i}"}, h) for i in (1, 2, 3)]
    for i in (1, 2, 3):
        wait_ev(signals.ev(signals.started, f"q{i}"))
    assert post(app, note("notifications/cancelled", {"requestId": 1}), headers=h).status == 202
    assert post(app, note("notifications/cancelled", {"requestId": 2}), headers=h).status == 202
    r = post(app, note("notifications/cancelled", {"requestId": 3}), headers=h)
    assert (r.status, r.json["error"]["code"], r.json["id"]) == (429, errors.SERVER_ERROR, None)
    for i in (1, 2, 3):
        signals.ev(signals.release, f"q{i}").set()
    codes = [c.result().json.get("error", {}).get("code") for c in calls]
    assert codes == [errors.REQUEST_CANCELLED, errors.REQUEST_CANCELLED, None]
    assert tables_empty(reg)


def test_a_head_is_answered_as_its_get_without_a_body(app: McpServer) -> None:
    """HEAD /mcp: a 405 as a GET's, its Content-Length, and no body (gunicorn logged "WSGI app
    sent body bytes on a no-body response" for each)."""
    get = run(app, environ_for("GET", None, content_type=None, content_length=None))
    head = run(app, environ_for("HEAD", None, content_type=None, content_length=None))
    assert head.status == get.status == 405
    assert head.body == b"" and get.body
    assert int(head.headers["content-length"]) > 0  # its GET's body names the method


def test_other_notifications_are_202(app: McpServer) -> None:
    sid = session(app)
    for m in ("notifications/progress", "notifications/roots/list_changed", "x/y"):
        assert post(app, note(m, {"a": 1}), headers=legacy_headers(sid)).status == 202


# ------------------------------------------------------------------------------ tool outcomes


@pytest.mark.parametrize("tool, args, check", [
    ("boom", {}, lambda j: j["result"]["isError"] is True
     and "kaput" in j["result"]["content"][0]["text"]),
    ("garbage", {}, lambda j: j["error"]["code"] == errors.INTERNAL_ERROR),
    ("garbage", {"value": None}, lambda j: j["error"]["code"] == errors.INTERNAL_ERROR),
    ("garbage", {"value": [1]}, lambda j: j["error"]["code"] == errors.INTERNAL_ERROR),
    ("garbage", {"value": {"a": 1}}, lambda j: j["result"]["structuredContent"] == {"a": 1}
     and json.loads(j["result"]["content"][0]["text"]) == {"a": 1}),
    ("garbage", {"value": {"content": [{"type": "text", "text": "t"}], "isError": True}},
     lambda j: j["result"] == {"content": [{"type": "text", "text": "t"}], "isError": True}),
    ("notjson", {}, lambda j: j["error"]["code"] == errors.INTERNAL_ERROR),
    ("unprintable", {}, lambda j: j["result"]["isError"] is True
     and "Error executing tool unprintable: ValueError" in j["result"]["content"][0]["text"]),
    ("fail", {}, lambda j: j["error"] == {"code": -32050, "message": "it failed",
                                          "data": {"why": "test"}}),
])
def test_tool_outcomes(stateless: McpServer, reg: Registry, tool: str, args: dict,
                       check: Any) -> None:
    r = post(stateless, rpc(1, "tools/call", {"name": tool, "arguments": args}))
    assert r.status == 200
    assert check(r.json), r.json
    assert tables_empty(reg)


@pytest.mark.parametrize("value, said", [
    ({"a": {1, 2}}, "returned a dict that is not JSON-serialisable"),
    ([1], "returned list, not a str or dict"),
])
def test_a_tool_result_that_cannot_be_sent_is_logged_as_what_it_is(
        stateless: McpServer, caplog: pytest.LogCaptureFixture, value: Any, said: str) -> None:
    """A dict that JSON cannot encode was logged as "returned dict, not a str or dict"."""
    stateless.add_tool(lambda conn, params: value, "unsendable")
    with caplog.at_level("ERROR", logger="shmcancel.server"):
        r = post(stateless, rpc(1, "tools/call", {"name": "unsendable", "arguments": {}}))
    assert r.status == 200 and r.json["error"]["code"] == errors.INTERNAL_ERROR
    assert any(said in rec.getMessage() for rec in caplog.records), caplog.text


def test_ctrl_c_of_a_development_server_is_not_taken_for_the_tools_error(
        stateless: McpServer, reg: Registry) -> None:
    """Under gunicorn a tool's ``KeyboardInterrupt`` is its own error (its workers turn SIGINT
    into ``SystemExit``: tests/integration/test_http.py); outside it, it is Ctrl-C, which
    stops the server. The call's rows go on the way out."""
    with pytest.raises(KeyboardInterrupt):
        post(stateless, rpc(1, "tools/call", {"name": "interrupt", "arguments": {}}))
    assert tables_empty(reg)


def test_cancelled_call_is_minus_32800_even_if_the_tool_returns(stateless: McpServer,
                                                                reg: Registry,
                                                                signals: Signals) -> None:
    c = start_call(stateless, 3, "wait", {"tag": "f", "finish_anyway": True})
    wait_ev(signals.ev(signals.started, "f"))
    post(stateless, note("notifications/cancelled", {"requestId": 3}))
    assert c.result().json["error"]["code"] == errors.REQUEST_CANCELLED
    assert tables_empty(reg)


def _call_on(wire: str, app: McpServer, id: int, params: dict, name: str) -> Reply:
    if wire == "modern":
        return modern(app, id, "tools/call", params, name=name)
    return post(app, rpc(id, "tools/call", params))


@pytest.mark.parametrize("wire", ["legacy", "modern"])
def test_a_read_tools_call_is_answered_200_whatever_went_wrong(stateless: McpServer,
                                                               reg: Registry,
                                                               wire: str) -> None:
    """contract §5 (revised): an SDK client turns a 4xx into a transport failure, so a request it
    could read gets 200: an unknown tool is -32602, invalid arguments (not an object, or the
    tool raising ToolError(INVALID_PARAMS)) a tool execution error naming the problem, any
    other ToolError a JSON-RPC error with its code, even one that has a 4xx elsewhere."""
    r = _call_on(wire, stateless, 1, {"name": "nope", "arguments": {}}, "nope")
    assert (r.status, r.json["id"], r.json["error"]["code"]) == (200, 1, errors.INVALID_PARAMS)
    assert "nope" in r.json["error"]["message"]

    r = _call_on(wire, stateless, 2, {"name": "echo", "arguments": "x"}, "echo")
    assert (r.status, r.json["id"]) == (200, 2), r
    res = r.json["result"]
    assert res["isError"] is True
    assert res["content"][0]["text"] == \
        'Invalid arguments for tool echo: "arguments" must be an object'

    r = _call_on(wire, stateless, 3, {"name": "fail", "arguments": {"code": -32602}}, "fail")
    assert (r.status, r.json["id"]) == (200, 3), r
    assert r.json["result"]["isError"] is True
    assert r.json["result"]["content"] == [
        {"type": "text", "text": "Invalid arguments for tool fail: it failed"}]
    if wire == "modern":
        assert r.json["result"]["resultType"] == "complete"

    for code in (-32601, -32600, -32050, errors.INTERNAL_ERROR):
        r = _call_on(wire, stateless, 4, {"name": "fail", "arguments": {"code": code}}, "fail")
        assert (r.status, r.json["error"]["code"]) == (200, code), r
        assert r.json["error"]["data"] == {"why": "test"}
    assert tables_empty(reg)


def test_progress_streams_sse_when_accepted(stateless: McpServer, reg: Registry) -> None:
    call = rpc(4, "tools/call", {"name": "progress", "arguments": {},
                                 "_meta": {"progressToken": "tok"}})
    r = post(stateless, call)
    assert r.status == 200
    events = r.events()
    assert [e["method"] for e in events[:3]] == ["notifications/progress"] * 3
    assert events[0]["params"] == {"progressToken": "tok", "progress": 1, "total": 3,
                                   "message": "step 1"}
    assert events[3]["id"] == 4 and json.loads(events[3]["result"]["content"][0]["text"]) == \
        [True, True, True]
    # JSON-only client, or no token: progress() is a no-op and the reply is JSON
    r = post(stateless, call, headers={"Accept": "application/json"})
    assert json.loads(r.json["result"]["content"][0]["text"]) == [False, False, False]
    r = post(stateless, rpc(5, "tools/call", {"name": "progress", "arguments": {}}))
    assert json.loads(r.json["result"]["content"][0]["text"]) == [False, False, False]
    # an SSE-only client gets even a plain reply as an event stream
    r = post(stateless, rpc(6, "tools/call", {"name": "echo", "arguments": {"text": "s"}}),
             headers={"Accept": "text/event-stream"})
    assert r.events()[0]["result"]["content"][0]["text"] == "s"
    assert tables_empty(reg)


def test_progress_outside_a_request_is_a_no_op() -> None:
    assert progress({}, 1) is False
    assert progress(None, 1) is False  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ 2026-07-28 wire


def test_modern_discover_list_call(stateless: McpServer, app: McpServer, reg: Registry) -> None:
    for server in (stateless, app):  # sessions on or off: the modern wire has none
        r = modern(server, 1, "server/discover")
        assert r.status == 200 and "mcp-session-id" not in r.headers
        res = r.json["result"]
        assert MODERN in res["supportedVersions"] and "2025-11-25" in res["supportedVersions"]
        assert res["capabilities"] == {"tools": {"listChanged": False}}
        assert res["resultType"] == "complete"
        assert isinstance(res["ttlMs"], int) and res["ttlMs"] >= 0
        assert res["cacheScope"] in ("public", "private")
        assert res["_meta"][SERVER_INFO_META_KEY] == {"name": "test-server", "version": "9.9"}
        res = modern(server, 2, "tools/list").json["result"]
        assert res["resultType"] == "complete" and "ttlMs" in res and "cacheScope" in res
        assert any(t["name"] == "echo" for t in res["tools"])
        r = modern(server, 3, "tools/call", {"name": "echo", "arguments": {"text": "m"}},
                   name="echo", headers={"Mcp-Session-Id": "ignored"})
        assert r.status == 200 and "mcp-session-id" not in r.headers
        assert r.json["result"]["resultType"] == "complete"
        assert r.json["result"]["content"] == [{"type": "text", "text": "m"}]
    assert tables_empty(reg)


def test_modern_base64_tool_name(stateless: McpServer) -> None:
    @stateless.tool("grüß")
    def gruss(conn, params):
        return "hallo"

    enc = "=?base64?" + base64.b64encode("grüß".encode()).decode() + "?="
    r = modern(stateless, 1, "tools/call", {"name": "grüß", "arguments": {}}, name=enc)
    assert r.json["result"]["content"][0]["text"] == "hallo"


MODERN_BAD = [
    # (params, headers override, status, code)
    ({"name": "echo", "arguments": {}}, {"Mcp-Name": "wait"}, 400, errors.HEADER_MISMATCH),
    ({"name": "echo", "arguments": {}}, {"Mcp-Name": None}, 400, errors.HEADER_MISMATCH),
    ({"name": "echo", "arguments": {}}, {"Mcp-Method": "tools/list"}, 400, errors.HEADER_MISMATCH),
    ({"name": "echo", "arguments": {}}, {"Mcp-Method": None}, 400, errors.HEADER_MISMATCH),
    ({"name": "echo", "arguments": {}, "_meta": {PV_KEY: "2025-11-25",
                                                 CLIENT_CAPABILITIES_META_KEY: {}}},
     {}, 400, errors.HEADER_MISMATCH),
    ({"name": "echo", "arguments": {}, "_meta": {CLIENT_CAPABILITIES_META_KEY: {}}},
     {}, 400, errors.INVALID_PARAMS),
    ({"name": "echo", "arguments": {}, "_meta": {PV_KEY: MODERN}}, {}, 400, errors.INVALID_PARAMS),
    ({"name": "echo", "arguments": {}, "_meta": "x"}, {}, 400, errors.INVALID_PARAMS),
    ({"name": "echo", "arguments": {}, "_meta": {PV_KEY: "2030-01-01",
                                                 CLIENT_CAPABILITIES_META_KEY: {}}},
     {"MCP-Protocol-Version": "2030-01-01"}, 400, errors.UNSUPPORTED_PROTOCOL_VERSION),
    ({"name": "nope", "arguments": {}}, {"Mcp-Name": "nope"}, 200, errors.INVALID_PARAMS),
]


@pytest.mark.parametrize("params, hdrs, status, code", MODERN_BAD)
def test_modern_rejections(stateless: McpServer, params: dict, hdrs: dict, status: int,
                           code: int) -> None:
    h = {"Mcp-Name": "echo", **hdrs}
    r = modern(stateless, 11, "tools/call", params, headers=h)
    # contract §5: a 400 -32602 is of the envelope, "id": null; a mismatch names the request
    want_id = None if (status, code) == (400, errors.INVALID_PARAMS) else 11
    assert (r.status, r.json["error"]["code"], r.json["id"]) == (status, code, want_id)
    if code == errors.UNSUPPORTED_PROTOCOL_VERSION:
        assert r.json["error"]["data"]["requested"] == "2030-01-01"
        assert MODERN in r.json["error"]["data"]["supported"]


@pytest.mark.parametrize("params", ["[]", "[1]", "5", '"x"', "null"])
def test_modern_params_that_is_no_object_fails_the_ladders_first_rung(stateless: McpServer,
                                                                      params: str) -> None:
    """contract §6.2: no ``_meta`` is the ladder's first rung, 400 ``-32602`` with ``"id":
    null``. A ``params`` that was no object at all was refused earlier, as on the 2025 wire
    (200, for the request's id): the more malformed request got the gentler answer, and a
    header that disagreed with it no ``-32020`` either."""
    body = f'{{"jsonrpc":"2.0","id":5,"method":"tools/call","params":{params}}}'.encode()
    r = post(stateless, None, raw=body, headers={"MCP-Protocol-Version": MODERN,
                                                 "Mcp-Method": "tools/list"})
    assert (r.status, r.json["error"]["code"], r.json["id"]) == (400, errors.INVALID_PARAMS,
                                                                 None), r


def test_modern_unknown_method_is_404(stateless: McpServer) -> None:
    for method in ("resources/list", "initialize", "ping"):
        r = modern(stateless, 1, method)
        assert (r.status, r.json["error"]["code"]) == (404, errors.METHOD_NOT_FOUND), method


def test_modern_notifications_and_bodiless_methods(app: McpServer) -> None:
    h = {"MCP-Protocol-Version": MODERN}
    r = post(app, note("notifications/cancelled", {"requestId": 1, "_meta": META}), headers=h)
    assert r.status == 202
    for method in ("GET", "DELETE"):
        r = run(app, environ_for(method, None, headers={**h, "Mcp-Session-Id": "abc"}))
        assert r.status == 405, method
    # this server keeps sessions: the 2026-07-28 wire is what has none
    assert "2026-07-28 wire has no sessions" in r.json["error"]["message"], r.json
    r = post(app, {"jsonrpc": "2.0", "id": 1, "result": {}}, headers=h)
    assert (r.status, r.json["error"]["code"]) == (400, errors.INVALID_REQUEST)


def test_unknown_version_header_is_32022(app: McpServer) -> None:
    r = post(app, rpc(1, "tools/list"), headers={"MCP-Protocol-Version": "1999-01-01"})
    assert (r.status, r.json["error"]["code"]) == (400, errors.UNSUPPORTED_PROTOCOL_VERSION)
    assert r.json["error"]["data"] == {"supported": ["2026-07-28", "2025-11-25", "2025-06-18",
                                                     "2025-03-26"], "requested": "1999-01-01"}
    r = run(app, environ_for("DELETE", None, headers={"MCP-Protocol-Version": "1999-01-01"}))
    assert (r.status, r.json["error"]["code"]) == (400, errors.UNSUPPORTED_PROTOCOL_VERSION)


# ------------------------------------------------------------------------------ bad input


def _b(s: str) -> bytes:
    return s.encode()


BAD_INPUT = [
    # (name, environ kwargs, status, code)
    ("malformed json", {"body": b"{not json"}, 400, errors.PARSE_ERROR),
    ("empty body", {"body": b""}, 400, errors.PARSE_ERROR),
    ("invalid utf-8", {"body": b'{"a":"\xff"}'}, 400, errors.PARSE_ERROR),
    ("NaN", {"body": b'{"jsonrpc":"2.0","id":NaN,"method":"ping"}'}, 400, errors.PARSE_ERROR),
    ("deep nesting", {"body": b"[" * 50_000 + b"]" * 50_000}, 400, errors.PARSE_ERROR),
    ("huge int", {"body": b'{"jsonrpc":"2.0","id":' + b"1" * 6000 + b',"method":"ping"}'},
     400, errors.PARSE_ERROR),
    ("batch", {"body": _b('[{"jsonrpc":"2.0","id":1,"method":"ping"}]')}, 400,
     errors.INVALID_REQUEST),
    ("empty batch", {"body": b"[]"}, 400, errors.INVALID_REQUEST),
    ("not an object", {"body": b'"ping"'}, 400, errors.INVALID_REQUEST),
    ("no jsonrpc", {"body": _b('{"id":1,"method":"ping"}')}, 400, errors.INVALID_REQUEST),
    ("jsonrpc 1.0", {"body": _b('{"jsonrpc":"1.0","id":1,"method":"ping"}')}, 400,
     errors.INVALID_REQUEST),
    ("method int", {"body": _b('{"jsonrpc":"2.0","id":1,"method":7}')}, 400,
     errors.INVALID_REQUEST),
    ("float id", {"body": _b('{"jsonrpc":"2.0","id":1.5,"method":"ping"}')}, 400,
     errors.INVALID_REQUEST),
    ("bool id", {"body": _b('{"jsonrpc":"2.0","id":true,"method":"ping"}')}, 400,
     errors.INVALID_REQUEST),
    ("object id", {"body": _b('{"jsonrpc":"2.0","id":{},"method":"ping"}')}, 400,
     errors.INVALID_REQUEST),
    ("null id", {"body": _b('{"jsonrpc":"2.0","id":null,"method":"ping"}')}, 400,
     errors.INVALID_REQUEST),
    # a valid JSON-RPC id the registry cannot key: a request read, answered for its id
    ("long id", {"body": _b('{"jsonrpc":"2.0","id":"' + "x" * 300 + '","method":"ping"}')},
     200, errors.INVALID_REQUEST),
    ("params array", {"body": _b('{"jsonrpc":"2.0","id":1,"method":"tools/list","params":[]}')},
     200, errors.INVALID_PARAMS),
    ("initialize no version", {"body": _b('{"jsonrpc":"2.0","id":1,"method":"initialize",'
                                          '"params":{"capabilities":{}}}')},
     200, errors.INVALID_PARAMS),
    ("initialize version int", {"body": _b('{"jsonrpc":"2.0","id":1,"method":"initialize",'
                                           '"params":{"protocolVersion":2025}}')},
     200, errors.INVALID_PARAMS),
    ("call no params", {"body": _b('{"jsonrpc":"2.0","id":1,"method":"tools/call"}')}, 200,
     errors.INVALID_PARAMS),
    ("call name int", {"body": _b('{"jsonrpc":"2.0","id":1,"method":"tools/call",'
                                  '"params":{"name":1}}')}, 200, errors.INVALID_PARAMS),
    ("call meta list", {"body": _b('{"jsonrpc":"2.0","id":1,"method":"tools/call",'
                                   '"params":{"name":"echo","_meta":[]}}')}, 200,
     errors.INVALID_PARAMS),
    ("progress token float", {"body": _b('{"jsonrpc":"2.0","id":1,"method":"tools/call",'
                                         '"params":{"name":"echo","_meta":'
                                         '{"progressToken":1.5}}}')}, 200, errors.INVALID_PARAMS),
    ("unknown tool", {"body": _b('{"jsonrpc":"2.0","id":1,"method":"tools/call",'
                                 '"params":{"name":"nope"}}')}, 200, errors.INVALID_PARAMS),
    ("cursor int", {"body": _b('{"jsonrpc":"2.0","id":1,"method":"tools/list",'
                               '"params":{"cursor":5}}')}, 200, errors.INVALID_PARAMS),
    ("unknown method", {"body": _b('{"jsonrpc":"2.0","id":1,"method":"resources/list"}')}, 200,
     errors.METHOD_NOT_FOUND),
    ("content-type text", {"body": _b('{"jsonrpc":"2.0","id":1,"method":"ping"}'),
                           "content_type": "text/plain"}, 415, errors.INVALID_REQUEST),
    ("content-type missing", {"body": _b('{"jsonrpc":"2.0","id":1,"method":"ping"}'),
                              "content_type": None}, 415, errors.INVALID_REQUEST),
    ("charset latin-1", {"body": _b('{"jsonrpc":"2.0","id":1,"method":"ping"}'),
                         "content_type": "application/json; charset=latin-1"}, 415,
     errors.INVALID_REQUEST),
    ("accept html", {"body": _b('{"jsonrpc":"2.0","id":1,"method":"ping"}'),
                     "headers": {"Accept": "text/html"}}, 406, errors.INVALID_REQUEST),
    ("content-length huge", {"body": b"{}", "content_length": "2000000"}, 413,
     errors.INVALID_REQUEST),
    ("content-length junk", {"body": b"{}", "content_length": "12abc"}, 400,
     errors.INVALID_REQUEST),
    ("content-length negative", {"body": b"{}", "content_length": "-1"}, 400,
     errors.INVALID_REQUEST),
    ("body over limit", {"body": b" " * 1_000_001}, 413, errors.INVALID_REQUEST),
    ("chunked over limit", {"body": b" " * 1_000_001, "content_length": None,
                            "extra": {"wsgi.input_terminated": True}}, 413,
     errors.INVALID_REQUEST),
    ("no length, not terminated", {"body": b"{}", "content_length": None}, 411,
     errors.INVALID_REQUEST),
]


@pytest.mark.parametrize("name, kw, status, code", BAD_INPUT, ids=[c[0] for c in BAD_INPUT])
def test_bad_input(stateless: McpServer, reg: Registry, name: str, kw: dict, status: int,
                   code: int) -> None:
    kw = dict(kw)
    body = kw.pop("body")
    # wsgiref's validator itself chokes on a malformed CONTENT_LENGTH: call those directly
    r = run(stateless, environ_for("POST", body, **kw), validate="content-length " not in name)
    assert r.status == status, r
    assert r.json["error"]["code"] == code, r
    if status == 400:  # contract §5: not a request the server read, whatever id it carries
        assert "id" in r.json and r.json["id"] is None, r
    elif name == "long id":
        assert r.json["id"] == "x" * 300, r
    assert tables_empty(reg)


def test_chunked_body_under_limit_is_read(stateless: McpServer) -> None:
    body = json.dumps(rpc(1, "ping")).encode()
    r = run(stateless, environ_for("POST", body, content_length=None,
                                   extra={"wsgi.input_terminated": True}))
    assert r.json["result"] == {}


def test_no_registry_is_a_clear_503(signals: Signals, monkeypatch: pytest.MonkeyPatch) -> None:
    from shmcancel.shm import registry as registry_mod
    # Whatever earlier tests left attached in this process, this server finds no registry.
    monkeypatch.setattr(registry_mod, "current", lambda: None)
    server = make_server(None, signals, sessions=False)
    r = post(server, rpc(1, "tools/call", {"name": "echo", "arguments": {}}))
    assert r.status == 503 and "registry" in r.json["error"]["message"]


# ---------------------------------------------------------------- disconnects (in-process)


def socket_call(app: Any, id: Any, tool: str, args: dict, *, multithread: bool = False,
                headers: dict | None = None) -> tuple[Call, socket.socket, socket.socket]:
    """A tools/call whose environ carries a real connected socket as ``gunicorn.socket``; the
    test holds the peer (the "client")."""
    server_side, client_side = socket.socketpair()
    body = json.dumps(rpc(id, "tools/call", {"name": tool, "arguments": args})).encode()
    env = environ_for("POST", body, headers=headers,
                      extra={"gunicorn.socket": server_side, "wsgi.multithread": multithread})
    c = Call(app, env)
    c.start()
    return c, server_side, client_side


def test_disconnect_cancels_exactly_that_request(stateless: McpServer, reg: Registry,
                                                 signals: Signals) -> None:
    # two anonymous clients from one address run request id 1: one leaves
    c1, s1, k1 = socket_call(stateless, 1, "wait", {"tag": "leaver"})
    c2, s2, k2 = socket_call(stateless, 1, "wait", {"tag": "stayer"})
    try:
        wait_ev(signals.ev(signals.started, "leaver"))
        wait_ev(signals.ev(signals.started, "stayer"))
        t0 = time.monotonic()
        k1.close()
        wait_ev(signals.ev(signals.saw_cancel, "leaver"))
        # seen within a slice of the watcher (LATE + TICK: 55 ms), slack for a loaded machine
        assert time.monotonic() - t0 < 0.5
        assert c1.result().json["error"]["code"] == errors.REQUEST_CANCELLED
        assert not signals.ev(signals.saw_cancel, "stayer").is_set()
        signals.ev(signals.release, "stayer").set()
        assert c2.result().json["result"]["content"][0]["text"] == "released"
        assert tables_empty(reg)
    finally:
        for s in (s1, k1, s2, k2):
            s.close()


def test_pipelined_data_is_not_a_disconnect(stateless: McpServer, signals: Signals) -> None:
    c, s, k = socket_call(stateless, 1, "wait", {"tag": "p"})
    try:
        wait_ev(signals.ev(signals.started, "p"))
        k.sendall(b"POST /mcp HTTP/1.1\r\nHost: x\r\n\r\n")  # the next request, pipelined
        assert not signals.ev(signals.saw_cancel, "p").wait(0.2)
        k.shutdown(socket.SHUT_WR)  # then the client goes away
        wait_ev(signals.ev(signals.saw_cancel, "p"))
        assert c.result().json["error"]["code"] == errors.REQUEST_CANCELLED
    finally:
        s.close()
        k.close()


def test_stubborn_tool_is_stopped_in_a_threaded_worker(stateless: McpServer, reg: Registry,
                                                       signals: Signals) -> None:
    c, s, k = socket_call(stateless, 1, "stubborn", {"tag": "st"}, multithread=True)
    try:
        wait_ev(signals.ev(signals.started, "st"))
        t0 = time.monotonic()
        k.close()
        wait_ev(signals.ev(signals.saw_cancel, "st"))
        reply = c.result()  # stream_cancel_timeout=0.3: RequestStopped ends the tool
        assert reply.json["error"]["code"] == errors.REQUEST_CANCELLED
        assert c.done_at is not None and 0.25 < c.done_at - t0 < 2.0
        assert tables_empty(reg)
    finally:
        s.close()


@pytest.mark.parametrize("multithread", [False, True])
def test_a_watched_call_leaves_no_cyclic_garbage(stateless: McpServer,
                                                 multithread: bool) -> None:
    """Everything a watched, tracked tools/call makes is freed by reference counting when it
    ends: garbage that only the cyclic collector frees would make a worker run full
    collections (milliseconds each, in a heap the size of gunicorn's) every few thousand
    calls."""
    server_side, client_side = socket.socketpair()
    body = json.dumps(rpc(1, "tools/call", {"name": "echo", "arguments": {"text": "x"}}))

    def call() -> None:
        env = environ_for("POST", body.encode(), extra={"gunicorn.socket": server_side,
                                                         "wsgi.multithread": multithread})
        assert run(stateless, env, validate=False).json["result"]["content"][0]["text"] == "x"

    call()  # first-use state (the watcher thread, caches) made before counting
    # Counted: what a collection finds after 50 calls. An earlier test's thread (a stop thread
    # waiting out its grace, a tool thread) may drop the last reference to its registry's
    # cycle inside one window; garbage the calls make shows up in every window.
    found = []
    try:
        for _ in range(3):
            gc.collect()
            gc.disable()
            for _ in range(50):
                call()
            found.append(gc.collect())
            gc.enable()
            if found[-1] == 0:
                break
        assert found[-1] == 0, f"cyclic garbage after each 50 calls: {found}"
    finally:
        gc.enable()
        server_side.close()
        client_side.close()


def test_a_stop_landing_in_the_watchers_own_stop_still_stops_it(
        stateless: McpServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """``RequestStopped`` is raised in a ``gthread`` tool's thread asynchronously: it can land
    after the tool returned, inside the ``Watcher.stop`` of the call's ``finally``, before that
    marked the watcher stopped. The call must still stop its watcher: else its socket stays
    watched and the stopper, seeing no stop, asks the worker to exit."""
    real_stop = disconnect.Watcher.stop
    landed: list[disconnect.Watcher] = []

    def stop_hit_once(self: disconnect.Watcher) -> None:
        if not landed:
            landed.append(self)
            raise RequestStopped
        real_stop(self)

    monkeypatch.setattr(disconnect.Watcher, "stop", stop_hit_once)
    c, s, k = socket_call(stateless, 1, "echo", {"text": "x"}, multithread=True)
    try:
        reply = c.result()
        assert reply.json["error"]["code"] == errors.REQUEST_CANCELLED  # it was being stopped
        assert landed and landed[0].wait_stopped(0)
        assert disconnect.watched_count() == 0
    finally:
        s.close()
        k.close()


def test_no_watcher_without_a_gunicorn_socket(stateless: McpServer, signals: Signals) -> None:
    c = start_call(stateless, 1, "wait", {"tag": "nw"})
    wait_ev(signals.ev(signals.started, "nw"))
    assert disconnect.watched_count() == 0
    signals.ev(signals.release, "nw").set()
    assert c.result().json["result"]["content"][0]["text"] == "released"


# ------------------------------------------------------------------------------ session store


def test_session_store_expiry_touch_and_capacity(reg: Registry) -> None:
    now = [1000.0]
    store = SessionStore(reg, clock=lambda: now[0])
    ttl = reg.config.session_ttl
    a = store.create("2025-11-25")
    assert store.get(a.id) == a and store.count() == 1
    now[0] += 5
    store.touch(a)
    seen = store.get(a.id)
    assert seen is not None and seen.last_seen == now[0]
    now[0] += ttl + 1
    assert store.get(a.id) is None and store.count() == 0  # expired: removed when read
    # capacity 8: the least recently seen goes when full and nothing expired
    ids = []
    for _ in range(8):
        now[0] += 1
        ids.append(store.create("2025-06-18").id)
    now[0] += 1
    store.touch(store.get(ids[0]))  # ids[0] is fresh again; ids[1] is now the oldest
    new = store.create("2025-11-25")
    assert store.count() == 8 and store.get(new.id) is not None
    assert store.get(ids[1]) is None and store.get(ids[0]) is not None
    # expired ones go at the sweep (a mint never scans the table)
    now[0] += ttl + 10
    assert store.sweep_all() == 8 and store.count() == 0
    store.create("2025-11-25")
    assert store.count() == 1
    assert store.get(None) is None and store.get("bad id") is None
    assert store.delete("x" * 200) is False


def test_modern_param_headers_are_checked(stateless: McpServer) -> None:
    @stateless.tool("sql", input_schema={"type": "object", "properties": {
        "region": {"type": "string", "x-mcp-header": "Region"}, "q": {"type": "string"}}})
    def sql(conn, params):
        return params["region"]

    args = {"region": "us-west1", "q": "select 1"}
    r = modern(stateless, 1, "tools/call", {"name": "sql", "arguments": args}, name="sql",
               headers={"Mcp-Param-Region": "us-west1"})
    assert r.json["result"]["content"][0]["text"] == "us-west1"
    for bad in ({}, {"Mcp-Param-Region": "eu-west1"}):
        r = modern(stateless, 2, "tools/call", {"name": "sql", "arguments": args}, name="sql",
                   headers=bad)
        assert (r.status, r.json["error"]["code"]) == (400, errors.HEADER_MISMATCH)
    # the legacy wire has no such headers
    r = post(stateless, rpc(3, "tools/call", {"name": "sql", "arguments": args}))
    assert r.json["result"]["content"][0]["text"] == "us-west1"


def test_tool_registration_is_checked(stateless: McpServer) -> None:
    with pytest.raises(ValueError, match="already registered"):
        stateless.add_tool(lambda c, p: "", "echo")
    with pytest.raises(ValueError, match="x-mcp-header"):
        stateless.add_tool(lambda c, p: "", "bad", input_schema={
            "type": "object", "properties": {"a": {"type": "number", "x-mcp-header": "A"}}})
    with pytest.raises(ValueError, match='"type": "object"'):
        stateless.add_tool(lambda c, p: "", "bad2", input_schema={"type": "string"})
    with pytest.raises(TypeError):
        stateless.add_tool("not callable", "bad3")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        ToolError("x", "m")  # type: ignore[arg-type]


def test_allowed_origins(reg: Registry, signals: Signals) -> None:
    server = make_server(reg, signals, sessions=False,
                         allowed_origins={"http://localhost:8000"})
    body = rpc(1, "tools/call", {"name": "echo", "arguments": {"text": "o"}})
    assert post(server, body).status == 200  # no Origin: not a browser
    assert post(server, body, headers={"Origin": "http://localhost:8000"}).status == 200
    r = post(server, body, headers={"Origin": "http://evil.example"})
    assert (r.status, r.json["error"]["code"], r.json["id"]) == (403, errors.INVALID_REQUEST, None)
    assert post(server, body, headers={"Origin": "http://localhost:8001"}).status == 403


@pytest.mark.parametrize("origin, status", [
    (None, 200), ("http://localhost:8000", 200), ("http://127.0.0.1:1234", 200),
    ("https://[::1]", 200), ("http://evil.example", 403), ("http://localhost.evil.example", 403),
    ("null", 403), ("http://localhost:8000/mcp", 403),
])
@pytest.mark.parametrize("sessions", [True, False])
def test_origin_is_checked_by_default_on_both_wires(reg: Registry, signals: Signals,
                                                    origin: str | None, status: int,
                                                    sessions: bool) -> None:
    """contract §6.0: on by default; loopback pages pass, any other Origin is 403 with a JSON-RPC
    error before anything else is looked at (no session, no body read)."""
    server = make_server(reg, signals, sessions=sessions)
    h = {"Origin": origin} if origin is not None else {}
    r = post(server, INIT, headers=h)
    assert r.status == status, r
    r = modern(server, 2, "tools/call", {"name": "echo", "arguments": {"text": "m"}},
               name="echo", headers=h)
    assert r.status == status, r
    if status == 403:
        assert (r.json["error"]["code"], r.json["id"]) == (errors.INVALID_REQUEST, None)
        assert "Origin" in r.json["error"]["message"]
        for verb in ("GET", "DELETE"):
            r = run(server, environ_for(verb, None, headers=h))
            assert r.status == 403, (verb, r)


def test_origin_opt_out(reg: Registry, signals: Signals) -> None:
    server = make_server(reg, signals, sessions=False, allowed_origins="*")
    for origin in ("http://evil.example", "null", "garbage"):
        r = post(server, rpc(1, "ping"), headers={"Origin": origin})
        assert (r.status, r.json["result"]) == (200, {}), origin
    with pytest.raises(ValueError, match="allowed_origins"):
        make_server(reg, signals, allowed_origins=["http://localhost/mcp"])


@pytest.mark.parametrize(("kw", "error"), [
    ({"registry": 5}, TypeError), ({"registry": "bad/name"}, InvalidRegistryName),
    ({"path": 5}, TypeError), ({"title": 5}, TypeError), ({"instructions": {"x": 1}}, TypeError),
    ({"sessions": "no"}, TypeError), ({"watch_disconnects": 1}, TypeError)])
def test_bad_constructor_arguments_are_refused_at_once(kw: dict[str, Any],
                                                       error: type[Exception]) -> None:
    """A wrong type or name was stored as given: every request then failed with a 500 and a
    logged traceback (``registry``, ``path``), or the ``initialize`` result broke the MCP schema
    (a non-string ``title`` or ``instructions``), or ``sessions="no"`` meant sessions on."""
    with pytest.raises(error):
        McpServer("t", "1", **kw)


def test_a_registry_name_that_names_none_is_a_503_not_a_500(shm_name: str) -> None:
    """Like a server given no registry at all: the deployment's mistake, answered 503 "Server
    misconfigured", not 500 with a traceback logged per request."""
    app = McpServer("t", "1", registry=shm_name)  # nothing created under that name
    r = post(app, INIT)
    assert r.status == 503, r
    assert "Server misconfigured" in r.json["error"]["message"]
    assert "/dev/shm" not in r.json["error"]["message"]  # the reason is the operator's (logged)
    with open(f"/dev/shm/shmcancel.{shm_name}", "w") as f:  # one it cannot use (not a segment)
        f.write("x")
    try:
        r = post(McpServer("t", "1", registry=shm_name), INIT)
        assert r.status == 503, r
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm/shmcancel.{shm_name}")
