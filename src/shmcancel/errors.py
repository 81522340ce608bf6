"""JSON-RPC 2.0 and MCP error codes: the public path of :mod:`shmcancel.mcp.codes`."""

from __future__ import annotations

from .mcp.codes import (
    HEADER_MISMATCH,
    INTERNAL_ERROR,
    INVALID_PARAMS,
    INVALID_REQUEST,
    METHOD_NOT_FOUND,
    PARSE_ERROR,
    REQUEST_CANCELLED,
    SERVER_ERROR,
    UNSUPPORTED_PROTOCOL_VERSION,
    request_cancelled,
)

__all__ = [
    "HEADER_MISMATCH",
    "INTERNAL_ERROR",
    "INVALID_PARAMS",
    "INVALID_REQUEST",
    "METHOD_NOT_FOUND",
    "PARSE_ERROR",
    "REQUEST_CANCELLED",
    "SERVER_ERROR",
    "UNSUPPORTED_PROTOCOL_VERSION",
    "request_cancelled",
]
