"""shmcancel: cross-process request cancellation for Python pre-fork servers."""

from __future__ import annotations

from . import errors, principal, telemetry
from .cancel import policy as _policy
from .cancel.policy import Cancellation, RequestHandle
from .config import Config
from .exceptions import (
    CancellationLimitReached,
    InvalidRegistryName,
    InvalidRequestId,
    LockTimeout,
    RegistryIncompatible,
    RegistryNotFound,
    RowTooLarge,
    SegmentTooLarge,
    ShmCancelError,
    TableFull,
)
from .mcp import conn as _conn
from .mcp.conn import cancelled
from .mcp.server import McpServer, ToolError
from .shm.lock import RegistryLock
from .shm.registry import Registry

# The policy takes scopes as strings; how a conn names its request and caller is the transport's.
_policy.read_conns_with(_conn)

__all__ = [
    "Cancellation",
    "CancellationLimitReached",
    "Config",
    "InvalidRegistryName",
    "InvalidRequestId",
    "LockTimeout",
    "McpServer",
    "Registry",
    "RegistryIncompatible",
    "RegistryLock",
    "RegistryNotFound",
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
