"""Waits that only a ring (or a direct wake) ends: for tests of who rings the doorbells."""

from __future__ import annotations

import time
from typing import Any

from shmcancel.mcp import wake

RINGS_ONLY: dict[str, Any] = {
    "WAIT_POLL": 60.0, "_SLICE": 60.0, "_next_look": lambda: time.monotonic() + 60.0,
    "_poke": lambda: lambda registry_name: True}
"""The settings of :mod:`shmcancel.mcp.wake` under which nothing looks at the waits but a ring:
the watcher thread's looks a minute apart (the next one too) and not started by a first wait,
the waits' own a minute apart too (a callable: the value is what it returns, at setting)."""


def set_rings_only(setattr_: Any = setattr) -> None:
    """Apply :data:`RINGS_ONLY` (``setattr_``: ``monkeypatch.setattr`` to have it undone)."""
    for name, value in RINGS_ONLY.items():
        setattr_(wake, name, value() if callable(value) else value)
