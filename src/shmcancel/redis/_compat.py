"""Imports of modules that another branch moves into subpackages (``shmcancel.cancel``,
``shmcancel.mcp``); the flat layout is the fallback."""

from __future__ import annotations

from typing import Any

try:  # the layout with subpackages
    from shmcancel.cancel import ids, reasons  # type: ignore[attr-defined,unused-ignore]
except ImportError:  # the flat layout
    from shmcancel import ids, reasons  # type: ignore[no-redef,unused-ignore]


def session_store_class() -> Any:
    try:
        from shmcancel.mcp.sessions import (  # type: ignore[import-not-found,unused-ignore]
            SessionStore,
        )
    except ImportError:
        from shmcancel.sessions import SessionStore  # type: ignore[no-redef,unused-ignore]
    return SessionStore


__all__ = ["ids", "reasons", "session_store_class"]
