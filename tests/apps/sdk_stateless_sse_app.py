"""A stateless MCP SDK server answering request POSTs as event streams (``stateless_http=True``
without ``json_response``, the SDK's default response), wrapped by ``shmcancel.sdk.asgi``: the
example serves stateless only with JSON responses."""

from __future__ import annotations

from mcp.server.mcpserver import MCPServer

import shmcancel.sdk
from tests.apps.sdk_tools import add_sleep_tools, add_stream_tools

mcp = MCPServer("shmcancel-sdk-stateless-sse")

add_sleep_tools(mcp)
add_stream_tools(mcp)


app = shmcancel.sdk.asgi(mcp, stateless_http=True)
