"""Per-wire protocol rules (shmcancel.mcp.wire): detection, the 2026-07-28 ladder, Accept and
Content-Type, result shaping. Pure, tables of cases."""

from __future__ import annotations

import base64

import pytest

from shmcancel import errors
from shmcancel.mcp import wire
from shmcancel.mcp.jsonrpc import Notification, Request, RpcError
from shmcancel.mcp.wire import (
    CLIENT_CAPABILITIES_META_KEY as CAPS,
)
from shmcancel.mcp.wire import (
    CLIENT_INFO_META_KEY as INFO,
)
from shmcancel.mcp.wire import (
    PROTOCOL_VERSION_META_KEY as PV,
)
from shmcancel.mcp.wire import (
    SERVER_INFO_META_KEY,
    SUPPORTED_VERSIONS,
    RequestHeaders,
    Wire,
    accepts,
    decode_header_value,
    detect,
    detect_without_body,
    dispatch_status,
    is_json_content_type,
    negotiate_legacy_version,
    param_headers,
    progress_token,
    shape_result,
    valid_session_id,
    validate_modern,
    validate_param_headers,
)
from shmcancel.server import McpServer

MODERN = "2026-07-28"
META = {PV: MODERN, INFO: {"name": "c", "version": "1"}, CAPS: {}}


def hdrs(version: str | None = None, method: str | None = None, name: str | None = None,
         **kw: str | None) -> RequestHeaders:
    return RequestHeaders(protocol_version=version, method=method, name=name,
                          session_id=kw.get("session_id"), accept=kw.get("accept"),
                          content_type=kw.get("content_type"))


def call(name: object = "sleep", meta: object = META, rid: int | str = 1) -> Request:
    params: dict[str, object] = {"name": name, "arguments": {}}
    if meta is not None:
        params["_meta"] = meta
    return Request(rid, "tools/call", params)


# ------------------------------------------------------------------------------ detection

@pytest.mark.parametrize("msg, headers, wire", [
    (Request(1, "initialize", {"protocolVersion": "2025-11-25"}), hdrs(), Wire.LEGACY),
    (Request(1, "tools/list", None), hdrs(), Wire.LEGACY),
    (Request(1, "tools/list", None), hdrs("2025-11-25"), Wire.LEGACY),
    (Request(1, "tools/list", None), hdrs("2025-06-18"), Wire.LEGACY),
    (Request(1, "tools/list", None), hdrs("2025-03-26"), Wire.LEGACY),
    (Notification("notifications/cancelled", {"requestId": 1}), hdrs("2025-11-25"), Wire.LEGACY),
    (Request(1, "tools/list", {"_meta": {"progressToken": 1}}), hdrs("2025-11-25"), Wire.LEGACY),
    (Request(1, "tools/list", {"_meta": META}), hdrs(MODERN, "tools/list"), Wire.MODERN),
    (Request(1, "tools/list", None), hdrs(MODERN), Wire.MODERN),  # then fails the ladder
    # the body claims modern: modern, whatever the header (then a mismatch)
    (Request(1, "tools/list", {"_meta": META}), hdrs(), Wire.MODERN),
    (Request(1, "tools/list", {"_meta": META}), hdrs("2025-11-25"), Wire.MODERN),
    (Request(1, "initialize", {"_meta": META}), hdrs(MODERN), Wire.MODERN),
])
def test_detect(msg: Request, headers: RequestHeaders, wire: Wire) -> None:
    assert detect(msg, headers) is wire


@pytest.mark.parametrize("version", ["2024-11-05", "2099-01-01", "", "garbage", "x" * 5000,
                                     "2026-07-28,2026-07-28"])
def test_detect_unsupported_version_header(version: str) -> None:
    with pytest.raises(RpcError) as ei:
        detect(Request(9, "tools/list", None), hdrs(version))
    e = ei.value
    assert (e.code, e.status, e.id) == (errors.UNSUPPORTED_PROTOCOL_VERSION, 400, 9)
    assert e.data["supported"] == list(SUPPORTED_VERSIONS)
    assert MODERN in e.data["supported"] and "2025-11-25" in e.data["supported"]
    assert isinstance(e.data["requested"], str) and len(e.data["requested"]) <= 131


def test_detect_without_body() -> None:
    assert detect_without_body(hdrs()) is Wire.LEGACY
    assert detect_without_body(hdrs("2025-11-25")) is Wire.LEGACY
    assert detect_without_body(hdrs(MODERN)) is Wire.MODERN
    assert detect_without_body(hdrs("1999-01-01")) is None


# ------------------------------------------------------------------------------ modern ladder

def test_validate_modern_accepts_a_well_formed_call() -> None:
    env = validate_modern(call(), hdrs(MODERN, "tools/call", "sleep"))
    assert env.protocol_version == MODERN and env.client_capabilities == {}
    assert env.client_info == {"name": "c", "version": "1"}
    # clientInfo is optional
    meta = {PV: MODERN, CAPS: {"x": {}}}
    assert validate_modern(call(meta=meta), hdrs(MODERN, "tools/call", "sleep")).client_info is None
    # a non-ASCII tool name travels base64-encoded
    name = "réveil ✓"
    enc = "=?base64?" + base64.b64encode(name.encode()).decode() + "?="
    validate_modern(call(name=name), hdrs(MODERN, "tools/call", enc))
    # a discover probe as the SDK sends it
    validate_modern(Request(1, "server/discover", {"_meta": META}), hdrs(MODERN, "server/discover"))


B64_SLEEP = "=?base64?" + base64.b64encode(b"sleep").decode() + "?="

# (request, headers, code)
LADDER = [
    (call(meta=None), hdrs(MODERN, "tools/call", "sleep"), errors.INVALID_PARAMS),
    (call(meta=[1]), hdrs(MODERN, "tools/call", "sleep"), errors.INVALID_PARAMS),
    (call(meta={PV: MODERN}), hdrs(MODERN, "tools/call", "sleep"), errors.INVALID_PARAMS),
    (call(meta={CAPS: {}}), hdrs(MODERN, "tools/call", "sleep"), errors.INVALID_PARAMS),
    (Request(1, "tools/list", None), hdrs(MODERN, "tools/list"), errors.INVALID_PARAMS),
    (call(), hdrs(None, "tools/call", "sleep"), errors.HEADER_MISMATCH),
    (call(), hdrs("2025-11-25", "tools/call", "sleep"), errors.HEADER_MISMATCH),
    (call(), hdrs(MODERN, None, "sleep"), errors.HEADER_MISMATCH),
    (call(), hdrs(MODERN, "tools/list", "sleep"), errors.HEADER_MISMATCH),
    (call(), hdrs(MODERN, "Tools/Call", "sleep"), errors.HEADER_MISMATCH),
    (call(), hdrs(MODERN, "tools/call", None), errors.HEADER_MISMATCH),
    (call(), hdrs(MODERN, "tools/call", "echo"), errors.HEADER_MISMATCH),
    (call(), hdrs(MODERN, "tools/call", "Sleep"), errors.HEADER_MISMATCH),
    (call(), hdrs(MODERN, "tools/call", "sleep,sleep"), errors.HEADER_MISMATCH),
    (call(), hdrs(MODERN, "tools/call", "=?base64?c2xlZXA?="), errors.HEADER_MISMATCH),
    (call(), hdrs(MODERN, "tools/call", "=?base64?!!!?="), errors.HEADER_MISMATCH),
    (call(name="é"), hdrs(MODERN, "tools/call", "é"), errors.HEADER_MISMATCH),
    # a body name that is no string disagrees with any header (was: -32602 of tools/call)
    (call(name=5), hdrs(MODERN, "tools/call", "5"), errors.HEADER_MISMATCH),
    (call(name=["sleep"]), hdrs(MODERN, "tools/call", "sleep"), errors.HEADER_MISMATCH),
    (call(meta={PV: "2027-01-01", CAPS: {}}), hdrs("2027-01-01", "tools/call", "sleep"),
     errors.UNSUPPORTED_PROTOCOL_VERSION),
    (call(meta={PV: MODERN, CAPS: []}), hdrs(MODERN, "tools/call", "sleep"),
     errors.INVALID_PARAMS),
    (call(meta={PV: MODERN, CAPS: {}, INFO: "me"}), hdrs(MODERN, "tools/call", "sleep"),
     errors.INVALID_PARAMS),
]


@pytest.mark.parametrize("msg, headers, code", LADDER)
def test_validate_modern_rejects(msg: Request, headers: RequestHeaders, code: int) -> None:
    with pytest.raises(RpcError) as ei:
        validate_modern(msg, headers)
    # contract §5: a -32602 of the envelope carries "id": null; a mismatch names the request
    want_id = None if code == errors.INVALID_PARAMS else msg.id
    assert (ei.value.code, ei.value.status, ei.value.id) == (code, 400, want_id)
    if code == errors.UNSUPPORTED_PROTOCOL_VERSION:
        assert ei.value.data == {"supported": list(SUPPORTED_VERSIONS), "requested": "2027-01-01"}


def test_a_2025_version_in_the_modern_envelope_is_refused_saying_why() -> None:
    """data.supported lists every revision served, 2025-11-25 too: the message must not
    read as if that version were not served at all."""
    with pytest.raises(RpcError) as ei:
        validate_modern(call(meta={PV: "2025-11-25", CAPS: {}}),
                        hdrs("2025-11-25", "tools/call", "sleep"))
    e = ei.value
    assert (e.code, e.status, e.id) == (errors.UNSUPPORTED_PROTOCOL_VERSION, 400, 1)
    assert "2025-11-25" in e.data["supported"]
    assert "negotiated by initialize" in e.message and MODERN in e.message


def test_base64_name_header_matches_after_decoding() -> None:
    validate_modern(call(), hdrs(MODERN, "tools/call", B64_SLEEP))


def test_tools_call_without_a_string_name_leaves_it_to_dispatch() -> None:
    """No header to disagree with: tools/call's own -32602 names the problem."""
    validate_modern(call(name=5), hdrs(MODERN, "tools/call", None))
    validate_modern(call(name=None), hdrs(MODERN, "tools/call", "sleep"))


@pytest.mark.parametrize("value, decoded", [
    ("us-west1", "us-west1"), ("", ""), (" padded", None), ("a\tb", None), ("é", None),
    ("=?base64?SGVsbG8sIOS4lueVjA==?=", "Hello, 世界"), ("=?base64?!?=", None),
    ("=?base64?SGk=?=", "Hi"), ("=?base64?SGl=?=", None),  # non-canonical padding bits
    ("=?base64?/w==?=", None), (None, None), ("x" * 9000, None),
])
def test_decode_header_value(value: str | None, decoded: str | None) -> None:
    assert decode_header_value(value) == decoded


# ------------------------------------------------------------------------------ shared rules

@pytest.mark.parametrize("params, token", [
    (None, None), ({}, None), ({"_meta": {}}, None), ({"_meta": {"progressToken": "t"}}, "t"),
    ({"_meta": {"progressToken": 7}}, 7), ({"_meta": {"progressToken": None}}, None),
])
def test_progress_token(params: dict | None, token: object) -> None:
    assert progress_token(Request(1, "tools/call", params)) == token


@pytest.mark.parametrize("params", [
    {"_meta": []}, {"_meta": "x"}, {"_meta": None}, {"_meta": {"progressToken": 1.5}},
    {"_meta": {"progressToken": True}}, {"_meta": {"progressToken": {}}},
])
def test_progress_token_rejects(params: dict) -> None:
    """A request was read: its -32602 travels with 200 (contract §5); a notification's with 400."""
    with pytest.raises(RpcError) as ei:
        progress_token(Request(4, "tools/call", params))
    assert (ei.value.code, ei.value.id, ei.value.status) == (errors.INVALID_PARAMS, 4, 200)
    with pytest.raises(RpcError) as ei:
        progress_token(Notification("notifications/x", params))
    assert (ei.value.code, ei.value.id, ei.value.status) == (errors.INVALID_PARAMS, None, 400)


def test_negotiate_legacy_version() -> None:
    for v in ("2025-11-25", "2025-06-18", "2025-03-26"):
        assert negotiate_legacy_version(v) == v
    for v in ("2024-11-05", "2026-07-28", "1.0", ""):
        assert negotiate_legacy_version(v) == "2025-11-25"


@pytest.mark.parametrize("sid, ok", [
    ("abc", True), ("A-z_0.9~!", True), ("x" * 128, True), ("x" * 129, False), ("", False),
    (None, False), ("a b", False), ("é", False), ("a\x00", False), ("a\n", False),
])
def test_valid_session_id(sid: str | None, ok: bool) -> None:
    assert valid_session_id(sid) is ok


@pytest.mark.parametrize("header, expected", [
    (None, (True, True)), ("", (True, True)),
    ("application/json, text/event-stream", (True, True)),
    ("application/json", (True, False)), ("text/event-stream", (False, True)),
    ("*/*", (True, True)), ("application/*", (True, False)), ("text/*", (False, True)),
    ("text/html", (False, False)), ("image/png, text/plain", (False, False)),
    ("application/json;q=0, text/event-stream", (False, True)),
    ("*/*;q=0.5, application/json;q=0", (False, True)),
    ("APPLICATION/JSON; charset=utf-8", (True, False)),
    ("application/json;q=abc", (False, False)),
    (", ,", (True, True)),
])
def test_accepts(header: str | None, expected: tuple[bool, bool]) -> None:
    assert accepts(header) == expected
    assert accepts(header) == expected  # the kept answer, the second time


def test_accepts_keeps_a_bounded_number_of_answers_each_its_own_headers() -> None:
    """The answers kept per ``Accept`` value are each that value's (never a neighbour's), at
    most ``_KEPT_ACCEPTS`` of them, none for a value longer than ``_KEPT_ACCEPT_LENGTH`` (a client
    varying its header cannot grow the process)."""
    headers = [f"application/json;q={i % 2}, text/event-stream;q={i // 2 % 2}, x/{i}"
               for i in range(3 * wire._KEPT_ACCEPTS)]
    for _ in range(2):
        for i, h in enumerate(headers):
            assert accepts(h) == (i % 2 == 1, i // 2 % 2 == 1), h
            assert len(wire._accepted) <= wire._KEPT_ACCEPTS
    long = "application/json, " + "x/y, " * wire._KEPT_ACCEPT_LENGTH
    assert accepts(long) == (True, False)
    assert long not in wire._accepted


@pytest.mark.parametrize("ct, ok", [
    ("application/json", True), ("application/json; charset=utf-8", True),
    ("Application/JSON;charset=UTF-8", True), ('application/json; charset="utf-8"', True),
    ("application/json; charset=latin-1", False), ("text/plain", False),
    ("application/jsonx", False), ("", False), (None, False), ("application/x-www-form-urlencoded",
                                                              False),
])
def test_is_json_content_type(ct: str | None, ok: bool) -> None:
    assert is_json_content_type(ct) is ok


@pytest.mark.parametrize("wire, code, status", [
    (Wire.LEGACY, errors.METHOD_NOT_FOUND, 200), (Wire.LEGACY, errors.INVALID_PARAMS, 200),
    (Wire.LEGACY, errors.PARSE_ERROR, 400), (Wire.LEGACY, 12345, 200),
    (Wire.LEGACY, errors.REQUEST_CANCELLED, 200),
    (Wire.MODERN, errors.METHOD_NOT_FOUND, 404), (Wire.MODERN, errors.INVALID_PARAMS, 200),
    (Wire.MODERN, errors.HEADER_MISMATCH, 400), (Wire.MODERN, errors.REQUEST_CANCELLED, 200),
    (Wire.MODERN, errors.UNSUPPORTED_PROTOCOL_VERSION, 400), (Wire.MODERN, -32021, 400),
    (Wire.LEGACY, errors.INVALID_REQUEST, 400),
    (Wire.MODERN, errors.INTERNAL_ERROR, 200),
])
def test_dispatch_status(wire: Wire, code: int, status: int) -> None:
    assert dispatch_status(wire, code) == status


def test_shape_result() -> None:
    info = {"name": "s", "version": "1"}
    r = {"content": [], "isError": False}
    assert shape_result(Wire.LEGACY, "tools/call", r, server_info=info, ttl_ms=5,
                        cache_scope="public") is r
    out = shape_result(Wire.MODERN, "tools/call", r, server_info=info, ttl_ms=5,
                       cache_scope="public")
    assert out["resultType"] == "complete" and "ttlMs" not in out
    assert out["_meta"] == {SERVER_INFO_META_KEY: info}
    assert r == {"content": [], "isError": False}  # input untouched
    for method in ("tools/list", "server/discover"):
        out = shape_result(Wire.MODERN, method, {"tools": [], "_meta": {"k": 1}},
                           server_info=info, ttl_ms=5, cache_scope="public")
        assert (out["ttlMs"], out["cacheScope"], out["resultType"]) == (5, "public", "complete")
        assert out["_meta"] == {"k": 1, SERVER_INFO_META_KEY: info}


# ------------------------------------------------------------------------------ Mcp-Param-*

REGION_SCHEMA = {"type": "object", "properties": {
    "region": {"type": "string", "x-mcp-header": "Region"},
    "n": {"type": "integer", "x-mcp-header": "N"},
    "flag": {"type": "boolean", "x-mcp-header": "Flag"},
    "nested": {"type": "object", "properties": {"deep": {"type": "string",
                                                         "x-mcp-header": "Deep"}}},
    "query": {"type": "string"},
}}


def test_param_headers_are_collected() -> None:
    specs = {s.token: (s.path, s.type) for s in param_headers(REGION_SCHEMA)}
    assert specs == {"Region": (("region",), "string"), "N": (("n",), "integer"),
                     "Flag": (("flag",), "boolean"), "Deep": (("nested", "deep"), "string")}
    assert param_headers({"type": "object"}) == ()


@pytest.mark.parametrize("schema", [
    {"type": "object", "x-mcp-header": "Root"},
    {"type": "object", "properties": {"a": {"type": "number", "x-mcp-header": "A"}}},
    {"type": "object", "properties": {"a": {"type": "string", "x-mcp-header": "A B"}}},
    {"type": "object", "properties": {"a": {"type": "string", "x-mcp-header": ""}}},
    {"type": "object", "properties": {"a": {"type": "string", "x-mcp-header": 5}}},
    {"type": "object", "properties": {"a": {"type": "string", "x-mcp-header": "A"},
                                      "b": {"type": "string", "x-mcp-header": "a"}}},
    {"type": "object", "properties": {"a": {"type": "array", "items": {
        "type": "string", "x-mcp-header": "A"}}}},
    {"type": "object", "anyOf": [{"properties": {"a": {"type": "string", "x-mcp-header": "A"}}}]},
])
def test_invalid_param_header_annotations(schema: dict) -> None:
    with pytest.raises(ValueError):
        param_headers(schema)


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"zone": {"type": "string", "x-mcp-header": "Zone_Id"}}},
    # case-insensitively unique for MCP, one environ key (HTTP_MCP_PARAM_ZONE_ID) for WSGI
    {"type": "object", "properties": {"a": {"type": "string", "x-mcp-header": "Zone-Id"},
                                      "b": {"type": "string", "x-mcp-header": "zone_id"}}},
])
def test_a_param_header_token_with_an_underscore_is_refused_at_registration(schema: dict) -> None:
    """``_`` is a tchar, but a WSGI app cannot read ``Mcp-Param-Zone_Id``: PEP 3333 names it
    like ``Mcp-Param-Zone-Id`` and gunicorn (default ``header_map="drop"``) drops it, so a
    correct client's every call mirroring it got 400 ``-32020`` ("Mcp-Param-Zone_Id is
    missing"). The server refuses such a tool when it is registered, as it does invalid ones."""
    with pytest.raises(ValueError, match="underscore"):
        param_headers(schema)
    server = McpServer("t", "1", registry="unused")
    with pytest.raises(ValueError, match="underscore"):
        server.add_tool(lambda conn, params: "", "zone", input_schema=schema)
    assert "zone" not in server.tools


def env(**h: str) -> dict[str, str]:
    return {"HTTP_MCP_PARAM_" + k.upper(): v for k, v in h.items()}


@pytest.mark.parametrize("args, headers, ok", [
    ({"query": "q"}, {}, True),
    ({"region": "us-west1"}, {"Region": "us-west1"}, True),
    ({"region": "Hello, 世界"}, {"Region": "=?base64?SGVsbG8sIOS4lueVjA==?="}, True),
    ({"region": None}, {}, True),
    ({"n": 42}, {"N": "42"}, True), ({"n": 42}, {"N": "42.0"}, True),
    ({"n": 42.0}, {"N": "42"}, True), ({"n": 42}, {"N": "42.5"}, False),
    ({"n": 42}, {"N": "4.2e1"}, False),
    ({"flag": True}, {"Flag": "true"}, True), ({"flag": False}, {"Flag": "True"}, False),
    ({"nested": {"deep": "x"}}, {"Deep": "x"}, True),
    ({"nested": "notanobject"}, {}, True),
    ({"region": "us-west1"}, {}, False),
    ({"region": "us-west1"}, {"Region": "eu-west1"}, False),
    ({}, {"Region": "us-west1"}, False),
    ({"region": ["a"]}, {"Region": "a"}, False),
    ({"region": "x"}, {"Region": "=?base64?!?="}, False),
])
def test_validate_param_headers(args: dict, headers: dict, ok: bool) -> None:
    specs = param_headers(REGION_SCHEMA)
    if ok:
        validate_param_headers(specs, args, env(**headers), 3)
    else:
        with pytest.raises(RpcError) as ei:
            validate_param_headers(specs, args, env(**headers), 3)
        assert (ei.value.code, ei.value.status, ei.value.id) == (errors.HEADER_MISMATCH, 400, 3)
