"""The SDK example's per-server socket directory across gunicorn's worker replacement (``HUP``)
and its stop: sessions keep being forwarded between the new workers, and a stopped server leaves
nothing in the socket directory (its subdirectory is named by the registry: one left per run
was one more empty directory per distinct registry name, forever)."""

from __future__ import annotations

import os
import re
import signal
import time
import uuid
from pathlib import Path

import httpx
import pytest
from helpers.gunicorn_harness import Gunicorn, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

CONF = "examples/sdk/gunicorn.conf.py"
HUPS = 3
HEADERS = {"content-type": "application/json", "accept": "application/json, text/event-stream",
           "mcp-protocol-version": "2025-11-25"}
INIT = {"jsonrpc": "2.0", "id": 0, "method": "initialize",
        "params": {"protocolVersion": "2025-11-25", "capabilities": {},
                   "clientInfo": {"name": "hup", "version": "0"}}}
SOCKET = re.compile(r"^([0-9a-f]{1,8})x[0-9a-f]{12}\.sock$")


def _socket_pids(sockets: Path) -> set[int]:
    """The pids named by the worker sockets under ``sockets`` (every server subdirectory)."""
    if not sockets.exists():
        return set()
    return {int(m.group(1), 16) for d in sockets.iterdir() for f in os.listdir(d)
            if (m := SOCKET.match(f))}


def _sessions_served(url: str, n: int = 6) -> None:
    """``n`` sessions, each on fresh connections (so on any worker), answer a ``tools/list``
    sent on another fresh connection: forwarded to the worker holding the session when it
    lands elsewhere."""
    for i in range(n):
        with httpx.Client(timeout=10) as h:
            r = h.post(url, headers=HEADERS, json=INIT)
            assert r.status_code == 200, r.text
            sid = r.headers["mcp-session-id"]
        with httpx.Client(timeout=10) as h:
            r = h.post(url, headers=dict(HEADERS, **{"mcp-session-id": sid}),
                       json={"jsonrpc": "2.0", "id": i + 1, "method": "tools/list"})
            assert r.status_code == 200, (sid, r.status_code, r.text)
            assert "sleep" in r.text, r.text


def test_hups_keep_the_socket_directory_and_a_stop_removes_it(short_tmp: Path) -> None:
    sockets = short_tmp / "socks"
    name = f"sdkhup-{uuid.uuid4().hex[:10]}"
    with Gunicorn(None, registry_name=name, config=CONF, workers=2,
                  worker_class="uvicorn_worker.UvicornWorker",
                  env={"SHMCANCEL_SDK_STATELESS": "0",
                       "SHMCANCEL_SDK_SOCKET_DIR": str(sockets)}) as g:
        workers = set(g.worker_pids())
        wait_until(lambda: _socket_pids(sockets) == workers, time.monotonic() + 30,
                   what="a socket per worker")
        _sessions_served(g.url)
        for _ in range(HUPS):
            old = workers
            g.signal(signal.SIGHUP)

            def replaced(old: set[int] = old) -> set[int] | None:
                now = set(g.worker_pids())
                return now if len(now) == 2 and not now & old else None

            workers = wait_until(replaced, time.monotonic() + 30, what="the HUP's new workers")
            # the old workers' sockets go (their close), the new ones' come (their bind)
            wait_until(lambda w=workers: _socket_pids(sockets) == w, time.monotonic() + 30,
                       what="a socket per new worker, none of the old")
            _sessions_served(g.url)
            assert len(list(sockets.iterdir())) == 1, list(sockets.iterdir())
    assert list(sockets.iterdir()) == [], list(sockets.rglob("*"))
