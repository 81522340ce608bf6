"""What the transport asks of another host's share of the work (sessions and calls elsewhere).

An integration (``shmcancel.redis``) installs a provider with :func:`install`; until then
:func:`current` is ``None`` and the transport serves one host alone. The transport calls a remote
only where the local registry has no answer (a session minted elsewhere, a call not in flight
here), so a poll never reaches it. Every method is bounded by the remote's own timeout.

Only :meth:`Remote.lookup_session` may raise into a request (and :meth:`Remote.cancel` and a
minted session's :meth:`Remote.publish_session`, when the remote answered that it could not do
it), and only :class:`~shmcancel.exceptions.RemoteUnavailable`: "no answer" must not read as "no
such session", which a client takes as its session gone for good (404); the transport answers
503 with ``Retry-After`` instead. The other methods never raise: a write the remote could not make
now is its own to retry or drop (the Redis bridge owes the ones that matter and retries them off
the request path).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from ..exceptions import RemoteUnavailable

__all__ = ["Remote", "RemoteUnavailable", "current", "install"]


class Remote(Protocol):
    def track(self, request_id: Any, scope: str) -> Any:
        """A ``tools/call`` begins here: a handle for :meth:`untrack`."""

    def untrack(self, handle: Any) -> None:
        """That call ended (owed to the remote when it cannot be told now)."""

    def cancel(self, request_id: Any, reason: Any, scope: str) -> bool:
        """Cancel a call running on another host; False when not in flight anywhere or
        unknown (no answer). May raise ``CancellationLimitReached``, and
        :class:`~shmcancel.exceptions.RemoteUnavailable` when the remote answered that it
        could not deliver it (its store damaged)."""

    def cancel_scope(self, scope: str, reason: Any) -> int:
        """Cancel every call of ``scope`` on any host; how many were recorded."""

    def publish_session(self, sid: str, version: str, client: str, *,
                        minted: bool = False) -> None:
        """A session minted or adopted here (owed when it cannot be stored now). One ``minted``
        here that the remote answered it will not store (full) raises
        :class:`~shmcancel.exceptions.RemoteUnavailable`: other hosts would not know it."""

    def keep_session(self, sid: str, client: str | None = None) -> None:
        """A request used a session here: its copy on the remote lives on (renewed now and
        then, never on every request; stored again when the remote lost it and ``client``,
        the request's client, is the session's). Never raises."""

    def lookup_session(self, sid: str, may_use: Callable[[str], bool] | None = None
                       ) -> tuple[str, str] | None:
        """``(protocol_version, client)`` of a session another host minted; ``None`` only when
        the remote answered that there is no such session, or when ``may_use(client)`` is
        false (the caller may not use it: not renewed, this host not listed). Raises
        :class:`~shmcancel.exceptions.RemoteUnavailable` when it gave no answer."""

    def delete_session(self, sid: str) -> None:
        """A session ended here (owed when it cannot be deleted now)."""

    def session_ended(self, sid: str) -> bool:
        """Whether this process heard that session ``sid`` ended (here, or elsewhere: a
        ``DELETE``, a give-up for its client's bound). Once it has, it stays so. Never raises."""


_provider: Callable[[], Remote | None] | None = None


def install(provider: Callable[[], Remote | None] | None) -> None:
    """Make ``provider()`` the remote the transport consults (``None`` removes it)."""
    global _provider
    _provider = provider


def current() -> Remote | None:
    """This process's remote, or ``None``."""
    p = _provider
    return None if p is None else p()
