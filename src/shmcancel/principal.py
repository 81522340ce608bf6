"""Who is calling (contract §3): the public path of :mod:`shmcancel.mcp.principal`."""

from __future__ import annotations

from .mcp.principal import (
    GLOBAL,
    MAX_SCOPE_BYTES,
    PRINCIPAL_KEY,
    REMOTE_ADDR_KEY,
    SESSION_KEY,
    UNKNOWN,
    client_bucket,
    id,
    normalize,
    put,
    scope,
)

__all__ = [
    "GLOBAL",
    "MAX_SCOPE_BYTES",
    "PRINCIPAL_KEY",
    "REMOTE_ADDR_KEY",
    "SESSION_KEY",
    "UNKNOWN",
    "client_bucket",
    "id",
    "normalize",
    "put",
    "scope",
]
