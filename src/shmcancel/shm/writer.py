"""Writes to a table, under the registry lock: ``insert``, ``insert_new``, ``delete``,
``delete_object``; publishing a record, the backward-shift delete, the free stack.

Invariants a writer (holding the registry lock) keeps, so that a writer killed at any bytecode
leaves a table ``fsck`` restores:

- a record is written only while it is unreferenced (taken from the free stack), and the index
  references it only once it is complete; a referenced record is never written;
- a new row is published by writing the slot's record number, then its hash (the hash makes the
  slot non-empty); a set update swaps the record number (one store) and frees the old record after;
- every bucket whose slots a writer touches is made odd before the first store and even after the
  last (a backward shift marks every bucket it moves slots in); a record is freed only after the
  index stopped referencing it, so its reuse is covered by the version bump that unreferenced it;
- ``lock.dirty`` is True from just before the first store to just after the last.

Corruption met under the lock (see ``base.py``) is repaired with ``fsck``, logged once (per
process and table) and the operation retried once; still corrupt, it raises ``TableCorrupted``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from ..exceptions import TableFull
from .base import PreparedKey, TableCorrupted, _crc32
from .fsck import Fsck
from .layout import _M32, _ROWS, _SEED, _STAMP, _STAMP_MAX, _TOP, _pack

_T = TypeVar("_T")


class Writes(Fsck):
    """The locked writes of :class:`~shmcancel.shm.table.Table`."""

    def _write_record(self, kbytes: bytes, vbytes: bytes) -> int:
        """Fill the record on top of the free stack (it is unreferenced), then pop it."""
        hq = self._hq
        top = hq[_TOP]
        r = self._free[top - 1] if 0 < top <= self.capacity + 1 else self.capacity + 1
        if r > self.capacity:  # the free stack is damaged: rebuild it and retry
            self._repair(f"table {self.name!r}: free-stack top {top} or record {r} out of range")
            self._lock.dirty = True  # the caller's write goes on
            top = hq[_TOP]
            if top == 0:
                raise TableFull(f"table {self.name!r} has no free record")
            r = self._free[top - 1]
        stamp = hq[_STAMP] + 1
        if stamp >= _STAMP_MAX:  # checked before the first store
            raise TableCorrupted(f"table {self.name!r}: stamp counter {stamp - 1} is garbage")
        hq[_STAMP] = stamp
        kl = len(kbytes)
        vl = len(vbytes)
        body = kbytes + vbytes
        self._rs.pack_into(self._buf, self._heap + r * self.record_size,
                           _crc32(body, (stamp ^ kl << 16 ^ vl ^ _SEED) & _M32),
                           kl, vl, 0, stamp, body)
        hq[_TOP] = top - 1
        return r

    def _free_record(self, r: int) -> None:
        hq = self._hq
        top = hq[_TOP]
        if top <= self.capacity:  # else the stack is damaged; fsck rebuilds it
            self._free[top] = r
            hq[_TOP] = top + 1

    def _publish(self, pk: PreparedKey, r: int) -> None:
        """Put record ``r`` in the first empty slot of ``pk``'s probe: record number, then
        hash (the store that makes the row visible)."""
        idx = self._idx
        ver = self._ver
        j = pk.j
        for _ in range(self.nslots):
            if not idx[j]:
                break
            j = (j + 2) & self._wmask
        else:  # before any store: fsck returns the popped record to the free stack
            raise TableCorrupted(f"table {self.name!r}: a probe met no empty slot")
        b = j >> 5
        ver[b] += 1
        idx[j + 1] = r
        idx[j] = pk.hash
        ver[b] += 1
        self._hq[_ROWS] += 1

    def _delete_slot(self, s: int) -> None:
        """Remove the entry in slot ``s`` by backward shift, then free its record."""
        idx = self._idx
        ver = self._ver
        mask = self._mask
        r = idx[2 * s + 1]
        marked = [s >> 4]
        ver[s >> 4] += 1
        i = j = s
        for _ in range(self.nslots):
            j = (j + 1) & mask
            hj = idx[2 * j]
            if not hj:
                break
            k = hj & mask
            # the entry at j stays if its home lies cyclically in (i, j]
            if (i < k <= j) if i <= j else (i < k or k <= j):
                continue
            bj = j >> 4
            if bj not in marked:
                ver[bj] += 1
                marked.append(bj)
            idx[2 * i + 1] = idx[2 * j + 1]  # a half-copied slot fails fsck's hash check
            idx[2 * i] = hj  # now a duplicate of slot j: fsck keeps one
            i = j
        else:  # mid-shift, marked buckets odd: the state of a killed writer, which fsck repairs
            raise TableCorrupted(f"table {self.name!r}: a backward shift met no empty slot")
        idx[2 * i] = 0
        idx[2 * i + 1] = 0
        for b in marked:
            ver[b] += 1
        hq = self._hq
        rows = hq[_ROWS]
        if rows:  # else the counter is garbage (check() recounts it); never store -1
            hq[_ROWS] = rows - 1
        self._free_record(r)

    def _locate(self, h: int, r: int) -> int:
        """The slot holding (hash ``h``, record ``r``), or -1; the caller holds the lock."""
        idx = self._idx
        j = 2 * (h & self._mask)
        for _ in range(self.nslots):
            sh = idx[j]
            if not sh:
                return -1
            if sh == h and idx[j + 1] == r:
                return j >> 1
            j = (j + 2) & self._wmask
        return -1

    def insert(self, key: Any, value: Any) -> None:
        """Set: insert or replace ``key``'s row. Bag: add the object unless an identical one is
        there. Raises RowTooLarge (before taking the lock or writing) or TableFull (or
        TableCorrupted: see the module docstring)."""
        if key.__class__ is not PreparedKey or key.t is not self:
            key = self.prepare(key)
        vb = _pack(value)
        if len(key.kbytes) + len(vb) > self._payload:
            self._check_size(key.kbytes, vb)
        return self._write(self._insert, key, vb)

    def _write(self, op: Callable[..., _T], *args: Any) -> _T:
        """``op(*args)`` under the lock; corruption it meets is repaired (fsck) and ``op`` tried
        once more, whose :class:`TableCorrupted` then propagates."""
        with self._lock:
            try:
                return op(*args)
            except TableCorrupted as e:
                self._repair(str(e))
            return op(*args)

    def _insert(self, key: PreparedKey, vb: bytes) -> None:
        lock = self._lock
        found = self._find(key)
        if found and self._set:
            s, old, _, oldvb = found[0]
            if oldvb == vb:
                return
            lock.dirty = True
            new = self._write_record(key.kbytes, vb)
            b = s >> 4
            ver = self._ver
            ver[b] += 1
            self._idx[2 * s + 1] = new  # the commit: one aligned store
            ver[b] += 1
            self._free_record(old)
            lock.dirty = False
            return
        for e in found:
            if e[3] == vb:
                return
        if self._hq[_ROWS] >= self.capacity:
            self._full()
        lock.dirty = True
        self._publish(key, self._write_record(key.kbytes, vb))
        lock.dirty = False

    def _full(self) -> None:
        """The row counter says full: raise TableFull, unless the counters are implausible
        (garbage): then recount them (fsck) and return if that made room. O(1) when they are
        plausible; the caller holds the lock."""
        hq = self._hq
        rows = hq[_ROWS]
        if rows > self.capacity or rows + hq[_TOP] != self.capacity + 1:
            self._repair(f"table {self.name!r}: row count {rows} and free-stack top {hq[_TOP]} "
                         f"do not add up to {self.capacity + 1} records")
            if hq[_ROWS] < self.capacity:
                return
        raise TableFull(f"table {self.name!r} is full ({self.capacity} rows)")

    def insert_new(self, key: Any, value: Any) -> bool:
        """Insert only if ``key`` has no row; False (nothing written) if it has one."""
        if key.__class__ is not PreparedKey or key.t is not self:
            key = self.prepare(key)
        vb = _pack(value)
        self._check_size(key.kbytes, vb)
        return self._write(self._insert_new, key, vb)

    def _insert_new(self, key: PreparedKey, vb: bytes) -> bool:
        lock = self._lock
        if self._find(key):
            return False
        if self._hq[_ROWS] >= self.capacity:
            self._full()
        lock.dirty = True
        self._publish(key, self._write_record(key.kbytes, vb))
        lock.dirty = False
        return True

    def delete(self, key: Any) -> int:
        """Remove every row of ``key``; returns how many."""
        if key.__class__ is not PreparedKey or key.t is not self:
            key = self.prepare(key)
        return self._write(self._delete, key)

    def _delete(self, key: PreparedKey) -> int:
        lock = self._lock
        found = self._find(key)
        if found:
            lock.dirty = True
            # from the far end: a backward shift moves only entries after the hole, never
            # the ones found before it (the cluster cannot wrap: load <= 50 %)
            for s, _, _, _ in reversed(found):
                self._delete_slot(s)
            lock.dirty = False
        return len(found)

    def delete_object(self, key: Any, value: Any) -> bool:
        """Remove exactly one row equal to (key, value); False if there is none."""
        if key.__class__ is not PreparedKey or key.t is not self:
            key = self.prepare(key)
        vb = _pack(value)
        return self._write(self._delete_object, key, vb)

    def _delete_object(self, key: PreparedKey, vb: bytes) -> bool:
        lock = self._lock
        for s, _, _, v in self._find(key):
            if v == vb:
                lock.dirty = True
                self._delete_slot(s)
                lock.dirty = False
                return True
        return False
