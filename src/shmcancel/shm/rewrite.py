"""Bulk deletes by rewriting part of the index: a window of the index is copied lock-free
(:meth:`Rewrites.copy_index`, :meth:`Rewrites.copy_window`), the deletions are planned from it
without the lock (:meth:`IndexCopy.without`), and stored in one short hold (:meth:`Rewrite.store`)
only if no bucket the plan touches moved since the copy (:meth:`Rewrite.current`): then no
writer touched those slots, so every record they reference is still that row's, unchanged but
for its word. Writers elsewhere in the index do not make a plan stale. Several tables' rewrites
can be stored in one hold.

A plan is local to probe clusters (runs of occupied slots): an entry's probe never leaves its
cluster, so deleting entries of a cluster and moving the cluster's other entries back towards
their homes changes no probe outside it. A plan touches the buckets from each of its clusters'
first slot to the empty slot that ends it (an insert there would lengthen the cluster).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator
from typing import Protocol

from .base import PreparedKey
from .layout import _LTOP, _M64, _ROWS, _TOP, _WORD, BUCKET_SLOTS
from .writer import Writes

_BS = BUCKET_SLOTS
_BW = 2 * BUCKET_SLOTS  # index words per bucket
_JOIN = 4  # buckets between two a rewrite touches that it stores too (if copied consistently)


class Companion(Protocol):
    """What else a rewrite's hold stores (see :meth:`Sweeps.sweep_delete`'s ``prepare``)."""

    def current(self) -> bool:
        """Under the lock, before any store: can :meth:`store` run as computed?"""
        ...

    def store(self) -> None:
        """Under the lock, right after the rewrite's stores. Run again, in the same hold, when
        an exception cut it short: it completes what it began (as :meth:`Rewrite.store`)."""
        ...


class WindowTooSmall(Exception):
    """A cluster of the window runs past its last slot: copy a larger window."""


class IndexCopy:
    """Buckets ``b0 .. b0 + nb - 1`` of a table's index (mod the bucket count; the whole index,
    read cyclically, when ``nb`` is every bucket) copied lock-free: ``words`` (hash, record
    pairs of the window's slots) and ``v0``, each bucket's version where two reads around the
    copy were equal and even, else -1 (never a version: a bucket moving during the copy, whose
    slots nothing may be planned from)."""

    __slots__ = ("b0", "nb", "t", "v0", "whole", "words")

    def __init__(self, t: Rewrites, b0: int, nb: int, v0: list[int],
                 words: memoryview) -> None:
        self.t = t
        self.b0 = b0
        self.nb = nb
        self.v0 = v0
        self.words = words
        self.whole = nb == t._nbuckets

    @property
    def complete(self) -> bool:
        """Every bucket of the window was copied consistently."""
        return -1 not in self.v0

    def forget_moved(self) -> None:
        """Mark every bucket of the window whose version moved since the copy as copied
        inconsistently (lock-free): a plan made again leaves out the clusters writers touched
        meanwhile."""
        v0 = self.v0
        for i, v in enumerate(self.t._window_versions(self.b0, self.nb)):
            if v != v0[i]:
                v0[i] = -1

    def find(self, pk: PreparedKey) -> tuple[tuple[int, int, int, int] | None,
                                             list[tuple[int, int]]] | None:
        """``((hash, record, word ref, window slot) or None, pins)``: ``pk``'s row in the copy
        (a set's one row; the first of a bag's) or None, and the (bucket, version) pairs of the
        buckets its probe read. The record is read lock-free, so the answer holds under the
        lock only while every pin does (then so does the reference, for
        :meth:`Writes.store_word`). None when the copy cannot tell: the probe reaches a
        bucket copied inconsistently or leaves the window. A record failing validation
        reads as no row (a writer moved it since the copy, and a pin says so, or it is
        corrupt: nothing is stored for it)."""
        t = self.t
        words, v0 = self.words, self.v0
        nw = len(words)
        h = pk.hash
        i = 2 * ((pk.home - self.b0 * _BS) & t._mask)
        pins: list[tuple[int, int]] = []
        lb = -1
        for _ in range(t.nslots):
            if self.whole:
                i &= nw - 1
            elif i >= nw:
                return None
            if i // _BW != lb:
                lb = i // _BW
                v = v0[lb]
                if v < 0:
                    return None
                pins.append(((self.b0 + lb) % t._nbuckets, v))
            sh = words[i]
            if not sh:
                return None, pins
            if sh == h:
                r = words[i + 1]
                rec = t._record(r)
                if rec is not None and rec[0] == pk.kbytes:
                    return (h, r, (t._offset(r) + _WORD) >> 2, i >> 1), pins
            i += 2
        return None

    def _clusters(self, lo: int, hi: int, slots: list[int] | None = None
                  ) -> Iterator[tuple[int, int]]:
        """``(first slot, slots)`` of every cluster of the window whose first slot lies in
        window slots ``lo .. hi - 1`` (its slots may wrap, in a whole copy), or with ``slots``,
        of the clusters holding those (occupied) slots; WindowTooSmall when one runs past the
        window's end."""
        words = self.words
        n = len(words) // 2
        m = n - 1 if self.whole else -1  # window slot k is k & m (-1 masks nothing)
        if slots is not None:
            starts = set()
            for s in slots:
                for _ in range(n):
                    p = (s - 1) & m
                    if p < 0:
                        raise WindowTooSmall
                    if not words[2 * p]:
                        break
                    s = p
                else:
                    return  # no empty slot: corrupt (fsck repairs it, row by row)
                starts.add(s)
            for cs in sorted(starts):
                e = cs
                while words[2 * (e & m)]:
                    e += 1
                    if not self.whole and e >= n:
                        raise WindowTooSmall
                yield cs, e - cs
            return
        if self.whole:
            empty = next((s for s in range(n) if not words[2 * s]), None)
            if empty is None:  # no empty slot: corrupt (fsck repairs it, row by row)
                return
            s, stop = empty + 1, empty + 1 + n
            while s < stop:
                if not words[2 * (s & m)]:
                    s += 1
                    continue
                cs = s
                while words[2 * (s & m)]:
                    s += 1
                if lo <= cs & m < hi:
                    yield cs & m, s - cs
            return
        s = lo
        while s < hi and words[2 * s - 2]:  # inside a cluster that begins before lo: not ours
            s += 1
            if s >= n:
                raise WindowTooSmall
        while s < hi:
            if not words[2 * s]:
                s += 1
                continue
            cs = s
            while words[2 * s]:
                s += 1
                if s >= n:
                    raise WindowTooSmall
            yield cs, s - cs

    def without(self, drop: Callable[[int, int], bool], lo: int = 0,
                hi: int | None = None, slots: list[int] | None = None) -> Rewrite | None:
        """The rewrite deleting every entry ``(hash, record)`` for which ``drop`` is true, of
        the clusters whose first slot is a window slot in ``lo .. hi - 1`` (all by default;
        ``lo`` >= 1 in a partial window, whose slot ``lo - 1`` tells where clusters begin),
        or with ``slots``, of the clusters holding those window slots:
        those entries emptied, then each cluster's moves that leave no empty slot inside any
        entry's probe (in the cluster's order: each entry to the first empty slot from its
        home), the dropped records pushed on their free stacks. A cluster touching a bucket
        copied inconsistently is left out (its rows stay). None when nothing is dropped, or
        when a cluster breaks the probe invariant (corrupt: the caller deletes row by row,
        under the lock, where a repair runs). WindowTooSmall as :meth:`_clusters`."""
        t = self.t
        cap = t.capacity
        words, v0 = self.words, self.v0
        n = len(words) // 2
        nbl = len(v0)  # window buckets
        m = n - 1 if self.whole else -1  # window slot k is k & m (-1 masks nothing)
        tmask = t._mask
        s0 = self.b0 * _BS
        freed: list[int] = []  # small records
        lfreed: list[int] = []  # large records
        touched: set[int] = set()  # window buckets
        zeroed: dict[int, list[int]] = {}  # window bucket -> its slots emptied
        moves = array("Q")
        for cs, length in self._clusters(lo, n if hi is None else hi, slots):
            first, last = cs // _BS, (cs + length) // _BS  # to the empty slot that ends it
            lbs = [b % nbl for b in range(first, last + 1)]
            if any(v0[b] < 0 for b in lbs):
                continue
            at = [k & m for k in range(cs, cs + length)]
            local = [(words[2 * w], words[2 * w + 1]) for w in at]
            dropped = [i for i, (h, r) in enumerate(local) if drop(h, r)]
            if not dropped:
                continue
            for i in dropped:
                r = local[i][1]
                (freed if r <= cap else lfreed).append(r)
                local[i] = (0, 0)
                zeroed.setdefault(at[i] // _BS, []).append(at[i])
            touched.update(lbs)
            for i, (h, r) in enumerate(local):
                if not h:
                    continue
                d = ((s0 + at[i]) - h) & tmask  # distance from the entry's home
                if d > i:  # its home lies before its cluster: the invariant is broken
                    return None
                e = i - d
                while e != i and local[e][0]:
                    e += 1
                if e != i:
                    local[e] = (h, r)
                    local[i] = (0, 0)
                    # each move stores the entry it moves as it is then (an entry moves once
                    # here, but a move must never name a slot's final word)
                    moves.extend(((s0 + at[i]) & tmask, (s0 + at[e]) & tmask, h, r))
        if not touched:
            return None
        # (absolute first bucket, buckets), none wrapping; a gap of a few buckets copied
        # consistently joins its neighbours (stored as copied: fewer, longer stores)
        runs: list[tuple[int, int]] = []
        nball = t._nbuckets
        for lb in sorted(touched):
            b = (self.b0 + lb) % nball
            if runs:
                b1, n1 = runs[-1]
                gap = b - (b1 + n1)
                if 0 <= gap <= _JOIN and all(v0[(b1 + n1 + k - self.b0) % nball] >= 0
                                             for k in range(gap)):
                    runs[-1] = (b1, n1 + gap + 1)
                    continue
            runs.append((b, 1))
        parts = []
        for b, nb in runs:
            lb = (b - self.b0) % nball
            cleared = words[lb * _BW:(lb + nb) * _BW].tolist()
            base = lb * _BW
            for k in range(lb, lb + nb):
                for w in zeroed.get(k, ()):
                    cleared[2 * w - base] = cleared[2 * w - base + 1] = 0
            parts.append((b, nb, v0[lb:lb + nb], cleared))
        return Rewrite(t, parts, moves, array("I", freed), array("I", lfreed))


class Rewrite:
    """A bulk delete computed from an :class:`IndexCopy`, to be stored under the lock.

    ``parts``: ``(first bucket, buckets, their versions at the copy, the words of their slots
    with the dropped entries emptied)``, one per run of buckets the plan touches; ``moves``:
    ``(src slot, dst slot, hash, record)`` x 4 words each, in order."""

    __slots__ = ("at", "base", "done", "even", "freed", "lfreed", "moves", "odd", "parts", "t")

    def __init__(self, t: Rewrites, parts: list[tuple[int, int, list[int], list[int]]],
                 moves: array[int], freed: array[int], lfreed: array[int]) -> None:
        self.t = t
        self.parts = [(b, nb, v0, array("Q", words)) for b, nb, v0, words in parts]
        self.odd = [array("Q", [(v + 1) & _M64 for v in v0]) for _, _, v0, _ in parts]
        self.even = [array("Q", [(v + 2) & _M64 for v in v0]) for _, _, v0, _ in parts]
        self.moves = moves
        self.freed = freed
        self.lfreed = lfreed
        self.done = False  # stored: never again (versions only grow)
        self.at = -1  # the moves stored (-1: not the emptied slots either)
        self.base: tuple[int, int, int] | None = None  # free-stack tops and rows at the store

    @property
    def rows(self) -> int:
        """The rows this rewrite deletes."""
        return len(self.freed) + len(self.lfreed)

    @property
    def buckets(self) -> int:
        """The buckets this rewrite touches."""
        return sum(nb for _, nb, _, _ in self.parts)

    def current(self) -> bool:
        """Under the lock: no bucket the plan touches moved since the copy (so :meth:`store`
        deletes exactly the rows it was computed for) and the free stacks can take its
        records (else the counters are implausible: the caller deletes row by row, where a
        repair can run). Lock-free, a hint only."""
        t = self.t
        ver = t._ver
        for b, nb, v0, _ in self.parts:
            if ver[b:b + nb].tolist() != v0:
                return False
        hq = t._hq
        return (hq[_TOP] + len(self.freed) <= t.capacity + 1
                and hq[_LTOP] + len(self.lfreed) <= t._nlarge)

    def store(self) -> None:
        """Under the lock, once :meth:`current`: the touched buckets odd, their slots with the
        dropped entries emptied, the moves, the buckets even (a reader sees the old slots or
        the new), then the free stacks and the row counter; ``dirty`` from the first store to
        the last. Every store writes a value fixed by the plan and the counters read at the
        first call, and the moves already stored are not stored again, so a store cut short
        (a signal handler's exception) is completed by running it again in the same hold;
        once complete, it is never run again (its versions would go back past a later
        write's)."""
        if self.done:
            return
        t = self.t
        hq = t._hq
        if self.base is None:
            self.base = (hq[_TOP], hq[_LTOP], hq[_ROWS])
        top, ltop, rows = self.base
        cap = t.capacity
        flags = t._flags
        nf, nl = len(self.freed), len(self.lfreed)
        flags.dirty = True
        ver, idx = t._ver, t._idx
        for (b, nb, _, _), odd in zip(self.parts, self.odd, strict=True):
            ver[b:b + nb] = odd
        # A writer killed inside a copy of many slots (a memcpy stores in no fixed order)
        # leaves any mix of the old slots and the new: safe only where no kept entry changes
        # slot. So the copy only empties the dropped entries' slots (the rest of a touched
        # bucket is stored as it is); the entries then move one at a time, each copied before
        # its old slot is cleared, so each is always in a slot.
        if self.at < 0:
            for b, nb, _, words in self.parts:
                idx[b * _BW:(b + nb) * _BW] = words
            self.at = 0
        m = self.moves
        for i in range(self.at, len(m), 4):
            src, dst = 2 * m[i], 2 * m[i + 1]
            idx[dst + 1] = m[i + 3]
            idx[dst] = m[i + 2]
            idx[src] = 0
            idx[src + 1] = 0
            self.at = i + 4
        for (b, nb, _, _), even in zip(self.parts, self.even, strict=True):
            ver[b:b + nb] = even
        t._free[top:top + nf] = self.freed
        hq[_TOP] = top + nf
        t._free[cap + 1 + ltop:cap + 1 + ltop + nl] = self.lfreed
        hq[_LTOP] = ltop + nl
        hq[_ROWS] = max(0, rows - nf - nl)
        flags.dirty = False
        self.done = True


class Rewrites(Writes):
    """The bulk rewrites of :class:`~shmcancel.shm.table.Table`."""

    def copy_window(self, b0: int, nb: int) -> IndexCopy:
        """Buckets ``b0 .. b0 + nb - 1`` (mod the bucket count; all of them at most) of the
        index, copied lock-free (see :class:`IndexCopy`)."""
        self._check_open()
        nball = self._nbuckets
        nb = min(nb, nball)
        b0 = 0 if nb == nball else b0 % nball
        v0 = self._window_versions(b0, nb)
        # one memcpy per span (a list of the whole default index takes ~1 ms, this ~0.05)
        idx = self._idx
        raw = b"".join([bytes(idx[a * _BW:b * _BW]) for a, b in self._spans(b0, nb)])
        words = memoryview(raw).cast("Q")
        v1 = self._window_versions(b0, nb)
        return IndexCopy(self, b0, nb, [v if v == w and not v & 1 else -1
                                        for v, w in zip(v0, v1, strict=True)], words)

    def _spans(self, b0: int, nb: int) -> list[tuple[int, int]]:
        """Buckets ``b0 .. b0 + nb - 1`` (mod the bucket count) as one or two ranges."""
        nball = self._nbuckets
        if b0 + nb <= nball:
            return [(b0, b0 + nb)]
        return [(b0, nball), (0, b0 + nb - nball)]

    def _window_versions(self, b0: int, nb: int) -> list[int]:
        """The versions of buckets ``b0 .. b0 + nb - 1`` (mod the bucket count), in order."""
        ver = self._ver
        out: list[int] = []
        for a, b in self._spans(b0, nb):
            out += ver[a:b].tolist()
        return out

    def copy_index(self, tries: int = 3) -> IndexCopy:
        """The whole index copied lock-free (see :class:`IndexCopy`): again while a bucket
        moved during the copy, ``tries`` times at most (then with those buckets marked)."""
        copy = self.copy_window(0, self._nbuckets)
        for _ in range(tries - 1):
            if copy.complete:
                break
            copy = self.copy_window(0, self._nbuckets)
        return copy
