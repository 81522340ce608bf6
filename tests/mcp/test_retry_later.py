"""The three 503 + ``Retry-After`` answers of ``McpServer.__call__`` (a registry lock timeout,
a session not taken up here, other hosts silent), pinned as they were before they became one
helper (``server._retry_later``): status, message, header, log level, and the log record's
origin (``funcName``/``lineno`` a handler's format may print: the request handler's, not the
helper's)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from helpers.wsgi import environ_for, run

from shmcancel.exceptions import LockTimeout, RemoteUnavailable
from shmcancel.mcp.server import McpServer
from shmcancel.mcp.sessions import SessionsFull

CASES = [
    (LockTimeout("lock held"), logging.WARNING, "1",
     "Service unavailable: the registry is busy; retry later"),
    (SessionsFull("all busy"), logging.INFO, "2",
     "Server busy: the session cannot be taken up here now (all busy)"),
    (RemoteUnavailable("redis silent"), logging.INFO, "1",
     "Service unavailable: the session store of other hosts did not answer; retry later"),
    (RemoteUnavailable("OOM", cause="is full"), logging.INFO, "1",
     "Service unavailable: the session store of other hosts is full; retry later"),
]


@pytest.mark.parametrize(("exc", "level", "retry_after", "message"), CASES,
                         ids=["lock-timeout", "sessions-full", "remote-unavailable",
                              "remote-full"])
def test_a_retry_later_answer_is_what_it_was(monkeypatch: pytest.MonkeyPatch,
                                             caplog: pytest.LogCaptureFixture, exc: Exception,
                                             level: int, retry_after: str, message: str) -> None:
    def handle(self: Any, environ: Any, start_response: Any) -> Any:
        raise exc

    monkeypatch.setattr(McpServer, "_handle", handle)
    monkeypatch.setattr(type(exc), "retry_after", int(retry_after), raising=False)
    with caplog.at_level(logging.DEBUG, logger="shmcancel"):
        reply = run(McpServer("t", "1"), environ_for("POST", b"{}"))
    assert reply.status == 503
    assert reply.headers["retry-after"] == retry_after
    assert reply.json["error"]["message"] == message
    recs = [r for r in caplog.records if r.name.startswith("shmcancel.") and str(exc) in
            r.getMessage()]
    assert len(recs) == 1, caplog.records
    rec = recs[0]
    assert rec.levelno == level
    assert rec.getMessage() == f"POST /mcp: {exc}"
    assert rec.funcName == "__call__", (rec.funcName, rec.lineno)  # where it was logged before


def test_a_request_after_the_servers_registry_was_closed_is_answered_503(
        shm_name: str, caplog: pytest.LogCaptureFixture) -> None:
    """A server given a ``Registry`` object that is then closed in its process (a worker's own
    exit path, an application closing it) answered every later request 500 with a traceback:
    ``RegistryClosed`` is no bug of the server's and not the client's fault. It is answered 503
    with ``Retry-After`` (another worker may serve the retry), and the registry is untouched."""
    import json

    from shmcancel import Registry

    reg = Registry.create(shm_name)
    other = Registry.attach(shm_name)
    try:
        server = McpServer("t", "1", registry=reg)
        init = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize",
                           "params": {"protocolVersion": "2025-11-25", "capabilities": {},
                                      "clientInfo": {"name": "c", "version": "1"}}}).encode()
        assert run(server, environ_for("POST", init)).status == 200
        reg.close()
        with caplog.at_level(logging.ERROR, logger="shmcancel"):
            reply = run(server, environ_for("POST", init))
        assert reply.status == 503
        assert reply.headers["retry-after"] == "1"
        assert "registry is closed" in reply.json["error"]["message"]
        assert not any(r.exc_info for r in caplog.records), "logged as an internal error"
        assert other.tables["sessions"].count() == 1  # the first request's session, none since
        assert other.check() == {}  # consistent
    finally:
        other.close()


def test_a_503_answers_a_request_read_with_its_id(shm_name: str, spawn: Any) -> None:
    """A request whose id was read and that then met a registry lock held past
    ``lock_timeout`` (an ``initialize``: minting a session writes) was answered 503 with
    ``"id": null``, which JSON-RPC keeps for an id that could not be read: its client could not
    match the error to its request. It carries the request's id."""
    import json

    from helpers.stalled_lock import stalled_lock

    from shmcancel import Config, Registry

    reg = Registry.create(shm_name, Config(lock_timeout=0.3))
    try:
        server = McpServer("t", "1", registry=reg)
        init = json.dumps({"jsonrpc": "2.0", "id": "init-7", "method": "initialize",
                           "params": {"protocolVersion": "2025-11-25", "capabilities": {},
                                      "clientInfo": {"name": "c", "version": "1"}}}).encode()
        with stalled_lock(spawn, shm_name):
            reply = run(server, environ_for("POST", init))
        assert reply.status == 503 and reply.headers["retry-after"] == "1"
        assert reply.json["id"] == "init-7"
        assert reply.json["error"]["code"] == -32000
    finally:
        reg.close()
        reg.unlink()
