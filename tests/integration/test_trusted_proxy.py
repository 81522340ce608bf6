"""contract §3 over HTTP: the trusted-proxy middleware that ``shmcancel/mcp/principal.py``
documents, in front of the MCP transport, under a real gunicorn on loopback
(``tests/apps/proxy_app.py``: the proxy is ``127.0.0.1``; ``127.0.0.2`` and ``127.0.0.3`` are
clients that reach gunicorn directly, so their ``X-Forwarded-For`` is theirs to invent).

gunicorn listens on ``127.0.0.1`` and on ``[::]`` (dual-stack: an IPv4 peer there is
``::ffff:a.b.c.d`` in ``REMOTE_ADDR``).
"""

from __future__ import annotations

import re
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from helpers.background import Background
from helpers.gunicorn_harness import Gunicorn
from helpers.mcp_client import ACCEPT, LEGACY, dump, reply_of, tag, wait_file

from shmcancel import errors

APP = "tests.apps.proxy_app:app"
CONF = "tests/apps/transport_conf.py"
PROXY = "127.0.0.1"
VICTIM = "198.51.100.7"  # the client the proxy forwards for
HEADERS = {"Accept": ACCEPT, "Content-Type": "application/json", "MCP-Protocol-Version": LEGACY}


@pytest.fixture(scope="module")
def outdir() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="shmcancel-proxy-") as d:
        yield d


@pytest.fixture(scope="module")
def server(module_shm_name: str, outdir: str) -> Iterator[Gunicorn]:
    env = {"SHMCANCEL_TEST_DIR": outdir, "SHMCANCEL_TEST_SESSIONS_PER_CLIENT": "2"}
    with Gunicorn(APP, registry_name=module_shm_name, config=CONF, env=env, workers=2,
                  extra_args=["-b", "[::]:0"]) as g:
        m = re.search(r"Listening at: \S*http://\[::\]:(\d+)", g.log())
        assert m is not None, g.log_tail()
        g.dual_port = int(m.group(1))  # type: ignore[attr-defined]
        yield g


def post(url: str, body: dict[str, Any], *, source: str, headers: dict[str, str] | None = None,
         timeout: float = 30.0) -> httpx.Response:
    """POST ``body`` from the loopback address ``source``, on a connection of its own."""
    transport = httpx.HTTPTransport(local_address=source)
    with httpx.Client(transport=transport, timeout=timeout) as h:
        return h.post(url, json=body, headers={**HEADERS, **(headers or {})})


def call(url: str, name: str, args: dict[str, Any], *, source: str, rid: int = 1,
         headers: dict[str, str] | None = None) -> dict[str, Any]:
    r = post(url, {"jsonrpc": "2.0", "id": rid, "method": "tools/call",
                   "params": {"name": name, "arguments": args}},
             source=source, headers=headers)
    assert r.status_code == 200, r.text
    return reply_of(r)


def scope_seen(url: str, *, source: str, headers: dict[str, str] | None = None) -> str:
    msg = call(url, "scope", {}, source=source, headers=headers)
    return msg["result"]["content"][0]["text"]


def urls(g: Gunicorn, path: str) -> dict[str, str]:
    """The server's ``path`` on its IPv4 listener and on its dual-stack one."""
    return {"ipv4": f"http://127.0.0.1:{g.port}{path}",
            "dual-stack": f"http://127.0.0.1:{g.dual_port}{path}"}  # type: ignore[attr-defined]


@pytest.mark.parametrize("listener", ["ipv4", "dual-stack"])
def test_the_proxy_forwards_its_clients_address(server, listener):
    """The documented middleware makes a client behind the proxy its own ``ip:`` scope, on
    either listener: on a dual-stack one the proxy's ``REMOTE_ADDR`` is ``::ffff:127.0.0.1``,
    the same peer (the library itself buckets it as ``127.0.0.1``)."""
    url = urls(server, "/stateless")[listener]
    assert scope_seen(url, source=PROXY) == f"ip:{PROXY}"
    got = scope_seen(url, source=PROXY, headers={"X-Forwarded-For": f"203.0.113.5, {VICTIM}"})
    assert got == f"ip:{VICTIM}"
    got = scope_seen(url, source=PROXY, headers={"X-Forwarded-For": "[2001:db8:1:2::99]"})
    assert got == "ip:2001:db8:1:2::/64"


@pytest.mark.parametrize("listener", ["ipv4", "dual-stack"])
def test_a_direct_client_cannot_forward_for_another(server, listener):
    """A client that is not the proxy keeps its own address whatever it claims."""
    url = urls(server, "/stateless")[listener]
    for claim in ({"X-Forwarded-For": VICTIM}, {"X-Forwarded-For": f"{VICTIM}, {PROXY}"},
                  {"Forwarded": f'for="{VICTIM}"'}, {"X-Real-IP": VICTIM}):
        assert scope_seen(url, source="127.0.0.2", headers=claim) == "ip:127.0.0.2", claim


def test_a_lying_client_cannot_cancel_the_forwarded_clients_call(server, outdir,
                                                                   module_shm_name):
    """The victim's call (behind the proxy, id 1, in ``ip:<victim>``) is not cancelled by a
    direct client naming the victim in its headers; the proxy forwarding for the victim does
    cancel it (so the call was in flight and cancellable all along)."""
    url = urls(server, "/stateless")["ipv4"]
    t = tag()
    fwd = {"X-Forwarded-For": VICTIM}
    victim = Background(lambda: call(url, "sleep", {"seconds": 20, "tag": t}, source=PROXY,
                                     headers=fwd))
    victim.start()
    wait_file(f"{outdir}/{t}.started", time.monotonic() + 20)
    note = {"jsonrpc": "2.0", "method": "notifications/cancelled",
            "params": {"requestId": 1, "reason": "forged"}}
    for claim in (fwd, {"X-Forwarded-For": f"{VICTIM}, {PROXY}"},
                  {"Forwarded": f"for={VICTIM}"}):
        assert post(url, note, source="127.0.0.2", headers=claim).status_code == 202
    d = dump(module_shm_name)
    assert [r["scope"] for r in d["in_flight"]] == [f"ip:{VICTIM}"]
    assert d["cancellations"] == []
    note["params"]["reason"] = "by the proxy"
    assert post(url, note, source=PROXY, headers=fwd).status_code == 202
    msg = victim.result(timeout=20)
    assert msg["error"]["code"] == errors.REQUEST_CANCELLED


def test_a_lying_client_cannot_use_up_the_forwarded_clients_sessions(server):
    """Minting counts against the client (§6.1, ``sessions_per_client`` = 2 here): a direct
    client naming the victim mints against its own address, never displacing the victim's."""
    url = urls(server, "/mcp")["ipv4"]
    fwd = {"X-Forwarded-For": VICTIM}
    init = {"jsonrpc": "2.0", "id": 0, "method": "initialize",
            "params": {"protocolVersion": LEGACY, "capabilities": {},
                       "clientInfo": {"name": "victim", "version": "1"}}}
    r = post(url, init, source=PROXY, headers=fwd)
    assert r.status_code == 200, r.text
    sid = r.headers["mcp-session-id"]
    for _ in range(4):
        r = post(url, init, source="127.0.0.3", headers=fwd)
        assert r.status_code == 200, r.text
    msg = call(url, "scope", {}, source=PROXY, headers={**fwd, "Mcp-Session-Id": sid})
    assert msg["result"]["content"][0]["text"] == f"session:{sid}"


def test_the_proxy_on_a_unix_socket_forwards_its_clients_address(shm_name, outdir, tmp_path):
    """Behind a proxy that connects to gunicorn's unix socket (``REMOTE_ADDR`` is ``""``),
    ``proxies=["unix"]`` trusts that peer; a TCP client is still not trusted."""
    sock = str(tmp_path / "g.sock")
    env = {"SHMCANCEL_TEST_DIR": outdir, "SHMCANCEL_TEST_PROXIES": "unix"}
    with Gunicorn(APP, registry_name=shm_name, config=CONF, env=env, workers=1,
                  extra_args=["-b", f"unix:{sock}"]) as g:
        body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                "params": {"name": "scope", "arguments": {}}}
        transport = httpx.HTTPTransport(uds=sock)
        with httpx.Client(transport=transport, timeout=30) as h:
            for fwd, expected in ((None, "ip:unknown"), (VICTIM, f"ip:{VICTIM}")):
                hdrs = HEADERS if fwd is None else {**HEADERS, "X-Forwarded-For": fwd}
                r = h.post("http://proxy/stateless", json=body, headers=hdrs)
                assert r.status_code == 200, r.text
                assert reply_of(r)["result"]["content"][0]["text"] == expected
        url = f"http://127.0.0.1:{g.port}/stateless"
        got = scope_seen(url, source="127.0.0.2", headers={"X-Forwarded-For": VICTIM})
        assert got == "ip:127.0.0.2"
