"""Writes to a table, under the registry lock: ``insert`` (``insert_held`` inside a hold,
``add_held`` for a key found without a row in it),
``insert_new``, ``set_word`` (or ``word_ref`` then ``store_word``), ``delete``,
``delete_object``, a bag's ``add``/``remove`` by receipt; publishing a record, the
backward-shift delete, the free stack.

Invariants a writer (holding the registry lock) keeps, so that a writer killed at any bytecode
leaves a table ``fsck`` restores:

- a record is written only while it is unreferenced (taken from its class's free stack), and the
  index references it only once it is complete; of a referenced record only the word is ever
  written (one aligned u32 store, outside the crc: a kill leaves the old word or the new);
- ``rows + free_top + large_top == capacity + 1 + nlarge`` whenever no writer is mid-operation,
  and a row is refused for want of a large record (``LargeRowsFull``) before any store;
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

import contextlib
from collections.abc import Callable
from functools import partial
from operator import itemgetter
from typing import Any, TypeVar

from ..exceptions import TableFull
from .base import LargeRowsFull, PreparedKey, TableCorrupted, _crc32
from .fsck import Fsck
from .hashing import PURE_PYTHON
from .layout import _LTOP, _M32, _M64, _REC, _ROWS, _SEED, _STAMP, _STAMP_MAX, _TOP, _WORD, _pack

_T = TypeVar("_T")

# The common cases in C (_cwrite.c): a new small row (_append, so add_held, and _add) and a key's
# small rows removed (_delete), unless it was not built or SHMCANCEL_PURE_PYTHON is set
# (hashing.PURE_PYTHON): then the Python path stores the same bytes
_add_small: Callable[[memoryview, tuple[int, ...], int, int, bytes, bytes], int] | None = None
_delete_small: Callable[[memoryview, tuple[int, ...], int, int, bytes], int] | None = None
if not PURE_PYTHON:
    with contextlib.suppress(ImportError):
        from ._cwrite import add_small as _add_small
        from ._cwrite import delete_small as _delete_small

_BY_RECEIPT: Any = object()  # remove() without a value: by its receipt only


def _one_word(view: memoryview, ref: int) -> tuple[int]:
    return (view[ref],)


def _bad_word(word: object) -> ValueError:
    return ValueError(f"a row's word is an int in 0..2**32-1, got {word!r}")


class Writes(Fsck):
    """The locked writes of :class:`~shmcancel.shm.table.Table`."""

    def _write_record(self, kbytes: bytes, vbytes: bytes, replacing: int = -1,
                      word: int = 0) -> int:
        """Fill the record on top of its class's free stack (it is unreferenced), then pop it;
        ``lock.dirty`` is set right before the first store. A large row needs two free large
        records (one stays the spare) unless it replaces the large record ``replacing``: else
        LargeRowsFull, raised before any store (as TableFull and TableCorrupted are)."""
        hq = self._hq
        kl = len(kbytes)
        vl = len(vbytes)
        if kl + vl <= self._spayload:  # small: records 0..capacity, stack at _free[0:]
            tw, base, n = _TOP, 0, self.capacity + 1
        else:  # large: records capacity+1 .., stack at _free[capacity+1:]
            tw, base, n = _LTOP, self.capacity + 1, self._nlarge
        top = hq[tw]
        r = self._free[base + top - 1] if 0 < top <= n else -1
        if not 0 <= r - base < n:  # the free stack is damaged: rebuild it and retry
            self._repair(f"table {self.name!r}: free-stack top {top} or record {r} out of range")
            top = hq[tw]
            if top == 0:
                raise TableFull(f"table {self.name!r} has no free record")
            r = self._free[base + top - 1]
        if base:  # a large record: the spare is for updates; its pages may be unallocated yet
            if top < (1 if replacing > self.capacity else 2):
                raise LargeRowsFull(
                    f"table {self.name!r} holds {self.large_count} rows larger than "
                    f"{self._spayload} packed bytes already (its large records)")
            if r > self._backed:
                self._back_to(r)
        stamp = hq[_STAMP] + 1
        if stamp >= _STAMP_MAX:  # checked before the first store
            raise TableCorrupted(f"table {self.name!r}: stamp counter {stamp - 1} is garbage")
        self._flags.dirty = True  # from right before the first store
        hq[_STAMP] = stamp
        body = kbytes + vbytes
        crc = _crc32(body, (stamp ^ kl << 16 ^ vl ^ _SEED) & _M32)
        if base:
            self._rs.pack_into(self._buf, self._lbase + r * self.record_size,
                               crc, kl, vl, word, stamp, body)
        else:
            self._rss.pack_into(self._buf, self._heap + r * self.small_size,
                                crc, kl, vl, word, stamp, body)
        hq[tw] = top - 1
        return r

    def _free_record(self, r: int) -> None:
        hq = self._hq
        if r <= self.capacity:
            top = hq[_TOP]
            if top <= self.capacity:  # else the stack is damaged; fsck rebuilds it
                self._free[top] = r
                hq[_TOP] = top + 1
        else:
            top = hq[_LTOP]
            if top < self._nlarge:
                self._free[self.capacity + 1 + top] = r
                hq[_LTOP] = top + 1

    def _publish(self, pk: PreparedKey, r: int) -> None:
        """Put record ``r`` in the first empty slot of ``pk``'s probe: record number, then
        hash (the store that makes the row visible)."""
        idx = self._idx
        ver = self._ver
        j = pk.j
        if idx[j]:  # the home slot is taken: the first empty one after it
            for _ in range(self.nslots):
                j = (j + 2) & self._wmask
                if not idx[j]:
                    break
            else:  # before any store: fsck returns the popped record to the free stack
                raise TableCorrupted(f"table {self.name!r}: a probe met no empty slot")
        b = j >> 5
        v = ver[b]  # read once: versions move only under the lock, which this writer holds
        ver[b] = (v + 1) & _M64
        idx[j + 1] = r
        idx[j] = pk.hash
        ver[b] = (v + 2) & _M64
        self._hq[_ROWS] += 1

    def _delete_slot(self, s: int) -> None:
        """Remove the entry in slot ``s`` by backward shift, then free its record."""
        idx = self._idx
        ver = self._ver
        mask = self._mask
        r = idx[2 * s + 1]
        marked = [s >> 4]
        ver[s >> 4] = (ver[s >> 4] + 1) & _M64
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
                ver[bj] = (ver[bj] + 1) & _M64
                marked.append(bj)
            idx[2 * i + 1] = idx[2 * j + 1]  # a half-copied slot fails fsck's hash check
            idx[2 * i] = hj  # now a duplicate of slot j: fsck keeps one
            i = j
        else:  # mid-shift, marked buckets odd: the state of a killed writer, which fsck repairs
            raise TableCorrupted(f"table {self.name!r}: a backward shift met no empty slot")
        idx[2 * i] = 0
        idx[2 * i + 1] = 0
        for b in marked:
            ver[b] = (ver[b] + 1) & _M64
        hq = self._hq
        rows = hq[_ROWS]
        if rows:  # else the counter is garbage (check() recounts it); never store -1
            hq[_ROWS] = rows - 1
        self._free_record(r)

    def insert(self, key: Any, value: Any) -> None:
        """Set: insert or replace ``key``'s row. Bag: add the object unless an identical one is
        there. Raises RowTooLarge (before taking the lock or writing) or TableFull: the table
        holds ``capacity`` rows, or (LargeRowsFull) the row needs a large record and the table
        holds its ``large_count`` large rows (or TableCorrupted: see the module docstring)."""
        return self._write(self._insert, *self._row(key, value))

    def insert_held(self, key: Any, value: Any) -> None:
        """:meth:`insert` for a caller that holds the lock already (several writes as one
        step): the same checks, the same repair of corruption it meets, without taking the lock
        again."""
        key, vb = self._row(key, value)
        try:
            return self._insert(key, vb)
        except TableCorrupted as e:
            self._repair(str(e))
        return self._insert(key, vb)

    def add_held(self, key: PreparedKey, value: Any) -> None:
        """:meth:`insert_held` of a key the caller, holding the lock since, found without a
        row (a set's new row, a bag's first): the same checks and repair, without probing for
        the key's rows again."""
        if key.__class__ is not PreparedKey or key.t is not self:  # _row, inlined: the hot path
            key = self.prepare(key)
        vb = _pack(value)
        if len(key.kbytes) + len(vb) > self._payload:
            self._check_size(key.kbytes, vb)
        try:
            self._append(key, vb)  # its common case in one C call (_cwrite.c)
            return
        except TableCorrupted as e:
            self._repair(str(e))
        return self._insert(key, vb)

    def _row(self, key: Any, value: Any) -> tuple[PreparedKey, bytes]:
        """``key`` prepared for this table and ``value`` packed; RowTooLarge (before the lock
        is taken or anything written) when the two do not fit a record. :meth:`add_held` has
        these lines inlined (the hot path): a change here goes there too."""
        if key.__class__ is not PreparedKey or key.t is not self:
            key = self.prepare(key)
        vb = _pack(value)
        if len(key.kbytes) + len(vb) > self._payload:
            self._check_size(key.kbytes, vb)
        return key, vb

    def _write(self, op: Callable[..., _T], *args: Any) -> _T:
        """``op(*args)`` under the lock; corruption it meets is repaired (fsck) and ``op`` tried
        once more, whose :class:`TableCorrupted` then propagates. On a closed table the lock
        raises :class:`~shmcancel.RegistryClosed` (and so does ``op`` when the lock was this
        thread's already, through another attachment of the registry)."""
        with self._lock:
            try:
                return op(*args)
            except TableCorrupted as e:
                self._repair(str(e))
            except Exception:
                self._if_closed()
                raise
            return op(*args)

    def _insert(self, key: PreparedKey, vb: bytes) -> None:
        lock = self._flags
        found = self._find(key)
        if found and self._set:
            s, old, _, oldvb, _, word = found[0]
            if oldvb == vb:
                return
            new = self._write_record(key.kbytes, vb, old, word)  # the word stays the row's
            b = s >> 4
            ver = self._ver
            ver[b] = (ver[b] + 1) & _M64
            self._idx[2 * s + 1] = new  # the commit: one aligned store
            ver[b] = (ver[b] + 1) & _M64
            self._free_record(old)
            lock.dirty = False
            return
        for e in found:
            if e[3] == vb:
                return
        self._append(key, vb)

    def _append(self, key: PreparedKey, vb: bytes, word: int = 0) -> int:
        """Publish the new row ``key -> vb`` (its word ``word``); its record. The caller holds
        the lock and found no row of ``key`` (a bag's: none equal to it). TableFull at
        ``capacity``. Its common case (a small row, word 0, a sound table) is one C call where
        _cwrite is built."""
        if not word and _add_small is not None:
            r = _add_small(self._buf, self._geo, key.j, key.hash, key.kbytes, vb)
            if r >= 0:
                return r  # written by the C path (it writes a word of 0); else nothing stored
        if self._hq[_ROWS] >= self.capacity:
            self._full()
        r = self._write_record(key.kbytes, vb, -1, word)
        self._publish(key, r)
        self._flags.dirty = False
        return r

    def _full(self) -> None:
        """The row counter says full: raise TableFull, unless the counters are implausible
        (garbage): then recount them (fsck) and return if that made room. O(1) when they are
        plausible; the caller holds the lock."""
        hq = self._hq
        rows = hq[_ROWS]
        if rows > self.capacity or rows + hq[_TOP] + hq[_LTOP] != self._nrec:
            self._repair(f"table {self.name!r}: row count {rows} and free-stack tops "
                         f"{hq[_TOP]}, {hq[_LTOP]} do not add up to {self._nrec} records")
            if hq[_ROWS] < self.capacity:
                return
        raise TableFull(f"table {self.name!r} is full ({self.capacity} rows)")

    def insert_new(self, key: Any, value: Any, word: int = 0) -> bool:
        """Insert only if ``key`` has no row, its word ``word`` (0 .. 2**32 - 1); False
        (nothing written) if it has one."""
        if word.__class__ is not int or not 0 <= word <= _M32:
            raise _bad_word(word)
        return self._write(self._insert_new, *self._row(key, value), word)

    def _insert_new(self, key: PreparedKey, vb: bytes, word: int = 0) -> bool:
        if self._find(key):
            return False
        self._append(key, vb, word)
        return True

    def set_word(self, key: Any, word: int) -> bool:
        """Store ``word`` (0 .. 2**32 - 1) as the word of ``key``'s row (a bag: of the first
        row of its probe) in place: one aligned u32 store into a referenced record, outside its
        crc, so a reader sees the old word or the new one, and a writer killed around it leaves
        either. No version moves (the record stays the row's). False when ``key`` has no row."""
        if word.__class__ is not int or not 0 <= word <= _M32:
            raise _bad_word(word)
        if key.__class__ is not PreparedKey or key.t is not self:
            key = self.prepare(key)
        return self._write(self._set_word, key, word)

    def _set_word(self, key: PreparedKey, word: int) -> bool:
        ref = self._word_ref(key)
        if ref < 0:
            return False
        self._u32[ref] = word
        return True

    def word_ref(self, key: Any) -> int:
        """Where the word of ``key``'s row (a bag: of the first row of its probe) lies, for
        :meth:`load_word` and :meth:`store_word`; -1 when ``key`` has no row. The reference
        is the row's only while the caller holds the lock from this call on and writes no row
        of this table meanwhile: a count read, checked and changed with one probe.

        A set's prepared key keeps the reference it found with its slot's bucket version: while
        that version has not moved, the slot still holds the same record (every change of a
        slot moves its bucket's version, and a referenced record is never rewritten but for its
        word), so the reference is returned without a probe. (A bag's is not kept: a row of
        the key published earlier in the probe would come first.)"""
        return self.word_at(key)[0]

    def _word_ref(self, key: PreparedKey) -> int:
        found = self._find(key)
        if not found:
            return -1
        ref = (self._offset(found[0][1]) + _WORD) >> 2
        if self._set:
            b = found[0][0] >> 4
            key.wref = (b, self._ver[b], ref)  # even: the caller holds the lock
        return ref

    def word_at(self, key: Any) -> tuple[int, int]:
        """:meth:`word_ref` and :meth:`load_word` in one call: ``(ref, word)``, or ``(-1, 0)``
        when ``key`` has no row (the same conditions: under the lock, valid while this hold
        writes no row of this table; a set's key keeps its reference as :meth:`word_ref`
        says)."""
        if key.__class__ is not PreparedKey or key.t is not self:
            key = self.prepare(key)
        w = key.wref
        if w is not None and self._ver[w[0]] == w[1]:
            ref = w[2]
        else:
            ref = self._write(self._word_ref, key)
            if ref < 0:
                return -1, 0
        return ref, self._u32[ref]

    def load_word(self, ref: int) -> int:
        """The word at ``ref`` (from :meth:`word_ref`, under the same lock hold)."""
        return self._u32[ref]

    def load_words(self, refs: list[int]) -> Callable[[], tuple[int, ...]]:
        """A function returning the words at ``refs`` (each from :meth:`word_ref` or an index
        copy's ``find``, valid under the same conditions) as one tuple, loaded by one C call:
        10 000 words in ~0.1 ms, a bulk check under the lock."""
        if len(refs) == 1:
            return partial(_one_word, self._u32, refs[0])
        return partial(itemgetter(*refs), self._u32)

    def load_versions(self, buckets: list[int]) -> Callable[[], tuple[int, ...]]:
        """A function returning the versions of ``buckets`` as one tuple, loaded by one C
        call (as :meth:`load_words`)."""
        if len(buckets) == 1:
            return partial(_one_word, self._ver, buckets[0])
        return partial(itemgetter(*buckets), self._ver)

    def store_word(self, ref: int, word: int) -> None:
        """:meth:`set_word` at ``ref`` (from :meth:`word_ref`, under the same lock hold): one
        aligned u32 store, no probe."""
        if word.__class__ is not int:
            raise _bad_word(word)
        try:
            self._u32[ref] = word  # the view refuses a value out of 0..2**32-1, storing nothing
        except ValueError:
            if 0 <= word <= _M32:  # not the word: the view is released (the table is closed)
                raise
            raise _bad_word(word) from None

    def delete(self, key: Any) -> int:
        """Remove every row of ``key``; returns how many."""
        if key.__class__ is not PreparedKey or key.t is not self:
            key = self.prepare(key)
        return self._write(self._delete, key)

    def _delete(self, key: PreparedKey) -> int:
        lock = self._flags
        if _delete_small is not None:  # its common case in one C call (_cwrite.c)
            n = _delete_small(self._buf, self._geo, key.j, key.hash, key.kbytes)
            if n >= 0:
                return n
            if n == -3:  # stopped mid-shift: the index changed under it (see _cwrite.c)
                lock.dirty = True
                raise TableCorrupted(f"table {self.name!r}: the index changed under a delete")
        found = self._find(key)
        if found:
            lock.dirty = True
            # from the far end: a backward shift moves only entries after the hole, never
            # the ones found before it (the cluster cannot wrap: load <= 50 %)
            for s, *_ in reversed(found):
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
        lock = self._flags
        for s, _, _, v, _, _ in self._find(key):
            if v == vb:
                lock.dirty = True
                self._delete_slot(s)
                lock.dirty = False
                return True
        return False

    # ------------------------------------------------------------ rows by receipt (bags)
    def add(self, key: Any, value: Any) -> tuple[int, int]:
        """Bag: add the row ``(key, value)`` without reading ``key``'s rows: a row equal to
        one there is one more of it (a thread's plain ``track`` rows of one key), which
        :meth:`delete_object` takes one at a time. Returns the receipt ``(record, stamp)``
        that :meth:`remove` takes. Raises as :meth:`insert`."""
        if self._set:
            raise TypeError(f"table {self.name!r} is a set: add() is for bags")
        return self._write(self._add, *self._row(key, value))

    def _add(self, key: PreparedKey, vb: bytes) -> tuple[int, int]:
        r = self._append(key, vb)
        return r, self._hq[_STAMP]  # the stamp the write gave r (the lock is held)

    def remove(self, key: Any, receipt: tuple[int, int] | None, value: Any = _BY_RECEIPT) -> bool:
        """Remove the row that :meth:`add` returned ``receipt`` for, if it is still there: a
        slot of ``key``'s probe holding that record, whose stamp is still the receipt's (stamps
        are never handed out twice, so a record reused since is another row). When it is not
        (or ``receipt`` is ``None``) and ``value`` is given, one row of ``key`` equal to
        ``value`` goes instead, in the same lock hold (as :meth:`delete_object`). False when
        nothing went."""
        if key.__class__ is not PreparedKey or key.t is not self:
            key = self.prepare(key)
        return self._write(self._remove, key, receipt, value)

    def _remove(self, key: PreparedKey, receipt: tuple[int, int] | None, value: Any) -> bool:
        if receipt is not None:
            r, stamp = receipt
            s = self._locate(key.hash, r)
            off = self._offset(r)
            if s >= 0 and off >= 0 and _REC.unpack_from(self._buf, off)[4] == stamp:
                lock = self._flags
                lock.dirty = True
                self._delete_slot(s)
                lock.dirty = False
                return True
        if value is _BY_RECEIPT:
            return False
        return self._delete_object(key, _pack(value))
