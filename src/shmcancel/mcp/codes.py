"""JSON-RPC 2.0 and MCP error codes used on the wire."""

from __future__ import annotations

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

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
SERVER_ERROR = -32000
REQUEST_CANCELLED = -32800
HEADER_MISMATCH = -32020
UNSUPPORTED_PROTOCOL_VERSION = -32022


def request_cancelled() -> int:
    """The code a cancelled request is answered with (``-32800``)."""
    return REQUEST_CANCELLED
