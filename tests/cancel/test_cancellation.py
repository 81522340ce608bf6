"""contract §3-§4 over a real registry in /dev/shm, one process (the cross-process cases are in
test_cancellation_procs.py). One rule per test, tables of cases where that reads better."""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
from decimal import Decimal
from fractions import Fraction

import pytest
from helpers.background import lock_held
from helpers.clock import Clock
from helpers.opcodes import at_bytecode
from helpers.rows import in_flight_count, in_flight_rows
from helpers.table_rig import healthy, python_writes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shmcancel
from shmcancel import (
    CancellationLimitReached,
    Config,
    InvalidRequestId,
    TableFull,
    principal,
    telemetry,
)
from shmcancel.cancel import ids, owed
from shmcancel.cancellation import (
    CANCELLED_EVENT,
    CLEANUP_EVENT,
    Cancellation,
    RequestHandle,
    cancelled,
)
from shmcancel.shm.registry import Registry


@pytest.fixture
def make(registry):
    """make(**config) -> (registry, Cancellation with a seeded Clock); the registry fixture's
    small config by default."""
    def _make(clock: Clock | None = None, **cfg):
        reg = registry(**cfg)
        return reg, Cancellation(reg, clock=clock or Clock())

    return _make


@pytest.fixture
def rc(make):
    return make()


class _Rows:
    """The part of a shared-memory table the backend-independent tests read, over a store's
    ``cancellations()`` or in-flight count."""

    def __init__(self, rows, count=None):
        self._rows, self._count = rows, count

    def scan(self):
        return [((s, r), (reason, at)) for s, r, reason, at in self._rows()]

    def count(self):
        return len(self.scan()) if self._count is None else self._count()

    def get(self, key, default=None):
        return dict(self.scan()).get(key, default)


class _RedisView:
    """What the backend-independent tests read of a registry, over a RedisStorage: its rows,
    in-flight rows and scopes with a count, and the evictions it made."""

    def __init__(self, storage):
        self.storage = storage
        client, prefix = storage.store.client, storage.store.prefix
        self.cancellations = _Rows(storage.cancellations)
        self.in_flight = _Rows(lambda: [], lambda: sum(
            client.zcard(k) for k in client.keys(prefix + "*:if:*")))
        self.scope_counts = _Rows(lambda: [], lambda: len(
            {s for s, _, _, _ in storage.cancellations()}))

    def table(self, name):
        return getattr(self, name)

    @property
    def evictions(self):
        return self.storage.evictions


@pytest.fixture(params=["shm", "redis"])
def make_any(request, registry):
    """make_any(clock=None, **config) -> (view, Cancellation): over a registry (``view`` is
    the registry) or over a real Redis (``RedisStorage``; ``view`` reads the same figures)."""
    def _make(clock: Clock | None = None, **cfg):
        clock = clock or Clock()
        if request.param == "shm":
            reg = registry(**cfg)
            return reg, Cancellation(reg, clock=clock)
        from shmcancel.redis import RedisStorage, RedisStore, connect
        srv = request.getfixturevalue("redis_server")
        kw = {"capacity": 400, "max_rows": 200, "in_flight_capacity": 64, "session_capacity": 16}
        kw.update(cfg)
        store = RedisStore(connect(srv.url, timeout=2.0), shmcancel.Config(**kw),
                           prefix=request.getfixturevalue("redis_prefix"))
        storage = RedisStorage(store, clock=clock, host="h1")
        return _RedisView(storage), Cancellation(None, clock=clock, backend=storage)

    return _make


@pytest.fixture
def rc_any(make_any):
    return make_any()


@pytest.fixture
def events():
    """Telemetry events seen during the test: list of (event, measurements, metadata)."""
    seen: list = []
    for i, ev in enumerate((CANCELLED_EVENT, CLEANUP_EVENT)):
        telemetry.attach(f"test-events-{i}", ev, lambda e, m, md, cfg: seen.append((e, m, md)))
    try:
        yield seen
    finally:
        for i in range(2):
            telemetry.detach(f"test-events-{i}")


def rows(reg):
    return sorted(reg.table("cancellations").scan())


# --------------------------------------------------------------------------------- §4.1 ids
def test_42_and_str_42_are_one_request(rc_any):
    reg, c = rc_any
    c.cancel(42, "first", "s")
    assert c.cancelled("42", "s") and c.cancelled(42, "s")
    c.cancel("42", "second", "s")
    assert reg.table("cancellations").count() == 1
    assert c.reason(42, "s") == "second"
    c.clear("42", "s")
    assert not c.cancelled(42, "s")
    c.track(42, "s")
    assert c.in_flight("42", "s")
    c.untrack("42", "s")
    assert not c.in_flight(42, "s")


@pytest.mark.parametrize(
    "rid",
    ["a" * 256, "é" * 128, "€" * 85 + "a", "🙂" * 64, "", 0, -1, 2**63, 10**255],
    ids=["256-ascii", "256-2byte", "256-3byte", "256-4byte", "empty", "0", "-1", "2^63", "big"],
)
def test_valid_ids_are_stored(rc_any, rid):
    reg, c = rc_any
    c.cancel(rid, None, "s")
    assert c.cancelled(rid, "s")
    assert rows(reg) == [(("s", str(rid)), (None, c.clock()))]


def test_an_int_id_of_any_size_is_cancelled_tracked_and_cleared(rc_any, events):
    """contract §4.1: any int but a bool, also past 256 digits (and past the 4 300 Python
    prints); it is one request with itself only, never with a str id."""
    _, c = rc_any
    for n in (10**300, -(10**300), 2**20000):
        c.cancel(n, "big", "s")
        assert c.cancelled(n, "s") and c.reason(n, "s") == "big"
        assert not c.cancelled(n + 1, "s") and not c.cancelled(ids.key(n)[:256], "s")
        c.track(n, "s")
        assert c.in_flight(n, "s")
        c.untrack(n, "s")
        c.clear(n, "s")
        assert not c.cancelled(n, "s") and not c.in_flight(n, "s")
    md = [m for e, _, m in events if e == CANCELLED_EVENT]
    assert len(md) == 3 and all(256 < len(m["request_id"]) <= 320 for m in md)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, True, 10**400, "12", None,
                                 Decimal("1.5"), Fraction(1, 3)],
                         ids=["nan", "inf", "-inf", "True", "int-past-float", "str", "None",
                              "Decimal", "Fraction"])
def test_a_clock_that_is_not_a_finite_time_is_refused(make_any, bad, events):
    """A row stamped NaN never expires (``now - nan > ttl`` is false) and breaks eviction's
    order, and ``shmtool dump --json`` would print it as non-JSON: ``cancel`` raises instead,
    writing nothing, and so does ``cleanup`` with such a ``now``. So for a value that is no
    number of seconds (a bool was stored as such, and sorted out of §4.4's order; a Decimal or
    a str raised msgpack's or Python's own error, an int past a float's range OverflowError)."""
    clock = Clock()
    view, c = make_any(clock=clock, max_rows=20)
    for i in range(20):  # at the cap: a new row would evict a batch first
        c.cancel(100 + i, None, "other")
    c.clear(100, "other")
    c.cancel(1, "kept", "global")
    clock.t = bad
    with pytest.raises(ValueError, match="finite"):
        c.cancel(2, "r", "global")
    with pytest.raises(ValueError, match="finite"):
        c.cancel(1, "overwrite", "global")
    with pytest.raises(ValueError, match="finite"):
        c.cleanup(0)
    assert view.evictions == 0  # nothing evicted for a row never written
    clock.t = 1_000_001.0
    assert not c.cancelled(2, "global") and c.reason(1, "global") == "kept"
    assert [e for e, _, _ in events].count(CANCELLED_EVENT) == 21
    assert c.cleanup(0) == 20


class _Seconds(float):
    pass


@pytest.mark.parametrize("at", [5, _Seconds(5.0)], ids=["int", "float-subclass"])
def test_a_clock_giving_an_int_stamps_rows_with_floats(make_any, at):
    """An int (as a test's clock may give) or a float subclass (numpy's) stamps a float:
    ``cancelled_at`` is "the clock's value (float seconds)" (contract §4.3), and it sorts among
    the float stamps for eviction (§4.4) and expires by ``cleanup``."""
    clock = Clock()
    _, c = make_any(clock=clock, max_rows=3)
    clock.t = 4.5
    c.cancel("older", None, "a")
    clock.t = at
    c.cancel("int", None, "a")
    got = c.cancelled_at("int", "a")
    assert got == 5.0 and type(got) is float
    clock.t = 6.0
    c.cancel("newer", None, "b")
    c.cancel("newest", None, "b")  # at the cap: scope a (2 rows) gives its oldest
    assert not c.cancelled("older", "a") and c.cancelled("int", "a")
    clock.t = at
    assert c.cleanup(0) == 0  # now = 5: no row older than 0 s (the int one is 0 s old)
    clock.t = 100.0
    assert c.cleanup(10) == 3


@pytest.mark.parametrize(
    "rid",
    ["a" * 257, "é" * 128 + "a", "€" * 86, "🙂" * 64 + "a", True, False, 1.0, 42.5,
     float("inf"), [1], {"id": 1}, (1,), b"1", "\ud800", object()],
    ids=["257-ascii", "257-2byte", "258-3byte", "257-4byte", "True", "False", "1.0", "42.5",
         "inf", "list", "dict", "tuple", "bytes", "surrogate", "object"],
)
def test_invalid_ids_rejected_by_cancel_and_ignored_elsewhere(rc_any, rid, events):
    reg, c = rc_any
    with pytest.raises(InvalidRequestId):
        c.cancel(rid, "r", "s")
    assert reg.table("cancellations").count() == 0
    assert reg.table("scope_counts").count() == 0
    assert events == []
    # None of the others raise for a bad id.
    c.track(rid, "s")
    assert in_flight_count(reg) == 0
    assert c.in_flight(rid, "s") is False
    c.untrack(rid, "s")
    c.clear(rid, "s")
    assert c.cancelled(rid, "s") is False
    assert c.reason(rid, "s") is None
    h = c.begin(rid, "s")
    assert h.tracked is False and h.cancelled() is False
    h.end()


def test_bool_is_not_the_int(rc_any):
    _reg, c = rc_any
    c.cancel(1, None, "s")
    assert c.cancelled(1, "s")
    assert c.cancelled(True, "s") is False


def test_none_is_a_noop_everywhere(rc_any, events):
    reg, c = rc_any
    c.cancel(None, "r", "s")
    c.track(None, "s")
    c.untrack(None, "s")
    c.clear(None, "s")
    assert c.cancelled(None, "s") is False
    assert c.reason(None, "s") is None
    assert c.in_flight(None, "s") is False
    assert reg.table("cancellations").count() == in_flight_count(reg) == 0
    assert events == []


# --------------------------------------------------------------------------------- §4.2 reasons
@pytest.mark.parametrize(
    ("reason", "stored"),
    [
        (None, None),
        ("user abort", "user abort"),
        ("a\tb\r\nc\x00d\x7fe\x9ff", "abcdef"),
        ("x\u202etxt\u2066\u200b\ufeff\u061c\u2060", "xtxt"),
        ("y" * 300, "y" * 200),
        ("\x01" * 800 + "gone", ""),
        (42, "42"),
        ({"a": 1}, "{'a': 1}"),
    ],
)
def test_reasons_are_sanitised_when_stored(rc_any, reason, stored):
    reg, c = rc_any
    c.cancel(1, reason, "s")
    assert c.reason(1, "s") == stored
    assert reg.table("cancellations").get(("s", "1"))[0] == stored


# --------------------------------------------------------------------------------- §3 scopes
def test_same_id_in_two_sessions(rc_any):
    _reg, c = rc_any
    a = {"shmcancel.session_id": "A", "shmcancel.request_id": 1, "REMOTE_ADDR": "203.0.113.9"}
    b = {"shmcancel.session_id": "B", "shmcancel.request_id": 1, "REMOTE_ADDR": "203.0.113.9"}
    c.cancel(1, None, c.scope(a))
    assert c.cancelled(a) and not c.cancelled(b)


def test_two_principals_behind_one_ip(rc_any):
    _reg, c = rc_any
    alice = principal.put({"REMOTE_ADDR": "203.0.113.9", "shmcancel.request_id": 7}, "alice")
    bob = principal.put({"REMOTE_ADDR": "203.0.113.9", "shmcancel.request_id": 7}, {"sub": "bob"})
    anon = {"REMOTE_ADDR": "203.0.113.9", "shmcancel.request_id": 7}
    c.cancel(7, None, c.scope(alice))
    assert [c.cancelled(x) for x in (alice, bob, anon)] == [True, False, False]


def test_principal_whose_id_is_an_ip_string_shares_nothing(make_any):
    reg, c = make_any(max_rows_per_scope=1)
    anon = {"REMOTE_ADDR": "203.0.113.9", "shmcancel.request_id": 1}
    fake = principal.put({"REMOTE_ADDR": "198.51.100.1", "shmcancel.request_id": 1}, "203.0.113.9")
    c.cancel(1, None, c.scope(anon))
    assert not c.cancelled(fake)
    c.cancel(1, None, c.scope(fake))  # its own quota of 1 is untouched by the anonymous row
    assert reg.table("cancellations").count() == 2


@pytest.mark.parametrize(
    ("conn", "scope"),
    [
        ({"shmcancel.session_id": "S1"}, "session:S1"),
        (principal.put({"REMOTE_ADDR": "192.0.2.1"}, "p1"), "principal:p1"),
        ({"REMOTE_ADDR": "::ffff:192.0.2.1"}, "ip:192.0.2.1"),
        ({"REMOTE_ADDR": "2001:db8:1:2::5"}, "ip:2001:db8:1:2::/64"),
        ({}, "ip:unknown"),
        (None, "global"),
    ],
)
def test_scope_method(rc_any, conn, scope):
    assert rc_any[1].scope(conn) == scope


def test_cancelled_conn_without_request_id_is_false(rc_any):
    _reg, c = rc_any
    c.cancel(1, None, "ip:192.0.2.1")
    assert c.cancelled({"REMOTE_ADDR": "192.0.2.1"}) is False
    assert c.cancelled({"REMOTE_ADDR": "192.0.2.1", "shmcancel.request_id": None}) is False
    assert c.cancelled({"REMOTE_ADDR": "192.0.2.1", "shmcancel.request_id": "1"}) is True


def test_cancel_with_long_session_scope(rc_any):
    _reg, c = rc_any
    conn = {"shmcancel.session_id": "s" * 2000, "shmcancel.request_id": "x" * 256}
    scope = c.scope(conn)
    assert len(scope.encode()) <= principal.MAX_SCOPE_BYTES
    c.cancel("x" * 256, "é" * 800, scope)
    assert c.cancelled(conn)


# ------------------------------------------------------------------------- §4.3 cancel / clear
def test_cancelled_at_is_the_clock_unrounded(make_any):
    clock = Clock(1_700_000_000.123456789)
    reg, c = make_any(clock)
    c.cancel(1, None, "s")
    assert reg.table("cancellations").get(("s", "1")) == (None, 1_700_000_000.123456789)
    assert c.cancelled_at(1, "s") == 1_700_000_000.123456789


def test_overwrite_keeps_count_updates_in_place(rc_any):
    reg, c = rc_any
    c.cancel(1, "a", "s")
    t0 = c.clock()
    c.clock.tick(5)
    c.cancel(1, "b", "s")
    assert reg.table("cancellations").count() == 1
    assert c.reason(1, "s") == "b" and c.cancelled_at(1, "s") == t0 + 5
    assert c._store.scope_rows("s") == 1


def test_overwrite_at_quota_skips_the_quota(make_any):
    reg, c = make_any(max_rows_per_scope=2)
    c.cancel(1, None, "s")
    c.cancel(2, None, "s")
    with pytest.raises(CancellationLimitReached):
        c.cancel(3, None, "s")
    c.cancel(2, "again", "s")  # overwrite: no quota check
    assert c.reason(2, "s") == "again"
    assert reg.table("cancellations").count() == 2


def test_overwrite_at_cap_does_not_evict(make_any):
    reg, c = make_any(max_rows=40, max_rows_per_scope=None)
    for i in range(40):
        c.clock.tick()
        c.cancel(i, None, "s")
    c.cancel(0, "again", "s")
    assert reg.table("cancellations").count() == 40 and reg.evictions == 0
    c.cancel(40, None, "s")
    assert reg.table("cancellations").count() == 39 and reg.evictions == 2


def test_quota_refusal_writes_nothing(make_any, events):
    reg, c = make_any(max_rows_per_scope=3)
    for i in range(3):
        c.cancel(i, None, "s")
    before = rows(reg)
    events.clear()
    with pytest.raises(CancellationLimitReached):
        c.cancel(99, "no", "s")
    assert rows(reg) == before and events == []
    assert isinstance(CancellationLimitReached("x"), shmcancel.ShmCancelError)


def test_quota_none_disables(make_any):
    reg, c = make_any(max_rows_per_scope=None, max_rows=None, capacity=300)
    for i in range(300):
        c.cancel(i, None, "s")
    assert reg.table("cancellations").count() == 300


def test_quota_flood_attacker_refused_victim_served(make_any):
    _reg, c = make_any(max_rows=100, max_rows_per_scope=20)
    refused = 0
    for i in range(1000):
        try:
            c.cancel(i, "flood", "ip:198.51.100.66")
        except CancellationLimitReached:
            refused += 1
    assert refused == 980
    for i in range(20):
        c.cancel(i, None, "session:victim")
    assert c._store.scope_rows("ip:198.51.100.66") == 20
    assert all(c.cancelled(i, "session:victim") for i in range(20))


def test_six_scopes_of_twenty_against_cap_100(make_any):
    reg, c = make_any(max_rows=100, max_rows_per_scope=20)
    for s in range(5):
        for i in range(20):
            c.clock.tick()
            c.cancel(i, None, f"ip:flood{s}")
    assert reg.table("cancellations").count() == 100
    for i in range(20):
        c.clock.tick()
        c.cancel(i, None, "session:victim")  # under its own quota: always served
        assert reg.table("cancellations").count() <= 100
        assert c.cancelled(i, "session:victim")
    with pytest.raises(CancellationLimitReached):
        c.cancel(20, None, "session:victim")  # its own 21st
    assert reg.table("cancellations").count() <= 100
    assert all(c.cancelled(i, "session:victim") for i in range(20))
    # the counts agree with the rows
    per_scope: dict = {}
    for (s, _), _ in reg.table("cancellations").scan():
        per_scope[s] = per_scope.get(s, 0) + 1
    assert {s: c._store.scope_rows(s) for s in per_scope} == per_scope


def test_clear_removes_only_its_own_row(rc_any):
    reg, c = rc_any
    for scope in ("a", "b"):
        for rid in (1, 2):
            c.cancel(rid, None, scope)
    c.clear(1, "a")
    assert rows(reg) == [(("a", "2"), (None, c.clock())), (("b", "1"), (None, c.clock())),
                         (("b", "2"), (None, c.clock()))]
    assert c._store.scope_rows("a") == 1


def test_clear_without_row_takes_no_lock(rc):
    reg, c = rc
    c.cancel(1, None, "s")
    with lock_held(reg, hold_for=10):
        done = threading.Event()

        def clear_absent():
            c.clear(2, "s")
            c.clear(1, "other")
            done.set()

        t2 = threading.Thread(target=clear_absent)
        t2.start()
        assert done.wait(2), "clear() of a missing row waited for the lock"
        t2.join()
        assert c.cancelled(1, "s")


def test_cancel_emits_telemetry(rc_any, events):
    _reg, c = rc_any
    c.cancel(42, "why\n", "session:x")
    assert events == [(CANCELLED_EVENT, {"count": 1},
                       {"request_id": "42", "scope": "session:x", "reason": "why"})]
    events.clear()
    c.cancel("42", None, "session:x")
    assert events[0][2]["reason"] is None and events[0][2]["request_id"] == "42"


def test_raising_handler_is_detached_and_cancel_still_succeeds(rc_any, caplog):
    _reg, c = rc_any

    def bad(*a):
        raise RuntimeError("broken handler")

    telemetry.attach("bad-handler", CANCELLED_EVENT, bad)
    with caplog.at_level(logging.ERROR, logger="shmcancel.telemetry"):
        c.cancel(1, None, "s")
    assert c.cancelled(1, "s")
    assert "bad-handler" not in telemetry.list_handlers()


# --------------------------------------------------------------------------------- §4.4 eviction
def test_eviction_takes_the_largest_scope_oldest_first(make_any):
    reg, c = make_any(max_rows=40, max_rows_per_scope=None)  # batch 2
    order = [("big", 10), ("mid", 10), ("small", 20)]
    ts = {}
    for scope, n in order:
        for i in range(n):
            ts[(scope, str(i))] = c.clock.tick()
            c.cancel(i, None, scope)
    # small has the most rows (20) though its rows are the newest: it loses its two oldest.
    c.cancel("new", None, "other")
    assert not c.cancelled(0, "small") and not c.cancelled(1, "small")
    assert c.cancelled(2, "small") and c.cancelled(0, "big")
    assert reg.evictions == 2
    assert c._store.scope_rows("small") == 18
    assert reg.table("cancellations").count() == 39


def test_eviction_spills_into_the_next_largest(make_any):
    _reg, c = make_any(max_rows=100, max_rows_per_scope=None)  # batch 5
    for scope, n in (("a", 3), ("b", 2), ("c", 95)):
        for i in range(n):
            c.clock.tick()
            c.cancel(i, None, scope)
    # c (95) loses its 5 oldest; nothing else.
    c.cancel(0, None, "d")
    assert [c.cancelled(i, "c") for i in range(7)] == [False] * 5 + [True] * 2
    assert c.cancelled(0, "a") and c.cancelled(0, "b")


def test_eviction_spill_with_batch_larger_than_the_largest_scope(make_any):
    _reg, c = make_any(max_rows=120, max_rows_per_scope=None)  # batch 6
    spec = [("s4", 4)] + [(f"t{i}", 3) for i in range(38)] + [("u2", 2)]  # 4 + 114 + 2 = 120
    for scope, n in spec:
        for i in range(n):
            c.clock.tick()
            c.cancel(i, None, scope)
    c.cancel(0, None, "new")
    # s4 (4 rows) goes whole, then the two oldest rows among the 3-row scopes: t0's first two.
    gone = [(s, i) for s, n in spec for i in range(n) if not c.cancelled(i, s)]
    assert gone == [("s4", 0), ("s4", 1), ("s4", 2), ("s4", 3), ("t0", 0), ("t0", 1)]
    assert c._store.scope_rows("s4") == 0 and c._store.scope_rows("t0") == 1


def test_all_singletons_tie_and_age_decides(make_any):
    _reg, c = make_any(max_rows=60, max_rows_per_scope=None)  # batch 3
    scopes = [f"s{i}" for i in range(60)]
    times = list(range(60))
    times = times[30:] + times[:30]  # rows inserted out of age order
    for s, t in zip(scopes, times, strict=True):
        c.clock.t = 1000.0 + t
        c.cancel(1, None, s)
    c.clock.t = 2000.0
    c.cancel(1, None, "late")
    gone = sorted(s for s in scopes if not c.cancelled(1, s))
    assert gone == ["s30", "s31", "s32"]  # the three oldest (times 0, 1, 2)


@pytest.mark.parametrize(("max_rows", "batch"), [(20, 1), (39, 1), (40, 2), (100, 5)])
def test_batch_is_always_full(make_any, max_rows, batch):
    reg, c = make_any(max_rows=max_rows, max_rows_per_scope=None)
    for i in range(max_rows):
        c.clock.tick()
        c.cancel(i, None, f"s{i}")
    c.cancel("x", None, "y")
    assert reg.table("cancellations").count() == max_rows - batch + 1
    assert reg.evictions == batch


def test_eviction_without_cap_at_physical_capacity(make_any):
    reg, c = make_any(max_rows=None, capacity=100, max_rows_per_scope=None)  # batch 100 // 20 = 5
    for i in range(100):
        c.clock.tick()
        c.cancel(i, None, "s")
    assert reg.table("cancellations").count() == 100
    c.cancel(100, None, "s")
    assert reg.table("cancellations").count() == 96 and reg.evictions == 5
    assert [c.cancelled(i, "s") for i in range(6)] == [False] * 5 + [True]


def test_eviction_frees_quota_of_the_evicted_scope(make_any):
    _reg, c = make_any(max_rows=20, max_rows_per_scope=20)  # batch 1
    for i in range(20):
        c.clock.tick()
        c.cancel(i, None, "s")
    c.cancel(0, None, "t")  # evicts s's oldest
    assert c._store.scope_rows("s") == 19
    c.cancel(100, None, "s")  # s is under its quota again
    assert c.cancelled(100, "s")


# --------------------------------------------------------------------------------- §4.5 in-flight
def test_track_untrack_in_flight(rc):
    reg, c = rc
    assert not c.in_flight(1, "s")
    c.track(1, "s")
    assert c.in_flight(1, "s") and not c.in_flight(1, "t")
    (key, owner), = in_flight_rows(reg)
    pid, start, tid, _token = owner
    assert key == ("s", "1")
    assert (pid, start) == shmcancel.shm.procinfo.me() and tid == threading.get_ident()
    c.untrack(1, "s")
    assert not c.in_flight(1, "s") and in_flight_count(reg) == 0


def test_namesakes_each_hold_a_row(rc):
    reg, c = rc
    other_done, release = threading.Event(), threading.Event()

    def other():
        c.track(1, "s")
        other_done.set()
        release.wait(10)
        c.untrack(1, "s")

    t = threading.Thread(target=other)
    t.start()
    try:
        assert other_done.wait(5)
        c.track(1, "s")
        assert in_flight_count(reg) == 2
        c.untrack(1, "s")  # removes this thread's row only
        assert c.in_flight(1, "s") and in_flight_count(reg) == 1
        (_, owner), = in_flight_rows(reg)
        assert owner[2] == t.ident
    finally:
        release.set()
        t.join()
    assert not c.in_flight(1, "s")


def test_two_handles_of_one_thread_are_two_rows(rc_any):
    reg, c = rc_any
    h1, h2 = c.begin(1, "s"), c.begin(1, "s")
    assert h1.tracked and h2.tracked and in_flight_count(reg) == 2
    h1.end()
    assert c.in_flight(1, "s")
    h2.end()
    assert not c.in_flight(1, "s")


def test_track_raises_table_full(make):
    _reg, c = make(in_flight_capacity=4)
    for i in range(4):
        c.track(i, "s")
    with pytest.raises(TableFull):
        c.track(99, "s")
    assert isinstance(TableFull("x"), shmcancel.ShmCancelError)


def test_begin_when_full_is_untracked_but_still_cancellable_locally(make, caplog):
    _reg, c = make(in_flight_capacity=2)
    import shmcancel.cancel.handle as mod

    mod._full_logged = False
    c.track(1, "s")
    c.track(2, "s")
    with caplog.at_level(logging.WARNING, logger="shmcancel.cancellation"):
        h = c.begin(3, "s")
        h2 = c.begin(4, "s")
    assert h.tracked is False and h2.tracked is False
    assert len([r for r in caplog.records if "could not be tracked" in r.getMessage()]) == 1
    assert not h.cancelled()
    c.cancel(3, None, "s")  # a direct cancel still reaches it through the shared row
    assert h.cancelled()
    h2.cancel_local("gone")
    assert h2.cancelled() and h2.reason() == "gone"
    h.end()
    h2.end()


# --------------------------------------------------------------------------------- handles
def test_handle_poll_sees_cancel_and_end_clears(rc_any):
    reg, c = rc_any
    h = c.begin(5, "session:x")
    assert isinstance(h, RequestHandle)
    assert (h.request_id, h.scope, h.tracked) == (5, "session:x", True)
    assert not h.cancelled() and h.reason() is None
    c.cancel("5", "stop", "session:x")
    assert h.cancelled() and h.reason() == "stop"
    h.end()
    assert not c.in_flight(5, "session:x") and not c.cancelled(5, "session:x")
    h.end()  # idempotent
    assert reg.table("cancellations").count() == in_flight_count(reg) == 0


def test_end_runs_once_even_from_racing_threads(rc_any):
    # A second end() must not clear a cancellation recorded since for a namesake: end() is the
    # request's finally and also the disconnect watcher's stop, and they can race.
    _reg, c = rc_any
    h, namesake = c.begin(3, "ip:198.51.100.7"), c.begin(3, "ip:198.51.100.7")
    go = threading.Barrier(8)

    def end() -> None:
        go.wait(timeout=5)
        h.end()

    threads = [threading.Thread(target=end) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=5)
    c.cancel(3, "for the namesake", "ip:198.51.100.7")
    h.end()
    assert namesake.cancelled() and c.cancelled(3, "ip:198.51.100.7")
    namesake.end()


def test_cancel_local_cancels_exactly_that_request(rc_any, events):
    reg, c = rc_any
    mine, namesake = c.begin(1, "ip:203.0.113.9"), c.begin(1, "ip:203.0.113.9")
    mine.cancel_local("client disconnected")
    assert mine.cancelled() and mine.reason() == "client disconnected"
    assert not namesake.cancelled()
    assert not c.cancelled(1, "ip:203.0.113.9")
    assert reg.table("cancellations").count() == 0
    assert events[0][0] == CANCELLED_EVENT and events[0][2]["request_id"] == "1"
    mine.end()
    assert c.in_flight(1, "ip:203.0.113.9")  # the namesake still runs
    namesake.end()


def test_end_untracks_then_clears(rc):
    _reg, c = rc
    h = c.begin(1, "s")
    c.cancel(1, None, "s")
    seen = []
    real_clear = c._store.clear

    def spy(scope, rid):
        seen.append(c.in_flight(1, "s"))
        return real_clear(scope, rid)

    c._store.clear = spy  # observe the order; the storage itself is real
    h.end()
    assert seen == [False]


def test_gating_follows_in_flight_rows(rc_any):
    reg, c = rc_any
    assert not c.cancel_if_in_flight(5, "x", scope="s")
    assert reg.table("cancellations").count() == 0  # not in flight: nothing recorded
    c.track(5, scope="s")
    assert c.in_flight(5, scope="s") and not c.in_flight(5, scope="t")
    assert c.cancel_if_in_flight(5, "x", scope="s")
    assert c.cancelled(5, scope="s")
    c.untrack(5, scope="s")
    c.clear(5, scope="s")  # the end of the request: untrack, then clear
    assert not c.in_flight(5, scope="s") and not c.cancelled(5, scope="s")
    assert not c.cancel_if_in_flight(5, "late", scope="s")
    assert reg.table("cancellations").count() == 0


def test_cancel_scope_cancels_every_request_in_flight_there(rc_any):
    _reg, c = rc_any
    hs = [c.begin(i, "session:A") for i in range(3)] + [c.begin(0, "session:B")]
    assert c.cancel_scope("session:A", "session deleted") == 3
    assert [h.cancelled() for h in hs] == [True, True, True, False]
    assert c.reason(2, "session:A") == "session deleted"
    for h in hs:
        h.end()
    assert c.cancel_scope("session:A") == 0


def test_cancel_scope_at_the_cap_evicts_other_scopes_before_its_own_rows(make_any):
    """contract §6.1 over §4.4: a session's DELETE cancels every call in flight in it. At the
    cap each of its rows made its scope the largest, so the next one evicted it before its tool
    had looked: the DELETE answered, and that call ran on. Its rows now go last."""
    _reg, c = make_any(max_rows=20, max_rows_per_scope=None)  # batch 1
    for i in range(20):  # the table at its cap: older rows of smaller scopes
        c.clock.tick()
        c.cancel(i, None, f"other{i % 5}")
    hs = [c.begin(i, "session:A") for i in range(6)]
    c.clock.tick()
    assert c.cancel_scope("session:A", "session deleted") == 6
    assert [c.cancelled(i, "session:A") for i in range(6)] == [True] * 6
    assert all(h.cancelled() for h in hs)
    # the others' oldest went, in §4.4's order among them (4 rows each: age decides)
    assert [c.cancelled(i, f"other{i % 5}") for i in range(20)] == [False] * 6 + [True] * 14
    for h in hs:
        h.end()


def test_cancel_scope_evicts_its_own_rows_only_when_nothing_else_is_left(make_any):
    """A session with more calls in flight than ``max_rows``: the table cannot hold a row for
    each, so its oldest go (the rows of other scopes are gone first)."""
    _reg, c = make_any(max_rows=3, max_rows_per_scope=None)  # batch 1
    c.cancel(0, None, "other")
    hs = [c.begin(i, "session:A") for i in range(4)]
    assert c.cancel_scope("session:A", "session deleted") == 4
    assert not c.cancelled(0, "other")
    assert [c.cancelled(i, "session:A") for i in range(4)] == [False, True, True, True]
    for h in hs:
        h.end()


def test_a_second_pass_of_cancel_scope_counts_and_reports_only_what_is_new(rc_any, events):
    """A session's DELETE cancels its calls, ends the session, then cancels again for a call
    begun in between: the second pass records every row again (a namesake begun since is
    cancelled too) but counts and emits only the calls the first had not."""
    _reg, c = rc_any
    hs = [c.begin(i, "session:A") for i in range(2)]
    first = c.cancel_scope_keys("session:A", "deleted")
    assert sorted(first) == ["0", "1"] and len(events) == 2
    late = c.begin(2, "session:A")
    assert c.cancel_scope("session:A", "deleted", reported=first) == 1
    assert [e[2]["request_id"] for e in events[2:]] == ["2"]
    assert late.cancelled() and all(h.cancelled() for h in hs)
    for h in [*hs, late]:
        h.end()


def test_handle_as_context_manager(rc_any):
    _reg, c = rc_any
    with c.begin(1, "s") as h:
        assert c.in_flight(1, "s") and h.tracked
    assert not c.in_flight(1, "s")


# --------------------------------------------------------------------------------- §4.6 cleanup
def test_cleanup_ttl_is_strict(make_any, events):
    reg, c = make_any(ttl=10.0)
    clock = c.clock
    for i, age in enumerate([5.0, 10.0, 10.5, 100.0]):
        clock.t = 1000.0 - age
        c.cancel(i, None, "s")
    clock.t = 1000.0
    events.clear()
    assert c.cleanup() == 2  # ages 10.5 and 100 (> 10); 10.0 is not strictly older
    assert [c.cancelled(i, "s") for i in range(4)] == [True, True, False, False]
    assert events == [(CLEANUP_EVENT, {"removed": 2, "in_flight_removed": 0}, {})]
    assert c.cleanup(ttl=4.0) == 2
    assert c._store.scope_rows("s") == reg.table("cancellations").count()


@pytest.mark.parametrize(("at", "now", "ttl"), [
    (8018.361843597839, 8018.461843597839, 0.1),  # now - at > ttl, yet at == fl(now - ttl)
    (3892.623881441467, 3898.6982614043195, 6.074379962852603),
])
def test_cleanup_ttl_is_the_contracts_float_comparison(make_any, at, now, ttl):
    """§4.6 names the comparison: a row goes when ``now - cancelled_at > ttl``, as floats. The
    Redis backend compared ``cancelled_at < now - ttl`` instead, which rounds differently: these
    rows, older than ttl by the contract's formula, stayed there (and cleanup counted 0)."""
    assert now - at > ttl and not at < now - ttl  # the two formulas part here
    _reg, c = make_any()
    c.clock.t = at
    c.cancel(1, None, "s")
    c.clock.t = now
    assert c.cleanup(ttl=ttl) == 1
    assert not c.cancelled(1, "s")


def test_cleanup_ttl_argument_overrides_config(rc_any):
    _reg, c = rc_any
    c.cancel(1, None, "s")
    c.clock.tick(50)
    assert c.cleanup() == 0  # default ttl 300
    assert c.cleanup(ttl=49.0) == 1


@pytest.mark.parametrize("ttl", ["10", True, float("nan"), [1]])
def test_cleanup_rejects_bad_ttl(rc_any, ttl):
    with pytest.raises(ValueError):
        rc_any[1].cleanup(ttl)


def test_cleanup_takes_an_int_past_floats_range_as_infinite(rc_any):
    _reg, c = rc_any
    c.cancel(1, None, "s")
    c.clock.tick(50)
    assert c.cleanup(ttl=10**400) == 0 and c.cancelled(1, "s")  # nothing is that old
    assert c.cleanup(ttl=-(10**400)) == 1 and not c.cancelled(1, "s")  # everything is older


def test_cleanup_repairs_scope_counts(rc):
    reg, c = rc
    c.cancel(1, None, "s")
    c.cancel(2, None, "s")
    # a writer killed between a count and its row leaves the count off: simulate both ways
    with reg.lock:
        c._store._add("s", +3)
        c._store._add("ghost", +2)
    assert c._store.scope_rows("s") == 5
    c.cleanup()
    assert c._store.scope_rows("s") == 2 and c._store.scope_rows("ghost") == 0
    assert reg.table("scope_counts").count() == 1


# --------------------------------------------------------------------------------- janitor
def test_janitor_runs_by_itself_after_the_interval(make, events):
    reg, c = make(clock=Clock(time.time()), janitor_interval=0.3, ttl=0.05)
    c.clock = time.time
    created = reg.created_at  # the schedule counts from the header's creation time
    c.cancel(1, None, "s")
    h = c.begin(2, "s")
    deadline = time.monotonic() + 10
    while c.cancelled(1, "s") and time.monotonic() < deadline:
        h.cancelled()  # polls are what drive it
        time.sleep(0.005)
    assert not c.cancelled(1, "s"), "the janitor never swept"
    assert time.time() - created >= 0.3 * 0.99  # not before one interval after creation
    assert any(e[0] == CLEANUP_EVENT for e in events)
    assert h.tracked and c.in_flight(2, "s")  # live rows stay
    h.end()


def test_janitor_runs_on_cancels_that_find_nothing_in_flight(make, events):
    """A process whose only calls are notifications for requests not in flight (a flood of
    stale ids) still drives the janitor: those calls write nothing, but they are use."""
    reg, c = make(clock=Clock(time.time()), janitor_interval=0.3, ttl=0.05)
    c.clock = time.time
    other = Cancellation(reg)
    other.cancel(1, None, "s")  # a row for the sweep to expire, written by someone else
    deadline = time.monotonic() + 10
    i = 0
    while not any(e[0] == CLEANUP_EVENT for e in events) and time.monotonic() < deadline:
        assert c.cancel_if_in_flight(1000 + i, None, "s") is False
        i += 1
        time.sleep(0.005)
    assert any(e[0] == CLEANUP_EVENT for e in events), "the janitor never swept"
    assert reg.info()["sweeps"] >= 1 and not c.cancelled(1, "s")


def test_janitor_sweeps_once_per_interval_across_instances(make, events):
    reg, c1 = make(janitor_interval=0.2)
    c2 = Cancellation(reg)
    deadline = time.monotonic() + 0.7
    while time.monotonic() < deadline:
        c1.cancelled(1, "s")
        c2.cancelled(1, "s")
        time.sleep(0.002)
    sweeps = sum(1 for e in events if e[0] == CLEANUP_EVENT)
    assert 1 <= sweeps <= 3  # 0.7 s of polling at 0.2 s intervals, first at 0.2 s
    assert reg.info()["sweeps"] == sweeps


# --------------------------------------------------------------------------------- cancelled(conn)
def test_module_cancelled_uses_the_handle(rc):
    _reg, c = rc
    h = c.begin(1, "ip:192.0.2.1")
    conn = {"shmcancel.handle": h, "REMOTE_ADDR": "192.0.2.1", "shmcancel.request_id": 1}
    assert cancelled(conn) is False
    h.cancel_local()
    assert cancelled(conn) is True
    assert c.cancelled(conn) is True
    h.end()


def test_module_cancelled_with_request_id_and_cancellation(rc):
    _reg, c = rc
    conn = {"shmcancel.request_id": "9", "shmcancel.cancellation": c,
            "shmcancel.session_id": "S"}
    assert cancelled(conn) is False
    c.cancel(9, None, "session:S")
    assert cancelled(conn) is True


def test_module_cancelled_finds_the_attached_registry(rc, shm_name):
    _reg, c = rc
    other = Registry.attach(shm_name)  # this process's current registry now
    try:
        assert shmcancel.shm.registry.current() is other
        conn = {"shmcancel.request_id": 3, "REMOTE_ADDR": "192.0.2.7"}
        assert cancelled(conn) is False
        c.cancel(3, None, "ip:192.0.2.7")
        assert cancelled(conn) is True
    finally:
        other.close()


class Weird(dict):
    def get(self, *a):
        raise RuntimeError("boom")


class BadHandle:
    def cancelled(self):
        raise RuntimeError("boom")


@pytest.mark.parametrize(
    "conn",
    [None, 5, "conn", [], {}, {"REMOTE_ADDR": "192.0.2.1"}, {"shmcancel.request_id": None},
     {"shmcancel.request_id": 1.5, "shmcancel.cancellation": None}, Weird(),
     {"shmcancel.handle": BadHandle()}, {"shmcancel.handle": object()}],
)
def test_module_cancelled_outside_a_request_is_false_and_never_raises(rc, conn):
    assert cancelled(conn) is False


def test_module_cancelled_without_any_registry(monkeypatch):
    import shmcancel.shm.registry as regmod

    monkeypatch.setattr(regmod, "_current", None)
    assert cancelled({"shmcancel.request_id": 1}) is False


def test_exports():
    assert shmcancel.Cancellation is Cancellation
    assert shmcancel.cancelled is cancelled
    assert shmcancel.principal is principal
    assert shmcancel.telemetry is telemetry


# --------------------------------------------------------------------------------- model
class Model:
    """The policy of contract §4.3-4.4 over a dict."""

    def __init__(self, max_rows, quota):
        self.rows: dict = {}
        self.max_rows, self.quota = max_rows, quota
        self.batch = max(1, max_rows // 20)

    def cancel(self, scope, rid, t):
        key = (scope, rid)
        if key not in self.rows:
            n = sum(1 for s, _ in self.rows if s == scope)
            if self.quota is not None and n >= self.quota:
                return "limit"
            if len(self.rows) >= self.max_rows:
                sizes: dict = {}
                for s, _ in self.rows:
                    sizes[s] = sizes.get(s, 0) + 1
                order = sorted(self.rows, key=lambda k: (-sizes[k[0]], self.rows[k], k[0], k[1]))
                for k in order[: self.batch]:
                    del self.rows[k]
        self.rows[key] = t
        return "ok"

    def clear(self, scope, rid):
        self.rows.pop((scope, rid), None)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["cancel", "cancel", "cancel", "clear"]),
                  st.sampled_from(["a", "b", "c", "d"]), st.integers(0, 12)),
        max_size=80,
    ),
    max_rows=st.integers(1, 30),
    quota=st.one_of(st.none(), st.integers(1, 12)),
)
def test_cancel_clear_sequences_match_the_model(shm_name, ops, max_rows, quota):
    reg = Registry.create(shm_name, Config(max_rows=max_rows, max_rows_per_scope=quota,
                                           capacity=40, in_flight_capacity=8,
                                           session_capacity=4))
    try:
        clock = Clock()
        c = Cancellation(reg, clock=clock)
        model = Model(max_rows, quota)
        for op, scope, rid in ops:
            t = clock.tick()
            if op == "cancel":
                expected = model.cancel(scope, str(rid), t)
                try:
                    c.cancel(rid, None, scope)
                    got = "ok"
                except CancellationLimitReached:
                    got = "limit"
                assert got == expected
            else:
                model.clear(scope, str(rid))
                c.clear(rid, scope)
            assert {k: v[1] for k, v in reg.table("cancellations").scan()} == model.rows
        for s in "abcd":
            assert c._store.scope_rows(s) == sum(1 for k in model.rows if k[0] == s)
    finally:
        reg.close()
        reg.unlink()


def test_pid_is_this_process():
    assert shmcancel.shm.procinfo.me()[0] == os.getpid()


def test_a_handle_stays_cancelled_once_it_saw_it(rc_any):
    _reg, c = rc_any
    h = c.begin(1, "s")
    c.cancel(1, "first", "s")
    assert h.cancelled()
    c.clear(1, "s")  # e.g. a namesake ended, or the janitor expired the row
    assert h.cancelled() and h.reason() == "first"
    h.end()


@pytest.mark.parametrize("scope", [None, 5, b"s", ["s"]])
def test_non_str_scope(rc_any, scope):
    _reg, c = rc_any
    with pytest.raises(TypeError):
        c.cancel(1, None, scope)
    assert c.cancelled(1, scope) is False
    assert c.in_flight(1, scope) is False
    assert c.reason(1, scope) is None
    c.clear(1, scope)
    c.track(1, scope)
    c.untrack(1, scope)
    assert c.begin(1, scope).tracked is False


def test_shm_backend_implements_the_storage_protocol(rc):
    from shmcancel.cancel.shm_storage import ShmBackend, Storage

    reg, c = rc
    assert isinstance(c._store, ShmBackend)
    assert isinstance(ShmBackend(reg), Storage)


class _Interrupt(BaseException):
    """What a signal handler raises in the middle of a write (gunicorn's SystemExit)."""


@pytest.mark.parametrize("counted", [False, True], ids=["new-count-row", "count-row-kept"])
def test_a_cancel_interrupted_at_any_bytecode_of_its_row_keeps_its_count_and_is_repaired(
        registry, counted, monkeypatch):
    """A new row's count goes up first and comes back down if the row cannot be written
    (``_add_row``). An exception raised at any bytecode of the row's write (a signal
    handler's SystemExit, design.md "The lock and its recovery") must leave the scope's count
    at least its rows, one above at most (stricter, never laxer: contract §4.4), and the
    tables repaired before the lock goes. So the count comes back down only when the row is
    not in (the exception may come after the row's publishing store), and undoing it, which
    deletes a count row fallen to 0 (more count rows than ``zero_counts_kept``), must not
    end the interrupted row write's dirty mark: the lock would then be released over a
    half-written table without fsck. The row is written by the Python path (python_writes):
    an exception comes before a C write or after it, as it does around ``_add_row``'s other
    calls."""
    python_writes(monkeypatch)
    reg = registry(max_rows=8, janitor_interval=3600.0)
    c = Cancellation(reg)
    store = c._store
    for scope in ("p", "q", "u"):  # 3 count rows > zero_counts_kept (2): a count at 0 goes
        c.cancel("a", None, scope)
    if counted:
        c.cancel("a", None, "s")
    lock = reg.lock

    def cancel_interrupted_at(k: int) -> int:
        """cancel "b" in "s", raising at the k-th table opcode run while a table is mid-write
        (0: count them)."""

        def interrupt() -> None:
            raise _Interrupt

        seen = at_bytecode(lock, k, interrupt)
        try:
            c.cancel("b", None, "s")
        finally:
            sys.settrace(None)
        return seen[0]

    n = cancel_interrupted_at(0)
    assert n > 20
    for k in range(1, n + 1):
        c.clear("b", "s")
        with lock:
            store._recount()  # the count of "s" is its rows again
        with pytest.raises(_Interrupt):
            cancel_interrupted_at(k)
        assert not lock.held_by_me() and lock.owner() is None
        with lock:  # nothing left for a repair to do: the lock's exit ran it
            for t in (store._c, store._n):
                try:
                    healthy(t)
                except AssertionError as e:
                    raise AssertionError(f"interrupted at {k}/{n}: {t.name} left unrepaired") from e
        rows = sum(1 for s, *_ in store.cancellations() if s == "s")
        assert rows <= store.scope_rows("s") <= rows + 1, (k, n, rows, store.scope_rows("s"))


@pytest.mark.parametrize("registry", ["prod", 5, object()], ids=["a name", "an int", "an object"])
def test_a_registry_that_is_not_one_is_a_clear_type_error(registry):
    """``Cancellation("prod")`` (a name where the Registry goes) failed with ``AttributeError:
    'str' object has no attribute 'table'``; it is a TypeError saying what to pass."""
    with pytest.raises(TypeError, match=r"Cancellation needs a Registry .*got "
                                        + type(registry).__name__):
        shmcancel.Cancellation(registry)


def test_a_clock_that_is_not_callable_is_a_type_error_at_once(registry):
    """A clock given as a value (``clock=time.time()``) failed only at the first write, deep in
    the store; it is refused where it is given."""
    with pytest.raises(TypeError, match="clock must be callable, got float"):
        shmcancel.Cancellation(registry(), clock=time.time())



def test_two_requests_of_one_id_in_one_thread_hold_a_row_each(rc):
    """As asyncio runs them: one thread, the same id and scope. Each ``track`` is a row of its
    own (contract §4.5: "Concurrent requests with the same id in one scope each hold their own
    row"); the first ``untrack`` left the other request out of flight, and a cancellation of it
    was no longer recorded."""
    reg, c = rc
    c.track(1, "ip:192.0.2.9")
    c.track(1, "ip:192.0.2.9")
    c.untrack(1, "ip:192.0.2.9")  # the short one ends
    assert c.in_flight(1, "ip:192.0.2.9")
    assert c.cancel_if_in_flight(1, "stop", "ip:192.0.2.9")
    c.untrack(1, "ip:192.0.2.9")
    assert not c.in_flight(1, "ip:192.0.2.9")
    c.untrack(1, "ip:192.0.2.9")  # no row left: nothing to do
    assert reg.table("in_flight").count() == 0


def test_cleanup_while_holding_the_lock_is_as_strict_and_keeps_the_counts(make):
    """contract §4.6: ``cleanup`` removes rows strictly older than ``ttl``. Called by a thread
    that holds the registry lock, it takes another path (every row read and removed in that
    hold), which no test reached."""
    reg, c = make(ttl=10.0)
    for i, age in enumerate([5.0, 10.0, 10.5, 100.0]):
        c.clock.t = 1000.0 - age
        c.cancel(i, None, "s")
    c.clock.t = 1000.0
    with reg.lock:
        assert c.cleanup() == 2  # 10.5 and 100 s old; 10 s is not strictly older
    assert [c.cancelled(i, "s") for i in range(4)] == [True, True, False, False]
    assert c._store.scope_rows("s") == 2


def test_cleanup_removes_a_live_processs_row_whose_end_was_dropped(make):
    """``cleanup`` also removes in-flight rows of requests that ended in this (live) process
    without their row going (contract §4.3: an owed end dropped, the queue full); only the
    janitor's tick did, and a direct ``cleanup`` or ``sweep`` left them."""
    _reg, c = make()
    h = c.begin(1, "s")
    assert h.tracked and c.in_flight(1, "s")
    owed.running.discard(h._token)  # its end ran, and its untrack was dropped
    try:
        assert c.sweep(3600) == (0, 1)
        assert not c.in_flight(1, "s")
    finally:
        owed.running.add(h._token)
        h.end()
