"""The SDK example's server, stateful, with the tools whose event streams carry notifications
(:func:`tests.apps.sdk_tools.add_stream_tools`), wrapped by ``shmcancel.sdk.asgi``."""

from __future__ import annotations

from mcp.server.mcpserver import MCPServer

import shmcancel.sdk
from tests.apps.sdk_tools import add_sleep_tools, add_stream_tools

mcp = MCPServer("shmcancel-sdk-stream")

add_sleep_tools(mcp)
add_stream_tools(mcp)


app = shmcancel.sdk.asgi(mcp)
