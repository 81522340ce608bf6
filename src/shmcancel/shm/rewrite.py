"""Bulk deletes by rewriting the index: a consistent copy of the index is taken lock-free
(:meth:`Rewrites.copy_index`), the new index and free stacks are computed from it without the
lock (:meth:`IndexCopy.without`), and stored in one short hold (:meth:`Rewrite.store`) only if
no bucket version and no free-stack top moved since the copy (:meth:`Rewrite.current`): then no
writer touched the index, so every record the copy references is still that row's, unchanged
but for its word. Several tables' rewrites can be stored in one hold.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Callable
from typing import Protocol

from .base import PreparedKey
from .fsck import reachability_moves
from .layout import _LTOP, _ROWS, _TOP, _WORD
from .writer import Writes


class Companion(Protocol):
    """What else a rewrite's hold stores (see :meth:`Sweeps.sweep_delete`'s ``prepare``)."""

    def current(self) -> bool:
        """Under the lock, before any store: can :meth:`store` run as computed?"""
        ...

    def store(self) -> None:
        """Under the lock, right after the rewrite's stores. Run again, in the same hold, when
        an exception cut it short: it completes what it began (as :meth:`Rewrite.store`)."""
        ...


class IndexCopy:
    """A table's index as it was between two equal reads of every bucket version (all even):
    ``words`` (hash, record pairs), ``v0`` (the versions) and the free-stack tops."""

    __slots__ = ("ltop", "t", "top", "v0", "words")

    def __init__(self, t: Rewrites, v0: list[int], words: list[int], top: int, ltop: int
                 ) -> None:
        self.t = t
        self.v0 = v0
        self.words = words
        self.top = top
        self.ltop = ltop

    def current(self) -> bool:
        """Under the lock: no bucket version and no free-stack top moved since the copy (so
        the copy is the index, and every record it references holds the same row). Lock-free,
        a hint only."""
        t = self.t
        hq = t._hq
        return hq[_TOP] == self.top and hq[_LTOP] == self.ltop and t._ver.tolist() == self.v0

    def find(self, pk: PreparedKey) -> tuple[int, int, int] | None:
        """``(hash, record, word ref)`` of ``pk``'s row in the copy (a set's one row; the first
        of a bag's), or None: the record is read lock-free, so the answer is the row's only if
        the rewrite built from this copy is :meth:`Rewrite.current` under the lock (then so is
        the reference, for :meth:`Writes.store_word`). A record failing validation reads as no
        row (a writer moved it since the copy, or it is corrupt: either way nothing is stored)."""
        t = self.t
        words = self.words
        wmask = t._wmask
        h = pk.hash
        j = pk.j
        for _ in range(t.nslots):
            sh = words[j]
            if not sh:
                return None
            if sh == h:
                r = words[j + 1]
                rec = t._record(r)
                if rec is not None and rec[0] == pk.kbytes:
                    return h, r, (t._offset(r) + _WORD) >> 2
            j = (j + 2) & wmask
        return None

    def without(self, drop: Callable[[int, int], bool]) -> Rewrite | None:
        """The rewrite that deletes every entry ``(hash, record)`` of the copy for which
        ``drop`` is true: the copy with those entries emptied, then the moves that leave no
        empty slot inside any entry's probe (fsck's, each a copy then a clear), the dropped
        records pushed on their free stacks. None when nothing is dropped, or when the stacks
        could not take the records (implausible counters: the caller deletes row by row, under
        the lock, where a repair can run)."""
        t = self.t
        cap = t.capacity
        freed: list[int] = []  # small records
        lfreed: list[int] = []  # large records
        new = list(self.words)
        kept = 0
        for j in range(0, t._nwords, 2):
            h = new[j]
            if not h:
                continue
            r = new[j + 1]
            if drop(h, r):
                (freed if r <= cap else lfreed).append(r)
                new[j] = new[j + 1] = 0
                continue
            kept += 1
        if not freed and not lfreed:
            return None
        if self.top + len(freed) > cap + 1 or self.ltop + len(lfreed) > t._nlarge:
            return None
        cleared = array("Q", new)
        # Each move stores the entry it moves as it is then, not the final index's word at its
        # destination: an entry can move twice (into the first empty slot, where the pass
        # starts, then back into a slot emptied after), and its first move would store the slot
        # its second empties.
        moves = array("Q")
        for move in reachability_moves(new, t._mask):
            moves.extend(move)
        return Rewrite(self, cleared, moves, array("I", freed), array("I", lfreed), kept)


class Rewrite:
    """A bulk delete computed from an :class:`IndexCopy`, to be stored under the lock."""

    __slots__ = ("at", "cleared", "copy", "done", "even", "freed", "kept", "lfreed", "moves",
                 "odd")

    def __init__(self, copy: IndexCopy, cleared: array[int], moves: array[int],
                 freed: array[int], lfreed: array[int], kept: int) -> None:
        self.copy = copy
        self.kept = kept  # the rows the new index holds
        self.done = False  # stored: never again (versions only grow)
        self.at = -1  # the moves stored (-1: not the cleared index either)
        self.cleared = cleared  # the copy without the dropped entries
        self.moves = moves  # (src, dst, hash, record) x 4 words each, in order
        self.freed = freed
        self.lfreed = lfreed
        self.odd = array("Q", [v + 1 for v in copy.v0])
        self.even = array("Q", [v + 2 for v in copy.v0])

    @property
    def rows(self) -> int:
        """The rows this rewrite deletes."""
        return len(self.freed) + len(self.lfreed)

    def current(self) -> bool:
        """:meth:`IndexCopy.current`: under the lock, :meth:`store` deletes exactly the rows
        it was computed for."""
        return self.copy.current()

    def store(self) -> None:
        """Under the lock, once :meth:`current`: every bucket odd, the new index, every bucket
        even (a reader sees the old index or the new one), then the free stacks and the row
        counter; ``dirty`` from the first store to the last. Every store writes a value fixed
        by the plan, and the moves already stored are not stored again, so a store cut short
        (a signal handler's exception) is completed by running it again in the same hold;
        once complete, it is never run again (its versions would go back past a later
        write's)."""
        if self.done:
            return
        c = self.copy
        t = c.t
        cap = t.capacity
        hq = t._hq
        flags = t._flags
        nf, nl = len(self.freed), len(self.lfreed)
        flags.dirty = True
        t._ver[:] = self.odd
        idx = t._idx
        # A writer killed inside a copy of the whole index (a memcpy stores in no fixed order)
        # leaves any mix of the old slots and the new: safe only where no kept entry changes
        # slot. So the copy only empties the dropped entries' slots; the entries then move
        # one at a time, each copied before its old slot is cleared (fsck's moves, in order:
        # a slot is cleared only once its entry is in place), so each is always in a slot.
        if self.at < 0:
            idx[:] = self.cleared
            self.at = 0
        m = self.moves
        for i in range(self.at, len(m), 4):
            src, dst = 2 * m[i], 2 * m[i + 1]
            idx[dst + 1] = m[i + 3]
            idx[dst] = m[i + 2]
            idx[src] = 0
            idx[src + 1] = 0
            self.at = i + 4
        t._ver[:] = self.even
        t._free[c.top:c.top + nf] = self.freed
        hq[_TOP] = c.top + nf
        t._free[cap + 1 + c.ltop:cap + 1 + c.ltop + nl] = self.lfreed
        hq[_LTOP] = c.ltop + nl
        hq[_ROWS] = self.kept
        flags.dirty = False
        self.done = True


class Rewrites(Writes):
    """The bulk rewrites of :class:`~shmcancel.shm.table.Table`."""

    def copy_index(self, tries: int = 3) -> IndexCopy | None:
        """A consistent lock-free copy of the index (see :class:`IndexCopy`), or None when
        writers kept moving it (``tries`` times)."""
        self._check_open()
        ver = self._ver
        for attempt in range(tries):
            if attempt:
                os.sched_yield()
            v0 = ver.tolist()
            if any(v & 1 for v in v0):
                continue
            top, ltop = self._hq[_TOP], self._hq[_LTOP]
            words = self._idx.tolist()
            if ver.tolist() == v0:
                return IndexCopy(self, v0, words, top, ltop)
        return None
