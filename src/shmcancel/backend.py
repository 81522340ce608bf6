"""Storage for the cancellation layer: the interface its policy needs, and the shared-memory
implementation over a :class:`~shmcancel.registry.Registry`.

The policy (id validation, the order of checks in ``cancel``, telemetry, when the janitor runs)
lives in :mod:`shmcancel.cancellation`; the eviction order in :mod:`shmcancel.eviction`. A backend
only stores rows and keeps its per-scope counts true. A second backend (Redis, for deployments
that outgrow one host) implements :class:`Storage` and runs the same tests.

Rows
----
- cancellation: key ``(scope, request_id)`` (both ``str``; ``request_id`` is already ``str(id)``),
  value ``(reason: str | None, cancelled_at: float)``; one row per key.
- in-flight: key ``(scope, request_id)``, value an :data:`Owner`
  ``(pid, start_time, thread_ident, token)``; several rows per key (one per running request).
- per-scope counts of cancellation rows, so the quota check reads one row instead of scanning.

Consistency of the counts: writers change a count and its rows inside one :meth:`Storage.atomic`
section, the count first on insert and last on delete. A writer killed in between leaves the
count one *too high*, which only makes that scope's quota stricter, never looser;
:meth:`Storage.expire` (run by every cleanup) recounts from the rows and repairs any drift.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections import Counter
from collections.abc import Callable, Container
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from . import eviction, procinfo
from .config import Config
from .exceptions import TableFull
from .table import PreparedKey

if TYPE_CHECKING:  # pragma: no cover
    from .registry import Registry

__all__ = ["Owner", "Poll", "ShmBackend", "Storage"]

_KEY_CACHE = 1024

#: Who runs an in-flight request: ``(pid, start_time, thread_ident, token)``. ``token`` tells
#: apart two requests of one thread (0 for plain ``track``; unique per ``RequestHandle``).
Owner = tuple[int, int, int, int]


class Poll(Protocol):
    """A cached lookup of one cancellation key (see ``table.Watch``)."""

    def member(self) -> bool: ...


@runtime_checkable
class Storage(Protocol):
    """What :class:`~shmcancel.cancellation.Cancellation` needs of a store.

    Reads (``exists``, ``get``, ``watch``, ``rows``, ``scope_rows``, ``in_flight``, ...) never
    block on writers. Every write is atomic by itself; :meth:`atomic` groups several into one
    step (it is reentrant), which ``cancel`` uses for check-then-insert.
    """

    #: The limits and timings the policy applies (shared by every process using the store).
    config: Config
    #: Physical cancellation rows the store can hold.
    capacity: int

    def atomic(self) -> contextlib.AbstractContextManager[Any]: ...

    # --- cancellation rows
    def exists(self, scope: str, rid: str) -> bool: ...
    def get(self, scope: str, rid: str) -> tuple[str | None, float] | None: ...
    def watch(self, scope: str, rid: str) -> Poll: ...
    def rows(self) -> int: ...
    def scope_rows(self, scope: str) -> int: ...
    def put(self, scope: str, rid: str, reason: str | None, at: float) -> bool:
        """Insert or overwrite; True when the row is new (it then counts for its scope)."""
    def evict(self, batch: int) -> int:
        """Remove ``min(batch, rows)`` rows in :mod:`~shmcancel.eviction` order; the count."""
    def clear(self, scope: str, rid: str) -> bool:
        """Remove one row; reads first and takes no lock when there is none."""
    def clear_before(self, scope: str, rid: str, before: float) -> bool:
        """Remove the row only if its ``cancelled_at < before`` (checked under the lock, so a
        newer row written meanwhile stays); reads first and takes no lock when there is none."""
    def expire(self, now: float, ttl: float) -> int:
        """Remove rows with ``now - cancelled_at > ttl``; repair the scope counts."""
    def cancellations(self) -> list[tuple[str, str, str | None, float]]: ...

    # --- in-flight rows
    def track(self, scope: str, rid: str, owner: Owner) -> None:
        """Add a row; when full, drop dead owners' rows and retry; ``TableFull`` if still full."""
    def untrack(self, scope: str, rid: str, owner: Owner) -> bool: ...
    def untrack_thread(self, scope: str, rid: str, pid: int, start: int, tid: int) -> bool:
        """Remove one row of this thread for the key (a token-0 row first)."""
    def in_flight(self, scope: str, rid: str) -> bool: ...
    def in_flight_ids(self, scope: str) -> list[str]: ...
    def reap(self, pid: int | None = None) -> int:
        """Remove in-flight rows whose owner process is gone (only ``pid``'s, when given)."""
    def reap_ended(self, pid: int, start: int, running: Container[int]) -> int:
        """Remove the rows of the live process ``(pid, start)`` whose token (non-zero) is not
        in ``running``: requests it no longer runs, whose end was lost. Scans without the
        lock and takes it only when there is something to remove."""

    # --- janitor
    def claim_sweep(self, now: float, interval: float) -> bool: ...


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


def _owner(value: Any) -> Owner | None:
    if type(value) is tuple and len(value) == 4 and all(type(v) is int for v in value):
        return value
    return None


def _remember(cache: dict[Any, PreparedKey], k: Any, pk: PreparedKey) -> PreparedKey:
    """Store ``pk`` under ``k`` in a key cache of at most ``_KEY_CACHE`` entries (emptied when
    full); returns ``pk``."""
    if len(cache) >= _KEY_CACHE:
        cache.clear()
    cache[k] = pk
    return pk


class ShmBackend:
    """:class:`Storage` over a registry's ``cancellations``, ``in_flight`` and ``scope_counts``
    tables. Lock-free reads; writes under the registry lock (``reg.lock``, reentrant per thread).
    Scope counts are keyed by ``blake2b(scope, key=reg.hash_key, digest_size=16)`` so a client
    cannot choose colliding count keys and every count row has one small fixed size.
    """

    def __init__(self, reg: Registry, *, alive: Callable[[int, int], bool] = procinfo.alive):
        self.reg = reg
        self._c = reg.cancellations
        self._f = reg.in_flight
        self._n = reg.scope_counts
        self._lock = reg.lock
        self._hash_key = bytes(reg.hash_key)
        self._alive = alive
        self._ckeys: dict[tuple[str, str], PreparedKey] = {}
        self._fkeys: dict[tuple[str, str], PreparedKey] = {}
        self._nkeys: dict[str, PreparedKey] = {}
        self.config: Config = reg.config
        self.capacity: int = reg.config.capacity  # type: ignore[assignment]

    # --- helpers
    def _digest(self, scope: str) -> bytes:
        return hashlib.blake2b(scope.encode("utf-8"), key=self._hash_key, digest_size=16).digest()

    # Packing and hashing a key costs more than a lookup: keep the last keys prepared (a cancel
    # reads, counts and writes one key several times; a request's end repeats its begin's key).
    def _ck(self, scope: str, rid: str) -> PreparedKey:
        k = (scope, rid)
        pk = self._ckeys.get(k)
        return pk if pk is not None else _remember(self._ckeys, k, self._c.prepare(k))

    def _fk(self, scope: str, rid: str) -> PreparedKey:
        k = (scope, rid)
        pk = self._fkeys.get(k)
        return pk if pk is not None else _remember(self._fkeys, k, self._f.prepare(k))

    def _nk(self, scope: str) -> PreparedKey:
        pk = self._nkeys.get(scope)
        return pk if pk is not None else _remember(
            self._nkeys, scope, self._n.prepare(self._digest(scope)))

    def _add(self, scope: str, delta: int) -> None:
        """Change a scope's count; caller holds the lock."""
        n = self.scope_rows(scope) + delta
        if n > 0:
            self._n.insert(self._nk(scope), n)
        else:
            self._n.delete(self._nk(scope))

    def atomic(self) -> contextlib.AbstractContextManager[Any]:
        return self._lock

    # --- cancellation rows
    def exists(self, scope: str, rid: str) -> bool:
        return self._c.member(self._ck(scope, rid))

    def get(self, scope: str, rid: str) -> tuple[str | None, float] | None:
        v = self._c.get(self._ck(scope, rid))
        row = _cancel_row((scope, rid), v) if v is not None else None
        return None if row is None else (row[2], row[3])

    def watch(self, scope: str, rid: str) -> Poll:
        return self._c.watch(self._ck(scope, rid))

    def rows(self) -> int:
        return self._c.count()

    def scope_rows(self, scope: str) -> int:
        n = self._n.get(self._nk(scope), 0)
        return n if type(n) is int else 0

    def put(self, scope: str, rid: str, reason: str | None, at: float) -> bool:
        key = self._ck(scope, rid)
        with self._lock:
            new = not self._c.member(key)
            if new:
                self._add(scope, +1)  # count first: a crash here leaves it high (stricter)
            try:
                self._c.insert(key, (reason, at))
            except BaseException:
                if new:
                    self._add(scope, -1)
                raise
            return new

    def evict(self, batch: int) -> int:
        with self._lock:
            victims = eviction.choose(((s, i, t) for s, i, _, t in self.cancellations()), batch)
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
            for d, n in self._n.scan():
                if counts.get(d) != n:
                    if d in counts:
                        self._n.insert(d, counts[d])
                    else:
                        self._n.delete(d)
                counts.pop(d, None)
            for d, n in counts.items():
                self._n.insert(d, n)
            return removed

    def cancellations(self) -> list[tuple[str, str, str | None, float]]:
        return [r for r in (_cancel_row(k, v) for k, v in self._c.scan()) if r is not None]

    # --- in-flight rows
    def track(self, scope: str, rid: str, owner: Owner) -> None:
        key = self._fk(scope, rid)
        try:
            self._f.insert(key, owner)
        except TableFull:
            if not self.reap():
                raise
            self._f.insert(key, owner)

    def untrack(self, scope: str, rid: str, owner: Owner) -> bool:
        return self._f.delete_object(self._fk(scope, rid), owner)

    def untrack_thread(self, scope: str, rid: str, pid: int, start: int, tid: int) -> bool:
        key = self._fk(scope, rid)
        mine = [o for o in map(_owner, self._f.lookup(key)) if o and o[:3] == (pid, start, tid)]
        if not mine:
            return False
        # a plain track() row (token 0) first
        return self._f.delete_object(key, min(mine, key=lambda o: o[3] != 0))

    def in_flight(self, scope: str, rid: str) -> bool:
        return self._f.member(self._fk(scope, rid))

    def watch_in_flight(self, scope: str, rid: str) -> Poll:
        """A cached poll of ``in_flight(scope, rid)`` (optional for a store: the policy falls
        back to calling ``in_flight``)."""
        return self._f.watch(self._fk(scope, rid))

    def in_flight_ids(self, scope: str) -> list[str]:
        ids = {k[1] for k, _ in self._f.scan(lambda k, v: type(k) is tuple and k[0] == scope)}
        return sorted(ids)

    def reap(self, pid: int | None = None) -> int:
        # Liveness reads /proc: decide before taking the lock, then delete under it.
        rows = self._f.scan()
        owners = {(o[0], o[1]) for o in (_owner(v) for _, v in rows) if o is not None}
        if pid is not None:
            owners = {o for o in owners if o[0] == pid}
        dead = {o for o in owners if not self._alive(*o)}
        malformed = pid is None and any(_owner(v) is None for _, v in rows)
        if not dead and not malformed:
            return 0

        def gone(key: Any, value: Any) -> bool:
            o = _owner(value)
            return pid is None if o is None else (o[0], o[1]) in dead

        return self._f.delete_where(gone)

    def reap_ended(self, pid: int, start: int, running: Container[int]) -> int:
        def ended(key: Any, value: Any) -> bool:
            o = _owner(value)
            return (o is not None and o[0] == pid and o[1] == start and o[3] != 0
                    and o[3] not in running)

        if not self._f.scan(ended):
            return 0
        # Under the lock ``running`` is read again: a request that began since has its token
        # in it before its row exists (the caller's invariant), so it is never taken for ended.
        return self._f.delete_where(ended)

    # --- janitor
    def claim_sweep(self, now: float, interval: float) -> bool:
        return bool(self.reg.claim_sweep(now, interval))
