"""A stateful MCP SDK server answering every request POST with one JSON response
(``json_response=True``), wrapped by ``shmcancel.sdk.asgi``: its sessions are routed to the
worker holding them like the example server's, but a forwarded call's answer is a JSON body,
not an event stream."""

from __future__ import annotations

from mcp.server.mcpserver import MCPServer

import shmcancel.sdk
from tests.apps.sdk_tools import add_sleep_tools

mcp = MCPServer("shmcancel-sdk-json")

add_sleep_tools(mcp)


app = shmcancel.sdk.asgi(mcp, json_response=True)
