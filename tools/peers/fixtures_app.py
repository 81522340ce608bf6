"""The example server plus the tools the MCP conformance suite's tool scenarios call (run by
tools/peers.sh): the same transport, registry and ``echo``/``sleep`` as ``examples/gunicorn``,
so a scenario that fails against the example only for want of its ``test_*`` tool can still
check the transport. Tools that need server-to-client requests or notifications other than
progress (sampling, elicitation, logging) are left out: this transport sends none.

gunicorn -c examples/gunicorn/gunicorn.conf.py --pythonpath tools/peers,examples/gunicorn \\
    fixtures_app:app
"""

from __future__ import annotations

import base64
import struct
import time
import zlib

from app import server  # the example's McpServer (examples/gunicorn/app.py)

import shmcancel
from shmcancel.errors import REQUEST_CANCELLED
from shmcancel.server import ToolError, progress


def _png_1x1() -> str:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data)))

    raw = b"\x00\xff\x00\x00"  # one filter byte, one red RGB pixel
    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))
    return base64.b64encode(png).decode("ascii")


def _wav_silence() -> str:
    samples = b"\x00\x00" * 80  # 10 ms of 16-bit mono silence at 8 kHz
    header = (b"RIFF" + struct.pack("<I", 36 + len(samples)) + b"WAVEfmt "
              + struct.pack("<IHHIIHH", 16, 1, 1, 8000, 16000, 2, 16)
              + b"data" + struct.pack("<I", len(samples)))
    return base64.b64encode(header + samples).decode("ascii")


IMAGE = {"type": "image", "data": _png_1x1(), "mimeType": "image/png"}
RESOURCE = {"type": "resource", "resource": {"uri": "test://embedded-resource",
                                             "mimeType": "text/plain",
                                             "text": "This is an embedded resource content."}}
NO_ARGS = {"type": "object", "properties": {}}


@server.tool("test_simple_text", description="Simple text.", input_schema=NO_ARGS)
def simple_text(conn, params):
    return "This is a simple text response for testing."


@server.tool("test_image_content", description="An image.", input_schema=NO_ARGS)
def image_content(conn, params):
    return {"content": [IMAGE]}


@server.tool("test_audio_content", description="Audio.", input_schema=NO_ARGS)
def audio_content(conn, params):
    return {"content": [{"type": "audio", "data": _wav_silence(), "mimeType": "audio/wav"}]}


@server.tool("test_embedded_resource", description="An embedded resource.",
             input_schema=NO_ARGS)
def embedded_resource(conn, params):
    return {"content": [RESOURCE]}


@server.tool("test_multiple_content_types", description="Text, image and resource.",
             input_schema=NO_ARGS)
def multiple_content_types(conn, params):
    return {"content": [{"type": "text", "text": "Multiple content types test:"}, IMAGE,
                        RESOURCE]}


@server.tool("test_error_handling", description="Always fails.", input_schema=NO_ARGS)
def error_handling(conn, params):
    raise RuntimeError("This tool intentionally returns an error for testing")


@server.tool("test_tool_with_progress", description="Reports progress 0, 50, 100.",
             input_schema=NO_ARGS)
def tool_with_progress(conn, params):
    for step in (0, 50, 100):
        if shmcancel.cancelled(conn):
            raise ToolError(REQUEST_CANCELLED, "Request cancelled")
        progress(conn, step, 100, f"step {step}")
        if step < 100:
            time.sleep(0.05)
    return "Progress test completed"


app = server
