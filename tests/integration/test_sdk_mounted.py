"""``shmcancel.sdk.asgi(mcp)`` mounted under a prefix of a parent app (``Mount("/example",
app=...)``, as the SDK's docs mount servers), stateful, on three uvicorn workers: a session's
requests landing on a worker that does not hold it are forwarded to the one that does, at the
path the mounted app itself serves (contract §9: "every request of a session works whichever
worker accepted it")."""

from __future__ import annotations

from collections.abc import Iterator

import anyio
import httpx
import pytest
from helpers.gunicorn_harness import Gunicorn
from helpers.mcp_client import open_session
from helpers.rows import in_flight_rows
from mcp import Client

from shmcancel import Registry

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

CONF = "examples/sdk/gunicorn.conf.py"
HEADERS = {"content-type": "application/json", "accept": "application/json, text/event-stream",
           "mcp-protocol-version": "2025-11-25"}


@pytest.fixture(scope="module")
def mounted(module_shm_name) -> Iterator[tuple[str, Registry]]:
    with Gunicorn("tests.apps.sdk_mounted_app:app", registry_name=module_shm_name, config=CONF,
                  workers=3, worker_class="uvicorn_worker.UvicornWorker") as g, \
            Registry.attach(module_shm_name, readonly=True) as reg:
        yield g.url.replace("/mcp", "/example/mcp"), reg


@pytest.mark.parametrize("path", ["/example/mcp", "/t/acme%20corp/mcp"],
                         ids=["mount", "percent-encoded-mount"])
def test_a_mounted_servers_session_works_on_every_worker(mounted, path):
    """12 requests of one session, each on a fresh connection (so on any of the three workers),
    all answered by the session's worker. Also under a path parameter whose value is
    percent-encoded in the request line (``/t/acme%20corp/mcp``: root_path ``/t/acme corp``,
    raw_path as sent): a forwarded request reaches the mounted app's own path, not the owner's
    404."""
    url = mounted[0].replace("/example/mcp", path)
    hdrs = open_session(url, dict(HEADERS))
    statuses = []
    for i in range(12):
        with httpx.Client(timeout=10) as h:
            r = h.post(url, headers=hdrs, json={
                "jsonrpc": "2.0", "id": i + 1, "method": "tools/call",
                "params": {"name": "echo", "arguments": {"text": f"n{i}"}}})
            statuses.append(r.status_code)
    assert statuses == [200] * 12


def test_the_sdk_client_on_a_mounted_server(mounted):
    """The official SDK client (2025-11-25 wire) runs 8 concurrent calls in one session (it
    opens connections as it needs them, so they land on several workers): all succeed, and
    nothing is left in flight."""
    url, reg = mounted

    async def main() -> list[str]:
        out: list[str] = []
        async with Client(url, mode="legacy") as c:
            async def one() -> None:
                r = await c.call_tool("sleep", {"seconds": 0.2})
                assert not r.is_error, r
                out.append(r.content[0].text)

            async with anyio.create_task_group() as tg:
                for _ in range(8):
                    tg.start_soon(one)
        return out

    for _ in range(2):
        assert anyio.run(main) == ["slept 0.2 s"] * 8
    assert in_flight_rows(reg) == []
