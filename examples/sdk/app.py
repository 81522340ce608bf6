"""The example server built on the official MCP SDK (``MCPServer``): three tools, served by
gunicorn's uvicorn workers with cross-worker cancellation
(see ``gunicorn.conf.py`` and ``README.md`` here).

``SHMCANCEL_SDK_STATELESS=1`` serves it stateless with JSON responses. Stateful (the default) works
on several workers too: a session lives in the worker that created it, and ``shmcancel.sdk``
routes its requests there from whichever worker accepted them.
"""

from __future__ import annotations

import os
import time

import anyio
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

import shmcancel.sdk

MAX_SLEEP = 60.0
POLL = 0.005  # seconds between two looks at the cancellation flag (the contract: <= 10 ms)

mcp = MCPServer("shmcancel-sdk-example")


def _seconds(tool: str, seconds: float) -> float:
    """``seconds`` when it is a sleep this server does (0 to MAX_SLEEP); else the SDK's
    ``ToolError``, whose message the client reads (any other exception is logged as the
    tool's crash, traceback and all, and the client learns nothing of it)."""
    if not 0 <= seconds <= MAX_SLEEP:  # NaN too
        raise ToolError(f"Invalid arguments for tool {tool}: seconds must be between 0 and "
                        f"{MAX_SLEEP:g}, got {seconds!r}")
    return seconds


@mcp.tool()
def echo(text: str) -> str:
    """Return the text it is given."""
    return text


@mcp.tool()
async def sleep(seconds: float) -> str:
    """Sleep for `seconds` (0 to 60); a cancellation interrupts it at once."""
    await anyio.sleep(_seconds("sleep", seconds))
    return f"slept {seconds:g} s"


@mcp.tool()
def sleep_sync(seconds: float) -> str:
    """Sleep for `seconds` (0 to 60) in a worker thread, polling for cancellation every 5 ms."""
    deadline = time.monotonic() + _seconds("sleep_sync", seconds)
    while (left := deadline - time.monotonic()) > 0:
        shmcancel.sdk.raise_if_cancelled()
        time.sleep(min(POLL, left))
    return f"slept {seconds:g} s"


STATELESS = os.environ.get("SHMCANCEL_SDK_STATELESS", "") not in ("", "0")
app = (shmcancel.sdk.asgi(mcp, stateless_http=True, json_response=True) if STATELESS
       else shmcancel.sdk.asgi(mcp))
