"""Disconnect is cancellation (SPEC §6.3) against a real gunicorn, with raw sockets: the client
sends a ``tools/call`` and goes away. Tools report through files (tests/apps/transport_app.py);
``stream_cancel_timeout`` is 0.5 s (tests/apps/transport_conf.py). Waits poll with deadlines."""

from __future__ import annotations

import json
import socket
import struct
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers.gunicorn_harness import Gunicorn, alive, wait_until
from helpers.mcp_client import MODERN, dump, meta, tag, wait_file

pytestmark = pytest.mark.integration

APP = "tests.apps.transport_app:app"
CONF = "tests/apps/transport_conf.py"
GRACE = 0.5  # stream_cancel_timeout of the test config
META = meta("t")
DETECT_BOUND = 0.100  # seconds from the close to the tool seeing cancelled(conn)


@pytest.fixture(scope="module")
def outdir() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="shmcancel-disc-") as d:
        yield d


def start(name: str, outdir: str, **kw: Any) -> Gunicorn:
    env = {"SHMCANCEL_TEST_DIR": outdir, "SHMCANCEL_TEST_STREAM_CANCEL_TIMEOUT": str(GRACE)}
    return Gunicorn(APP, registry_name=name, config=CONF, env=env, **kw)


@pytest.fixture(scope="module")
def server(module_shm_name: str, outdir: str) -> Iterator[Gunicorn]:
    with start(module_shm_name, outdir, workers=3, worker_class="sync") as g:
        yield g


def send_call(port: int, tool: str, args: dict, *, id: Any = 1, path: str = "/stateless",
              modern: bool = False, extra: bytes = b"") -> socket.socket:
    """Open a connection and send one complete ``tools/call``; the socket is the client."""
    params: dict[str, Any] = {"name": tool, "arguments": args}
    headers = [b"Host: 127.0.0.1", b"Content-Type: application/json",
               b"Accept: application/json, text/event-stream"]
    if modern:
        params["_meta"] = META
        headers += [f"MCP-Protocol-Version: {MODERN}".encode(), b"Mcp-Method: tools/call",
                    f"Mcp-Name: {tool}".encode()]
    else:
        headers.append(b"MCP-Protocol-Version: 2025-11-25")
    body = json.dumps({"jsonrpc": "2.0", "id": id, "method": "tools/call",
                       "params": params}).encode()
    headers.append(f"Content-Length: {len(body)}".encode())
    s = socket.create_connection(("127.0.0.1", port), timeout=20)
    s.sendall(f"POST {path} HTTP/1.1\r\n".encode() + b"\r\n".join(headers) + b"\r\n\r\n"
              + body + extra)
    return s


def read_reply(s: socket.socket) -> dict[str, Any]:
    """Read a whole HTTP response (the sync worker closes after it) and return its JSON-RPC."""
    data = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    if b"chunked" in head.lower():
        out, rest = b"", body
        while rest:
            size, _, rest = rest.partition(b"\r\n")
            n = int(size, 16)
            if n == 0:
                break
            out, rest = out + rest[:n], rest[n + 2:]
        body = out
    return json.loads(body)


def in_flight(name: str) -> list[dict[str, Any]]:
    return dump(name)["in_flight"]


def whoami(g: Gunicorn, path: str = "/stateless") -> int:
    r = httpx.post(f"http://127.0.0.1:{g.port}{path}", timeout=10,
                   json={"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                         "params": {"name": "whoami", "arguments": {}}},
                   headers={"MCP-Protocol-Version": "2025-11-25",
                            "Accept": "application/json, text/event-stream"})
    return int(r.json()["result"]["content"][0]["text"])


def close_abruptly(s: socket.socket) -> None:
    """Close with a reset (SO_LINGER 0) rather than a FIN."""
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


# ------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("how", ["fin", "reset"])
def test_close_cancels_the_running_tool(server: Gunicorn, outdir: str, how: str) -> None:
    t = tag()
    s = send_call(server.port, "sleep", {"seconds": 10, "tag": t})
    wait_file(f"{outdir}/{t}.started", time.monotonic() + 10)
    closed = time.monotonic()
    if how == "fin":
        s.close()
    else:
        close_abruptly(s)
    seen = float(wait_file(f"{outdir}/{t}.cancelled", closed + 5))
    print(f"\n[disconnect/{how}] tool saw cancelled(conn) {(seen - closed) * 1000:.1f} ms "
          "after the close")
    assert seen - closed < DETECT_BOUND
    wait_until(lambda: in_flight(server.registry_name) == [], closed + GRACE + 1,
               what="the in-flight row to go")


def test_stubborn_tool_is_stopped_and_the_worker_replaced(server: Gunicorn, outdir: str) -> None:
    before = set(server.worker_pids())
    t = tag()
    s = send_call(server.port, "stubborn", {"seconds": 20, "tag": t})
    pid = int(wait_file(f"{outdir}/{t}.started", time.monotonic() + 10))
    closed = time.monotonic()
    s.close()
    wait_file(f"{outdir}/{t}.cancelled", closed + 1)  # it saw the cancellation, ignored it
    wait_until(lambda: in_flight(server.registry_name) == [], closed + GRACE + 1,
               what="the in-flight row to go")
    wait_until(lambda: not alive(pid), closed + GRACE + 3, what="the stuck worker to exit")
    workers = server.wait_workers(3, time.monotonic() + 15)
    assert pid not in workers and set(workers) - before
    # and the replacement serves
    assert whoami(server) in workers
    assert in_flight(server.registry_name) == []
    assert not Path(f"{outdir}/{t}.finished").exists()
    assert "the worker exits" in server.log()
    print("\n" + server.log_tail(15))


def test_disconnect_cancels_only_that_anonymous_client(server: Gunicorn, outdir: str) -> None:
    """Two anonymous clients behind one address share the ``ip:`` scope and both run id 1: one
    leaves, the other's call completes normally."""
    leaver, stayer = tag(), tag()
    s1 = send_call(server.port, "sleep", {"seconds": 10, "tag": leaver}, id=1)
    s2 = send_call(server.port, "sleep", {"seconds": 1.0, "tag": stayer}, id=1)
    try:
        deadline = time.monotonic() + 10
        wait_file(f"{outdir}/{leaver}.started", deadline)
        wait_file(f"{outdir}/{stayer}.started", deadline)
        s1.close()
        wait_file(f"{outdir}/{leaver}.cancelled", time.monotonic() + 2)
        reply = read_reply(s2)
        assert reply["result"]["content"][0]["text"] == "slept 1s", reply
        assert not Path(f"{outdir}/{stayer}.cancelled").exists()
    finally:
        s2.close()


def test_pipelined_request_is_not_a_disconnect(server: Gunicorn, outdir: str) -> None:
    t = tag()
    s = send_call(server.port, "sleep", {"seconds": 0.5, "tag": t},
                  extra=b"POST /stateless HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    try:
        reply = read_reply(s)
        assert reply["result"]["content"][0]["text"] == "slept 0.5s", reply
        assert not Path(f"{outdir}/{t}.cancelled").exists()
    finally:
        s.close()


def test_modern_close_before_any_byte_cancels(server: Gunicorn, outdir: str) -> None:
    t = tag()
    s = send_call(server.port, "sleep", {"seconds": 10, "tag": t}, path="/mcp", modern=True)
    wait_file(f"{outdir}/{t}.started", time.monotonic() + 10)
    closed = time.monotonic()
    s.close()  # no response byte was sent: the 2026-07-28 way to cancel
    seen = float(wait_file(f"{outdir}/{t}.cancelled", closed + 5))
    assert seen - closed < DETECT_BOUND
    wait_until(lambda: in_flight(server.registry_name) == [], closed + GRACE + 1,
               what="the in-flight row to go")


def test_gthread_stubborn_tool_is_stopped_and_the_worker_keeps_serving(shm_name: str,
                                                                      outdir: str) -> None:
    with start(shm_name, outdir, workers=1, worker_class="gthread", threads=4) as g:
        (worker,) = g.worker_pids()
        t = tag()
        s = send_call(g.port, "stubborn", {"seconds": 20, "tag": t})
        wait_file(f"{outdir}/{t}.started", time.monotonic() + 10)
        closed = time.monotonic()
        s.close()
        wait_file(f"{outdir}/{t}.cancelled", closed + 1)
        wait_until(lambda: in_flight(g.registry_name) == [], closed + GRACE + 1,
                   what="the in-flight row to go")
        # the tool's thread was stopped (it never finished); the same worker serves on
        wait_until(lambda: "stopping its thread" in g.log(), closed + GRACE + 2,
                   what="the stop to be logged")
        assert whoami(g) == worker
        assert g.worker_pids() == [worker]
        assert not Path(f"{outdir}/{t}.finished").exists()
        print("\n" + g.log_tail(15))
