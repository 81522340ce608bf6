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
from .mcp.wake import wait_cancelled

__all__ = [
    "PROGRESS_KEY",
    "McpServer",
    "RequestStopped",
    "Tool",
    "ToolError",
    "progress",
    "wait_cancelled",
]
