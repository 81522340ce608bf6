"""A stateful MCP SDK server answering every request POST with one JSON response
(``json_response=True``), wrapped by ``shmcancel.sdk.asgi``: its sessions are routed to the
worker holding them like the example server's, but a forwarded call's answer is a JSON body,
not an event stream."""

from __future__ import annotations

import time

import anyio
from mcp.server.mcpserver import MCPServer

import shmcancel.sdk

mcp = MCPServer("shmcancel-sdk-json")


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


app = shmcancel.sdk.asgi(mcp, json_response=True)
