"""Cooperative request cancellation across worker processes: the policy (contract §4).

A ``notifications/cancelled`` arrives in another worker than the ``tools/call`` it cancels and
cannot preempt it: the handler records a row in the shared table, the tool polls
``shmcancel.cancelled(conn)`` and stops. Rows are keyed ``(scope, str(request_id))``; scopes
arrive as strings (a conn is read only through the installed :class:`ConnReader`, which
:mod:`shmcancel.mcp.conn` provides).

Invariants:

- ``cancel`` validates the id, then the store records it as one atomic step
  (:meth:`Storage.record`): scope quota (``CancellationLimitReached``, the only bound that
  rejects) → global cap (evict a batch, :mod:`shmcancel.cancel.eviction`) → insert. Overwriting
  a row changes reason and time in place and runs neither check. The policy knows no lock: each
  store operation is atomic by itself, so any :class:`Storage` (shared memory, Redis) serves.
- The transport's lifecycle: :meth:`Cancellation.begin` → :class:`RequestHandle` (never raises;
  ``tracked`` is ``False`` when the in-flight table is full), ``handle.cancelled()`` (lock-free,
  cached), ``handle.cancel_local()`` (exactly this request), ``handle.end()`` (untrack, then
  clear; idempotent).
- :meth:`Cancellation.cancel_if_in_flight` checks and inserts in one store step, so a cancel
  racing the end of its call leaves no row; a handle ignores (and removes) a row older than itself.
- ``end()`` is never lost: on ``LockTimeout`` it is owed (at most ``_OWED_MAX`` per process) and
  landed later; a process removes its own in-flight rows of requests it no longer runs.
- Sweeps ride on calls (``Registry.claim_sweep``, one winner per ``janitor_interval``, scheduled on
  :func:`time.time`); ``clock`` only stamps rows and is ``cleanup``'s ``now``.

Why, at length: docs/design.md ("Hardening edges", "The janitor").
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Generic, Protocol, TypeVar

from .. import telemetry
from ..exceptions import CancellationLimitReached, LockTimeout, ShmCancelError
from ..shm import procinfo
from ..shm.reader import Watch as _Watch
from ..shm.registry import Registry
from . import ids
from .eviction import batch_size
from .reasons import sanitize
from .shm_storage import ShmBackend
from .storage import Owner, Poll, Storage

__all__ = [
    "CANCELLED_EVENT",
    "CLEANUP_EVENT",
    "Cancellation",
    "ConnReader",
    "RequestHandle",
    "owed_ends",
    "read_conns_with",
    "settle_owed",
]

log = logging.getLogger("shmcancel.cancellation")

CANCELLED_EVENT = ("shmcancel", "request", "cancelled")
CLEANUP_EVENT = ("shmcancel", "cancellation", "cleanup")

_now = time.time  # the janitor's schedule (see the module docstring)
_WATCH_CACHE = 1024
#: Cached polls between two clock reads of the janitor check (per Cancellation).
_POLLS_PER_CLOCK = 16
# After a lost claim_sweep, look again after this fraction of the interval.
_RECHECK_FRACTION = 0.125

_tokens = itertools.count(1)
_full_logged = False

# Ends owed to a store (see the module docstring): (store, scope, rid, owner, ended_at).
_OWED_MAX = 1024
_owed: collections.deque[tuple[Storage, str, str, Owner | None, float]] = collections.deque()
_owed_lock = threading.Lock()  # one thread lands owed ends at a time
_dropped_logged = False
#: Tokens of the requests this process runs. A token is added before its row is written and
#: removed when its end begins, so a row whose token is absent belongs to an ended request.
_running: set[int] = set()
#: Called (from the thread that owes) whenever an end becomes owed: a janitor's wake-up.
_owed_listeners: set[Callable[[], None]] = set()


def _reset_after_fork() -> None:
    global _full_logged, _dropped_logged, _owed_lock
    _full_logged = False
    _dropped_logged = False
    _owed.clear()  # the parent's requests: the parent (or the reaper of its rows) ends them
    _running.clear()
    _owed_listeners.clear()  # threads do not survive a fork
    _owed_lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_after_fork)


class ConnReader(Protocol):
    """How a conn (a mapping) names its request and its caller. The transport provides one
    (:mod:`shmcancel.mcp.conn`); the package installs it at import (:func:`read_conns_with`)."""

    def handle(self, conn: Mapping[str, Any]) -> Any: ...
    def request_id(self, conn: Mapping[str, Any]) -> Any: ...
    def scope(self, conn: object) -> str: ...


class _NoConns:
    """Before a transport is installed a conn names no request, and every caller is global."""

    @staticmethod
    def handle(conn: Mapping[str, Any]) -> Any:
        return None

    @staticmethod
    def request_id(conn: Mapping[str, Any]) -> Any:
        return None

    @staticmethod
    def scope(conn: object) -> str:
        return "global"

_conns: ConnReader = _NoConns()


def read_conns_with(reader: ConnReader) -> None:
    """Read conns with ``reader`` in :meth:`Cancellation.scope` and :meth:`Cancellation.cancelled`
    (the scope lookup and the environ keys belong to the transport, above this layer)."""
    global _conns
    _conns = reader


_T = TypeVar("_T")


class _Polls(Generic[_T]):
    """A poll cache: scope -> id as given -> poll (two lookups of cached-hash keys, no tuple
    to build and hash). At most ``_WATCH_CACHE`` polls in all (``n``); emptied when full.
    Only plain ``str`` scopes and valid ids of exact types ``int`` or ``str`` enter: a
    cached poll is trusted without validating the id again. ``m`` is the outer map, a plain
    ``dict`` (subscripting a ``dict`` subclass misses the interpreter's fast path) that stays
    the same object for the cache's life, so the hot path may hold it."""

    __slots__ = ("m", "n")

    def __init__(self) -> None:
        self.m: dict[str, dict[object, _T]] = {}
        self.n = 0

    def values(self) -> Iterable[dict[object, _T]]:
        return self.m.values()

    def find(self, scope: str, x: object) -> _T | None:
        ws = self.m.get(scope)
        return None if ws is None else ws.get(x)

    def add(self, scope: str, x: object, v: _T) -> _T:
        m = self.m
        if self.n >= _WATCH_CACHE:
            m.clear()
            self.n = 0
        ws = m.get(scope)
        if ws is None:
            ws = m[scope] = {}
        if x not in ws:
            self.n += 1
        ws[x] = v
        return v


def _valid_scope(scope: object) -> bool:
    return type(scope) is str or isinstance(scope, str)


class Cancellation:
    """The cancellation policy over one registry (contract §4). Cheap to construct; thread-safe.

    ``backend`` defaults to :class:`~shmcancel.cancel.shm_storage.ShmBackend` over ``registry``.
    """

    def __init__(
        self,
        registry: Registry | None,
        clock: Callable[[], float] = time.time,
        *,
        backend: Storage | None = None,
    ) -> None:
        if backend is None:
            if registry is None:
                raise TypeError("Cancellation needs a registry or a backend")
            backend = ShmBackend(registry)
        self.registry = registry
        self.clock = clock
        self._store: Storage = backend
        cfg = backend.config
        self.config = cfg
        self._quota: int | None = cfg.max_rows_per_scope
        self._cap: int = cfg.effective_max_rows
        # effective_max_rows is capacity exactly when max_rows is None
        self._batch = batch_size(cfg.max_rows, cfg.effective_max_rows)
        self._interval: float = cfg.janitor_interval
        self._next_check = -math.inf
        self._polls = 0  # cached polls left before the next clock read (see the module doc)
        # scope -> id as given -> cached poll, so repeated polls skip validating, packing and
        # hashing; only ids and scopes of the exact types int/str and str enter (see cancelled)
        self._watches: _Polls[Poll] = _Polls()
        self._in_flight_polls: _Polls[Callable[[], bool]] = _Polls()
        self._watch_map = self._watches.m  # the hot path's plain dicts (see _Polls)
        self._in_flight_map = self._in_flight_polls.m

    def __repr__(self) -> str:
        return f"<Cancellation over {self.registry!r}>"

    # --- scope
    @staticmethod
    def scope(conn: object) -> str:
        """The caller's scope (contract §3): session → principal → ip bucket; ``"global"`` for
        a non-mapping (read by the installed :class:`ConnReader`)."""
        return _conns.scope(conn)

    # --- cancellation rows
    def cancel(self, request_id: object, reason: object = None, scope: str = "global") -> None:
        """Record that ``request_id`` in ``scope`` is cancelled.

        ``None`` is a no-op. Raises :class:`~shmcancel.InvalidRequestId` for an invalid id and
        :class:`~shmcancel.CancellationLimitReached` when the scope holds ``max_rows_per_scope``
        rows already, writing nothing in either case. Emits ``("shmcancel", "request",
        "cancelled")``.
        """
        if request_id is None:
            return
        self._record(request_id, reason, scope, only_in_flight=False)

    def cancel_if_in_flight(self, request_id: object, reason: object = None,
                            scope: str = "global") -> bool:
        """:meth:`cancel`, but only while ``request_id`` is in flight in ``scope``; the check and
        the insert are one store step (:meth:`Storage.record`), so a request ending meanwhile
        leaves no row. Returns whether a row was recorded (``False`` for ``None`` or a request
        not in flight). Raises as :meth:`cancel` does, and :class:`~shmcancel.LockTimeout`."""
        if request_id is None:
            return False
        return self._record(request_id, reason, scope, only_in_flight=True)

    def _record(self, request_id: object, reason: object, scope: str, *,
                only_in_flight: bool) -> bool:
        rid = ids.require_key(request_id)
        if not _valid_scope(scope):
            raise TypeError(f"scope must be a str, got {type(scope).__name__}")
        scope = str.__str__(scope)
        text = sanitize(reason)
        if not self._store.record(scope, rid, text, self.clock, quota=self._quota, cap=self._cap,
                                  batch=self._batch, only_in_flight=only_in_flight):
            return False
        telemetry.execute(
            CANCELLED_EVENT, {"count": 1}, {"request_id": rid, "scope": scope, "reason": text}
        )
        self._tick()
        return True

    def cancelled(self, conn_or_request_id: object, scope: str = "global") -> bool:
        """Whether the request is cancelled. With a conn (a mapping): its handle when it has
        one, else its ``"shmcancel.request_id"`` in ``scope(conn)`` (no request id → ``False``).
        Otherwise the argument is the request id, looked up in ``scope``. Never raises."""
        try:
            x = conn_or_request_id
            t = type(x)
            if t is not int and t is not str:
                if t is not dict and not isinstance(x, Mapping):
                    return self._cancelled(x, scope)
                h = _conns.handle(x)  # type: ignore[arg-type]
                if h is not None and isinstance(h, RequestHandle) and h._c._store is self._store:
                    return h.cancelled()
                scope = _conns.scope(x)
                x = _conns.request_id(x)  # type: ignore[arg-type]
                t = type(x)
                if t is not int and t is not str:
                    return self._cancelled(x, scope)
            # Fast path: an id and scope of the exact types, polled before. The cache is keyed
            # by the id as given (42 and "42" are two entries watching the one row); only valid
            # ids of exact types enter it, so a bool, float or subclass never matches here.
            if type(scope) is str:
                try:
                    w = self._watch_map[scope][x]
                except KeyError:
                    pass
                else:
                    n = self._polls = self._polls - 1
                    if n < 0:
                        self._poll_tick()
                    if w.__class__ is _Watch and w._ver[w._b] == w._v:
                        return w._member  # Watch.member()'s own first line, without the call
                    return w.member()
            return self._cancelled(x, scope)
        except Exception:
            log.debug("cancelled() failed", exc_info=True)
            return False

    def _cancelled(self, x: object, scope: str) -> bool:
        """:meth:`cancelled`'s general path for an id (the conn already resolved): one not
        cached yet, or not of an exact type."""
        rid = ids.key(x)
        if rid is None or (type(scope) is not str and not isinstance(scope, str)):
            return False
        scope = str.__str__(scope)  # cache keys hold plain str only
        self._tick()
        k = x if type(x) is int or type(x) is str else rid  # as the fast path looks it up
        w = self._watches.find(scope, k)
        if w is None:
            w = self._watches.add(scope, k, self._store.watch(scope, rid))
        return w.member()

    def reason(self, request_id: object, scope: str = "global") -> str | None:
        """The stored reason of a cancelled request; ``None`` when not cancelled, cancelled
        without a reason, or the id is invalid."""
        row = self._row(request_id, scope)
        return None if row is None else row[0]

    def cancelled_at(self, request_id: object, scope: str = "global") -> float | None:
        """When the request was cancelled (``clock`` seconds), or ``None``."""
        row = self._row(request_id, scope)
        return None if row is None else row[1]

    def _row(self, request_id: object, scope: str) -> tuple[str | None, float] | None:
        """The stored ``(reason, cancelled_at)`` of the request; ``None`` when not cancelled or
        the id or scope is invalid."""
        rid = ids.key(request_id)
        if rid is None or not _valid_scope(scope):
            return None
        self._tick()
        return self._store.get(scope, rid)

    def clear(self, request_id: object, scope: str = "global") -> None:
        """Remove the ``(scope, id)`` cancellation row. Reads first: when there is no row (the
        common case) no lock is taken. Invalid ids are ignored."""
        rid = ids.key(request_id)
        if rid is None or not _valid_scope(scope):
            return
        self._tick()
        self._store.clear(scope, rid)

    def cancel_scope(self, scope: str, reason: object = None) -> int:
        """Cancel every request in flight in ``scope`` (a session's ``DELETE``). Returns how many
        were recorded; stops quietly at the scope's quota."""
        if not _valid_scope(scope):
            return 0
        n = 0
        for rid in self._store.in_flight_ids(scope):
            try:
                # each one atomically: a request that ended since the scan gets no row
                n += self.cancel_if_in_flight(rid, reason, scope)
            except CancellationLimitReached:
                log.warning("cancel_scope(%r): quota reached after %d requests", scope[:80], n)
                break
        return n

    # --- in-flight rows
    def track(self, request_id: object, scope: str = "global") -> None:
        """Mark ``request_id`` in flight in ``scope`` for the calling process and thread.

        Raises :class:`~shmcancel.TableFull` when ``in_flight_capacity`` rows are held even after
        dead owners' rows are removed. Invalid ids are ignored. Prefer :meth:`begin`.
        """
        rid = ids.key(request_id)
        if rid is None or not _valid_scope(scope):
            return
        pid, start = procinfo.me()
        self._store.track(scope, rid, (pid, start, threading.get_ident(), 0))
        self._tick()

    def untrack(self, request_id: object, scope: str = "global") -> None:
        """Remove the calling thread's own in-flight row for the key (one of them), leaving
        namesakes run by other threads or processes in flight."""
        rid = ids.key(request_id)
        if rid is None or not _valid_scope(scope):
            return
        pid, start = procinfo.me()
        self._store.untrack_thread(scope, rid, pid, start, threading.get_ident())
        self._tick()

    def in_flight(self, request_id: object, scope: str = "global") -> bool:
        """True while any in-flight row exists for ``(scope, id)``. Never raises."""
        try:
            # cached per (scope, id as given) like cancelled()'s watches: exact types only
            if type(scope) is str and (type(request_id) is int or type(request_id) is str):
                try:
                    p = self._in_flight_map[scope][request_id]
                except KeyError:
                    pass
                else:
                    n = self._polls = self._polls - 1
                    if n < 0:
                        self._poll_tick()
                    return p()
            rid = ids.key(request_id)
            if rid is None or not _valid_scope(scope):
                return False
            self._tick()
            st = self._store
            watch = getattr(st, "watch_in_flight", None)
            f: Callable[[], bool] = (watch(scope, rid).member if watch is not None
                                     else functools.partial(st.in_flight, scope, rid))
            if type(scope) is str and (type(request_id) is int or type(request_id) is str):
                self._in_flight_polls.add(scope, request_id, f)
            return f()
        except Exception:
            log.debug("in_flight() failed", exc_info=True)
            return False

    def begin(self, request_id: object, scope: str) -> RequestHandle:
        """Track a dispatched request and return its :class:`RequestHandle`. Never raises: when
        the request cannot be tracked (full in-flight table, invalid id) the handle has
        ``tracked = False`` and still honours :meth:`RequestHandle.cancel_local`."""
        return RequestHandle(self, request_id, scope)

    # --- cleanup and the janitor
    def cleanup(self, ttl: float | None = None) -> int:
        """Remove cancellation rows older than ``ttl`` (strictly: ``now - cancelled_at > ttl``;
        default ``Config.ttl``) and in-flight rows whose owner process is gone, or whose request
        ended in this (live) process without its row going (an owed end dropped). Returns the
        number of cancellation rows removed; emits ``("shmcancel", "cancellation", "cleanup")``
        with both counts."""
        return self.sweep(ttl)[0]

    def sweep(self, ttl: float | None = None) -> tuple[int, int]:
        """:meth:`cleanup`, returning ``(cancellation rows removed, in-flight rows removed)``."""
        if ttl is None:
            ttl = self.config.ttl
        elif isinstance(ttl, bool) or not isinstance(ttl, int | float) or math.isnan(ttl):
            raise ValueError(f"ttl must be a number of seconds, got {ttl!r}")
        if self.registry is not None:  # header counters plausible, else recounted (fsck)
            self.registry.check()
        removed = self._store.expire(self.clock(), float(ttl))
        in_flight_removed = self._store.reap() + self._reap_ended()
        telemetry.execute(
            CLEANUP_EVENT, {"removed": removed, "in_flight_removed": in_flight_removed}, {}
        )
        return removed, in_flight_removed

    def reap(self, pid: int | None = None) -> int:
        """Remove in-flight rows of dead owners now (only ``pid``'s when given: what gunicorn's
        master calls from ``child_exit``). Returns the rows removed."""
        return self._store.reap(pid)

    def tick(self) -> bool:
        """Sweep now if this process wins the interval's claim (``Registry.claim_sweep``: one
        winner per ``janitor_interval`` across processes). Returns whether it swept. What the
        janitor does on the back of calls, and what
        :class:`shmcancel.cancel.janitor.Janitor` calls."""
        now = _now()
        stalled = False
        try:
            won = self._store.claim_sweep(now, self._interval)
        except Exception as e:  # a stalled lock is one line: expected, and nothing to debug
            log.warning("janitor: claim_sweep failed: %s", e,
                        exc_info=not isinstance(e, LockTimeout))
            won, stalled = False, isinstance(e, LockTimeout)
        self._next_check = now + self._interval * (1.0 if won else _RECHECK_FRACTION)
        if won:
            try:
                self.sweep()
            except Exception as e:
                log.warning("janitor: cleanup failed: %s", e,
                            exc_info=not isinstance(e, LockTimeout))
        if not stalled:  # a stalled lock would only make the settling wait once more
            self.settle()
        return won

    def settle(self) -> int:
        """Land the ends this process owes (see the module docstring), then remove this
        process's in-flight rows whose request ended. Returns the rows settled (ends landed
        plus rows removed). Never raises; a :class:`~shmcancel.LockTimeout` leaves the rest
        owed for the next try."""
        n = settle_owed()
        try:
            n += self._reap_ended()
        except Exception as e:
            log.warning("removing ended requests' rows failed: %s", e,
                        exc_info=not isinstance(e, LockTimeout))
        return n

    def _reap_ended(self) -> int:
        pid, start = procinfo.me()
        return self._store.reap_ended(pid, start, _running)

    def _poll_tick(self) -> None:
        """The janitor check of a cached poll, once per ``_POLLS_PER_CLOCK`` of them."""
        self._polls = _POLLS_PER_CLOCK - 1
        self._tick()

    def _tick(self) -> None:
        """The janitor's piggy-back on every call, reads included (they count as use of the
        registry, contract §4.6): one clock read and a comparison until this process's next
        check."""
        if _now() >= self._next_check:
            self.tick()


class RequestHandle:
    """One dispatched request, as the transport holds it (see the module docstring).

    ``request_id`` (as given), ``scope``, ``tracked``, ``error`` (why it is not tracked, or
    ``None``; a :class:`~shmcancel.LockTimeout` there means the registry is stalled).
    ``cancelled()`` is the hot poll; ``cancel_local(reason)`` cancels this request only, in this
    process; ``end()`` untracks then clears, is idempotent and never raises.

    ``began`` is the ``clock`` before the row was written: a cancellation is recorded only
    while the request is in flight, hence at or after ``began``; a row with an older
    ``cancelled_at`` is a leftover of an earlier namesake, never this request's.
    """

    __slots__ = (
        "_c", "_ended", "_local", "_local_reason", "_owner", "_rid", "_stale_at", "_token",
        "_watch", "began", "error", "request_id", "scope", "tracked",
    )

    def __init__(self, c: Cancellation, request_id: object, scope: str) -> None:
        self._c = c
        self.request_id = request_id
        self.scope = scope
        self.tracked = False
        # end() runs from the request's finally and from the disconnect watcher's stop: the
        # first caller to take this lock ends the request, any other returns at once.
        self._ended = threading.Lock()
        self._local = False
        self._local_reason: str | None = None
        self._owner: Owner | None = None
        self._watch: Poll | None = None
        self._token = 0
        self._stale_at: float | None = None
        self.error: ShmCancelError | None = None
        self.began = c.clock()
        rid = self._rid = ids.key(request_id) if _valid_scope(scope) else None
        if rid is None:
            return
        token = self._token = next(_tokens)
        _running.add(token)  # before the row exists: see _running
        try:
            pid, start = procinfo.me()
            owner = (pid, start, threading.get_ident(), token)
            c._store.track(scope, rid, owner)
            self._owner = owner
            self.tracked = True
        except LockTimeout as e:
            self.error = e
            _running.discard(token)
            log.warning("a request could not be tracked: %s", e)
        except ShmCancelError as e:
            self.error = e
            _running.discard(token)
            _log_untracked(e)
        else:
            if _owed:
                settle_owed()  # the lock answered: land what this process owes
        c._tick()

    def __repr__(self) -> str:
        return (f"<RequestHandle {self.scope!r} {self._rid!r} tracked={self.tracked} "
                f"cancelled={self.cancelled()}>")

    def cancelled(self) -> bool:
        """True once this request was cancelled, here or by any process. Lock-free; never
        raises. Once true it stays true (it latches: a namesake's ``end()``, an eviction or the
        janitor removing the shared row afterwards does not un-cancel a running tool)."""
        if self._local:
            return True
        try:
            w = self._watch
            if w.__class__ is _Watch and w._ver[w._b] == w._v and not w._member:
                pass  # the hot path: Watch.member()'s first line, without the call
            elif w is not None or self._rid is not None:
                if w is None:  # made on the first poll: many tools never poll
                    w = self._watch = self._c._store.watch(self.scope, self._rid)  # type: ignore[arg-type]
                if w.member() and self._latch():
                    return True
            c = self._c
            n = c._polls = c._polls - 1
            if n < 0:
                c._poll_tick()
        except Exception:
            return False
        return False

    def _latch(self) -> bool:
        """The shared row was seen: latch it unless it is older than this request (then
        remove that old row, once, and return ``False``)."""
        row = None
        if self._rid is not None:
            try:
                row = self._c._store.get(self.scope, self._rid)
            except Exception:
                row = None
        if row is not None and row[1] < self.began:
            if row[1] != self._stale_at:  # try each old row once: the poll must not block
                self._stale_at = row[1]
                try:
                    self._c._store.clear_before(self.scope, self._rid, self.began)  # type: ignore[arg-type]
                except Exception:
                    log.debug("removing a stale cancellation row failed", exc_info=True)
            return False
        self._local_reason = row[0] if row is not None else None
        self._local = True
        return True

    def cancel_local(self, reason: object = None) -> None:
        """Cancel exactly this request, in this process only (a client disconnect). Emits the
        ``cancelled`` telemetry event with ``"local": True`` in its metadata."""
        if self._local:
            return
        self._local_reason = sanitize(reason)
        self._local = True
        telemetry.execute(
            CANCELLED_EVENT,
            {"count": 1},
            {"request_id": self._rid if self._rid is not None else repr(self.request_id),
             "scope": self.scope, "reason": self._local_reason, "local": True},
        )

    def reason(self) -> str | None:
        """The shared row's reason when one exists, else the one latched or given to
        :meth:`cancel_local` (or ``None``)."""
        if self._rid is not None:
            try:
                row = self._c._store.get(self.scope, self._rid)
            except Exception:
                row = None
            if row is not None and row[1] >= self.began:
                return row[0]
        return self._local_reason

    def end(self) -> None:
        """Untrack this request's own row, then clear the key's cancellation row. Idempotent;
        logs and swallows storage errors (it runs in a ``finally``)."""
        if not self._ended.acquire(blocking=False):
            return
        rid = self._rid
        if rid is None:
            return
        _running.discard(self._token)
        c = self._c
        st = c._store
        try:
            ended_at = c.clock()
            if self._owner is not None:
                st.untrack(self.scope, rid, self._owner)
            # Skip the clear's own read when cheaper evidence says there is no row: a polled
            # handle's watch (one load), else the scope's count, never below its rows (a row
            # left by a wrong count is a leftover the next namesake's first poll removes).
            w = self._watch
            if w.member() if w is not None else st.scope_rows(self.scope) > 0:
                st.clear(self.scope, rid)
        except LockTimeout as e:
            _owe(st, self.scope, rid, self._owner, ended_at)
            log.warning("ending request %r in %r: %s; retried later", rid, self.scope[:80], e)
        except Exception:
            log.warning("ending request %r in %r failed", rid, self.scope[:80], exc_info=True)
        else:
            if _owed:
                settle_owed()

    def __enter__(self) -> RequestHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.end()


def _owe(st: Storage, scope: str, rid: str, owner: Owner | None, ended_at: float) -> None:
    """Queue an end that could not land. At ``_OWED_MAX`` the oldest is dropped (logged once
    per process): its in-flight row is still removed by :meth:`Cancellation.settle`."""
    global _dropped_logged
    if len(_owed) >= _OWED_MAX:
        with contextlib.suppress(IndexError):
            _owed.popleft()
        if not _dropped_logged:
            _dropped_logged = True
            log.warning("more than %d request ends are owed to a stalled registry; the oldest "
                        "are dropped (their rows are reaped later). (Logged once per process.)",
                        _OWED_MAX)
    _owed.append((st, scope, rid, owner, ended_at))
    for wake in list(_owed_listeners):
        try:
            wake()
        except Exception:
            log.debug("an owed-end listener failed", exc_info=True)


def owed_ends() -> int:
    """How many request ends this process still owes to a registry (see the module docstring)."""
    return len(_owed)


def _land(st: Storage, scope: str, rid: str, owner: Owner | None, ended_at: float) -> None:
    """An owed end, as one store operation (:meth:`Storage.end`)."""
    st.end(scope, rid, owner, ended_at)


def settle_owed() -> int:
    """Land the ends this process owes, oldest first; stops at the first
    :class:`~shmcancel.LockTimeout` (the rest stay owed). Other errors drop that end (logged).
    One thread at a time (another caller returns 0 at once). Returns the ends landed."""
    lock = _owed_lock
    if not _owed or not lock.acquire(blocking=False):
        return 0
    n = 0
    try:
        for _ in range(len(_owed)):  # bounded: ends owed meanwhile wait for the next call
            try:
                entry = _owed[0]
            except IndexError:
                break
            try:
                _land(*entry)
            except LockTimeout:
                break
            except Exception:
                log.warning("dropping an owed request end", exc_info=True)
            else:
                n += 1
            if _owed and _owed[0] is entry:  # _owe may have dropped it meanwhile
                _owed.popleft()
    finally:
        lock.release()
    return n


def _log_untracked(e: Exception) -> None:
    global _full_logged
    if not _full_logged:
        _full_logged = True
        log.warning(
            "a request could not be tracked (%s); it runs uncancellable by notifications. "
            "Raise Config.in_flight_capacity. (Logged once per process.)", e,
        )
