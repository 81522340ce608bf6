"""What the transport asks of another host's share of the work (sessions and calls elsewhere).

An integration (``shmcancel.redis``) installs a provider with :func:`install`; until then
:func:`current` is ``None`` and the transport serves one host alone. The transport calls a remote
only where the local registry has no answer (a session minted elsewhere, a call not in flight
here), so a poll never reaches it. Every method is bounded by the remote's own timeout and never
raises into a request.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["Remote", "current", "install"]


class Remote(Protocol):
    def track(self, request_id: Any, scope: str) -> Any: ...
    def untrack(self, handle: Any) -> None: ...
    def cancel(self, request_id: Any, reason: Any, scope: str) -> bool: ...
    def cancel_scope(self, scope: str, reason: Any) -> int: ...
    def publish_session(self, sid: str, version: str, client: str) -> None: ...
    def lookup_session(self, sid: str) -> tuple[str, str] | None: ...
    def delete_session(self, sid: str) -> None: ...


_provider: Callable[[], Remote | None] | None = None


def install(provider: Callable[[], Remote | None] | None) -> None:
    """Make ``provider()`` the remote the transport consults (``None`` removes it)."""
    global _provider
    _provider = provider


def current() -> Remote | None:
    """This process's remote, or ``None``."""
    p = _provider
    return None if p is None else p()
