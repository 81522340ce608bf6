"""Servers built on the official MCP Python SDK (``mcp`` ≥ 2.3, ``MCPServer``) under gunicorn with
several uvicorn workers: cross-worker cancellation through the shared registry (contract §9).

::

    from mcp.server.mcpserver import MCPServer
    import shmcancel.sdk

    mcp = MCPServer("example")
    ...                                   # tools as usual
    app = shmcancel.sdk.asgi(mcp)         # what gunicorn's uvicorn workers serve

Two public seams of the SDK: a server middleware runs every ``tools/call`` under a
:class:`shmcancel.RequestHandle` in the caller's scope (contract §3) inside an anyio cancel scope
that a per-loop poller cancels, answered ``MCPError(-32800)``; an ASGI layer inside the ``/mcp``
route answers a posted ``notifications/cancelled`` itself (``cancel_if_in_flight``), repeating the
SDK's Origin/Host and Content-Type checks and body cap, and on the 2026-07-28 wire cancels a call
whose client disconnects. Stateful sessions are routed to the worker holding them
(:mod:`shmcancel.sdk._routing`). More: docs/design.md, "The SDK integration".

Tools ask :func:`cancelled` or call :func:`raise_if_cancelled` (sync tools must: their thread
cannot be interrupted; async tools are interrupted by ``CancelledError`` at their next await).
A session dies with its worker (crash, ``max_requests``, ``HUP``): its requests then get 404.
"""

from __future__ import annotations

try:
    import httpx  # noqa: F401  (forwarding a session's requests to its worker)
    import mcp  # noqa: F401
except ImportError as e:
    raise ImportError(f"shmcancel.sdk needs the {e.name} package: pip install "
                      "'shmcancel[sdk]'", name=e.name) from e

from ._asgi import asgi
from ._calls import (
    RequestCancelled,
    cancelled,
    current_handle,
    raise_if_cancelled,
)
from ._routing import SocketDirTooLong, SocketDirUnsafe

__all__ = ["RequestCancelled", "SocketDirTooLong", "SocketDirUnsafe", "asgi", "cancelled",
           "current_handle", "raise_if_cancelled"]
