"""An SDK server mounted under a prefix of a parent Starlette app, as the SDK's docs mount
servers (``Mount("/example", app=...)``, the parent's lifespan running the mounted app's):
``/example/mcp`` (and ``/t/{tenant}/mcp``), stateful."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import anyio
from mcp.server.mcpserver import MCPServer
from starlette.applications import Starlette
from starlette.routing import Mount

import shmcancel.sdk

mcp = MCPServer("shmcancel-sdk-mounted")


@mcp.tool()
def echo(text: str) -> str:
    return text


@mcp.tool()
async def sleep(seconds: float) -> str:
    await anyio.sleep(seconds)
    return f"slept {seconds:g} s"


inner = shmcancel.sdk.asgi(mcp)


@contextlib.asynccontextmanager
async def lifespan(_app: Starlette) -> AsyncIterator[None]:
    async with inner.router.lifespan_context(inner):
        yield


# and under a path parameter (one app per tenant): a prefix whose raw path is percent-encoded
app = Starlette(routes=[Mount("/example", app=inner), Mount("/t/{tenant}", app=inner)],
                lifespan=lifespan)
