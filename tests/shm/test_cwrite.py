"""The C write paths (``shm/_cwrite.c``: a new small row, a key's small rows removed) against the
Python path: the same operations on twin tables, one written through C and one through Python,
leave byte-identical regions, whatever the probe, the record class, a full table, a backward
shift or a declined case. The index hash (``siphash``) in C against its Python twin, and across
processes of both kinds sharing one registry.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
from typing import Any

import pytest
from helpers.table_rig import (
    Rig,
    fills_to_capacity,
    healthy,
    killed_holding,
    same_home_keys,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shmcancel.exceptions import TableFull
from shmcancel.shm import hashing, writer
from shmcancel.shm.base import TableCorrupted
from shmcancel.shm.table import Table

pytestmark = pytest.mark.skipif(writer._add_small is None and hashing.PURE_PYTHON,
                                reason="SHMCANCEL_PURE_PYTHON is set")

C_ADD = writer._add_small
C_DELETE = writer._delete_small
# (kind, capacity, record_size, small_size, large_count): 16 index slots, two record classes
SPEC = ("set", 7, 160, 48, 3)
KEYS = [f"k{i}" for i in range(12)]
VALUES = st.one_of(st.integers(-3, 3), st.text("ab", max_size=4),
                   st.text("z", min_size=40, max_size=90))  # large records, some too large
OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.sampled_from(KEYS), VALUES),
    st.tuples(st.just("delete"), st.sampled_from(KEYS), st.none()),
    st.tuples(st.just("insert"), st.sampled_from(KEYS), VALUES),
    st.tuples(st.just("receipt"), st.sampled_from(KEYS), VALUES)), max_size=40)


def test_the_c_path_is_built_where_a_compiler_is() -> None:
    """A machine with a C compiler builds the extension (``pip install`` with setup.py's
    optional Extension): without it every new row takes the slower Python path, silently."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler here: the Python path is the only one")
    assert C_ADD is not None, "shmcancel.shm._cwrite was not built (see the pip install log)"


@pytest.mark.parametrize(("value", "pure"), [("1", True), ("yes", True), ("0", False),
                                             ("", False), (" 0 ", False)])
def test_shmcancel_pure_python_selects_the_python_path(value: str, pure: bool) -> None:
    """``=1`` selects it; ``=0`` (or empty) does not, as the documented ``=1`` implies (``=0``
    selected it)."""
    out = subprocess.run(
        [sys.executable, "-c", "from shmcancel.shm import hashing, writer; "
         "print(writer._add_small is None, hashing.siphash is hashing.siphash_py)"],
        env={**os.environ, "SHMCANCEL_PURE_PYTHON": value}, capture_output=True, text=True,
        timeout=60, check=True)
    assert out.stdout.split() == [str(pure), str(pure)]
    assert hashing.siphash is not hashing.siphash_py  # and here, the C one


# SipHash-2-4 under the key 00..0f of the message 00..(n-1): the reference vectors (n = 0 and 15
# are the paper's; all were computed by an independent implementation, the siphashc package)
SIP_VECTORS = {0: 0x726FDB47DD0E0E31, 1: 0x74F839C593DC67FD, 7: 0xAB0200F58B01D137,
               8: 0x93F5F5799A932462, 15: 0xA129CA6149BE45E5, 16: 0x3F2ACC7F57C29BDB,
               63: 0x958A324CEB064572}


@pytest.mark.parametrize("fn", [hashing.siphash, hashing.siphash_py], ids=["c", "python"])
def test_siphash_gives_the_reference_answers(fn: Any) -> None:
    for n, want in SIP_VECTORS.items():
        assert fn(bytes(range(16)), bytes(range(n))) == want, n


@settings(max_examples=300, deadline=None)
@given(key=st.binary(min_size=16, max_size=16), data=st.binary(max_size=300))
def test_siphash_in_c_is_siphash_in_python(key: bytes, data: bytes) -> None:
    want = hashing.siphash_py(key, data)
    assert hashing.siphash(key, data) == want
    assert hashing.siphash(bytearray(key), memoryview(data)) == want  # the buffer path
    assert 0 <= want < 2**64


@pytest.mark.parametrize("fn", [hashing.siphash, hashing.siphash_py], ids=["c", "python"])
def test_siphash_refuses_bad_arguments(fn: Any) -> None:
    for key in (b"k" * 15, b"k" * 17, b""):
        with pytest.raises(ValueError, match="16 bytes"):
            fn(key, b"data")
    for data in ("text", None, 5):
        with pytest.raises(TypeError):
            fn(b"k" * 16, data)
    with pytest.raises(BufferError):  # as the C one's buffer protocol refuses it
        fn(b"k" * 16, memoryview(b"abcdef")[::2])
    grid = memoryview(bytearray(6)).cast("B", shape=[2, 3])  # two dimensions, C order: taken
    assert fn(b"k" * 16, grid) == hashing.siphash_py(b"k" * 16, bytes(6))


def test_processes_hashing_in_c_and_in_python_share_a_registry(shm_name: str) -> None:
    """A process without the C part (``SHMCANCEL_PURE_PYTHON``, as one where it was not built)
    finds the rows a process with it wrote, and the other way round: the same hash, so the
    same homes."""
    from shmcancel import Cancellation, Config, Registry

    reg = Registry.create(shm_name, Config(capacity=400, max_rows=200, in_flight_capacity=64,
                                           session_capacity=16))
    try:
        c = Cancellation(reg)
        for i in range(20):
            c.cancel(f"from-c-{i}", None, "ip:192.0.2.1")
        code = (
            "import sys\n"
            "from shmcancel import Cancellation, Registry\n"
            "from shmcancel.shm import hashing\n"
            "assert hashing.siphash is hashing.siphash_py\n"
            "reg = Registry.attach(sys.argv[1])\n"
            "c = Cancellation(reg)\n"
            "found = sum(c.cancelled(f'from-c-{i}', 'ip:192.0.2.1') for i in range(20))\n"
            "for i in range(20):\n"
            "    c.cancel(f'from-py-{i}', None, 'ip:192.0.2.1')\n"
            "reg.close()\n"
            "print(found)\n")
        out = subprocess.run([sys.executable, "-c", code, shm_name], capture_output=True,
                             text=True, timeout=60,
                             env={**os.environ, "SHMCANCEL_PURE_PYTHON": "1"})
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "20"
        assert all(c.cancelled(f"from-py-{i}", "ip:192.0.2.1") for i in range(20))
        assert reg.check() == {}  # every row's hash checks out: nothing to repair
    finally:
        reg.close()
        reg.unlink()


def _apply(t: Table, op: str, key: Any, value: Any, c_add: Any,
           c_delete: Any = None) -> object:
    """``op`` on ``t`` with ``writer._add_small`` set to ``c_add`` and ``writer._delete_small``
    to ``c_delete``; what it returned or raised (its type)."""
    saved = writer._add_small, writer._delete_small
    writer._add_small, writer._delete_small = c_add, c_delete
    try:
        with t._lock:
            if op == "add":
                if t.member(key):
                    return "member"
                t.add_held(t.prepare(key), value)
                return "added"
            if op == "delete":
                return t.delete(key)
            if op == "receipt":  # a bag's add: its receipt (record, stamp)
                return t.add(key, value) if t.kind == "bag" else "a set"
            t.insert(key, value)
            return "inserted"
    except Exception as e:  # TableFull, RowTooLarge: the same in both
        return type(e)
    finally:
        writer._add_small, writer._delete_small = saved


def _twins(rig_factory: Any) -> tuple[Table, Table, Rig]:
    rig = rig_factory([SPEC, SPEC])
    return rig.tables[0], rig.tables[1], rig


@pytest.mark.skipif(C_ADD is None or C_DELETE is None, reason="the C path is not built")
@pytest.mark.parametrize("kind", ["set", "bag"])
def test_c_and_python_write_the_same_bytes(rig_factory: Any, kind: str) -> None:
    """A cancellation's new row (``add_held``), a new key's ``insert``, a bag's ``add``
    (which answers a receipt) and a ``delete`` take the C paths where they can."""
    spec = (kind, *SPEC[1:])
    rig = rig_factory([spec, spec])
    written = [0, 0]  # rows the C path wrote, declined
    deleted = [0, 0]  # deletes of a row or more by the C path, declined

    def c_add(*args: Any) -> int:
        r = C_ADD(*args)
        written[r < 0] += 1
        return r

    def c_delete(*args: Any) -> int:
        n = C_DELETE(*args)
        if n:
            deleted[n < 0] += 1
        return n

    @settings(max_examples=300, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(ops=OPS)
    def run(ops: list[Any]) -> None:
        a, b = rig.reset(0), rig.reset(1)
        for op, key, value in ops:
            got_c = _apply(a, op, key, value, c_add, c_delete)
            got_py = _apply(b, op, key, value, None)
            assert got_c == got_py, (op, key, value)
            assert bytes(a._buf) == bytes(b._buf), (op, key, value)
        healthy(a)
        assert sorted(a.scan(), key=repr) == sorted(b.scan(), key=repr)

    run()
    assert written[0] > 100 and written[1] > 10, written  # both ways were taken, often
    assert deleted[0] > 10 and deleted[1] > 3, deleted


@pytest.mark.skipif(C_ADD is None or C_DELETE is None, reason="the C path is not built")
@pytest.mark.parametrize("kind", ["set", "bag"])
def test_c_and_python_delete_the_same_way_across_buckets(rig_factory: Any, kind: str) -> None:
    """Long clusters (keys sharing a few homes, the last home slot among them: the probe wraps
    around the index end) whose backward shifts cross buckets: 3000 seeded inserts and deletes
    on twin tables of 128 slots (8 buckets) leave byte-identical regions after each."""
    spec = (kind, 60, 160, 48, 3)
    rig = rig_factory([spec, spec])
    a, b = rig.reset(0), rig.reset(1)
    assert a.nslots >= 128
    homes = [15, 16, 31, a.nslots - 1]
    keys = [k for h in homes for k in same_home_keys(a, 8, home=h)]
    rng = random.Random(51)
    shifted = 0  # C deletes that moved an entry back across a bucket boundary
    deleted = [0, 0]  # deletes of a row or more by the C path, declined

    def c_delete(*args: Any) -> int:
        n = C_DELETE(*args)
        if n:
            deleted[n < 0] += 1
        return n

    for _ in range(3000):
        key = rng.choice(keys)
        op = rng.choice(["insert", "insert", "delete"])
        value = rng.choice([1, "ab", "z" * 60])  # some large
        before = [a._idx[i] for i in range(0, 2 * a.nslots, 2)]
        got = [_apply(t, op, key, value, C_ADD, c_delete if t is a else None) for t in (a, b)]
        assert got[0] == got[1], (op, key, value)
        assert bytes(a._buf) == bytes(b._buf), (op, key, value)
        after = [a._idx[i] for i in range(0, 2 * a.nslots, 2)]
        moved = [s for s in range(a.nslots) if after[s] and after[s] != before[s]]
        shifted += op == "delete" and any(s % 16 == 15 for s in moved)
    healthy(a)
    assert shifted > 20 and deleted[0] > 300 and deleted[1] > 30, (shifted, deleted)


@pytest.mark.skipif(C_ADD is None or C_DELETE is None, reason="the C path is not built")
def test_probes_past_the_home_slot_and_around_the_index_end(rig_factory: Any) -> None:
    """Keys sharing the last home slot: the C path probes on, wrapping to slot 0, as the
    Python path does; a full table is refused by both (TableFull), nothing stored."""
    a, b, _ = _twins(rig_factory)
    keys = same_home_keys(a, SPEC[1] + 1, home=a.nslots - 1)
    for k in keys:
        got = [_apply(t, "add", k, "v", c) for t, c in ((a, C_ADD), (b, None))]
        assert got[0] == got[1]
        assert bytes(a._buf) == bytes(b._buf)
    assert got[0] is TableFull
    assert [a._idx[2 * s] != 0 for s in (a.nslots - 1, 0, 1)] == [True] * 3
    healthy(a)
    assert sorted(k for k, _ in a.scan()) == sorted(keys[:SPEC[1]])


@pytest.mark.skipif(C_ADD is None or C_DELETE is None, reason="the C path is not built")
def test_the_c_path_stores_nothing_on_a_closed_table(rig_factory: Any) -> None:
    a, _, rig = _twins(rig_factory)
    pk = a.prepare("k")
    before = bytes(rig.region(0))
    a.close()
    with pytest.raises(ValueError):
        C_ADD(a._buf, a._geo, pk.j, pk.hash, pk.kbytes, b"\xa1v")
    assert bytes(rig.region(0)) == before


# Arguments a caller could get wrong, which both C writes check alike (_cwrite.c's call_open)
BAD_ARGUMENTS = ["geometry past the region", "odd j", "hash 0",
                 "record size times records overflows", "fewer than 16 slots"]


def _bad_arguments(t: Table, rig: Rig, pk: Any, bad: str) -> tuple[tuple[int, ...], int, int]:
    """``(geometry, j, hash)`` of a call on ``t`` for ``pk``, made ``bad`` (:data:`BAD_ARGUMENTS`;
    any other: as they are)."""
    geo, j, h = t._geo, pk.j, pk.hash
    if bad == "geometry past the region":
        geo = (geo[0] + 10**6, *geo[1:])
    elif bad == "odd j":
        j += 1
    elif bad == "hash 0":
        h = 0
    elif bad == "record size times records overflows":  # wrapped to 0: it passed the bound
        geo = (geo[0], 2**62, geo[2], 3, *geo[4:])
    elif bad == "fewer than 16 slots":  # its versions' bound was 0 bytes
        geo = (*geo[:4], len(rig.region(0)), *geo[5:7], 8)
        j = 0
    return geo, j, h


@pytest.mark.skipif(C_ADD is None or C_DELETE is None, reason="the C path is not built")
@pytest.mark.parametrize("bad", [*BAD_ARGUMENTS, "payload too large"])
def test_the_c_path_declines_what_it_cannot_check(rig_factory: Any, bad: str) -> None:
    """Arguments a caller could get wrong (the Python path checks or repairs each): -1, and
    not one byte of the region stored."""
    a, _, rig = _twins(rig_factory)
    pk = a.prepare("k")
    geo, j, h = _bad_arguments(a, rig, pk, bad)
    vb = b"x" * 200 if bad == "payload too large" else b"\xa1v"
    before = bytes(rig.region(0))
    assert C_ADD(a._buf, geo, j, h, pk.kbytes, vb) == -1
    assert bytes(rig.region(0)) == before


C_STORES = 12  # the stores of add_small's write, in order (see _cwrite.c)


def _killed_after_each_store(rig: Rig, fresh: Any, stores: int, write: Any,
                             before: list[Any], after: list[Any]) -> list[bool]:
    """For every n up to ``stores``: on ``fresh()``'s table a forked child, holding the lock,
    runs ``write(t, n)`` (a C write making only its first n stores) and SIGKILLs itself; the
    parent takes the dead holder's unit over, repairs (fsck) and requires exactly the rows
    ``before`` or ``after``, a clean second fsck and every record usable (the table fills to
    its capacity, no more). Whether each n ended with the rows ``after``."""
    outcome = []
    for n in range(stores + 1):
        t = fresh()

        def write_then_die(t: Table = t, n: int = n) -> None:
            with t._lock:
                write(t, n)
                os.kill(os.getpid(), signal.SIGKILL)

        killed_holding(rig, write_then_die)
        with rig.lock:
            t.fsck()
            got = sorted(t.scan(), key=repr)
            assert got in (before, after), f"killed after store {n}: {got}"
            outcome.append(got == after)
            healthy(t)
            fills_to_capacity(t)  # no record leaked
            healthy(t)
    return outcome


@pytest.mark.skipif(C_ADD is None or C_DELETE is None, reason="the C path is not built")
@pytest.mark.parametrize("home", ["free", "taken"])
def test_a_writer_killed_after_any_store_of_the_c_path_is_repaired(rig_factory: Any,
                                                                   home: str) -> None:
    """For every n: fork; the child, holding the lock, makes only the first n stores of a new
    row's C write and SIGKILLs itself (a writer killed right there); the parent takes the dead
    holder's unit over and repairs (fsck), and requires exactly the rows before or after the
    write, a clean second fsck, and every record usable (the table fills to its capacity, no
    more). Catches a store order fsck cannot repair (the slot published before its record)."""
    rig = rig_factory([SPEC])
    t = rig.reset(0)
    first, new = same_home_keys(t, 2) if home == "taken" else ("k0", "k1")

    def fresh() -> Table:
        t = rig.reset(0)
        t.insert(first, 1)
        t.insert("other", "x")
        return t

    before = sorted(fresh().scan(), key=repr)
    after = sorted([*before, (new, "v")], key=repr)
    outcome = _killed_after_each_store(
        rig, fresh, C_STORES,
        lambda t, n: C_ADD(t._buf, t._geo, (pk := t.prepare(new)).j, pk.hash, pk.kbytes,
                           b"\xa1v", n),
        before, after)
    # the row is in from its slot's hash store on (the store that publishes it)
    assert outcome == [False] * 10 + [True] * 3, outcome


@pytest.mark.skipif(C_ADD is None or C_DELETE is None, reason="the C path is not built")
@pytest.mark.parametrize("where, value", [
    ("stamp", 2**64 - 1), ("stamp", 2**62 - 1), ("stamp", 2**62 - 2),
    ("version", 2**64 - 1), ("version", 2**64 - 2), ("version", 2**63)])
def test_garbage_counters_take_the_same_course_on_both_paths(rig_factory: Any, where: str,
                                                            value: int) -> None:
    """A stamp counter or a bucket version at the edge of its range (what a crashed writer or a
    hostile user with the segment's file leaves): the C path declines where the Python path
    repairs (a stamp counter past its bound: it wrapped to 0 and reused stamps of rows in the
    table), and a version wraps at 2**64 on both (the Python path raised ValueError part-way
    through a write, and so did the fsck that was to repair it)."""
    a, b, _ = _twins(rig_factory)
    for t in (a, b):
        t.insert("other", 1)
        if where == "stamp":
            t._hq[5] = value
        else:
            t._ver[t.prepare("k").b] = value
    got = [_apply(t, "add", "k", "v", c) for t, c in ((a, C_ADD), (b, None))]
    assert got == ["added", "added"]
    assert bytes(a._buf) == bytes(b._buf)
    for t in (a, b):
        with t._lock:
            t.fsck()
        healthy(t)
        assert sorted(t.scan(), key=repr) == [("k", "v"), ("other", 1)]
        assert t.delete("k") == 1 and t.lookup("k") == []
        assert max(s for *_, s, _ in (t._record(r) or (0, 0, 0, 0) for r in range(8))) < 2**62
    assert bytes(a._buf) == bytes(b._buf)


@pytest.mark.skipif(C_ADD is None or C_DELETE is None, reason="the C path is not built")
@pytest.mark.parametrize("which", ["first", "last"])
def test_a_writer_killed_after_any_store_of_the_c_delete_is_repaired(rig_factory: Any,
                                                                     which: str) -> None:
    """A delete whose backward shift moves three entries back, one across a bucket boundary
    (``first``), or none (``last``): for every n, a child holding the lock makes only the
    first n stores of the C delete and SIGKILLs itself; the parent takes the unit over and
    repairs (fsck), and requires exactly the rows before or after the delete (after, from some
    store on), a clean second fsck and every record usable (the table fills to capacity)."""
    rig = rig_factory([("set", 60, 160, 48, 3)])
    t = rig.reset(0)
    keys = same_home_keys(t, 4, home=14)  # slots 14, 15 | 16, 17: buckets 0 and 1
    gone = keys[0] if which == "first" else keys[-1]

    def fresh() -> Table:
        t = rig.reset(0)
        for i, k in enumerate(keys):
            t.insert(k, i)
        t.insert("other", "x")
        return t

    stores = None
    for n in range(200):  # how many stores the delete makes: the first n that completes it
        t = fresh()
        pk = t.prepare(gone)
        with t._lock:
            if C_DELETE(t._buf, t._geo, pk.j, pk.hash, pk.kbytes, n) == 1:
                stores = n
                break
    assert stores is not None and stores >= (14 if which == "first" else 7), stores
    before = sorted(fresh().scan(), key=repr)
    after = sorted([r for r in before if r[0] != gone], key=repr)
    outcome = _killed_after_each_store(
        rig, fresh, stores,
        lambda t, n: C_DELETE(t._buf, t._geo, (pk := t.prepare(gone)).j, pk.hash, pk.kbytes, n),
        before, after)
    assert outcome[0] is False and outcome[-1] is True, outcome
    assert outcome == sorted(outcome), outcome  # once gone, gone


@pytest.mark.skipif(C_ADD is None or C_DELETE is None, reason="the C path is not built")
@pytest.mark.parametrize("case", ["a large row", "a record failing validation",
                                  "no empty slot", *BAD_ARGUMENTS])
def test_the_c_delete_declines_what_the_python_path_handles(rig_factory: Any,
                                                            case: str) -> None:
    """-1 and not one byte stored; then the Python path takes the delete as before (a large
    row removed; a corrupt record or a full probe: TableCorrupted, which the write repairs)."""
    a, _, rig = _twins(rig_factory)
    a.insert("other", 1)
    a.insert("k", "z" * 60 if case == "a large row" else "v")
    pk = a.prepare("k")
    geo, j, h = _bad_arguments(a, rig, pk, case)
    if case == "a record failing validation":
        r = a._idx[a._find(pk)[0][0] * 2 + 1]
        a._buf[a._heap + r * a.small_size + 24] ^= 1  # a byte of its key: the crc fails
    elif case == "no empty slot":
        for s in range(a.nslots):
            if not a._idx[2 * s]:
                a._idx[2 * s] = 1 << 40 | s  # a hash whose home is s
    before = bytes(rig.region(0))
    with a._lock:
        assert C_DELETE(a._buf, geo, j, h, pk.kbytes) == -1
    assert bytes(rig.region(0)) == before
    if case == "a large row":
        assert a.delete("k") == 1 and a.lookup("k") == []
        healthy(a)


@pytest.mark.skipif(C_ADD is None or C_DELETE is None, reason="the C path is not built")
@pytest.mark.parametrize("nslots", [16, 128])
def test_a_delete_whose_index_changes_under_it_stops_and_is_repaired(rig_factory: Any,
                                                                     nslots: int) -> None:
    """Another process writes the slot a delete's probe found empty before the backward shift
    reaches it (a hostile user with the segment's file, or a bug). The shift ran on past it
    without a bound: on a full small index it never ended (the lock held), on a large one it
    marked more buckets than its array holds (a crash). Now it stops at that slot, leaving what
    a killed writer leaves; the delete raises TableCorrupted at once, and the write's repair
    restores a sound table."""
    cap = 7 if nslots == 16 else 60
    rig = rig_factory([("set", cap, 160, 48, 3)])
    t = rig.reset(0)
    assert t.nslots == nslots
    keys = same_home_keys(t, cap, home=3)  # one cluster from slot 3 on
    for i, k in enumerate(keys):
        t.insert(k, i)
    empty = (3 + cap) % nslots  # the slot that ends the cluster's probe
    assert not t._idx[2 * empty] and t._idx[2 * (empty - 1)]
    pk = t.prepare(keys[0])
    with t._lock:
        got = C_DELETE(t._buf, t._geo, pk.j, pk.hash, pk.kbytes, -1, 2 * empty, pk.hash)
        assert got == -3
        assert any(v % 2 for v in t._ver), "stopped mid-shift: a version left odd"
        t.fsck()
    healthy(t)
    assert sorted(k for k, _ in t.scan()) in (sorted(keys[1:]), sorted(keys))
    # through the table: the index changed under the delete, TableCorrupted, repaired (fsck)
    t = rig.reset(0)
    for i, k in enumerate(keys):
        t.insert(k, i)
    saved = writer._delete_small
    writer._delete_small = lambda *a: C_DELETE(*a, -1, 2 * empty, pk.hash) \
        if a[3] == pk.hash else C_DELETE(*a)
    try:
        with pytest.raises(TableCorrupted, match="the index changed under a delete"), t._lock:
            t._delete(t.prepare(keys[0]))
    finally:
        writer._delete_small = saved
    with t._lock:
        t.fsck()
    healthy(t)
    fills_to_capacity(t)
