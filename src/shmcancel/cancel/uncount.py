"""Scope counts taken down in bulk, in the hold of the rewrite that deletes their rows.

A sweep that deletes many cancellation rows at once (an eviction batch, an expiry) does it by one
rewrite of the index (``shm/rewrite.py``); each scope's count must fall by its rows in that same
hold (a writer killed after the hold would otherwise leave counts too high with no lock recovery
to mark them suspect). One ``scope_counts`` row per scope: deleting the rows falling to 0 one by
one costs a probe and a backward shift each (~8 µs: 4 ms for a batch of 500 scopes), so they go
by a second rewrite, of ``scope_counts``' index, computed lock-free with the first.
"""

from __future__ import annotations

from collections.abc import Callable

from ..shm.rewrite import Rewrite
from ..shm.table import PreparedKey, Table


class Uncount:
    """A :class:`~shmcancel.shm.rewrite.Companion`: counts ``(key, n)`` (a scope's prepared
    count key, the rows of it deleted) fall by ``n``, computed lock-free at construction from a
    copy of ``counts``' index: a count whose row holds ``n`` or less then loses its row (by one
    rewrite of the index), every other is one store of its word. :meth:`current`, under the
    lock, says whether that plan still holds: no bucket that the keys' probes read (or that the
    rewrite touches) moved since the copy, and no falling-to-0 count moved since it was read (a
    word moves without a version). ``then``, when given, runs in the same hold after the counts
    (``add_evictions``)."""

    __slots__ = ("_drop", "_kept", "_load", "_n", "_ok", "_pins", "_read", "_set", "_then",
                 "_want")

    def __init__(self, counts: Table, keys: list[tuple[PreparedKey, int]],
                 then: Callable[[], None] | None = None) -> None:
        self._n = counts
        self._then = then
        self._ok = False  # a plan was made
        self._kept: list[tuple[int, int]] = []  # (word ref, n)
        self._load: Callable[[], tuple[int, ...]] = tuple
        self._read: tuple[int, ...] = ()
        self._pins: Callable[[], tuple[int, ...]] = tuple
        self._want: tuple[int, ...] = ()
        self._drop: Rewrite | None = None
        self._set: list[tuple[int, int]] | None = None  # what store() writes: (ref, count)
        copy = counts.copy_index()
        load = counts.load_word
        pins: dict[int, int] = {}
        gone: set[tuple[int, int]] = set()
        slots: list[int] = []
        zeroed: list[tuple[int, int]] = []  # (word ref, word read) of the rows to drop
        for pk, n in keys:
            got = copy.find(pk)
            if got is None:  # a bucket moved during the copy: no plan
                return
            hit, seen = got
            pins.update(seen)
            if hit is None:  # no count row (drift a recount repairs): nothing to take down
                continue
            h, r, ref, slot = hit
            w = load(ref)
            if w <= n:
                gone.add((h, r))
                slots.append(slot)
                zeroed.append((ref, w))
            else:
                self._kept.append((ref, n))
        if gone:
            self._drop = copy.without(lambda h, r: (h, r) in gone, slots=slots)
            if self._drop is None or self._drop.rows != len(gone):
                return  # implausible, or a cluster reached a bucket copied inconsistently
            self._load = counts.load_words([ref for ref, _ in zeroed])
            self._read = tuple(w for _, w in zeroed)
        if pins:
            bs = list(pins)
            self._pins = counts.load_versions(bs)
            self._want = tuple(pins[b] for b in bs)
        self._ok = True

    def current(self) -> bool:
        if not self._ok or self._pins() != self._want:
            return False
        if self._drop is not None and not self._drop.current():
            return False
        return self._load() == self._read

    def store(self) -> None:
        """Every store writes a value fixed before the first (the counts read once, exact
        under the lock), so a store cut short is completed by running it again in the same
        hold; ``then`` runs with each, so it must count once however often it runs (the
        eviction's stores the counter read at its first run plus the batch)."""
        counts = self._n
        if self._set is None:
            load = counts.load_word
            self._set = [(ref, max(0, load(ref) - n)) for ref, n in self._kept]
        if self._drop is not None:
            self._drop.store()
        store = counts.store_word
        for ref, w in self._set:  # records do not move with the rewrite: refs hold
            # at 0 (rows of the scope cleared since the plan) the row stays, for a sweep's
            # count repair: a delete cut short and run again would meet a half-shifted index
            store(ref, w)
        if self._then is not None:
            self._then()
