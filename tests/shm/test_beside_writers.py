"""Sweeps and checks of a table while another process writes it as fast as it can (a real
forked writer over a real shared-memory segment): they must neither stall on it (a plan that
never finds the whole index unchanged, a check that sees the writer mid-operation and goes
under the lock for an O(rows) read) nor lose or corrupt a row of either."""

from __future__ import annotations

import json
import mmap
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgpack
from helpers.procs import child, fork, reap, recv, wait_exit
from helpers.table_rig import Rig, healthy, same_home_keys

from shmcancel.shm.registry import Registry
from shmcancel.shm.table import Table


@contextmanager
def writer_beside(rig: Rig, t: Table) -> Iterator[Any]:
    """A forked process inserts and deletes its own rows ``w0`` .. ``w299`` of ``t`` as fast
    as it can; yields ``writes()``, its count so far. On exit it stops and the table's rows of
    it are checked against the model it sends back."""
    shared = mmap.mmap(-1, 16)  # the writer's count, then the stop flag

    def writer(out: int) -> None:
        rig.lock.after_fork_child()
        model: dict[str, int] = {}
        n = 0
        while not shared[8]:
            k = f"w{n % 300}"
            t.insert(k, n)
            model[k] = n
            k = f"w{(n + 150) % 300}"
            t.delete(k)
            model.pop(k, None)
            n += 1
            shared[:8] = n.to_bytes(8, "little")
        os.write(out, json.dumps(model).encode())

    def writes() -> int:
        return int.from_bytes(shared[:8], "little")

    pid, r = child(writer)
    try:
        deadline = time.monotonic() + 10
        while writes() < 1000:
            assert time.monotonic() < deadline, "the writer did not start"
        yield writes
        shared[8] = 1
        model = json.loads(recv(r, 30))
        assert wait_exit(pid, 10) == 0
        pid = -1
        assert {k: v for k, v in t.scan() if str(k).startswith("w")} == model
    finally:
        if pid > 0:
            reap(pid)
        os.close(r)
        shared.close()


def test_bulk_deletes_go_through_while_another_process_writes(shm_name: str) -> None:
    """A rewrite planned from the whole index would never find it unchanged beside this
    writer (~100 000 writes a second); planned per window and stored if the buckets it touches
    did not move, most of 3 000 rows still go in bulk, the rest row by row. The doomed rows
    are gone, the writer's are what it says, the table is sound. (A sweep the writer did not
    write 100 times through, on a loaded machine, is made again.)"""
    rig = Rig(shm_name, [("set", 4096, 64)])
    t = rig.tables[0]
    try:
        with writer_beside(rig, t) as writes:
            for _ in range(10):
                for k in range(3000):
                    t.insert(f"d{k}", k)
                rows = [row for row in t.sweep_rows() if row[2][1:2] == b"d"]
                assert len(rows) == 3000
                before = writes()
                got = t._bulk_delete(rows)
                during = writes() - before
                assert got is not None
                deleted, leftover, _ = got
                assert t.sweep_delete(leftover) == len(leftover)
                if during > 100:
                    break
            assert during > 100, f"the writer made only {during} writes during the sweep"
            assert len(deleted) > len(rows) // 2, (len(deleted), len(leftover), during)
        assert not any(str(k).startswith("d") for k, _ in t.scan())
        healthy(t)
    finally:
        rig.close()


def test_a_check_beside_a_writer_reads_no_index_under_the_lock(shm_name: str) -> None:
    """A healthy table checked (deep) while the writer runs: the lock-free look catches the
    writer mid-operation (counters that do not add up, a record reused), so the check looks
    again at a copy taken in a short hold, and goes under the lock for its O(rows) read only
    to confirm what the copy shows wrong: here, (almost) never. Nothing is repaired. Checks
    run until 20 of them caught the writer so (all 20 read under the lock before)."""
    rig = Rig(shm_name, [("set", 4096, 64)])
    t = rig.tables[0]
    locked: list[bool] = []
    caught: list[bool] = []  # checks whose lock-free look found the writer mid-operation
    real = t._implausible

    def counted(locked_: bool, deep: bool, *a: Any) -> str | None:
        got = real(locked_, deep, *a)
        if locked_:
            locked.append(True)
        elif not a and got is not None:  # a lock-free look at the table itself
            caught.append(True)
        return got

    t._implausible = counted  # type: ignore[method-assign]
    try:
        for k in range(3000):
            t.insert(f"d{k}", k)
        with writer_beside(rig, t):
            deadline = time.monotonic() + 60
            while len(caught) < 20:
                assert time.monotonic() < deadline, f"{len(caught)} checks caught the writer"
                assert t.check(deep=True) is None
        assert len(locked) <= 2, f"{len(locked)} of {len(caught)} checks read under the lock"
        assert rig.lock.repairs == 0
        healthy(t)
    finally:
        rig.close()


def _writes_after_the_snapshot(rig: Rig, t: Table, write: Any) -> None:
    """Make ``t.check`` run ``write()`` in a forked process right after its snapshot hold,
    before it looks at the snapshot (as a writer running at that moment would)."""
    real = t._implausible

    def hooked(locked: bool, deep: bool, snap: Any = None, suspects: Any = None) -> Any:
        if snap is not None:
            def writer(out: int) -> None:
                rig.lock.after_fork_child()
                write()
                os.write(out, b"ok")

            pid, r = child(writer)
            try:
                assert recv(r, 30) == b"ok"
                assert wait_exit(pid, 10) == 0
            finally:
                os.close(r)
        return real(locked, deep, snap, suspects)

    t._implausible = hooked  # type: ignore[method-assign]


def test_a_duplicate_key_is_repaired_while_a_writer_updates_it(shm_name: str) -> None:
    """A set key with two valid rows (counters that add up). Right after the check's snapshot
    another process updates the key (its first row gets a new record) and inserts another key
    (which takes the freed record): the first row's record read from the snapshot is now the
    other key's. Telling keys apart by records read later hid the duplicate; by the snapshot's
    hashes, the check goes under the lock and repairs it."""
    rig = Rig(shm_name, [("set", 256, 64)])
    t = rig.tables[0]
    try:
        for k in range(100):
            t.insert(f"d{k}", k)
        t.insert("K", "first")
        with rig.lock:  # corruption: a second row of K
            t._append(t.prepare("K"), msgpack.packb("second"))
        _writes_after_the_snapshot(rig, t, lambda: (t.insert("K", "updated"),
                                                    t.insert("L", "other")))
        rep = t.check(deep=True)
        assert rep is not None and rep["stale_rows"] == 1, rep
        assert t.lookup("K") == ["updated"] and t.lookup("L") == ["other"]
        healthy(t)
    finally:
        rig.close()


def test_a_corrupt_record_is_repaired_when_a_delete_shifts_its_entry(shm_name: str) -> None:
    """A record with garbage over it (its crc fails) whose entry a delete of the key before it
    in the same cluster shifts back one slot, right after the check's snapshot: the entry is
    still in the index, in another slot, so the check repairs it."""
    rig = Rig(shm_name, [("set", 256, 64)])
    t = rig.tables[0]
    try:
        for k in range(50):
            t.insert(f"d{k}", k)
        a, b, c = same_home_keys(t, 3)
        for k in (a, b, c):
            t.insert(k, k)
        (_, rec, *_), = t._find(t.prepare(c))
        t._buf[t._offset(rec) + t.RECORD_HEADER] ^= 0xFF
        _writes_after_the_snapshot(rig, t, lambda: t.delete(b))
        rep = t.check(deep=True)
        assert rep is not None and rep["bad_entries"] == 1, rep
        assert t.lookup(a) == [a] and t.lookup(b) == [] and t.lookup(c) == []
        healthy(t)
    finally:
        rig.close()


def test_a_readonly_unreadable_beside_writers_reports_corruption_only(shm_name: str) -> None:
    """A read-only attachment (``shmtool dump``/``stats``) takes no lock: beside two forked
    writers churning rows of a 2 000-row table, its optimistic read of the whole table rarely
    finds it unchanged, and the unsynchronised read it falls back to can meet a record freed
    and rewritten under its entry. Every entry it suspects is re-read stable before it is
    reported: a healthy table shows none (some did before), and a genuinely corrupted record
    is still reported under the same churn."""
    shared = mmap.mmap(-1, 24)  # each writer's count, then the stop flag

    def writer(w: int) -> None:
        reg = Registry.attach(shm_name)
        t = reg.table("cancellations")
        n = 0
        while not shared[16]:
            t.insert((f"w{w}", f"r{n % 200}"), ("x", float(n)))
            t.delete((f"w{w}", f"r{(n + 100) % 200}"))
            n += 1
            shared[8 * w:8 * w + 8] = n.to_bytes(8, "little")
        reg.close()

    with Registry.create(shm_name) as reg:
        pids: list[int] = []
        try:
            t = reg.table("cancellations")
            for i in range(2000):
                t.insert(("s", f"r{i}"), ("why", 1.0))
            pids = [fork(lambda w=w: writer(w)) for w in range(2)]
            deadline = time.monotonic() + 20
            while min(int.from_bytes(shared[8 * w:8 * w + 8], "little") for w in range(2)) < 1000:
                assert time.monotonic() < deadline, "the writers did not start"
            with Registry.attach(shm_name, readonly=True) as ro:
                rt = ro.table("cancellations")
                for _ in range(30):
                    assert rt.unreadable() == []
                    assert rt.stats()["unreadable"] == 0
                with reg.lock:  # the writers' records hold still only while it is held
                    slot, rec = next((s, r) for s, r, kb, _, _ in t._entries(t._idx.tolist())
                                     if msgpack.unpackb(kb) == ["s", "r5"])
                    t._buf[t._offset(rec) + t.RECORD_HEADER] ^= 0xFF
                for _ in range(10):
                    assert rt.unreadable() == [(slot, rec)]
                    assert rt.stats()["unreadable"] == 1
            shared[16] = 1
            for pid in pids:
                assert wait_exit(pid, 20) == 0
            pids = []
        finally:
            shared[16] = 1
            for pid in pids:
                reap(pid)
            shared.close()
            reg.unlink()
