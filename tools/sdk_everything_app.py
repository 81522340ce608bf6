"""An "everything"-style server on the official MCP SDK (``MCPServer``) for the conformance suite's
server scenarios (``tools/sdk_conformance.sh``): the fixtures those scenarios call, written here
from their descriptions. ``SHMCANCEL_SDK_BENCH_BARE=1`` serves the SDK's own app alone (the
baseline, on one worker); otherwise ``shmcancel.sdk.asgi`` wraps it (stateful, as the SDK's
default)."""

from __future__ import annotations

import base64
import os
import struct
import zlib

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.prompts.base import UserMessage
from mcp_types import (
    AudioContent,
    Completion,
    EmbeddedResource,
    ImageContent,
    TextContent,
    TextResourceContents,
)

import shmcancel.sdk

mcp = MCPServer("shmcancel-sdk-everything")


def _png() -> str:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data)))

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(b"\x00\xff\x00\x00")) + chunk(b"IEND", b""))
    return base64.b64encode(png).decode("ascii")


def _wav() -> str:
    samples = b"\x00\x00" * 80
    header = (b"RIFF" + struct.pack("<I", 36 + len(samples)) + b"WAVEfmt "
              + struct.pack("<IHHIIHH", 16, 1, 1, 8000, 16000, 2, 16)
              + b"data" + struct.pack("<I", len(samples)))
    return base64.b64encode(header + samples).decode("ascii")


PNG, WAV = _png(), _wav()


def _resource(uri: str) -> EmbeddedResource:
    return EmbeddedResource(type="resource", resource=TextResourceContents(
        uri=uri, mimeType="text/plain", text="This is an embedded resource content."))


@mcp.tool()
def test_simple_text() -> list[TextContent]:
    """Returns simple text."""
    return [TextContent(type="text", text="This is a simple text response for testing.")]


@mcp.tool()
def test_image_content() -> list[ImageContent]:
    """Returns an image."""
    return [ImageContent(type="image", data=PNG, mimeType="image/png")]


@mcp.tool()
def test_audio_content() -> list[AudioContent]:
    """Returns audio."""
    return [AudioContent(type="audio", data=WAV, mimeType="audio/wav")]


@mcp.tool()
def test_embedded_resource() -> list[EmbeddedResource]:
    """Returns an embedded resource."""
    return [_resource("test://embedded-resource")]


@mcp.tool()
def test_multiple_content_types() -> list[TextContent | ImageContent | EmbeddedResource]:
    """Returns text, an image and a resource."""
    return [TextContent(type="text", text="Multiple content types test:"),
            ImageContent(type="image", data=PNG, mimeType="image/png"),
            _resource("test://mixed-content-resource")]


@mcp.tool()
def test_error_handling() -> str:
    """Always fails."""
    raise ValueError("This tool intentionally returns an error for testing")


@mcp.tool()
async def test_tool_with_progress(ctx: Context) -> str:
    """Reports progress 0, 50, 100."""
    for p in (0, 50, 100):
        await ctx.report_progress(p, 100, f"step {p}")
        await anyio.sleep(0.05)
    return "Progress test completed"


@mcp.tool()
async def test_tool_with_logging(ctx: Context) -> str:
    """Logs three messages."""
    for m in ("Tool execution started", "Tool processing data", "Tool execution completed"):
        await ctx.info(m)
        await anyio.sleep(0.05)
    return "Logging test completed"


@mcp.resource("test://static-text", mime_type="text/plain")
def static_text() -> str:
    return "This is the content of the static text resource."


@mcp.resource("test://static-binary", mime_type="image/png")
def static_binary() -> bytes:
    return base64.b64decode(PNG)


@mcp.resource("test://template/{id}/data", mime_type="application/json")
def template(id: str) -> str:
    return f'{{"id": "{id}", "templateTest": true, "data": "Data for ID: {id}"}}'


@mcp.prompt()
def test_simple_prompt() -> list[UserMessage]:
    """A simple prompt."""
    return [UserMessage("This is a simple prompt for testing.")]


@mcp.prompt()
def test_prompt_with_arguments(arg1: str, arg2: str) -> list[UserMessage]:
    """A prompt with arguments."""
    return [UserMessage(f"Prompt with arguments: arg1='{arg1}', arg2='{arg2}'")]


@mcp.prompt()
def test_prompt_with_embedded_resource(resourceUri: str) -> list[UserMessage]:
    """A prompt with an embedded resource."""
    return [UserMessage(_resource(resourceUri)), UserMessage("Please process the resource.")]


@mcp.prompt()
def test_prompt_with_image() -> list[UserMessage]:
    """A prompt with an image."""
    return [UserMessage(ImageContent(type="image", data=PNG, mimeType="image/png")),
            UserMessage("Please analyze the image above.")]


@mcp.completion()
async def complete(ref, argument, context):  # type: ignore[no-untyped-def]
    return Completion(values=[], total=0, hasMore=False)


if os.environ.get("SHMCANCEL_SDK_BENCH_BARE", "") not in ("", "0"):
    app = mcp.streamable_http_app()
else:
    app = shmcancel.sdk.asgi(mcp)
