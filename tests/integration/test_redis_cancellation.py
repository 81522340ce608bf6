"""contract §3-§4 over a real Redis (``redis_server`` fixture): scoping, quota, the §4.4 eviction
batch and order (checked against the shared-memory policy fed the same operations), TTL,
in-flight gating with leases, telemetry, and a script cache flush (NOSCRIPT). The rules both
backends share run against both (``new`` fixture: ``shm`` and ``redis``)."""

from __future__ import annotations

import random
import time

import pytest
from helpers.clock import Clock as _Clock

import shmcancel
from shmcancel import CancellationLimitReached, Config, InvalidRequestId, telemetry
from shmcancel.redis import RedisCancellation, RedisStore, connect


class Clock(_Clock):
    def tick(self, dt: float = 0.000137) -> float:  # uneven steps: ties in eviction order are rare
        return super().tick(dt)


def make(redis_server, prefix, config=None, clock=None, lease=10.0, host="h1"):
    client = connect(redis_server.url, timeout=2.0)
    store = RedisStore(client, config or Config(), prefix=prefix)
    return RedisCancellation(store, clock=clock or Clock(), lease=lease, host=host)


@pytest.fixture(params=["shm", "redis"])
def new(request, redis_server, redis_prefix, shm_name):
    """``new(config=None, clock=None)``: a fresh Cancellation over the backend of the param
    (one per test)."""
    made = []

    def factory(config=None, clock=None):
        assert not made, "one backend per test"
        if request.param == "redis":
            c = make(redis_server, redis_prefix, config, clock)
        else:
            reg = shmcancel.Registry.create(shm_name, config=config or Config())
            made.append(reg)
            c = shmcancel.Cancellation(reg, clock=clock or Clock())
        made.append(c)
        return c
    yield factory
    for x in made:
        if isinstance(x, shmcancel.Registry):
            x.close()
            x.unlink()


def rows(c) -> int:
    return c.store.rows() if isinstance(c, RedisCancellation) else c._store.rows()


def scope_rows(c, scope: str) -> int:
    st = c.store if isinstance(c, RedisCancellation) else c._store
    return st.scope_rows(scope)


def test_scopes_keep_rows_apart(new):
    c = new()
    c.cancel(1, "a", scope="principal:203.0.113.9")
    assert c.cancelled(1, scope="principal:203.0.113.9")
    assert not c.cancelled(1, scope="ip:203.0.113.9")
    assert not c.cancelled("1", scope="global")
    assert c.cancelled("1", scope="principal:203.0.113.9")  # rows keyed by str(id)
    conn = {"shmcancel.session_id": "s1", "shmcancel.request_id": 7}
    c.cancel(7, scope=c.scope(conn))
    assert c.cancelled(conn)
    assert c.reason(1, scope="principal:203.0.113.9") == "a"


def test_reason_is_sanitised_and_none_kept(new):
    c = new()
    c.cancel("x", "bad\x00\u202etext")
    c.cancel("y")
    assert c.reason("x") == "badtext"
    assert c.cancelled("y") and c.reason("y") is None


@pytest.mark.parametrize("bad", [1.5, True, [1], {"a": 1}, "x" * 257])
def test_invalid_ids(new, bad):
    c = new()
    with pytest.raises(InvalidRequestId):
        c.cancel(bad)
    assert rows(c) == 0
    assert not c.cancelled(bad) and c.reason(bad) is None and not c.in_flight(bad)
    c.clear(bad)
    assert c.track(bad) is None
    c.cancel(None)
    assert rows(c) == 0


def test_quota_rejects_and_overwrite_does_not_count(new):
    clock = Clock()
    c = new(Config(max_rows_per_scope=3), clock)
    for i in range(3):
        c.cancel(i, scope="ip:1.2.3.4")
    with pytest.raises(CancellationLimitReached):
        c.cancel(99, scope="ip:1.2.3.4")
    assert not c.cancelled(99, scope="ip:1.2.3.4")
    clock.tick()
    c.cancel(0, "again", scope="ip:1.2.3.4")  # an existing row: overwritten, no quota check
    assert c.reason(0, scope="ip:1.2.3.4") == "again"
    assert c.cancelled_at(0, scope="ip:1.2.3.4") == clock.t
    assert scope_rows(c, "ip:1.2.3.4") == 3
    c.cancel(99, scope="ip:5.6.7.8")  # another scope has its own quota
    c.clear(1, scope="ip:1.2.3.4")
    c.cancel(99, scope="ip:1.2.3.4")  # room again
    assert rows(c) == 4


@pytest.mark.parametrize("seed", range(6))
def test_eviction_matches_shared_memory_policy(redis_server, redis_prefix, shm_name, seed):
    """The same operations, same clock values, against Redis and the shared-memory
    Cancellation: after each step both hold exactly the same rows (§4.4 batch and order)."""
    rnd = random.Random(seed)
    cfg = Config(max_rows=40, capacity=200, max_rows_per_scope=30)
    clock = Clock()
    r = make(redis_server, redis_prefix, cfg, clock)
    reg = shmcancel.Registry.create(shm_name, config=cfg)
    try:
        s = shmcancel.Cancellation(reg, clock=clock)
        scopes = [f"ip:10.0.0.{i}" for i in range(5)]
        for step in range(160):
            scope = rnd.choice(scopes[: 1 + step % 5])
            rid = rnd.randrange(60)
            if rnd.random() < 0.3:
                clock.tick(rnd.choice([0.0, 0.000001, 0.5]))  # ties decided by scope, id
            else:
                clock.tick()
            outcomes = []
            for c in (r, s):
                try:
                    c.cancel(rid, f"r{step}", scope=scope)
                    outcomes.append("ok")
                except CancellationLimitReached:
                    outcomes.append("quota")
            assert outcomes[0] == outcomes[1]
            want = sorted((sc, i, a) for sc, i, _reason, a in s._store.cancellations())
            got = sorted((sc, i, a) for sc, i, _reason, a in r.store.cancellations())
            assert got == want, f"step {step}"
        assert r.store.rows() <= 40
    finally:
        reg.close()
        reg.unlink()


def test_eviction_batch_takes_largest_scope_oldest_first(new):
    clock = Clock()
    c = new(Config(max_rows=20, capacity=100, max_rows_per_scope=None), clock)
    for i in range(12):  # big scope: 12 rows, oldest first
        clock.tick()
        c.cancel(i, scope="ip:big")
    for i in range(8):
        clock.tick()
        c.cancel(i, scope="ip:small")
    clock.tick()
    c.cancel("new", scope="ip:small")  # at the cap: batch = 20 // 20 = 1 row goes
    assert not c.cancelled(0, scope="ip:big")
    assert c.cancelled(1, scope="ip:big") and c.cancelled("new", scope="ip:small")
    assert rows(c) == 20


def test_ttl_expiry_is_strict(new):
    clock = Clock()
    c = new(Config(ttl=10.0), clock)
    c.cancel("old")
    t0 = clock.t
    clock.t = t0 + 5
    c.cancel("young")
    clock.t = t0 + 10.0  # now - at == ttl: kept (strictly older only)
    assert c.cleanup() == 0
    clock.t = t0 + 10.5
    assert c.cleanup() == 1
    assert not c.cancelled("old") and c.cancelled("young")
    assert scope_rows(c, "global") == 1


def test_gating_follows_in_flight_rows(new):
    c = new()
    assert not c.cancel_if_in_flight(5, "x", scope="s")
    assert rows(c) == 0  # not in flight: nothing recorded
    c.track(5, scope="s")
    assert c.in_flight(5, scope="s") and not c.in_flight(5, scope="t")
    assert c.cancel_if_in_flight(5, "x", scope="s")
    assert c.cancelled(5, scope="s")
    c.untrack(5, scope="s")
    c.clear(5, scope="s")  # the end of the request: untrack, then clear
    assert not c.in_flight(5, scope="s") and not c.cancelled(5, scope="s")
    assert not c.cancel_if_in_flight(5, "late", scope="s")
    assert rows(c) == 0


def test_redis_untrack_ends_the_row_too(redis_server, redis_prefix):
    c = make(redis_server, redis_prefix)
    token = c.track_token(5, scope="s")
    assert c.cancel_if_in_flight(5, "x", scope="s") and token is not None
    c.untrack_token("s", "5", token)  # no namesake runs on: the row goes with the request
    assert not c.in_flight(5, scope="s") and not c.cancelled(5, scope="s")


def test_namesakes_each_hold_a_row(redis_server, redis_prefix):
    a = make(redis_server, redis_prefix, host="A")
    b = make(redis_server, redis_prefix, host="B")
    ta, tb = a.track_token(1, "ip:x"), b.track_token(1, "ip:x")
    assert ta and tb
    a.untrack_token("ip:x", "1", ta)
    assert b.in_flight(1, "ip:x")
    b.untrack_token("ip:x", "1", tb)
    assert not a.in_flight(1, "ip:x")


def test_cancel_goes_to_the_owner_box(redis_server, redis_prefix):
    a = make(redis_server, redis_prefix, host="A")
    b = make(redis_server, redis_prefix, host="B")
    a.track("q", "session:z")
    assert b.cancel_if_in_flight("q", "stop", "session:z")
    raw = a.store.client.rpop(a.store.box_key(a.box))
    assert RedisStore.decode_box_item(raw) == ("session:z", "q", "stop")
    assert a.store.client.llen(b.store.box_key(b.box)) == 0


def test_a_stale_row_does_not_cancel_a_new_request(redis_server, redis_prefix):
    clock = Clock()
    c = make(redis_server, redis_prefix, clock=clock)
    c.cancel(3, scope="s")  # left by an earlier request (or a racing notification)
    clock.tick(1.0)
    c.track(3, scope="s")
    assert not c.cancelled(3, scope="s")


def test_rows_of_a_dead_host_expire_with_its_lease(redis_server, redis_prefix):
    dead = make(redis_server, redis_prefix, lease=0.3, host="dead")
    live = make(redis_server, redis_prefix, lease=0.3, host="live")
    dead.track(1, "s")
    live.track(2, "s")
    deadline = time.monotonic() + 5
    while dead.in_flight(1, "s") and time.monotonic() < deadline:
        live.renew()  # the live host renews; the dead one never does
        time.sleep(0.05)
    assert not dead.in_flight(1, "s")
    assert live.in_flight(2, "s")
    assert not live.cancel_if_in_flight(1, None, "s")


def test_renew_adds_back_rows_redis_lost(redis_server, redis_prefix):
    c = make(redis_server, redis_prefix)
    c.track(1, "s")
    c.store.client.delete(c.store.if_key("s", "1"))  # as after a Redis restart
    assert not c.in_flight(1, "s")
    assert c.renew() == 1
    assert c.in_flight(1, "s")


def test_noscript_reloads(redis_server, redis_prefix):
    c = make(redis_server, redis_prefix)
    c.cancel(1)
    c.store.client.script_flush()
    c.cancel(2)
    assert c.cancelled(1) and c.cancelled(2)


def test_telemetry_events(new):
    clock = Clock()
    c = new(Config(ttl=1.0), clock)
    seen: list[tuple] = []
    telemetry.attach("t-redis-1", ("shmcancel", "request", "cancelled"),
                     lambda e, m, md, cfg: seen.append((e, dict(m), dict(md))))
    telemetry.attach("t-redis-2", ("shmcancel", "cancellation", "cleanup"),
                     lambda e, m, md, cfg: seen.append((e, dict(m), dict(md))))
    try:
        c.cancel(4, "why", scope="ip:1.1.1.1")
        clock.tick(2)
        c.cleanup()
    finally:
        telemetry.detach("t-redis-1")
        telemetry.detach("t-redis-2")
    assert seen == [
        (("shmcancel", "request", "cancelled"), {"count": 1},
         {"request_id": "4", "scope": "ip:1.1.1.1", "reason": "why"}),
        (("shmcancel", "cancellation", "cleanup"), {"removed": 1, "in_flight_removed": 0}, {}),
    ]


def test_keys_carry_the_prefix_and_scope_hash_tag(redis_server, redis_prefix):
    c = make(redis_server, redis_prefix)
    c.cancel(1, scope="ip:9.9.9.9")
    c.track(2, scope="ip:9.9.9.9")
    keys = sorted(k.decode() for k in c.store.client.keys(redis_prefix + "*"))
    assert keys and all(k.startswith(redis_prefix) for k in keys)
    tagged = [k for k in keys if "{g}" not in k]
    tags = {k[k.index("{"):k.index("}") + 1] for k in tagged}
    assert len(tags) == 1 and len(tagged) == 4  # :c, :t, :ifs, :if:<rid> share one slot


def test_cancel_scope_reaches_every_host(redis_server, redis_prefix):
    a = make(redis_server, redis_prefix, host="A")
    b = make(redis_server, redis_prefix, host="B")
    a.track(1, "session:s")
    b.track(2, "session:s")
    b.track(3, "session:other")
    ended = b.track_token(4, "session:s")
    assert ended is not None
    b.untrack_token("session:s", "4", ended)
    assert a.cancel_scope("session:s", "deleted") == 2
    assert a.cancelled(1, "session:s") and a.cancelled(2, "session:s")
    assert not a.cancelled(3, "session:other") and not a.cancelled(4, "session:s")
    assert a.store.client.llen(a.store.box_key(a.box)) == 1
    assert b.store.client.llen(b.store.box_key(b.box)) == 1


def test_quota_and_cap_are_shared_by_hosts(redis_server, redis_prefix):
    clock = Clock()
    cfg = Config(max_rows=20, capacity=100, max_rows_per_scope=4)
    a = make(redis_server, redis_prefix, cfg, clock, host="A")
    b = make(redis_server, redis_prefix, cfg, clock, host="B")
    for i in range(2):
        clock.tick()
        a.cancel(i, scope="ip:q")
        clock.tick()
        b.cancel(10 + i, scope="ip:q")
    with pytest.raises(CancellationLimitReached):
        a.cancel(99, scope="ip:q")
    with pytest.raises(CancellationLimitReached):
        b.cancel(99, scope="ip:q")
    for i in range(16):  # fill to the cap from both hosts, one row per scope
        clock.tick()
        (a, b)[i % 2].cancel(i, scope=f"ip:s{i}")
    assert a.store.rows() == 20
    clock.tick()
    b.cancel("next", scope="ip:new")  # at the cap: the largest scope's oldest row goes
    assert not b.cancelled(0, scope="ip:q") and a.cancelled(10, scope="ip:q")
    assert a.store.rows() == 20
