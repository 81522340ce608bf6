"""shmcancel: cross-process request cancellation for Python pre-fork servers."""

from __future__ import annotations

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

__all__ = [
    "CancellationLimitReached",
    "Config",
    "InvalidRegistryName",
    "InvalidRequestId",
    "LockTimeout",
    "RegistryIncompatible",
    "RegistryNotFound",
    "RowTooLarge",
    "SegmentTooLarge",
    "ShmCancelError",
    "TableFull",
]
