"""The tools the SDK test apps serve: ``sleep`` (async, cancelled at its await), ``sleep_sync``
(in a worker thread, polling for its cancellation every 5 ms) and ``sleep_then_clean_up``
(async, its cleanup running on, shielded, once cancelled); and, on some, tools
whose event streams carry notifications (:func:`add_stream_tools`)."""

from __future__ import annotations

import time

import anyio
from mcp.server.mcpserver import Context, MCPServer

import shmcancel.sdk


def add_sleep_tools(mcp: MCPServer) -> None:
    """Register ``sleep``, ``sleep_sync`` and ``sleep_then_clean_up`` on ``mcp``."""

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

    @mcp.tool()
    async def sleep_then_clean_up(seconds: float, cleanup: float) -> str:
        try:
            await anyio.sleep(seconds)
        finally:
            with anyio.CancelScope(shield=True):  # a rollback, say: runs even when cancelled
                await anyio.sleep(cleanup)
        return f"slept {seconds:g} s"


NOTIFY_EVERY = 0.2  # seconds between progress_sleep's notifications


def add_stream_tools(mcp: MCPServer) -> None:
    """Register ``progress_sleep`` (a log notification every :data:`NOTIFY_EVERY` seconds until
    ``seconds`` have passed), ``log_then_sleep`` (one log notification of ``size``
    characters, then ``seconds`` asleep) and ``flood`` (a log notification of ``size``
    characters every 10 ms until ``seconds`` have passed: a client that stops reading fills
    every buffer on the way within a second) and ``big_then_done`` (a log notification of
    ``size`` characters, then its answer: a client that stops reading holds the answer's send)."""

    @mcp.tool()
    async def progress_sleep(seconds: float, ctx: Context) -> str:
        deadline = time.monotonic() + seconds
        n = 0
        while time.monotonic() < deadline:
            n += 1
            await ctx.info(f"step {n}")
            await anyio.sleep(NOTIFY_EVERY)
        return f"slept {seconds:g} s"

    @mcp.tool()
    async def log_then_sleep(size: int, seconds: float, ctx: Context) -> str:
        await ctx.info("L" * size)
        await anyio.sleep(seconds)
        return f"slept {seconds:g} s"

    @mcp.tool()
    async def big_then_done(size: int, ctx: Context) -> str:
        await ctx.info("B" * size)
        return "done"

    @mcp.tool()
    async def flood(seconds: float, size: int, ctx: Context) -> str:
        deadline = time.monotonic() + seconds
        n = 0
        while time.monotonic() < deadline:
            n += 1
            await ctx.info("P" * size)
            await anyio.sleep(0.01)
        return f"flooded {n} times"
