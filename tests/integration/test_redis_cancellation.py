"""contract §3-§4 over a real Redis (``redis_server`` fixture): scoping, quota, the §4.4 eviction
batch and order (checked against the shared-memory policy fed the same operations), TTL,
in-flight gating with leases, and a script cache flush (NOSCRIPT): what is Redis's own. The
rules both backends share run against both in tests/cancel/test_cancellation.py (``make_any``)."""

from __future__ import annotations

import random
import shutil
import subprocess
import time

import msgpack
import pytest
from helpers.clock import Clock as _Clock
from helpers.redis_server import RedisServer

import shmcancel
from shmcancel import CancellationLimitReached, Config
from shmcancel.redis import RedisCancellation, RedisStore, connect


class Clock(_Clock):
    def tick(self, dt: float = 0.000137) -> float:  # uneven steps: ties in eviction order are rare
        return super().tick(dt)


def make(redis_server, prefix, config=None, clock=None, lease=10.0, host="h1"):
    client = connect(redis_server.url, timeout=2.0)
    store = RedisStore(client, config or Config(), prefix=prefix)
    return RedisCancellation(store, clock=clock or Clock(), lease=lease, host=host)


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


def test_eviction_breaks_a_tie_of_one_scopes_rows_by_id_as_shared_memory_does(
        redis_server, redis_prefix, shm_name):
    """contract §4.4: rows of one age in one scope go in id order. The random test above
    rarely ties two rows of a scope that a batch then cuts between, so the eviction script's
    own id comparison went unchecked (reversed, Redis evicted A/y where shared memory evicts
    A/x)."""
    cfg = Config(max_rows=40, capacity=200, max_rows_per_scope=30)  # batch 2
    clock = Clock()
    r = make(redis_server, redis_prefix, cfg, clock)
    reg = shmcancel.Registry.create(shm_name, config=cfg)
    try:
        s = shmcancel.Cancellation(reg, clock=clock)

        def put(scope: str, rid: str, at: float) -> None:
            clock.t = at
            for c in (r, s):
                c.cancel(rid, "x", scope=scope)

        put("B", "b0", 1000.0)  # the oldest row: the first to go
        put("A", "x", 1001.0)
        put("A", "y", 1001.0)  # as old as A/x: the id decides the second
        for i in range(18):
            put("A", f"z{i:02}", 1010.0)
        for i in range(19):
            put("B", f"w{i:02}", 1010.0)  # A and B: 20 rows each, the largest scopes
        put("C", "new", 1020.0)  # at the cap (40): a batch of 2 goes
        want = sorted((sc, i) for sc, i, _r, _a in s._store.cancellations())
        got = sorted((sc, i) for sc, i, _r, _a in r.store.cancellations())
        assert ("B", "b0") not in want and ("A", "x") not in want and ("A", "y") in want
        assert got == want
    finally:
        reg.close()
        reg.unlink()


@pytest.fixture
def collating_redis(tmp_path):
    """A redis-server whose locale collates unlike bytes (en_US.UTF-8: "a" < "B", punctuation
    ignored), built with localedef into the test's directory; skipped where it cannot be."""
    if shutil.which("localedef") is None:
        pytest.skip("localedef is not installed")
    done = subprocess.run(["localedef", "-i", "en_US", "-f", "UTF-8",
                           str(tmp_path / "en_US.UTF-8")], capture_output=True, timeout=120)
    if not (tmp_path / "en_US.UTF-8").is_dir():
        pytest.skip(f"no en_US.UTF-8 locale could be built: {done.stderr[-200:]!r}")
    srv = RedisServer(env={"LOCPATH": str(tmp_path), "LC_ALL": "en_US.UTF-8"})
    try:
        yield srv.start()
    finally:
        srv.stop()


def test_eviction_ties_follow_the_contract_whatever_the_servers_locale(collating_redis,
                                                                       redis_prefix,
                                                                       shm_name):
    """contract §4.4: rows go in (-rows_in_their_scope, cancelled_at, scope, id) order. Rows of
    one time were ordered by Lua's string "<", which is strcoll in the server's locale
    (redis-server calls setlocale(LC_COLLATE, "")): under en_US.UTF-8 scope "a" went before
    "B", id "a:x" after "ab", unlike the shared-memory policy (code points) fed the same
    operations."""
    probe = connect(collating_redis.url, timeout=2.0)
    assert probe.eval("return tostring('a' < 'B')", 0) == b"true"  # the locale took
    probe.close()
    cfg = Config(max_rows=4, capacity=200, max_rows_per_scope=30)
    clock = Clock()  # never ticked: one time for every row, ties throughout
    r = make(collating_redis, redis_prefix, cfg, clock)
    reg = shmcancel.Registry.create(shm_name, config=cfg)
    try:
        s = shmcancel.Cancellation(reg, clock=clock)
        ops = [("a", "1"), ("B", "1"), ("s", "ab"), ("s", "a:x"), ("c", "1"), ("d", "1"),
               ("s", "B"), ("s", "a"), ("e", "1"), ("f", "1")]
        for scope, rid in ops:
            for c in (r, s):
                c.cancel(rid, "x", scope=scope)
            want = sorted((sc, i) for sc, i, _reason, _a in s._store.cancellations())
            got = sorted((sc, i) for sc, i, _reason, _a in r.store.cancellations())
            assert got == want, (scope, rid)
    finally:
        reg.close()
        reg.unlink()


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
    # with when it was recorded: the worker's local row is stamped with it
    assert RedisStore.decode_box_item(raw) == ("session:z", "q", "stop",
                                               b.cancelled_at("q", "session:z"))
    assert a.store.client.llen(b.store.box_key(b.box)) == 0


@pytest.mark.parametrize("item", [[400_000_000] * 3, [b"s", b"q", 10**9], [b"d", 10**9],
                                  [b"s", b"q"], {"a": 1}, 5, b"\xc1", [b"s", [b"q"], b"r"]])
def test_a_malformed_box_item_is_dropped_without_allocating(item):
    """A box item written by anyone with Redis access: ints where byte strings go must not
    become bytes(n) (one item of 16 bytes once allocated 1.5 GB)."""
    import tracemalloc

    raw = item if isinstance(item, bytes) else msgpack.packb(item)
    tracemalloc.start()
    try:
        assert RedisStore.decode_box_item(raw) is None
        assert tracemalloc.get_traced_memory()[1] < 1 << 20
    finally:
        tracemalloc.stop()


def test_a_stale_row_does_not_cancel_a_new_request(redis_server, redis_prefix):
    clock = Clock()
    c = make(redis_server, redis_prefix, clock=clock)
    c.cancel(3, scope="s")  # left by an earlier request (or a racing notification)
    clock.tick(1.0)
    c.track(3, scope="s")
    assert not c.cancelled(3, scope="s")


def test_members_another_client_put_in_the_index_do_not_stop_expiry(redis_server,
                                                                     redis_prefix):
    """One member not of the form <#scope>:<scope><rid> made every expiry script fail (a Lua
    error on a nil), so rows past their TTL stayed; it is dropped now, rows expire."""
    clock = Clock()
    c = make(redis_server, redis_prefix, clock=clock)
    c.cancel(1, scope="s")
    junk = [b"no-colon", b"99:short", b"x:ab", b"-1:s", b"1.5:sx"]
    c.store.client.zadd(c.store._all, dict.fromkeys(junk, 0))
    assert [r[:2] for r in c.store.cancellations()] == [("s", "1")]
    clock.tick(400.0)
    assert c.cleanup(ttl=300.0) == 1
    assert not c.cancelled(1, scope="s")
    assert [c.store.client.zscore(c.store._all, m) for m in junk] == [None] * len(junk)


def test_a_scope_key_another_client_wrote_over_does_not_stop_expiry(redis_server,
                                                                    redis_prefix):
    """contract §4.6: cleanup removes rows with now - cancelled_at > ttl. A member of the index
    whose scope's rows key another client wrote with another type made the expiry script fail
    on it (WRONGTYPE) at every sweep, so no row of any scope past its TTL went (and the bridge
    logged a warning each sweep). Such a member names no row of ours: dropped, rows expire."""
    clock = Clock()
    c = make(redis_server, redis_prefix, clock=clock)
    c.cancel(1, scope="s")
    c.store.client.set(c.store._skeys("x")[0], "a string")
    c.store.client.set(c.store._skeys("y")[1], "a string")
    junk = [b"1:x9", b"1:y9"]
    c.store.client.zadd(c.store._all, dict.fromkeys(junk, 0))  # the oldest: met first
    clock.tick(400.0)
    assert c.cleanup(ttl=300.0) == 1
    assert not c.cancelled(1, scope="s")
    assert [c.store.client.zscore(c.store._all, m) for m in junk] == [None] * len(junk)


def test_index_members_whose_row_is_not_there_do_not_hide_the_rows_behind_them(
        redis_server, redis_prefix):
    """A member of the index of the member form whose row is not there (another client's write,
    or a row removed without its member) stayed in the index, looked at again by every sweep
    and never counted; the sweep stopped at the first script call that removed fewer rows than
    its limit, so a limit's worth of them (older than every row) stopped expiry for good."""
    clock = Clock()
    c = make(redis_server, redis_prefix, clock=clock)
    c.cancel(1, scope="s")
    junk = {f"1:z{i}".encode(): 0 for i in range(600)}
    c.store.client.zadd(c.store._all, junk)
    clock.tick(400.0)
    assert c.cleanup(ttl=300.0) == 1
    assert not c.cancelled(1, scope="s")
    assert c.store.client.zcard(c.store._all) == 0


def test_the_sweep_claim_key_expires_when_no_host_claims(redis_server, redis_prefix):
    c = make(redis_server, redis_prefix)
    key = (redis_prefix + "{g}:sweep").encode()
    assert not c.store.claim_sweep(100.0, 2.0)  # the first claim: one interval later
    assert c.store.claim_sweep(102.5, 2.0)
    assert 19_000 < c.store.client.pttl(key) <= 20_000  # ten intervals


def test_the_sweep_claim_goes_on_after_the_clock_steps_back(redis_server, redis_prefix):
    """A claim recorded at 1000.0 by a host whose clock then stepped back an hour: waiting
    for the clock to catch up stopped every host's sweeps for that hour (up to the key's ten
    intervals). A last claim more than an interval ahead is due, as in shared memory."""
    c = make(redis_server, redis_prefix)
    assert not c.store.claim_sweep(1000.0, 2.0)
    assert c.store.claim_sweep(1002.0, 2.0)
    assert c.store.claim_sweep(1002.0 - 3600, 2.0)  # the clock stepped back an hour
    assert not c.store.claim_sweep(1002.0 - 3600 + 0.5, 2.0)  # one per interval again
    assert c.store.claim_sweep(1002.0 - 3600 + 2.0, 2.0)


@pytest.mark.parametrize("junk", [b"garbage", b""])
def test_a_sweep_claim_written_over_with_junk_is_claimed_again(redis_server, redis_prefix, junk):
    """A string that is no number at ``{g}:sweep`` (another client's write, the right type)
    failed the claim script with a Lua error on every call of every host, for good: no sweep
    ran again. It counts as no claim and is written over."""
    c = make(redis_server, redis_prefix)
    key = (redis_prefix + "{g}:sweep").encode()
    assert not c.store.claim_sweep(100.0, 2.0)
    c.store.client.set(key, junk)
    assert not c.store.claim_sweep(103.0, 2.0)  # as a first claim: one interval later
    assert c.store.client.get(key) == b"103.0"
    assert c.store.claim_sweep(105.0, 2.0)


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


def test_a_running_id_whose_row_key_another_client_wrote_over_does_not_stop_cancel_scope(
        redis_server, redis_prefix):
    """contract §6.1: a session's DELETE cancels every request still in flight in it. A running
    id whose in-flight key another client wrote with another type made its cancel script fail
    (WRONGTYPE), which ended cancel_scope there: the ids after it in the set were never
    cancelled (the bridge's DELETE then told no host). Such an id is not in flight: skipped."""
    c = make(redis_server, redis_prefix)
    c.track(7, "session:x")
    for i in range(50):  # the set's order is Redis's: some come before 7
        c.store.client.sadd(c.store.ifs_key("session:x"), f"z{i}")
        c.store.client.set(c.store.if_key("session:x", f"z{i}"), "a string")
    assert c.cancel_scope("session:x", "session deleted") == 1
    assert c.cancelled(7, "session:x")


def test_noscript_reloads(redis_server, redis_prefix):
    c = make(redis_server, redis_prefix)
    c.cancel(1)
    c.store.client.script_flush()
    c.cancel(2)
    assert c.cancelled(1) and c.cancelled(2)


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
