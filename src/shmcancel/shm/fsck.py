"""Checking and repairing a table: ``fsck`` (under the lock), ``check`` (plausibility of the
header counters and free stack, lock-free while all is well), the repair-and-log-once every
operation uses when it meets corruption, and ``stats`` (from one consistent index read).

The header counters obey ``rows + free_top + large_top == capacity + 1 + nlarge`` (every record
referenced once or on its class's free stack once) whenever no writer is mid-operation;
:meth:`Fsck.check` tests that and more (the janitor and ``Registry.attach`` call it) and recounts.
Each step of ``fsck`` leaves a state ``fsck`` handles: a killed ``fsck`` is finished by the next.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar

from .base import _SPIN_BEFORE_YIELD, READ_RETRIES, TableBase, _header_damage
from .layout import _CLS, _CLS_OFF, _HDR, _LTOP, _M64, _ROWS, _STAMP, _STAMP_MAX, _TOP

T = TypeVar("T")
Snapshot = tuple[tuple[int, int, int, int], bytes, bytes, bytes]

log = logging.getLogger("shmcancel.table")


class Fsck(TableBase):
    """``fsck``, ``check`` and ``stats`` of :class:`~shmcancel.shm.table.Table`."""

    def _optimistic(self, read: Callable[[list[int]], T]) -> T | None:
        """``read(index words)`` from a consistent copy of the index, lock-free: every bucket
        version even before, and all unchanged after ``read`` returns (it may read records:
        a writer bumps a bucket's version around any change to what its entries reference).
        None after ``READ_RETRIES // 4`` tries: the caller reads under the lock."""
        ver = self._ver
        for attempt in range(READ_RETRIES // 4):
            if attempt >= _SPIN_BEFORE_YIELD:
                os.sched_yield()
            v0 = ver.tolist()
            if any(v & 1 for v in v0):
                continue
            got = read(self._idx.tolist())
            if ver.tolist() == v0:
                return got
        return None

    def _consistent(self, read: Callable[[list[int]], T],
                    unlocked: Callable[[list[int]], T] | None = None) -> T:
        """``read(index words)`` from a consistent copy of the index (optimistic, else under
        the lock; on a read-only attachment, which has no lock, as it is then, and read by
        ``unlocked`` when given: a writer may be changing what it reads)."""
        got = self._optimistic(read)
        if got is not None:
            return got
        if self._lockless:
            return (unlocked or read)(self._idx.tolist())
        with self._lock:
            return read(self._idx.tolist())

    def _index_words(self) -> list[int]:
        """The index as a list of u64 words, consistent (see :meth:`_consistent`)."""
        return self._consistent(list)

    def _unreadable(self, words: list[int]) -> list[tuple[int, int]]:
        hash_ = self._hash
        return [(s, r) for s, r, kb, _, stamp in self._entries(words)
                if stamp < 0 or hash_(kb) != words[2 * s]]

    def _confirmed(self, words: list[int], bad: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Of ``bad`` (:meth:`_unreadable` of ``words``, read without the lock on a read-only
        attachment, where a writer may have freed and rewritten a record since), the entries
        a stable re-read confirms: the slot holds the same hash and record, its bucket version
        even and unchanged across the re-read, and the record still fails. An entry that
        changed, reads valid, or is never read stable within ``READ_RETRIES`` tries is left
        out: a corrupted entry is never reported that may be a writer's."""
        ver, idx, rec, hash_ = self._ver, self._idx, self._record, self._hash
        out = []
        for s, r in bad:
            b = s >> 4
            h = words[2 * s]
            for attempt in range(READ_RETRIES):
                if attempt >= _SPIN_BEFORE_YIELD:
                    os.sched_yield()
                v = ver[b]
                if v & 1:
                    continue
                same = idx[2 * s] == h and idx[2 * s + 1] == r
                got = rec(r) if same else None
                if ver[b] != v:
                    continue
                if same and (got is None or hash_(got[0]) != h):
                    out.append((s, r))
                break
        return out

    def _unreadable_read(self) -> tuple[list[int], list[tuple[int, int]]]:
        """The index words and their :meth:`_unreadable` entries, from one consistent read
        (see :meth:`_consistent`); on a read-only attachment whose optimistic read failed,
        only the entries :meth:`_confirmed` confirms."""
        return self._consistent(lambda w: (w, self._unreadable(w)),
                                lambda w: (w, self._confirmed(w, self._unreadable(w))))

    def unreadable(self) -> list[tuple[int, int]]:
        """(slot, record number) of every index entry whose record fails validation or holds a
        key that does not hash to the entry: corrupted rows no read returns, which fsck drops
        (its ``bad_entries``). From one consistent read of the index and the records (see
        :meth:`_unreadable_read`): a row a writer is replacing is never one."""
        self._check_open()
        return self._unreadable_read()[1]

    def stats(self) -> dict[str, Any]:
        """``rows``, ``capacity``, ``nslots``, ``load`` (rows / nslots), ``probe_histogram``
        {distance from home slot: entries}, ``max_probe``, the size classes (``small_size``,
        ``record_size``, ``large_count``) and ``large_rows`` (rows in large records); from one
        consistent index read; and ``unreadable``: how many of ``rows`` are entries whose record
        is corrupted (:meth:`unreadable`), from the same read."""
        self._check_open()
        hist: dict[int, int] = {}
        mask = self._mask
        cap = self.capacity
        nlarge = 0
        words, bad = self._unreadable_read()
        for j in range(0, self._nwords, 2):
            h = words[j]
            if h:
                d = ((j >> 1) - (h & mask)) & mask
                hist[d] = hist.get(d, 0) + 1
                if words[j + 1] > cap:
                    nlarge += 1
        n = sum(hist.values())
        return {
            "rows": n,
            "capacity": self.capacity,
            "nslots": self.nslots,
            "load": n / self.nslots,
            "probe_histogram": dict(sorted(hist.items())),
            "max_probe": max(hist, default=0),
            "small_size": self.small_size,
            "record_size": self.record_size,
            "large_count": self.large_count,
            "large_rows": nlarge,
            "unreadable": len(bad),
        }

    # ---------------------------------------------------------------- corruption
    def _repair(self, why: str) -> dict[str, int]:
        """Repair the table with fsck (the caller holds the lock) after finding ``why``; log it
        once per process and table. ``lock.dirty`` stays True throughout, so a repair cut short
        is finished by the lock's own."""
        lock = self._lock
        lock.dirty = True
        rep = self.fsck()
        lock.dirty = False
        pid = os.getpid()
        if self._logged_pid != pid:
            self._logged_pid = pid
            log.error("corrupted shared memory: %s; repaired with fsck: %s (logged once per "
                      "process and table)", why,
                      {k: v for k, v in rep.items() if v} or "nothing to repair")
        return rep

    def _frozen(self) -> Snapshot:
        """Under the lock: the header counters, and copies of the index, the free stacks and
        the bucket versions (memcpy: ~0.1 ms for the default table, where their lists take
        ~3 ms), for :meth:`_implausible` to look at without the lock."""
        hq = self._hq
        return ((hq[_ROWS], hq[_TOP], hq[_LTOP], hq[_STAMP]), bytes(self._idx),
                bytes(self._free), bytes(self._ver))

    def _implausible(self, locked: bool, deep: bool, snap: Snapshot | None = None,
                     suspects: list[tuple[int, int, int]] | None = None) -> str | None:
        """What is wrong with the header counters or the free stack, or None. Lock-free (not
        ``locked``) a writer mid-operation can make a healthy table look wrong: confirm under
        the lock. O(nslots + capacity) list work; ``deep`` also validates every referenced
        record and its hash, keys' uniqueness (set) and reachability: what fsck would repair.
        From ``snap`` (:meth:`_frozen`), everything but the records is exact as of the
        snapshot; records are read as they are now, so an entry whose record does not match
        goes into ``suspects`` as (slot, hash, record) rather than into the answer (a writer
        may have deleted the row and reused its record since), and a set's keys are told
        apart by their hashes."""
        if snap is not None:
            (rows, top, ltop, stamp), iw, fw, vw = snap
            words = memoryview(iw).cast("Q").tolist()
        else:
            hq = self._hq
            rows, top, ltop, stamp = hq[_ROWS], hq[_TOP], hq[_LTOP], hq[_STAMP]
        cap, nrec = self.capacity, self._nrec
        if rows > cap or top > cap + 1 or ltop > self._nlarge or rows + top + ltop != nrec:
            return (f"row count {rows} and free-stack tops {top}, {ltop} do not add up to "
                    f"{nrec} records")
        if stamp >= _STAMP_MAX - 1:  # the next stamp would be past its bound
            return f"stamp counter {stamp}"
        damage = _header_damage(self._buf, self._header_want)
        if damage is not None:
            return f"region header damaged ({damage})"
        if snap is None:
            words = self._idx.tolist()
        refs = [r for h, r in zip(words[::2], words[1::2], strict=True) if h]
        if len(refs) != rows:
            return f"row count {rows}, index entries {len(refs)}"
        free = self._free.tolist() if snap is None else memoryview(fw).cast("I").tolist()
        small, large = free[:top], free[cap + 1:cap + 1 + ltop]
        held = set(small)
        held.update(large)
        held.update(refs)
        if (len(held) != nrec or max(held) >= nrec or max(small, default=0) > cap
                or min(large, default=nrec) <= cap):
            return "free stacks and index do not hold each record exactly once, in its class"
        vers = self._ver.tolist() if snap is None else memoryview(vw).cast("Q").tolist()
        if (locked or snap is not None) and any(v & 1 for v in vers):
            return "a bucket version is odd with no writer running"
        if deep:
            hash_ = self._hash
            keys = set()
            for s, r, kb, _, stamp in self._entries(words):
                if stamp < 0 or hash_(kb) != words[2 * s]:
                    if suspects is None:
                        return f"the entry in slot {s} does not match its record"
                    suspects.append((s, words[2 * s], r))
                    continue
                keys.add(kb)
            # from a snapshot, by hash: a key's rows share it, and a record read after the
            # snapshot may be another row's by now (a collision is confirmed under the lock)
            if self._set and (len(keys) if snap is None
                              else len(set(words[::2])) - (0 in words[::2])) != rows:
                return "a key has two rows"
            if reachability_moves(list(words), self._mask):
                return "an entry lies beyond an empty slot of its probe"
        return None

    def check(self, deep: bool = False) -> dict[str, int] | None:
        """Check the header counters (rows, free-stack top, stamp) and the free stack for
        plausibility against the index; when they are wrong, repair (fsck: recounts them) and
        log once. Returns fsck's repair counts, or None when all was plausible. Lock-free when
        it is; else (a writer mid-operation looks implausible) from a snapshot taken in a
        short hold, and under the lock only to confirm what the snapshot shows wrong (an entry
        whose record failed its check counts while the entry is still in the index). Only
        ``deep`` decodes records (about 3 us a row): it finds whatever fsck would repair, e.g.
        garbage over the hash of an entry, which no counter shows and no lookup meets. Without
        it, a corrupted record is repaired by the first operation that reads it."""
        self._check_open()
        if self._implausible(False, deep) is None:
            return None
        lock = self._lock
        with lock:
            if lock.dirty:  # called from inside a write of this thread: not now
                return None
            snap = self._frozen()
        suspects: list[tuple[int, int, int]] = []
        why = self._implausible(False, deep, snap, suspects)
        if why is None and not suspects:
            return None
        with lock:
            if lock.dirty:
                return None
            if why is None and all(self._locate(h, r) < 0 for _, h, r in suspects):
                return None  # every suspect entry is gone since the snapshot: a writer's
            why = self._implausible(True, deep)
            return None if why is None else self._repair(f"table {self.name!r}: {why}")

    # ---------------------------------------------------------------- recovery
    def fsck(self) -> dict[str, int]:
        """Check and repair the table; the caller holds the lock. Returns counts of repairs,
        all zero for a healthy table (which it leaves untouched: no version moves).

        Drops index entries whose record number is out of range, whose record fails its
        length/crc check, or whose key does not hash to the entry; keeps one of entries sharing
        a record; for a set keeps only the newest (highest stamp) row of a key; moves entries
        back so that no empty slot lies between an entry's home and the entry; rebuilds the
        free stack of each size class from the records referenced; recounts the rows; rewrites
        the region header's geometry (magic, capacity, record size, index and class geometry:
        from this table's, which the segment header's descriptor and the schema define) when
        garbage overwrote it; makes every bucket version even. Every step leaves a state fsck
        handles, so a killed fsck is finished by the next.
        """
        self._check_open()
        rep = {"odd_versions": 0, "bad_entries": 0, "duplicate_entries": 0,
               "stale_rows": 0, "moved": 0, "free_stack": 0, "rows": 0, "region_header": 0}
        idx = self._idx
        ver = self._ver
        words = idx.tolist()
        drop: list[int] = []
        by_rec: dict[int, int] = {}
        by_key: dict[bytes, tuple[int, int]] = {}
        newest = 0
        for s, r, kb, _, stamp in self._entries(words):
            if stamp < 0 or self._hash(kb) != words[2 * s]:
                drop.append(s)
                rep["bad_entries"] += 1
                continue
            newest = max(newest, stamp)
            if r in by_rec:
                drop.append(s)
                rep["duplicate_entries"] += 1
                continue
            by_rec[r] = s
            if self._set:
                prev = by_key.get(kb)
                if prev is not None:
                    rep["stale_rows"] += 1
                    if prev[0] >= stamp:
                        drop.append(s)
                        del by_rec[r]
                        continue
                    drop.append(prev[1])
                    del by_rec[words[2 * prev[1] + 1]]
                by_key[kb] = (stamp, s)
        for s in drop:
            words[2 * s] = words[2 * s + 1] = 0
        moves = reachability_moves(words, self._mask)
        versions = ver.tolist()
        odd = [b for b, v in enumerate(versions) if v & 1]
        rep["odd_versions"] = len(odd)
        rep["moved"] = len(moves)
        if drop or moves:
            for b, v in enumerate(versions):  # readers retry (or wait on our lock) meanwhile
                if not v & 1:
                    ver[b] = (v + 1) & _M64
            for s in drop:
                idx[2 * s] = 0
                idx[2 * s + 1] = 0
            for src, dst, _, _ in moves:
                idx[2 * dst + 1] = idx[2 * src + 1]
                idx[2 * dst] = idx[2 * src]  # a duplicate until the next store: fsck keeps one
                idx[2 * src] = 0
                idx[2 * src + 1] = 0
            odd = list(range(len(versions)))
        hq = self._hq
        cap, nrec = self.capacity, self._nrec
        small = [r for r in range(cap, -1, -1) if r not in by_rec]  # pops low numbers first
        large = [r for r in range(nrec - 1, cap, -1) if r not in by_rec]
        top, ltop = hq[_TOP], hq[_LTOP]
        free = self._free
        if (top != len(small) or ltop != len(large)
                or sorted(free[:top]) != small[::-1]
                or sorted(free[cap + 1:cap + 1 + ltop]) != large[::-1]):
            for i, r in enumerate(small):
                free[i] = r
            for i, r in enumerate(large):
                free[cap + 1 + i] = r
            hq[_TOP] = len(small)
            hq[_LTOP] = len(large)
            rep["free_stack"] = 1
        if _header_damage(self._buf, self._header_want) is not None:
            # only derived fields: a store torn by a kill here is rewritten by the next fsck
            want = self._header_want
            _HDR.pack_into(self._buf, 0, *want[:5])
            _CLS.pack_into(self._buf, _CLS_OFF, *want[5:])
            rep["region_header"] = 1
        if hq[_ROWS] != len(by_rec):
            hq[_ROWS] = len(by_rec)
            rep["rows"] = 1
        if hq[_STAMP] < newest or hq[_STAMP] >= _STAMP_MAX - 1:
            hq[_STAMP] = newest
        for b in odd:
            v = ver[b]
            if v & 1:
                ver[b] = (v + 1) & _M64
        return rep


def reachability_moves(words: list[int], mask: int) -> list[tuple[int, int, int, int]]:
    """Moves ``(src slot, dst slot, hash, record)`` that leave no empty slot between any entry's
    home and the entry, applied to ``words`` (the index as a list of u64 words) as they are
    computed, in order; each names the entry it moves as it is then (an entry may move more
    than once).

    Passes in probe order, each starting after an empty slot: an entry goes to the first empty
    slot from its home on. One pass is not always enough: an entry whose probe wraps past the
    last slot can move into the slot the pass started after, and on again at the pass's end,
    emptying a slot on the path of an entry placed earlier. So passes repeat until one moves
    nothing. Every move shortens its entry's probe distance (the slot it takes lies between
    its home and where it was), so the passes end; their number is bounded by the sum of the
    distances.
    """
    nslots = mask + 1
    start = next((s for s in range(nslots) if not words[2 * s]), None)
    if start is None:
        return []
    moves: list[tuple[int, int, int, int]] = []
    budget = sum((s - words[2 * s]) & mask for s in range(nslots) if words[2 * s])
    for _ in range(budget + 1):
        before = len(moves)
        for step in range(1, nslots + 1):
            s = (start + step) & mask
            h = words[2 * s]
            if not h:
                continue
            e = h & mask
            while e != s and words[2 * e]:
                e = (e + 1) & mask
            if e != s:
                r = words[2 * s + 1]
                words[2 * e], words[2 * e + 1] = h, r
                words[2 * s] = words[2 * s + 1] = 0
                moves.append((s, e, h, r))
        if len(moves) == before:
            break
    return moves
