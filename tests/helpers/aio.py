"""Async waiting for the tests that drive the official MCP SDK's client (anyio)."""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio


async def until(predicate: Callable[[], object], timeout: float, what: str) -> float:
    """Poll ``predicate()`` every 5 ms; return the monotonic time it held; fail after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await anyio.sleep(0.005)
    return time.monotonic()
