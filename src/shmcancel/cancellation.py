"""Cooperative request cancellation (SPEC §4): the public path of :mod:`shmcancel.cancel.policy`."""

from __future__ import annotations

from .cancel.policy import (
    CANCELLATION_KEY,
    CANCELLED_EVENT,
    CLEANUP_EVENT,
    HANDLE_KEY,
    REQUEST_ID_KEY,
    Cancellation,
    RequestHandle,
    cancelled,
    owed_ends,
    settle_owed,
)

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
