"""A server whose /dev/shm fills up after its registry was created (another tenant, a runaway
job): real gunicorn on loopback, run with a small /dev/shm of its own (``helpers.small_shm``)
that the test really fills. A ``notifications/cancelled`` whose row needs a large record that
can no longer be backed is answered 503 with ``Retry-After``, records nothing and leaves the
call running; one whose row is small is recorded as ever; once room is made, the retried
notification cancels the call."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from collections.abc import Iterator

import httpx
import pytest
from helpers import small_shm
from helpers.background import Background
from helpers.gunicorn_harness import Gunicorn, wait_until
from helpers.mcp_client import ACCEPT, LEGACY, open_session, reply_of, tag, wait_file

from shmcancel import errors

pytestmark = pytest.mark.integration

LONG_REASON = "\U0001f600" * 200  # 800 bytes: the row takes a large record


class SmallShmGunicorn(Gunicorn):
    def command(self) -> list[str]:
        return small_shm.command("40m", super().command())


@contextlib.contextmanager
def filled(pid: int) -> Iterator[None]:
    """Fill the /dev/shm process ``pid`` sees; make the room again on leaving."""
    where = f"/proc/{pid}/root/dev/shm"
    fd = small_shm.fill(where)
    try:
        yield
    finally:
        os.close(fd)
        os.unlink(f"{where}/filler")


def test_a_cancel_that_finds_dev_shm_full_is_503_and_lands_once_room_is_made(
        shm_name: str) -> None:
    if (why := small_shm.unavailable()) is not None:
        pytest.skip(why)
    with tempfile.TemporaryDirectory(prefix="shmcancel-full-") as out, SmallShmGunicorn(
            "tests.apps.transport_app:app", registry_name=shm_name,
            config="tests/apps/transport_conf.py", env={"SHMCANCEL_TEST_DIR": out},
            workers=3) as g:  # two sleeping calls, and one for the notifications
        headers = {"Accept": ACCEPT, "Content-Type": "application/json",
                   "MCP-Protocol-Version": LEGACY, **open_session(g.url, {"Accept": ACCEPT})}

        def post(obj: object) -> httpx.Response:
            return httpx.post(g.url, content=json.dumps(obj).encode(), headers=headers,
                              timeout=30)

        def call(rid: int, t: str) -> Background:
            bg = Background(lambda: reply_of(post(
                {"jsonrpc": "2.0", "id": rid, "method": "tools/call",
                 "params": {"name": "sleep", "arguments": {"seconds": 25, "tag": t}}})))
            bg.start()
            wait_file(f"{out}/{t}.started", deadline=time.monotonic() + 10)
            return bg

        def cancel(rid: int, reason: str) -> httpx.Response:
            return post({"jsonrpc": "2.0", "method": "notifications/cancelled",
                         "params": {"requestId": rid, "reason": reason}})

        workers = set(g.worker_pids())
        short_tag, long_tag = tag(), tag()
        short_call, long_call = call(1, short_tag), call(2, long_tag)
        with filled(g.pid):
            assert cancel(1, "stop").status_code == 202  # a small row: recorded as ever
            reply = short_call.result()
            assert reply.get("error", {}).get("code") == errors.REQUEST_CANCELLED, (
                reply, g.log_tail())
            r = cancel(2, LONG_REASON)
            assert r.status_code == 503 and r.headers["retry-after"], r.text
            assert "no room" in r.json()["error"]["message"]
            assert long_call.is_alive() and not os.path.exists(f"{out}/{long_tag}.cancelled")
        assert cancel(2, LONG_REASON).status_code == 202
        assert long_call.result()["error"]["code"] == errors.REQUEST_CANCELLED
        wait_until(lambda: "/dev/shm has no room left" in g.log(), time.monotonic() + 5,
                   what="the refusal logged")
        assert set(g.worker_pids()) == workers  # none died (a write into a hole: SIGBUS)


SDK_CONF = "examples/sdk/gunicorn.conf.py"
SDK_HEADERS = {"content-type": "application/json", "accept": "application/json, text/event-stream",
               "mcp-protocol-version": "2025-11-25"}


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_an_sdk_cancel_that_finds_dev_shm_full_is_503_not_a_202_that_records_nothing(
        shm_name: str) -> None:
    """The same on the SDK front end (``shmcancel.sdk``, stateless, three uvicorn workers): a
    ``notifications/cancelled`` whose row cannot be written is 503 with ``Retry-After``, never
    handed to the SDK, which answers a notification 202 and cannot stop a sync tool running in
    a thread (or in another worker): the client would take its cancel as delivered."""
    if (why := small_shm.unavailable()) is not None:
        pytest.skip(why)
    with SmallShmGunicorn(None, registry_name=shm_name, config=SDK_CONF, workers=3,
                          worker_class="uvicorn_worker.UvicornWorker",
                          env={"SHMCANCEL_SDK_STATELESS": "1"}) as g:
        def post(obj: object) -> httpx.Response:
            return httpx.post(g.url, json=obj, headers=SDK_HEADERS, timeout=40)

        call = Background(lambda: post(
            {"jsonrpc": "2.0", "id": 7, "method": "tools/call",
             "params": {"name": "sleep_sync", "arguments": {"seconds": 20}}}).json())
        call.start()
        note = {"jsonrpc": "2.0", "method": "notifications/cancelled",
                "params": {"requestId": 7, "reason": LONG_REASON}}
        with filled(g.pid):
            # 202 until the call is in flight (a cancel of no call is the SDK's), then 503
            deadline = time.monotonic() + 10
            while (r := post(note)).status_code == 202 and time.monotonic() < deadline:
                assert call.is_alive(), call.result()
                time.sleep(0.1)
            assert r.status_code == 503 and r.headers["retry-after"], (r.status_code, r.text)
            assert call.is_alive()
        assert post(note).status_code == 202
        assert call.result()["error"]["code"] == errors.REQUEST_CANCELLED
