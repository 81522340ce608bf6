"""JSON-RPC 2.0 and MCP error codes: the public path of :mod:`shmcancel.mcp.codes`."""

from __future__ import annotations

from .mcp import codes as _codes
from .mcp.codes import *  # noqa: F403 - this module is that one's public name

__all__ = list(_codes.__all__)
