"""The conn (a WSGI environ) as the cancellation layer sees it: the keys the transport puts there,
the caller's scope, and :func:`cancelled`, what a tool polls.

The policy (:mod:`shmcancel.cancel.policy`) takes scopes as strings and knows no environ keys; the
package installs this module as its :class:`~shmcancel.cancel.policy.ConnReader` at import, so that
``Cancellation.scope(conn)`` and ``Cancellation.cancelled(conn)`` (contract §4) keep reading a
conn.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..cancel.handle import RequestHandle
from ..cancel.policy import Cancellation
from ..shm import registry
from .principal import PRINCIPAL_KEY, REMOTE_ADDR_KEY, SESSION_KEY, scope

__all__ = [
    "CANCELLATION_KEY",
    "HANDLE_KEY",
    "POLL_KEY",
    "REQUEST_ID_KEY",
    "SCOPE_KEYS",
    "cancelled",
    "handle",
    "request_id",
    "scope",
]

HANDLE_KEY = "shmcancel.handle"
REQUEST_ID_KEY = "shmcancel.request_id"
CANCELLATION_KEY = "shmcancel.cancellation"
#: Where ``Cancellation.cancelled(conn)`` keeps the poll it resolved for a conn without a handle:
#: under ``POLL_KEY + "#n"``, a key per ``Cancellation`` instance, which ``POLL_KEY`` names (one
#: instance's poll replaces another's).
POLL_KEY = "shmcancel.poll"
#: The keys ``scope(conn)`` reads (contract §3): a poll kept under ``POLL_KEY`` holds while
#: their values stay the same objects.
SCOPE_KEYS = (SESSION_KEY, PRINCIPAL_KEY, REMOTE_ADDR_KEY)

_defaults: dict[int, tuple[Any, Cancellation]] = {}


def handle(conn: Mapping[str, Any]) -> Any:
    """``conn["shmcancel.handle"]``: the request's handle, put there by the transport."""
    return conn.get(HANDLE_KEY)


def request_id(conn: Mapping[str, Any]) -> Any:
    """``conn["shmcancel.request_id"]``: the JSON-RPC id of the request being dispatched."""
    return conn.get(REQUEST_ID_KEY)


def _default_for(reg: Any) -> Cancellation:
    entry = _defaults.get(id(reg))
    if entry is not None and entry[0] is reg:
        return entry[1]
    c = Cancellation(reg)
    _defaults.clear()  # one attached registry per process, normally
    _defaults[id(reg)] = (reg, c)
    return c


def cancelled(conn: object) -> bool:
    """Whether the request being dispatched with ``conn`` is cancelled: what a tool polls.

    Uses ``conn["shmcancel.handle"]`` (a :class:`~shmcancel.RequestHandle` put there by the
    transport) when present; else ``conn["shmcancel.request_id"]`` in ``scope(conn)``, with
    ``conn["shmcancel.cancellation"]`` or a :class:`~shmcancel.Cancellation` over the process's
    attached registry (``shmcancel.shm.registry.current()``). ``False`` outside a dispatched
    request (no handle, no request id, no registry); never raises.
    """
    try:
        h = conn.get(HANDLE_KEY)  # type: ignore[attr-defined]
        # RequestHandle.cancelled()'s hot path inlined, its janitor countdown included: the
        # call would be a fifth of this poll (tools/bench_cancel.py)
        if h.__class__ is RequestHandle and h._ver[h._b] == h._v:
            n = h._n = h._n - 1
            if n >= 0:
                return False
        if h is not None:
            return h.cancelled() is True
        if conn.get(REQUEST_ID_KEY) is None:  # type: ignore[attr-defined]
            return False
        c = conn.get(CANCELLATION_KEY)  # type: ignore[attr-defined]
        if not isinstance(c, Cancellation):
            reg = registry.current()
            if reg is None:
                return False
            c = _default_for(reg)
        return c.cancelled(conn)
    except Exception:
        return False
