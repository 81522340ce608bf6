"""The MCP WSGI application: the public path of :mod:`shmcancel.mcp.server`."""

from __future__ import annotations

from .mcp.server import (
    PROGRESS_KEY,
    McpServer,
    RequestStopped,
    Tool,
    ToolError,
    progress,
)

__all__ = [
    "PROGRESS_KEY",
    "McpServer",
    "RequestStopped",
    "Tool",
    "ToolError",
    "progress",
]
