"""contract §4's cancellation API over Redis alone: :class:`RedisCancellation`.

The same rules as :class:`shmcancel.Cancellation` (scoping, quota that rejects, the global cap
that evicts the §4.4 batch in its order, TTL expiry, in-flight gating, telemetry), for every
host that shares the Redis. The transport does not poll through it: a host's tools poll their
local registry, and :mod:`shmcancel.redis.bridge` delivers what is recorded here to the host that
runs the request. It is what a library user without shared memory (or a test) calls directly.

In-flight rows are owned by ``<host>:<pid>`` with a lease: each ``track`` holds the row until
``lease`` seconds pass without :meth:`renew` (the bridge renews every ``lease / 3``), so the rows
of a host that died vanish within ``lease`` of its last renewal.
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from shmcancel import principal, telemetry
from shmcancel.config import Config
from shmcancel.exceptions import CancellationLimitReached

from ..cancel import ids, reasons
from .store import RedisStore

__all__ = ["CANCELLED_EVENT", "CLEANUP_EVENT", "RedisCancellation"]

CANCELLED_EVENT = ("shmcancel", "request", "cancelled")
CLEANUP_EVENT = ("shmcancel", "cancellation", "cleanup")

_tokens = itertools.count(1)


def default_host_id() -> str:
    """``SHMCANCEL_HOST_ID``, else the host name."""
    return os.environ.get("SHMCANCEL_HOST_ID") or socket.gethostname()


class RedisCancellation:
    """contract §4 over a :class:`RedisStore`. ``clock``: float seconds (``cancelled_at``);
    ``lease``: seconds an in-flight row lives without renewal; ``host``: this host's identity
    (rows are owned by ``host:pid``)."""

    def __init__(self, store: RedisStore, *, clock: Callable[[], float] = time.time,
                 lease: float = 10.0, host: str | None = None) -> None:
        if not 0 < lease <= 3600:
            raise ValueError(f"lease must be in (0, 3600] seconds, got {lease!r}")
        self.store = store
        self.config: Config = store.config
        self.clock = clock
        self.lease = float(lease)
        self.host = host or default_host_id()
        self._pid = os.getpid()
        self._mine: dict[tuple[str, str, int], bytes] = {}  # (scope, rid, token) -> owner
        self._lock = threading.Lock()

    @property
    def box(self) -> str:
        """This process's box: where cancellations of its requests are pushed."""
        return f"{self.host}:{os.getpid()}"

    def _now_ms(self) -> int:
        return int(time.time() * 1000)

    @staticmethod
    def scope(conn: object) -> str:
        return principal.scope(conn)

    # --- cancellation rows
    def cancel(self, request_id: object, reason: object = None, scope: str = "global") -> None:
        """Record a cancellation (contract §4.3). Raises ``InvalidRequestId`` /
        ``CancellationLimitReached`` as the shared-memory policy does."""
        if request_id is None:
            return
        self._record(request_id, reason, scope, gate=False)

    def cancel_if_in_flight(self, request_id: object, reason: object = None,
                            scope: str = "global") -> bool:
        """:meth:`cancel` only while the request runs on some host (one script: a request
        ending meanwhile leaves no row); pushes it to the running workers' boxes. Returns
        whether a row was recorded."""
        if request_id is None:
            return False
        return self._record(request_id, reason, scope, gate=True)

    def _record(self, request_id: object, reason: object, scope: str, *, gate: bool) -> bool:
        rid = ids.require_key(request_id)
        if not isinstance(scope, str):
            raise TypeError(f"scope must be a str, got {type(scope).__name__}")
        text = reasons.sanitize(reason)
        status, _ = self.store.cancel(scope, rid, text, self.clock(), gate=gate,
                                      now_ms=self._now_ms(),
                                      box_lease_ms=int(self.lease * 1000))
        if status == 0:
            return False
        if status == -1:
            raise CancellationLimitReached(
                f"scope {scope[:80]!r} already holds {self.store.quota} cancellation rows")
        telemetry.execute(CANCELLED_EVENT, {"count": 1},
                          {"request_id": rid, "scope": scope, "reason": text})
        return True

    def cancelled(self, conn_or_request_id: object, scope: str = "global") -> bool:
        """Whether the request is cancelled (a conn: its request id in its scope). Never
        raises on bad input."""
        x = conn_or_request_id
        if isinstance(x, dict):
            scope = principal.scope(x)
            x = x.get("shmcancel.request_id")
        rid = ids.key(x)
        if rid is None:
            return False
        return self.store.get(scope, rid) is not None

    def reason(self, request_id: object, scope: str = "global") -> str | None:
        rid = ids.key(request_id)
        row = None if rid is None else self.store.get(scope, rid)
        return None if row is None else row[0]

    def cancelled_at(self, request_id: object, scope: str = "global") -> float | None:
        rid = ids.key(request_id)
        row = None if rid is None else self.store.get(scope, rid)
        return None if row is None else row[1]

    def clear(self, request_id: object, scope: str = "global") -> None:
        rid = ids.key(request_id)
        if rid is not None:
            self.store.clear(scope, rid)

    def cancel_scope(self, scope: str, reason: object = None) -> int:
        """Cancel every request in flight in ``scope`` on any host, each one gated and recorded
        atomically (one that ended since the scan gets no row). Stops quietly at the quota."""
        n = 0
        for rid in self.store.in_flight_ids(scope):
            try:
                n += self._record(rid, reason, scope, gate=True)
            except CancellationLimitReached:
                break
        return n

    # --- in-flight rows
    def track(self, request_id: object, scope: str = "global") -> int | None:
        """Add an in-flight row owned by this process; returns its token (for
        :meth:`untrack_token`), None for an invalid id."""
        rid = ids.key(request_id)
        if rid is None:
            return None
        token = next(_tokens)
        owner = f"{self.box}\n{token}".encode()
        with self._lock:
            self._mine[(scope, rid, token)] = owner
            self.store.track(scope, rid, owner, deadline_ms=self._now_ms() + int(self.lease * 1000),
                             now_ms=self._now_ms(), started_at=self.clock())
        return token

    def track_offline(self, scope: str, rid: str) -> int:
        """Hold a row only locally (Redis is down): :meth:`renew` adds it when Redis returns."""
        token = next(_tokens)
        with self._lock:
            self._mine[(scope, rid, token)] = f"{self.box}\n{token}".encode()
        return token

    def forget(self, scope: str, rid: str, token: int) -> None:
        """Drop a row locally only (Redis is down; its lease ends it there)."""
        with self._lock:
            self._mine.pop((scope, rid, token), None)

    def untrack_token(self, scope: str, rid: str, token: int) -> bool:
        """End the row :meth:`track` returned ``token`` for; True once done (also when it was
        not held). Raises Redis errors, leaving the row held for :meth:`forget`."""
        with self._lock:
            owner = self._mine.get((scope, rid, token))
            if owner is not None:
                self.store.untrack(scope, rid, owner, now_ms=self._now_ms())
                del self._mine[(scope, rid, token)]
        return True

    def untrack(self, request_id: object, scope: str = "global") -> None:
        """Remove one in-flight row of this process for the key."""
        rid = ids.key(request_id)
        if rid is None:
            return
        with self._lock:
            mine = [k for k in self._mine if k[0] == scope and k[1] == rid]
        if mine:
            self.untrack_token(scope, rid, mine[-1][2])

    def in_flight(self, request_id: object, scope: str = "global") -> bool:
        rid = ids.key(request_id)
        return rid is not None and self.store.in_flight(scope, rid, now_ms=self._now_ms())

    def renew(self) -> int:
        """Extend the lease of every row this process holds, adding back any Redis lost (a
        restart). Returns how many were added back."""
        deadline = self._now_ms() + int(self.lease * 1000)
        with self._lock:
            items = list(self._mine.items())
            entries = [(self.store.if_key(s, r), o) for (s, r, _), o in items]
            missing = self.store.renew(entries, deadline)
            for i in missing:
                (s, r, _), o = items[i]
                self.store.track(s, r, o, deadline_ms=deadline, now_ms=self._now_ms(),
                                 started_at=self.clock())
        return len(missing)

    def held(self) -> int:
        """In-flight rows this process holds."""
        return len(self._mine)

    def forget_process(self) -> None:
        """After fork: the parent's rows are the parent's."""
        with self._lock:
            self._mine.clear()

    # --- cleanup
    def cleanup(self, ttl: float | None = None) -> int:
        """Remove rows with ``now - cancelled_at > ttl`` (default ``Config.ttl``); in-flight
        rows of dead hosts expire by their lease. Emits the cleanup event."""
        removed = self.store.expire(self.clock(), self.config.ttl if ttl is None else float(ttl))
        telemetry.execute(CLEANUP_EVENT, {"removed": removed, "in_flight_removed": 0}, {})
        return removed

    def __repr__(self) -> str:
        return f"<RedisCancellation host={self.host!r} prefix={self.store.prefix!r}>"


def connect(url: str, *, timeout: float = 0.5, **kw: Any) -> Any:
    """A ``redis.Redis`` for ``url`` whose every call gives up after ``timeout`` seconds."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry
    # No client-side retries: a failed call fails within `timeout`, and the bridge decides.
    return redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout,
                                retry=Retry(NoBackoff(), 0), health_check_interval=0, **kw)
