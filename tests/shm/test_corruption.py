"""Garbage over a registry's shared memory (issue #7, defect 7): no loop spins, nothing but
documented errors escapes, and the table is repaired and works afterwards.

Each case writes random bytes over one area of one table of a real registry (the index, the
record heap, the free stack, the header counters), then runs every public operation under a
CPU-time deadline (``cpu_deadline``: SIGPROF raises ``Hang`` in a loop that spins; a loaded
machine that gives us no CPU never trips it), then the janitor's sweep, then checks that an
insert/lookup round trip works and that ``fsck`` finds nothing left to repair. One case runs
the spin scenario in a forked worker that must release the lock to its parent.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from helpers.procs import child, reap, recv
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from shmcancel import Cancellation, Config, Registry
from shmcancel.exceptions import RegistryIncompatible, ShmCancelError
from shmcancel.mcp.sessions import SessionStore
from shmcancel.shm.table import Table, _geometry

CFG = Config(max_rows=64, capacity=64, in_flight_capacity=32, session_capacity=16,
             lock_timeout=5.0)
TABLES = ["cancellations", "in_flight", "sessions", "scope_counts"]
AREAS = ["index", "records", "large records", "free stack", "counters"]
ROWS = 12  # rows each table holds when the garbage lands: keys 0..11, values 10 * key
DOCUMENTED = ShmCancelError  # TableFull, TableCorrupted, ...: what the library raises on purpose
ROWS_WORD, TOP_WORD, STAMP_WORD, LTOP_WORD = 3, 4, 5, 7  # u64 header words (shm/layout.py)
BIG = "x" * 300  # a value no small record holds: its row takes a large record


class Hang(Exception):
    """An operation used more CPU time than any bounded loop over these tables can."""


@contextlib.contextmanager
def cpu_deadline(seconds: float = 10.0) -> Iterator[None]:
    """Raise ``Hang`` in the main thread once this process has spent ``seconds`` of CPU time
    inside the block (ITIMER_PROF; pytest-timeout's SIGALRM is left alone)."""
    def on_prof(_sig: int, _frame: object) -> None:
        raise Hang(f"still running after {seconds} s of CPU time: an unbounded loop")

    old = signal.signal(signal.SIGPROF, on_prof)
    signal.setitimer(signal.ITIMER_PROF, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, old)


@pytest.fixture
def reg(shm_name: str) -> Iterator[Registry]:
    r = Registry.create(shm_name, CFG)
    try:
        yield r
    finally:
        r.close()


def area(t: Table, name: str) -> tuple[int, int]:
    """Byte range of ``name`` within the table's region."""
    g = _geometry(t.capacity, t.record_size, t.small_size, t.large_count)
    return {"index": (g.idx_off, g.heap_off), "records": (g.heap_off, g.large_off),
            "large records": (g.large_off, g.free_off),
            "free stack": (g.free_off, g.free_off + 4 * t._nrec),
            "counters": (24, 64)}[name]  # rows, tops, stamp and the class geometry


def fresh(t: Table) -> None:
    """Format ``t`` afresh and fill it with ROWS rows, and with ``bigs(t)`` rows of large records
    (keys "big0".., value BIG) where ``t`` has a large class."""
    Table.format(t._buf, t.capacity, t.record_size, t.small_size, t.large_count)
    for k in range(ROWS):
        t.insert(k, 10 * k)
    for k in range(bigs(t)):
        t.insert(f"big{k}", BIG)


def bigs(t: Table) -> int:
    """Rows of large records ``fresh`` puts in ``t``."""
    return min(3, t.large_count) if t.record_size - t.RECORD_HEADER > 302 else 0


def scribble(t: Table, name: str, seed: int, lo: float, span: float, small: bool) -> None:
    """Random bytes over the part [lo, lo + span) (fractions) of area ``name`` of ``t``;
    ``small``: random u32s below records + 1 instead (plausible record numbers and counts)."""
    a, b = area(t, name)
    start = a + int((b - a) * lo)
    end = min(b, start + max(8, int((b - a) * span)))
    rng = random.Random(seed)
    if small:
        start &= ~3
        end &= ~3
        data = b"".join(rng.randrange(t._nrec + 1).to_bytes(4, "little")
                        for _ in range((end - start) // 4))
    else:
        data = rng.randbytes(end - start)
    t._buf[start:end] = data


def every_operation(t: Table) -> dict[str, Any]:
    """Each public operation of ``t`` once, reads first, each under its own deadline. Returns
    op -> result, or the documented error it raised; anything else propagates."""
    keys = [*range(ROWS), 999]
    ops: list[tuple[str, Callable[[], Any]]] = [
        ("lookup", lambda: [t.lookup(k) for k in keys]),
        ("get", lambda: [t.get(k) for k in keys]),
        ("member", lambda: [t.member(k) for k in keys]),
        ("watch", lambda: [(w.member(), w.values(), w.member())
                           for w in (t.watch(k) for k in keys)]),
        ("scan", lambda: sorted(t.scan(), key=repr)),
        ("count", t.count),
        ("stats", t.stats),
        ("insert new", lambda: t.insert(1000, 1)),
        ("insert existing", lambda: t.insert(1, 11)),
        ("insert_new", lambda: t.insert_new(1001, 1)),
        ("add_held", lambda: add_held(t, 1002, 1)),
        ("delete", lambda: t.delete(2)),
        ("delete_object", lambda: t.delete_object(3, 30)),
        ("delete_where", lambda: t.delete_where(lambda k, v: k == 4)),
    ]
    out: dict[str, Any] = {}
    for name, op in ops:
        with cpu_deadline():
            try:
                out[name] = op()
            except DOCUMENTED as e:
                out[name] = e
    return out


def add_held(t: Table, key: Any, value: Any) -> bool:
    """``add_held`` as its callers use it: inside a hold, after finding no row of ``key``."""
    with t._lock:
        if t.member(key):
            return False
        t.add_held(t.prepare(key), value)
        return True


def zeros(t: Table) -> dict[str, int]:
    return dict.fromkeys(t.fsck(), 0)


def assert_works(reg: Registry, t: Table) -> None:
    """After the janitor's sweep: a round trip works, fsck finds nothing, counters agree."""
    with cpu_deadline():
        Cancellation(reg).sweep()
        t.insert("fresh", 7)
        assert t.lookup("fresh") == [7] and t.member("fresh")
        with reg.lock:
            assert t.fsck() == zeros(t)
        rows = t.scan()
        assert t.count() == len(rows) == t.stats()["rows"]
        assert t.delete("fresh") == 1 and not t.member("fresh")


@pytest.mark.parametrize("area_name", AREAS)
@pytest.mark.parametrize("table", TABLES)
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), lo=st.floats(0, 0.95), span=st.floats(0, 1),
       small=st.booleans())
@example(seed=1, lo=0.0, span=1.0, small=False)  # the whole area
@example(seed=2, lo=0.0, span=1.0, small=True)
def test_garbage_over_a_table(reg: Registry, table: str, area_name: str, seed: int, lo: float,
                              span: float, small: bool) -> None:
    """Every operation finishes, raises nothing undocumented and reads no wrong value (a row
    reads as itself or absent); after the janitor's sweep the table is sound and works."""
    t = reg.tables[table]
    fresh(t)
    scribble(t, area_name, seed, lo, span, small)
    got = every_operation(t)
    for k, vals in zip(range(ROWS), got["lookup"], strict=False):
        assert vals in ([], [10 * k]), (k, vals)
    assert got["lookup"][-1] == [] and got["member"][-1] is False
    for k in range(bigs(t)):
        assert t.lookup(f"big{k}") in ([], [BIG])
    assert set(got["scan"]) <= {(k, 10 * k) for k in range(ROWS)} | {
        (f"big{k}", BIG) for k in range(bigs(t))}
    assert len(set(got["scan"])) == len(got["scan"])  # no row twice
    assert_works(reg, t)


@pytest.mark.parametrize("area_name", AREAS)
@settings(max_examples=10, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), small=st.booleans())
@example(seed=3, small=False)
def test_fsck_on_garbage_finishes_and_leaves_a_sound_table(reg: Registry, area_name: str,
                                                            seed: int, small: bool) -> None:
    t = reg.table("sessions")
    fresh(t)
    scribble(t, area_name, seed, 0.0, 1.0, small)
    with cpu_deadline(), reg.lock:
        t.fsck()
        assert t.fsck() == zeros(t)
    t.insert("k", "v")
    assert t.lookup("k") == ["v"]


@pytest.mark.parametrize("write", ["insert", "add_held"])
@pytest.mark.parametrize("table", TABLES)
def test_a_full_index_of_garbage_does_not_spin_a_writer(reg: Registry, table: str,
                                                        write: str) -> None:
    """What a worker met: random bytes over the whole index, so that no slot is empty. The
    insert (or a cancel's ``add_held``) repairs the table (fsck, under the lock) and
    succeeds."""
    t = reg.tables[table]
    fresh(t)
    scribble(t, "index", 7, 0.0, 1.0, False)
    with cpu_deadline():
        assert t.member(5) is False and t.lookup(5) == []
        if write == "insert":
            t.insert("k", "v")
        else:
            assert add_held(t, "k", "v")
    assert t.lookup("k") == ["v"] and t.count() == 1
    with reg.lock:
        assert t.fsck() == zeros(t)


@pytest.mark.parametrize("write", ["insert", "add_held"])
@pytest.mark.parametrize("value", ["v", BIG], ids=["small", "large"])
@pytest.mark.parametrize("damage", [(TOP_WORD, 0), (TOP_WORD, 10**6), (TOP_WORD, 2**64 - 1),
                                    (STAMP_WORD, 2**62), (STAMP_WORD, 2**64 - 1),
                                    (ROWS_WORD, 10**6)],
                         ids=["free top 0", "free top past the stack", "free top -1",
                              "stamp past its range", "stamp -1", "rows past capacity"])
def test_a_header_word_of_garbage_under_a_new_row(reg: Registry, write: str, value: str,
                                                  damage: tuple[int, int]) -> None:
    """The header words a new row's write reads before its first store (its record class's
    free-stack top, the stamp counter, the row counter) hold garbage: the write repairs the
    table (fsck, under the lock) and its row goes in, whole and alone, small or large
    (``add_held`` takes its own path for a small record; it must fall back, never store
    through a bad top or stamp)."""
    t = reg.table("cancellations")
    fresh(t)
    if value == BIG and not bigs(t):
        pytest.skip("this table has no large records")
    word, garbage = damage
    if word == TOP_WORD and value == BIG:
        word = LTOP_WORD  # the free stack of the record class the row takes
    t._hq[word] = garbage
    with cpu_deadline():
        if write == "insert":
            t.insert("k", value)
        else:
            assert add_held(t, "k", value)
    assert t.lookup("k") == [value]
    assert t.count() == ROWS + bigs(t) + 1 == len(t.scan())
    with reg.lock:
        assert t.fsck() == zeros(t)


def test_a_spinning_worker_releases_the_lock(reg: Registry) -> None:
    """A forked worker whose in-flight index is garbage tracks and untracks a request; it must
    finish (and so release the lock) instead of spinning with the lock held, as it did."""
    name = reg.name

    def worker(w: int) -> None:
        r = Registry.attach(name)
        scribble(r.table("in_flight"), "index", 11, 0.0, 1.0, False)
        c = Cancellation(r)
        c.track(7)
        assert c.in_flight(7)
        c.untrack(7)
        assert not c.in_flight(7)
        os.write(w, b"ok")

    pid, fd = child(worker)
    try:
        assert recv(fd, timeout=30) == b"ok"
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        os.close(fd)
        reap(pid)
    with cpu_deadline(), reg.lock:  # free again; the worker left the table sound
        assert reg.table("in_flight").fsck() == zeros(reg.table("in_flight"))
    c = Cancellation(reg)
    c.track(8)
    assert c.in_flight(8)


def test_inflated_row_counter_does_not_make_the_table_full(reg: Registry) -> None:
    """A row counter raised to capacity (the sessions table's ``initialize`` -> TableFull until
    restart): the insert finds the counters implausible, recounts, and succeeds."""
    t = reg.table("cancellations")
    fresh(t)
    t._hq[ROWS_WORD] = t.capacity
    t.insert("k", "v")
    assert t.lookup("k") == ["v"] and t.count() == ROWS + bigs(t) + 1
    t._hq[ROWS_WORD] = 2**64 - 1
    assert t.count() == ROWS + bigs(t) + 1  # an absurd counter is not believed
    t.insert_new("k2", "v")
    assert t.count() == ROWS + bigs(t) + 2


def test_inflated_session_counter_does_not_refuse_initialize(reg: Registry) -> None:
    store = SessionStore(reg)
    s0 = store.create("2025-06-18")
    reg.table("sessions")._hq[ROWS_WORD] = reg.config.session_capacity
    s1 = store.create("2025-06-18")
    assert store.get(s1.id) is not None and store.get(s0.id) is not None
    assert reg.table("sessions").count() == 2


@pytest.mark.parametrize(("word", "value"), [
    (ROWS_WORD, 0),  # a delete must not store -1
    (STAMP_WORD, 2**64 - 1),  # the next stamp must not overflow
    (TOP_WORD, 2**64 - 1),
    (TOP_WORD, 0),
    (LTOP_WORD, 2**64 - 1),
    (LTOP_WORD, 0),
])
def test_absurd_header_counters(reg: Registry, word: int, value: int) -> None:
    """Counters no writer leaves: no store overflows, the janitor's sweep recounts them."""
    t = reg.table("sessions")  # a table the sweep's expiry leaves alone
    fresh(t)
    t._hq[word] = value
    with cpu_deadline():
        assert t.delete(0) == 1
        t.insert("k", "v")
        t.insert(1, 12)  # a set update: write a record, free the old one
        t.insert("big0", BIG + "y")  # a set update of a large row
        assert t.delete("big2") == 1
        t.insert("big9", BIG)  # a new large row
    assert t.lookup("k") == ["v"] and t.lookup(1) == [12] and t.lookup(0) == []
    assert t.lookup("big0") == [BIG + "y"] and t.lookup("big9") == [BIG]
    assert_works(reg, t)
    assert t.count() == ROWS + bigs(t)


def test_attach_recounts_implausible_counters(reg: Registry) -> None:
    """``Registry.attach`` (each worker) recounts a row counter that disagrees with the index."""
    t = reg.table("cancellations")
    fresh(t)
    t._hq[ROWS_WORD] = ROWS + bigs(t) + 5
    r2 = Registry.attach(reg.name)
    try:
        assert r2.table("cancellations").count() == ROWS + bigs(t)
        with r2.lock:
            assert r2.table("cancellations").fsck() == zeros(t)
    finally:
        r2.close()


def test_janitor_repairs_a_free_stack_that_points_at_live_records(reg: Registry) -> None:
    """Garbage that looks like record numbers over the free stack (here: the numbers of live
    records): the sweep rebuilds it before an insert can overwrite a live row."""
    t = reg.table("sessions")
    fresh(t)
    live = [r for _, r, _, _, _ in t._entries(t._idx.tolist())]
    top = t._hq[TOP_WORD]
    for i in range(top):
        t._free[i] = live[i % len(live)]
    for i in range(t._hq[LTOP_WORD]):  # the large class's stack: live small and large records
        t._free[t.capacity + 1 + i] = live[-1 - i % len(live)]
    Cancellation(reg).sweep()
    for k in range(20, 24 - bigs(t)):
        t.insert(k, k)
    t.insert("big0", BIG + "z")
    assert all(t.lookup(k) == [10 * k] for k in range(ROWS))
    assert [t.lookup(f"big{k}") for k in range(1, bigs(t))] == [[BIG]] * (bigs(t) - 1)
    with reg.lock:
        assert t.fsck() == zeros(t)


def test_a_corrupted_record_is_repaired_once_then_reads_are_lock_free(
        reg: Registry, caplog: pytest.LogCaptureFixture) -> None:
    """A record failing its crc sends a reader to the lock, which repairs (one log line per
    process and table, however often it recurs); later reads take no lock."""
    t = reg.table("in_flight")
    fresh(t)
    caplog.set_level(logging.ERROR, "shmcancel.table")
    for _ in range(2):
        r = next(r for _, r, kb, _, _ in t._entries(t._idx.tolist()) if kb == b"\x05")
        off = t._offset(r) + Table.RECORD_HEADER
        t._buf[off] ^= 0xFF
        gen = reg.lock.generation
        for _ in range(10):
            assert t.lookup(5) == []
        assert reg.lock.generation - gen <= 2  # the fallback once, not every read
        t.insert(5, 50)
    logged = [r for r in caplog.records if "corrupted shared memory" in r.getMessage()]
    assert len(logged) == 1 and "in_flight" in logged[0].getMessage()
    assert t.lookup(5) == [50]


def test_attach_never_waits_long_for_a_held_lock(reg: Registry,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    """A live process holds the lock while the counters are implausible: attach waits at most
    about a second for it, skips the repair (logged), and the next sweep does it."""
    t = reg.table("cancellations")
    fresh(t)
    go_r, go_w = os.pipe()

    def holder(w: int) -> None:
        r = Registry.attach(reg.name)
        with r.lock:
            os.write(w, b"held")
            os.read(go_r, 1)  # until the parent lets go (or dies: EOF)

    pid, fd = child(holder)
    try:
        assert recv(fd) == b"held"
        t._hq[ROWS_WORD] = ROWS + bigs(t) + 5
        caplog.set_level(logging.WARNING, "shmcancel.registry")
        t0 = time.monotonic()
        r2 = Registry.attach(reg.name)
        assert time.monotonic() - t0 < CFG.lock_timeout  # the check's own bound, not the lock's
        r2.close()
        assert any("check on attach skipped" in r.getMessage() for r in caplog.records)
    finally:
        os.write(go_w, b"x")
        os.close(go_w)
        os.close(go_r)
        os.close(fd)
        reap(pid)
    assert t.count() == ROWS + bigs(t) + 5
    Cancellation(reg).sweep()  # the malformed test rows go too; the counter agrees
    assert t.count() == len(t.scan()) and t._hq[ROWS_WORD] == t.count()


def test_a_corrupt_class_geometry_is_refused_at_attach_and_restored_by_the_sweep(
        reg: Registry) -> None:
    """Garbage over a table's size classes (header bytes 48..56): a new attachment refuses the
    segment (its records would be misread), the attached processes go on with the geometry
    they checked, and the janitor's sweep writes it back."""
    t = reg.table("sessions")  # a table the sweep's expiry leaves alone
    fresh(t)
    good = bytes(t._buf[48:56])
    t._buf[48:52] = (t.small_size + 8).to_bytes(4, "little")
    with pytest.raises(RegistryIncompatible, match="does not match the layout"):
        Registry.attach(reg.name)
    assert t.lookup("big1") == [BIG] and t.lookup(3) == [30]
    with cpu_deadline():
        Cancellation(reg).sweep()
    assert bytes(t._buf[48:56]) == good
    Registry.attach(reg.name).close()
    assert_works(reg, t)


@pytest.mark.parametrize("table", TABLES)
def test_a_damaged_region_header_is_refused_at_attach_and_rebuilt_by_check(
        reg: Registry, table: str) -> None:
    """0xFF over a table's whole 64-byte region header (magic, geometry, counters): a new
    attachment refuses the segment with an error naming the damage and ``shmtool fsck``; an
    attached process's ``check`` finds it and rebuilds the header from the descriptor and the
    schema; new attachments work again and the rows are intact."""
    t = reg.table(table)
    fresh(t)
    t._buf[0:64] = b"\xff" * 64
    with pytest.raises(RegistryIncompatible, match=(
            rf"registry {reg.name}: table '{table}': region header damaged \(magic .*capacity "
            rf"4294967295 \(expected {t.capacity}\).*run `shmtool fsck {reg.name}`")):
        Registry.attach(reg.name)
    with cpu_deadline():
        rep = reg.check(deep=False)
    assert rep[table]["region_header"] == 1
    assert reg.check() == {}
    Registry.attach(reg.name).close()
    assert all(t.lookup(k) == [10 * k] for k in range(ROWS))
    assert_works(reg, t)


@pytest.mark.parametrize(("key", "target"), [
    (5, "large in use"), (5, "large free"), ("big1", "small in use"), ("big1", "small free"),
    (5, "past both"), ("big1", "huge")])
def test_a_record_number_out_of_its_class(reg: Registry, key: Any, target: str) -> None:
    """An index entry naming a record of the other class (live or free) or no record: the row
    reads as absent (never another row's value), every other row as itself, and the repair
    leaves both free stacks whole (every record usable again)."""
    t = reg.table("sessions")  # a table the sweep's expiry leaves alone
    fresh(t)
    ents = {kb: r for _, r, kb, _, _ in t._entries(t._idx.tolist())}
    used = set(ents.values())
    r = {"large in use": ents[t.prepare("big0").kbytes],
         "large free": next(r for r in range(t._nrec - 1, t.capacity, -1) if r not in used),
         "small in use": ents[t.prepare(0).kbytes],
         "small free": next(r for r in range(t.capacity, -1, -1) if r not in used),
         "past both": t._nrec, "huge": 2**40}[target]
    s = t._find(t.prepare(key))[0][0]
    t._idx[2 * s + 1] = r
    with cpu_deadline():
        assert t.lookup(key) == [] and not t.member(key)
        assert all(t.lookup(k) == [10 * k] for k in range(ROWS) if k != key)
        assert all(t.lookup(f"big{k}") == [BIG] for k in range(bigs(t)) if f"big{k}" != key)
    assert_works(reg, t)
    assert t.count() == ROWS + bigs(t) - 1
    t.insert(key, 1 if key == 5 else BIG)  # the key can be written again, in its class
    while t.count() < t.capacity:  # every small record is usable
        t.insert(("fill", t.count()), 0)
