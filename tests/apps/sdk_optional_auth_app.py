"""The SDK example (examples/sdk, on the ``--pythonpath``) with optional authentication, as an
app may add it (Starlette's ``AuthenticationMiddleware``): ``Authorization: Bearer <name>``
authenticates as client ``<name>`` (an SDK ``AuthenticatedUser``); no header is anonymous."""

from __future__ import annotations

from typing import Any

from app import app  # examples/sdk/app.py
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import AccessToken
from starlette.authentication import AuthCredentials, AuthenticationBackend
from starlette.middleware.authentication import AuthenticationMiddleware


class _Optional(AuthenticationBackend):
    async def authenticate(self, conn: Any) -> tuple[AuthCredentials, AuthenticatedUser] | None:
        header = conn.headers.get("authorization", "")
        if not header.startswith("Bearer "):
            return None
        name = header[len("Bearer "):]
        return AuthCredentials([]), AuthenticatedUser(
            AccessToken(token=name, client_id=name, scopes=[]))


app.add_middleware(AuthenticationMiddleware, backend=_Optional())
