"""``shmcancel.sdk`` on a server with the SDK's bearer auth (contract §9: "the SDK's own checks
(Origin/Host, auth, session existence) still apply to every request"), under real gunicorn with
uvicorn workers: a ``notifications/cancelled`` that shmcancel would answer itself is refused by
the SDK's auth first, and principals are the SDK's (client id, issuer, subject), so two clients
sharing a subject cannot cancel each other's calls."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import anyio
import httpx
import pytest
from helpers.aio import until
from helpers.background import lock_held
from helpers.gunicorn_harness import Gunicorn
from helpers.mcp_client import open_session
from helpers.procs import sigquit_blockers
from helpers.rows import in_flight_rows

from shmcancel import Registry

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

CONF = "examples/sdk/gunicorn.conf.py"
SLEEP = 30.0
HEADERS = {"content-type": "application/json", "accept": "application/json, text/event-stream",
           "mcp-protocol-version": "2025-11-25"}


@pytest.fixture(scope="module", params=["stateful", "stateless"])
def server(request, module_shm_name) -> Iterator[tuple[str, Gunicorn, Registry]]:
    env = {"SHMCANCEL_TEST_SDK_STATELESS": "1" if request.param == "stateless" else "0"}
    with Gunicorn("tests.apps.sdk_auth_app:app", registry_name=module_shm_name, config=CONF,
                  workers=2, worker_class="uvicorn_worker.UvicornWorker", env=env) as g, \
            Registry.attach(module_shm_name, readonly=True) as reg:
        yield request.param, g, reg


def _auth(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def _session(g: Gunicorn, token: str) -> dict[str, str]:
    return open_session(g.url, dict(HEADERS, **_auth(token)))


async def _call_7(h: httpx.AsyncClient, url: str, headers: dict[str, str], tool: str,
                  answers: list[Any]) -> None:
    """Call ``tool`` (id 7) for ``SLEEP`` seconds; its answer (the JSON of a JSON or SSE reply)
    appended to ``answers``."""
    r = await h.post(url, headers=headers, json={
        "jsonrpc": "2.0", "id": 7, "method": "tools/call",
        "params": {"name": tool, "arguments": {"seconds": SLEEP}}})
    text = r.text
    answers.append(json.loads(text[text.index("{"):text.rindex("}") + 1]))


async def _only_its_creator_cancels(url: str, reg: Registry, mine: dict[str, str], tool: str,
                                    others: Callable[[dict[str, Any]], Awaitable[None]]
                                    ) -> None:
    """A ``tool`` call (id 7) with the creator's headers ``mine``: ``others(note)`` posts its
    ``notifications/cancelled`` as others (and checks their answers), which must leave the call
    running; the creator's then cancels it (``-32800``)."""
    answers: list[Any] = []
    async with httpx.AsyncClient(timeout=30) as h, anyio.create_task_group() as tg:
        tg.start_soon(_call_7, h, url, mine, tool, answers)
        await until(lambda: in_flight_rows(reg), 10, "the call")
        note = {"jsonrpc": "2.0", "method": "notifications/cancelled",
                "params": {"requestId": 7, "reason": "hijack"}}
        await others(note)
        await anyio.sleep(0.3)  # a wrongly recorded cancel would end it meanwhile
        assert in_flight_rows(reg) and not answers
        async with httpx.AsyncClient(timeout=10) as h2:
            r = await h2.post(url, headers=mine, json=note)
            assert r.status_code == 202, r.text
        await until(lambda: answers, 2.0, "the call's answer")
    assert answers[0]["error"]["code"] == -32800, answers


def test_only_the_calls_principal_cancels_it(server):
    """Alice's call (client ``a``): a cancel without a token is the SDK's 401, one with a token
    lacking the scope its 403, one from client ``b`` with the same subject (another principal)
    cancels nothing; only her own cancels it."""
    kind, g, reg = server
    mine = _session(g, "alice-at-a") if kind == "stateful" else dict(HEADERS, **_auth("alice-at-a"))
    session = {k: v for k, v in mine.items() if k == "mcp-session-id"}

    async def others(note: dict[str, Any]) -> None:
        async with httpx.AsyncClient(timeout=10) as h2:
            for token, want in ((None, 401), ("nobody", 401), ("bare", 403),
                                ("alice-at-b", None)):
                hdrs = dict(HEADERS, **session, **(_auth(token) if token else {}))
                r = await h2.post(g.url, headers=hdrs, json=note)
                if want is not None:
                    assert r.status_code == want, (token, r.status_code, r.text)

    anyio.run(_only_its_creator_cancels, g.url, reg, mine, "sleep_sync", others)
    assert in_flight_rows(reg) == []


def test_a_cancel_waiting_for_the_lock_does_not_stall_the_worker(module_shm_name, shm_name):
    """One worker, the registry lock held elsewhere: a cancel for a call in flight waits
    ``lock_timeout`` for it (then 503), off the event loop: another request of the same worker
    is answered meanwhile, not after the cancel's wait."""
    lock_timeout = 2.0
    env = {"SHMCANCEL_TEST_SDK_STATELESS": "1", "SHMCANCEL_TEST_LOCK_TIMEOUT": str(lock_timeout)}
    mine = dict(HEADERS, **_auth("alice-at-a"))
    with Gunicorn("tests.apps.sdk_auth_app:app", registry_name=shm_name,
                  config="tests/apps/transport_conf.py", workers=1,
                  worker_class="uvicorn_worker.UvicornWorker", env=env) as g, \
            Registry.attach(shm_name) as reg:
        (worker,) = g.worker_pids()

        async def scenario() -> tuple[int, float, float]:
            call = {"jsonrpc": "2.0", "id": 9, "method": "tools/call",
                    "params": {"name": "sleep", "arguments": {"seconds": SLEEP}}}
            note = {"jsonrpc": "2.0", "method": "notifications/cancelled",
                    "params": {"requestId": 9}}
            other = {"jsonrpc": "2.0", "id": 10, "method": "tools/call",
                     "params": {"name": "sleep", "arguments": {"seconds": 0}}}
            async with httpx.AsyncClient(timeout=30) as h, anyio.create_task_group() as tg:
                tg.start_soon(lambda: h.post(g.url, headers=mine, json=call))
                await until(lambda: in_flight_rows(reg), 10, "the call")
                out: dict[str, Any] = {}

                async def cancel() -> None:
                    t0 = anyio.current_time()
                    r = await h.post(g.url, headers=mine, json=note)
                    out["cancel"] = (r.status_code, anyio.current_time() - t0)

                with lock_held(reg):
                    before = sigquit_blockers(worker)
                    tg.start_soon(cancel)
                    await until(lambda: sigquit_blockers(worker) - before, 10,
                                "the cancel to wait for the lock")
                    t0 = anyio.current_time()
                    r = await h.post(g.url, headers=mine, json=other)
                    assert r.status_code == 200, r.text
                    other_took = anyio.current_time() - t0
                    await until(lambda: "cancel" in out, 10, "the cancel's answer")
                tg.cancel_scope.cancel()
            status, cancel_took = out["cancel"]
            return status, cancel_took, other_took

        status, cancel_took, other_took = anyio.run(scenario)
        assert status == 503 and cancel_took >= 0.9 * lock_timeout, (status, cancel_took)
        assert other_took < 0.5 * lock_timeout, other_took


def test_an_anonymous_caller_cannot_cancel_in_an_authenticated_clients_session(shm_name):
    """With optional authentication, an anonymous ``notifications/cancelled`` naming alice's
    session was answered 202 by a worker not holding it, and cancelled her call (the worker
    holding it, as the SDK, answers 404: the caller is not the session's creator). It is
    forwarded there now, on whichever worker it lands."""
    with Gunicorn("tests.apps.sdk_optional_auth_app:app", registry_name=shm_name, config=CONF,
                  workers=2, worker_class="uvicorn_worker.UvicornWorker",
                  env={"SHMCANCEL_SDK_STATELESS": "0"},
                  extra_args=["--pythonpath", "examples/sdk"]) as g, \
            Registry.attach(shm_name, readonly=True) as reg:
        mine = _session(g, "alice")
        session = {k: v for k, v in mine.items() if k == "mcp-session-id"}

        async def anonymous(note: dict[str, Any]) -> None:
            statuses = []
            for _ in range(8):  # fresh connections: on either worker
                async with httpx.AsyncClient(timeout=10) as h2:
                    r = await h2.post(g.url, headers=dict(HEADERS, **session), json=note)
                    statuses.append(r.status_code)
            assert 202 not in statuses, statuses

        anyio.run(_only_its_creator_cancels, g.url, reg, mine, "sleep", anonymous)
        assert in_flight_rows(reg) == []
