"""The per-worker bridge between a host's shared-memory registry and Redis.

One :class:`Bridge` per worker process, started after fork (``shmcancel.gunicorn.post_fork``
when ``SHMCANCEL_REDIS_URL`` is set; never in the master). It does three things:

- the transport tells it when a ``tools/call`` starts and ends (:meth:`track` / :meth:`untrack`:
  one Redis script each, bounded by the client timeout), so Redis holds a cross-host in-flight
  index owned by ``<host>:<pid>`` with a lease;
- a ``notifications/cancelled`` that finds nothing in flight on this host asks Redis
  (:meth:`cancel`): one script gates on that index, applies the quota / cap / eviction rules and
  pushes the cancellation into the box (a list) of each worker running the request;
- its thread ``BLPOP``\\s the worker's box and writes each cancellation into the local registry
  (``cancel_if_in_flight``: local gating again, so a call that ended meanwhile gets no row), then
  the tool's next *local* poll sees it. A box is a list, so what arrives while the thread is busy
  or briefly disconnected waits there: the catch-up read is the next ``BLPOP``. The thread also
  renews the worker's leases every ``lease / 3`` and expires old rows every ``janitor_interval``.

Polls never touch Redis. Redis down or slow: every call gives up after ``timeout`` (one budget:
a third waiting for this worker's other Redis call, else the call is skipped; a third to
connect; a third to read; no retries), so a request's first failing call costs it at most
``timeout`` and the rest are skipped; the first
failure marks the bridge down and logs one warning; while down, calls return at once without
Redis (requests are served, same-host cancellation works through shared memory, cross-host
cancellation and session adoption do not); the thread probes every ``retry`` seconds and, when
Redis answers, logs once, adds back every in-flight row of the worker (renew) and resumes.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from shmcancel.config import Config
from shmcancel.exceptions import CancellationLimitReached, LockTimeout

from ..cancel import ids
from ..mcp import remote
from ..mcp.sessions import SessionStore
from .cancellation import RedisCancellation, connect
from .store import RedisStore

__all__ = ["Bridge", "current", "start", "start_from_env", "stop"]

log = logging.getLogger("shmcancel.redis")

_current: Bridge | None = None
_current_lock = threading.Lock()


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
        self.block = max(0.05, min(1.0, lease / 3))  # BLPOP wait, and the renew period floor
        cfg = config or registry.config
        # One budget of `timeout` per call: a third waiting for this process's other Redis
        # call (RedisStorage's I/O lock), a third connecting, a third reading.
        self.store = RedisStore(connect(url, timeout=timeout * 2 / 3), cfg, prefix=prefix)
        # The box reader (the thread, never a request) blocks up to `block`: its socket reads
        # wait that long plus the timeout.
        self._blocking = RedisStore(connect(url, timeout=2 * (self.block + timeout)), cfg,
                                    prefix=prefix)
        self.remote = RedisCancellation(self.store, lease=lease, host=host,
                                        io_wait=timeout / 3)
        self.down = False
        self.delivered = 0
        self._pid = os.getpid()
        self._sessions: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._next_sweep = time.monotonic() + cfg.janitor_interval
        self._janitor_interval = cfg.janitor_interval

    # ------------------------------------------------------------------ health

    def _failed(self, what: str, e: BaseException) -> None:
        if not self.down:
            self.down = True
            log.warning("Redis unreachable (%s: %s): serving on; cross-host cancellation and "
                        "sessions paused until it answers", what, e)

    def _guard(self, what: str, fn: Any, *a: Any, **kw: Any) -> Any:
        """``fn(*a, **kw)`` unless Redis is down; a Redis failure marks it down (None); this
        process's other Redis call holding on past the wait skips this one (None)."""
        if self.down:
            return None
        from redis.exceptions import RedisError
        try:
            return fn(*a, **kw)
        except (RedisError, OSError) as e:
            self._failed(what, e)
            return None
        except LockTimeout as e:
            log.debug("skipped a Redis call: %s", e)
            return None

    # ------------------------------------------------------------------ transport hooks

    def track(self, request_id: object, scope: str) -> tuple[str, str, int] | None:
        """A ``tools/call`` begins: hold a cross-host in-flight row. Returns the handle for
        :meth:`untrack`. Kept locally even while Redis is down (added back when it returns)."""
        rid = ids.key(request_id)
        if rid is None:
            return None
        r = self.remote
        token = r.track_offline(scope, rid)  # held here first: a failed add leaves no orphan
        self._guard("track", r.track_held, scope, rid, token)
        return scope, rid, token

    def untrack(self, handle: tuple[str, str, int] | None) -> None:
        if handle is None:
            return
        scope, rid, token = handle
        # Down (or failing now): dropped here only; its lease ends the row in Redis.
        if self.down or self._guard("untrack", self.remote.untrack_token, scope, rid,
                                    token) is None:
            self.remote.forget(scope, rid, token)

    def cancel(self, request_id: object, reason: object, scope: str) -> bool:
        """A notification found nothing in flight here: record it if the request runs on some
        host (it is delivered there). Raises ``CancellationLimitReached`` (quota); False when
        not in flight anywhere or Redis is down."""
        from redis.exceptions import RedisError
        if self.down:
            return False
        try:
            return self.remote.cancel_if_in_flight(request_id, reason, scope)
        except CancellationLimitReached:
            raise
        except (RedisError, OSError) as e:
            self._failed("cancel", e)
            return False

    def publish_session(self, sid: str, version: str, client: str) -> None:
        """A session minted here (or adopted here): stored for other hosts, and this worker's
        box listed to hear of its deletion elsewhere."""
        self._guard("session", self.store.put_session, sid, version, client,
                    now_ms=int(time.time() * 1000), box=self.remote.box)

    def lookup_session(self, sid: str) -> tuple[str, str] | None:
        """``(protocol_version, client)`` of a session another host minted; the caller adopts
        it, so this worker is listed as a holder."""
        got = self._guard("session", self.store.get_session, sid)
        if isinstance(got, tuple):
            self.publish_session(sid, got[0], got[1])
            return got
        return None

    def delete_session(self, sid: str) -> None:
        """A session ended here: forgotten in Redis, and every other host holding it deletes
        its copy (through the boxes)."""
        self._guard("session", self.store.delete_session, sid, own_box=self.remote.box,
                    box_lease_ms=int(self.remote.lease * 1000))

    def cancel_scope(self, scope: str, reason: object) -> int:
        """Cancel every request in flight in ``scope`` on any host (a session's ``DELETE``);
        how many were recorded. Stops quietly at the scope's quota, as the local one does."""
        from redis.exceptions import RedisError
        if self.down:
            return 0
        try:
            return self.remote.cancel_scope(scope, reason)
        except (RedisError, OSError) as e:
            self._failed("cancel_scope", e)
            return 0

    # ------------------------------------------------------------------ the thread

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="shmcancel-redis", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout + self.block + self.timeout)

    def _run(self) -> None:
        from redis.exceptions import RedisError
        box = self.store.box_key(self.remote.box)
        next_renew = 0.0
        while not self._stop.is_set():
            try:
                if self.down:
                    self.store.client.ping()
                    self.down = False
                    added = self.remote.renew()
                    log.warning("Redis answers again: cross-host cancellation resumed "
                                "(%d in-flight rows added back)", added)
                    next_renew = time.monotonic() + self.block
                now = time.monotonic()
                if now >= next_renew:
                    self.remote.renew()
                    self.store.client.pexpire(box, int(self.remote.lease * 1000))
                    next_renew = now + self.block
                if now >= self._next_sweep:
                    self._next_sweep = now + self._janitor_interval
                    self.remote.cleanup()
                item = self._blocking.client.blpop([box], timeout=self.block)
                if item is not None:
                    self._apply(item[1])
                    # drain what else waits, without blocking
                    for _ in range(1000):
                        raw = self.store.client.rpop(box)
                        if raw is None:
                            break
                        self._apply(raw)
            except (RedisError, OSError) as e:
                self._failed("subscriber", e)
                self._stop.wait(self.retry)
            except LockTimeout:
                pass  # a request's Redis call held on: renew on the next turn
            except Exception:
                log.exception("shmcancel redis bridge: unexpected error")
                self._stop.wait(self.retry)

    def _session_store(self) -> Any:
        if self._sessions is None:
            self._sessions = SessionStore(self.registry)
        return self._sessions

    def _apply(self, raw: bytes) -> None:
        got = RedisStore.decode_box_item(raw)
        if got is None:
            return
        if isinstance(got, str):  # a session deleted on another host
            try:
                self._session_store().delete(got)
            except Exception as e:
                log.warning("could not end a session deleted on another host: %s", e)
            return
        scope, rid, reason = got
        try:
            if self.local.cancel_if_in_flight(rid, reason, scope):
                self.delivered += 1
        except Exception as e:  # quota on this host, a lock timeout: logged, never fatal
            log.warning("could not apply a cross-host cancellation: %s", e)


def current() -> Bridge | None:
    """This process's bridge, if one was started here (never inherited across fork)."""
    b = _current
    if b is not None and b._pid != os.getpid():
        return None
    return b


remote.install(current)  # the transport asks this bridge where the local registry has no answer


def start(registry: Any, url: str, **kw: Any) -> Bridge:
    """Start this process's bridge (replacing one inherited or started before)."""
    global _current
    with _current_lock:
        b = Bridge(registry, url, **kw)
        b.start()
        _current = b
        return b


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
