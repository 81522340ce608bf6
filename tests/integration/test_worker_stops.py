"""Requests in flight in a ``sync`` worker that gunicorn itself stops (contract §5): the worker
timeout (``SIGABRT``), a quick shutdown (``SIGINT``/``SIGQUIT`` to the master, forwarded to the
workers as ``SIGQUIT``). gunicorn's handlers raise ``SystemExit`` in the request; escaping the
app it became gunicorn's HTML ``500 Internal Server Error`` (and a traceback in the log), which
an MCP client takes for a transport failure. A request that was read gets HTTP 200 carrying its
JSON-RPC response; one the server did not get to serve, 503 with ``Retry-After``.

Real gunicorn on loopback (the example's config serving tests/apps/hooks_app.py), real signals.
Waits poll with deadlines.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from helpers.gunicorn_harness import Gunicorn, alive, wait_until
from helpers.mcp_client import ACCEPT, LEGACY, MODERN, dump, meta
from helpers.procs import waits_for_the_lock

from shmcancel.errors import INTERNAL_ERROR

pytestmark = pytest.mark.integration

CONF = "examples/gunicorn/gunicorn.conf.py"
APP = "tests.apps.hooks_app:app"


def send_call(port: int, rid: int, seconds: float, *, modern: bool,
              session: str | None = None) -> socket.socket:
    """Open a connection and send one ``sleep`` call; the socket is the client."""
    params: dict[str, Any] = {"name": "sleep", "arguments": {"seconds": seconds}}
    headers = ["Host: 127.0.0.1", "Content-Type: application/json", f"Accept: {ACCEPT}"]
    if modern:
        params["_meta"] = meta("stops")
        headers += [f"MCP-Protocol-Version: {MODERN}", "Mcp-Method: tools/call",
                    "Mcp-Name: sleep"]
    else:
        headers += [f"MCP-Protocol-Version: {LEGACY}", f"Mcp-Session-Id: {session}"]
    body = json.dumps({"jsonrpc": "2.0", "id": rid, "method": "tools/call",
                       "params": params}).encode()
    headers.append(f"Content-Length: {len(body)}")
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(("POST /mcp HTTP/1.1\r\n" + "\r\n".join(headers) + "\r\n\r\n").encode() + body)
    return s


def read_response(s: socket.socket) -> tuple[bytes, bytes]:
    """The whole HTTP response (the sync worker closes after it): ``(head, body)``."""
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return head, body


def open_session(url: str) -> str:
    h = {"Accept": ACCEPT, "Content-Type": "application/json"}
    r = httpx.post(url, headers=h, timeout=10, json={
        "jsonrpc": "2.0", "id": 0, "method": "initialize",
        "params": {"protocolVersion": LEGACY, "capabilities": {},
                   "clientInfo": {"name": "stops", "version": "0"}}})
    assert r.status_code == 200, r.text
    sid = r.headers["mcp-session-id"]
    r = httpx.post(url, headers={**h, "Mcp-Session-Id": sid, "MCP-Protocol-Version": LEGACY},
                   json={"jsonrpc": "2.0", "method": "notifications/initialized"}, timeout=10)
    assert r.status_code == 202, r.text
    return sid


def in_flight_pids(name: str) -> list[int]:
    return [r["pid"] for r in dump(name)["in_flight"]]


def assert_json_rpc_error(head: bytes, body: bytes, rid: int, log: str) -> None:
    assert head.startswith(b"HTTP/1.1 200"), (head, body, log)
    reply = json.loads(body)
    assert reply["id"] == rid, reply
    assert reply["error"]["code"] == INTERNAL_ERROR, reply


@pytest.mark.parametrize("modern", [False, True], ids=["legacy", "modern"])
@pytest.mark.parametrize("how", ["worker-timeout", "quick-shutdown"])
def test_a_call_gunicorn_stops_is_answered_json_rpc_not_html_500(shm_name: str, how: str,
                                                                   modern: bool) -> None:
    """The worker timeout aborts the worker running the call; a quick shutdown quits every
    worker. Either way the call was read: HTTP 200 with a JSON-RPC error, its rows gone."""
    extra = ["--timeout", "2"] if how == "worker-timeout" else []
    with Gunicorn(APP, registry_name=shm_name, config=CONF, workers=2, extra_args=extra) as g:
        sid = None if modern else open_session(g.url)
        s = send_call(g.port, 7, 30, modern=modern, session=sid)
        with s:
            pid = wait_until(lambda: (p := in_flight_pids(shm_name)) and p[0],
                             time.monotonic() + 10, what="the call to be in flight")
            if how == "quick-shutdown":
                g.signal(signal.SIGINT)
            head, body = read_response(s)
        log = g.log()
        if how == "worker-timeout":
            assert f"WORKER TIMEOUT (pid:{pid})" in log, g.log_tail()
            wait_until(lambda: not in_flight_pids(shm_name), time.monotonic() + 10,
                       what="the call's rows to go")
        assert_json_rpc_error(head, body, 7, g.log_tail())
        assert "Error handling request" not in log, g.log_tail()
        if how == "quick-shutdown":
            wait_until(lambda: not alive(g.pid), time.monotonic() + 20,
                       what="the master to exit")
            assert not os.path.exists(f"/dev/shm/shmcancel.{shm_name}"), "on_exit unlinks"


_HOLDER = """
import os, sys, time
import shmcancel
from shmcancel.shm.registry import Registry
reg = Registry.attach(sys.argv[1])
reg.lock.__enter__()
print("held", flush=True)
time.sleep(120)
"""

@pytest.fixture
def stopped_holder(shm_name: str) -> Iterator[Callable[[], subprocess.Popen[str]]]:
    """Another process of the user holding registry ``shm_name``'s lock, stopped; killed
    afterwards."""
    holder: list[subprocess.Popen[str]] = []

    def start() -> subprocess.Popen[str]:
        p = subprocess.Popen([sys.executable, "-c", _HOLDER, shm_name], stdout=subprocess.PIPE,
                             text=True)
        holder.append(p)
        assert p.stdout is not None and p.stdout.readline().strip() == "held"
        os.kill(p.pid, signal.SIGSTOP)
        return p

    try:
        yield start
    finally:
        for p in holder:
            p.kill()
            p.wait(timeout=10)


def test_a_request_waiting_for_the_lock_when_its_worker_quits_is_503(
        shm_name: str, stopped_holder: Callable[[], Any]) -> None:
    """An ``initialize`` waits for the registry lock (held by a stopped process) when its
    worker is told to quit: it was not served, so 503 with ``Retry-After`` (a retry is safe),
    never gunicorn's HTML 500."""
    with Gunicorn(APP, registry_name=shm_name, config=CONF, workers=1) as g:
        stopped_holder()
        worker = g.worker_pids()[0]
        out: dict[str, Any] = {}

        def initialize() -> None:
            try:
                out["r"] = httpx.post(g.url, headers={"Accept": ACCEPT}, timeout=30, json={
                    "jsonrpc": "2.0", "id": 1, "method": "initialize",
                    "params": {"protocolVersion": LEGACY, "capabilities": {},
                               "clientInfo": {"name": "stops", "version": "0"}}})
            except Exception as e:  # the test reports it
                out["e"] = e

        t = threading.Thread(target=initialize, daemon=True)
        t.start()
        wait_until(lambda: waits_for_the_lock(worker), time.monotonic() + 10,
                   what="the worker to wait for the lock")
        os.kill(worker, signal.SIGQUIT)  # what a quick shutdown sends every worker
        t.join(30)
        r = out.get("r")
        assert r is not None, out
        assert r.status_code == 503 and r.headers.get("retry-after"), (r.status_code, r.text)
        assert r.json()["error"]["code"] == -32000, r.text
        assert "Error handling request" not in g.log(), g.log_tail()
        wait_until(lambda: not alive(worker), time.monotonic() + 10, what="the worker to exit")


@pytest.mark.parametrize("streamed", [False, True], ids=["json", "sse"])
def test_a_call_whose_tool_ran_keeps_its_answer_when_its_worker_quits_at_its_end(
        shm_name: str, stopped_holder: Callable[[], Any], tmp_path: Any, streamed: bool) -> None:
    """A session's ``tools/call`` whose tool has returned, waiting at its end for the registry
    lock (the session's touch is due; a stopped process holds the lock) when its worker is told
    to quit. The tool ran, so its answer stands: it was answered 503 "retry is safe" (a retry
    runs the tool again), and on an SSE stream already open ``start_response`` was called a
    second time (gunicorn's "Error handling request" traceback, the stream cut)."""
    env = {"SHMCANCEL_TEST_DIR": str(tmp_path)}
    with Gunicorn("tests.apps.transport_app:app", registry_name=shm_name,
                  config="tests/apps/transport_conf.py", workers=1, env=env) as g:
        sid = open_session(g.url)
        worker = g.worker_pids()[0]
        out: dict[str, Any] = {}
        params: dict[str, Any] = {"name": "nap", "arguments": {
            "seconds": 1.2, "tag": "ended", "progress": streamed}}  # > the touch interval
        if streamed:
            params["_meta"] = {"progressToken": "p"}

        def call() -> None:
            try:
                out["r"] = httpx.post(g.url, timeout=30, headers={
                    "Accept": ACCEPT, "Mcp-Session-Id": sid, "MCP-Protocol-Version": LEGACY},
                    json={"jsonrpc": "2.0", "id": 5, "method": "tools/call", "params": params})
            except Exception as e:  # the test reports it
                out["e"] = e

        t = threading.Thread(target=call, daemon=True)
        t.start()
        wait_until(lambda: (tmp_path / "ended.started").exists(), time.monotonic() + 10,
                   what="the tool to start")
        stopped_holder()  # the tool needs no lock; its end (the session's touch) does
        wait_until(lambda: waits_for_the_lock(worker), time.monotonic() + 10,
                   what="the call's end to wait for the lock")
        os.kill(worker, signal.SIGQUIT)  # what a quick shutdown sends every worker
        t.join(30)
        r = out.get("r")
        assert "Error handling request" not in g.log(), g.log_tail()
        assert r is not None, out
        assert r.status_code == 200, (r.status_code, r.text)
        if streamed:
            events = [json.loads(line[5:]) for line in r.text.splitlines()
                      if line.startswith("data:")]
            reply = events[-1]
        else:
            reply = r.json()
        assert reply["id"] == 5 and reply["result"]["content"][0]["text"] == "napped 1.2s", reply
        wait_until(lambda: not alive(worker), time.monotonic() + 10, what="the worker to exit")


def _waits_to_send(pid: int) -> bool:
    """Whether process ``pid``'s main thread waits for room in a socket's send buffer (the
    kernel's wait there, by its two names)."""
    try:
        with open(f"/proc/{pid}/wchan") as f:
            return f.read().strip() in ("sk_stream_wait_memory", "wait_woken")
    except OSError:
        return False


def test_a_quit_while_a_streamed_answer_is_written_cuts_the_stream_without_a_second_start(
        shm_name: str, tmp_path: Any) -> None:
    """A call whose progress opened an SSE stream, its large answer being written to a client
    that does not read, when its worker is told to quit: the stream can only be cut (the
    status line is out). It was, but by way of a second ``start_response`` for a 503 (gunicorn's
    "Response headers already set!" traceback in the log) instead of ending the connection."""
    env = {"SHMCANCEL_TEST_DIR": str(tmp_path)}
    with Gunicorn("tests.apps.transport_app:app", registry_name=shm_name,
                  config="tests/apps/transport_conf.py", workers=1, env=env) as g:
        worker = g.worker_pids()[0]
        body = json.dumps({"jsonrpc": "2.0", "id": 9, "method": "tools/call", "params": {
            "name": "nap", "_meta": {"progressToken": "p"},
            "arguments": {"seconds": 0, "progress": True, "pad": 16 << 20}}}).encode()
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
        s.settimeout(30)
        with s:
            s.connect(("127.0.0.1", g.port))
            s.sendall(b"POST /stateless HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                      b"Content-Type: application/json\r\n"
                      + f"Accept: {ACCEPT}\r\nMCP-Protocol-Version: {LEGACY}\r\n".encode()
                      + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            assert s.recv(1024).startswith(b"HTTP/1.1 200")
            wait_until(lambda: _waits_to_send(worker), time.monotonic() + 20,
                       what="the worker to wait to write the answer")
            os.kill(worker, signal.SIGQUIT)  # what a quick shutdown sends every worker
            while s.recv(1 << 20):  # the rest, up to the connection's end
                pass
        wait_until(lambda: not alive(worker), time.monotonic() + 10, what="the worker to exit")
        assert "Error handling request" not in g.log(), g.log_tail()
