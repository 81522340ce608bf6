"""contract §4's cancellation API over Redis alone: :class:`RedisCancellation`, the policy
(:class:`shmcancel.Cancellation`) over a :class:`~shmcancel.redis.storage.RedisStorage`, plus
what the bridge needs of it (tokens for rows it holds while Redis may be down, lease renewal).

The transport does not poll through it: a host's tools poll their local registry, and
:mod:`shmcancel.redis.bridge` delivers what is recorded here to the host that runs the request.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable
from typing import Any

from ..cancel import ids
from ..cancel.policy import Cancellation
from ..cancel.storage import Owner
from .storage import RedisStorage, default_host_id
from .store import RedisStore

__all__ = ["RedisCancellation", "connect", "default_host_id"]

_tokens = itertools.count(1)


class RedisCancellation(Cancellation):
    """``Cancellation(None, clock, backend=RedisStorage(store, ...))`` with the bridge's extras.
    ``clock``: float seconds (``cancelled_at``); ``lease``: seconds an in-flight row lives
    without :meth:`renew`; ``host``: this host's identity (rows are owned by ``host:pid:tag``);
    ``auto_renew``: :class:`RedisStorage`'s renewal thread (off: the bridge calls
    :meth:`renew` from its own thread); ``pending``: :class:`RedisStorage`'s.

    Reports no ``("shmcancel", "request", "cancelled")`` event of its own: the bridge delivers
    each cancellation recorded here to the host running the request, whose registry reports
    it, once (contract §4.7)."""

    _reports = False

    def __init__(self, store: RedisStore, *, clock: Callable[[], float] = time.time,
                 lease: float = 10.0, host: str | None = None, io_wait: float = 10.0,
                 auto_renew: bool = False, pending: float = 10.0) -> None:
        self.storage = RedisStorage(store, clock=clock, lease=lease, host=host, io_wait=io_wait,
                                    auto_renew=auto_renew, pending=pending)
        super().__init__(None, clock, backend=self.storage)
        self.store = store
        self.lease = self.storage.lease
        self.host = self.storage.host

    @property
    def box(self) -> str:
        """This process's box: where cancellations of its requests are pushed."""
        return self.storage.box

    # --- rows the bridge holds by token (its handle survives Redis being down)
    @staticmethod
    def _owner(token: int) -> Owner:
        return (os.getpid(), 0, 0, token)  # start 0: never taken for a policy-run request

    def track_token(self, request_id: object, scope: str = "global") -> int | None:
        """Add an in-flight row owned by this process; returns its token (for
        :meth:`untrack_token`), None for an invalid id."""
        rid = ids.key(request_id)
        if rid is None:
            return None
        token = next(_tokens)
        self.storage.track(scope, rid, self._owner(token))
        return token

    def track_held(self, scope: str, rid: str, token: int) -> None:
        """Add to Redis the row :meth:`track_offline` holds for ``token``. Raises Redis errors
        or ``LockTimeout``, the row staying held here (:meth:`renew` adds it later)."""
        self.storage.track_held(scope, rid, self._owner(token))

    def track_offline(self, scope: str, rid: str) -> int:
        """Hold a row only locally (Redis is down): :meth:`renew` adds it when Redis returns."""
        token = next(_tokens)
        self.storage.hold(scope, rid, self._owner(token))
        return token

    def forget(self, scope: str, rid: str, token: int) -> None:
        """Drop a row locally only (Redis is down; its lease ends it there)."""
        self.storage.forget(scope, rid, self._owner(token))

    def untrack_token(self, scope: str, rid: str, token: int) -> bool:
        """End the row :meth:`track_token` returned ``token`` for; True once done (also when it
        was not held). Raises Redis errors or ``LockTimeout``, leaving the row held for
        :meth:`forget`."""
        self.storage.untrack(scope, rid, self._owner(token))
        return True

    def release(self, scope: str, rid: str, token: int) -> bytes | None:
        """Stop holding a row here without telling Redis (nor adding it back on :meth:`renew`);
        what :meth:`untrack_released` needs to end it there later. None when not held."""
        return self.storage.release(scope, rid, self._owner(token))

    def untrack_released(self, scope: str, rid: str, raw: bytes) -> bool:
        """End in Redis a row :meth:`release` let go of. Raises Redis errors or
        ``LockTimeout``."""
        return self.storage.untrack_released(scope, rid, raw)

    def renew(self) -> int:
        """Extend the lease of every row this process holds, adding back any Redis lost (a
        restart). Returns how many were added back."""
        return self.storage.renew()

    def held(self) -> int:
        """In-flight rows this process holds."""
        return self.storage.held()

    def forget_process(self) -> None:
        """After fork: the parent's rows are the parent's."""
        self.storage.forget_process()

    def __repr__(self) -> str:
        return f"<RedisCancellation host={self.host!r} prefix={self.store.prefix!r}>"


def connect(url: str, *, timeout: float = 0.5, **kw: Any) -> Any:
    """A ``redis.Redis`` for ``url`` whose every call gives up after ``timeout`` seconds, a
    (re)connection included: connecting and reading each get half of it."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry
    # No client-side retries: a failed call fails within `timeout`, and the bridge decides.
    return redis.Redis.from_url(url, socket_timeout=timeout / 2,
                                socket_connect_timeout=timeout / 2,
                                retry=Retry(NoBackoff(), 0), health_check_interval=0, **kw)
