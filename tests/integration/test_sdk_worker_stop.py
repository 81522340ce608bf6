"""A call still running when its SDK worker stops (gunicorn ``HUP``): its SSE stream ended as the
server's exit began (``sse_starlette`` ends every stream at once) and its session dies with the
worker, so no answer of it can arrive; a sync tool ran on unheard until it ended or gunicorn's
``graceful_timeout`` (30 s) killed the worker, its in-flight row held all the while. It is
stopped at the app's lifespan shutdown: the worker exits at once and no row stays."""

from __future__ import annotations

import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers.gunicorn_harness import Gunicorn, alive, wait_until
from helpers.mcp_client import open_session
from helpers.rows import in_flight_count

from shmcancel.shm.registry import Registry

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

CONF = "examples/sdk/gunicorn.conf.py"
HEADERS = {"content-type": "application/json", "accept": "application/json, text/event-stream",
           "mcp-protocol-version": "2025-11-25"}
TOOL_SECONDS = 60  # far past gunicorn's graceful_timeout: only the stop ends it in time


def test_a_sync_call_running_at_a_hup_is_stopped_with_its_worker(short_tmp: Path) -> None:
    name = f"sdkstop-{uuid.uuid4().hex[:10]}"
    with Gunicorn(None, registry_name=name, config=CONF, workers=1,
                  worker_class="uvicorn_worker.UvicornWorker",
                  env={"SHMCANCEL_SDK_STATELESS": "0",
                       "SHMCANCEL_SDK_SOCKET_DIR": str(short_tmp / "socks")}) as g, \
            Registry.attach(name, readonly=True) as reg:
        [old] = g.worker_pids()
        session = open_session(g.url, HEADERS, "stop")
        done: dict[str, Any] = {}

        def call() -> None:
            try:
                with httpx.Client(timeout=TOOL_SECONDS + 30) as h:
                    done["r"] = h.post(g.url, headers=session, json={
                        "jsonrpc": "2.0", "id": 1, "method": "tools/call",
                        "params": {"name": "sleep_sync", "arguments": {"seconds": TOOL_SECONDS}}})
            except httpx.HTTPError as e:
                done["error"] = e

        t = threading.Thread(target=call, daemon=True)
        t.start()
        wait_until(lambda: in_flight_count(reg) == 1, time.monotonic() + 20,
                   what="the call in flight")
        g.signal(signal.SIGHUP)
        # the stop: within the tool's 10 ms poll and the worker's exit, not the 30 s of
        # gunicorn's graceful_timeout (nor the tool's 60 s)
        wait_until(lambda: not alive(old), time.monotonic() + 15,
                   what="the HUP'd worker's exit")
        assert in_flight_count(reg) == 0
        t.join(30)
        assert not t.is_alive()
        # whatever reached the client, it is not the tool's result (which never came)
        assert "slept" not in getattr(done.get("r"), "text", ""), done
