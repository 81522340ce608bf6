"""Record size classes (shm/layout.py): a table keeps one small record per row and ``L`` large
ones; every valid row fits while at most ``L`` rows are large, and what happens past that is each
table's documented policy. Real shared memory throughout (``Rig``, ``Registry``)."""

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
from shmcancel.cancel import tables as cancel_tables
from shmcancel.cancel.reasons import SHORTENED
from shmcancel.cancel.shm_storage import ShmBackend
from shmcancel.exceptions import TableFull
from shmcancel.mcp import session_tables
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


# ------------------------------------------------------------------ per table, past the large class

REASON = "r" * 200  # a reason no small record holds


def _ticking() -> Callable[[], float]:
    now = [1000.0]

    def clock() -> float:
        now[0] += 1
        return now[0]

    return clock


def test_past_the_large_class_a_cancellation_keeps_its_row_with_its_reason_cut(
        shm_name: str) -> None:
    """Rows that need a large record only for their reason: once the large records are taken,
    a new row, and an overwrite that grows a small row, keep their rows (nothing is evicted:
    §4.3, §4.4) with the reason's longest prefix that fits a small record, ending in "…"."""
    with Registry.create(shm_name, Config(max_rows=1000, capacity=1000)) as reg:
        c = Cancellation(reg, clock=_ticking())
        t = reg.table("cancellations")
        L = t.large_count
        assert L == cancel_tables.LARGE_CANCELLATIONS and t.capacity == 1000
        c.cancel("grows", "short", scope="s1")
        for i in range(L):
            c.cancel(f"big{i}", REASON, scope=f"s{i % 4}")
        assert len(t.large_rows()) == L
        for rid in ("new", "grows"):  # a new row; an existing small row overwritten in place
            c.cancel(rid, REASON, scope="s1")
            kept = c.reason(rid, "s1")
            assert kept is not None and kept.endswith(SHORTENED)
            assert 0 < len(kept) - 1 < len(REASON) and REASON.startswith(kept[:-1])
        assert reg.evictions == 0 and t.count() == L + 2
        assert all(c.reason(f"big{i}", f"s{i % 4}") == REASON for i in range(L))
        assert ShmBackend(reg).scope_rows("s1") == sum(1 for k, _ in t.scan() if k[0] == "s1")
        c.cancel("new", "short again", scope="s1")  # short again: stored whole
        assert c.reason("new", "s1") == "short again"
        reg.unlink()


def test_a_reason_is_cut_on_a_character_boundary(shm_name: str) -> None:
    """Multi-byte characters: the cut never splits one (the kept text is a prefix)."""
    with Registry.create(shm_name, Config(max_rows=1000, capacity=1000)) as reg:
        c = Cancellation(reg, clock=_ticking())
        for i in range(reg.table("cancellations").large_count):
            c.cancel(f"big{i}", REASON, scope="s")
        wide = "é€😀" * 60  # 2-, 3- and 4-byte characters
        c.cancel("wide", wide, scope="t")
        kept = c.reason("wide", "t")
        assert kept is not None and kept.endswith(SHORTENED) and wide.startswith(kept[:-1])
        reg.unlink()


def test_rows_whose_key_needs_a_large_record_evict_among_the_large_rows(shm_name: str) -> None:
    """A key no small record holds (a long principal scope) cannot be helped by cutting the
    reason: past the large class, the oldest large rows go in §4.4's order, a batch of
    ``max(1, L // 20)``, and the new row is stored whole."""
    with Registry.create(shm_name, Config(max_rows=1000, capacity=1000)) as reg:
        c = Cancellation(reg, clock=_ticking())
        t = reg.table("cancellations")
        L = t.large_count
        scopes = [f"principal:{n}" + "p" * 200 for n in range(4)]
        for i in range(20):
            c.cancel(f"small{i}", "short", scope=f"s{i % 4}")
        for i in range(L):
            c.cancel(f"big{i}", None, scope=scopes[i % 4])
        assert len(t.large_rows()) == L and reg.evictions == 0
        c.cancel("big-new", "a reason", scope=scopes[0])  # never refused for its size
        batch = max(1, L // 20)
        assert c.reason("big-new", scopes[0]) == "a reason" and reg.evictions == batch
        gone = [i for i in range(L) if not c.cancelled(f"big{i}", scopes[i % 4])]
        assert gone == list(range(batch))  # equal scopes: the oldest large rows, in §4.4 order
        assert all(c.cancelled(f"small{i}", f"s{i % 4}") for i in range(20))  # untouched
        assert t.count() == 20 + L - batch + 1 and len(t.large_rows()) == L - batch + 1
        store = ShmBackend(reg)
        for s in scopes:  # the scope counts moved with the evicted rows
            assert store.scope_rows(s) == sum(1 for k, _ in t.scan() if k[0] == s)
        reg.unlink()


def _dead_owner() -> tuple[int, int, int, int]:
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        os._exit(0)
    os.waitpid(pid, 0)
    return (pid, 1, 1, 1)


def test_in_flight_past_the_large_class_reaps_then_fails_like_a_full_table(shm_name: str) -> None:
    with Registry.create(shm_name, Config(in_flight_capacity=1024)) as reg:
        c = Cancellation(reg)
        store = ShmBackend(reg)
        L = reg.table("in_flight").large_count
        scope = "p" * 200  # a long principal: every row of it is large
        dead = _dead_owner()
        for i in range(L):
            store.track(scope, f"dead{i}", dead)
        c.track("mine", scope)  # the dead owner's large rows are reaped to make room
        assert c.in_flight("mine", scope) and len(reg.table("in_flight").large_rows()) == 1
        for i in range(L - 1):
            c.track(f"live{i}", scope)
        with pytest.raises(TableFull, match="larger than"):
            c.track("one-more", scope)
        c.track("small", "global")  # small rows are unaffected
        assert c.in_flight("small", "global") and not c.in_flight("one-more", scope)
        reg.unlink()


def test_in_flight_rows_of_a_long_principal_and_uuid_ids_take_small_records(
        shm_name: str) -> None:
    """A 79-character principal scope with UUID request ids (a common transport row) fits a
    small record: far more than the large class's rows of it are tracked at once."""
    with Registry.create(shm_name, Config(in_flight_capacity=1024)) as reg:
        c = Cancellation(reg)
        scope = "principal:" + "u" * 69
        L = reg.table("in_flight").large_count
        ids = [str(uuid.UUID(int=i)) for i in range(3 * L)]
        for rid in ids:
            c.track(rid, scope)
        assert all(c.in_flight(rid, scope) for rid in ids)
        assert not reg.table("in_flight").large_rows()
        reg.unlink()


def test_session_clients_past_the_large_class_refuse_a_session(shm_name: str) -> None:
    """A client with more than 8 sessions has a large client row; when L clients have one, a
    ninth session of another client is refused like a full table (SessionsFull), and its first
    eight, or a session of a client whose row is large already, are not."""
    cfg = Config(session_capacity=session_tables.LARGE_CLIENTS * 9 + 32, sessions_per_client=32)
    with Registry.create(shm_name, cfg) as reg:
        store = SessionStore(reg)
        L = reg.table("session_clients").large_count
        for i in range(L):
            for _ in range(9):
                store.create("2025-06-18", client=f"c{i}")
        for _ in range(8):
            store.create("2025-06-18", client="late")
        with pytest.raises(SessionsFull):
            store.create("2025-06-18", client="late")
        store.create("2025-06-18", client="c0")  # a large row grows: the spare serves it
        assert len(reg.table("session_clients").large_rows()) == L
        reg.unlink()


# ------------------------------------------------------------------ footprint

MIB = 1 << 20


def test_default_segment_is_at_most_8_mib_and_follows_max_rows(shm_name: str,
                                                             shm_names: list[str]) -> None:
    footprint = load_tool("footprint").footprint
    with Registry.create(shm_name) as reg:
        default = os.path.getsize(segment_path(shm_name))
        assert default <= 8 * MIB and default == reg.info()["total_size"]
        assert footprint(Config())[1] == default  # what tools/footprint.py prints
        reg.unlink()
    small_name = shm_name + "s"
    shm_names.append(small_name)
    with Registry.create(small_name, Config(max_rows=100)) as reg:
        small = os.path.getsize(segment_path(small_name))
        assert small < default - 2 * MIB and footprint(Config(max_rows=100))[1] == small
        assert reg.table("cancellations").capacity == 100
        assert reg.table("scope_counts").capacity == 100 + 25  # room for 25 counts at 0
        assert reg.config.capacity == 10_000  # the contract's meaning is unchanged
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
