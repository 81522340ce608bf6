"""The per-worker bridge between a host's shared-memory registry and Redis.

One :class:`Bridge` per worker process, started after fork (``shmcancel.gunicorn.post_fork``
when ``SHMCANCEL_REDIS_URL`` is set; never in the master). It does three things:

- the transport tells it when a ``tools/call`` starts and ends (:meth:`track` / :meth:`untrack`:
  one Redis script each, bounded by the client timeout), so Redis holds a cross-host in-flight
  index owned by ``<host>/<registry>:<pid>:<tag>`` (:func:`registry_host`; a random tag)
  with a lease;
- a ``notifications/cancelled`` that finds nothing in flight on this host asks Redis
  (:meth:`cancel`): one script gates on that index, applies the quota / cap / eviction rules and
  pushes the cancellation into the box (a list) of each worker running the request;
- its thread waits for the worker's box to hold an item (``BLMOVE`` of the box onto itself: the
  item stays), moves each item to the worker's *taken* list (``take.lua``, which leases that
  list in the same step), writes the cancellation into the local registry
  (``cancel_if_in_flight``: local gating again, so a call that ended meanwhile gets no row), then
  drops the item from the taken list; the tool's next *local* poll sees it. A box is a list, so
  what arrives while the thread is busy or briefly disconnected waits there. A move whose reply
  was lost (Redis slower than the client's timeout: it ran the move all the same) leaves the
  item in the taken list, which the thread applies after any failed call, before it reads the
  box again (stopping, as there, at a lock timeout: what it kept is tried again first, oldest
  first); one applied whose drop got no answer is only dropped (this process remembers it). A
  full Redis refuses moves (they may add data): the thread then pops, as it did before the
  taken list. The thread also renews the worker's leases every ``lease / 3`` and expires old
  rows every ``janitor_interval``.
  While a stalled process holds the registry lock (one acquisition held for 0.1 s) the thread
  neither reads its box nor waits ``lock_timeout`` on the lock: its renewals go on.

Polls never touch Redis. Every call gives up after ``timeout`` (one budget: a third waiting for
this worker's other Redis call, else the call is skipped; a third to connect; a third to read;
no retries). A request whose session lookup gets no answer is answered at once (503); one whose
track gets none does not wait on its untrack (owed, below): a ``tools/call`` pays the timeout
once, not once per call it makes.

Health. A call that fails to *connect* (refused, reset, closed: ``ConnectionError``) marks the
bridge down at once. A call that times out (or gets an error answer other than a full Redis's
``OOM`` or a ``WRONGTYPE`` from a key another client wrote over, which are answers) counts one
failure: it marks the bridge down only when :data:`DOWN_AFTER` calls in a row of this worker
failed so,
since a single slow call under load says little about Redis; any answered call resets the
count. A skipped call (the worker's other Redis call held on) counts nothing. Going down logs
one warning; while down, calls return at once without Redis (requests are served, same-host
cancellation works through shared memory; cross-host cancellation does not, a session minted on
another host is answered 503, and writes are owed);
the thread probes every ``retry`` seconds and, when Redis answers, logs once, adds back every
in-flight row of the worker (renew) and resumes.

No answer is not "no". A session lookup that got no answer (timed out, failed, skipped, or the
bridge is down) raises :class:`~shmcancel.exceptions.RemoteUnavailable`: the transport answers
503 with ``Retry-After``, never 404, which tells a client its session is gone for good. 404 is for
a session Redis says it does not hold (or one this worker deleted).

Owed writes. A write that matters and got no answer (ending an in-flight row, storing a session,
deleting one, a cross-host cancellation) is owed, not lost: kept in a queue of at most
:data:`OWED_MAX` entries (one per row, session or cancelled request: a newer write replaces an
older one; when full the oldest is dropped, with one warning per overflow), each with a deadline
past which it no longer matters (a row's lease; the session TTL; :data:`CANCEL_TTL`), and applied
by the thread, oldest first, before its next renew, stopping at the first that gets no answer.
Deleting a session drops a publish of it still owed; a session deleted here is never adopted
again, and Redis refuses for a while (``store.GONE_TTL``) to store one deleted anywhere: a
holder whose store is refused (it had not heard of the DELETE) ends its copy and its calls. A
row whose end is owed is released here first, so renew never adds it back. A timed-out
write may have landed anyway: each is idempotent. What is still owed when the worker exits is
lost: its rows end with their lease, its sessions with their TTL. An owed cancellation applied
before the host running its call has added back the row Redis lost (a restart) finds nothing in
flight: it waits in Redis for that row (:class:`~shmcancel.redis.storage.RedisStorage`'s
``pending``), which :meth:`RedisCancellation.renew` adds back with its request's start.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import itertools
import logging
import math
import os
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from shmcancel.config import Config
from shmcancel.exceptions import (
    CancellationLimitReached,
    LockTimeout,
    RemoteUnavailable,
    ShmCancelError,
    TableFull,
)

from ..cancel import ids
from ..mcp import remote, wake
from ..mcp.principal import SESSION_KEY
from ..mcp.sessions import SessionStore
from ..shm import procinfo
from .cancellation import RedisCancellation, connect
from .storage import default_host_id
from .store import Damaged, RedisStore, wrong_type

__all__ = ["CANCEL_TTL", "DOWN_AFTER", "OWED_MAX", "Bridge", "current", "start", "start_from_env",
           "stop"]

log = logging.getLogger("shmcancel.redis")

DOWN_AFTER = 3  # calls in a row that time out (or get an error answer) before Redis is down
OWED_MAX = 1024  # writes owed to Redis (and sessions remembered as deleted here)
SETTLE_BATCH = 256  # owed writes the thread applies per turn, at most
CANCEL_TTL = 10.0  # seconds an owed cross-host cancellation still matters
_STALLED = "the registry lock is held by a process that stalled holding it"
_STALL = 0.1  # seconds one acquisition of the registry lock held means its holder stalled
TAKEN_MAX = 4096  # items of the taken list applied again at once (a box holds at most as many)
KEEP_EVERY = 60.0  # seconds between two renewals of one session's copy by one process, at most
HELD_MAX = 4096  # sessions a process remembers publishing, and renewal times it keeps
# The form of the session ids the transport mints (secrets.token_urlsafe): any other id names no
# session of ours, and could name another key (a session's key plus ":boxes")
_SID_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


#: RemoteUnavailable's cause for a session's copy no host could adopt (another client's write).
_DAMAGED = "holds a damaged copy of this session; it is being stored again"


def _minted_form(sid: str) -> bool:
    return 0 < len(sid) <= 128 and _SID_CHARS.issuperset(sid)


def _put_newest(d: OrderedDict[str, Any], key: str, value: Any) -> None:
    """``d[key] = value`` as its newest entry; the oldest goes past :data:`HELD_MAX`. The
    caller holds the lock guarding ``d``."""
    d[key] = value
    d.move_to_end(key)
    if len(d) > HELD_MAX:
        d.popitem(last=False)


class _NoAnswer(Exception):
    """A Redis call got no answer: skipped, failed or timed out."""


class _Refused(_NoAnswer):
    """A full Redis (``noeviction``) refused a write that needs memory (``OOM``)."""


class _Damaged(_NoAnswer):
    """Redis answered ``WRONGTYPE``: a key of ours held what another client wrote (the scripts
    mend their keys first, so this is one they could not)."""


@dataclass(frozen=True, slots=True, eq=False)
class _Owed:
    key: tuple[Any, ...]
    deadline: float  # time.monotonic() past which it no longer matters
    fn: Callable[[], object]


def _connection_failure(e: BaseException) -> bool:
    """Redis could not be reached (refused, reset, closed), as opposed to a call that timed out
    or got an error answer."""
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError
    if isinstance(e, RedisTimeoutError | TimeoutError):
        return False
    return isinstance(e, RedisConnectionError | OSError)


_current: Bridge | None = None
_current_lock = threading.Lock()
_started: weakref.WeakSet[Bridge] = weakref.WeakSet()  # bridges started (a child's: the parent's)


def registry_host(host: str, registry: Any) -> str:
    """The host part of a bridge's box: ``host`` (``SHMCANCEL_HOST_ID``, the host name) and a
    digest of its registry's random hash key. A session's copy lives in one registry, for every
    worker attached to it: a session's end tells one worker of each such registry
    (``common.lua``'s ``end_session``), and two registries under one host name (two servers on
    one machine, containers sharing its name) are two hosts there. The digest names the
    registry without giving its key away."""
    digest = hashlib.blake2b(registry.hash_key, digest_size=5, person=b"shmc-host").hexdigest()
    return f"{host}/{digest}"


class Bridge:
    """See the module docstring. ``registry``: this host's attached registry (the local
    segment cancellations are delivered into); ``url``: the Redis URL; ``timeout``: seconds any
    one Redis call may take; ``lease``: in-flight row lease (rows of a dead host vanish within
    ``lease`` of its last renewal); ``retry``: seconds between probes while Redis is down."""

    def __init__(self, registry: Any, url: str, *, prefix: str = "shmcancel:",
                 timeout: float = 0.5, lease: float = 10.0, retry: float = 0.5,
                 host: str | None = None, config: Config | None = None) -> None:
        from shmcancel import Cancellation
        self.registry = registry
        self.local = Cancellation(registry)
        self.timeout = float(timeout)
        self.retry = float(retry)
        self.block = max(0.05, min(1.0, lease / 3))  # BLMOVE wait, and the renew period floor
        cfg = config or registry.config
        # One budget of `timeout` per call: a third waiting for this process's other Redis
        # call (RedisStorage's I/O lock), a third connecting, a third reading.
        self.store = RedisStore(connect(url, timeout=timeout * 2 / 3), cfg, prefix=prefix)
        # The box reader (the thread, never a request) blocks up to `block`: its socket reads
        # wait that long plus the timeout.
        self._blocking = RedisStore(connect(url, timeout=2 * (self.block + timeout)), cfg,
                                    prefix=prefix)
        self.remote = RedisCancellation(self.store, lease=lease,
                                        host=registry_host(host or default_host_id(), registry),
                                        io_wait=timeout / 3)
        self.down = False
        # Redis answered again after an outage, but the rows and sessions it may have lost are
        # not all back yet: the thread tries again each turn until they are
        self._recovering = False
        self._forgot = False  # why it recovers: Redis answered all along but lost data
        self._alive_set = False  # this worker's alive key was set since its last recovery
        # monotonic time until which a session Redis does not have may be one another host has
        # not stored again yet, after this worker restored what it holds (each host's thread
        # sees a loss within a renewal period, an outage's end within a retry)
        self._restoring_until = -math.inf
        # how long, after Redis lost data, no session store gives up a client's sessions
        # (RedisStore.set_restoring): every worker sees the loss within a renewal period (an
        # outage's end within a retry) and adds its in-flight rows back at once; a lease more
        self._restoring_ms = int((lease + self.block + self.retry) * 1000)
        self.delivered = 0
        self._health = threading.Lock()
        self._failures = 0  # calls in a row that timed out or got an error answer
        self._owed: OrderedDict[tuple[Any, ...], _Owed] = OrderedDict()
        self._owed_lock = threading.Lock()
        self._overflowing = False
        # cancellations taken from the box that the registry could not take yet, retried by the
        # thread every turn, Redis down or not (local work, not a Redis write owed):
        # (scope, rid) -> (reason, deadline, cancelled_at), oldest first, at most OWED_MAX
        self._undelivered: OrderedDict[tuple[str, str],
                                       tuple[object, float, float | None]] = OrderedDict()
        # sessions deleted on another host whose end (their calls cancelled, this host's copy
        # gone) the registry could not take yet: sid -> (deadline, the keys of its calls whose
        # cancellation was reported already), oldest first, at most OWED_MAX
        self._unended: OrderedDict[str, tuple[float, tuple[str, ...]]] = OrderedDict()
        # items of the taken list applied whose drop got no answer (only the thread touches it)
        self._applied: OrderedDict[bytes, None] = OrderedDict()
        self._deleted: OrderedDict[str, None] = OrderedDict()  # sessions deleted here, newest last
        # sessions published by this process: sid -> (version, client), newest last; and when
        # this process last renewed a session's copy (keep_session)
        self._held: OrderedDict[str, tuple[str, str]] = OrderedDict()
        self._kept: OrderedDict[str, float] = OrderedDict()
        self._session_ttl = float(cfg.session_ttl)
        self.owed_applied = 0
        self.owed_expired = 0
        self.owed_dropped = 0
        self._pid = os.getpid()
        self._marked = False  # this worker's box marked stopped in Redis (_box_stopped)
        self._sessions: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._next_sweep = time.monotonic() + cfg.janitor_interval
        self._janitor_interval = cfg.janitor_interval

    # ------------------------------------------------------------------ health

    def _failed(self, what: str, e: BaseException) -> None:
        """A Redis call failed: a connection failure marks the bridge down, a timeout or an
        error answer counts towards :data:`DOWN_AFTER` (see the module docstring). A full
        Redis refusing a write (``OOM``, ``noeviction``) answered: the write is owed, and the
        reads and ends it still serves go on."""
        from redis.exceptions import OutOfMemoryError
        if isinstance(e, OutOfMemoryError):
            self._answered()
            log.debug("Redis is full (%s: %s); the write is owed", what, e)
            return
        if wrong_type(e):  # a key another client wrote over: an answer, not an outage
            self._answered()
            log.warning("a Redis key of the wrong type (%s: %s)", what, e)
            return
        connection = _connection_failure(e)
        with self._health:
            self._failures = DOWN_AFTER if connection else self._failures + 1
            mark = self._failures >= DOWN_AFTER and not self.down
            if mark:
                self.down = True
        if mark:
            why = "connection failed" if connection else f"{DOWN_AFTER} calls in a row failed"
            log.warning("Redis unreachable (%s: %s: %s): serving on; cross-host cancellation "
                        "and sessions paused until it answers", why, what, e)
        else:
            log.debug("a Redis call failed (%s: %s); not marked down", what, e)

    def _answered(self) -> None:
        if self._failures:
            with self._health:
                self._failures = 0

    def _ask(self, what: str, fn: Any, *a: Any, **kw: Any) -> Any:
        """``fn(*a, **kw)``'s answer. Raises :class:`_NoAnswer` when there was none: the bridge
        is down (skipped), the call failed or timed out (:meth:`_failed`), or this process's
        other Redis call held on past the wait (skipped)."""
        if self.down:
            raise _NoAnswer(f"{what}: Redis is down")
        from redis.exceptions import OutOfMemoryError, RedisError
        try:
            got = fn(*a, **kw)
        except (RedisError, OSError) as e:
            self._failed(what, e)
            kind = (_Refused if isinstance(e, OutOfMemoryError)
                    else _Damaged if wrong_type(e) else _NoAnswer)
            raise kind(f"{what}: {e}") from None
        except LockTimeout as e:
            log.debug("skipped a Redis call: %s", e)
            raise _NoAnswer(f"{what}: {e}") from None
        self._answered()
        return got

    # ------------------------------------------------------------------ owed writes

    def _owe(self, key: tuple[Any, ...], ttl: float, fn: Callable[[], object]) -> None:
        """Keep ``fn()`` for the thread to apply within ``ttl`` seconds (replacing what was
        owed under ``key``); the oldest entry goes when the queue is full."""
        entry = _Owed(key, time.monotonic() + ttl, fn)
        dropped: _Owed | None = None
        with self._owed_lock:
            self._owed.pop(key, None)
            if len(self._owed) >= OWED_MAX:
                _, dropped = self._owed.popitem(last=False)
                self.owed_dropped += 1
            self._owed[key] = entry
            warn = dropped is not None and not self._overflowing
            if dropped is not None:
                self._overflowing = True
        if warn and dropped is not None:
            log.warning("Redis writes owed exceed %d: dropping the oldest (a %s); rows end with "
                        "their lease, sessions with their TTL", OWED_MAX, dropped.key[0])

    def _unowe(self, key: tuple[Any, ...], entry: _Owed | None = None) -> None:
        with self._owed_lock:
            if entry is None or self._owed.get(key) is entry:
                self._owed.pop(key, None)
            if not self._owed:
                self._overflowing = False

    def owed(self) -> int:
        """Writes owed to Redis now."""
        return len(self._owed)

    def undelivered(self) -> int:
        """Cancellations and session ends taken from the box that the registry has not taken
        yet (retried)."""
        return len(self._undelivered) + len(self._unended)

    def _settle(self) -> None:
        """The thread: apply owed writes, oldest first, at most :data:`SETTLE_BATCH` per turn.
        Raises what the first one that gets no answer raised (the loop counts it), leaving it
        and the rest owed. One answered ``WRONGTYPE`` (a key another client wrote over) can
        never land: given up; one a full Redis refused (``OOM``) stays owed, and the rest are
        tried."""
        from redis.exceptions import OutOfMemoryError
        with self._owed_lock:
            entries = list(itertools.islice(self._owed.values(), SETTLE_BATCH))
        for entry in entries:
            if self._stop.is_set():
                return
            if time.monotonic() > entry.deadline:
                self.owed_expired += 1
                self._unowe(entry.key, entry)
                continue
            try:
                stored = entry.fn()
            except OutOfMemoryError:
                # Redis is full: this write stays owed; the next (an end, say) may not need
                # memory, and the turn goes on to the box (README: reads go on)
                self._answered()
                continue
            except Exception as e:
                if not wrong_type(e):
                    raise
                # a key another client wrote over: this write can never land, and kept it
                # would fail every turn before the renewals and the box (see _run)
                log.warning("an owed Redis write (a %s) was given up: %s", entry.key[0], e)
                self.owed_dropped += 1
                self._unowe(entry.key, entry)
                continue
            self._answered()
            self._unowe(entry.key, entry)
            self.owed_applied += 1
            if entry.key[0] == "publish" and stored and entry.key[1] in self._deleted:
                self._owe_delete(entry.key[1])  # deleted while its publish was on the way

    def _owe_delete(self, sid: str) -> None:
        self._owe(("delete", sid), self._session_ttl, functools.partial(self._delete, sid))

    # ------------------------------------------------------------------ transport hooks

    def track(self, request_id: object, scope: str) -> tuple[str, str, int, bool] | None:
        """A ``tools/call`` begins: hold a cross-host in-flight row. Returns the handle for
        :meth:`untrack`. Kept locally even while Redis is down (added back when it returns)."""
        rid = ids.key(request_id)
        if rid is None:
            return None
        r = self.remote
        token = r.track_offline(scope, rid)  # held here first: a failed add leaves no orphan
        try:
            self._ask("track", r.track_held, scope, rid, token)
            answered = True
        except _NoAnswer:
            answered = False
        return scope, rid, token, answered

    def untrack(self, handle: tuple[str, str, int, bool] | None) -> None:
        """The call ended: its row ends in Redis now, or is owed (Redis down or not answering;
        straight away when its track got no answer either, so a request pays the timeout at
        most once)."""
        if handle is None:
            return
        scope, rid, token, answered = handle
        if answered:
            try:
                self._ask("untrack", self.remote.untrack_token, scope, rid, token)
                return
            except _NoAnswer:
                pass
        raw = self.remote.release(scope, rid, token)
        if raw is not None:
            self._owe(("untrack", scope, rid, raw), self.remote.lease,
                      functools.partial(self.remote.untrack_released, scope, rid, raw))

    def cancel(self, request_id: object, reason: object, scope: str) -> bool:
        """A notification found nothing in flight here: record it if the request runs on some
        host (it is delivered there). Raises ``CancellationLimitReached`` (quota), and
        ``RemoteUnavailable`` when Redis answered ``WRONGTYPE`` (a key of ours another client
        wrote over that the script could not mend: an owed retry would meet it too, so the
        client is asked to retry instead); False when not in flight anywhere, or when Redis gave
        no answer: then the cancellation is owed for :data:`CANCEL_TTL` seconds (still gated on
        the request being in flight when it lands, so a call that ended meanwhile gets no row,
        and recorded as of now, so a call of the id that began since ignores it)."""
        at = self.remote.clock()
        try:
            return bool(self._ask("cancel", self.remote.cancel_if_in_flight, request_id,
                                  reason, scope))
        except _Damaged as e:
            raise RemoteUnavailable(f"cross-host cancellation not delivered: {e}",
                                    cause="is damaged") from None
        except _NoAnswer:
            rid = ids.key(request_id)
            if rid is not None:
                self._owe(("cancel", scope, rid), CANCEL_TTL,
                          functools.partial(self._owed_cancel, rid, reason, scope, at))
            return False

    def _owed_cancel(self, rid: str, reason: object, scope: str, at: float) -> None:
        try:
            self.remote.cancel_key_if_in_flight(rid, reason, scope, at)
        except CancellationLimitReached as e:  # the quota filled meanwhile: nothing to retry
            log.warning("an owed cross-host cancellation was refused: %s", e)

    def publish_session(self, sid: str, version: str, client: str, *,
                        minted: bool = False) -> None:
        """A session minted (or adopted) here: stored for other hosts, and this worker's box
        listed to hear of its deletion elsewhere. Owed when Redis gives no answer. One
        ``minted`` here that a full Redis refused (``OOM``) raises ``RemoteUnavailable``
        instead, forgotten here: Redis answers the other hosts, which would answer it 404 (the
        caller does not hand it out)."""
        with self._owed_lock:
            _put_newest(self._held, sid, (version, client))
            _put_newest(self._kept, sid, time.monotonic())
        put = functools.partial(self._put, sid, version, client)
        try:
            self._ask("session", put)
        except _Refused as e:
            if not minted:
                self._owe(("publish", sid), self._session_ttl, put)
                return
            with self._owed_lock:
                self._held.pop(sid, None)
                self._kept.pop(sid, None)
            raise RemoteUnavailable(f"a new session could not be stored in Redis: {e}",
                                    cause="is full") from None
        except _NoAnswer:
            self._owe(("publish", sid), self._session_ttl, put)

    def _put(self, sid: str, version: str, client: str, seen: float | None = None) -> bool:
        """Store the session in Redis; False when Redis refused it, deleted lately on another
        host (then it is ended here too: :meth:`_gone`). The client's sessions Redis gave up
        for its bound end here too (their other holders were told through their boxes, this
        worker's was not), so that no host serves one the others answer 404. ``seen``: when
        the session was last used (wall-clock seconds), for a store that is no use of it (a
        restore after Redis lost it): its place in its client's order; now when None."""
        now_ms = int(time.time() * 1000)
        given_up = self.store.put_session(
            sid, version, client, now_ms=now_ms,
            seen_ms=now_ms if seen is None else int(seen * 1000), box=self.remote.box,
            box_lease_ms=int(self.remote.lease * 1000),
            alive=self.store.alive_key(self.remote.box) if self._alive_set else None,
            restoring_ms=self._restoring_ms, others=self._last_uses(sid, client))
        if given_up is None:
            self._gone(sid)
            return False
        for old in given_up:
            self._gone(old)
        return True

    def _last_uses(self, sid: str, client: str) -> list[tuple[str, int]]:
        """``(id, last_seen in wall-clock ms)`` of the sessions of ``client`` but ``sid`` in
        this host's table, at most ``sessions_per_client``: a store sends them, so that Redis
        orders the client's sessions by their use here within a touch interval, not only as of
        their last renewal (once a minute per process). Empty when the table cannot be read."""
        sessions = self._session_store()
        digest = sessions.client_digest(client)
        out: list[tuple[str, int]] = []
        try:
            for other in sessions.client_sessions(client):
                if len(out) >= sessions.per_client:
                    break
                s = None if other == sid else sessions.get(other)
                if s is not None and s.client == digest:
                    out.append((other, int(s.last_seen * 1000)))
        except ShmCancelError:  # its lock stalled, the registry closed: Redis's order as is
            return []
        return out

    def _gone(self, sid: str) -> None:
        """Session ``sid`` was ended elsewhere (deleted on another host, or given up in Redis
        for its client's bound), and this process had not heard of it (its store raced the
        DELETE, Redis had lost the boxes to tell, or this process's store gave it up): never
        published or adopted again here, and this host's copy and calls end."""
        self._forget(sid)
        self._end_session(sid)

    def session_ended(self, sid: str) -> bool:
        """Whether session ``sid`` ended, here or elsewhere, as far as this process heard
        (:meth:`_forget`: the newest :data:`OWED_MAX` kept)."""
        return sid in self._deleted

    def _forget(self, sid: str) -> None:
        """Session ``sid`` ended: remembered as deleted here, no longer published (nor its
        publish owed) or renewed."""
        with self._owed_lock:
            self._deleted[sid] = None
            if len(self._deleted) > OWED_MAX:
                self._deleted.popitem(last=False)
            self._held.pop(sid, None)
            self._kept.pop(sid, None)
        self._unowe(("publish", sid))

    def keep_session(self, sid: str, client: str | None = None) -> None:
        """A request used session ``sid`` here: at most every :data:`KEEP_EVERY` seconds (or a
        quarter of ``session_ttl``) this process renews its copy's lifetime in Redis, so other
        hosts keep finding a session in use, and lists this worker among its holders (told of a
        ``DELETE`` elsewhere: the worker that adopted this host's copy may have died); a copy
        gone (Redis restarted empty) is stored again when this process published it, one
        deleted elsewhere lately is ended here. One this process did not publish is renewed
        with its client's set of sessions (the per-client bound), and stored again, too when
        ``client`` (the request's) is the one this host counts it against: the process that
        published it may have died (a recycled worker).
        Never raises; a renewal without an answer is retried
        at the next request after the period."""
        if not _minted_form(sid):
            return
        now = time.monotonic()
        with self._owed_lock:
            last = self._kept.get(sid)
            if last is not None and now - last < min(KEEP_EVERY, self._session_ttl / 4):
                return
            _put_newest(self._kept, sid, now)
            held = self._held.get(sid)
        with contextlib.suppress(_NoAnswer):
            self._ask("session", self._keep, sid, held, client)

    def _keep(self, sid: str, held: tuple[str, str] | None, client: str | None) -> None:
        served = None  # held here only as a copy the request's client is counted for
        if held is None and client is not None:
            held = served = self._served(sid, client)
        kept = self.store.touch_session(sid, None if held is None else held[1],
                                        box=self.remote.box, now_ms=int(time.time() * 1000))
        if kept < 0:  # deleted on another host, and this worker's box was not told
            self._gone(sid)
        elif kept == 0 and held is not None:
            if served is not None:
                with self._owed_lock:
                    _put_newest(self._held, sid, held)
            self._put(sid, *held)

    def _served(self, sid: str, client: str) -> tuple[str, str] | None:
        """``(version, client)`` of this host's copy of session ``sid`` when ``client`` (a
        request's) is the one it counts against, else None. Its renewal then renews that
        client's set of sessions too, as its publisher's does: the per-client bound counts the
        sessions in use, and the publisher may have died while the session lives on here."""
        sessions = self._session_store()
        s = sessions.get(sid)
        if s is None or s.client != sessions.client_digest(client):
            return None
        return s.protocol_version, client

    def lookup_session(self, sid: str, may_use: Callable[[str], bool] | None = None
                       ) -> tuple[str, str] | None:
        """``(protocol_version, client)`` of a session another host minted; the caller adopts
        it, so this worker is listed as a holder. None when Redis says there is no such session
        (or it was deleted here, or the id is not of the form this transport mints: it is not
        looked up), or when ``may_use(client)`` is false (the caller may not use it: it is
        neither renewed nor listed); raises ``RemoteUnavailable`` when Redis gave no answer, or
        when it has none but lost data since this worker's last look (its alive key is gone),
        or within a renewal period and a retry after this worker restored what it holds: the
        session's host may not have stored it again yet."""
        if sid in self._deleted or not _minted_form(sid):
            return None
        # this worker's alive key, read with the session: missing though it was set, Redis
        # lost data since (a FLUSHALL) and the session's host has not stored it again yet
        was_set = self._alive_set
        try:
            got, alive, mending = self._ask(
                "session", self.store.get_session_and_alive, sid,
                self.store.alive_key(self.remote.box) if was_set else None)
        except _NoAnswer as e:
            raise RemoteUnavailable(f"session lookup got no answer from Redis ({e})") from None
        if isinstance(got, Damaged):
            self._mend_session(sid, got)
        if got is None and ((not alive and self._alive_set)
                            or time.monotonic() < self._restoring_until):
            raise RemoteUnavailable("session lookup: Redis lost data (a FLUSHALL, an eviction, "
                                    "a restart) and its hosts may not have stored their "
                                    "sessions again yet",
                                    cause="lost data; its hosts store it again")
        if got is None and mending:
            raise RemoteUnavailable("session lookup: its copy in Redis was damaged; its "
                                    "holders store it again", cause=_DAMAGED)
        if isinstance(got, tuple) and may_use is not None and not may_use(got[1]):
            return None
        if isinstance(got, tuple):
            self.publish_session(sid, got[0], got[1])
            if sid in self._deleted:  # deleted since the lookup: Redis refused to store it
                return None
            return got
        return None

    def _mend_session(self, sid: str, got: Damaged) -> NoReturn:
        """A lookup met a copy of session ``sid`` no host can adopt (another client wrote over
        it): it is deleted and its holders are told to store it again (:meth:`_store_again`),
        and the lookup raises ``RemoteUnavailable``: the session may well live on its holders'
        hosts, so not 404. A copy stored again since it was read is looked up anew."""
        try:
            told = self._ask("session", self.store.mend_session, sid, got.seen,
                             box_lease_ms=int(self.remote.lease * 1000))
        except _NoAnswer as e:
            raise RemoteUnavailable(f"session lookup: its copy in Redis is damaged ({e})"
                                    ) from None
        if told < 0:
            raise RemoteUnavailable("session lookup: its copy in Redis changed meanwhile",
                                    cause=_DAMAGED)
        log.warning("a session's copy in Redis was not one (another client's write): deleted, "
                    "%d holder(s) told to store it again", told)
        raise RemoteUnavailable("session lookup: its copy in Redis was damaged; its holders "
                                "store it again", cause=_DAMAGED)

    def _store_again(self, sid: str) -> None:
        """The thread: session ``sid``'s copy in Redis was damaged (:meth:`_mend_session`):
        stored again when this process published or adopted it and it lives here."""
        with self._owed_lock:
            held = self._held.get(sid)
        here = None if held is None else self._session_store().get(sid)
        if held is None or here is None:
            return
        put = functools.partial(self._put, sid, *held, here.last_seen)
        try:
            self._ask("session", put)
        except _NoAnswer:
            self._owe(("publish", sid), self._session_ttl, put)

    def delete_session(self, sid: str) -> None:
        """A session ended here: forgotten in Redis, and every other host holding it deletes
        its copy (through the boxes). Owed when Redis gives no answer."""
        self._forget(sid)
        try:
            self._ask("session", self._delete, sid)
        except _NoAnswer:
            self._owe_delete(sid)

    def _delete(self, sid: str) -> None:
        self.store.delete_session(sid, own_box=self.remote.box,
                                  box_lease_ms=int(self.remote.lease * 1000))

    def cancel_scope(self, scope: str, reason: object) -> int:
        """Cancel every request in flight in ``scope`` on any host (a session's ``DELETE``);
        how many were recorded. Every one, past the scope's quota too, as the local one does
        (contract §6.1)."""
        try:
            return int(self._ask("cancel_scope", self.remote.cancel_scope, scope, reason))
        except _NoAnswer:
            return 0

    # ------------------------------------------------------------------ the thread

    def start(self) -> None:
        """Start the thread. When the process exits, this worker's box is marked stopped
        (:meth:`_box_stopped`), whichever bridge is the process's current one then."""
        self._thread = threading.Thread(target=self._run, name="shmcancel-redis", daemon=True)
        self._thread.start()
        with _current_lock:
            _started.add(self)

    def stop(self, timeout: float = 2.0) -> None:
        """End the thread (waiting for it up to ``timeout`` and a turn) and mark this worker's
        box stopped (:meth:`_box_stopped`). Never raises."""
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout + self.block + self.timeout)
        self._box_stopped()

    def _box_stopped(self) -> None:
        """Tell Redis this worker's box is read no more (``RedisStore.box_stopped``): it leaves
        the holders of the sessions it served, which a ``DELETE`` tells. Once, after the
        thread was told to stop, never while Redis is marked down (the call would wait out its
        timeout; the box stays listed then, as a killed worker's does). Never raises."""
        if self._marked or self.down or self._thread is None:
            return
        self._marked = True
        try:
            self.store.box_stopped(self.remote.box)
        except Exception as e:
            log.debug("marking this worker's Redis box stopped: %s", e)

    def _run(self) -> None:
        from redis.exceptions import OutOfMemoryError, RedisError, ResponseError
        box = self.store.box_key(self.remote.box)
        taken = self.store.taken_key(self.remote.box)
        alive = self.store.alive_key(self.remote.box)
        lease_ms = int(self.remote.lease * 1000)  # the box's and the taken list's
        unconfirmed = True  # the taken list may hold items (a failed call, or a restart)
        next_renew = 0.0
        while not self._stop.is_set():
            try:
                # the registry only, Redis down or not; a lock timeout there (a stalled holder)
                # leaves the box in Redis for this turn: taking more out would cost each its own
                # lock_timeout wait before the next renewal, the registry could take none. A
                # holder seen stalled is not waited on at all: a lock_timeout per turn (10 s by
                # default) would outlast the leases this thread renews (10 s)
                stalled = self._lock_stalled()
                if not stalled and (self._undelivered or self._unended):
                    stalled = not self._redeliver()
                if self.down or self._recovering:
                    if self.down:
                        self.store.client.ping()
                        self._answered()
                        self._recovering = True
                        self.down = False
                        self._set_restoring()  # it may have restarted empty
                    added = self.remote.renew()
                    republished = self._republish()
                    with self._owed_lock:  # Redis may have lost them: each session's next
                        self._kept.clear()  # request here renews (or stores) it at once
                    self._recovering = False
                    try:  # marked from here: a loss right after this restore is seen too
                        self.store.set_alive(self.remote.box, lease_ms)
                        self._alive_set = True
                    except OutOfMemoryError:
                        self._alive_set = False  # refused: its absence says nothing
                    log.warning("%s (%d in-flight rows added back, %d sessions stored again, "
                                "%d writes owed)",
                                "Redis lost data while it answered (a FLUSHALL, an eviction, "
                                "or a restart between two looks): restoring what this worker "
                                "holds" if self._forgot else
                                "Redis answers again: cross-host cancellation resumed",
                                added, republished, self.owed())
                    self._forgot = False
                    next_renew = time.monotonic() + self.block
                    self._restoring_until = next_renew + self.block + self.retry
                if self._owed:
                    self._settle()
                now = time.monotonic()
                if now >= next_renew:
                    try:
                        self.remote.renew()
                        for k in (box, taken):
                            self.store.client.pexpire(k, lease_ms)
                        if self._lost(alive, lease_ms):  # restored at once: the next turn
                            self._recovering = self._forgot = True
                            continue  # (not after this turn's wait for the box)
                    except OutOfMemoryError as e:  # full: the box is read all the same
                        log.debug("renewing leases: Redis is full (%s)", e)
                        self._alive_set = False  # refused: its expiry is no loss
                    self._answered()
                    next_renew = now + self.block
                if now >= self._next_sweep:
                    self._next_sweep = now + self._janitor_interval
                    self.remote.cleanup()
                if stalled:  # renewals go on every turn: no longer apart than the lease
                    self._stop.wait(min(self.retry, self.block))
                    continue
                try:
                    if unconfirmed:
                        if not self._apply_taken(taken):
                            # one kept at a lock timeout: _redeliver applies it first, next
                            # turn, before anything newer is taken (oldest first: take.lua)
                            continue
                        unconfirmed = False
                    try:  # wait for an item, leaving it in the box (a rotation of one end)
                        waited = self._blocking.client.blmove(box, box, self.block, "RIGHT",
                                                              "RIGHT")
                        moved = True
                    except OutOfMemoryError:  # a full Redis refuses moves (they may add data):
                        got = self._blocking.client.brpop([box], timeout=self.block)
                        waited, moved = (got[1] if got else None), False  # pops, oldest first
                    raw = (self.store.take(box, taken, lease_ms) if moved and waited is not None
                           else waited)
                    # and what else waits, without blocking; up to a lock timeout (see above)
                    for _ in range(1000):
                        if raw is None or not (self._take(taken, raw) if moved
                                               else self._apply(raw)):
                            break
                        raw = (self.store.take(box, taken, lease_ms) if moved
                               else self.store.client.rpop(box))
                except ResponseError as e:
                    if not wrong_type(e):
                        raise
                    # another client wrote over this worker's box (or its taken list): take.lua
                    # mends both, deleting only a key of another type (a cancellation pushed
                    # since into the box, which cancel.lua mended, stays: it is moved to the
                    # taken list, applied next turn)
                    log.warning("this worker's Redis box was not a list (written by another "
                                "client): mended")
                    self.store.take(box, taken, lease_ms)
                    unconfirmed = True
                    continue
            except (RedisError, OSError) as e:
                unconfirmed = True
                self._failed("bridge thread", e)
                self._stop.wait(self.retry)
            except LockTimeout:
                pass  # a request's Redis call held on: renew on the next turn
            except Exception:
                log.exception("shmcancel redis bridge: unexpected error")
                self._stop.wait(self.retry)

    def _lost(self, alive: bytes, lease_ms: int) -> bool:
        """Set ``alive`` for another lease; whether it was missing though this worker had set it
        (a lease ago at most): Redis answered all along, yet lost data, which the down-and-back
        path never sees. What the worker holds is then restored as after an outage (rows added
        back, its sessions stored again): until then other hosts answer its sessions 404, and
        Redis gives up no client's sessions for a while (:meth:`_set_restoring`). Loss
        of other keys alone (an eviction policy that spares this one) goes unseen: run Redis
        with ``noeviction``."""
        existed = self.store.set_alive(self.remote.box, lease_ms)
        was_set, self._alive_set = self._alive_set, True
        if was_set and not existed:
            self._set_restoring()
        return was_set and not existed

    def _set_restoring(self) -> None:
        """Redis may have lost data: no session store gives up a client's sessions while the
        workers restore theirs and their in-flight rows (``session.lua``). A full Redis that
        refuses the mark refuses those stores too."""
        from redis.exceptions import OutOfMemoryError
        with contextlib.suppress(OutOfMemoryError):
            self.store.set_restoring(self._restoring_ms)

    def _lock_stalled(self) -> bool:
        """True when a live process has held the registry lock, in one acquisition, for
        ``_STALL`` seconds (a third of ``block`` at most: a turn may ask twice besides its
        ``block`` of reading, and still renews well within the lease). Writers hold it for
        microseconds, a sweep's hold for 1 ms at most: a write would wait ``lock_timeout``."""
        lock = self.registry.lock
        wait = min(_STALL, self.block / 3)
        deadline = time.monotonic() + wait
        gen = lock.generation
        while True:
            owner = lock.owner()
            if owner is None or lock.generation != gen or not procinfo.alive(*owner):
                return False
            if time.monotonic() >= deadline:
                return True
            if self._stop.wait(wait / 10):
                return False

    def _republish(self) -> int:
        """After an outage (Redis may have restarted empty): owe a store of every session this
        process published that still lives here, so other hosts find it again; how many. Each
        keeps its place in its client's order (its last use here): a restore is no use."""
        sessions = self._session_store()
        with self._owed_lock:
            held = list(self._held.items())
        n = 0
        for sid, (version, client) in held:
            if (here := sessions.get(sid)) is None:  # ended here meanwhile: not brought back
                with self._owed_lock:
                    self._held.pop(sid, None)
                continue
            self._owe(("publish", sid), self._session_ttl,
                      functools.partial(self._put, sid, version, client, here.last_seen))
            n += 1
        return n

    def _session_store(self) -> Any:
        if self._sessions is None:
            self._sessions = SessionStore(self.registry)
        return self._sessions

    def _take(self, taken: bytes, raw: bytes) -> bool:
        """Apply an item moved to the ``taken`` list (``take.lua``), then drop it from there.
        One applied whose drop got no answer (its item still listed) is not applied again:
        a session's end would report its calls cancelled once more. :meth:`_apply`'s answer."""
        if raw in self._applied:
            ok = True
        else:
            ok = self._apply(raw)
            self._applied[raw] = None
            while len(self._applied) > TAKEN_MAX:
                self._applied.popitem(last=False)
        self.store.client.lrem(taken, 1, raw)
        self._applied.pop(raw, None)
        return ok

    def _apply_taken(self, taken: bytes) -> bool:
        """Apply what the ``taken`` list holds: items moved out of the box whose move's reply
        was lost, or whose drop's (oldest first; at most a box's worth). Stops at one the
        registry's lock timed out on (:meth:`_apply` kept it for :meth:`_redeliver`), the rest
        left listed, and returns False: as the box's reading does, so that what was kept lands
        before anything newer (an older cancellation of a reused id applied after the newer
        would leave the running call uncancelled)."""
        for raw in self.store.client.lrange(taken, 0, TAKEN_MAX - 1):
            if not self._take(taken, raw):
                return False
        return True

    def _apply(self, raw: bytes) -> bool:
        """Apply one item of this worker's box; False when the registry's lock timed out (the
        item is kept for :meth:`_redeliver`)."""
        got = RedisStore.decode_box_item(raw)
        if got is None:
            return True
        if isinstance(got, tuple) and len(got) == 2:  # its copy in Redis was damaged
            self._store_again(got[1])
            return True
        stalled = self._lock_stalled()  # kept as at a lock timeout, without its wait (_run)
        if isinstance(got, str):  # a session deleted on another host
            self._forget(got)  # first: an adoption under way looks after its insert
            return self._end_session(got, time.monotonic() + self._session_ttl,
                                     stalled=stalled)
        scope, rid, reason, at = got
        return self._deliver(rid, reason, scope, time.monotonic() + CANCEL_TTL, at,
                             stalled=stalled)

    def _deliver(self, rid: str, reason: object, scope: str, deadline: float,
                 at: float | None, retry: bool = False, stalled: bool = False) -> bool:
        """Record a cancellation taken from this worker's box, gated on its call being in
        flight here. One the registry cannot take now (its lock held past ``lock_timeout``,
        /dev/shm full) is kept and tried again by the thread every turn (:meth:`_redeliver`,
        Redis down or not) until ``deadline`` (``time.monotonic()``): it was taken out of
        Redis, so dropping it would lose it. A quota refusal is final. The local row is stamped
        with ``at``, when the cancellation was recorded in Redis (another host's clock): a call
        of the id that began here after it (the one it was for ended before its box was read,
        and the id was reused) ignores it, as it does any row older than itself. Logged as a
        warning the first time and when given up, retries at debug. False when the lock timed
        out, or ``stalled`` (:meth:`_lock_stalled`, seen before: kept without a wait)."""
        try:
            if stalled:
                raise LockTimeout(_STALLED)
            # A row here already: this host recorded the cancellation too (its own DELETE or
            # notification, before it went through Redis) and reported it; a leftover row is
            # replaced, unreported (contract §4.7: each cancellation reported once).
            fresh = self.local.cancelled_at(rid, scope) is None
            if self.local.cancel_key_if_in_flight(rid, reason, scope, at,  # rid: a row key
                                                  report=fresh):
                self.delivered += 1
                # its tool may be waiting (wait_cancelled): wake it, as the transport does
                wake.ring(self.registry.name, self.local.in_flight_pids(rid, scope))
        except (LockTimeout, TableFull) as e:
            left = deadline - time.monotonic()
            if left > 0:
                with self._owed_lock:
                    self._undelivered.pop((scope, rid), None)
                    if len(self._undelivered) >= OWED_MAX:
                        self._undelivered.popitem(last=False)
                    self._undelivered[(scope, rid)] = (reason, deadline, at)
            log.log(logging.DEBUG if retry and left > 0 else logging.WARNING,
                    "could not apply a cross-host cancellation now: %s (%s)", e,
                    f"tried again for {left:.1f} s" if left > 0 else "given up")
            return not isinstance(e, LockTimeout)
        except Exception as e:  # quota on this host: logged, never fatal
            log.warning("could not apply a cross-host cancellation: %s", e)
        return True

    def _redeliver(self) -> bool:
        """The thread: try again the cancellations and session ends the registry could not
        take (:meth:`_deliver`, :meth:`_end_session`), oldest first; stops at a lock timeout
        (the others would wait it too), leaving the rest for the next turn, and then returns
        False."""
        with self._owed_lock:
            due = list(self._undelivered.items())
        for (scope, rid), (reason, deadline, at) in due:
            if self._stop.is_set():
                return True
            with self._owed_lock:
                if self._undelivered.get((scope, rid)) != (reason, deadline, at):
                    continue  # replaced meanwhile
                del self._undelivered[(scope, rid)]
            if not self._deliver(rid, reason, scope, deadline, at, retry=True):
                return False
        with self._owed_lock:
            ends = list(self._unended.items())
        for sid, (deadline, reported) in ends:
            if self._stop.is_set():
                return True
            with self._owed_lock:
                if self._unended.pop(sid, None) is None:
                    continue
            if not self._end_session(sid, deadline, retry=True, reported=reported):
                return False
        return True

    def _end_session(self, sid: str, deadline: float | None = None, retry: bool = False,
                     reported: tuple[str, ...] = (), stalled: bool = False) -> bool:
        """Session ``sid`` ended elsewhere (deleted on another host, or given up in Redis for
        its client's bound): end this host's copy and cancel its calls in flight here, as a
        local ``DELETE`` does (``Cancellation.cancel_scope_around``:
        before the copy goes, and again after for a call begun in between). That DELETE
        cancelled the calls Redis listed in flight; a call that began here since passed its
        session check on this copy, and is cancelled now (it re-reads its session once
        tracked: one of the two sees the other). One the registry
        cannot take now (its lock held past ``lock_timeout``) is kept and tried again by the
        thread every turn (:meth:`_redeliver`) until ``deadline`` (``time.monotonic()``;
        default: a session TTL from now): it was taken out of Redis, so dropping it would leave
        the session's calls here running. False when the lock timed out, or ``stalled`` (seen
        before: kept without a wait).

        Each call is reported cancelled once (contract §4.7): the events come once every write
        is done, and the keys reported (``reported``) are kept with an end retried after a
        stall. The bells ring for whatever was recorded, a step stalling or not."""
        if deadline is None:
            deadline = time.monotonic() + self._session_ttl
        done = list(reported)

        def end() -> bool:  # this host's copy, whether or not it is still here
            self._session_store().delete(sid)
            return True

        try:
            if stalled:
                raise LockTimeout(_STALLED)
            scope = self.local.scope({SESSION_KEY: sid})
            self.local.cancel_scope_around(scope, "session deleted", end, reported=done,
                                           ring=lambda: wake.ring(self.registry.name))
        except LockTimeout as e:  # the calls cancelled before the stall were rung already
            left = deadline - time.monotonic()
            if left > 0:
                with self._owed_lock:
                    self._unended.pop(sid, None)
                    if len(self._unended) >= OWED_MAX:
                        self._unended.popitem(last=False)
                    self._unended[sid] = (deadline, tuple(done))
            log.log(logging.DEBUG if retry and left > 0 else logging.WARNING,
                    "could not end a session deleted on another host now: %s (%s)", e,
                    f"tried again for {left:.1f} s" if left > 0 else "given up")
            return False
        except Exception as e:
            log.warning("could not end a session deleted on another host: %s", e)
        return True


def current() -> Bridge | None:
    """This process's bridge, if one was started here (never inherited across fork)."""
    b = _current
    if b is not None and b._pid != os.getpid():
        return None
    return b


remote.install(current)  # the transport asks this bridge where the local registry has no answer


def start(registry: Any, url: str, **kw: Any) -> Bridge:
    """Start this process's bridge (replacing one inherited or started before). When the
    process exits (a recycled or stopped worker), its box is marked stopped."""
    global _current
    b = Bridge(registry, url, **kw)
    b.start()
    with _current_lock:
        _current = b
    return b


def _at_exit() -> None:
    """The process exits: the boxes of the bridges it started are read no more. Marked without
    joining their threads (in a ``BLMOVE`` one would hold the exit up to a second): nothing a
    thread still does can undo a mark."""
    with _current_lock:
        started = [b for b in _started if b._pid == os.getpid()]
    for b in started:
        b._stop.set()
        b._box_stopped()


atexit.register(_at_exit)  # a process that started no bridge looks at an empty set


def stop() -> None:
    global _current
    with _current_lock:
        b, _current = _current, None
    if b is not None and b._pid == os.getpid():
        b.stop()


def start_from_env(registry: Any, url: str) -> Bridge:
    """:func:`start` with settings from the environment (the gunicorn integration):
    ``SHMCANCEL_REDIS_PREFIX`` (default ``shmcancel:``), ``SHMCANCEL_REDIS_TIMEOUT`` (seconds,
    0.5), ``SHMCANCEL_REDIS_LEASE`` (seconds, 10), ``SHMCANCEL_HOST_ID`` (the host name)."""
    def seconds(name: str, default: float) -> float:
        raw = os.environ.get(name)
        try:
            v = float(raw) if raw else default
        except ValueError:
            v = -1.0
        if not 0 < v <= 3600:
            raise ValueError(f"{name} must be seconds in (0, 3600], got {raw!r}")
        return v
    return start(registry, url, prefix=os.environ.get("SHMCANCEL_REDIS_PREFIX", "shmcancel:"),
                 timeout=seconds("SHMCANCEL_REDIS_TIMEOUT", 0.5),
                 lease=seconds("SHMCANCEL_REDIS_LEASE", 10.0))
