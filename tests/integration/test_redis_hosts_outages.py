"""Two gunicorn "hosts" sharing one real Redis: the failure-table promises of README's Redis
section not covered by test_redis_hosts.py (a call running across a Redis restart, lookups
Redis cannot answer on every route, adoption refused by the adopting host's bounds, a killed
worker's rows, a 2026-07-28 disconnect)."""

from __future__ import annotations

import os
import signal
import socket
import time
from typing import Any

import redis
from helpers.background import Background
from helpers.gunicorn_harness import wait_until
from helpers.mcp_client import modern_call_bytes, tag, wait_file
from helpers.redis_server import running
from test_redis_hosts import (
    LEASE,
    PING,
    Client,
    assert_retry_later,
    outdir,
    sleeping_on,
    two_hosts,
)

from shmcancel import errors

__all__ = ["outdir"]  # the module fixture, shared


def test_a_call_running_across_a_redis_restart_is_cancelled_through_b(
        outdir: str, shm_name: str, shm_names: list[str]) -> None:
    """README: Redis back (even empty) -> the bridge re-adds every in-flight row of its worker.
    A call started before the kill, and one started while Redis was down, are both cancelled
    through B once Redis answers again."""
    with running() as srv, two_hosts(srv.url, outdir, shm_name, shm_names,
                                     a_workers=3) as (a, b, _):
        c = Client(a.url)
        assert c.call(b.url, 0, "echo", {"text": "x"})["result"]  # adopted on B
        t1 = tag()
        before = Background(lambda: c.call(a.url, "before", "sleep", {"seconds": 30, "tag": t1}))
        before.start()
        wait_file(f"{outdir}/{t1}.started", time.monotonic() + 10)
        srv.kill()
        t2 = tag()
        during = Background(lambda: c.call(a.url, "during", "sleep", {"seconds": 30, "tag": t2}))
        during.start()
        wait_file(f"{outdir}/{t2}.started", time.monotonic() + 10)
        srv.start()
        r = redis.Redis.from_url(srv.url)
        wait_until(lambda: len(list(r.scan_iter(match="*:if:*"))) >= 2 or None,
                   time.monotonic() + 20, interval=0.1, what="A's rows re-added")
        for rid, call in (("before", before), ("during", during)):
            assert c.cancel(b.url, rid).status_code == 202
            assert call.result()["error"]["code"] == errors.REQUEST_CANCELLED
        r.close()


def test_every_route_of_an_unseen_session_is_503_while_redis_is_stopped(
        outdir: str, shm_name: str, shm_names: list[str]) -> None:
    """README: a session minted on another host and Redis gives no answer -> 503 +
    Retry-After, never 404: a DELETE and a notifications/cancelled too, not only a request."""
    with running() as srv, two_hosts(srv.url, outdir, shm_name, shm_names) as (a, b, _):
        c = Client(a.url)
        with srv.paused():
            assert_retry_later(c.post(b.url, {"jsonrpc": "2.0", "method":
                                              "notifications/cancelled",
                                              "params": {"requestId": 1}}, retry_for=0))
            assert_retry_later(c.post(b.url, {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                                              "params": {"name": "echo",
                                                         "arguments": {"text": "x"}}},
                                      retry_for=0))
            assert_retry_later(c.delete(b.url, retry_for=0))
        assert c.delete(b.url).status_code == 204
        wait_until(lambda: c.post(a.url, PING).status_code == 404 or None,
                   time.monotonic() + 10, what="the session to end on A")
        assert "Traceback" not in a.log() + b.log()


def test_a_session_b_cannot_adopt_for_its_client_bound_is_503_not_404(
        outdir: str, shm_name: str, shm_names: list[str]) -> None:
    """sessions_per_client=2: the client's two sessions on B each run a call, so B cannot take
    a third (minted on A) now. Minting in that state is 503 + Retry-After on B; adopting must be
    too: the session exists (Redis says so), and a 404 tells the client it is gone for good
    (README: 404 only when Redis answers that there is no such session). Once a call ends, B
    adopts it."""
    with running() as srv, two_hosts(srv.url, outdir, shm_name, shm_names, worker_class="gthread",
                                     threads=4,
                                     env_extra={"SHMCANCEL_TEST_SESSIONS_PER_CLIENT": "2"}
                                     ) as (a, b, _):
        busy = [Client(b.url), Client(b.url)]
        tags = [tag(), tag()]
        calls = [Background(lambda c=c, t=t: c.call(b.url, 1, "sleep", {"seconds": 30, "tag": t}))
                 for c, t in zip(busy, tags, strict=True)]
        for call in calls:
            call.start()
        for t in tags:
            wait_file(f"{outdir}/{t}.started", time.monotonic() + 10)
        c = Client(a.url)  # same client (address): Redis keeps it and drops busy[0]'s copy
        r = c.post(b.url, PING, retry_for=0)
        assert r.status_code != 404, r.text
        assert_retry_later(r)
        assert busy[1].cancel(b.url, 1).status_code == 202
        assert calls[1].result()["error"]["code"] == errors.REQUEST_CANCELLED
        assert c.post(b.url, PING).status_code == 200
        assert busy[0].cancel(b.url, 1).status_code == 202
        calls[0].result()


def test_a_killed_workers_redis_rows_expire_within_a_lease(
        redis_server: Any, outdir: str, shm_name: str, shm_names: list[str]) -> None:
    """README: a worker dies -> its Redis rows and box expire within one lease."""
    r = redis.Redis.from_url(redis_server.url)
    with two_hosts(redis_server.url, outdir, shm_name, shm_names) as (a, b, prefix):
        c, _call, pid, rows = sleeping_on(a, r, prefix, outdir)
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        wait_until(lambda: not rows() or None, killed + 2 * LEASE + 2, what="its rows to go")
        assert time.monotonic() - killed <= 2 * LEASE + 1.0
        wait_until(lambda: not list(r.scan_iter(match=f"{prefix}box:A:{pid}:*")) or None,
                   killed + 2 * LEASE + 2, what="its box to go")
        assert c.cancel(b.url, 1).status_code == 202
        assert list(r.scan_iter(match=prefix + "*:c")) == []
        assert c.post(b.url, PING).status_code == 200
    r.close()


def test_a_modern_disconnect_on_a_cancels_and_leaves_no_redis_row(
        redis_server: Any, outdir: str, shm_name: str, shm_names: list[str]) -> None:
    """2026-07-28: closing the connection cancels the call on A; its Redis in-flight row ends
    with it and nothing is recorded in Redis."""
    r = redis.Redis.from_url(redis_server.url)
    with two_hosts(redis_server.url, outdir, shm_name, shm_names) as (a, _b, prefix):
        t = tag()
        host, port = a.url.split("//")[1].split("/")[0].split(":")
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(modern_call_bytes("sleep", {"seconds": 25, "tag": t}, client="audit",
                                        host=host))
            wait_file(f"{outdir}/{t}.started", time.monotonic() + 10)
            wait_until(lambda: list(r.scan_iter(match=prefix + "*:if:*")) or None,
                       time.monotonic() + 5, what="the in-flight row")
        wait_file(f"{outdir}/{t}.cancelled", time.monotonic() + 10)
        wait_until(lambda: not list(r.scan_iter(match=prefix + "*:if:*")) or None,
                   time.monotonic() + 5, what="the row to end")
        assert list(r.scan_iter(match=prefix + "*:c")) == []
    r.close()


def test_a_session_with_a_call_in_flight_keeps_its_redis_copy(
        outdir: str, shm_name: str, shm_names: list[str]) -> None:
    """contract §6.1: a session with a call in flight is never evicted. sessions_per_client=2:
    the client runs a call in s1 on A, then mints s2 and s3 on A (A gives up s2, idle). Redis
    gave up s1, the oldest, though its call runs: the client's notifications/cancelled sent to
    B (README: it "lands on B") was answered 404 and the call ran on."""
    with running() as srv, two_hosts(srv.url, outdir, shm_name, shm_names,
                                     env_extra={"SHMCANCEL_TEST_SESSIONS_PER_CLIENT": "2"}
                                     ) as (a, b, _):
        s1 = Client(a.url)
        t = tag()
        call = Background(lambda: s1.call(a.url, 1, "sleep", {"seconds": 30, "tag": t}))
        call.start()
        wait_file(f"{outdir}/{t}.started", time.monotonic() + 10)
        Client(a.url)
        Client(a.url)
        r = s1.cancel(b.url, 1)
        assert r.status_code == 202, r.text
        assert call.result()["error"]["code"] == errors.REQUEST_CANCELLED
