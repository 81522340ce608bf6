"""The shared-memory implementation of :class:`~shmcancel.cancel.storage.Storage` over a
:class:`~shmcancel.shm.registry.Registry` (rows, counts and their consistency: see
:mod:`shmcancel.cancel.storage`)."""

from __future__ import annotations

import contextlib
import logging
import os
from collections import Counter
from collections.abc import Callable, Container
from functools import partial
from typing import Any

from ..config import Config
from ..exceptions import CancellationLimitReached, TableFull
from ..shm import procinfo
from ..shm.hashing import blake2b
from ..shm.lanes import LaneWatch, fence
from ..shm.reader import Watch
from ..shm.registry import Registry
from ..shm.table import PreparedKey, ShmFull, Table, _unpack
from . import eviction
from .storage import Owner, Poll, Storage, clear_ended, clock_seconds
from .tables import CANCELLATIONS, IN_FLIGHT, SCOPE_COUNTS, zero_counts_kept
from .uncount import Uncount

__all__ = ["Owner", "Poll", "ShmBackend", "Storage"]

_KEY_CACHE = 1024
_ROUNDS = (0, 1, 2, 3)  # record's rounds: the last evicts under the lock


def _cancel_row(key: Any, value: Any) -> tuple[str, str, str | None, float] | None:
    """``(scope, rid, reason, at)`` of a well-formed row, else None."""
    if (
        type(key) is tuple and len(key) == 2 and type(key[0]) is str and type(key[1]) is str
        and type(value) is tuple and len(value) == 2
        and (value[0] is None or type(value[0]) is str)
        and type(value[1]) in (float, int)
    ):
        return key[0], key[1], value[0], float(value[1])
    return None


log = logging.getLogger("shmcancel.cancellation")


def _owner(value: Any) -> Owner | None:
    if type(value) is tuple and len(value) == 4 and all(type(v) is int for v in value):
        return value
    return None


def _remember(cache: dict[Any, PreparedKey], k: Any, pk: PreparedKey) -> PreparedKey:
    """Store ``pk`` under ``k`` in a key cache of at most ``_KEY_CACHE`` entries (emptied when
    full); returns ``pk``. :func:`_prepared` has these lines inlined (every new request id)."""
    if len(cache) >= _KEY_CACHE:
        cache.clear()
    cache[k] = pk
    return pk


def _prepared(cache: dict[tuple[str, str], PreparedKey],
              other: dict[tuple[str, str], PreparedKey], table: Table, scope: str,
              rid: str) -> PreparedKey:
    """``(scope, rid)`` prepared for ``table``, from ``cache``. Packing and hashing a key costs
    more than a lookup: a cancel reads, counts and writes one key several times, a request's end
    repeats its begin's key. The cancellation and in-flight tables key rows by (scope, rid) with
    one hash key, so a key prepared for the ``other`` serves after a new home slot. The caches
    hold plain-str keys only: a str subclass could compare equal to another scope."""
    if type(scope) is not str:
        scope = str.__str__(scope)
    k = (scope, rid)
    pk = cache.get(k)
    if pk is None:  # _remember, inlined: every new request id comes here
        pk = table.prepare(other.get(k) or k)
        if len(cache) >= _KEY_CACHE:
            cache.clear()
        cache[k] = pk
    return pk


class ShmBackend:
    """:class:`Storage` over a registry's ``cancellations``, ``in_flight`` and ``scope_counts``
    tables. Lock-free reads; each write operation under the registry lock (``reg.lock``,
    reentrant per thread), the sweeps in short holds. Scope counts are keyed by
    ``blake2b(scope, key=reg.hash_key, digest_size=16)`` so a client cannot choose colliding
    count keys and every count row has one small fixed size.

    Counts move with their rows under the lock, the count first on insert and last on delete:
    a writer killed in between leaves a count one *too high*, which only makes that scope's
    quota stricter; :meth:`expire` recounts from the rows and repairs any drift.
    """

    def __init__(self, reg: Registry, *, alive: Callable[[int, int], bool] = procinfo.alive):
        self.reg = reg
        self._c = reg.table(CANCELLATIONS)
        self._f = reg.table(IN_FLIGHT)
        self._n = reg.table(SCOPE_COUNTS)
        self._zeros_kept = zero_counts_kept(reg.config)
        self._lanes = reg.lanes[IN_FLIGHT]  # a handle's row, when its process's lane has room
        if self._lanes.orphans is None:  # dead owners' rows a claim or reap clears: see reap
            self._lanes.orphans = []
        self._lock = reg.lock
        # the registry's lock recoveries when this process last recounted the scopes (see
        # record): -1, none yet, so a death before it attached is covered too
        self._recounted_at = -1
        self._hash_key = bytes(reg.hash_key)
        self._alive = alive
        self._ckeys: dict[tuple[str, str], PreparedKey] = {}
        self._fkeys: dict[tuple[str, str], PreparedKey] = {}
        self._nkeys: dict[str, PreparedKey] = {}
        self._scope_watches: dict[str, Watch] = {}
        # _ck / _fk(scope, rid): the prepared key of a cancellation / in-flight row
        self._ck = partial(_prepared, self._ckeys, self._fkeys, self._c)
        self._fk = partial(_prepared, self._fkeys, self._ckeys, self._f)
        self.config: Config = reg.config
        self.capacity: int = reg.config.capacity  # type: ignore[assignment]

    # --- helpers
    def _digest(self, scope: str) -> bytes:
        return blake2b(scope.encode("utf-8"), key=self._hash_key, digest_size=16).digest()

    def _nk(self, scope: str) -> PreparedKey:
        if type(scope) is not str:
            scope = str.__str__(scope)
        pk = self._nkeys.get(scope)
        return pk if pk is not None else _remember(
            self._nkeys, scope, self._n.prepare(self._digest(scope)))

    def _count(self, scope: str) -> tuple[int, int]:
        """Under the lock: ``(ref, n)``, the scope's count ``n`` and where its word lies (-1:
        no count row, ``n`` is 0), found with one probe; ``ref`` holds while this hold writes
        no count."""
        return self._n.word_at(self._nk(scope))

    def _add(self, scope: str, delta: int, counted: tuple[int, int] | None = None) -> None:
        """Change a scope's count (``counted``: :meth:`_count`'s answer when the caller just
        read it under this hold); caller holds the lock. A count falling to 0 keeps its row
        while the table holds at most ``zero_counts_kept`` rows (see ``tables.py``)."""
        ref, n = self._count(scope) if counted is None else counted
        n += delta
        t = self._n
        if ref >= 0:
            if n > 0:
                t.store_word(ref, n)  # the row stays: one store
            elif t.count() <= self._zeros_kept:
                t.store_word(ref, 0)
            else:
                t.delete(self._nk(scope))
        elif n > 0:
            t.insert_new(self._nk(scope), None, n)

    def _set_count(self, key: PreparedKey | bytes, n: int) -> None:
        """Under the lock: the count of the scope whose count key (digest) is ``key`` becomes
        ``n``. Its row exists exactly while ``n > 0``; the count is the row's word, so a change
        that keeps the row is one store."""
        t = self._n
        if n <= 0:
            t.delete(key)
        elif not t.set_word(key, n):
            t.insert_new(key, None, n)

    def atomic(self) -> contextlib.AbstractContextManager[Any]:
        """The registry lock: several of this store's writes as one step (not in
        :class:`Storage`; for tests and tools that build a state by hand)."""
        return self._lock

    # --- cancellation rows
    def record(self, scope: str, rid: str, reason: str | None, clock: Callable[[], float], *,
               quota: int | None, cap: int, batch: int, only_in_flight: bool,
               spare: bool = False) -> bool:
        """:meth:`Storage.record` under the lock. Not in flight by a lock-free read: answered
        without the lock (a flood of notifications for ids nobody runs never contends with the
        writers); in flight: checked again under it. At the cap the batch is evicted outside
        the lock (in short holds, see :meth:`evict`) and the checks run again; after three
        such rounds (other writers refilling the table meanwhile) it is evicted under the
        held lock. At the quota, if a writer died holding the lock since this process last
        recounted (the registry's lock recoveries moved), every scope's count is recounted from
        the rows first (:meth:`_recount`, in the same hold) and the quota checked again: a
        count left one too high by a writer killed between the count and its row must not
        refuse a caller under its quota (contract §4.4)."""
        if only_in_flight and not self.in_flight(scope, rid):
            return False
        ck = self._ck(scope, rid)
        fk = self._fk(scope, rid) if only_in_flight else None
        lock = self._lock
        keep = scope if spare else None
        for attempt in _ROUNDS:
            lock.__enter__()  # not a with: its two calls from C cost a tenth of a cancel's lock
            try:
                got = self._record_held(scope, rid, ck, fk, reason, clock, quota, cap, batch,
                                        attempt, keep)
            except BaseException as e:
                lock.__exit__(type(e), e, e.__traceback__)
                raise
            lock.__exit__(None, None, None)
            if got is not None:
                return got
            self.evict(batch, cap, keep)
        raise AssertionError("unreachable: the last round evicts under the lock")

    def _record_held(self, scope: str, rid: str, ck: PreparedKey, fk: PreparedKey | None,
                     reason: str | None, clock: Callable[[], float], quota: int | None,
                     cap: int, batch: int, attempt: int, keep: str | None) -> bool | None:
        """One round of :meth:`record` under the held lock: its answer, or None when the table
        is at the cap (the caller evicts outside the lock and tries again)."""
        c = self._c
        # Reads of the tables under the held lock are exact (no writer can move a
        # version meanwhile); a lane row can go without the lock (see _still_in_lane).
        in_table = True  # (no gate: as if in flight)
        if fk is not None:
            in_table = self._f.member(fk)
            if not in_table and not self._lanes.member(fk):
                return False
        at = clock()
        if at.__class__ is not float or at - at:  # NaN, an infinity, not a float: checked
            at = clock_seconds(at)  # before anything is evicted for the row
        full = False
        counted = None  # the scope's count (_count), read only for a new row
        if not c.member(ck):
            counted = self._n.word_at(self._nk(scope))  # _count, inlined: every new row
            if quota is not None and counted[1] >= quota:
                if self._recount_after_recovery():  # in this hold: the count is read again
                    counted = self._count(scope)
                if counted[1] >= quota:
                    raise CancellationLimitReached(
                        f"scope {scope[:80]!r} already holds {quota} cancellation rows")
            if c.count() >= cap:
                if attempt < _ROUNDS[-1]:
                    full = True  # evicted below, outside the lock; then checked again
                else:
                    self.evict(batch, spare=keep)
                    counted = None  # the eviction may have taken rows of this scope
        if not full:
            try:
                if counted is None:
                    self._put(ck, scope, reason, at, None)
                else:
                    self._add_row(ck, scope, reason, at, counted)
            except ShmFull:  # /dev/shm is full: evicting others' rows would not help
                raise
            except TableFull:  # the physical table filled below the cap
                # or scope_counts, with counts a sweeper killed between its rows' rewrite and
                # its counts' left high (their rows gone): recounted, not evicted for (§4.4)
                if not (self._recount_after_recovery() and self._put_if_room(ck, scope, reason,
                                                                             at)):
                    self.evict(batch, spare=keep)
                    self._put(ck, scope, reason, at, None)
            return in_table or (fk is not None and self._still_in_lane(scope, rid, fk))
        return None

    def _recount_after_recovery(self) -> bool:
        """Under the lock: :meth:`_recount` if a writer died holding the lock since this process
        last recounted (the registry's lock recoveries moved); whether it recounted."""
        recoveries = self._lock.recoveries
        if recoveries == self._recounted_at:
            return False
        self._recount()
        self._recounted_at = recoveries
        return True

    def _put_if_room(self, key: PreparedKey, scope: str, reason: str | None, at: float) -> bool:
        """Under the lock: :meth:`_put`, False instead of :class:`TableFull`."""
        try:
            self._put(key, scope, reason, at, None)
        except ShmFull:
            raise
        except TableFull:
            return False
        return True

    def _recount(self) -> None:
        """Under the lock (taken here if the caller does not hold it), every scope's count
        becomes its rows (:meth:`_count_fixes`, exact: no writer moves a row meanwhile) at the
        price of reading every row under the lock:
        :meth:`record` runs it at a quota refusal, once per lock recovery per process (a
        writer that died may have left any scope's count off, not only the refused one's)."""
        with self._lock:
            for d, n in self._count_fixes():
                self._set_count(d, n)

    def _still_in_lane(self, scope: str, rid: str, fk: PreparedKey) -> bool:
        """Under the lock, right after the gate's row was written for a request found only in
        a lane: is it still running? A lane row is removed without this lock, so the request's
        end is a store then a load (the row removed, then "is there a cancellation?") and so
        is this side (the cancellation written, then "is it still running?"): with a full
        barrier between each store and its load, one of the two sees the other. Not running:
        the row goes again and nothing was recorded."""
        fence()  # the row's stores before the lanes' loads
        if self._lanes.member(fk):
            return True
        if self._c.delete(self._ck(scope, rid)):
            self._add(scope, -1)
        return False

    def exists(self, scope: str, rid: str) -> bool:
        # A request's end asks this of its own key, kept prepared for its in-flight row: the
        # same hash (one hash key), so a sure miss needs no key prepared for this table.
        fk = self._fkeys.get((scope, rid)) if type(scope) is str else None
        if fk is not None and self._c.absent(fk.hash):
            return False
        return self._c.member(self._ck(scope, rid))

    def get(self, scope: str, rid: str) -> tuple[str | None, float] | None:
        if type(scope) is not str:  # a str subclass reads as its text (as _ck keys it)
            scope = str.__str__(scope)
        v = self._c.get(self._ck(scope, rid))
        row = _cancel_row((scope, rid), v) if v is not None else None
        return None if row is None else (row[2], row[3])

    def watch(self, scope: str, rid: str) -> Poll:
        return self._c.watch(self._ck(scope, rid))

    def rows(self) -> int:
        return self._c.count()

    def scope_rows(self, scope: str) -> int:
        return self._n.word(self._nk(scope)) or 0

    def scope_has_rows(self, scope: str) -> bool:
        """A scope without a count row has no rows: a cached watch of it answers that with one
        load while no row of its bucket changed. With a row (its count may be 0), its word,
        read through the place the key keeps (two version loads and the word)."""
        if type(scope) is not str:
            scope = str.__str__(scope)
        w = self._scope_watches.get(scope)
        if w is None:
            if len(self._scope_watches) >= _KEY_CACHE:
                self._scope_watches.clear()
            w = self._scope_watches[scope] = self._n.watch(self._nk(scope))
        return w.member() and bool(self._n.word(w.key))

    def put(self, scope: str, rid: str, reason: str | None, at: float) -> bool:
        """Write the row ``(reason, at)`` (no quota or cap check); True when it is new."""
        key = self._ck(scope, rid)
        with self._lock:
            return self._put(key, scope, reason, at, None)

    def _put(self, key: PreparedKey, scope: str, reason: str | None, at: float,
             counted: tuple[int, int] | None) -> bool:
        """Under the lock: write ``key``'s row. ``counted``: the scope's count (:meth:`_count`)
        when the caller just read it for a key without a row, else ``None`` (then membership
        is read here)."""
        if counted is None:
            if self._c.member(key):
                self._c.insert_held(key, (reason, at))
                return False
            counted = self._count(scope)
        return self._add_row(key, scope, reason, at, counted)

    def _add_row(self, key: PreparedKey, scope: str, reason: str | None, at: float,
                 counted: tuple[int, int]) -> bool:
        """Under the lock: the new row ``key -> (reason, at)`` of ``scope``, whose count
        ``counted`` (:meth:`_count`) was read in this hold with no row of ``key`` found since.
        The count goes up first (a writer killed before the row leaves it high: stricter) and
        back down if the row cannot be written. True (the row is new)."""
        ref, n = counted
        if ref >= 0:
            self._n.store_word(ref, n + 1)  # _add, inlined: the count row stays, one store
        else:
            self._add(scope, +1, counted)
        try:
            self._c.add_held(key, (reason, at))
        except BaseException:
            self._unadd(key, scope)
            raise
        return True

    def _unadd(self, key: PreparedKey, scope: str) -> None:
        """Under the lock, after the write of :meth:`_add_row`'s row raised: its count comes
        back down unless the row is in (an exception, a signal handler's SystemExit, can come
        after the row's publishing store; a count below its rows would let the scope past its
        quota). The row write's dirty mark stays set for the lock's exit to repair the table:
        the count's own writes (a count row at 0 deleted) end with ``dirty`` cleared."""
        lock = self._lock
        dirty = lock.dirty
        try:
            if not self._c.member(key):  # exact under the lock (a half-published row: not in)
                self._add(scope, -1)
        finally:
            if dirty:
                lock.dirty = True

    def evict(self, batch: int, cap: int | None = None, spare: str | None = None) -> int:
        """Remove the first ``batch`` rows in contract §4.4's order (``spare``'s last:
        :func:`eviction.choose`). Unless the caller holds the
        lock, the batch is chosen from a lock-free read of every row and deleted in short
        holds, each row re-validated under the lock (a row cleared or re-cancelled meanwhile is
        left alone: it is no longer the row that was ranked); scope counts and the eviction
        counter move with each chunk, so they match the rows at a release (after a bulk
        rewrite, in the rewrite's own hold, :meth:`_bulk_uncount`). ``cap``: the insert that
        found the table at ``cap`` rows under the lock evicts for it after releasing it; the
        batch goes only if the table still holds ``cap`` rows at the first deletion's hold
        (another insert that found the cap at the same time may have evicted its batch since:
        a second batch would be one no order of the two inserts removes, contract §4.4)."""
        if self._lock.held_by_me():
            return self._evict_locked(batch, spare)
        total = 0
        refused: list[bool] = []

        def at_cap() -> bool:
            if self._c.count() >= cap:  # type: ignore[operator]
                return True
            refused.append(True)
            return False

        start = None if cap is None else at_cap
        for _ in range(3):  # a victim rewritten meanwhile is replaced by the next in order
            raw = {}
            ranked = []
            for row in self._c.sweep_rows():
                r = _cancel_row(_unpack(row[2]), _unpack(row[3]))
                if r is not None:
                    raw[r[0], r[1]] = row
                    ranked.append((r[0], r[1], r[3]))
            keys = eviction.choose(ranked, batch, spare)
            if not keys:
                break
            gone: set[Any] = set()

            def evicted(chunk: list[tuple[Any, Any]], gone: set[Any] = gone) -> None:
                self._evicted(chunk)
                gone.update(k for k, _ in chunk)

            def prepare(chunk: list[tuple[Any, Any]], gone: set[Any] = gone) -> Uncount:
                base: list[int] = []  # the counter, read at then's first run

                def then() -> None:  # run again if an exception cut the stores short
                    if not base:
                        base.append(self.reg.evictions)
                    self.reg.add_evictions(len(chunk), base[0])
                    gone.update(k for k, _ in chunk)
                return self._bulk_uncount(chunk, then)

            n = self._c.sweep_delete([raw[k] for k in keys], on_chunk=evicted, start=start,
                                     prepare=prepare)
            if refused:
                break  # below the cap already: the insert finds room
            if n:
                start = None  # the batch has begun: it is removed in full
            total += n
            batch = sum(1 for k in keys if k not in gone and self._c.member(self._ck(*k)))
            if not batch:
                break
        return total

    def _bulk_uncount(self, gone: list[tuple[Any, Any]], then: Callable[[], None] | None = None
                      ) -> Uncount:
        """Lock-free, before the hold of a bulk rewrite deleting ``gone``: what takes their
        scopes' counts down in that hold (:class:`Uncount`; an evicter killed after a hold
        that left them high held no lock when it died, so no recovery would mark the counts
        suspect, see record, and its scopes stayed refused under their quota)."""
        prep = self._n.prepare
        keys = [(prep(self._digest(s)), n) for s, n in self._per_scope(gone).items()]
        return Uncount(self._n, keys, then)

    def _evicted(self, gone: list[tuple[Any, Any]]) -> None:
        """Count the chunk ``gone`` (rows deleted) as evicted and out of its scopes."""
        self._uncount(gone, evicted=True)

    def _uncount(self, gone: list[tuple[Any, Any]], evicted: bool = False) -> None:
        """Take the well-formed rows of ``gone`` (deleted) out of their scopes' counts; the
        per-scope sums are made before the lock is taken (reentrant: a sweep's chunk may hold
        it already)."""
        per_scope = self._per_scope(gone)
        with self._lock:
            for scope, n in per_scope.items():
                self._add(scope, -n)
            if evicted:
                self.reg.add_evictions(len(gone))

    @staticmethod
    def _per_scope(gone: list[tuple[Any, Any]]) -> Counter[str]:
        """The well-formed rows of ``gone`` per scope."""
        per_scope: Counter[str] = Counter()
        for k, v in gone:
            r = _cancel_row(k, v)
            if r is not None:
                per_scope[r[0]] += 1
        return per_scope

    def _evict_locked(self, batch: int, spare: str | None = None) -> int:
        with self._lock:
            victims = eviction.choose(((s, i, t) for s, i, _, t in self.cancellations()), batch,
                                      spare)
            per_scope: Counter[str] = Counter()
            for key in victims:
                if self._c.delete(key):
                    per_scope[key[0]] += 1
            for scope, n in per_scope.items():
                self._add(scope, -n)
            n = sum(per_scope.values())
            if n:
                self.reg.add_evictions(n)
            return n

    def clear(self, scope: str, rid: str) -> bool:
        key = self._ck(scope, rid)
        if not self._c.member(key):  # the common case: never cancelled, no lock taken
            return False
        with self._lock:
            if not self._c.delete(key):
                return False
            self._add(scope, -1)
            return True

    def clear_before(self, scope: str, rid: str, before: float) -> bool:
        key = self._ck(scope, rid)
        if not self._c.member(key):
            return False
        with self._lock:
            row = self.get(scope, rid)
            if row is None or not row[1] < before:
                return False
            if not self._c.delete(key):
                return False
            self._add(scope, -1)
            return True

    def expire(self, now: float, ttl: float) -> int:
        """Remove the rows older than ``ttl`` (and malformed ones), then repair scope counts
        that drifted (a writer killed between a count and its row). Unless the caller holds
        the lock: rows chosen lock-free, deleted in short holds re-validated under the lock
        with their counts (a bulk rewrite's in its own hold, :meth:`_bulk_uncount`), and the
        count repair applied only when no writer ran since it was computed."""
        if self._lock.held_by_me():
            return self._expire_locked(now, ttl)
        doomed = []
        for row in self._c.sweep_rows():
            r = _cancel_row(_unpack(row[2]), _unpack(row[3]))
            if r is None or now - r[3] > ttl:
                doomed.append(row)
        doomed.sort(key=lambda row: row[2])  # by packed key: a chunk touches few scope counts
        removed = self._c.sweep_delete(doomed, on_chunk=self._uncount,
                                       prepare=self._bulk_uncount) if doomed else 0
        self._repair_counts()
        return removed

    def _repair_counts(self, attempts: int = 3, chunk: int = 64) -> None:
        """Make ``scope_counts`` match the rows, and remove its rows at 0 (after the drift
        fixes, within the same ``chunk``): compare both tables read lock-free between two
        equal idle lock generations, then apply at most ``chunk`` corrections under the lock if
        no writer took it since (else try again, ``attempts`` times; the next sweep goes on)."""
        lock = self._lock
        for attempt in range(attempts):
            if attempt:
                os.sched_yield()
            g0 = lock.idle_generation()
            if g0 is None:
                continue
            fixes = self._count_fixes()
            if lock.idle_generation() != g0:
                continue
            if not fixes:
                return
            with lock:
                if lock.generation != g0 + 1:  # a writer ran between the reads and now
                    continue
                for d, n in fixes[:chunk]:
                    self._set_count(d, n)
            return

    def _count_fixes(self) -> list[tuple[Any, int]]:
        """``(count key, count)`` for every scope whose count differs from its rows, then every
        count row at 0 of a scope without rows (removed last), from one read of both tables
        (exact under the lock, else a snapshot that :meth:`_repair_counts` checks)."""
        counts: Counter[bytes] = Counter()
        for row in self._c.sweep_rows():
            r = _cancel_row(_unpack(row[2]), _unpack(row[3]))
            if r is not None:
                counts[self._digest(r[0])] += 1
        fixes: list[tuple[Any, int]] = []
        zeros: list[tuple[Any, int]] = []
        for row in self._n.sweep_rows():
            d = _unpack(row[2])
            want = counts.pop(d, 0)
            have = self._n.word(d)
            if have != want:
                fixes.append((d, want))
            elif want == 0:
                zeros.append((d, 0))
        fixes.extend(counts.items())
        fixes.extend(zeros)
        return fixes

    def _expire_locked(self, now: float, ttl: float) -> int:
        with self._lock:
            removed = 0
            counts: Counter[bytes] = Counter()
            for k, v in self._c.scan():
                row = _cancel_row(k, v)
                if row is None or now - row[3] > ttl:
                    removed += self._c.delete_object(k, v)
                else:
                    counts[self._digest(row[0])] += 1
            # Repair drift left by a writer killed between a count and its row.
            for d, _ in self._n.scan():
                if counts.get(d) != self._n.word(d):
                    self._set_count(d, counts.get(d, 0))
                counts.pop(d, None)
            for d, n in counts.items():
                self._set_count(d, n)
            return removed

    def cancellations(self) -> list[tuple[str, str, str | None, float]]:
        return [r for r in (_cancel_row(k, v) for k, v in self._c.scan()) if r is not None]

    # --- in-flight rows
    def end(self, scope: str, rid: str, owner: Owner | None, ended_at: float) -> None:
        with self._lock:
            if owner is not None:
                self.untrack(scope, rid, owner)
            clear_ended(self, scope, rid, ended_at, owner is None)

    #: A plain ``track`` (token 0) adds a row each call, the same thread's too (contract §4.5:
    #: two requests of one id hold a row each, asyncio's in one thread as well); ``untrack``
    #: removes one. The policy then has no owed untrack to forgo on a new ``track``.
    track_rows_per_call = True
    #: Cancellation rows cleared with their dead requests' in-flight rows, ever, in this
    #: process (``cleanup`` counts those its reap cleared among the rows it removed)
    orphans_cleared = 0

    def track(self, scope: str, rid: str, owner: Owner) -> object:
        """Returns the row's receipt for a handle's row (token non-zero): its way (an ``int``)
        in this process's lane, else ``Table.add``'s (no other row equals it, so none is read
        first); ``None`` for a plain ``track`` row (added as a bag's row too: one per call)."""
        key = self._fk(scope, rid)
        # A handle's row goes to this process's lane while the shared table has room (so a
        # full table still refuses every new request, as contract §4.5 says); see lanes.py.
        if owner[3] and self._f.count() < self._f.capacity:
            w = self._lanes.add(key, owner[2], owner[3])
            if self._lanes.orphans:  # its lane was a dead owner's: their cancellations go
                self._clear_orphaned(self._take_orphans())
            if w is not None:
                return w
        try:
            receipt = self._f.add(key, owner)
        except TableFull:
            # added again whatever the reap removed: another process reaping at once may have
            # removed the dead owners' rows first
            self.reap()
            receipt = self._f.add(key, owner)
        return receipt if owner[3] else None

    def untrack(self, scope: str, rid: str, owner: Owner, receipt: object = None) -> bool:
        if type(receipt) is int:  # a lane's way
            return self._lanes.remove(receipt, owner[3])
        return self._f.remove(self._fk(scope, rid),
                              receipt if type(receipt) is tuple else None, owner)

    def untrack_thread(self, scope: str, rid: str, pid: int, start: int, tid: int) -> bool:
        key = self._fk(scope, rid)
        mine = [o for o in map(_owner, self._f.lookup(key)) if o and o[:3] == (pid, start, tid)]
        # a plain track() row (token 0) first, then a handle's (in the lane, else the table)
        if any(o[3] == 0 for o in mine):
            return self._f.delete_object(key, (pid, start, tid, 0))
        if (pid, start) == procinfo.me():
            for w, kb, t, token in self._lanes.own_rows():
                if kb == key.kbytes and t == tid and self._lanes.remove(w, token):
                    return True
        return bool(mine) and self._f.delete_object(key, mine[0])

    def in_flight(self, scope: str, rid: str) -> bool:
        key = self._fk(scope, rid)
        return self._f.member(key) or self._lanes.member(key)

    def in_flight_pids(self, scope: str, rid: str) -> set[int]:
        """The pids owning ``(scope, rid)``'s in-flight rows, read lock-free (optional for a
        store: what a cancellation's wake-up rings, :meth:`Cancellation.in_flight_pids`)."""
        key = self._fk(scope, rid)
        return ({o[0] for o in map(_owner, self._f.lookup(key)) if o}
                | {o[0] for o in self._lanes.owners(key)})

    def watch_in_flight(self, scope: str, rid: str) -> Poll:
        """A cached poll of ``in_flight(scope, rid)`` (optional for a store: the policy falls
        back to calling ``in_flight``)."""
        key = self._fk(scope, rid)
        return LaneWatch(self._f.watch(key), self._lanes, key)

    def in_flight_ids(self, scope: str) -> list[str]:
        ids = {k[1] for k, _ in self._f.scan(lambda k, v: type(k) is tuple and k[0] == scope)}
        ids.update(k[1] for k, _ in self.lane_rows() if k[0] == scope)
        return sorted(ids)

    def in_flight_rows(self) -> list[tuple[Any, Any]]:
        """Every in-flight row as ``(key, value)``, the shared table's then the lanes' (a
        lock-free snapshot, for inspection: ``shmtool dump``, tests)."""
        return [*self._f.scan(), *self.lane_rows()]

    def lane_rows(self) -> list[tuple[tuple[str, str], Owner]]:
        """The in-flight rows held in the processes' lanes (a lock-free snapshot): ``((scope,
        rid), owner)``, rows whose key does not decode as one left out."""
        out = []
        for kb, owner in self._lanes.rows():
            try:
                k = _unpack(kb)
            except Exception:
                continue
            if type(k) is tuple and len(k) == 2 and type(k[0]) is str and type(k[1]) is str:
                out.append(((k[0], k[1]), owner))
        return out

    def reap(self, pid: int | None = None) -> int:
        """Remove the in-flight rows of dead owners (``pid``'s only, when given), then the
        cancellation rows of their keys that no namesake still in flight holds: a request whose
        process died ends there, and its cancellation with it (contract §4.3: a cancellation
        never outlives its request), not one ``ttl`` later."""
        # Liveness reads /proc: decide before taking the lock, then delete under it.
        rows = self._f.scan()
        owners = {(o[0], o[1]) for o in (_owner(v) for _, v in rows) if o is not None}
        if pid is not None:
            owners = {o for o in owners if o[0] == pid}
        dead = {o for o in owners if not self._alive(*o)}
        malformed = pid is None and any(_owner(v) is None for _, v in rows)
        n = self._lanes.reap(pid)
        keys: list[Any] = self._take_orphans()  # the dead lanes' rows' (and a claim's since)
        if dead or malformed:
            def gone(key: Any, value: Any) -> bool:
                o = _owner(value)
                return pid is None if o is None else (o[0], o[1]) in dead

            keys += [k for k, v in rows if gone(k, v)]
            n += self._f.delete_where(gone)
        if keys:
            self._clear_orphaned(keys)
        return n

    def _take_orphans(self) -> list[bytes]:
        got = self._lanes.orphans or []
        self._lanes.orphans = []
        return got

    def _clear_orphaned(self, keys: list[Any]) -> None:  # keys: (scope, rid), or packed
        """The cancellation rows of ``keys`` (of in-flight rows just reaped, or cleared from a
        dead owner's lane this process claimed), each cleared unless a namesake is in flight:
        under the lock, so that a cancellation of a namesake (recorded under it, only while
        that namesake is in flight) is never the one taken. Never raises: a lock not had in
        time, a closed registry, leave the rest to their ``ttl``, and the caller's work (a
        reap's count, a ``begin``) stands."""
        try:
            for k in dict.fromkeys(keys):
                if type(k) is bytes:  # a lane row's packed key
                    k = _unpack(k)
                if (type(k) is tuple and len(k) == 2 and type(k[0]) is str
                        and type(k[1]) is str and self.exists(*k)):
                    with self._lock:
                        clear_ended(self, k[0], k[1])
                        if not self.exists(*k):
                            self.orphans_cleared += 1
        except Exception as e:
            log.debug("clearing the cancellations of ended requests: %s", e)

    def reap_ended(self, pid: int, start: int, running: Container[int]) -> int:
        def ended(key: Any, value: Any) -> bool:
            o = _owner(value)
            return (o is not None and o[0] == pid and o[1] == start and o[3] != 0
                    and o[3] not in running)

        n = 0
        if (pid, start) == procinfo.me():
            for w, _, _, token in self._lanes.own_rows():
                if token not in running:
                    n += self._lanes.remove(w, token)
        if not self._f.scan(ended):
            return n
        # Under the lock ``running`` is read again: a request that began since has its token
        # in it before its row exists (the caller's invariant), so it is never taken for ended.
        return n + self._f.delete_where(ended)

    # --- janitor
    def claim_sweep(self, now: float, interval: float) -> bool:
        return bool(self.reg.claim_sweep(now, interval))
