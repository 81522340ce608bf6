"""Cooperative request cancellation (contract §4): the public path of
:mod:`shmcancel.cancel.policy` and of the conn reading (:mod:`shmcancel.mcp.conn`)."""

from __future__ import annotations

from .cancel.policy import (
    CANCELLED_EVENT,
    CLEANUP_EVENT,
    Cancellation,
    RequestHandle,
    owed_ends,
    settle_owed,
)
from .mcp.conn import CANCELLATION_KEY, HANDLE_KEY, REQUEST_ID_KEY, cancelled

__all__ = [
    "CANCELLATION_KEY",
    "CANCELLED_EVENT",
    "CLEANUP_EVENT",
    "HANDLE_KEY",
    "REQUEST_ID_KEY",
    "Cancellation",
    "RequestHandle",
    "cancelled",
    "owed_ends",
    "settle_owed",
]
