"""Servers built on the official MCP Python SDK (``mcp`` ≥ 2.3, ``MCPServer``) under gunicorn with
several uvicorn workers: cross-worker cancellation through the shared registry (contract §9).

::

    from mcp.server.mcpserver import MCPServer
    import shmcancel.sdk

    mcp = MCPServer("example")
    ...                                   # tools as usual
    app = shmcancel.sdk.asgi(mcp)         # what gunicorn's uvicorn workers serve

How it works (two seams of the SDK, both public):

- a *server middleware* (``MCPServer.middleware``) wraps every ``tools/call`` in the handler's own
  task: it begins a :class:`shmcancel.RequestHandle` in the caller's scope (session, else the
  authenticated principal, else the client address: contract §3), runs the call in an anyio cancel
  scope, and ends the handle when the call ends, however it ends. A per-worker poller (one
  asyncio task per event loop, alive only while calls run) cancels that scope once the handle
  reports a cancellation; the middleware then raises ``MCPError(-32800)``, which the SDK writes
  through its normal error path (JSON or SSE, stateful or stateless).
- an *ASGI layer* inside the ``/mcp`` route (so inside the SDK's auth middleware) answers a
  posted ``notifications/cancelled`` itself when its request is in flight in the caller's scope
  (on any worker), recording it with :meth:`shmcancel.Cancellation.cancel_if_in_flight` (check
  and insert in one lock hold); anything else goes on to the SDK unchanged. It repeats the SDK's
  Origin/Host and Content-Type checks for what it answers, caps the body at the SDK's
  ``max_request_body_size``, and on the 2026-07-28 wire watches the connection: a client that
  disconnects before its response is complete cancels its call (JSON responses included).

- a stateful server's sessions work on every worker: a session's id names the worker that holds
  it, each worker also serves the app on a unix socket of its own, and a request for another
  worker's session is forwarded there (SSE streamed through). See :mod:`shmcancel.sdk._routing`.

Tools ask :func:`cancelled` or call :func:`raise_if_cancelled` (sync tools must: their thread
cannot be interrupted; async tools are interrupted by ``CancelledError`` at their next await).
A session dies with its worker (crash, ``max_requests``, ``HUP``): its requests then get 404.
"""

from __future__ import annotations

from ._asgi import asgi
from ._calls import RequestCancelled, cancelled, current_handle, raise_if_cancelled

__all__ = ["RequestCancelled", "asgi", "cancelled", "current_handle", "raise_if_cancelled"]
