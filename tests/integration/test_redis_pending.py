"""A cross-host cancellation that finds no in-flight row because Redis lost it (a restart, a
lease that ran out while its host could not reach Redis), against a real redis-server: it waits
in Redis (``pc``, bounded per scope, with a TTL) and lands when the row of a request started by
then is added back; a request started after it is never cancelled by it (contract §4.3). And a
row added back keeps its request's start, so a cancellation recorded for it is not taken for a
stale one."""

from __future__ import annotations

import time
from typing import Any

import msgpack
import pytest
import redis
from helpers.background import Background
from helpers.clock import Clock
from helpers.gunicorn_harness import wait_until
from helpers.mcp_client import tag, wait_file
from helpers.redis_server import running, unique_prefix
from test_redis_bridge import bridge
from test_redis_hosts import Client, outdir, two_hosts

from shmcancel import Cancellation, Config, errors
from shmcancel.redis import RedisCancellation, RedisStorage, RedisStore, connect
from shmcancel.shm.registry import Registry

__all__ = ["outdir"]  # the module fixture, shared

S = "session:z"


def make(url: str, prefix: str, clock: Clock, host: str, config: Config | None = None,
         pending: float = 10.0) -> RedisCancellation:
    store = RedisStore(connect(url, timeout=2.0), config or Config(), prefix=prefix)
    return RedisCancellation(store, clock=clock, host=host, pending=pending)


def lose_row(c: RedisCancellation, rid: str, scope: str = S) -> None:
    """What a Redis restart (or a lease run out) does to one request's in-flight row."""
    c.store.client.delete(c.store.if_key(scope, rid))
    assert not c.in_flight(rid, scope)


def put_pending(c: RedisCancellation, rid: str, raw: bytes, scope: str = S) -> None:
    """Write a pending cancellation as another client could (common.lua's key layout),
    waiting a minute."""
    r = c.store.client
    r.hset(c.store.pc_key(scope), rid, raw)
    r.zadd(c.store.prefix + "{g}:pend", {f"{len(scope.encode())}:{scope}{rid}":
                                         int(time.time() * 1000) + 60_000})


def box(c: RedisCancellation) -> list[Any]:
    """What waits in ``c``'s box, oldest first (taken): ``(scope, rid, reason)``, each checked
    to carry the time of the row it delivers."""
    out = []
    while (raw := c.store.client.rpop(c.store.box_key(c.box))) is not None:
        item = RedisStore.decode_box_item(raw)
        assert isinstance(item, tuple)
        assert item[3] is not None and item[3] == c.store.get(item[0], item[1])[1]  # type: ignore[index]
        out.append(item[:3])
    return out


def test_a_cancellation_that_finds_no_row_lands_when_the_row_is_added_back(
        redis_server: Any, redis_prefix: str) -> None:
    clock = Clock()
    a, b = (make(redis_server.url, redis_prefix, clock, h) for h in "AB")
    a.track_token("7", S)
    clock.tick(1.0)
    lose_row(a, "7")
    clock.tick(1.0)
    assert b.cancel_if_in_flight("7", "stop", S) is False  # nothing in flight now
    assert not b.cancelled("7", S)  # and no row recorded
    clock.tick(1.0)
    assert a.renew() == 1
    assert box(a) == [(S, "7", "stop")]
    assert a.cancelled("7", S) and a.reason("7", S) == "stop"
    assert a.cancelled_at("7", S) == clock.t - 1.0  # when it was sent


def test_a_call_whose_track_lands_after_its_cancellation_is_cancelled(
        redis_server: Any, redis_prefix: str) -> None:
    """The start race: the call is held on its host (its Redis track not there yet) when the
    notification reaches another host."""
    clock = Clock()
    a, b = (make(redis_server.url, redis_prefix, clock, h) for h in "AB")
    token = a.track_offline(S, "8")
    clock.tick(0.5)
    assert b.cancel_if_in_flight("8", None, S) is False
    a.track_held(S, "8", token)
    assert box(a) == [(S, "8", None)]
    assert a.cancelled("8", S)


def test_a_request_started_after_the_cancellation_is_not_cancelled_by_it(
        redis_server: Any, redis_prefix: str) -> None:
    clock = Clock()
    a, b = (make(redis_server.url, redis_prefix, clock, h) for h in "AB")
    assert b.cancel_if_in_flight("9", "late", S) is False  # its call ended: it reused the id
    clock.tick(0.2)
    a.track_token("9", S)
    lose_row(a, "9")
    assert a.renew() == 1  # added back: still started after the notification
    assert box(a) == [] and not a.cancelled("9", S)


def test_a_row_added_back_keeps_its_request_start(redis_server: Any,
                                                  redis_prefix: str) -> None:
    """A row recorded for a running request survives the request's row being added back: the
    re-add is not a new request that finds an older cancellation."""
    clock = Clock()
    a, b = (make(redis_server.url, redis_prefix, clock, h) for h in "AB")
    a.track_token("10", S)
    clock.tick(1.0)
    assert b.cancel_if_in_flight("10", "stop", S) is True
    assert box(a) == [(S, "10", "stop")]
    clock.tick(1.0)
    lose_row(a, "10")
    assert a.renew() == 1
    assert a.cancelled("10", S) and b.cancelled("10", S)


def test_pending_cancellations_are_bounded_per_scope_and_expire(
        redis_server: Any, redis_prefix: str) -> None:
    clock = Clock()
    b = make(redis_server.url, redis_prefix, clock, "B",
             config=Config(max_rows_per_scope=4), pending=0.3)
    r = b.store.client
    for i in range(10):
        assert b.cancel_if_in_flight(str(i), None, S) is False
    assert r.hlen(b.store.pc_key(S)) == 4
    assert 0 < r.pttl(b.store.pc_key(S)) <= 300
    clock.tick(0.1)
    assert b.cancel_if_in_flight("0", "again", S) is False  # held already: renewed, full or not
    assert r.hlen(b.store.pc_key(S)) == 4
    wait_until(lambda: r.exists(b.store.pc_key(S)) == 0 or None, time.monotonic() + 5,
               interval=0.02, what="the pending cancellations to expire")
    assert b.store.rows() == 0


def test_pending_zero_drops_a_cancellation_that_finds_nothing(
        redis_server: Any, redis_prefix: str) -> None:
    clock = Clock()
    a = make(redis_server.url, redis_prefix, clock, "A")
    b = make(redis_server.url, redis_prefix, clock, "B", pending=0)
    a.track_token("11", S)
    lose_row(a, "11")
    assert b.cancel_if_in_flight("11", None, S) is False
    assert b.store.client.exists(b.store.pc_key(S)) == 0
    assert a.renew() == 1 and box(a) == [] and not a.cancelled("11", S)


def test_a_pending_cancellation_respects_the_scope_quota(redis_server: Any,
                                                         redis_prefix: str) -> None:
    clock = Clock()
    cfg = Config(max_rows_per_scope=2)
    a = make(redis_server.url, redis_prefix, clock, "A", config=cfg)
    b = make(redis_server.url, redis_prefix, clock, "B", config=cfg)
    a.track_token("12", S)
    lose_row(a, "12")
    clock.tick(0.1)
    assert b.cancel_if_in_flight("12", None, S) is False
    b.cancel("x", scope=S)
    b.cancel("y", scope=S)  # the scope's quota is full now
    assert a.renew() == 1
    assert box(a) == [] and not a.cancelled("12", S)


def test_an_owed_cancellation_applied_before_the_row_is_back_lands(shm_name: str) -> None:
    """Redis restarts empty while a call runs on host A and host B owes its cancellation; B
    applies it before A adds its row back (the order that lost it before), then A's bridge
    delivers it to the running call."""
    reg = Registry.create(shm_name, Config(capacity=400, max_rows=200, in_flight_capacity=64,
                                           session_capacity=16))
    prefix = unique_prefix()
    try:
        with running() as srv, bridge(reg, srv, prefix=prefix, host="A") as a, \
                bridge(reg, srv, prefix=prefix, host="B") as b:
            handle = Cancellation(reg).begin(7, "session:x")
            assert handle.tracked and a.track(7, "session:x") is not None
            srv.kill()
            assert b.cancel(7, "stop", "session:x") is False and b.owed() == 1
            srv.start()
            b._settle()  # the owed cancellation, applied while nothing is in flight in Redis
            assert b.owed() == 0 and b.owed_applied == 1
            assert a.remote.renew() == 1  # A's row added back
            r = redis.Redis.from_url(srv.url)
            raw = r.rpop(a.store.box_key(a.remote.box))
            r.close()
            assert raw is not None
            a._apply(raw)
            assert handle.cancelled() and handle.reason() == "stop"
            handle.end()
    finally:
        reg.close()
        reg.unlink()


def test_a_call_cancelled_through_b_while_redis_restarts_is_cancelled(
        outdir: str, shm_name: str, shm_names: list[str]) -> None:
    """README's failure table: the notification reaches B while Redis is down (owed), Redis
    comes back empty; whichever of B's owed cancellation and A's re-added row reaches Redis
    first, the call ends with -32800."""
    with running() as srv, two_hosts(srv.url, outdir, shm_name, shm_names) as (a, b, _):
        c = Client(a.url)
        assert c.call(b.url, 0, "echo", {"text": "x"})["result"]  # adopted on B
        for i in range(3):
            t = tag()
            call = Background(lambda t=t, i=i: c.call(a.url, f"r{i}", "sleep",
                                                      {"seconds": 30, "tag": t}))
            call.start()
            wait_file(f"{outdir}/{t}.started", time.monotonic() + 10)
            srv.kill()
            assert c.cancel(b.url, f"r{i}").status_code == 202
            srv.start()
            assert call.result(25)["error"]["code"] == errors.REQUEST_CANCELLED


def test_a_thread_tracking_an_id_again_starts_a_new_request(redis_prefix: str) -> None:
    """``Cancellation.track`` over RedisStorage: a thread whose untrack got no answer still holds
    the old row here; tracking the id again is a new request, started now. It kept the old
    request's start, so a pending cancellation sent after the old request began but before
    the new one did made the new request start out cancelled (contract 4.3)."""
    clock = Clock()
    with running() as srv:
        st = RedisStorage(RedisStore(connect(srv.url, timeout=2.0), Config(), prefix=redis_prefix),
                          clock=clock, host="A", auto_renew=False)
        c = Cancellation(None, clock, backend=st)
        b = make(srv.url, redis_prefix, clock, "B")
        c.track("1", S)
        clock.tick(1.0)
        srv.kill()
        c.untrack("1", S)  # the request ended; its end got no answer (logged)
        srv.start()  # empty
        clock.tick(1.0)
        assert b.cancel_if_in_flight("1", "for the old one", S) is False
        clock.tick(1.0)
        c.track("1", S)  # a new request reusing the id, on the same thread
        assert not c.cancelled("1", S)
        assert st.store.client.llen(st.store.box_key(st.box)) == 0


def test_a_malformed_pending_entry_fails_neither_track_nor_renew(redis_server: Any,
                                                                 redis_prefix: str) -> None:
    """A pc entry written by someone else whose time cmsgpack/tonumber accept but ZADD refuses
    (or that is not finite) made track.lua fail after adding the row: track raised, and renew
    stopped at that row, so rows after it were never added back."""
    clock = Clock()
    a = make(redis_server.url, redis_prefix, clock, "A")
    for rid in ("1", "2", "3", "4"):
        a.track_token(rid, S)
        lose_row(a, rid)
    for rid, at in (("1", b"1e400"), ("2", b" 2000000"), ("3", b"inf")):
        put_pending(a, rid, msgpack.packb([b"=x", at], use_bin_type=False))
    clock.tick(1.0)
    assert a.renew() == 4
    assert all(a.in_flight(rid, S) for rid in ("1", "2", "3", "4"))
    for rid in ("1", "3"):  # not a finite time: no row
        assert a.cancelled_at(rid, S) is None
    put_pending(a, "5", msgpack.packb([b"=x", b"1e400"], use_bin_type=False))
    a.track_token("5", S)
    assert a.in_flight("5", S) and not a.cancelled("5", S)


def test_a_pending_cancellation_waits_pending_seconds_however_busy_its_scope(
        redis_server: Any, redis_prefix: str) -> None:
    """``pending`` is how long one cancellation waits: the scope's hash had one TTL, renewed by
    every newer pending cancellation, so in a scope that kept getting some, an old one waited
    on for ever and cancelled a row added back long after."""
    clock = Clock()
    a = make(redis_server.url, redis_prefix, clock, "A")
    b = make(redis_server.url, redis_prefix, clock, "B", pending=0.3)
    a.track_token("7", S)
    lose_row(a, "7")
    clock.tick(1.0)
    assert b.cancel_if_in_flight("7", "stop", S) is False
    end = time.monotonic() + 0.9  # three times `pending`, with other notifications meanwhile
    n = iter(range(10**6))
    wait_until(lambda: b.cancel_if_in_flight(f"x{next(n)}", None, S) or time.monotonic() > end,
               end + 5, interval=0.05, what="0.9 s of notifications")
    assert b.store.client.exists(b.store.pc_key(S))  # the scope's other ones still wait
    assert a.renew() == 1
    assert box(a) == [] and not a.cancelled("7", S)


@pytest.mark.parametrize("lost", ["pend written over", "no end anywhere"])
def test_a_pending_cancellation_outlives_its_wait_index_written_over(
        redis_server: Any, redis_prefix: str, lost: str) -> None:
    """Junk over ``{g}:pend`` (another client's write; mended: deleted) took every waiting
    cancellation's end with it, and track.lua read "no end" as "wait over": the row added
    back dropped the cancellation, and the call ran on. The entry keeps its own end; one with
    no end anywhere still waits (its scope's hash has a TTL)."""
    clock = Clock()
    a, b = (make(redis_server.url, redis_prefix, clock, h) for h in "AB")
    for rid in ("7", "8"):
        a.track_token(rid, S)
        lose_row(a, rid)
    clock.tick(1.0)
    assert b.cancel_if_in_flight("7", "stop", S) is False
    r = a.store.client
    if lost == "no end anywhere":  # as an entry written before the end was kept in it
        r.hset(a.store.pc_key(S), "7", msgpack.packb([b"=stop", repr(clock.t)], use_bin_type=False))
    r.set(a.store.prefix + "{g}:pend", b"junk")
    assert a.renew() == 2
    assert box(a) == [(S, "7", "stop")] and a.reason("7", S) == "stop"
    assert not a.cancelled("8", S)


def test_pending_cancellations_are_bounded_across_scopes(redis_server: Any,
                                                         redis_prefix: str) -> None:
    """Each scope keeps at most pending_max, but scopes are many (a client opens sessions): the
    pending cancellations of every scope together are at most the row cap, as rows are."""
    clock = Clock()
    b = make(redis_server.url, redis_prefix, clock, "B", config=Config(max_rows=20))
    for s in range(10):
        for i in range(5):
            assert b.cancel_if_in_flight(str(i), None, f"session:{s}") is False
    total = sum(b.store.client.hlen(b.store.pc_key(f"session:{s}")) for s in range(10))
    assert total == 20


def test_a_pending_cancellation_lands_once(redis_server: Any, redis_prefix: str) -> None:
    """Once it landed, a row lost and added back again within ``pending`` keeps the newer
    cancellation recorded since: the older one does not land over it."""
    clock = Clock()
    a, b = (make(redis_server.url, redis_prefix, clock, h) for h in "AB")
    a.track_token("13", S)
    lose_row(a, "13")
    clock.tick(1.0)
    assert b.cancel_if_in_flight("13", "first", S) is False
    assert a.renew() == 1 and box(a) == [(S, "13", "first")]
    clock.tick(1.0)
    assert b.cancel_if_in_flight("13", "second", S) is True
    assert box(a) == [(S, "13", "second")]
    lose_row(a, "13")
    assert a.renew() == 1
    # the row recorded for it is handed to it again (its box may have been lost), not "first"
    assert box(a) == [(S, "13", "second")] and a.reason("13", S) == "second"
    assert a.cancelled_at("13", S) == clock.t
