"""Record size classes (shm/layout.py): a table keeps one small record per row and ``L`` large
ones; every valid row fits while at most ``L`` rows are large. The cancellation layer's tables
take ``L`` = every row (any valid row fits), the sessions' a bounded ``L`` with a documented
policy past it. Real shared memory throughout (``Rig``, ``Registry``)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
from helpers.table_rig import Rig, healthy
from helpers.tools import load_tool
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from shmcancel import Cancellation, Config, Registry
from shmcancel.exceptions import TableFull
from shmcancel.mcp.sessions import SessionsFull, SessionStore
from shmcancel.shm.names import segment_path
from shmcancel.shm.table import LargeRowsFull, Table

CAP, RS, SMALL, LARGE = 12, 256, 64, 3  # the machine's table: payloads of 40 and 232 bytes


def large(t: Table, key: Any, value: Any) -> bool:
    return len(msgpack.packb(key)) + len(msgpack.packb(value)) > t.small_size - Table.RECORD_HEADER


def large_rows(t: Table) -> int:
    return sum(1 for k, v in t.scan() if large(t, k, v))


class ClassedSet(RuleBasedStateMachine):
    """A set table of two size classes against a dict: small and large rows up to (and past)
    the exhaustion of both the large class and the table."""

    def __init__(self) -> None:
        super().__init__()
        self.rig = Rig(f"t{os.getpid()}-cls-{id(self):x}", [("set", CAP, RS, SMALL, LARGE)])
        self.t = self.rig.tables[0]
        self.model: dict[str, Any] = {}

    def teardown(self) -> None:
        self.rig.close()
        os.unlink("/dev/shm/shmcancel." + self.rig.name)
        os.unlink("/dev/shm/sem.shmcancel." + self.rig.name)

    def nlarge(self) -> int:
        return sum(1 for k, v in self.model.items() if large(self.t, k, v))

    @rule(k=st.integers(0, 15), v=st.one_of(
        st.integers(-1000, 1000), st.text("ab", max_size=30), st.text("xyz", min_size=50,
                                                                      max_size=200)))
    def insert(self, k: int, v: Any) -> None:
        key = f"k{k}"
        old = self.model.get(key)
        grows = large(self.t, key, v) and (old is None or not large(self.t, key, old))
        if old is None and len(self.model) == CAP:
            with pytest.raises(TableFull) as e:
                self.t.insert(key, v)
            assert type(e.value) is TableFull  # the row count is checked first
        elif old != v and grows and self.nlarge() == LARGE:
            with pytest.raises(LargeRowsFull):
                self.t.insert(key, v)
        else:
            self.t.insert(key, v)
            self.model[key] = v

    @rule(k=st.integers(0, 15))
    def delete(self, k: int) -> None:
        key = f"k{k}"
        assert self.t.delete(key) == (1 if key in self.model else 0)
        self.model.pop(key, None)

    @invariant()
    def agrees(self) -> None:
        t = self.t
        assert dict(t.scan()) == self.model and t.count() == len(self.model)
        for k in range(16):
            assert t.lookup(f"k{k}") == ([self.model[f"k{k}"]] if f"k{k}" in self.model else [])
        assert large_rows(t) == self.nlarge() <= LARGE
        with self.rig.lock:
            healthy(t)


TestClassedSet = ClassedSet.TestCase
TestClassedSet.settings = settings(max_examples=40, stateful_step_count=60, deadline=None,
                                   suppress_health_check=[HealthCheck.too_slow])


def test_a_full_large_class_still_updates_its_rows_and_takes_small_ones(shm_name: str) -> None:
    rig = Rig(shm_name, [("bag", CAP, RS, SMALL, LARGE)])
    try:
        t = rig.tables[0]
        big = "x" * 100
        for i in range(LARGE):
            t.insert("b", f"{big}{i}")
        with pytest.raises(LargeRowsFull):
            t.insert("b", f"{big}new")
        with pytest.raises(LargeRowsFull):
            t.insert_new("other", big)
        for i in range(CAP - LARGE):  # the small records are all there
            t.insert("s", i)
        assert t.count() == CAP and large_rows(t) == LARGE
        assert t.delete_object("b", f"{big}0")
        t.insert("b", f"{big}new")  # the freed large record is reused
        with rig.lock:
            healthy(t)
    finally:
        rig.close()


# ------------------------------------------------------------------ per table

SCOPE = "principal:" + "\U0001f600" * 125  # 510 UTF-8 bytes: within the 512 of contract §3
REASON = "\U0001f600" * 200  # 800 bytes, 200 characters: the longest reason §4.2 keeps


def _ticking() -> Callable[[], float]:
    now = [1000.0]

    def clock() -> float:
        now[0] += 1
        return now[0]

    return clock


def _worst_id(i: int) -> str:
    return f"{i:06d}" + "i" * 250  # 256 bytes: the longest id §4.1 takes


def test_max_rows_cancellations_of_the_worst_size_all_fit_whole(shm_name: str) -> None:
    """Every row as large as the contract allows (scope, id and reason at their limits):
    ``max_rows`` of them are kept with their whole reasons and nothing is evicted below the
    cap (§2, §4.2, §4.4); the next one evicts exactly §4.4's batch, oldest first."""
    with Registry.create(shm_name, Config(max_rows=600, max_rows_per_scope=None)) as reg:
        c = Cancellation(reg, clock=_ticking())
        t = reg.table("cancellations")
        assert t.large_count == t.capacity == 600
        for i in range(600):
            c.cancel(_worst_id(i), REASON, scope=SCOPE)
        assert reg.evictions == 0 and t.count() == 600 and len(t.large_rows()) == 600
        assert all(c.reason(_worst_id(i), SCOPE) == REASON for i in range(600))
        assert allocated(shm_name) <= os.path.getsize(segment_path(shm_name))
        c.cancel(_worst_id(600), REASON, scope=SCOPE)
        assert reg.evictions == 30 and t.count() == 571
        assert [i for i in range(601) if not c.cancelled(_worst_id(i), SCOPE)] == list(range(30))
        reg.unlink()


def test_an_overwrite_that_grows_a_row_keeps_every_row(shm_name: str) -> None:
    """Small rows overwritten with the longest reason, the table full: each keeps its row,
    its whole new reason, and no other row goes (§4.3)."""
    with Registry.create(shm_name, Config(max_rows=300)) as reg:
        c = Cancellation(reg, clock=_ticking())
        for i in range(300):
            c.cancel(i, "short", scope=f"s{i % 3}")
        for i in range(300):
            c.cancel(i, REASON, scope=f"s{i % 3}")
        assert reg.evictions == 0 and reg.table("cancellations").count() == 300
        assert all(c.reason(i, f"s{i % 3}") == REASON for i in range(300))
        reg.unlink()


def test_in_flight_capacity_rows_of_the_worst_size_are_tracked(shm_name: str) -> None:
    """``in_flight_capacity`` rows of the longest scope and id: each tracked (§4.5), and the
    next one is ``TableFull`` for the row count, not for its size."""
    with Registry.create(shm_name, Config(in_flight_capacity=300)) as reg:
        c = Cancellation(reg)
        for i in range(300):
            c.track(_worst_id(i), SCOPE)
        assert all(c.in_flight(_worst_id(i), SCOPE) for i in range(300))
        with pytest.raises(TableFull) as e:
            c.track(_worst_id(300), SCOPE)
        assert type(e.value) is TableFull
        reg.unlink()


def test_in_flight_rows_of_a_long_principal_and_uuid_ids_take_small_records(
        shm_name: str) -> None:
    """A 79-character principal scope with UUID request ids (a common transport row) fits a
    small record (the one a scan reads)."""
    with Registry.create(shm_name, Config(in_flight_capacity=1024)) as reg:
        c = Cancellation(reg)
        scope = "principal:" + "u" * 69
        ids = [str(uuid.UUID(int=i)) for i in range(500)]
        for rid in ids:
            c.track(rid, scope)
        assert all(c.in_flight(rid, scope) for rid in ids)
        assert not reg.table("in_flight").large_rows()
        reg.unlink()


def test_every_session_client_row_may_be_large(shm_name: str) -> None:
    """A client with more than 8 sessions has a large client row. Every client row may be
    large (their pages come as they are written): 300 clients of 9 sessions each, more large
    rows than the 256 a bounded class held, are all served; only a full sessions table refuses
    a new client's session (SessionsFull)."""
    cfg = Config(session_capacity=300 * 9, sessions_per_client=32)
    with Registry.create(shm_name, cfg) as reg:
        store = SessionStore(reg)
        t = reg.table("session_clients")
        assert t.large_count == t.capacity == reg.table("sessions").large_count
        for i in range(300):
            for _ in range(9):
                store.create("2025-06-18", client=f"c{i}")
        assert len(t.large_rows()) == 300 and reg.table("sessions").count() == 300 * 9
        with pytest.raises(SessionsFull, match="table is full"):
            store.create("2025-06-18", client="late")
        reg.unlink()


# ------------------------------------------------------------------ footprint

MIB = 1 << 20


def allocated(name: str) -> int:
    """Bytes of registry ``name``'s segment that /dev/shm has allocated (its pages backed)."""
    return os.stat(segment_path(name)).st_blocks * 512


def test_the_segment_allocates_large_records_on_demand_and_follows_max_rows(
        shm_name: str, shm_names: list[str]) -> None:
    """A worst-case record for every cancellation and in-flight row (the contract's counts
    hold whatever the rows' sizes), so the file follows ``max_rows`` down (~1.8 KB a row); of
    it ``create`` allocates all but the large records (issue #9: <= 8 MiB by default), which
    writers back as large rows come. ``tools/footprint.py`` prints both figures."""
    fp = load_tool("footprint")
    with Registry.create(shm_name) as reg:
        default = os.path.getsize(segment_path(shm_name))
        assert default == reg.info()["total_size"] == fp.footprint(Config())[1]
        at_create = allocated(shm_name)
        assert at_create == fp.allocated_at_create(Config()) <= 8 * MIB < default - 16 * MIB
        for name in ("cancellations", "in_flight"):
            t = reg.table(name)
            assert t.large_count == t.capacity
        reg.unlink()
    small_name = shm_name + "s"
    shm_names.append(small_name)
    with Registry.create(small_name, Config(max_rows=100)) as reg:
        small = os.path.getsize(segment_path(small_name))
        assert small < default - 16 * MIB and fp.footprint(Config(max_rows=100))[1] == small
        assert allocated(small_name) == fp.allocated_at_create(Config(max_rows=100)) < at_create
        assert reg.table("cancellations").capacity == 100
        assert reg.table("scope_counts").capacity == 100 + 25  # room for 25 counts at 0
        assert reg.config.capacity == 10_000  # the contract's meaning is unchanged
        reg.unlink()
    whole_name = shm_name + "p"
    shm_names.append(whole_name)
    with Registry.create(whole_name, Config(preallocate=True)) as reg:  # every page at create
        assert allocated(whole_name) == default == fp.allocated_at_create(
            Config(preallocate=True))
        reg.unlink()


def test_large_records_backed_follow_the_peak_of_large_rows(shm_name: str) -> None:
    """Rows of the worst size back their records as they come, and rows written after others
    were cleared reuse the records already backed (the lowest first): what is allocated grows
    with the peak of large rows held, never with their turnover, up to the file size."""
    with Registry.create(shm_name, Config(max_rows_per_scope=None)) as reg:
        c = Cancellation(reg, clock=_ticking())
        rs = reg.table("cancellations").record_size
        before = allocated(shm_name)
        for i in range(300):
            c.cancel(_worst_id(i), REASON, scope=SCOPE)
        grown = allocated(shm_name)
        assert before + 300 * rs <= grown <= before + 300 * rs + (1 << 17)  # + a backing chunk
        for round_ in range(3):
            for i in range(300):
                c.clear(_worst_id(i), SCOPE)
            for i in range(300):
                c.cancel(_worst_id(i), f"{round_}{REASON}"[:200], scope=SCOPE)
            assert allocated(shm_name) == grown
        assert all(c.reason(_worst_id(i), SCOPE) == f"2{REASON}"[:200] for i in range(300))
        assert not any(n for rep in reg.fsck().values() for n in rep.values())
        reg.unlink()


def test_max_rows_rows_of_typical_size_are_all_stored(shm_name: str) -> None:
    """The default config: max_rows cancellations of typical size (scopes of minted session
    ids, ids of 1-36 characters, no reason or a short one) and a full in-flight table of
    typical rows, all stored, nothing evicted."""
    with Registry.create(shm_name) as reg:
        c = Cancellation(reg)
        cfg = reg.config
        scopes = [os.urandom(24).hex()[:32] for _ in range(50)]
        ids: list[object] = [*range(100), *(f"{i:036d}" for i in range(100))]
        n = 0
        for s in scopes:
            for rid in ids:
                if n < cfg.max_rows:  # type: ignore[operator]
                    c.cancel(rid, None if n % 2 else "Client cancelled the request", scope=s)
                    n += 1
        assert reg.table("cancellations").count() == cfg.max_rows and reg.evictions == 0
        assert not reg.table("cancellations").large_rows()
        for i in range(cfg.in_flight_capacity):
            c.track(f"{i:036d}", scopes[i % 50])
        assert reg.table("in_flight").count() == cfg.in_flight_capacity
        assert not reg.table("in_flight").large_rows()
        reg.unlink()
