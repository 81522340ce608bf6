"""JSON-RPC 2.0 as MCP uses it: decode a POST body, classify and validate one message, build
replies. Pure: no I/O, no HTTP, no registry.

What MCP narrows in JSON-RPC (and what this module therefore rejects):

- an ``id`` is an integer or a string, never ``null``, a float or a ``bool``; shmcancel also
  caps a string at :data:`shmcancel.cancel.ids.MAX_ID_BYTES` (contract §4.1);
- ``params``, when present, is an object;
- one message per POST: JSON-RPC batching was removed from MCP in 2025-06-18 (and never
  existed on the 2026-07-28 wire), so a JSON array is answered ``-32600``.

Every rejection of :func:`decode` and :func:`parse` is an :class:`RpcError` with HTTP 400 and
``"id": null`` (contract §5: a message that is not a valid envelope is not a request the server
read, whatever id it carries; the official SDK's server answers the same); errors of requests
that were read carry their id, with HTTP 200: a ``params`` that is not an object, and a string id
past shmcancel's cap (a valid JSON-RPC and MCP id, which the official SDK's server would serve:
answered ``-32600`` for that id, as the SDK integration answers it). No input makes this module
raise anything else.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..cancel import ids
from . import codes

__all__ = [
    "Notification",
    "Request",
    "Response",
    "RpcError",
    "decode",
    "encode",
    "error_body",
    "parse",
    "result_body",
]

JSONRPC_VERSION = "2.0"


class RpcError(Exception):
    """A JSON-RPC error reply waiting to be sent: ``code``, ``message``, optional ``data``, the
    ``id`` to answer (``None`` → ``"id": null``) and the HTTP ``status`` it travels with."""

    def __init__(self, code: int, message: str, *, id: int | str | None = None,
                 data: Any = None, status: int = 400) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.id = id
        self.data = data
        self.status = status

    def body(self) -> dict[str, Any]:
        return error_body(self.id, self.code, self.message, self.data)

    def __repr__(self) -> str:
        return f"RpcError({self.code}, {self.message!r}, id={self.id!r}, status={self.status})"


@dataclass(frozen=True, slots=True)
class Request:
    """A request: it has a valid ``id`` and is owed exactly one reply."""

    id: int | str
    method: str
    params: dict[str, Any] | None


@dataclass(frozen=True, slots=True)
class Notification:
    """A notification: no ``id``; the HTTP answer is 202 with no body (or an error status)."""

    method: str
    params: dict[str, Any] | None


@dataclass(frozen=True, slots=True)
class Response:
    """A result or error object the client POSTed (a reply to a server-to-client request)."""

    id: Any


Message = Request | Notification | Response


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# json.loads/dumps with options build a decoder/encoder a call; these keep no state between calls
_DECODER = json.JSONDecoder(parse_constant=_reject_constant)
_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)
_ASCII_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def decode(body: bytes) -> Any:
    """Parse a POST body as strict JSON (UTF-8, no ``NaN``/``Infinity``).

    Raises :class:`RpcError` ``-32700`` (HTTP 400) for anything that is not one JSON text,
    including invalid UTF-8, nesting deep enough to exhaust the recursion limit and integer
    literals past CPython's digit limit.
    """
    try:
        return _DECODER.decode(body.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are both
        raise RpcError(codes.PARSE_ERROR, f"Parse error: {_short(e)}") from None


def _valid_id(value: Any) -> bool:
    return ids.key(value) is not None and isinstance(value, int | str)


def parse(obj: Any) -> Message:
    """Classify a decoded body as a :class:`Request`, :class:`Notification` or client
    :class:`Response`, validating the envelope. Raises :class:`RpcError`: HTTP 400, but for a
    request (a valid id) whose ``params`` is not an object, its ``-32602`` for that id (200),
    and for a request whose string id is past the cap, its ``-32600`` for that id (200)."""
    if isinstance(obj, list):
        raise RpcError(codes.INVALID_REQUEST,
                       "Batch requests are not supported: send one JSON-RPC message per POST")
    if not isinstance(obj, dict):
        raise RpcError(codes.INVALID_REQUEST, "Invalid Request: the body must be a JSON-RPC "
                       "request or notification object")
    has_id = "id" in obj
    raw_id = obj.get("id")
    echo = raw_id if has_id and _valid_id(raw_id) else None
    if obj.get("jsonrpc") != JSONRPC_VERSION:
        raise RpcError(codes.INVALID_REQUEST, 'Invalid Request: "jsonrpc" must be "2.0"')
    if "method" not in obj:
        if ("result" in obj) != ("error" in obj) and has_id:
            return Response(raw_id if echo is not None else None)
        raise RpcError(codes.INVALID_REQUEST,
                       'Invalid Request: a request needs a "method" string')
    method = obj["method"]
    if not isinstance(method, str):
        raise RpcError(codes.INVALID_REQUEST, 'Invalid Request: "method" must be a string')
    if has_id and echo is None:
        long_id = isinstance(raw_id, str)  # a request all the same: answered for its id (§5)
        raise RpcError(codes.INVALID_REQUEST, "Invalid Request: " + _describe_bad_id(raw_id),
                       id=raw_id if long_id else None, status=200 if long_id else 400)
    params = obj.get("params")
    if "params" in obj and not isinstance(params, dict):
        # a request (its id valid by now: echo) is answered for its id with HTTP 200 (contract
        # §5); a notification, 400 with "id": null (echo is None)
        raise RpcError(codes.INVALID_PARAMS,
                       f'Invalid params: "params" must be an object, got {_json_type(params)}',
                       id=echo, status=200 if has_id else 400)
    if has_id:
        return Request(echo, method, params)  # type: ignore[arg-type]
    return Notification(method, params)


def _describe_bad_id(value: Any) -> str:
    if value is None:
        return 'the request "id" must not be null'
    if isinstance(value, str):
        return f'the request "id" is longer than {ids.MAX_ID_BYTES} UTF-8 bytes (or not UTF-8)'
    return f'the request "id" must be an integer or a string, got {_json_type(value)}'


_JSON_TYPES = ((bool, "a boolean"), (int, "an integer"),  # bool first: it is an int
               (float, "a number with a fraction or exponent"), (str, "a string"),
               (list, "an array"), (dict, "an object"))


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    for t, name in _JSON_TYPES:
        if isinstance(value, t):
            return name
    return type(value).__name__


def _short(e: BaseException, limit: int = 200) -> str:
    text = str(e) or type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def result_body(id: int | str, result: dict[str, Any]) -> dict[str, Any]:
    return {"jsonrpc": JSONRPC_VERSION, "id": id, "result": result}


def error_body(id: int | str | None, code: int, message: str, data: Any = None) -> dict[str, Any]:
    err: dict[str, Any] = {"code": code, "message": message}
    if data is not None:
        err["data"] = data
    return {"jsonrpc": JSONRPC_VERSION, "id": id, "error": err}


def encode(obj: Any) -> bytes:
    """Serialise one reply as compact UTF-8 JSON.

    Raises ``ValueError``/``TypeError`` for values JSON cannot carry (``NaN``, sets, objects,
    nesting past the interpreter's recursion limit: its ``RecursionError`` is raised as a
    ``ValueError``), so the caller can turn a tool's unserialisable result into an internal
    error. Strings holding lone surrogates (JSON input may carry ``"\\ud800"``) are written
    escaped.
    """
    try:
        try:
            return _ENCODER.encode(obj).encode("utf-8")
        except UnicodeEncodeError:
            return _ASCII_ENCODER.encode(obj).encode("ascii")
    except RecursionError:
        raise ValueError("nested too deeply to encode as JSON") from None
