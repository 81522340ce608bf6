"""The cross-host layer: Redis carries sessions, in-flight gating and cancellations between
hosts; each host's shared-memory registry stays the fast path (polls never touch Redis).

- :class:`RedisStore` — keys and Lua scripts (:mod:`.store`);
- :class:`RedisStorage` — the :class:`~shmcancel.cancel.storage.Storage` over it
  (:mod:`.storage`): ``Cancellation(None, backend=RedisStorage(store))`` is contract §4 over Redis;
- :class:`RedisCancellation` — that policy plus the bridge's extras (:mod:`.cancellation`);
- :class:`Bridge` — one per worker: in-flight index, cross-host cancel, delivery into the local
  segment, sessions, outage handling (:mod:`.bridge`).

Needs the optional dependency ``redis`` (``pip install shmcancel[redis]``).
"""

from __future__ import annotations

from .bridge import Bridge, current, start, start_from_env, stop
from .cancellation import RedisCancellation, connect
from .storage import RedisStorage
from .store import RedisStore

__all__ = ["Bridge", "RedisCancellation", "RedisStorage", "RedisStore", "connect", "current",
           "start", "start_from_env", "stop"]
