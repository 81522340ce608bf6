"""shmcancel: cross-process request cancellation for Python pre-fork servers.

The transport's names (:class:`McpServer`, :class:`ToolError`) load on first use (PEP 562), so a
process that only wants the table does not import the server, ``ssl`` or ``ctypes``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import errors, principal, telemetry
from .cancel import policy as _policy
from .cancel import tables as _cancel_tables  # noqa: F401  (declares its tables)
from .cancel.handle import RequestHandle
from .cancel.policy import Cancellation
from .config import Config
from .exceptions import (
    CancellationLimitReached,
    InvalidRegistryName,
    InvalidRequestId,
    LockTimeout,
    RegistryClosed,
    RegistryIncompatible,
    RegistryNotFound,
    RemoteUnavailable,
    RowTooLarge,
    SegmentTooLarge,
    ShmCancelError,
    TableFull,
)
from .mcp import conn as _conn
from .mcp import session_tables as _session_tables  # noqa: F401  (declares its tables)
from .mcp.conn import cancelled
from .shm.lock import RegistryLock
from .shm.registry import Registry

if TYPE_CHECKING:  # pragma: no cover
    from .mcp.server import McpServer, ToolError

# Every registry holds the tables the layers that own them declare on import (cancel.tables,
# mcp.session_tables, imported above before any registry can exist).
# The policy takes scopes as strings; how a conn names its request and caller is the transport's.
_policy.read_conns_with(_conn)

_LAZY = {"McpServer": "server", "ToolError": "server"}

__all__ = [
    "Cancellation",
    "CancellationLimitReached",
    "Config",
    "InvalidRegistryName",
    "InvalidRequestId",
    "LockTimeout",
    "McpServer",
    "Registry",
    "RegistryClosed",
    "RegistryIncompatible",
    "RegistryLock",
    "RegistryNotFound",
    "RemoteUnavailable",
    "RequestHandle",
    "RowTooLarge",
    "SegmentTooLarge",
    "ShmCancelError",
    "TableFull",
    "ToolError",
    "cancelled",
    "errors",
    "principal",
    "telemetry",
]


if not TYPE_CHECKING:  # a module __getattr__ seen by a type checker makes every name Any
    def __getattr__(name: str) -> Any:
        mod = _LAZY.get(name)
        if mod is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        import importlib

        value = getattr(importlib.import_module(f".{mod}", __name__), name)
        globals()[name] = value  # later lookups are plain attribute reads
        return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
