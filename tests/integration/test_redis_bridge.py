"""The per-worker Redis bridge (shmcancel.redis.bridge) against a real redis-server of the test's
own, made slow or unreachable for real: ``CLIENT PAUSE`` (the server holds every client's
commands for a while), SIGKILL. A call that gets no answer is told apart from Redis's "no";
one timed-out call does not mark Redis down, several in a row or a refused connection do; writes
that got no answer are owed and applied once Redis answers."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from helpers.gunicorn_harness import wait_until
from helpers.redis_server import RedisServer, running, unique_prefix

from shmcancel import Cancellation, Config, RemoteUnavailable
from shmcancel.exceptions import LockTimeout
from shmcancel.mcp.sessions import SessionStore
from shmcancel.redis import bridge as bridge_mod
from shmcancel.redis.bridge import DOWN_AFTER, OWED_MAX, Bridge
from shmcancel.shm.registry import Registry

TIMEOUT = 0.3  # the bridge's budget per call: reads give up after 0.1 s


@pytest.fixture
def srv() -> Iterator[RedisServer]:
    """A redis-server of the test's own (to pause or kill), stopped at the end."""
    with running() as s:
        yield s


@pytest.fixture
def reg(shm_name: str) -> Iterator[Registry]:
    r = Registry.create(shm_name, Config(capacity=400, max_rows=200, in_flight_capacity=64,
                                         session_capacity=16))
    try:
        yield r
    finally:
        r.close()
        r.unlink()


@contextlib.contextmanager
def bridge(reg: Registry, srv: RedisServer, *, thread: bool = False,
           lease: float = 30.0, timeout: float = TIMEOUT, prefix: str | None = None,
           host: str = "h") -> Iterator[Bridge]:
    """A bridge with a long lease (an in-flight row only goes when it is ended) and, unless
    ``thread``, no thread: only the calls a test makes reach Redis. Bridges given one
    ``prefix`` and different ``host`` names are hosts of one deployment."""
    b = Bridge(reg, srv.url, prefix=prefix or unique_prefix(), timeout=timeout, lease=lease,
               host=host, retry=0.1)
    if thread:
        b.start()
    try:
        yield b
    finally:
        b.stop()


def pause(srv: RedisServer, ms: int) -> float:
    """``CLIENT PAUSE ms ALL``: the server holds every client's commands for ``ms``; when
    that ends (monotonic)."""
    c = redis.Redis.from_url(srv.url)
    try:
        c.execute_command("CLIENT", "PAUSE", ms, "ALL")
    finally:
        c.close()
    return time.monotonic() + ms / 1000


SID = "s" * 32


def test_no_answer_is_not_no_and_one_timeout_does_not_mark_redis_down(
        reg: Registry, srv: RedisServer) -> None:
    with bridge(reg, srv) as b:
        b.publish_session(SID, "2025-11-25", "ip:1.2.3.4")
        assert b.lookup_session(SID) == ("2025-11-25", "ip:1.2.3.4")
        assert b.lookup_session("u" * 32) is None  # Redis says: no such session
        until = pause(srv, 1500)
        with pytest.raises(RemoteUnavailable):
            b.lookup_session(SID)  # the read timed out
        assert not b.down  # one slow call says little about Redis
        wait_until(lambda: time.monotonic() > until or None, until + 5, what="the pause")
        assert b.lookup_session(SID) == ("2025-11-25", "ip:1.2.3.4")
        assert not b.down


def test_timeouts_in_a_row_mark_redis_down_and_an_answer_resets_the_count(
        reg: Registry, srv: RedisServer) -> None:
    with bridge(reg, srv) as b:
        b.publish_session(SID, "2025-11-25", "c")
        until = pause(srv, 1500)
        for _ in range(DOWN_AFTER - 1):
            with pytest.raises(RemoteUnavailable):
                b.lookup_session(SID)
        assert not b.down
        wait_until(lambda: time.monotonic() > until or None, until + 5, what="the pause")
        assert b.lookup_session(SID) == ("2025-11-25", "c")  # answered: the count starts over
        until = pause(srv, 1500)
        for _ in range(DOWN_AFTER - 1):
            with pytest.raises(RemoteUnavailable):
                b.lookup_session(SID)
        assert not b.down
        with pytest.raises(RemoteUnavailable):
            b.lookup_session(SID)
        assert b.down  # DOWN_AFTER in a row
        with pytest.raises(RemoteUnavailable):
            b.lookup_session(SID)  # skipped: not tried, so not counted
        assert b._failures == DOWN_AFTER


def test_a_refused_connection_marks_redis_down_at_once(reg: Registry,
                                                       srv: RedisServer) -> None:
    with bridge(reg, srv) as b:
        b.publish_session(SID, "2025-11-25", "c")
        srv.kill()
        with pytest.raises(RemoteUnavailable):
            b.lookup_session(SID)
        assert b.down


def test_owed_writes_are_applied_once_redis_answers(reg: Registry, srv: RedisServer) -> None:
    """publish, delete and untrack that time out (and those made while the bridge is down)
    land once Redis answers, applied by the bridge thread; a deleted session is not adopted
    again meanwhile."""
    with bridge(reg, srv, thread=True) as b:
        r = redis.Redis.from_url(srv.url)
        b.publish_session("d" * 32, "2025-11-25", "c")
        handle = b.track(7, "session:x")
        assert handle is not None and handle[3]  # its track answered
        assert b.remote.in_flight(7, "session:x")
        until = pause(srv, 2000)
        b.publish_session("p" * 32, "2025-11-25", "c")
        b.delete_session("d" * 32)
        b.untrack(handle)
        assert b.owed() == 3
        assert b.lookup_session("d" * 32) is None  # deleted here: no need to ask
        wait_until(lambda: time.monotonic() > until or None, until + 5, what="the pause")
        wait_until(lambda: b.owed() == 0 or None, time.monotonic() + 20, interval=0.05,
                   what="the owed writes")
        assert b.owed_applied == 3 and b.owed_dropped == 0 and b.owed_expired == 0
        assert b.lookup_session("p" * 32) == ("2025-11-25", "c")
        assert r.get(b.store.prefix + "sess:" + "d" * 32) is None
        assert not b.remote.in_flight(7, "session:x")
        assert b.remote.held() == 0
        r.close()


def test_an_owed_untrack_is_not_added_back_by_renew(reg: Registry, srv: RedisServer) -> None:
    """A call whose track got no answer owes its untrack at once (it does not wait on Redis a
    second time), and the lease renewals after Redis answers do not bring its row back."""
    with bridge(reg, srv, thread=True, timeout=1.5) as b:  # a read gives up after 0.5 s
        until = pause(srv, 2500)
        handle = b.track(8, "session:y")
        assert handle is not None and not handle[3]
        t0 = time.monotonic()
        b.untrack(handle)
        assert time.monotonic() - t0 < 0.25  # owed, not tried
        assert b.owed() == 1 and b.remote.held() == 0
        wait_until(lambda: time.monotonic() > until or None, until + 5, what="the pause")
        wait_until(lambda: b.owed() == 0 or None, time.monotonic() + 20, interval=0.05,
                   what="the owed untrack")
        renewed = b.remote.renew()
        assert renewed == 0 and not b.remote.in_flight(8, "session:y")


def test_a_cross_host_cancel_without_an_answer_is_owed_and_lands(reg: Registry,
                                                                 srv: RedisServer) -> None:
    """Host B's notification for a call running on host A meets a paused Redis: the
    cancellation is owed, not dropped, and A's tool sees it once Redis answers. One owed for a
    request in flight nowhere records nothing when it lands."""
    prefix = unique_prefix()
    c = Cancellation(reg)
    with bridge(reg, srv, thread=True, prefix=prefix, host="A") as a, \
            bridge(reg, srv, thread=True, prefix=prefix, host="B") as b:
        handle = c.begin(7, "session:x")  # running on A: its local row and its Redis row
        assert handle.tracked and a.track(7, "session:x") is not None
        until = pause(srv, 1500)
        assert b.cancel(7, "stop", "session:x") is False  # no answer
        assert b.cancel(8, "nobody runs it", "session:x") is False
        assert b.owed() == 2 and not handle.cancelled()
        wait_until(lambda: time.monotonic() > until or None, until + 5, what="the pause")
        wait_until(lambda: handle.cancelled() or None, time.monotonic() + 20, interval=0.02,
                   what="the owed cancellation delivered on A")
        assert handle.reason() == "stop"
        wait_until(lambda: b.owed() == 0 or None, time.monotonic() + 20, interval=0.02,
                   what="both owed cancellations applied")
        assert b.owed_applied == 2 and a.delivered == 1
        assert not c.cancelled(8, "session:x")
        handle.end()


def test_owed_writes_are_bounded(reg: Registry, srv: RedisServer,
                                 caplog: pytest.LogCaptureFixture) -> None:
    with bridge(reg, srv) as b:
        srv.kill()
        caplog.set_level(logging.WARNING, logger="shmcancel.redis")
        for i in range(OWED_MAX + 10):
            b.publish_session(f"{i:032d}", "2025-11-25", "c")
        assert b.down
        assert b.owed() == OWED_MAX and b.owed_dropped == 10
        drops = [rec for rec in caplog.records if "owed exceed" in rec.getMessage()]
        assert len(drops) == 1


def test_connection_failure_kinds() -> None:
    """Refused, reset and closed connections are connection failures; timeouts are not."""
    from redis.exceptions import ConnectionError as RCE
    from redis.exceptions import ResponseError
    from redis.exceptions import TimeoutError as RTE
    f: Any = bridge_mod._connection_failure
    assert f(RCE("Error 111 connecting")) and f(ConnectionResetError())
    assert not f(RTE("Timeout reading from socket")) and not f(TimeoutError())
    assert not f(ResponseError("BUSY"))


def test_a_cross_host_cancel_of_a_long_int_id_lands(reg: Registry, srv: RedisServer) -> None:
    """A call whose id is an int of more than 256 digits (valid, contract §4.1; keyed by a
    text of its own) is cancelled through another host as any other: the key text the box
    carries is recorded in A's registry, not refused as an over-long id and dropped."""
    prefix = unique_prefix()
    c = Cancellation(reg)
    big = 10**300
    with bridge(reg, srv, thread=True, prefix=prefix, host="A") as a, \
            bridge(reg, srv, thread=True, prefix=prefix, host="B") as b:
        handle = c.begin(big, "session:x")
        assert handle.tracked and a.track(big, "session:x") is not None
        assert b.cancel(big, "stop", "session:x") is True  # recorded in Redis, pushed to A
        wait_until(lambda: handle.cancelled() or None, time.monotonic() + 10, interval=0.02,
                   what="the cancellation delivered on A")
        assert handle.reason() == "stop" and a.delivered == 1
        handle.end()


def test_cancel_scope_cancels_calls_with_long_int_ids(reg: Registry, srv: RedisServer) -> None:
    """A session's DELETE (cancel_scope, on this host and through Redis on every host)
    cancels every call in flight in it, one whose id is a long int too (its row's key is not
    a valid id text: it is not validated again), and never raises (the transport's DELETE)."""
    prefix = unique_prefix()
    c = Cancellation(reg)
    ids = [10**300, 7, "z"]
    with bridge(reg, srv, prefix=prefix, host="A") as a, \
            bridge(reg, srv, prefix=prefix, host="B") as b:
        handles = [c.begin(i, "session:x") for i in ids]
        assert all(h.tracked for h in handles)
        assert all(a.track(i, "session:x") is not None for i in ids)
        assert b.cancel_scope("session:x", "session deleted") == 3
        assert c.cancel_scope("session:x", "session deleted") == 3
        assert all(h.cancelled() for h in handles)
        for h in handles:
            h.end()


def test_a_cancellation_of_an_ended_call_does_not_cancel_the_next_call_of_its_id(
        reg: Registry, srv: RedisServer) -> None:
    """contract §4.3: a later call reusing the id never starts out cancelled. B's cancellation
    of A's call 5 reaches A's box; the call ends before A's thread takes it, and a new call 5
    begins on A: the cancellation, older than the new call, does not cancel it."""
    prefix = unique_prefix()
    c = Cancellation(reg)
    with bridge(reg, srv, prefix=prefix, host="A") as a, \
            bridge(reg, srv, prefix=prefix, host="B") as b:
        h1 = c.begin(5, "session:x")
        r1 = a.track(5, "session:x")
        assert b.cancel(5, "stop", "session:x") is True  # pushed to A's box
        h1.end()
        a.untrack(r1)
        time.sleep(0.01)  # the new call begins after the cancellation
        h2 = c.begin(5, "session:x")
        r2 = a.track(5, "session:x")
        a.start()  # A's thread takes the box now
        wait_until(lambda: a.delivered == 1 or None, time.monotonic() + 10, interval=0.02,
                   what="the box taken")
        assert not h2.cancelled()
        h2.end()
        a.untrack(r2)
        # one sent while the call runs is delivered as ever
        h3 = c.begin(6, "session:x")
        r3 = a.track(6, "session:x")
        assert b.cancel(6, "stop", "session:x") is True
        wait_until(lambda: h3.cancelled() or None, time.monotonic() + 10, interval=0.02,
                   what="the cancellation delivered on A")
        h3.end()
        a.untrack(r3)


def test_an_owed_cancellation_does_not_cancel_a_later_call_of_its_id(
        reg: Registry, srv: RedisServer) -> None:
    """contract §4.3: a later call reusing the id never starts out cancelled. B's notification
    for A's call 5 meets a paused Redis and is owed; call 5 ends and a new call 5 begins on A
    before Redis answers. The owed cancellation lands as of when it was sent, older than the
    new call, which it does not cancel."""
    prefix = unique_prefix()
    c = Cancellation(reg)
    with bridge(reg, srv, thread=True, prefix=prefix, host="A") as a, \
            bridge(reg, srv, thread=True, prefix=prefix, host="B") as b:
        h1 = c.begin(5, "session:x")
        r1 = a.track(5, "session:x")
        until = pause(srv, 1500)
        assert b.cancel(5, "stop", "session:x") is False and b.owed() == 1
        h1.end()
        a.untrack(r1)
        time.sleep(0.01)  # the new call begins after the cancellation was sent
        h2 = c.begin(5, "session:x")
        r2 = a.track(5, "session:x")
        wait_until(lambda: time.monotonic() > until or None, until + 5, what="the pause")
        wait_until(lambda: (b.owed() == 0 and a.owed() == 0) or None, time.monotonic() + 20,
                   interval=0.02, what="the owed writes applied")
        time.sleep(1.0)  # a delivery to A's box would be taken by now
        assert not h2.cancelled()
        h2.end()
        a.untrack(r2)


# ------------------------------------------------------------ keys another client wrote over
def _served(reg: Registry, srv: RedisServer, prefix: str) -> Iterator[Any]:
    """An McpServer (sessions on, one ``echo`` tool) over ``reg``, with this process's bridge
    started on ``srv`` (what the transport consults), stopped after."""
    from shmcancel.server import McpServer
    app = McpServer(name="t", version="1", registry=reg)

    @app.tool("echo")
    def echo(conn: Any, params: Any) -> Any:
        return params.get("text", "")

    b = bridge_mod.start(reg, srv.url, prefix=prefix, timeout=TIMEOUT, lease=30.0, host="h",
                         retry=0.1)
    try:
        yield app, b
    finally:
        bridge_mod.stop()


def _init(app: Any) -> str:
    import json

    from helpers.wsgi import environ_for, run
    body = json.dumps({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {},
        "clientInfo": {"name": "t", "version": "1"}}}).encode()
    r = run(app, environ_for("POST", body))
    assert r.status == 200, r
    return r.headers["mcp-session-id"]


def test_a_delete_whose_running_ids_another_client_garbled_still_ends_the_session(
        reg: Registry, srv: RedisServer) -> None:
    """README: a DELETE on any host cancels the session's calls on every host and ends the
    copies other hosts adopted; the remote's cancel_scope never raises (mcp/remote.py). A member
    of the session scope's set of running ids that is not UTF-8 (another client's write) raised
    UnicodeDecodeError out of cancel_scope: the DELETE was an HTTP 500 and the session stayed
    in Redis, for every other host to go on serving."""
    from helpers.wsgi import environ_for, run
    prefix = unique_prefix()
    with contextlib.contextmanager(_served)(reg, srv, prefix) as (app, b):
        sid = _init(app)
        r = redis.Redis.from_url(srv.url)
        try:
            # a publish (or delete) that took longer than TIMEOUT on a loaded machine is owed,
            # and lands from the bridge's thread
            wait_until(lambda: r.exists(f"{prefix}sess:{sid}"), time.monotonic() + 10,
                       what="the session to be stored in Redis")
            r.sadd(b.store.ifs_key("session:" + sid), b"\xff\xfe")
            reply = run(app, environ_for("DELETE", None, headers={
                "Mcp-Session-Id": sid, "MCP-Protocol-Version": "2025-11-25"}))
            assert reply.status == 204, reply
            wait_until(lambda: not r.exists(f"{prefix}sess:{sid}"), time.monotonic() + 10,
                       what="the session to go from Redis")
        finally:
            r.close()


def test_a_full_redis_refusing_writes_is_not_marked_down_and_reads_go_on(
        reg: Registry, srv: RedisServer) -> None:
    """README: with ``noeviction`` a full Redis answers a write that needs memory with an error,
    which the bridge holds back as owed, while ends, expiry and reads go on. Each OOM answer
    counted as a failed call: DOWN_AFTER of them (new sessions published) marked Redis down,
    and then the bridge skipped the reads too (a session of another host: 503) and cross-host
    cancellation stopped, though Redis answered every call."""
    r = redis.Redis.from_url(srv.url)
    try:
        with bridge(reg, srv) as b:
            b.publish_session(SID, "2025-11-25", "ip:1.2.3.4")
            r.config_set("maxmemory", 1)  # noeviction (the default): every write needing memory
            for i in range(DOWN_AFTER + 1):
                b.publish_session(str(i) * 32, "2025-11-25", "ip:1.2.3.4")
            assert b.owed() == DOWN_AFTER + 1  # refused: owed, not lost
            assert not b.down
            assert b.lookup_session(SID) == ("2025-11-25", "ip:1.2.3.4")  # reads go on
    finally:
        r.config_set("maxmemory", 0)
        r.close()


def test_an_owner_another_client_wrote_into_a_calls_row_does_not_stop_its_cancellation(
        reg: Registry, srv: RedisServer) -> None:
    """An owner of an in-flight row is ``<box>\\n<thread>``; one without the newline (another
    client's write) made cancel.lua fail (``box_of``: arithmetic on nil) for that request: the
    cross-host cancellation never landed, and DOWN_AFTER such notifications marked Redis down
    for every call of the worker. Such an owner names no box: skipped."""
    prefix = unique_prefix()
    c = Cancellation(reg)
    with bridge(reg, srv, thread=True, prefix=prefix, host="A") as a, \
            bridge(reg, srv, prefix=prefix, host="B") as b:
        handle = c.begin(7, "session:x")
        assert handle.tracked and a.track(7, "session:x") is not None
        r = redis.Redis.from_url(srv.url)
        try:
            r.zadd(b.store.if_key("session:x", "7"), {b"no-newline": time.time() * 1000 + 60e3})
        finally:
            r.close()
        for _ in range(DOWN_AFTER):
            assert b.cancel(7, "stop", "session:x") is True
        assert not b.down
        wait_until(lambda: handle.cancelled() or None, time.monotonic() + 10, interval=0.02,
                   what="the cancellation delivered on A")
        handle.end()


def test_keys_of_the_wrong_type_are_answers_not_an_outage(reg: Registry,
                                                           srv: RedisServer) -> None:
    """A key another client wrote with another type answers WRONGTYPE: Redis answered. A
    session key holding a hash made its lookup raise RemoteUnavailable (503 for good, never
    404), and DOWN_AFTER such answers (that lookup, or notifications into a scope whose rows
    key is a string) marked Redis down: every session of another host 503, cross-host
    cancellation off for every call of the worker. The scripts mend such keys (deleted): the
    damaged session is 503 while its holders (none here) may store it again, a box lease,
    then unknown."""
    prefix = unique_prefix()
    with bridge(reg, srv, prefix=prefix) as b:
        b.publish_session(SID, "2025-11-25", "ip:1.2.3.4")
        r = redis.Redis.from_url(srv.url)
        try:
            r.hset(f"{prefix}sess:{'h' * 32}", "a", "b")
            r.set(b.store._skeys("session:w")[0], "a string")
        finally:
            r.close()
        handle = b.track(7, "session:w")
        assert handle is not None and handle[3]
        with pytest.raises(RemoteUnavailable):
            b.lookup_session("h" * 32)  # damaged: mended, its holders told
        for _ in range(DOWN_AFTER + 1):
            with pytest.raises(RemoteUnavailable):
                b.lookup_session("h" * 32)  # while they may store it again
        b.store.client.delete(f"{prefix}sess:{'h' * 32}:mending")  # as at its expiry
        for _ in range(DOWN_AFTER + 1):
            assert b.lookup_session("h" * 32) is None  # no such session: 404
            assert b.cancel(7, "stop", "session:w")  # its rows key mended
        assert not b.down
        assert b.lookup_session(SID) == ("2025-11-25", "ip:1.2.3.4")


def test_an_owed_write_redis_can_never_take_does_not_stop_the_bridge_thread(
        reg: Registry, srv: RedisServer) -> None:
    """The thread applies owed writes before it renews leases and reads its box, stopping at the
    first that fails. One Redis refuses for good (its session's holders set is a string another
    client wrote: WRONGTYPE) failed every turn for its whole deadline (the session TTL): the
    worker read its box no more, so a cross-host cancellation of its call never landed, and
    its leases went unrenewed. The scripts now mend such a key (deleted, then written as
    theirs): the write lands."""
    prefix = unique_prefix()
    c = Cancellation(reg)
    with bridge(reg, srv, prefix=prefix, host="A") as a, \
            bridge(reg, srv, prefix=prefix, host="B") as b:
        r = redis.Redis.from_url(srv.url)
        try:
            r.set(f"{prefix}sess:{SID}:boxes", "a string")
            a.publish_session(SID, "2025-11-25", "ip:1.2.3.4")
            assert a.owed() == 0
            assert r.smembers(f"{prefix}sess:{SID}:boxes") == {a.remote.box.encode()}
        finally:
            r.close()
        a.start()
        handle = c.begin(7, "session:x")
        assert handle.tracked and a.track(7, "session:x") is not None
        assert b.cancel(7, "stop", "session:x") is True
        wait_until(lambda: handle.cancelled() or None, time.monotonic() + 10, interval=0.02,
                   what="the cancellation delivered on A")
        wait_until(lambda: a.owed() == 0 or None, time.monotonic() + 10, what="the write given up")
        handle.end()


def test_a_full_redis_does_not_stop_the_bridge_reading_its_box(reg: Registry,
                                                                srv: RedisServer) -> None:
    """README: a full Redis (noeviction) refuses writes, while ends, expiry and reads go on. The
    thread applies owed writes and renews leases (writes) before it reads its box: each turn
    the refused write raised first, so a cancellation waiting in the box (pushed before Redis
    filled up) was never read while Redis stayed full."""
    prefix = unique_prefix()
    c = Cancellation(reg)
    r = redis.Redis.from_url(srv.url)
    try:
        with bridge(reg, srv, prefix=prefix, host="A") as a, \
                bridge(reg, srv, prefix=prefix, host="B") as b:
            handle = c.begin(7, "session:x")
            assert handle.tracked and a.track(7, "session:x") is not None
            assert b.cancel(7, "stop", "session:x") is True  # in A's box
            r.config_set("maxmemory", 1)
            a.publish_session(SID, "2025-11-25", "ip:1.2.3.4")
            assert a.owed() == 1
            a.start()
            wait_until(lambda: handle.cancelled() or None, time.monotonic() + 10,
                       interval=0.02, what="the cancellation read from A's box")
            handle.end()
    finally:
        r.config_set("maxmemory", 0)
        r.close()


def test_an_item_whose_read_lost_its_reply_is_still_delivered(reg: Registry,
                                                              srv: RedisServer) -> None:
    """Redis slower than the client's timeout still runs the read it was sent: the bridge's
    drain popped a cancellation whose reply then never came, and it was lost for good (its
    notification answered 202, the row recorded in Redis, the call ran to its end). Reads now
    move each item to the worker's taken list, dropped only once applied: after the failed
    call the thread applies what that list holds. The lost reply is made here by raising the
    client's own timeout error after the real command ran (a pause of Redis that long, at that
    moment, is a matter of luck)."""
    with _hosts(reg, srv) as (a, b, c):
        handles = {rid: c.begin(rid, "session:x") for rid in (7, 8)}
        for rid, h in handles.items():
            assert h.tracked and a.track(rid, "session:x") is not None
            assert b.cancel(rid, "stop", "session:x") is True  # in A's box
        lost: list[bytes] = []

        def losing(real: Any) -> Any:
            def call(*args: Any, **kw: Any) -> Any:
                got = real(*args, **kw)
                if got is not None and not lost:  # the first item read without blocking
                    lost.append(got)
                    raise redis.exceptions.TimeoutError("Timeout reading from socket")
                return got
            return call

        a.store.take = losing(a.store.take)  # the drain's read (take.lua)
        a.store.client.rpop = losing(a.store.client.rpop)  # (before the taken list)
        a.start()
        for rid, h in handles.items():
            wait_until(lambda h=h: h.cancelled() or None, time.monotonic() + 10,
                       interval=0.02, what=f"call {rid} cancelled on A")
        assert len(lost) == 1, "the drain's read lost its reply once"
        assert a.delivered == 2
        taken = a.store.taken_key(a.remote.box)
        wait_until(lambda: a.store.client.llen(taken) == 0 or None, time.monotonic() + 5,
                   interval=0.02, what="the taken list emptied")
        for h in handles.values():
            h.end()


@contextlib.contextmanager
def _hosts(reg: Registry, srv: RedisServer) -> Iterator[tuple[Bridge, Bridge, Cancellation]]:
    """Hosts A and B of one deployment (bridges without threads yet), and a Cancellation of
    the registry both stand on here."""
    prefix = unique_prefix()
    with bridge(reg, srv, prefix=prefix, host="A") as a, \
            bridge(reg, srv, prefix=prefix, host="B") as b:
        yield a, b, Cancellation(reg)


@contextlib.contextmanager
def _cancelled_through_b(reg: Registry, srv: RedisServer) -> Iterator[tuple[Bridge, Any]]:
    """Host A (its bridge, no thread yet) running call 7 in ``session:x``, which host B
    cancelled: the cancellation waits in A's box. Yields A's bridge and the call's handle."""
    with _hosts(reg, srv) as (a, b, c):
        handle = c.begin(7, "session:x")
        assert handle.tracked and a.track(7, "session:x") is not None
        assert b.cancel(7, "stop", "session:x") is True  # in A's box
        try:
            yield a, handle
        finally:
            handle.end()


def test_an_item_applied_whose_drop_got_no_answer_is_not_applied_again(
        reg: Registry, srv: RedisServer) -> None:
    """An item applied, then its drop from the taken list fails (no answer: Redis stalled
    writes): the item is still listed, and the thread looks at the list after the failure. It
    only drops it: applied again, a session's end reported its calls cancelled once more per
    turn (4 reports from one 600 ms stall, in a reviewer's run), a cancellation rang again."""
    with _cancelled_through_b(reg, srv) as (a, handle):
        real, failed = a.store.client.lrem, []

        def lrem(*args: Any, **kw: Any) -> Any:
            if not failed:
                failed.append(args)
                raise redis.exceptions.TimeoutError("Timeout reading from socket")
            return real(*args, **kw)

        a.store.client.lrem = lrem
        a.start()
        taken = a.store.taken_key(a.remote.box)
        wait_until(lambda: (failed and a.store.client.llen(taken) == 0) or None,
                   time.monotonic() + 10, interval=0.02, what="the item dropped after all")
        assert handle.cancelled() and a.delivered == 1


def test_the_taken_list_is_leased_as_it_is_made(reg: Registry, srv: RedisServer) -> None:
    """A worker killed between taking an item and dropping it leaves its taken list behind:
    the move that makes the list leases it in the same step (take.lua), so it goes with the
    worker's box, never stays for good."""
    with _cancelled_through_b(reg, srv) as (a, _):
        box, taken = a.store.box_key(a.remote.box), a.store.taken_key(a.remote.box)
        assert a.store.take(box, taken, 3000) is not None  # what the thread does first
        assert 0 < a.store.client.pttl(taken) <= 3000
        assert a.store.take(box, taken, 3000) is None  # the box is empty now


def _clock_moves(c: Cancellation) -> None:
    """Until ``c``'s clock reads later than now (rows and calls are told apart by it)."""
    t0 = c.clock()
    wait_until(lambda: c.clock() > t0 or None, time.monotonic() + 1, interval=0.001,
               what="the clock to move")


def _two_cancellations_of_a_reused_id(a: Any, b: Any, c: Cancellation) -> tuple[Any, ...]:
    """Host A's call 7 is cancelled from host B and ends before A's bridge runs; A's next call
    reuses id 7 and is cancelled from B too: A's box holds both cancellations, oldest first.
    Returns the second call's handle, its Redis row's token, and A's box and taken-list keys."""
    first = c.begin(7, "session:x")
    t1 = a.track(7, "session:x")
    assert first.tracked and t1 is not None
    assert b.cancel(7, "first call", "session:x") is True
    first.end()
    a.untrack(t1)
    _clock_moves(c)
    second = c.begin(7, "session:x")
    t2 = a.track(7, "session:x")
    assert second.tracked and t2 is not None
    _clock_moves(c)
    assert b.cancel(7, "second call", "session:x") is True
    box, taken = a.store.box_key(a.remote.box), a.store.taken_key(a.remote.box)
    assert a.store.client.llen(box) == 2
    return second, t2, box, taken


def test_two_cancellations_of_a_reused_id_land_oldest_first(reg: Registry,
                                                            srv: RedisServer) -> None:
    """A call ends before its worker reads its box, the next call reuses its id and is
    cancelled too: the box holds both cancellations. Applied newest first, the old one then
    replaced the row's stamp with its own, older than the new call, which ignored it and ran
    to its end (a reviewer's repro). Oldest first, the later cancellation's row is the one
    left, and the call is cancelled."""
    with _hosts(reg, srv) as (a, b, c):
        second, t2, box, taken = _two_cancellations_of_a_reused_id(a, b, c)
        a.start()
        wait_until(lambda: (a.delivered == 2 and a.store.client.llen(box) == 0
                            and a.store.client.llen(taken) == 0) or None,
                   time.monotonic() + 10, interval=0.02, what="both items applied")
        assert second.cancelled() and second.reason() == "second call"
        second.end()
        a.untrack(t2)


def test_a_cancellation_kept_after_a_lost_take_reply_still_lands_before_a_newer_one(
        reg: Registry, srv: RedisServer) -> None:
    """take.lua: oldest first, the later cancellation's row last. The move of the older of two
    cancellations of a reused id lost its reply (it ran: the item waits in the taken list), and
    applying it from there on the next turn hit a registry lock timeout (kept for
    ``_redeliver``). That turn went on to read the box all the same: the newer one was applied,
    then the next turn's ``_redeliver`` wrote the older one over it, its stamp older than the
    running call, which ignored it and ran to its end (a reviewer's repro, 3 of 3). The items
    of the taken list stop at a lock timeout, as the box's do: what was kept lands first."""
    with _hosts(reg, srv) as (a, b, c):
        second, t2, box, taken = _two_cancellations_of_a_reused_id(a, b, c)
        lost: list[bytes] = []
        real_take = a.store.take

        def take(*args: Any, **kw: Any) -> Any:  # the first move runs, its reply is lost
            got = real_take(*args, **kw)
            if got is not None and not lost:
                lost.append(got)
                raise redis.exceptions.TimeoutError("Timeout reading from socket")
            return got

        stalls: list[str] = []
        landed: list[str] = []  # the reasons recorded (or refused), in order
        real_cancel = a.local.cancel_key_if_in_flight

        def cancel_key_if_in_flight(rid: str, reason: object, *args: Any, **kw: Any) -> bool:
            if reason == "first call" and not stalls:  # a stalled holder, once
                stalls.append(reason)
                raise LockTimeout("the registry lock held past lock_timeout (forced once)")
            got = real_cancel(rid, reason, *args, **kw)
            landed.append(str(reason))
            return got

        a.store.take = take  # type: ignore[method-assign]
        a.local.cancel_key_if_in_flight = cancel_key_if_in_flight  # type: ignore[method-assign]
        try:
            a.start()
            wait_until(lambda: (len(landed) == 2 and a.undelivered() == 0
                                and a.store.client.llen(box) == 0
                                and a.store.client.llen(taken) == 0) or None,
                       time.monotonic() + 10, interval=0.02, what="both items applied")
            assert lost and stalls, (lost, stalls)
            assert second.cancelled() and second.reason() == "second call"
            assert landed == ["first call", "second call"]  # oldest first
        finally:
            second.end()
            a.untrack(t2)


def test_a_calls_row_key_another_client_wrote_over_does_not_stop_the_bridge_thread(
        reg: Registry, srv: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    """The thread renews every row its worker holds in one script before it reads its box. A
    call whose in-flight key another client wrote as a string (WRONGTYPE) failed that script
    every turn, for as long as the call ran: the worker read its box no more (a cross-host
    cancellation of its other call never landed), renewed none of its leases, and logged a
    warning every turn; as did the add back of a row whose scope's running-id set is a string.
    The scripts mend such keys (deleted, the row added back): every row is renewed."""
    prefix = unique_prefix()
    c = Cancellation(reg)
    with bridge(reg, srv, prefix=prefix, host="A", lease=1.5) as a, \
            bridge(reg, srv, prefix=prefix, host="B") as b:
        r = redis.Redis.from_url(srv.url)
        try:
            r.set(a.store.if_key("session:y", "8"), "a string")
            r.set(a.store.ifs_key("session:z"), "a string")  # each add back of 9 fails
            poisoned = c.begin(8, "session:y")
            assert poisoned.tracked and a.track(8, "session:y") is not None
            poisoned2 = c.begin(9, "session:z")
            assert poisoned2.tracked and a.track(9, "session:z") is not None
            handle = c.begin(7, "session:x")
            assert handle.tracked and a.track(7, "session:x") is not None
            caplog.set_level(logging.WARNING, logger="shmcancel.redis")
            caplog.clear()  # the two tracks' own answers
            a.start()
            # past two leases: the row of call 7 lives on only if the thread renews it
            until = time.monotonic() + 2 * a.remote.lease
            wait_until(lambda: time.monotonic() > until or None, until + 5, interval=0.05,
                       what="two leases")
            assert b.cancel(7, "stop", "session:x") is True  # still in flight in Redis
            wait_until(lambda: handle.cancelled() or None, time.monotonic() + 10,
                       interval=0.02, what="the cancellation delivered on A")
            warnings = [m for m in caplog.messages if "wrong type" in m]
            assert not warnings, warnings
            handle.end()
            poisoned.end()
            poisoned2.end()
        finally:
            r.close()


def test_recovery_after_an_outage_is_tried_again_until_it_is_done(
        reg: Registry, srv: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    """Redis restarts empty; its PING answers first while writes still wait (``CLIENT PAUSE
    WRITE``, as in a failover), so the renewal that follows gets no answer. The bridge used to
    count Redis as back at the PING and never try the rest again: the session it published
    stayed missing (another host answered 404 for a live session) and the call's row with
    it. Now the recovery is tried each turn until it is done."""
    caplog.set_level(logging.WARNING, logger="shmcancel.redis")
    prefix = unique_prefix()
    with bridge(reg, srv, thread=True, prefix=prefix) as b:
        s = SessionStore(reg).create("2025-11-25", "ip:1.2.3.4")
        b.publish_session(s.id, "2025-11-25", "ip:1.2.3.4")
        assert b.track(7, "session:" + s.id) is not None
        assert b.store.get_session(s.id) is not None
        paused = threading.Event()
        ping = b.store.client.ping

        def ping_once_paused() -> Any:  # the bridge's probe answers only once writes wait
            assert paused.wait(10)
            return ping()

        b.store.client.ping = ping_once_paused  # type: ignore[method-assign]
        srv.kill()
        wait_until(lambda: b.down or None, time.monotonic() + 10, what="Redis marked down")
        srv.start()
        c = redis.Redis.from_url(srv.url)
        try:
            c.execute_command("CLIENT", "PAUSE", 1000, "WRITE")
            paused.set()
        finally:
            c.close()
        with bridge(reg, srv, prefix=prefix, host="h2") as other:
            wait_until(lambda: other.lookup_session(s.id) or None, time.monotonic() + 20,
                       interval=0.05, what="the session stored again")
        wait_until(lambda: b.remote.in_flight(7, "session:" + s.id) or None,
                   time.monotonic() + 20, interval=0.05, what="the call's row added back")
        assert any("answers again" in r.getMessage() for r in caplog.records)


def test_a_full_redis_is_not_taken_for_one_that_lost_data(
        reg: Registry, srv: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    """A worker's alive key, refused while Redis is full (``noeviction``), expires on its own:
    once Redis took writes again, every worker logged that Redis had lost data and restored
    what it held, though nothing had been lost."""
    r = redis.Redis.from_url(srv.url)
    try:
        with caplog.at_level(logging.WARNING, logger="shmcancel"), \
                bridge(reg, srv, thread=True, lease=1.5) as b:  # a turn every 0.5 s
            alive = b.store.alive_key(b.remote.box)
            wait_until(lambda: r.exists(alive), time.monotonic() + 10, what="the alive key")
            r.config_set("maxmemory", 1)
            wait_until(lambda: not r.exists(alive), time.monotonic() + 10,
                       what="the alive key to expire, refused")
            r.config_set("maxmemory", 0)
            wait_until(lambda: r.exists(alive), time.monotonic() + 10, what="the key set again")
            first = r.pttl(alive)
            # a later turn set it again: a restore the first one decided has been logged.
            # Seen as its TTL going up again, after it went down (read within a millisecond
            # of the set, ``first`` is the whole lease: no later set could exceed it)
            low = wait_until(lambda: 0 < (p := r.pttl(alive)) < first - 100 and p,
                             time.monotonic() + 10, what="time to pass since that set")
            wait_until(lambda: r.pttl(alive) > low, time.monotonic() + 10, what="a later turn")
        assert not [m for m in caplog.messages if "lost data" in m], caplog.messages
    finally:
        r.config_set("maxmemory", 0)
        r.close()
