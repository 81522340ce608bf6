"""The tool registry: :class:`Tool` (what ``tools/list`` describes), :class:`ToolError` (what a
tool raises to answer with a JSON-RPC error), registration with its argument checks, and how a
tool's return value becomes a ``CallToolResult``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import codes, jsonrpc
from .jsonrpc import Request, RpcError
from .wire import (
    ParamHeader,
    param_headers,
)

# the conn is the request's WSGI environ (a dict): a tool may take it as a dict or a Mapping
ToolFn = Callable[[dict[str, Any], dict[str, Any]], Any]

_MAX_TEXT = 1000  # characters of an exception message put into an isError result


class ToolError(Exception):
    """Raised by a tool to answer its call with a JSON-RPC error (``code``, ``message``,
    optional ``data``), e.g. ``ToolError(codes.REQUEST_CANCELLED, "Request cancelled")``;
    always with HTTP 200. ``ToolError(codes.INVALID_PARAMS, problem)`` is the exception: the
    call's arguments are invalid, which is answered as a tool execution error (a result with
    ``isError: true`` and the text ``Invalid arguments for tool NAME: problem``)."""

    def __init__(self, code: int, message: str, data: Any = None) -> None:
        if isinstance(code, bool) or not isinstance(code, int):
            raise TypeError(f"ToolError code must be an int, got {code!r}")
        super().__init__(message)
        self.code = code
        self.message = str(message)
        self.data = data


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    fn: ToolFn
    description: str | None = None
    input_schema: Mapping[str, Any] = field(default_factory=lambda: {"type": "object"})
    title: str | None = None
    annotations: Mapping[str, Any] | None = None
    output_schema: Mapping[str, Any] | None = None
    param_headers: tuple[ParamHeader, ...] = ()

    def describe(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "inputSchema": dict(self.input_schema)}
        if self.title is not None:
            d["title"] = self.title
        if self.description is not None:
            d["description"] = self.description
        if self.annotations is not None:
            d["annotations"] = dict(self.annotations)
        if self.output_schema is not None:
            d["outputSchema"] = dict(self.output_schema)
        return d


class ToolRegistry:
    """The tools a server serves, by name; a mixin of :class:`~shmcancel.mcp.server.McpServer`,
    whose constructor creates ``_tools``."""

    _tools: dict[str, Tool]

    def tool(self, name: str, description: str | None = None,
             input_schema: Mapping[str, Any] | None = None, *, title: str | None = None,
             annotations: Mapping[str, Any] | None = None,
             output_schema: Mapping[str, Any] | None = None) -> Callable[[ToolFn], ToolFn]:
        """Decorator registering ``fn(conn, params)`` as tool ``name``."""
        def register(fn: ToolFn) -> ToolFn:
            self.add_tool(fn, name, description, input_schema, title=title,
                          annotations=annotations, output_schema=output_schema)
            return fn
        return register

    def add_tool(self, fn: ToolFn, name: str, description: str | None = None,
                 input_schema: Mapping[str, Any] | None = None, *, title: str | None = None,
                 annotations: Mapping[str, Any] | None = None,
                 output_schema: Mapping[str, Any] | None = None) -> Tool:
        if not callable(fn):
            raise TypeError(f"tool {name!r}: {fn!r} is not callable")
        if not isinstance(name, str) or not name:
            raise ValueError(f"tool name must be a non-empty str, got {name!r}")
        if name in self._tools:
            raise ValueError(f"tool {name!r} is already registered")
        schema = {"type": "object"} if input_schema is None else dict(input_schema)
        if schema.get("type") != "object":
            raise ValueError(f'tool {name!r}: input_schema must have "type": "object"')
        jsonrpc.encode(schema)  # must be JSON
        try:
            mirrored = param_headers(schema)
        except ValueError as e:
            raise ValueError(f"tool {name!r}: {e}") from None
        t = Tool(name, fn, description, schema, title, annotations, output_schema, mirrored)
        self._tools[name] = t
        return t

    @property
    def tools(self) -> dict[str, Tool]:
        return dict(self._tools)

    def _tools_list(self, msg: Request) -> dict[str, Any]:
        params = msg.params or {}
        cursor = params.get("cursor")
        if cursor is not None and not isinstance(cursor, str):
            raise RpcError(codes.INVALID_PARAMS, 'Invalid params: "cursor" must be a string',
                           id=msg.id, status=200)
        return {"tools": [t.describe() for t in self._tools.values()]}


def _tool_result(value: Any) -> dict[str, Any] | None:
    if isinstance(value, str):
        return {"content": [{"type": "text", "text": value}], "isError": False}
    if isinstance(value, dict):
        if isinstance(value.get("content"), list):
            return dict(value)
        try:
            text = jsonrpc.encode(value).decode("utf-8")
        except (TypeError, ValueError):
            return None
        return {"content": [{"type": "text", "text": text}], "structuredContent": value,
                "isError": False}
    return None


def _invalid_arguments(tool: str, problem: str) -> dict[str, Any]:
    """The tool execution error (``isError: true``) that answers a call with invalid
    arguments, naming the problem (MCP 2025-11-25: input validation errors are tool errors, so
    the model can correct its call)."""
    text = f"Invalid arguments for tool {tool}: {problem}"
    return {"content": [{"type": "text", "text": text[:_MAX_TEXT]}], "isError": True}
