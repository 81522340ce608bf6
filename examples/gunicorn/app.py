"""The example MCP server: two tools, ``echo`` and ``sleep``, served by gunicorn workers that
share one cancellation registry (see ``gunicorn.conf.py`` and ``README.md`` beside this file).
"""

from __future__ import annotations

import time

import shmcancel
from shmcancel.errors import INVALID_PARAMS, REQUEST_CANCELLED
from shmcancel.server import McpServer, ToolError, wait_cancelled

MAX_SLEEP = 60.0

server = McpServer(name="shmcancel-example", version="0.1.0", sessions=True)


@server.tool(
    "echo",
    description="Return the text it is given.",
    input_schema={
        "type": "object",
        "properties": {"text": {"type": "string"}},
        "required": ["text"],
        "additionalProperties": False,
    },
)
def echo(conn, params):
    text = params.get("text") if isinstance(params, dict) else None
    if not isinstance(text, str):
        raise ToolError(INVALID_PARAMS, '"text" must be a string')
    return text


@server.tool(
    "sleep",
    description=f"Sleep for `seconds` (0 to {MAX_SLEEP:g}); stops early when cancelled.",
    input_schema={
        "type": "object",
        "properties": {"seconds": {"type": "number", "minimum": 0, "maximum": MAX_SLEEP}},
        "required": ["seconds"],
        "additionalProperties": False,
    },
)
def sleep(conn, params):
    seconds = params.get("seconds") if isinstance(params, dict) else None
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) \
            or not 0 <= seconds <= MAX_SLEEP:
        raise ToolError(INVALID_PARAMS, f'"seconds" must be a number from 0 to {MAX_SLEEP:g}')
    deadline = time.monotonic() + seconds
    while True:
        if shmcancel.cancelled(conn):
            raise ToolError(REQUEST_CANCELLED, "Request cancelled")
        left = deadline - time.monotonic()
        if left <= 0:
            return f"slept {seconds:g}s"
        # returns within 5 ms of the call's cancellation (the contract: 10 ms), woken by the
        # worker that records it or by this worker's look at its waiting calls; else after left
        wait_cancelled(conn, left)


app = server
