"""Races in stopping a tool whose client left (contract §6.3, mcp/stop.py) against a real gunicorn:
trace hooks in the worker's app (tests/apps/stop_race_app.py) pin each thread to the point the
race needs; no sleeps order anything. Waits poll with deadlines."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.gunicorn_harness import Gunicorn, alive, wait_until
from helpers.mcp_client import tag, wait_file

pytestmark = pytest.mark.integration

CONF = "tests/apps/transport_conf.py"
GRACE = 0.5  # stream_cancel_timeout


def send_call(port: int, tool: str, args: dict[str, Any], *,
              meta: dict[str, Any] | None = None) -> socket.socket:
    """Open a connection and send one ``tools/call`` to ``/stateless``; the socket is the
    client."""
    params: dict[str, Any] = {"name": tool, "arguments": args}
    if meta is not None:
        params["_meta"] = meta
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                       "params": params}).encode()
    head = ("POST /stateless HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            "Accept: application/json, text/event-stream\r\nMCP-Protocol-Version: 2025-11-25\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=20)
    s.sendall(head + body)
    return s


def test_a_tool_that_ends_as_the_last_wait_times_out_does_not_lose_its_worker(
        shm_name: str, tmp_path: Path) -> None:
    """``gthread``, ``graceful_timeout`` 0: the tool did not take ``RequestStopped`` (stuck in C),
    so the worker was asked to exit; the stop thread's last ``wait_stopped`` times out just as
    the tool ends and calls ``stop()``. The process must not be ``_exit``-ed under it: its tool
    ended, so the graceful exit it was asked for goes on (code 0), its pool joined."""
    env = {"SHMCANCEL_TEST_DIR": str(tmp_path), "SHMCANCEL_TEST_STREAM_CANCEL_TIMEOUT": str(GRACE)}
    with Gunicorn("tests.apps.stop_race_app:app", registry_name=shm_name, config=CONF, env=env,
                  workers=1, worker_class="gthread", threads=2,
                  extra_args=["--graceful-timeout", "0"]) as g:
        (worker,) = g.worker_pids()
        t = tag()
        s = send_call(g.port, "held", {"tag": t})
        wait_file(f"{tmp_path}/{t}.started", time.monotonic() + 10)
        s.close()
        # grace, RequestStopped's second, graceful_timeout 0 and its second, then the exit
        wait_until(lambda: not alive(worker), time.monotonic() + GRACE + 1 + 1 + 10,
                   what="the worker asked to exit to exit")
        g.wait_workers(1, time.monotonic() + 15)
        log = g.log()
        assert "stop-race: the stop thread's last wait timed out" in log, g.log_tail()
        assert "held caught RequestStopped" in log, g.log_tail()
        assert "stop-race: the stop thread returned" in log, g.log_tail()
        assert "exiting now" not in log, g.log_tail()
        assert f"Worker (pid:{worker}) exited with code" not in log, g.log_tail()
