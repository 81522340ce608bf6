"""``shmcancel.sdk`` (contract §9) at the edges of the two wires, against the example server
(examples/sdk, stateful, three uvicorn workers), through real HTTP on loopback.

The 2026-07-28 wire has no sessions: the SDK routes such a request before any session lookup and
ignores an ``Mcp-Session-Id`` it carries (contract §6.2: "an Mcp-Session-Id is ignored"). The
session routing must do the same: a stale or foreign session id on that wire is neither a 404
nor a reason to forward the request to another worker (where the forwarding worker, which sees
no response head before a JSON answer is complete, would not notice its client leave, and the
call would not be cancelled).
"""

from __future__ import annotations

import json
import shutil
import socket
import tempfile
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest
from helpers.gunicorn_harness import Gunicorn
from helpers.mcp_client import open_session
from helpers.names import unlink_registry_names
from helpers.rows import in_flight_rows

from shmcancel import Registry

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

CONF = "examples/sdk/gunicorn.conf.py"
STOPPED_WITHIN = 2.0  # seconds from the client's leaving to the call's row going
LEGACY = {"content-type": "application/json", "accept": "application/json, text/event-stream",
          "mcp-protocol-version": "2025-11-25"}
META = {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
        "io.modelcontextprotocol/clientInfo": {"name": "audit", "version": "1"},
        "io.modelcontextprotocol/clientCapabilities": {}}


def _modern_headers(tool: str) -> dict[str, str]:
    return {"content-type": "application/json", "accept": "application/json, text/event-stream",
            "mcp-protocol-version": "2026-07-28", "mcp-method": "tools/call", "mcp-name": tool}


def _modern_call(rid: int, tool: str, args: dict) -> dict:
    return {"jsonrpc": "2.0", "id": rid, "method": "tools/call",
            "params": {"name": tool, "arguments": args, "_meta": META}}


@pytest.fixture(scope="module")
def stateful() -> Iterator[tuple[Gunicorn, Registry]]:
    name = f"sdkwire-{uuid.uuid4().hex[:10]}"
    sockets = tempfile.mkdtemp(prefix="sdkwire-")
    try:
        with Gunicorn(None, registry_name=name, config=CONF, workers=3,
                      worker_class="uvicorn_worker.UvicornWorker",
                      env={"SHMCANCEL_SDK_STATELESS": "0",
                           "SHMCANCEL_SDK_SOCKET_DIR": sockets}) as g, \
                Registry.attach(name, readonly=True) as reg:
            yield g, reg
    finally:
        unlink_registry_names(name)
        shutil.rmtree(sockets, ignore_errors=True)


def _rows(reg: Registry) -> list[tuple[str, str]]:
    return [k for k, _ in in_flight_rows(reg)]


def _wait(pred, within: float) -> bool:
    end = time.monotonic() + within
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.005)
    return bool(pred())


def _worker_tokens(g: Gunicorn) -> set[str]:
    """The tokens of the live workers, read from the session ids they mint (fresh connections,
    until every worker has answered one)."""
    tokens: set[str] = set()
    init = {"jsonrpc": "2.0", "id": 0, "method": "initialize",
            "params": {"protocolVersion": "2025-11-25", "capabilities": {},
                       "clientInfo": {"name": "audit", "version": "0"}}}
    for _ in range(60):
        with httpx.Client(timeout=10) as h:
            r = h.post(g.url, headers=LEGACY, json=init)
            assert r.status_code == 200, r.text
            tokens.add(r.headers["mcp-session-id"].split("-", 1)[0])
        if len(tokens) >= 3:
            break
    assert len(tokens) >= 2, tokens
    return tokens


def test_modern_wire_ignores_a_stale_session_id(stateful):
    """A 2026-07-28 request whose ``Mcp-Session-Id`` names a worker that is gone is served (the
    SDK ignores the header on that wire), never a 404."""
    g, _reg = stateful
    body = _modern_call(1, "echo", {"text": "hi"})
    for sid in ("1x000000000000-abc", "garbage"):
        for _ in range(3):  # any worker
            with httpx.Client(timeout=10) as h:
                r = h.post(g.url, headers=dict(_modern_headers("echo"), **{"mcp-session-id": sid}),
                           json=body)
            assert r.status_code == 200, (sid, r.status_code, r.text)
            assert r.json()["result"]["content"][0]["text"] == "hi", r.text


@pytest.mark.parametrize("tool", ["sleep", "sleep_sync"])
def test_modern_wire_disconnect_cancels_with_any_session_header(stateful, tool):
    """A 2026-07-28 call whose client sends some worker's session id and then closes its
    connection (before any response byte: JSON responses) is cancelled, whichever worker
    accepted it (contract §9)."""
    g, reg = stateful
    tokens = sorted(_worker_tokens(g))
    body = json.dumps(_modern_call(7, tool, {"seconds": 6})).encode()
    slow: list[str] = []
    for token in tokens:
        for _ in range(2):
            assert _wait(lambda: not _rows(reg), 10), _rows(reg)
            hdrs = dict(_modern_headers(tool), **{"mcp-session-id": f"{token}-whatever"})
            head = "".join(f"{k}: {v}\r\n" for k, v in hdrs.items())
            s = socket.create_connection(("127.0.0.1", g.port))
            try:
                s.sendall(f"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1:{g.port}\r\n"
                          f"Content-Length: {len(body)}\r\n{head}\r\n".encode() + body)
                assert _wait(lambda: _rows(reg), 10), "the call never started"
            finally:
                s.close()
            if not _wait(lambda: not _rows(reg), STOPPED_WITHIN):
                slow.append(token)
    assert slow == [], f"calls not cancelled on disconnect (session tokens {slow})"


def _session(g: Gunicorn) -> dict[str, str]:
    return open_session(g.url, LEGACY)


OTHER_WORKER = "another live worker's token"  # for _refused_while_a_call_runs(token=...)


def _refused_while_a_call_runs(stateful, rid: int, note: bytes,
                               content_type: str | None = None,
                               token: str | None = None, tries: int = 1) -> httpx.Response:
    """Run ``sleep`` (1.5 s) as call ``rid`` of a new session; once it is in flight, POST the
    cancel ``note`` in that session (with ``content_type`` when given; ``token``: its session
    id with that worker token instead of its own; ``tries`` times, each on a new connection,
    so on whichever worker accepts it). Returns the cancel's reply (each reply the same
    status), having checked that the call was not cancelled (it slept its 1.5 s)."""
    import threading

    g, reg = stateful
    assert _wait(lambda: not _rows(reg), 10), _rows(reg)
    hdrs = _session(g)
    scope = "session:" + hdrs["mcp-session-id"].split("-", 1)[1]
    answer: list[httpx.Response] = []

    def call() -> None:
        with httpx.Client(timeout=20) as h:
            answer.append(h.post(g.url, headers=hdrs, json={
                "jsonrpc": "2.0", "id": rid, "method": "tools/call",
                "params": {"name": "sleep", "arguments": {"seconds": 1.5}}}))

    t = threading.Thread(target=call)
    t.start()
    try:
        assert _wait(lambda: (scope, str(rid)) in _rows(reg), 10), _rows(reg)
        sent = dict(hdrs)
        if content_type is not None:
            sent["content-type"] = content_type
        if token is not None:
            own, sdk_id = hdrs["mcp-session-id"].split("-", 1)
            if token == OTHER_WORKER:
                token = sorted(_worker_tokens(g) - {own})[0]
            sent["mcp-session-id"] = token + "-" + sdk_id
        replies = []
        for _ in range(tries):
            with httpx.Client(timeout=10) as h:
                replies.append(h.post(g.url, content=note, headers=sent))
    finally:
        t.join(20)
    assert answer and "slept 1.5 s" in answer[0].text, answer and answer[0].text
    assert len({r.status_code for r in replies}) == 1, [(r.status_code, r.text) for r in replies]
    return replies[-1]


def test_a_cancel_the_sdk_cannot_parse_is_its_400_and_cancels_nothing(stateful):
    """A ``notifications/cancelled`` body that the SDK's JSON parser refuses (a lone surrogate
    escape: 400 ``-32700`` from the SDK when no call of that id runs) is refused the same way
    while a call of that id runs: shmcancel parses it with the SDK's parser, so it neither
    answers 202 nor cancels the call (the SDK's own checks still apply, contract §9, §5)."""
    r = _refused_while_a_call_runs(stateful, 7, (
        b'{"jsonrpc":"2.0","method":"notifications/cancelled",'
        b'"params":{"requestId":7,"reason":"a\\ud800b"}}'))
    assert r.status_code == 400 and "-32700" in r.text, (r.status_code, r.text)


@pytest.mark.parametrize("content_type", ["application/jsonx", "Application/JSON"])
def test_a_cancel_with_a_content_type_the_sdk_refuses_is_its_415(stateful, content_type):
    """The SDK's transport takes a POST only with the media type ``application/json`` itself
    (its Content-Type check after the Origin/Host one, which looks at the prefix only): any
    other is its 415. A ``notifications/cancelled`` with such a type is refused the same way
    while a call of that id runs: it neither answers 202 nor cancels the call (the SDK's own
    checks still apply, contract §9, §5)."""
    note = {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 8}}
    r = _refused_while_a_call_runs(stateful, 8, json.dumps(note).encode(), content_type)
    assert r.status_code == 415, (r.status_code, r.text)


def test_a_cancel_in_a_session_id_naming_no_worker_is_a_404_and_cancels_nothing(stateful):
    """A session id whose worker token names no worker (never issued: forged, or of a worker
    long gone) is an unknown session: 404 for every request, contract §5 and §9 ("session
    existence" still applies). A ``notifications/cancelled`` carrying one was answered 202 from
    the registry, and cancelled the call of the session whose SDK id it carried."""
    note = {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 9}}
    r = _refused_while_a_call_runs(stateful, 9, json.dumps(note).encode(),
                                   token="ffffffffx000000000000")
    assert r.status_code == 404, (r.status_code, r.text)


def test_a_cancel_pairing_another_workers_token_with_the_sdk_id_is_a_404(stateful):
    """A session id made of a live worker's token and the SDK id of a session another worker
    holds names no session (a reviewer's forgery): every request with it is 404, and so is a
    ``notifications/cancelled``, whichever worker accepts it. It was 202, cancelling the
    call, when a worker other than the token's accepted it."""
    note = {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 11}}
    r = _refused_while_a_call_runs(stateful, 11, json.dumps(note).encode(),
                                   token=OTHER_WORKER, tries=8)
    assert r.status_code == 404, (r.status_code, r.text)
