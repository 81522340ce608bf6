"""shmcancel: cross-process request cancellation for Python pre-fork servers."""

from __future__ import annotations

from . import errors, principal, telemetry
from .cancel.policy import Cancellation, RequestHandle, cancelled
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
from .mcp.server import McpServer, ToolError
from .shm.lock import RegistryLock
from .shm.registry import Registry

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
