"""JSON-RPC envelope rules (shmcancel.mcp.jsonrpc): decode, classify, reject — a table of cases."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmcancel import errors
from shmcancel.mcp.jsonrpc import (
    Notification,
    Request,
    Response,
    RpcError,
    decode,
    encode,
    error_body,
    parse,
    result_body,
)

# ------------------------------------------------------------------------------ decode

@pytest.mark.parametrize("body", [
    b"", b"{", b"{'a': 1}", b"nul", b"[1,]", b'{"a":NaN}', b'{"a":Infinity}', b'{"a":-Infinity}',
    b"\xff\xfe{}", b'{"a":"\xc3"}', b"\xef\xbb\xbf{}", b"{} {}",
    b"[" * 100_000 + b"]" * 100_000,
    b'{"id":' + b"9" * 5000 + b"}",
])
def test_decode_rejects_non_json_with_parse_error(body: bytes) -> None:
    with pytest.raises(RpcError) as ei:
        decode(body)
    assert ei.value.code == errors.PARSE_ERROR
    assert ei.value.status == 400
    assert ei.value.id is None


def test_decode_accepts_utf8_json() -> None:
    assert decode('{"t":"héllo ✓"}'.encode()) == {"t": "héllo ✓"}


# ------------------------------------------------------------------------------ parse

def req(**kw: object) -> dict[str, object]:
    return {"jsonrpc": "2.0", **kw}


@pytest.mark.parametrize("obj, expected", [
    (req(id=1, method="ping"), Request(1, "ping", None)),
    (req(id="abc", method="tools/list", params={}), Request("abc", "tools/list", {})),
    (req(id=0, method="x", params={"a": 1}, extra=True), Request(0, "x", {"a": 1})),
    (req(id=-5, method="x"), Request(-5, "x", None)),
    (req(id="é" * 128, method="x"), Request("é" * 128, "x", None)),  # 256 bytes: the limit
    (req(id=10**300, method="x"), Request(10**300, "x", None)),  # any int (contract §4.1)
    (req(method="notifications/initialized"), Notification("notifications/initialized", None)),
    (req(method="n", params={"k": []}), Notification("n", {"k": []})),
    (req(id=3, result={}), Response(3)),
    (req(id="x", error={"code": 1, "message": "m"}), Response("x")),
    (req(id=None, error={"code": 1, "message": "m"}), Response(None)),
])
def test_parse_accepts(obj: object, expected: object) -> None:
    assert parse(obj) == expected


# (body, code): each answered 400 with "id": null (contract §5), even where a usable id is there
REJECTED = [
    ([], errors.INVALID_REQUEST),
    ([req(id=1, method="ping")], errors.INVALID_REQUEST),
    ("ping", errors.INVALID_REQUEST),
    (42, errors.INVALID_REQUEST),
    (None, errors.INVALID_REQUEST),
    ({"id": 1, "method": "ping"}, errors.INVALID_REQUEST),
    ({"jsonrpc": "1.0", "id": 1, "method": "ping"}, errors.INVALID_REQUEST),
    ({"jsonrpc": 2.0, "id": "a", "method": "ping"}, errors.INVALID_REQUEST),
    (req(id=1), errors.INVALID_REQUEST),
    (req(id=1, method=5), errors.INVALID_REQUEST),
    (req(id=1, method=None), errors.INVALID_REQUEST),
    (req(id=1, method=["tools/call"]), errors.INVALID_REQUEST),
    (req(id=None, method="ping"), errors.INVALID_REQUEST),
    (req(id=1.5, method="ping"), errors.INVALID_REQUEST),
    (req(id=1.0, method="ping"), errors.INVALID_REQUEST),
    (req(id=True, method="ping"), errors.INVALID_REQUEST),
    (req(id=False, method="ping"), errors.INVALID_REQUEST),
    (req(id={"a": 1}, method="ping"), errors.INVALID_REQUEST),
    (req(id=[1], method="ping"), errors.INVALID_REQUEST),
    (req(method="ping", params=[1, 2]), errors.INVALID_PARAMS),
    (req(method="notifications/cancelled", params=[1]), errors.INVALID_PARAMS),
    (req(method="notifications/cancelled", params="1"), errors.INVALID_PARAMS),
    (req(id=1, result={}, error={}), errors.INVALID_REQUEST),
    (req(result={}), errors.INVALID_REQUEST),
    (req(), errors.INVALID_REQUEST),
]


@pytest.mark.parametrize("rid", ["x" * 257, "é" * 129, "\ud800"])
def test_a_request_whose_string_id_is_past_the_cap_is_answered_for_its_id(rid: str) -> None:
    """A string id of over 256 UTF-8 bytes (or not UTF-8) is a valid JSON-RPC and MCP id:
    the request was read, so its ``-32600`` is for that id with HTTP 200 (SPEC §5; it was 400
    with ``"id": null``, a transport failure for an SDK client), and the id goes back intact."""
    with pytest.raises(RpcError) as ei:
        parse(req(id=rid, method="ping"))
    e = ei.value
    assert (e.code, e.id, e.status) == (errors.INVALID_REQUEST, rid, 200)
    assert "longer than 256 UTF-8 bytes" in e.message
    assert json.loads(encode(e.body()))["id"] == rid


@pytest.mark.parametrize("params", [[1, 2], "x", None, 3, []])
@pytest.mark.parametrize("rid", [1, "a"])
def test_a_request_whose_params_is_not_an_object_is_answered_for_its_id(params: object,
                                                                       rid: object) -> None:
    """A request was read (its id is valid): its -32602 is for that id with HTTP 200, as SPEC §5
    asks of every request the server could read (it was 400 with ``"id": null``)."""
    with pytest.raises(RpcError) as ei:
        parse(req(id=rid, method="tools/list", params=params))
    e = ei.value
    assert (e.code, e.id, e.status) == (errors.INVALID_PARAMS, rid, 200)
    assert e.body()["id"] == rid and "must be an object" in e.message


@pytest.mark.parametrize("obj, code", REJECTED)
def test_parse_rejects(obj: object, code: int) -> None:
    with pytest.raises(RpcError) as ei:
        parse(obj)
    e = ei.value
    assert (e.code, e.id, e.status) == (code, None, 400)
    body = e.body()
    assert body["jsonrpc"] == "2.0" and "id" in body and body["id"] is None
    assert body["error"]["code"] == code and isinstance(body["error"]["message"], str)
    encode(body)  # always serialisable


def test_batch_message_says_batching_is_unsupported() -> None:
    with pytest.raises(RpcError, match=r"[Bb]atch"):
        parse([req(id=1, method="ping")])


@settings(max_examples=300, deadline=None)
@given(st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.sampled_from(["jsonrpc", "id", "method", "params", "result", "error",
                                       "x"]), children, max_size=6),
    max_leaves=20,
))
def test_parse_never_raises_anything_but_rpc_error(obj: object) -> None:
    try:
        msg = parse(obj)
    except RpcError as e:
        assert e.status == 400
        encode(e.body())
    else:
        assert isinstance(msg, Request | Notification | Response)


# ------------------------------------------------------------------------------ replies

def test_reply_bodies_and_encoding() -> None:
    assert json.loads(encode(result_body(7, {"a": "é"}))) == {"jsonrpc": "2.0", "id": 7,
                                                            "result": {"a": "é"}}
    assert error_body(None, -32600, "m") == {"jsonrpc": "2.0", "id": None,
                                            "error": {"code": -32600, "message": "m"}}
    assert error_body("x", -32022, "m", {"supported": []})["error"]["data"] == {"supported": []}
    # a lone surrogate echoed back still yields valid UTF-8 JSON
    out = encode({"t": "\ud800"})
    out.decode("utf-8")
    assert json.loads(out) == {"t": "\ud800"}
    with pytest.raises(ValueError):
        encode({"x": float("nan")})
    with pytest.raises(TypeError):
        encode({"x": {1, 2}})


@pytest.mark.parametrize("lone_surrogate", [False, True])
def test_encode_refuses_nesting_past_the_recursion_limit_with_value_error(
        lone_surrogate: bool) -> None:
    """A value nested past the recursion limit is one JSON cannot carry here: ``ValueError``
    (what callers turn into ``-32603``), not ``RecursionError`` (which became an HTTP 500)."""
    deep: object = "\ud800" if lone_surrogate else "x"
    for _ in range(20_000):
        deep = {"x": [deep]}
    with pytest.raises(ValueError):
        encode(result_body(1, {"deep": deep}))
    assert json.loads(encode({"after": 1})) == {"after": 1}  # the encoder still works
