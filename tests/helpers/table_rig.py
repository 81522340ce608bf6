"""``Rig`` builds tables in a real POSIX shared-memory segment with a minimal lock over a real
POSIX semaphore; it stands in for ``Registry`` where recovery does not matter. ``healthy``
checks a table's invariants; ``same_home_keys`` makes colliding keys."""

from __future__ import annotations

import mmap
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

import posix_ipc

from shmcancel.exceptions import TableFull
from shmcancel.shm.table import Table

HASH_KEY = bytes(range(32))


class SemLock:
    """The table's view of ``RegistryLock``: reentrant per thread over a real POSIX semaphore,
    with ``dirty``; a ``with`` that exits while dirty runs ``fsck`` on every table (repair)."""

    def __init__(self, name: str) -> None:
        self.sem = posix_ipc.Semaphore("/shmcancel." + name, posix_ipc.O_CREAT, 0o600, 1)
        self.dirty = False
        self.tables: list[Table] = []
        self.acquisitions = 0
        self.repairs = 0
        self._owner: int | None = None
        self._depth = 0

    def held_by_me(self) -> bool:
        return self._owner == threading.get_ident() and self._depth > 0

    def __enter__(self) -> SemLock:
        me = threading.get_ident()
        if self._owner != me:
            self.sem.acquire()
            self._owner = me
            self.acquisitions += 1
        self._depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth:
            return
        try:
            if self.dirty:
                self.repairs += 1
                for t in self.tables:
                    t.fsck()
                self.dirty = False
        finally:
            self._owner = None
            self.sem.release()

    def after_fork_child(self) -> None:
        self._owner = None
        self._depth = 0


Spec = tuple[str, int, int] | tuple[str, int, int, int, int]


def _classes(spec: Spec) -> tuple[int, int]:
    """(small_size, large_count) of a spec (0, 0: one record size)."""
    return (spec[3], spec[4]) if len(spec) == 5 else (0, 0)  # type: ignore[misc]


class Rig:
    """Tables in one real shared-memory segment: ``specs`` = [(kind, capacity, record_size)],
    or [(kind, capacity, record_size, small_size, large_count)] for two size classes."""

    def __init__(self, name: str, specs: list[Spec]) -> None:
        self.name = name
        self.specs = specs
        self.offsets = []
        off = 0
        for spec in specs:
            self.offsets.append(off)
            off += (Table.region_size(spec[1], spec[2], *_classes(spec)) + 4095) & ~4095
        self.size = off
        shm = posix_ipc.SharedMemory("/shmcancel." + name, posix_ipc.O_CREAT, 0o600, size=off)
        try:
            self.mm = mmap.mmap(shm.fd, off)
        finally:
            shm.close_fd()
        self.buf = memoryview(self.mm)
        self.lock = SemLock(name)
        for i in range(len(specs)):
            Table.format(self.region(i), specs[i][1], specs[i][2], *_classes(specs[i]))
        self.tables = [self.open(i) for i in range(len(specs))]
        self.lock.tables = self.tables

    def region(self, i: int) -> memoryview:
        spec = self.specs[i]
        size = Table.region_size(spec[1], spec[2], *_classes(spec))
        return self.buf[self.offsets[i]:self.offsets[i] + size]

    def open(self, i: int) -> Table:
        spec = self.specs[i]
        small, large = _classes(spec)
        return Table(f"t{i}", self.region(i), kind=spec[0],  # type: ignore[arg-type]
                     capacity=spec[1], record_size=spec[2], hash_key=HASH_KEY, lock=self.lock,
                     small_size=small, large_count=large)

    def reset(self, i: int) -> Table:
        """Format table ``i`` afresh and return a new Table over it."""
        self.tables[i].close()
        Table.format(self.region(i), self.specs[i][1], self.specs[i][2],
                     *_classes(self.specs[i]))
        self.tables[i] = self.open(i)
        return self.tables[i]

    def close(self) -> None:
        for t in self.tables:
            t.close()
        self.buf.release()
        self.mm.close()
        self.lock.sem.close()


def index_reachable(t: Table) -> bool:
    """No empty slot between any entry's home and the entry."""
    return words_reachable(t._idx.tolist(), t.nslots - 1)


def words_reachable(words: list[int], mask: int) -> bool:
    """:func:`index_reachable` of an index given as its u64 words (``mask``: slots - 1)."""
    for s in range(mask + 1):
        h = words[2 * s]
        if h:
            k = h & mask
            while k != s:
                if not words[2 * k]:
                    return False
                k = (k + 1) & mask
    return True


def healthy(t: Table) -> None:
    assert t.fsck() == dict.fromkeys(t.fsck(), 0)
    assert index_reachable(t)
    assert not any(v & 1 for v in t._ver.tolist())


def same_home_keys(t: Table, n: int, home: int | None = None) -> list[str]:
    """``n`` keys whose home slot is ``home`` (the first key's home when None)."""
    out: list[str] = []
    i = 0
    while len(out) < n:
        k = f"c{i}"
        i += 1
        h = t.prepare(k).home
        if home is None:
            home = h
        if h == home:
            out.append(k)
    return out


def killed_holding(rig: Rig, body: Callable[[], object]) -> None:
    """Fork a child that runs ``body()``, which ends in a SIGKILL of the child while it holds
    the rig's lock (a writer killed mid-write); wait for it, require the SIGKILL, and take the
    dead holder's unit of the semaphore over, as a recovering waiter does."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            body()
        finally:
            os._exit(7)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
    assert rig.lock.sem.value == 0  # it died holding the lock: take its unit over
    rig.lock.sem.release()


def fills_to_capacity(t: Table) -> None:
    """No small record leaked: ``t`` takes new rows up to its capacity and refuses one more
    (``TableFull``)."""
    i = 0
    while t.count() < t.capacity:
        t.insert(("fill", i), i)
        i += 1
    try:
        t.insert(("fill", "one more"), 0)
    except TableFull:
        return
    raise AssertionError(f"table {t.name!r} took a row past its capacity {t.capacity}")


def python_writes(monkeypatch: Any) -> None:
    """Every write takes the Python path, whose bytecodes a test interrupts one by one: the C
    paths (``shm/_cwrite.c``: a new small row, a key's small rows removed) run none between
    their first store and their last, so an exception or a kill lands before or after them."""
    from shmcancel.shm import writer

    monkeypatch.setattr(writer, "_add_small", None)
    monkeypatch.setattr(writer, "_delete_small", None)
