"""The 2026-07-28 wire: stateless; every request's headers and ``_meta`` validated
(:func:`shmcancel.mcp.wire.validate_modern`), ``server/discover``, no client notifications (a
client cancels by closing the connection), responses from the client refused.
"""

from __future__ import annotations

from typing import Any

from . import codes
from .call import CallLifecycle
from .jsonrpc import Notification, Request, Response, RpcError
from .principal import SESSION_KEY
from .reply import StartResponse, _Reply
from .wire import (
    SUPPORTED_VERSIONS,
    RequestHeaders,
    Wire,
    validate_modern,
)


class ModernWire(CallLifecycle):
    """The 2026-07-28 request handling; a mixin of :class:`~shmcancel.mcp.server.McpServer`."""

    # ------------------------------------------------------------------ 2026-07-28

    def _modern(self, environ: dict[str, Any], start_response: StartResponse,
                headers: RequestHeaders, msg: Request | Notification | Response,
                json_ok: bool, sse_ok: bool) -> _Reply | None:
        if isinstance(msg, Response):
            raise RpcError(codes.INVALID_REQUEST,
                           "Invalid Request: clients must not send responses on 2026-07-28")
        if isinstance(msg, Notification):
            # No client-to-server notifications exist on this wire (a client cancels by closing
            # the connection); accept and drop, as the transport's rules allow.
            return _Reply(202)
        validate_modern(msg, headers)
        environ.pop(SESSION_KEY, None)  # an Mcp-Session-Id header is ignored on this wire
        if msg.method == "server/discover":
            # serverInfo also travels in _meta (io.modelcontextprotocol/serverInfo) on every
            # 2026-07-28 result; discover names it plainly too, as initialize does.
            result = {"supportedVersions": list(SUPPORTED_VERSIONS),
                      "capabilities": self.capabilities(), "serverInfo": self.server_info()}
            if self.instructions is not None:
                result["instructions"] = self.instructions
            return self._result(Wire.MODERN, msg, result, json_ok)
        return self._tool_methods(environ, start_response, Wire.MODERN, msg, json_ok, sse_ok)
