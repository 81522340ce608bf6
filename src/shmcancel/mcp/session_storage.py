"""The storage interface of MCP sessions (contract §6.1): what the transport needs of a session
store. The shared-memory implementation is :class:`~shmcancel.mcp.sessions.SessionStore`.

Every method is one atomic step against every other process using the store (a second backend
implements each as one operation, e.g. one Lua script); reads never block on writers. The
per-client bound is the store's: ``create`` never displaces another client's session.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from .sessions import Call, Session

__all__ = ["SessionStorage"]


@runtime_checkable
class SessionStorage(Protocol):
    """Sessions bounded per client, their calls in flight, and their expiry."""

    def create(self, protocol_version: str, client: str = "global", *,
               session_id: str | None = None) -> Session:
        """Mint (or adopt, with ``session_id``) a session for ``client``, giving up the
        client's own least recently seen idle session at its bound (or a full store);
        :class:`~shmcancel.mcp.sessions.SessionsFull` when it has none to give up."""
    def get(self, session_id: str | None) -> Session | None:
        """The live session, or ``None`` (malformed, unknown, expired)."""
    def touch(self, session: Session) -> None:
        """Record that ``session`` was seen now (at most one write per touch interval)."""
    def delete(self, session_id: str) -> bool:
        """End a session; True when it existed."""
    def begin_call(self, session: Session) -> Call | None:
        """Record a call running in ``session`` and touch it, in one step (the session is then
        never given up nor expired while the call runs); ``None`` when it is gone."""
    def end_call(self, call: Call) -> None:
        """The call ended: drop its record and touch the session. Never raises (a store that
        does not answer in time owes it and lands it later)."""
    def client_digest(self, client: str) -> bytes:
        """What :attr:`Session.client` holds for a session minted for ``client``."""
    def minted_for_principal(self, session: Session) -> bool:
        """Whether ``session`` was minted for a principal (``principal:<id>``), not for an
        address bucket."""
    def sweep(self) -> int:
        """Remove a bounded piece of the expired sessions (and damage); how many went."""
