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

import functools
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any, Generic, Protocol, TypeVar

from .. import telemetry
from ..exceptions import LockTimeout, RegistryClosed
from ..shm import procinfo
from ..shm.reader import Watch as _Watch
from ..shm.registry import Registry
from ..telemetry import _handlers as _listeners
from . import ids, owed
from .eviction import batch_size
from .handle import CANCELLED_EVENT, POLLS_PER_CLOCK, RequestHandle, valid_scope
from .owed import owed_ends, settle_owed
from .reasons import sanitize
from .shm_storage import ShmBackend
from .storage import Poll, Storage, clock_seconds
from .tables import SCOPE_MAX

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

CLEANUP_EVENT = ("shmcancel", "cancellation", "cleanup")

_now = time.time  # the janitor's schedule (see the module docstring)
_WATCH_CACHE = 1024
# After a lost claim_sweep, look again after this fraction of the interval.
_RECHECK_FRACTION = 0.125

class ConnReader(Protocol):
    """How a conn (a mapping) names its request and its caller. The transport provides one
    (:mod:`shmcancel.mcp.conn`); the package installs it at import (:func:`read_conns_with`).

    ``REQUEST_ID_KEY`` is the conn key of the request id; ``POLL_KEY`` the key under which
    :meth:`Cancellation.cancelled` keeps, in a ``dict`` conn without a handle, the poll it
    resolved (valid while the conn's request id and the values under ``SCOPE_KEYS`` stay the
    same objects); ``SCOPE_KEYS``: the keys of the session id, the principal (a dict whose
    ``"id"`` is read) and the client address, from which :meth:`scope` reads a conn's
    scope."""

    REQUEST_ID_KEY: str
    POLL_KEY: str
    SCOPE_KEYS: tuple[str, str, str]

    def handle(self, conn: Mapping[str, Any]) -> Any: ...
    def request_id(self, conn: Mapping[str, Any]) -> Any: ...
    def scope(self, conn: object) -> str: ...


class _NoConns:
    """Before a transport is installed a conn names no request, and every caller is global."""

    REQUEST_ID_KEY = POLL_KEY = ""
    SCOPE_KEYS = ("", "", "")

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
_instances = itertools.count(1)  # numbers the conn keys of Cancellation instances
_rid_key = _poll_key = _sid_key = _pr_key = _addr_key = ""  # the reader's keys, as globals
# for the hot path


def read_conns_with(reader: ConnReader) -> None:
    """Read conns with ``reader`` in :meth:`Cancellation.scope` and :meth:`Cancellation.cancelled`
    (the scope lookup and the environ keys belong to the transport, above this layer)."""
    global _conns, _rid_key, _poll_key, _sid_key, _pr_key, _addr_key
    _conns = reader
    _rid_key, _poll_key = reader.REQUEST_ID_KEY, reader.POLL_KEY
    _sid_key, _pr_key, _addr_key = reader.SCOPE_KEYS


class _HotPoll(Protocol):
    """What the poll caches hold: a :class:`~shmcancel.shm.reader.Watch`, or a :class:`_Cached`
    store poll. ``_ver[_b] == _v`` means "unchanged, answer ``_member``"."""

    @property
    def _ver(self) -> Sequence[int]: ...
    @property
    def _b(self) -> int: ...
    @property
    def _v(self) -> int: ...
    @property
    def _member(self) -> bool: ...
    def member(self) -> bool: ...


class _Cached:
    """A store's poll that is not a :class:`~shmcancel.shm.reader.Watch`, given the attributes
    the hot paths of :meth:`Cancellation.cancelled` read first, so that they need no type check:
    ``_ver[_b] == _v`` never holds, so ``member()`` always runs."""

    __slots__ = ("_member", "member")
    _ver: Sequence[int] = (0,)
    _b = 0
    _v = -1

    def __init__(self, poll: Poll) -> None:
        self._member = False
        self.member = poll.member


class _ConnPoll:
    """What :meth:`Cancellation.cancelled` keeps in a conn without a handle, under a key of its
    Cancellation's own (``POLL_KEY#n``, so no other instance's poll is ever taken for it; the
    conn's ``POLL_KEY`` names that key, and one instance's poll replaces another's): the
    poll ``w`` of request id ``rid``, valid while the conn's request id and the values its
    scope was read from (``sid``, ``pr``, ``addr`` under the reader's ``SCOPE_KEYS``, and
    ``pid``, the principal's ``"id"``) are the same objects: the same request in the same
    scope. ``plain``: the conn had an address but neither a session nor a principal key (the
    scope is the address's while it still has neither: two membership tests instead of three
    lookups)."""

    __slots__ = ("addr", "pid", "plain", "pr", "rid", "sid", "w")

    def __init__(self, rid: object, w: _HotPoll, conn: dict[str, Any]) -> None:
        self.rid = rid
        self.w = w
        self.sid = conn.get(_sid_key)
        self.pr = pr = conn.get(_pr_key)
        self.pid = pr.get("id") if pr is not None else None
        self.addr = conn.get(_addr_key)
        self.plain = _sid_key not in conn and _pr_key not in conn and _addr_key in conn


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


class Cancellation:
    """The cancellation policy over one registry (contract §4). Cheap to construct; thread-safe.

    ``backend`` defaults to :class:`~shmcancel.cancel.shm_storage.ShmBackend` over ``registry``.
    """

    #: Whether the cancellations recorded here are reported (``("shmcancel", "request",
    #: "cancelled")``); a store that only relays them to where the request runs, which reports
    #: them itself, says no (the Redis bridge's :class:`~shmcancel.redis.RedisCancellation`).
    _reports = True

    def __init__(
        self,
        registry: Registry | None,
        clock: Callable[[], float] = time.time,
        *,
        backend: Storage | None = None,
    ) -> None:
        if registry is not None and not isinstance(registry, Registry):
            raise TypeError(f"Cancellation needs a Registry (Registry.create or attach), got "
                            f"{type(registry).__name__}")
        if not callable(clock):
            raise TypeError(f"clock must be callable, got {type(clock).__name__}")
        if backend is None:
            if registry is None:
                raise TypeError("Cancellation needs a registry or a backend")
            backend = ShmBackend(registry)
        self.registry = registry
        self.clock = clock
        self._store: Storage = backend
        self._forgo_owed_untrack = not getattr(backend, "track_rows_per_call", False)
        cfg = backend.config
        self.config = cfg
        self._quota: int | None = cfg.max_rows_per_scope
        self._cap: int = cfg.effective_max_rows
        # effective_max_rows is capacity exactly when max_rows is None
        self._batch = batch_size(cfg.max_rows, cfg.effective_max_rows)
        self._interval: float = cfg.janitor_interval
        self._next_check = -math.inf
        # the cached polls' janitor check, once per POLLS_PER_CLOCK of them, the first at once
        # (next() on a C iterator: half the cost of a countdown kept in an attribute)
        self._ticks = itertools.cycle((True,) + (False,) * (POLLS_PER_CLOCK - 1))
        # scope -> id as given -> cached poll, so repeated polls skip validating, packing and
        # hashing; only ids and scopes of the exact types int/str and str enter (see cancelled)
        self._watches: _Polls[_HotPoll] = _Polls()
        self._in_flight_polls: _Polls[Callable[[], bool]] = _Polls()
        self._watch_map = self._watches.m  # the hot path's plain dicts (see _Polls)
        self._in_flight_map = self._in_flight_polls.m
        # where this instance keeps a conn's poll: POLL_KEY + "#" + a number unique in the
        # process (a key no conn has until the first store, see cancelled)
        self._conn_key: Any = object()

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
        if request_id is not None:
            self._record(ids.require_key(request_id), reason, scope, False, self._quota,
                         self.clock)

    def cancel_if_in_flight(self, request_id: object, reason: object = None,
                            scope: str = "global") -> bool:
        """:meth:`cancel`, but only while ``request_id`` is in flight in ``scope``; the check and
        the insert are one store step (:meth:`Storage.record`), so a request ending meanwhile
        leaves no row. Returns whether a row was recorded (``False`` for ``None`` or a request
        not in flight). Raises as :meth:`cancel` does, and :class:`~shmcancel.LockTimeout`."""
        if request_id is None:
            return False
        return self._record(ids.require_key(request_id), reason, scope, True, self._quota,
                            self.clock)

    def cancel_key_if_in_flight(self, key: str, reason: object = None,
                                scope: str = "global", at: float | None = None, *,
                                report: bool = True) -> bool:
        """:meth:`cancel_if_in_flight` of the request whose row key is ``key``: the text
        :func:`~shmcancel.cancel.ids.key` made of its id, as a store or another host hands it
        back (a long int's key is no valid id itself, so it is not validated as one). ``at``:
        when the cancellation was made (``clock`` seconds; elsewhere, then carried here), the
        row's ``cancelled_at`` instead of now: a request of the id that began after it ignores
        it. ``report=False``: no event (the cancellation was reported where it was made).
        Raises :class:`~shmcancel.InvalidRequestId` for a text no valid id is keyed by."""
        return self._record(ids.require_row_key(key), reason, scope, True, self._quota,
                            self.clock if at is None else lambda: at, report)

    def _record(self, rid: str, reason: object, scope: str, only_in_flight: bool,
                quota: int | None, clock: Callable[[], float], report: bool = True) -> bool:
        """Record row key ``rid`` (already validated: :func:`ids.require_key`), stamped with
        ``clock()``; its event unless ``report`` is False (or this object reports none)."""
        # valid_scope's common case inlined: every cancellation comes here
        if type(scope) is not str or not scope.isascii() or len(scope) > SCOPE_MAX:
            if not valid_scope(scope):
                if not isinstance(scope, str):
                    raise TypeError(f"scope must be a str, got {type(scope).__name__}")
                raise ValueError(f"scope must be at most {SCOPE_MAX} UTF-8 bytes (and "
                                 f"encodable: no lone surrogate), got {scope[:40]!r}"
                                 + ("..." if len(scope) > 40 else ""))
            scope = str.__str__(scope)
        text = sanitize(reason)
        if not self._store.record(scope, rid, text, clock, quota=quota, cap=self._cap,
                                  batch=self._batch, only_in_flight=only_in_flight):
            self._tick()  # a call that wrote nothing is use of the registry too (§4.6)
            return False
        if owed.queue:
            settle_owed()  # the lock answered: land what this process owes
        if _listeners and report and self._reports:  # telemetry.listening(), inlined
            telemetry.execute(CANCELLED_EVENT, {"count": 1},
                              {"request_id": rid, "scope": scope, "reason": text})
        now = _now()  # _tick, inlined: every cancellation comes here
        if now >= self._next_check or self._next_check - now > self._interval:
            self.tick()
        return True

    def cancelled(self, conn_or_request_id: object, scope: str = "global") -> bool:
        """Whether the request is cancelled. With a conn (a mapping): its handle when it has
        one, else its ``"shmcancel.request_id"`` in ``scope(conn)`` (no request id → ``False``).
        Otherwise the argument is the request id, looked up in ``scope``. Never raises.

        A ``dict`` conn without a handle keeps the poll its first call resolved, under
        ``ConnReader.POLL_KEY + "#n"`` (``n`` numbers this instance), for as long as its
        request id and the values its scope is read from stay the same objects: a conn given a
        principal or a session, or reused for another request, is resolved again."""
        try:
            x: Any = conn_or_request_id
            t = type(x)
            if t is dict:
                try:
                    e = x[self._conn_key]
                    # The same request (id) in the same scope (what the scope is read from): a
                    # conn reused for another request, or given a principal or a session since,
                    # is resolved again below.
                    if (x[_rid_key] is e.rid
                            and ((x[_addr_key] is e.addr and _sid_key not in x
                                  and _pr_key not in x) if e.plain
                                 else (x.get(_addr_key) is e.addr and x.get(_sid_key) is e.sid
                                       and x.get(_pr_key) is e.pr
                                       and (e.pr is None or e.pr.get("id") is e.pid)))):
                        w = e.w
                        if next(self._ticks):
                            self._tick()
                        if w._ver[w._b] == w._v:  # Watch.member()'s first line (see _Cached)
                            return w._member
                        return w.member()
                except (KeyError, AttributeError):  # no poll kept, or the id or address gone
                    pass
            elif t is int or t is str:
                # Fast path: an id of an exact type polled before in this scope. The cache is
                # keyed by the id as given (42 and "42" are two entries watching the one row);
                # only valid ids of exact types and scopes of exact type str enter it, so a
                # bool, float or subclass id never gets here, and a scope that is not a str
                # matches no entry (or raises, unhashable: not a valid scope either).
                try:
                    w = self._watch_map[scope][x]
                except KeyError:
                    return self._cancelled(x, scope)
                if next(self._ticks):
                    self._tick()
                if w._ver[w._b] == w._v:  # Watch.member()'s own first line (see _Cached)
                    return w._member
                return w.member()
            elif not isinstance(x, Mapping):
                return self._cancelled(x, scope)
            h = _conns.handle(x)
            if h is not None and isinstance(h, RequestHandle) and h._c._store is self._store:
                return h.cancelled()
            scope = _conns.scope(x)
            rid = _conns.request_id(x)
            cw = self._watch_of(rid, scope)
            if cw is None:
                return False
            if t is dict and h is None and _poll_key:
                pr = x.get(_pr_key)
                if pr is None or type(pr) is dict:  # another mapping may change unseen
                    k = self._conn_key
                    if type(k) is not str:
                        k = self._conn_key = f"{_poll_key}#{next(_instances)}"
                    # POLL_KEY names the one instance key a conn holds: another instance's
                    # poll goes when this one's comes (a conn polled by a new Cancellation
                    # each time keeps two keys, not one per instance)
                    old = x.get(_poll_key)
                    if type(old) is not str or old != k:  # (no __eq__ of a stranger's runs)
                        if type(old) is str and old.startswith(_poll_key + "#"):
                            x.pop(old, None)
                        x[_poll_key] = k
                    x[k] = _ConnPoll(rid, cw, x)
            return cw.member()
        except Exception:
            log.debug("cancelled() failed", exc_info=True)
            return False

    def _cancelled(self, x: object, scope: str) -> bool:
        """:meth:`cancelled`'s general path for an id (the conn already resolved): one not
        cached yet, or not of an exact type."""
        w = self._watch_of(x, scope)
        return False if w is None else w.member()

    def _watch_of(self, x: object, scope: str) -> _HotPoll | None:
        """The cached poll of id ``x`` in ``scope`` (made and cached when new); ``None`` for an
        invalid id or scope."""
        rid = ids.key(x)
        if rid is None or (type(scope) is not str and not isinstance(scope, str)):
            return None
        scope = str.__str__(scope)  # cache keys hold plain str only
        self._tick()
        k = x if type(x) is int or type(x) is str else rid  # as the fast path looks it up
        w = self._watches.find(scope, k)
        if w is None:
            p = self._store.watch(scope, rid)
            w = p if isinstance(p, _Watch) else _Cached(p)
            self._watches.add(scope, k, w)
        return w

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
        if rid is None or not valid_scope(scope):
            return None
        self._tick()
        return self._store.get(str.__str__(scope), rid)  # a str subclass reads as its text

    def clear(self, request_id: object, scope: str = "global") -> None:
        """Remove the ``(scope, id)`` cancellation row. Reads first: when there is no row (the
        common case) no lock is taken. Invalid ids are ignored.

        Never lost (contract §4.3): when the lock cannot be had in time
        (:class:`~shmcancel.LockTimeout`) the clear is owed, not raised, and this process lands
        it later (its next write, ``cleanup``, its janitor). While a namesake is in flight then,
        only a row older than this call goes."""
        rid = ids.key(request_id)
        if rid is None or not valid_scope(scope):
            return
        self._tick()
        try:
            self._store.clear(scope, rid)
        except LockTimeout as e:
            owed.owe(self._store, scope, rid, None, self.clock())
            log.warning("clearing request %r in %r: %s; retried later", rid, scope[:80], e)
        else:
            if owed.queue:
                settle_owed()

    def cancel_scope(self, scope: str, reason: object = None, *,
                     reported: Collection[str] = ()) -> int:
        """Cancel every request in flight in ``scope`` (a session's ``DELETE``). Returns how many
        were recorded; :meth:`cancel_scope_keys` names them.

        Every one, past ``max_rows_per_scope`` too (contract §6.1: the DELETE "cancels every
        request still in flight in it"): the quota bounds the cancellations a client asks for,
        while these rows are bounded by the requests in flight and each goes with its request.
        ``reported``: row keys an earlier pass cancelled; recorded again (a namesake begun
        since is cancelled too) but neither counted nor emitted again.
        """
        return len(self.cancel_scope_keys(scope, reason, reported=reported))

    def cancel_scope_keys(self, scope: str, reason: object = None, *,
                          reported: Collection[str] = (), emit: bool = True) -> list[str]:
        """:meth:`cancel_scope`, returning the row keys (``str(id)``) it cancelled, those in
        ``reported`` left out. ``emit=False``: their events are not emitted here but by
        :meth:`report_cancelled` once the caller knows the pass counts (a DELETE's pass before
        its session goes: one answered 404 or 503 reports nothing, the one that ends the
        session reports each call once)."""
        if not valid_scope(scope):
            return []
        if type(scope) is not str:
            scope = str.__str__(scope)
        text = sanitize(reason)
        done = []
        for rid in self._store.in_flight_ids(scope):
            # each one atomically: a request that ended since the scan gets no row. rid is a
            # row key, not an id: a long int's is no valid id, so it is not validated again
            if self._store.record(scope, rid, text, self.clock, quota=None, cap=self._cap,
                                  batch=self._batch, only_in_flight=True, spare=True) \
                    and rid not in reported:
                done.append(rid)
        # What _record does after its row, once for all: every row is written before the first
        # event, so a handler's BaseException (a signal's SystemExit) cannot leave the rest of
        # the scope running uncancelled.
        if done and owed.queue:
            settle_owed()
        if emit:
            self._emit_cancelled(scope, done, text)
        self._tick()
        return done

    def report_cancelled(self, scope: str, keys: Collection[str], reason: object = None) -> None:
        """Emit the ``request cancelled`` events of ``keys``, which
        ``cancel_scope_keys(scope, reason, emit=False)`` returned."""
        if valid_scope(scope):
            self._emit_cancelled(str.__str__(scope), keys, sanitize(reason))

    def cancel_scope_around(self, scope: str, reason: object, end: Callable[[], bool], *,
                            reported: list[str], ring: Callable[[], None]) -> list[str] | None:
        """Cancel every request in flight in ``scope`` around ``end()`` (what stops requests
        joining the scope: a session's end), as a session's ``DELETE`` does: before it, and
        again after it for a request begun in between (one beginning later finds ``end``'s
        effect). Each step takes the lock on its own; one that stalls (``LockTimeout``,
        raised) leaves no request that was in flight before the call running, but one begun in
        between if the pass after stalls. ``ring()`` (wake the waiting tools) runs when a pass
        recorded a row or a step raised. The events come last, once every write is done, and
        only when ``end()`` returned True: each request once, also across calls sharing
        ``reported`` (the keys reported so far, extended here: a retry). Returns the keys
        reported, or ``None`` when ``end()`` returned False (nothing reported)."""
        first: list[str] = []
        after: list[str] = []
        ended = finished = False
        try:
            try:
                first = self.cancel_scope_keys(scope, reason, reported=reported, emit=False)
                if not end():
                    finished = True
                    return None
                ended = True
                after = self.cancel_scope_keys(scope, reason, reported=[*reported, *first],
                                               emit=False)
                finished = True
            finally:
                if first or after or not finished:
                    ring()
        finally:
            if ended:  # whatever a later step raised: a retry's end() is not this one's
                reported += first + after
                self.report_cancelled(scope, first + after, reason)
        return first + after

    def _emit_cancelled(self, scope: str, keys: Collection[str], text: str | None) -> None:
        if keys and self._reports and telemetry.listening():
            for rid in keys:
                telemetry.execute(CANCELLED_EVENT, {"count": 1},
                                  {"request_id": rid, "scope": scope, "reason": text})

    # --- in-flight rows
    def track(self, request_id: object, scope: str = "global") -> None:
        """Mark ``request_id`` in flight in ``scope`` for the calling process and thread: one
        row per call, the same thread's again too (two requests of one id, asyncio's in one
        thread, hold a row each; :meth:`untrack` removes one). The Redis store keeps one row per
        thread and key.

        Raises :class:`~shmcancel.TableFull` when ``in_flight_capacity`` rows are held even after
        dead owners' rows are removed. Invalid ids are ignored. Prefer :meth:`begin`.
        """
        rid = ids.key(request_id)
        if rid is None or not valid_scope(scope):
            return
        pid, start = procinfo.me()
        owner = (pid, start, threading.get_ident(), 0)
        if owed.queue and self._forgo_owed_untrack:
            # a store keeping one row per thread and key (Redis): an untrack of it, owed to a
            # stalled lock, must not land after this track: it would end the new request
            owed.forgo_untrack(self._store, scope, rid, owner)
        self._store.track(scope, rid, owner)
        if owed.queue:
            settle_owed()  # the lock answered: land what this process owes
        self._tick()

    def untrack(self, request_id: object, scope: str = "global") -> None:
        """Remove the calling thread's own in-flight row for the key (one of them), leaving
        namesakes run by other threads or processes in flight.

        Never lost (contract §4.3): when the lock cannot be had in time
        (:class:`~shmcancel.LockTimeout`) the untrack of this thread's ``track`` row is owed,
        not raised, and this process lands it later (its next write, ``cleanup``, its
        janitor)."""
        rid = ids.key(request_id)
        if rid is None or not valid_scope(scope):
            return
        pid, start = procinfo.me()
        tid = threading.get_ident()
        try:
            self._store.untrack_thread(scope, rid, pid, start, tid)
        except LockTimeout as e:
            owed.owe(self._store, scope, rid, (pid, start, tid, 0), None)
            log.warning("untracking request %r in %r: %s; retried later", rid, scope[:80], e)
        else:
            if owed.queue:
                settle_owed()
        self._tick()

    def in_flight(self, request_id: object, scope: str = "global") -> bool:
        """True while any in-flight row exists for ``(scope, id)``. Never raises."""
        try:
            # cached per (scope, id as given) like cancelled()'s watches: exact types only (a
            # scope that is not a str matches no entry, or raises: unhashable, not valid either)
            if type(request_id) is int or type(request_id) is str:
                try:
                    p = self._in_flight_map[scope][request_id]
                except KeyError:
                    pass
                else:
                    if next(self._ticks):
                        self._tick()
                    return p()
            rid = ids.key(request_id)
            if rid is None or not valid_scope(scope):
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

    def in_flight_pids(self, request_id: object, scope: str = "global") -> set[int] | None:
        """The pids of the processes running ``request_id`` in ``scope`` now (a lock-free
        snapshot: empty when none), or ``None`` when the store cannot tell (a store without
        ``in_flight_pids``) or the id or scope is invalid. Never raises."""
        rid = ids.key(request_id)
        pids = getattr(self._store, "in_flight_pids", None)
        if rid is None or pids is None or not valid_scope(scope):
            return None
        try:
            return set(pids(str.__str__(scope), rid))
        except Exception:
            log.debug("in_flight_pids() failed", exc_info=True)
            return None

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
        elif isinstance(ttl, bool) or not isinstance(ttl, int | float) or ttl != ttl:  # NaN
            raise ValueError(f"ttl must be a number of seconds, got {ttl!r:.80}")
        elif abs(ttl) > 1e300:  # an int past float's range: as good as infinite
            ttl = math.inf if ttl > 0 else -math.inf
        if self.registry is not None:  # header counters plausible, else recounted (fsck)
            self.registry.check()
        now = self.clock()
        if now.__class__ is not float or now - now:  # NaN, an infinity: no row's age can be told
            now = clock_seconds(now)
        settle_owed()  # this process's request ends owed to a stalled lock land first (§4.3)
        removed = self._store.expire(now, float(ttl))
        # a dead request's cancellation goes with its reaped row: removed by this sweep too
        cleared = getattr(self._store, "orphans_cleared", 0)
        in_flight_removed = self._store.reap() + self._reap_ended()
        removed += getattr(self._store, "orphans_cleared", 0) - cleared
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
        reg = self.registry
        if reg is not None and reg.closed:  # nothing to sweep or settle through it any more
            self._next_check = now + self._interval
            return False
        if reg is not None and reg.lock.stalled():  # a sweep can wait; a request should not
            self._next_check = now + self._interval * _RECHECK_FRACTION
            return False
        stalled = False
        try:
            won = self._store.claim_sweep(now, self._interval)
        except Exception as e:  # a stalled lock is one line: expected, and nothing to debug
            if reg is None or not reg.closed:  # else closed by another thread meanwhile
                log.warning("janitor: claim_sweep failed: %s", e,
                            exc_info=not isinstance(e, LockTimeout))
            won, stalled = False, isinstance(e, LockTimeout)
        self._next_check = now + self._interval * (1.0 if won else _RECHECK_FRACTION)
        if won:
            try:
                self.sweep()
            except Exception as e:
                # Closed by another thread mid-sweep (the close waits for the sweep's hold, not
                # for its lock-free reads between holds): nothing failed, nothing to debug.
                if reg is None or not reg.closed:
                    log.warning("janitor: cleanup failed: %s", e,
                                exc_info=not isinstance(e, LockTimeout))
        if not stalled:  # a stalled lock would only make the settling wait once more
            self.settle()
        return won

    def settle(self) -> int:
        """Land the ends this process owes (see the module docstring), then remove this
        process's in-flight rows whose request ended. Returns the rows settled (ends landed
        plus rows removed). Never raises; a :class:`~shmcancel.LockTimeout` leaves the rest
        owed for the next try. On a closed registry it has no rows to remove (0)."""
        n = settle_owed()
        try:
            n += self._reap_ended()
        except RegistryClosed:
            pass
        except Exception as e:
            log.warning("removing ended requests' rows failed: %s", e,
                        exc_info=not isinstance(e, LockTimeout))
        return n

    def _reap_ended(self) -> int:
        pid, start = procinfo.me()
        return self._store.reap_ended(pid, start, owed.running)

    def _tick(self) -> None:
        """The janitor's piggy-back on every call, reads included (they count as use of the
        registry, contract §4.6): one clock read and a comparison until this process's next
        check (or when that lies more than an interval ahead: the clock stepped back)."""
        now = _now()
        if now >= self._next_check or self._next_check - now > self._interval:
            self.tick()
