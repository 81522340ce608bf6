"""An MCP SDK server with bearer auth, wrapped by ``shmcancel.sdk.asgi`` (tests of contract §9:
the SDK's auth applies to every request, and its principals keep their calls apart).

Tokens (scope ``mcp`` required): ``alice-at-a`` (client ``a``, subject ``alice``),
``alice-at-b`` (client ``b``, subject ``alice``: another principal for the SDK), ``bare``
(client ``a``, subject ``alice``, no scope: the SDK's 403). ``SHMCANCEL_TEST_SDK_STATELESS=1``:
stateless with JSON responses.
"""

from __future__ import annotations

import os

from mcp.server.auth.provider import AccessToken
from mcp.server.auth.settings import AuthSettings
from mcp.server.mcpserver import MCPServer

import shmcancel.sdk
from tests.apps.sdk_tools import add_sleep_tools

_TOKENS = {"alice-at-a": ("a", "alice", ["mcp"]), "alice-at-b": ("b", "alice", ["mcp"]),
           "bare": ("a", "alice", [])}


class _Verifier:
    async def verify_token(self, token: str) -> AccessToken | None:
        got = _TOKENS.get(token)
        if got is None:
            return None
        client, subject, scopes = got
        return AccessToken(token=token, client_id=client, subject=subject, scopes=scopes)


mcp = MCPServer("auth-test", token_verifier=_Verifier(), auth=AuthSettings(
    issuer_url="http://127.0.0.1:9/", resource_server_url="http://127.0.0.1:9/mcp",
    required_scopes=["mcp"]))

add_sleep_tools(mcp)


_stateless = os.environ.get("SHMCANCEL_TEST_SDK_STATELESS") == "1"
app = shmcancel.sdk.asgi(mcp, **({"stateless_http": True, "json_response": True}
                                 if _stateless else {}))
