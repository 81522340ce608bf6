"""Which MCP wire a request speaks, and the per-wire rules: header and ``_meta`` validation,
result shaping, the HTTP status of an error. Pure (h11-style): the WSGI app in
:mod:`shmcancel.server` does the I/O and asks this module what the protocol says.

Two wires share ``POST /mcp`` (contract §6):

- **legacy** — MCP 2025-11-25, 2025-06-18 and 2025-03-26: an ``initialize`` handshake (sent
  without ``MCP-Protocol-Version``), optional sessions (``Mcp-Session-Id``), client
  notifications such as ``notifications/cancelled``. A request without the version header is
  taken as 2025-03-26, as those revisions ask.
- **modern** — MCP 2026-07-28: stateless; every request carries ``MCP-Protocol-Version``,
  ``Mcp-Method`` (and ``Mcp-Name`` for name-bearing methods) mirroring the body, and
  ``params._meta`` with ``io.modelcontextprotocol/protocolVersion`` and
  ``io.modelcontextprotocol/clientCapabilities``. Cancellation is closing the connection.

:func:`detect` decides per request, before any session is looked at: a modern version header,
or the modern ``_meta`` envelope key in the body, selects modern (a body that claims modern
with a legacy or missing header then fails the header rung with ``-32020``); a legacy header or
none selects legacy; any other header value is answered ``-32022`` (HTTP 400) naming every
version served, which both the legacy rule ("unsupported version → 400") and the modern one
("UnsupportedProtocolVersionError") ask for; on a request in the modern envelope the ladder
decides (a header disagreeing with ``_meta`` is ``-32020`` first).

Header values arrive as WSGI strings (latin-1 decoded bytes). Duplicate header lines are
joined with ``,`` by gunicorn, so a duplicated routing header never equals the body and is
rejected as a mismatch.
"""

from __future__ import annotations

import base64
import binascii
import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from . import codes
from .jsonrpc import Message, Notification, Request, RpcError

__all__ = [
    "CLIENT_CAPABILITIES_META_KEY",
    "CLIENT_INFO_META_KEY",
    "LEGACY_VERSIONS",
    "MODERN_VERSIONS",
    "PROTOCOL_VERSION_META_KEY",
    "SERVER_INFO_META_KEY",
    "SUPPORTED_VERSIONS",
    "Envelope",
    "ParamHeader",
    "RequestHeaders",
    "Wire",
    "accepts",
    "decode_header_value",
    "detect",
    "detect_without_body",
    "dispatch_status",
    "is_json_content_type",
    "negotiate_legacy_version",
    "param_headers",
    "progress_token",
    "shape_result",
    "valid_session_id",
    "validate_modern",
    "validate_param_headers",
]

MODERN_VERSIONS: tuple[str, ...] = ("2026-07-28",)
LEGACY_VERSIONS: tuple[str, ...] = ("2025-11-25", "2025-06-18", "2025-03-26")  # newest first
SUPPORTED_VERSIONS: tuple[str, ...] = MODERN_VERSIONS + LEGACY_VERSIONS
LATEST_LEGACY_VERSION = LEGACY_VERSIONS[0]
#: What a legacy request without ``MCP-Protocol-Version`` is taken to speak (2025-06-18 rule).
HEADERLESS_LEGACY_VERSION = "2025-03-26"

PROTOCOL_VERSION_META_KEY = "io.modelcontextprotocol/protocolVersion"
CLIENT_INFO_META_KEY = "io.modelcontextprotocol/clientInfo"
CLIENT_CAPABILITIES_META_KEY = "io.modelcontextprotocol/clientCapabilities"
SERVER_INFO_META_KEY = "io.modelcontextprotocol/serverInfo"

#: Methods whose ``Mcp-Name`` header mirrors a params field (2026-07-28 transport).
NAME_BEARING_METHODS: Mapping[str, str] = {
    "tools/call": "name",
    "prompts/get": "name",
    "resources/read": "uri",
}

#: Longest header value read; longer ones are treated as malformed (never as a match).
MAX_HEADER_VALUE = 8192
MAX_SESSION_ID = 128

_HEADER_SAFE = re.compile(r"[\x20-\x7e]*")
_SESSION_ID = re.compile(r"[\x21-\x7e]{1,128}")
_B64_SENTINEL = re.compile(r"=\?base64\?(.*)\?=", re.DOTALL)


class Wire(enum.Enum):
    LEGACY = "legacy"
    MODERN = "2026-07-28"


class RequestHeaders(NamedTuple):
    """The request headers the transport reads, from a WSGI environ (absent → ``None``). A
    named tuple: made on every request, it costs a tuple, not a frozen dataclass's setattrs."""

    protocol_version: str | None
    method: str | None
    name: str | None
    session_id: str | None
    accept: str | None
    content_type: str | None

    @classmethod
    def from_environ(cls, environ: Mapping[str, Any]) -> RequestHeaders:
        def h(key: str) -> str | None:
            v = environ.get(key)
            return v if isinstance(v, str) else None

        return cls(
            protocol_version=h("HTTP_MCP_PROTOCOL_VERSION"),
            method=h("HTTP_MCP_METHOD"),
            name=h("HTTP_MCP_NAME"),
            session_id=h("HTTP_MCP_SESSION_ID"),
            accept=h("HTTP_ACCEPT"),
            content_type=h("CONTENT_TYPE"),
        )


@dataclass(frozen=True, slots=True)
class Envelope:
    """The validated per-request protocol fields of a modern request."""

    protocol_version: str
    client_info: dict[str, Any] | None
    client_capabilities: dict[str, Any]


# --------------------------------------------------------------------------- detection


def _meta_of(msg: Message) -> Any:
    params = getattr(msg, "params", None)
    return params.get("_meta") if isinstance(params, dict) else None


def _unsupported(requested: str, id: int | str | None, why: str = "") -> RpcError:
    shown = requested if len(requested) <= 128 else requested[:128] + "..."
    return RpcError(
        codes.UNSUPPORTED_PROTOCOL_VERSION,
        f"Unsupported protocol version: {shown!r}{why}",
        id=id,
        data={"supported": list(SUPPORTED_VERSIONS), "requested": shown},
    )


def detect(msg: Message, headers: RequestHeaders) -> Wire:
    """The wire of a parsed POST body. Raises ``-32022`` (HTTP 400) for a version header that
    names no revision served here, unless the body is a request in the modern envelope: the
    ladder (:func:`validate_modern`) then answers ``-32020`` when the header disagrees with
    ``_meta`` (a version header sent twice, joined), ``-32022`` when both name that version."""
    version = headers.protocol_version
    meta = _meta_of(msg)
    modern_meta = isinstance(meta, dict) and PROTOCOL_VERSION_META_KEY in meta
    if version is None:
        return Wire.MODERN if modern_meta else Wire.LEGACY
    version = version.strip(" \t")
    if version in MODERN_VERSIONS:
        return Wire.MODERN
    if version in LEGACY_VERSIONS:
        return Wire.MODERN if modern_meta else Wire.LEGACY
    if modern_meta and isinstance(msg, Request):
        return Wire.MODERN  # the ladder's header rung (-32020) comes before the version's
    raise _unsupported(version, msg.id if isinstance(msg, Request) else None)


def detect_without_body(headers: RequestHeaders) -> Wire | None:
    """The wire of a bodiless request (GET, DELETE): by the version header alone. ``None``
    for a header naming no served revision."""
    version = headers.protocol_version
    if version is None:
        return Wire.LEGACY
    version = version.strip(" \t")
    if version in MODERN_VERSIONS:
        return Wire.MODERN
    if version in LEGACY_VERSIONS:
        return Wire.LEGACY
    return None


# --------------------------------------------------------------------------- modern rules


def decode_header_value(value: str | None) -> str | None:
    """A mirrored header value (``Mcp-Name``, ``Mcp-Param-*``) as text, or ``None`` when it is
    absent or malformed. ``=?base64?...?=`` is decoded (canonical base64 of UTF-8 only); a
    plain value must be printable ASCII without surrounding whitespace."""
    if value is None or len(value) > MAX_HEADER_VALUE:
        return None
    m = _B64_SENTINEL.fullmatch(value)
    if m is None:
        if not _HEADER_SAFE.fullmatch(value) or value != value.strip(" \t"):
            return None
        return value
    payload = m.group(1)
    try:
        raw = base64.b64decode(payload, validate=True)
        if base64.b64encode(raw).decode("ascii") != payload:
            return None
        return raw.decode("utf-8")
    except (binascii.Error, ValueError):
        return None


def _mismatch(message: str, id: int | str | None) -> RpcError:
    return RpcError(codes.HEADER_MISMATCH, f"Header mismatch: {message}", id=id)


def validate_modern(msg: Request, headers: RequestHeaders) -> Envelope:
    """Run the 2026-07-28 validation ladder on a request; first failure wins.

    1. ``params._meta`` is an object with the protocol version and client capabilities
       → else ``-32602``;
    2. ``MCP-Protocol-Version`` equals the ``_meta`` version, ``Mcp-Method`` equals ``method``,
       ``Mcp-Name`` (decoded) equals the name-bearing param → else ``-32020``;
    3. the version is served → else ``-32022`` with ``data.supported``/``data.requested``;
    4. ``clientCapabilities`` (and ``clientInfo`` when present) are objects → else ``-32602``.

    All with HTTP 400; the ``-32602`` ones (the request's envelope, contract §5) with
    ``"id": null``, the others with the request's id (as the official SDK's server answers).
    """
    rid = msg.id
    params = msg.params
    meta = params.get("_meta") if params is not None else None
    if not isinstance(meta, dict):
        raise RpcError(codes.INVALID_PARAMS,
                       "Invalid params: params._meta must be an object carrying "
                       f"{PROTOCOL_VERSION_META_KEY!r} and {CLIENT_CAPABILITIES_META_KEY!r}")
    missing = [k for k in (PROTOCOL_VERSION_META_KEY, CLIENT_CAPABILITIES_META_KEY)
               if k not in meta]
    if missing:
        raise RpcError(codes.INVALID_PARAMS,
                       f"Invalid params: params._meta lacks {', '.join(missing)}")
    version = meta[PROTOCOL_VERSION_META_KEY]
    header_version = headers.protocol_version
    if header_version is None:
        raise _mismatch("the MCP-Protocol-Version header is missing", rid)
    if header_version.strip(" \t") != version:
        raise _mismatch("MCP-Protocol-Version does not match params._meta "
                        f"{PROTOCOL_VERSION_META_KEY!r}", rid)
    if headers.method is None:
        raise _mismatch("the Mcp-Method header is missing", rid)
    if headers.method.strip(" \t") != msg.method:
        raise _mismatch("Mcp-Method does not match the request's method", rid)
    name_key = NAME_BEARING_METHODS.get(msg.method)
    named = params.get(name_key) if name_key is not None and params is not None else None
    if isinstance(named, str):
        if headers.name is None:
            raise _mismatch(f"the Mcp-Name header is missing (params.{name_key} is set)", rid)
        if decode_header_value(headers.name) != named:
            raise _mismatch(f"Mcp-Name does not match params.{name_key}", rid)
    elif named is not None and headers.name is not None:  # no string: unlike any header
        raise _mismatch(f"Mcp-Name does not match params.{name_key}", rid)
    if not isinstance(version, str):  # unreachable with a header (a header is a str), kept total
        raise RpcError(codes.INVALID_PARAMS, "Invalid params: the protocol version must be a "
                       "string")
    if version not in MODERN_VERSIONS:
        # data.supported lists every revision served; one of the 2025 wire is not one this
        # envelope names (it is negotiated by initialize), which the message says
        raise _unsupported(version, rid, (
            f" in params._meta (this envelope carries {', '.join(MODERN_VERSIONS)}; "
            f"{version} is negotiated by initialize)") if version in LEGACY_VERSIONS else "")
    caps = meta[CLIENT_CAPABILITIES_META_KEY]
    if not isinstance(caps, dict):
        raise RpcError(codes.INVALID_PARAMS,
                       f"Invalid params: {CLIENT_CAPABILITIES_META_KEY!r} must be an object")
    info = meta.get(CLIENT_INFO_META_KEY)
    if info is not None and not isinstance(info, dict):
        raise RpcError(codes.INVALID_PARAMS,
                       f"Invalid params: {CLIENT_INFO_META_KEY!r} must be an object")
    return Envelope(version, info, caps)


# --------------------------------------------------------------------------- Mcp-Param-*

_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_CANONICAL_DECIMAL = re.compile(r"-?[0-9]+(\.[0-9]+)?")
X_MCP_HEADER = "x-mcp-header"


@dataclass(frozen=True, slots=True)
class ParamHeader:
    """A tool argument mirrored into ``Mcp-Param-{token}`` (2026-07-28 ``x-mcp-header``)."""

    path: tuple[str, ...]
    token: str
    type: str


def _count_annotations(node: Any, depth: int = 0) -> int:
    if depth > 64:
        return 0
    if isinstance(node, dict):
        return (X_MCP_HEADER in node) + sum(_count_annotations(v, depth + 1)
                                             for v in node.values())
    if isinstance(node, list):
        return sum(_count_annotations(v, depth + 1) for v in node)
    return 0


def param_headers(input_schema: Mapping[str, Any]) -> tuple[ParamHeader, ...]:
    """The ``x-mcp-header`` annotations of a tool's input schema.

    Raises ``ValueError`` for an invalid one (the 2026-07-28 constraints: only on a property
    reached from the root through ``properties`` alone, an RFC 9110 token, on an
    ``integer``/``string``/``boolean`` property, case-insensitively unique): clients must drop
    such a tool, so the server refuses to register it. Also for a token with an underscore,
    valid in MCP but not readable here: a WSGI environ names ``Mcp-Param-a_b`` and
    ``Mcp-Param-a-b`` alike (``HTTP_MCP_PARAM_A_B``) and gunicorn drops a header name with
    ``_`` by default (``header_map``), so the check of every call mirroring it would fail (or
    read another header's value); refused at registration rather than at each call.
    """
    found: list[ParamHeader] = []
    stack: list[tuple[tuple[str, ...], Any]] = [((), input_schema)]
    while stack:
        path, node = stack.pop()
        if not isinstance(node, dict):
            continue
        if path and X_MCP_HEADER in node:
            token, typ = node[X_MCP_HEADER], node.get("type")
            where = ".".join(path)
            if not isinstance(token, str) or not _TOKEN.fullmatch(token):
                raise ValueError(f"property {where!r}: {X_MCP_HEADER} must be an RFC 9110 token")
            if "_" in token:
                raise ValueError(f"property {where!r}: {X_MCP_HEADER} {token!r} has an underscore: "
                                 "a WSGI app cannot read that header (PEP 3333 maps '-' and '_' "
                                 "to one environ key; gunicorn drops such header names), so "
                                 "every call mirroring it would fail its check")
            if typ not in ("string", "integer", "boolean"):
                raise ValueError(f"property {where!r}: {X_MCP_HEADER} is only allowed on "
                                 "string, integer and boolean properties")
            found.append(ParamHeader(path, token, typ))
        props = node.get("properties")
        if isinstance(props, dict):
            stack.extend(((*path, k), v) for k, v in props.items() if isinstance(k, str))
    if len(found) != _count_annotations(input_schema):
        raise ValueError(f"{X_MCP_HEADER} is only allowed on properties reached through "
                         '"properties" alone')
    tokens = [p.token.lower() for p in found]
    if len(set(tokens)) != len(tokens):
        raise ValueError(f"{X_MCP_HEADER} values must be case-insensitively unique")
    return tuple(found)


def _render(value: Any) -> str | None:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value
    if isinstance(value, int | float):
        try:
            return str(value)
        except ValueError:
            return None
    return None


def _param_matches(typ: str, value: Any, rendered: str, decoded: str) -> bool:
    # an int is whole as it is (float() of one past float range raises OverflowError)
    if (typ == "integer" and not isinstance(value, bool)
            and (isinstance(value, int) or (isinstance(value, float) and value.is_integer()))
            and _CANONICAL_DECIMAL.fullmatch(decoded)):
        whole, _, fraction = decoded.partition(".")
        if fraction.strip("0"):
            return False
        try:
            return int(whole) == int(value)
        except (ValueError, OverflowError):
            return False
    return decoded == rendered


def validate_param_headers(specs: tuple[ParamHeader, ...], arguments: Mapping[str, Any],
                           environ: Mapping[str, Any], id: int | str | None) -> None:
    """Check each annotated argument against its ``Mcp-Param-*`` header (2026-07-28): present
    together and equal after decoding (integers compared numerically), or absent together
    (``null`` counts as absent). Raises ``-32020`` (HTTP 400) on the first disagreement."""
    for spec in specs:
        header = f"Mcp-Param-{spec.token}"
        raw = environ.get("HTTP_MCP_PARAM_" + spec.token.upper().replace("-", "_"))
        raw = raw if isinstance(raw, str) else None
        value: Any = arguments
        for key in spec.path:
            value = value.get(key) if isinstance(value, Mapping) else None
        rendered = _render(value) if value is not None else None
        if rendered is None:
            if raw is not None:
                raise _mismatch(f"{header} is present but the argument it mirrors is not "
                                "a value it can carry", id)
            continue
        if raw is None:
            raise _mismatch(f"{header} is missing (the argument is set)", id)
        decoded = decode_header_value(raw)
        if decoded is None or not _param_matches(spec.type, value, rendered, decoded):
            raise _mismatch(f"{header} does not match the argument", id)


# --------------------------------------------------------------------------- shared rules


def progress_token(msg: Request | Notification) -> int | str | None:
    """``params._meta.progressToken`` (a string or an integer), or ``None`` when absent.

    Raises ``-32602`` for a ``_meta`` that is not an object or a token of another type: with
    HTTP 200 for a request (it was read, contract §5), 400 for a notification.
    """
    params = msg.params
    if params is None or "_meta" not in params:
        return None
    meta = params["_meta"]
    rid = msg.id if isinstance(msg, Request) else None
    status = 200 if isinstance(msg, Request) else 400
    if not isinstance(meta, dict):
        raise RpcError(codes.INVALID_PARAMS, "Invalid params: params._meta must be an object",
                       id=rid, status=status)
    token = meta.get("progressToken")
    if token is None:
        return None
    if isinstance(token, bool) or not isinstance(token, int | str):
        raise RpcError(codes.INVALID_PARAMS,
                       "Invalid params: _meta.progressToken must be a string or an integer",
                       id=rid, status=status)
    return token


def negotiate_legacy_version(requested: str) -> str:
    """The version an ``initialize`` is answered with: the requested one when served, else
    the newest legacy revision (the client then decides whether it can speak it)."""
    return requested if requested in LEGACY_VERSIONS else LATEST_LEGACY_VERSION


def valid_session_id(value: str | None) -> bool:
    """A well-formed ``Mcp-Session-Id``: 1–128 visible ASCII characters (0x21–0x7E)."""
    return value is not None and _SESSION_ID.fullmatch(value) is not None


def _media_types(header: str) -> list[tuple[str, float]]:
    out: list[tuple[str, float]] = []
    for part in header[:MAX_HEADER_VALUE].split(",")[:64]:
        fields = part.split(";")
        mt = fields[0].strip().lower()
        if not mt:
            continue
        q = 1.0
        for p in fields[1:]:
            k, _, v = p.partition("=")
            if k.strip().lower() == "q":
                try:
                    q = float(v.strip())
                except ValueError:
                    q = 0.0
        out.append((mt, q))
    return out


def accepts(accept: str | None) -> tuple[bool, bool]:
    """``(json_ok, sse_ok)`` for an ``Accept`` header: wildcards count, ``q=0`` refuses, the
    most specific entry wins. No header (or an empty one) accepts anything (RFC 9110). The
    answers for short headers are kept (clients send a few values, each on every request)."""
    if accept is None:
        return True, True
    keep = type(accept) is str and len(accept) <= _KEPT_ACCEPT_LENGTH  # (a subclass may hash oddly)
    got = _accepted.get(accept) if keep else None
    if got is None:
        got = _accepts(accept)
        if keep:
            if len(_accepted) >= _KEPT_ACCEPTS:
                _accepted.clear()
            _accepted[accept] = got
    return got


_KEPT_ACCEPTS = 64  # Accept values whose answer is kept (then the cache starts over)
_KEPT_ACCEPT_LENGTH = 256  # the longest value kept, in characters
_accepted: dict[str, tuple[bool, bool]] = {}


def _accepts(accept: str) -> tuple[bool, bool]:
    if not accept.strip():
        return True, True
    types = _media_types(accept)
    if not types:
        return True, True

    def ok(full: str) -> bool:
        major = full.split("/", 1)[0] + "/*"
        for candidate in (full, major, "*/*"):
            qs = [q for mt, q in types if mt == candidate]
            if qs:
                return max(qs) > 0
        return False

    return ok("application/json"), ok("text/event-stream")


def is_json_content_type(content_type: str | None) -> bool:
    """``application/json``, with at most a UTF-8 ``charset`` parameter."""
    if content_type is None:
        return False
    fields = content_type[:MAX_HEADER_VALUE].split(";")
    if fields[0].strip().lower() != "application/json":
        return False
    for p in fields[1:]:
        k, _, v = p.partition("=")
        if k.strip().lower() == "charset" and v.strip().strip('"').lower() not in ("utf-8", "utf8"):
            return False
    return True


def dispatch_status(wire: Wire, code: int) -> int:
    """HTTP status of a JSON-RPC error answering a message that was read as a request.

    contract §5 (revised 2026-12-01): SDK clients turn an HTTP 4xx into a transport failure, so a
    request they could read gets 200 carrying its error: invalid params (``-32602``, e.g. an
    unknown tool), a cancelled call (``-32800``), a tool's own codes, ``-32603``. 4xx only
    where the transport asks for one: the 2026-07-28 header, capability and version rungs
    (``-32020``, ``-32021``, ``-32022``: 400) and an unknown method on that wire (``-32601``:
    404, as 2026-07-28 requires; 200 on the legacy wire, where a client may take a 404 for
    "session gone"). ``-32700``/``-32600`` say the message was not a request: 400. What is
    decided elsewhere: the envelope errors of :func:`shmcancel.mcp.jsonrpc.parse` and of
    :func:`validate_modern` (400), session, Origin, size and media-type refusals, the quota
    refusal of a ``notifications/cancelled`` (429).
    """
    if code in (codes.PARSE_ERROR, codes.INVALID_REQUEST, codes.HEADER_MISMATCH, -32021,
                codes.UNSUPPORTED_PROTOCOL_VERSION):
        return 400
    if code == codes.METHOD_NOT_FOUND:
        return 404 if wire is Wire.MODERN else 200
    return 200


def shape_result(wire: Wire, method: str, result: dict[str, Any], *,
                 server_info: Mapping[str, Any], ttl_ms: int, cache_scope: str) -> dict[str, Any]:
    """A result as the wire wants it. Legacy: unchanged. Modern: ``resultType: "complete"`` on
    every result, ``ttlMs``/``cacheScope`` on ``tools/list`` and ``server/discover``, and the
    server's identity in ``_meta`` (``io.modelcontextprotocol/serverInfo``)."""
    if wire is Wire.LEGACY:
        return result
    out = dict(result)
    out["resultType"] = "complete"
    if method in ("tools/list", "server/discover"):
        out["ttlMs"] = ttl_ms
        out["cacheScope"] = cache_scope
    meta = out.get("_meta")
    meta = dict(meta) if isinstance(meta, dict) else {}
    meta[SERVER_INFO_META_KEY] = dict(server_info)
    out["_meta"] = meta
    return out
