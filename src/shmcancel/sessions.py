"""MCP sessions (2025-era wire) kept in the registry's shared ``sessions`` table, so a session
minted by one worker is accepted by every other.

Row: ``session_id -> (created, last_seen, protocol_version)`` — wall-clock seconds (the
``clock``, default :func:`time.time`, shared by every process) and the version ``initialize``
negotiated. Well under the table's 512-byte value bound.

- Ids are ``secrets.token_urlsafe(24)``: 192 random bits, 32 visible-ASCII characters, as the
  2025-11-25 transport asks (globally unique, cryptographically secure, 0x21–0x7E only).
- A session expires once it has not been seen for ``config.session_ttl`` seconds. An expired row
  is treated as absent by :meth:`SessionStore.get` (and removed then), so expiry needs no sweeper.
- ``last_seen`` is refreshed at most once per :data:`TOUCH_INTERVAL` (or ``ttl / 10`` when
  shorter): a busy session costs a shared write per second, not per request.
- The table holds ``config.session_capacity`` rows. Minting into a full table first drops every
  expired session, then — if none had expired — the least recently seen one; a new client is
  never refused because old ones left without a ``DELETE``.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .exceptions import ShmCancelError, TableFull
from .wire import valid_session_id

__all__ = ["TOUCH_INTERVAL", "Session", "SessionStore"]

TOUCH_INTERVAL = 1.0  # seconds


@dataclass(frozen=True, slots=True)
class Session:
    id: str
    created: float
    last_seen: float
    protocol_version: str


def _row(value: Any) -> tuple[float, float, str] | None:
    """A stored value as ``(created, last_seen, version)``, or ``None`` if it is not one."""
    if (isinstance(value, tuple | list) and len(value) == 3
            and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value[:2])
            and isinstance(value[2], str)):
        return float(value[0]), float(value[1]), value[2]
    return None


class SessionStore:
    """Sessions over one registry (``reg.sessions``, ``reg.lock``, ``reg.config``)."""

    def __init__(self, reg: Any, clock: Callable[[], float] = time.time) -> None:
        self._reg = reg
        self._table = reg.sessions
        self._clock = clock
        cfg = reg.config
        self.ttl: float = float(cfg.session_ttl)
        self.capacity: int = int(cfg.session_capacity)
        self._touch_every = min(TOUCH_INTERVAL, self.ttl / 10)

    def create(self, protocol_version: str) -> Session:
        """Mint and store a new session. Makes room when the table is full (expired first, then
        the least recently seen)."""
        now = self._clock()
        sid = secrets.token_urlsafe(24)
        value = (now, now, protocol_version)
        with self._reg.lock:
            if self._table.count() >= self.capacity:
                self._make_room(now)
            for _ in range(3):
                try:
                    if self._table.insert_new(sid, value):
                        break
                except TableFull:
                    self._make_room(now)
                    continue
                sid = secrets.token_urlsafe(24)  # a collision of 192 random bits: never, but total
            else:
                raise TableFull("sessions table is full")
        return Session(sid, now, now, protocol_version)

    def _make_room(self, now: float) -> None:
        ttl = self.ttl

        def expired(_k: Any, v: Any) -> bool:
            r = _row(v)
            return r is None or now - r[1] > ttl

        if self._table.delete_where(expired) > 0:
            return
        rows = self._table.scan()
        if rows:
            oldest = min(rows, key=lambda kv: (_row(kv[1]) or (0.0, 0.0, ""))[1])
            self._table.delete(oldest[0])

    def get(self, session_id: str | None) -> Session | None:
        """The live session ``session_id`` names, or ``None`` (malformed, unknown, expired).
        Lock-free unless it finds an expired row, which it removes."""
        if not valid_session_id(session_id):
            return None
        try:
            r = _row(self._table.get(session_id))
        except ShmCancelError:
            return None
        if r is None:
            return None
        now = self._clock()
        if now - r[1] > self.ttl:
            self._delete_if(session_id, r)  # type: ignore[arg-type]
            return None
        return Session(session_id, r[0], r[1], r[2])  # type: ignore[arg-type]

    def touch(self, session: Session) -> None:
        """Record that ``session`` was seen now (a shared write at most once per interval)."""
        now = self._clock()
        if now - session.last_seen < self._touch_every:
            return
        with self._reg.lock:
            r = _row(self._table.get(session.id))
            if r is None or r[1] >= now:  # deleted meanwhile (never resurrect), or fresher
                return
            self._table.insert(session.id, (r[0], now, r[2]))

    def delete(self, session_id: str) -> bool:
        """End a session. True when it existed."""
        if not valid_session_id(session_id):
            return False
        return self._table.delete(session_id) > 0

    def _delete_if(self, session_id: str, seen: tuple[float, float, str]) -> None:
        with self._reg.lock:
            if _row(self._table.get(session_id)) == seen:
                self._table.delete(session_id)

    def count(self) -> int:
        return self._table.count()
