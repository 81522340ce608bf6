"""The tools the SDK test apps serve: ``sleep`` (async, cancelled at its await) and
``sleep_sync`` (in a worker thread, polling for its cancellation every 5 ms)."""

from __future__ import annotations

import time

import anyio
from mcp.server.mcpserver import MCPServer

import shmcancel.sdk


def add_sleep_tools(mcp: MCPServer) -> None:
    """Register ``sleep`` and ``sleep_sync`` on ``mcp``."""

    @mcp.tool()
    async def sleep(seconds: float) -> str:
        await anyio.sleep(seconds)
        return f"slept {seconds:g} s"

    @mcp.tool()
    def sleep_sync(seconds: float) -> str:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            shmcancel.sdk.raise_if_cancelled()
            time.sleep(0.005)
        return f"slept {seconds:g} s"
