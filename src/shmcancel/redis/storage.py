""":class:`~shmcancel.cancel.storage.Storage` over Redis: :class:`RedisStorage`, so
``Cancellation(None, backend=RedisStorage(store))`` gives contract §4 to every host sharing one
Redis. Each operation is one Lua script of :class:`~shmcancel.redis.store.RedisStore` (or one
read), hence atomic by itself; a poll costs a round trip (the gunicorn integration keeps its polls
on the local registry: :mod:`shmcancel.redis.bridge`).

In-flight rows are owned by ``<host>:<pid>:<tag>`` (the worker's box, where gated cancellations
are pushed; a bridge's ``host`` also names its registry; ``tag`` is random, so workers of two
hosts that share a host name and number their processes alike, containers with host networking,
keep apart) with a lease: a row lives
``lease`` seconds past its last :meth:`RedisStorage.renew`, so whoever runs requests renews
every ``lease / 3``: by default a daemon thread of this
storage does, started when the process first holds a row and ending when it holds none (a
fork child starts with none of its parent's rows, locks or thread; the
bridge, which renews from its own thread, turns it off: ``auto_renew=False``). The rows of a host
that died vanish within ``lease``. ``reap`` therefore removes nothing: leases do it.

Differences from shared memory, by design: an owed :meth:`~RedisStorage.end` keeps the key's row
while a namesake still runs (``untrack.lua``); ``record`` reads ``clock`` before its script, so
hosts' clocks must agree to well under the gap between a request's begin and its cancellation.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
import weakref
from collections.abc import Callable, Container

from ..cancel import owed
from ..cancel.storage import Owner, Poll, clear_ended, clock_seconds
from ..config import Config
from ..exceptions import CancellationLimitReached, LockTimeout
from ..shm import procinfo
from .store import RedisStore, wrong_type

__all__ = ["RedisStorage", "default_host_id"]

log = logging.getLogger("shmcancel.redis")

_instances: weakref.WeakSet[RedisStorage] = weakref.WeakSet()
#: The token a ``track`` row (token 0) is held under once its untrack got no answer: its
#: request ended, and :meth:`RedisStorage.reap_ended` ends it (no token in ``owed.running``
#: tells of a token-0 row's end, so renew would otherwise keep it in flight for good).
_ENDED = -1
#: The most rows of ended requests (their end got no answer, or their track never reached
#: Redis) a process keeps for :meth:`RedisStorage.reap_ended` while Redis is away; the oldest
#: beyond go unended (their Redis rows, if any, end with their lease): without a bound every
#: request of an outage stayed in memory until Redis answered.
ENDED_MAX = 1024


def _after_fork_in_child() -> None:
    # A fork child holds none of its parent's rows (the parent runs those requests and ends
    # them): renewing them, as the child's own renewal thread would once the child tracks a
    # request, would track back in Redis a request the parent ended. The parent's threads
    # (its renewer, mid-call with _io held) do not exist here: fresh locks, no renewer.
    for st in list(_instances):
        st._after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


def default_host_id() -> str:
    """``SHMCANCEL_HOST_ID``, else the host name."""
    return os.environ.get("SHMCANCEL_HOST_ID") or socket.gethostname()


class _Exists:
    """A poll of one cancellation row: one ``HEXISTS`` per ``member()``."""

    __slots__ = ("_rid", "_scope", "_store")

    def __init__(self, store: RedisStore, scope: str, rid: str) -> None:
        self._store, self._scope, self._rid = store, scope, rid

    def member(self) -> bool:
        return self._store.exists(self._scope, self._rid)


class RedisStorage:
    """:class:`Storage` over a :class:`RedisStore`. ``clock``: float seconds (a request's start,
    to tell a stale row from its own); ``lease``: seconds an in-flight row lives without
    :meth:`renew`; ``host``: this host's identity; ``auto_renew``: renew from a daemon
    thread of this storage while the process holds rows (else the caller calls
    :meth:`renew` every ``lease / 3``); ``pending``: seconds a gated cancellation that finds
    nothing in flight waits in Redis for the row of a request started by then to be added back
    (Redis lost it: a restart, a lease that ran out while Redis was unreachable), which it then
    cancels (at most :attr:`RedisStore.pending_max` wait per scope and ``pending_cap`` in all:
    more are dropped); 0: it is dropped at once. Thread-safe."""

    def __init__(self, store: RedisStore, *, clock: Callable[[], float] = time.time,
                 lease: float = 10.0, host: str | None = None,
                 io_wait: float = 10.0, auto_renew: bool = True, pending: float = 10.0) -> None:
        if not 0 < lease <= 3600:
            raise ValueError(f"lease must be in (0, 3600] seconds, got {lease!r}")
        if not 0 <= pending <= 3600:
            raise ValueError(f"pending must be in [0, 3600] seconds, got {pending!r}")
        self.store = store
        self.config: Config = store.config
        self.capacity: int = store.cap
        self.clock = clock
        self.lease = float(lease)
        self.host = host or default_host_id()
        self.pending = float(pending)
        # rows this process holds: (scope, rid, owner) -> (owner in Redis, request's start)
        self._mine: dict[tuple[str, str, Owner], tuple[bytes, float]] = {}
        #: Rows this instance's records evicted (the registry counts every process's).
        self.evictions = 0
        #: Guards ``_mine``; never held across a Redis call.
        self._lock = threading.Lock()
        #: Serialises this process's track/untrack/renew Redis calls (so ``renew`` never adds
        #: back a row an ``untrack`` is ending); waited for at most ``io_wait`` seconds.
        self._io = threading.Lock()
        self.io_wait = float(io_wait)
        self.auto_renew = bool(auto_renew)
        self._renewer: threading.Thread | None = None  # guarded by _lock
        self._prune_at = 2 * ENDED_MAX  # len(_mine) at which hold() drops ended rows
        self._pruned_logged = False
        self._tag = secrets.token_hex(4)  # this process's box, told apart from a namesake's
        _instances.add(self)

    def _after_fork(self) -> None:
        """In a fork child: the parent's rows and threads are the parent's."""
        self._tag = secrets.token_hex(4)
        self._lock = threading.Lock()
        self._io = threading.Lock()
        self._mine.clear()
        self._renewer = None
        self._prune_at = 2 * ENDED_MAX

    def _io_held(self, what: str) -> None:
        """Take ``_io`` within ``io_wait`` seconds, else raise ``LockTimeout`` (the caller skips
        Redis: a thread never queues behind another's slow call for longer than that)."""
        if not self._io.acquire(timeout=self.io_wait):
            raise LockTimeout(f"{what}: another Redis call of this process held on for "
                              f"{self.io_wait:g}s")

    def __repr__(self) -> str:
        return f"<RedisStorage host={self.host!r} prefix={self.store.prefix!r}>"

    @property
    def box(self) -> str:
        """This process's box: where cancellations of its requests are pushed. Its random tag
        keeps it apart from the box of a process of the same pid on a host of the same name
        (containers on one machine with host networking share its host name, and each pid
        namespace numbers its workers alike)."""
        return f"{self.host}:{os.getpid()}:{self._tag}"

    def _owner(self, owner: Owner) -> bytes:
        return f"{self.box}\n{owner[1]}:{owner[2]}:{owner[3]}".encode()

    @staticmethod
    def _now_ms() -> int:
        return int(time.time() * 1000)

    # --- cancellation rows
    def record(self, scope: str, rid: str, reason: str | None, clock: Callable[[], float], *,
               quota: int | None, cap: int, batch: int, only_in_flight: bool,
               spare: bool = False) -> bool:
        at = clock()
        if at.__class__ is not float or at - at:  # NaN, an infinity, not a float
            at = clock_seconds(at)
        status, evicted = self.store.cancel(
            scope, rid, reason, at, gate=only_in_flight, now_ms=self._now_ms(),
            box_lease_ms=int(self.lease * 1000),
            limits=(-1 if quota is None else quota, cap, batch),
            pending_ms=int(self.pending * 1000) if only_in_flight else 0, spare=spare)
        self.evictions += evicted
        if status == -1:
            raise CancellationLimitReached(
                f"scope {scope[:80]!r} already holds {quota} cancellation rows")
        return status != 0

    def get(self, scope: str, rid: str) -> tuple[str | None, float] | None:
        return self.store.get(scope, rid)

    def exists(self, scope: str, rid: str) -> bool:
        return self.store.exists(scope, rid)

    def watch(self, scope: str, rid: str) -> Poll:
        return _Exists(self.store, scope, rid)

    def scope_rows(self, scope: str) -> int:
        return self.store.scope_rows(scope)

    def scope_has_rows(self, scope: str) -> bool:
        return self.store.scope_rows(scope) > 0

    def rows(self) -> int:
        return self.store.rows()

    def clear(self, scope: str, rid: str) -> bool:
        return self.store.clear(scope, rid)

    def clear_before(self, scope: str, rid: str, before: float) -> bool:
        return self.store.clear(scope, rid, before)

    def expire(self, now: float, ttl: float) -> int:
        return self.store.expire(now, ttl)

    def cancellations(self) -> list[tuple[str, str, str | None, float]]:
        return self.store.cancellations()

    # --- in-flight rows
    def track(self, scope: str, rid: str, owner: Owner) -> None:
        """Hold the row of a request started now here and in Redis (a row this owner still
        holds, its end having got no answer, was an earlier request's: replaced). Raises Redis
        errors or ``LockTimeout``: a handle's row (a token) stays held here only (:meth:`renew`
        adds it; it ends with its request, see :meth:`reap_ended`), a plain ``track`` row
        (token 0) is let go of, as a failed ``track`` writes nothing elsewhere: its caller,
        told it failed, will not untrack it (a row Redis did take ends with its lease)."""
        held = self.hold(scope, rid, owner)
        try:
            self._add(scope, rid, held)
        except BaseException:
            if owner[3] == 0:
                self.forget(scope, rid, owner)
            raise

    def track_held(self, scope: str, rid: str, owner: Owner) -> None:
        """Add to Redis the row :meth:`hold` holds, with the start it held (held now when it
        is not). Raises as :meth:`track` does."""
        with self._lock:
            held = self._mine.get((scope, rid, owner))
        self._add(scope, rid, held if held is not None else self.hold(scope, rid, owner))

    def _add(self, scope: str, rid: str, held: tuple[bytes, float]) -> None:
        self._io_held("track")
        try:
            now = self._now_ms()
            self.store.track(scope, rid, held[0], deadline_ms=now + int(self.lease * 1000),
                             now_ms=now, started_at=held[1])
        finally:
            self._io.release()

    def hold(self, scope: str, rid: str, owner: Owner) -> tuple[bytes, float]:
        """Hold a row only locally (Redis is down), its request started now: :meth:`renew` adds
        it when Redis returns. Returns what is held: the owner in Redis, the start."""
        held = (self._owner(owner), self.clock())
        with self._lock:
            if owner[3] == 0:  # one member in Redis: the thread's ended row's end would end it
                self._mine.pop((scope, rid, (*owner[:3], _ENDED)), None)
            self._mine[scope, rid, owner] = held
            if len(self._mine) >= self._prune_at:
                self._prune_ended()
            self._want_renewer()
        return held

    def _prune_ended(self) -> None:
        """Keep at most :data:`ENDED_MAX` rows of ended requests (a track row held as ended, or
        a handle's row whose token left ``owed.running``), dropping the oldest; caller holds
        ``_lock``. The next prune comes once ``_mine`` doubles (so a process running many
        requests at once does not scan at every hold)."""
        pid, start = procinfo.me()
        running = owed.running
        ended = [k for k in self._mine if k[2][3] == _ENDED or (
            k[2][3] != 0 and k[2][0] == pid and k[2][1] == start and k[2][3] not in running)]
        drop = ended[:len(ended) - ENDED_MAX] if len(ended) > ENDED_MAX else []
        for k in drop:
            del self._mine[k]
        self._prune_at = max(2 * ENDED_MAX, 2 * len(self._mine))
        if drop and not self._pruned_logged:
            self._pruned_logged = True
            log.warning("more than %d in-flight rows of ended requests are owed to Redis; the "
                        "oldest are dropped (they end with their lease). (Logged once.)",
                        ENDED_MAX)

    def forget(self, scope: str, rid: str, owner: Owner) -> None:
        """Drop a row locally only (Redis is down; its lease ends it there)."""
        with self._lock:
            self._mine.pop((scope, rid, owner), None)

    def untrack(self, scope: str, rid: str, owner: Owner, receipt: object = None, *,
                before: float | None = None) -> bool:
        """End the row (``receipt`` is ``None``: :meth:`track` gives none); when no namesake
        runs on, the key's cancellation row goes too (one script; with ``before``, only a row
        cancelled before then: an end landing late, :meth:`end`). Raises Redis errors or
        ``LockTimeout``, leaving the row held for :meth:`forget` (a ``track`` row, token 0,
        held as ended after a Redis error: :meth:`reap_ended` ends it)."""
        with self._lock:
            held = self._mine.get((scope, rid, owner))
        if held is None:
            return False
        self._io_held("untrack")
        try:
            gone = self.store.untrack(scope, rid, held[0], now_ms=self._now_ms(),
                                      before=before)
            with self._lock:
                self._mine.pop((scope, rid, owner), None)
        except Exception:
            if owner[3] == 0:
                with self._lock:
                    if self._mine.pop((scope, rid, owner), None) is not None:
                        self._mine[scope, rid, (*owner[:3], _ENDED)] = held
            raise
        finally:
            self._io.release()
        return gone

    def release(self, scope: str, rid: str, owner: Owner) -> bytes | None:
        """Stop holding a row here (so :meth:`renew` never adds it back) and return what names
        its owner in Redis, for :meth:`untrack_released`; None when it was not held."""
        with self._lock:
            held = self._mine.pop((scope, rid, owner), None)
        return None if held is None else held[0]

    def untrack_released(self, scope: str, rid: str, raw: bytes) -> bool:
        """:meth:`untrack` of a row :meth:`release` let go of (owed: it could not be ended
        when its request ended). Raises Redis errors or ``LockTimeout``."""
        self._io_held("untrack")
        try:
            return self.store.untrack(scope, rid, raw, now_ms=self._now_ms())
        finally:
            self._io.release()

    def untrack_thread(self, scope: str, rid: str, pid: int, start: int, tid: int) -> bool:
        with self._lock:
            mine = [o for (s, r, o) in self._mine if s == scope and r == rid
                    and o[:3] == (pid, start, tid)]
        if not mine:
            return False
        try:
            return self.untrack(scope, rid, min(mine, key=lambda o: o[3] > 0))  # track rows first
        except LockTimeout:
            raise  # owed by the caller
        except Exception as e:  # no answer: the row is held as ended, reap_ended ends it
            log.warning("untracking request %r in %r got no answer from Redis (%s); its row "
                        "ends later", rid, scope[:80], e)
            return False

    def end(self, scope: str, rid: str, owner: Owner | None, ended_at: float) -> None:
        if owner is not None and self.untrack(scope, rid, owner, before=ended_at):
            return  # untrack.lua cleared the row from before ended_at when no namesake runs on
        clear_ended(self, scope, rid, ended_at, owner is None)

    def in_flight(self, scope: str, rid: str) -> bool:
        return self.store.in_flight(scope, rid, now_ms=self._now_ms())

    def in_flight_ids(self, scope: str) -> list[str]:
        return sorted(set(self.store.in_flight_ids(scope)))

    def reap(self, pid: int | None = None) -> int:
        """Nothing: a dead host's or process's rows end with their lease."""
        return 0

    def reap_ended(self, pid: int, start: int, running: Container[int]) -> int:
        with self._lock:
            ended = [(s, r, o) for (s, r, o) in self._mine
                     if o[0] == pid and o[1] == start and o[3] != 0 and o[3] not in running]
        return sum(self.untrack(*k) for k in ended)

    def renew(self) -> int:
        """Extend the lease of every row this process holds, adding back any Redis lost (a
        restart, a lease run out) with its request's start, so that a cancellation sent since
        that found nothing in flight meanwhile lands (``track.lua``). Returns how many were
        added back. A row's key another client wrote with another type is mended by the
        scripts (deleted, the row added back); one Redis still answers ``WRONGTYPE`` for is
        skipped, so that it stops neither the renewal of the other rows nor the bridge
        thread's turn (its box read)."""
        from redis.exceptions import ResponseError
        now = self._now_ms()
        deadline = now + int(self.lease * 1000)
        added = 0
        self._io_held("renew")
        try:
            with self._lock:  # an ended row is never renewed (reap_ended ends it)
                items = [kv for kv in self._mine.items() if kv[0][2][3] != _ENDED]
            missing = self.store.renew([(self.store.if_key(s, r), o)
                                        for (s, r, _), (o, _) in items], deadline,
                                       now_ms=now)
            for i in missing:
                (s, r, _), (o, started) = items[i]
                try:
                    self.store.track(s, r, o, deadline_ms=deadline, now_ms=now,
                                     started_at=started)
                except ResponseError as e:
                    if not wrong_type(e):
                        raise
                    log.debug("not adding back request %r in %r: %s", r, s[:80], e)
                    continue
                added += 1
        finally:
            self._io.release()
        return added

    def _want_renewer(self) -> None:
        """With ``auto_renew``, make sure a thread renews the rows held (caller holds
        ``_lock``). One per process: a copy inherited across fork is not running."""
        if not self.auto_renew:
            return
        t = self._renewer
        if t is not None and t.is_alive():
            return
        t = self._renewer = threading.Thread(target=self._renew_loop, daemon=True,
                                             name="shmcancel-redis-renew")
        t.start()

    def _renew_loop(self) -> None:
        """Renew every ``lease / 3`` while rows are held; end (leaving ``_renewer`` to the
        next :meth:`track`) once none is. Rows of requests this process no longer runs (their
        end got no answer) are ended first, never renewed: renew would add them back."""
        me = threading.current_thread()
        while True:
            time.sleep(self.lease / 3)
            with self._lock:
                if self._renewer is not me:
                    return
                if not self._mine:
                    self._renewer = None
                    return
            try:
                pid, start = procinfo.me()
                self.reap_ended(pid, start, owed.running)
                self.renew()
            except Exception as e:  # Redis down or slow: the next period tries again
                log.debug("renewing in-flight leases failed: %s", e)

    def held(self) -> int:
        """In-flight rows this process holds."""
        return len(self._mine)

    def forget_process(self) -> None:
        """After fork: the parent's rows are the parent's."""
        with self._lock:
            self._mine.clear()

    # --- janitor
    def claim_sweep(self, now: float, interval: float) -> bool:
        return self.store.claim_sweep(now, interval)
