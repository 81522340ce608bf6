"""Two gunicorn instances as two "hosts" (own ports, own registries, one real Redis through
``SHMCANCEL_REDIS_URL``): sessions, cancellation and liveness across them, and a Redis that is
SIGKILLed mid-run and restarted. Tools report through files (tests/apps/transport_app.py)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import redis
from helpers.background import Background
from helpers.gunicorn_harness import Gunicorn, wait_until
from helpers.mcp_client import ACCEPT, LEGACY, RETRY_FOR, reply_of, send, tag, wait_file
from helpers.names import TEST_PREFIX, fresh_registry_name
from helpers.redis_server import running, unique_prefix

from shmcancel import errors

APP = "tests.apps.transport_app:app"
CONF = "tests/apps/transport_conf.py"
LEASE = 1.0  # seconds: in-flight rows of a dead host vanish within this (bound: 2 x LEASE)


@pytest.fixture(scope="module")
def outdir() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="shmcancel-hosts-") as d:
        yield d


def host(name: str, host_id: str, url: str, prefix: str, outdir: str, **kw: Any) -> Gunicorn:
    env = {"SHMCANCEL_TEST_DIR": outdir, "SHMCANCEL_REDIS_URL": url,
           "SHMCANCEL_REDIS_PREFIX": prefix, "SHMCANCEL_HOST_ID": host_id,
           "SHMCANCEL_REDIS_LEASE": str(LEASE), "SHMCANCEL_REDIS_TIMEOUT": "0.2",
           **kw.pop("env_extra", {})}
    return Gunicorn(APP, registry_name=name, config=CONF, env=env,
                    workers=kw.pop("workers", 2), **kw)


class Client:
    """A 2025-11-25 client whose session was minted on ``url`` (any host may be asked)."""

    def __init__(self, url: str) -> None:
        self.sid: str | None = None
        r = self.post(url, {"jsonrpc": "2.0", "id": 0, "method": "initialize",
                            "params": {"protocolVersion": LEGACY, "capabilities": {},
                                       "clientInfo": {"name": "hosts-test", "version": "1"}}})
        assert r.status_code == 200, r.text
        self.sid = r.headers["mcp-session-id"]

    def post(self, url: str, obj: Any, timeout: float = 20.0,
             retry_for: float = RETRY_FOR) -> httpx.Response:
        """POST ``obj``, retrying a 503 with ``Retry-After`` for ``retry_for`` seconds as a
        real client does (0: the first answer)."""
        h = {"Accept": ACCEPT, "Content-Type": "application/json"}
        if self.sid is not None:
            h["Mcp-Session-Id"] = self.sid
            h["MCP-Protocol-Version"] = LEGACY
        return send("POST", url, content=json.dumps(obj).encode(), headers=h, timeout=timeout,
                    retry_for=retry_for)

    def delete(self, url: str, retry_for: float = RETRY_FOR) -> httpx.Response:
        h = {"Mcp-Session-Id": self.sid or "", "MCP-Protocol-Version": LEGACY}
        return send("DELETE", url, headers=h, timeout=10, retry_for=retry_for)

    def call(self, url: str, id: Any, tool: str, args: dict) -> dict[str, Any]:
        return reply_of(self.post(url, {"jsonrpc": "2.0", "id": id, "method": "tools/call",
                                        "params": {"name": tool, "arguments": args}}))

    def cancel(self, url: str, id: Any) -> httpx.Response:
        return self.post(url, {"jsonrpc": "2.0", "method": "notifications/cancelled",
                               "params": {"requestId": id, "reason": "from elsewhere"}})


@pytest.fixture(scope="module")
def hosts(redis_server: Any, outdir: str) -> Iterator[tuple[Gunicorn, Gunicorn, str]]:
    prefix = unique_prefix()
    with fresh_registry_name() as na, fresh_registry_name() as nb, \
            host(na, "A", redis_server.url, prefix, outdir) as a, \
            host(nb, "B", redis_server.url, prefix, outdir) as b:
        yield a, b, prefix


def cross_cancel(a: Gunicorn, b: Gunicorn, outdir: str, client: Client | None = None,
                 rid: Any = 1) -> tuple[dict[str, Any], float]:
    """A ``sleep`` on A, its ``notifications/cancelled`` sent to B: (the reply, seconds from
    B's 202 to the reply)."""
    c = client or Client(a.url)
    t = tag()
    call = Background(lambda: c.call(a.url, rid, "sleep", {"seconds": 20, "tag": t}))
    call.start()
    wait_file(f"{outdir}/{t}.started", time.monotonic() + 10)
    r = c.cancel(b.url, rid)
    acked = time.monotonic()
    assert r.status_code == 202, r.text
    reply = call.result()
    return reply, call.done_at - acked


def test_session_minted_on_a_is_accepted_on_b(hosts: Any) -> None:
    a, b, _ = hosts
    c = Client(a.url)
    reply = c.call(b.url, 5, "echo", {"text": "hi"})
    assert reply["result"]["content"][0]["text"] == "hi", reply
    unknown = Client(a.url)
    unknown.sid = "x" * 32  # never minted anywhere
    assert unknown.post(b.url, {"jsonrpc": "2.0", "id": 1, "method": "ping"}).status_code == 404


def test_sleep_on_a_cancelled_through_b(hosts: Any, outdir: str) -> None:
    a, b, _ = hosts
    c = Client(a.url)
    for rid in (1, "two", 3):
        reply, latency = cross_cancel(a, b, outdir, c, rid)
        assert reply["error"]["code"] == errors.REQUEST_CANCELLED, reply
        assert reply["id"] == rid
        assert latency < 5.0  # generous: delivery is a BLPOP wake-up, then a 2 ms local poll


def test_delete_on_b_ends_the_session_and_its_call_on_a(hosts: Any, outdir: str) -> None:
    """contract §6.1's DELETE, sent to another host than the one running the call: the call ends
    -32800 and the session is gone on both hosts."""
    a, b, _ = hosts
    c = Client(a.url)
    assert c.call(b.url, 0, "echo", {"text": "x"})["result"]  # B holds it too now
    t = tag()
    call = Background(lambda: c.call(a.url, 1, "sleep", {"seconds": 20, "tag": t}))
    call.start()
    wait_file(f"{outdir}/{t}.started", time.monotonic() + 10)
    assert c.delete(b.url).status_code == 204
    assert call.result()["error"]["code"] == errors.REQUEST_CANCELLED
    ping = {"jsonrpc": "2.0", "id": 2, "method": "ping"}
    wait_until(lambda: c.post(a.url, ping).status_code == 404 or None, time.monotonic() + 10,
               what="the session to end on A")
    assert c.post(b.url, ping).status_code == 404


def test_scoping_holds_across_hosts(hosts: Any, outdir: str) -> None:
    """Another session naming the same request id on B cancels nothing on A."""
    a, b, _ = hosts
    owner, other = Client(a.url), Client(b.url)
    t = tag()
    call = Background(lambda: owner.call(a.url, 9, "sleep", {"seconds": 1.5, "tag": t}))
    call.start()
    wait_file(f"{outdir}/{t}.started", time.monotonic() + 10)
    assert other.cancel(b.url, 9).status_code == 202
    reply = call.result()
    assert reply.get("result", {}).get("content", [{}])[0].get("text") == "slept 1.5s", reply
    assert not os.path.exists(f"{outdir}/{t}.cancelled")




def test_a_session_id_naming_another_key_is_404_and_redis_stays_up(hosts: Any) -> None:
    """A session's key plus ":boxes" names the set of its holders' boxes: looked up as a
    session it made Redis answer WRONGTYPE, three of which marked Redis down on that worker
    (503 for everyone's sessions held elsewhere). Ids not of the minted form are not looked up."""
    a, b, _ = hosts
    c = Client(a.url)
    assert c.call(b.url, 1, "echo", {"text": "adopted"})["result"]["content"][0]["text"] \
        == "adopted"  # B adopted it: its key and its ":boxes" set exist in Redis
    crafted = Client(a.url)
    for suffix in (":boxes", "{x}", "*"):
        crafted.sid = c.sid + suffix
        for _ in range(4):  # past DOWN_AFTER
            r = crafted.post(b.url, {"jsonrpc": "2.0", "id": 1, "method": "ping"}, retry_for=0)
            assert r.status_code in (400, 404), (suffix, r.status_code, r.text)
    other = Client(a.url)  # never seen on B: B must still ask Redis, and get an answer
    reply = other.call(b.url, 2, "echo", {"text": "still up"})
    assert reply["result"]["content"][0]["text"] == "still up", reply
    assert "Redis unreachable" not in b.log()


@contextlib.contextmanager
def two_hosts(url: str, outdir: str, shm_name: str, shm_names: list[str],
              a_workers: int = 2, **kw: Any) -> Iterator[tuple[Gunicorn, Gunicorn, str]]:
    """Hosts A (registry ``shm_name``) and B (a second test-unique registry) sharing the Redis
    at ``url`` under a fresh key prefix; ``(a, b, prefix)``, both stopped at the end."""
    other = TEST_PREFIX + uuid.uuid4().hex[:12]
    shm_names.append(other)
    prefix = unique_prefix()
    with host(shm_name, "A", url, prefix, outdir, workers=a_workers, **dict(kw)) as a, \
            host(other, "B", url, prefix, outdir, **kw) as b:
        yield a, b, prefix


def sleeping_on(a: Gunicorn, r: redis.Redis, prefix: str, outdir: str
                ) -> tuple[Client, Background, int, Callable[[], list[bytes]]]:
    """A 20 s ``sleep`` call (id 1) started on ``a`` and in flight in Redis: its client, the
    call, the pid of the worker running it, and a function listing the in-flight rows under
    ``prefix``."""
    c = Client(a.url)
    t = tag()
    call = Background(lambda: c.call(a.url, 1, "sleep", {"seconds": 20, "tag": t}))
    call.start()
    pid = int(wait_file(f"{outdir}/{t}.started", time.monotonic() + 10))

    def rows() -> list[bytes]:
        return list(r.scan_iter(match=prefix + "*:if:*"))
    wait_until(lambda: rows() or None, time.monotonic() + 5, what="the in-flight row")
    return c, call, pid, rows


def test_a_killed_host_loses_its_rows_within_two_leases(redis_server: Any, outdir: str,
                                                        shm_name: str,
                                                        shm_names: list[str]) -> None:
    r = redis.Redis.from_url(redis_server.url)
    with two_hosts(redis_server.url, outdir, shm_name, shm_names) as (a, b, prefix):
        c, call, _pid, rows = sleeping_on(a, r, prefix, outdir)
        tree = a._tree()
        for pid in tree:  # the whole host at once: master and workers
            os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        wait_until(lambda: not rows() or None, killed + 2 * LEASE + 2,
                   what="the dead host's rows to go")
        gone_after = time.monotonic() - killed
        assert gone_after <= 2 * LEASE + 1.0  # stated bound 2 x lease (+ scheduling slack)
        assert c.cancel(b.url, 1).status_code == 202  # nothing to deliver to, nothing recorded
        assert list(r.scan_iter(match=prefix + "*:c")) == []
        with pytest.raises(httpx.HTTPError):
            call.result()
    r.close()


def test_a_session_in_use_outlives_its_ttl_on_other_hosts(redis_server: Any, outdir: str,
                                                          shm_name: str,
                                                          shm_names: list[str]) -> None:
    """``session_ttl`` is an idle lifetime: a session used on A every 0.25 s for twice its
    2 s TTL is still found by B (its copy in Redis was stored once, at the mint, and expired)."""
    with two_hosts(redis_server.url, outdir, shm_name, shm_names,
                   env_extra={"SHMCANCEL_TEST_SESSION_TTL": "2"}) as (a, b, _):
        c = Client(a.url)
        end = time.monotonic() + 4.0
        while time.monotonic() < end:
            r = c.post(a.url, {"jsonrpc": "2.0", "id": 1, "method": "ping"}, retry_for=0)
            assert r.status_code == 200, r.text
            time.sleep(0.25)
        reply = c.call(b.url, 2, "echo", {"text": "found"})
        assert reply.get("result", {}).get("content", [{}])[0].get("text") == "found", reply


def test_after_redis_restarts_empty_other_hosts_find_the_sessions_again(
        outdir: str, shm_name: str, shm_names: list[str]) -> None:
    """A session minted on A and never seen by B: once Redis is back (empty), A stores it
    again, so B adopts it and a cancellation sent to B reaches A's call."""
    with running() as srv, \
            two_hosts(srv.url, outdir, shm_name, shm_names) as (a, b, _):
        c = Client(a.url)
        assert c.post(a.url, {"jsonrpc": "2.0", "id": 1, "method": "ping"}).status_code == 200
        srv.kill()
        wait_until(lambda: "Redis unreachable" in a.log() or None, time.monotonic() + 20,
                   what="A to see Redis gone")
        srv.start()
        wait_until(lambda: "Redis answers again" in a.log() or None, time.monotonic() + 30,
                   what="A to see Redis back")

        def b_finds_it() -> bool | None:
            r = c.post(b.url, {"jsonrpc": "2.0", "id": 2, "method": "ping"}, retry_for=0)
            return r.status_code == 200 or None
        wait_until(b_finds_it, time.monotonic() + 10, interval=0.1,
                   what="B to find A's session")
        reply, _ = cross_cancel(a, b, outdir, c, "after-restart")
        assert reply["error"]["code"] == errors.REQUEST_CANCELLED, reply


def test_redis_killed_and_restarted(outdir: str, shm_name: str, shm_names: list[str]) -> None:
    """Redis SIGKILLed mid-run: no request fails, same-host cancellation keeps working, the
    outage is logged once per worker, and cross-host cancellation resumes after a restart."""
    with running() as srv, \
            two_hosts(srv.url, outdir, shm_name, shm_names) as (a, b, _):
            c = Client(a.url)
            reply, _ = cross_cancel(a, b, outdir, c, "before")
            assert reply["error"]["code"] == errors.REQUEST_CANCELLED

            failures: list[Any] = []
            calls = [0]
            stop = threading.Event()

            def load() -> None:  # echo on both hosts, as fast as it goes
                i = 0
                while not stop.is_set():
                    i += 1
                    url = (a.url, b.url)[i % 2]
                    try:
                        rep = c.call(url, f"e{i}", "echo", {"text": str(i)})
                        if rep.get("result", {}).get("content", [{}])[0].get("text") != str(i):
                            failures.append(rep)
                    except Exception as e:
                        failures.append(repr(e))
                    calls[0] += 1

            loader = threading.Thread(target=load, daemon=True)
            loader.start()
            try:
                def same_host_cancel(rid: str) -> None:
                    t = tag()
                    call = Background(lambda: c.call(a.url, rid, "sleep",
                                                     {"seconds": 20, "tag": t}))
                    call.start()
                    wait_file(f"{outdir}/{t}.started", time.monotonic() + 10)
                    assert c.cancel(a.url, rid).status_code == 202
                    rep = call.result()
                    assert rep["error"]["code"] == errors.REQUEST_CANCELLED, rep

                same_host_cancel("s0")
                srv.kill()
                for i in range(1, 6):
                    same_host_cancel(f"s{i}")
                before = calls[0]
                wait_until(lambda: calls[0] >= before + 20 or None, time.monotonic() + 20,
                           what="requests served while Redis is down")
                srv.start()

                def cross_works() -> bool | None:
                    rep, _ = cross_cancel_short(a, b, outdir, c)
                    return rep.get("error", {}).get("code") == errors.REQUEST_CANCELLED or None
                wait_until(cross_works, time.monotonic() + 30, interval=0.1,
                           what="cross-host cancellation to resume")
                same_host_cancel("after")
            finally:
                stop.set()
                loader.join(30)
            assert not loader.is_alive()
            assert failures == []
            log = a.log() + b.log()
            assert 1 <= log.count("Redis unreachable") <= 4  # once per worker, not per request
            assert "Redis answers again" in log


def cross_cancel_short(a: Gunicorn, b: Gunicorn, outdir: str,
                       c: Client) -> tuple[dict[str, Any], float]:
    """:func:`cross_cancel` with a sleep that ends by itself within a second when the
    cancellation does not get through."""
    t = tag()
    rid = "x" + t
    call = Background(lambda: c.call(a.url, rid, "sleep", {"seconds": 1.0, "tag": t}))
    call.start()
    wait_file(f"{outdir}/{t}.started", time.monotonic() + 10)
    acked = time.monotonic()
    assert c.cancel(b.url, rid).status_code == 202
    return call.result(), call.done_at - acked


def test_redis_stalled_costs_at_most_the_timeout(outdir: str, shm_name: str,
                                                 shm_names: list[str]) -> None:
    """A Redis that stops answering (SIGSTOP): calls on both hosts are served, each delayed by
    no more than the client timeout (0.2 s here) plus slack, same-host cancellation works, and
    after SIGCONT cross-host cancellation resumes."""
    with running() as srv, \
            two_hosts(srv.url, outdir, shm_name, shm_names) as (a, b, _):
            c = Client(a.url)
            assert c.call(b.url, 0, "echo", {"text": "x"})["result"]  # adopted on B
            with srv.paused():
                for i in range(8):
                    url = (a.url, b.url)[i % 2]
                    t0 = time.monotonic()
                    rep = c.call(url, i, "echo", {"text": str(i)})
                    assert rep["result"]["content"][0]["text"] == str(i), rep
                    assert time.monotonic() - t0 < 3.0  # generous: the bound is 0.2 s
                t = tag()
                call = Background(lambda: c.call(a.url, "s", "sleep", {"seconds": 20, "tag": t}))
                call.start()
                wait_file(f"{outdir}/{t}.started", time.monotonic() + 10)
                assert c.cancel(a.url, "s").status_code == 202
                assert call.result()["error"]["code"] == errors.REQUEST_CANCELLED

            def cross_works() -> bool | None:
                rep, _ = cross_cancel_short(a, b, outdir, c)
                return rep.get("error", {}).get("code") == errors.REQUEST_CANCELLED or None
            wait_until(cross_works, time.monotonic() + 30, interval=0.1,
                       what="cross-host cancellation to resume")


def test_quota_is_shared_across_hosts(redis_server: Any, outdir: str, shm_name: str,
                                      shm_names: list[str]) -> None:
    """contract §4's per-scope quota counts rows recorded through any host: with
    ``max_rows_per_scope=2``, two calls running on A cancelled through B are recorded (they
    see it); the third cancellation sent to B gets HTTP 429 / -32000 and its call runs on; once
    the first two end (their rows go), a cancellation through B gets through again. B's own
    registry holds no row of the scope, so only the shared count in Redis can refuse it."""
    quota = {"SHMCANCEL_TEST_MAX_ROWS_PER_SCOPE": "2"}
    with two_hosts(redis_server.url, outdir, shm_name, shm_names, a_workers=4,
                   env_extra=quota) as (a, b, _):
        c = Client(a.url)
        tags = [tag() for _ in range(3)]
        calls = [Background(lambda i=i, t=t: c.call(a.url, i, "stubborn", {"seconds": 4, "tag": t}))
                 for i, t in enumerate(tags[:2], 1)]
        calls.append(Background(lambda: c.call(a.url, 3, "sleep",
                                               {"seconds": 20, "tag": tags[2]})))
        for call in calls:
            call.start()
        for t in tags:
            wait_file(f"{outdir}/{t}.started", time.monotonic() + 10)
        for rid, t in ((1, tags[0]), (2, tags[1])):
            assert c.cancel(b.url, rid).status_code == 202
            wait_file(f"{outdir}/{t}.cancelled", time.monotonic() + 10)
        over = c.cancel(b.url, 3)
        assert over.status_code == 429, over.text
        assert over.json()["error"]["code"] == errors.SERVER_ERROR, over.text
        for call, t in zip(calls[:2], tags, strict=False):  # they end, their rows with them
            assert call.result()["error"]["code"] == errors.REQUEST_CANCELLED
            assert os.path.exists(f"{outdir}/{t}.finished")
        assert not os.path.exists(f"{outdir}/{tags[2]}.cancelled")  # ran on past the refusal
        assert calls[2].is_alive()
        assert c.cancel(b.url, 3).status_code == 202
        assert calls[2].result()["error"]["code"] == errors.REQUEST_CANCELLED


def test_redis_stalled_blocks_no_request_past_the_timeout(outdir: str, shm_name: str) -> None:
    """The issue's "nothing blocks a worker longer than the timeout", on gthread: Redis stops
    answering (SIGSTOP) and several ``tools/call`` run at once on one worker's threads; each
    one's whole Redis part (waiting for the worker's other Redis call, connecting, reading) is
    one budget of ``SHMCANCEL_REDIS_TIMEOUT``, so no request takes longer than that plus a
    generous margin for scheduling - not one timeout per thread queued before it."""
    timeout, n = 0.6, 6
    with running() as srv, host(shm_name, "A", srv.url, unique_prefix(), outdir, workers=1,
              worker_class="gthread", threads=n + 2,
              env_extra={"SHMCANCEL_REDIS_TIMEOUT": str(timeout)}) as a:
        c = Client(a.url)
        assert c.call(a.url, 0, "echo", {"text": "x"})["result"]  # Redis answers
        go = threading.Barrier(n)

        def timed(i: int) -> float:
            go.wait(10)
            t0 = time.monotonic()
            rep = c.call(a.url, i + 1, "echo", {"text": str(i)})
            assert rep["result"]["content"][0]["text"] == str(i), rep
            return time.monotonic() - t0
        calls = [Background(lambda i=i: timed(i)) for i in range(n)]
        with srv.paused():
            for call in calls:
                call.start()
            took = [call.result() for call in calls]
        assert max(took) < timeout + 0.5, took


PING = {"jsonrpc": "2.0", "id": 1, "method": "ping"}


def assert_retry_later(r: httpx.Response) -> None:
    """A 503 that asks the client to retry: ``Retry-After`` and a JSON-RPC error body."""
    assert r.status_code == 503, r.text
    assert int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["code"] == errors.SERVER_ERROR, r.text


def test_a_session_lookup_redis_cannot_answer_is_503_not_404(outdir: str, shm_name: str,
                                                              shm_names: list[str]) -> None:
    """A session minted on A, first seen by B while Redis is stopped: B cannot know whether it
    exists, so it answers 503 + Retry-After (a 404 would tell the client its session is gone for
    good), and so does a session id unknown everywhere. Once Redis answers again, the same
    session works on B and the unknown one is 404."""
    with running() as srv, two_hosts(srv.url, outdir, shm_name, shm_names) as (a, b, _):
        c = Client(a.url)
        unknown = Client(a.url)
        unknown.sid = "y" * 32  # never minted anywhere
        with srv.paused():
            assert_retry_later(c.post(b.url, PING, retry_for=0))
            assert_retry_later(c.post(b.url, PING, retry_for=0))  # the same, asked again
            assert_retry_later(unknown.post(b.url, PING, retry_for=0))
            assert c.post(a.url, PING, retry_for=0).status_code == 200  # A holds it
        wait_until(lambda: c.post(b.url, PING, retry_for=0).status_code == 200 or None,
                   time.monotonic() + 20, interval=0.05, what="B to adopt the session")
        assert c.call(b.url, 2, "echo", {"text": "back"})["result"]["content"][0]["text"] == "back"
        assert unknown.post(b.url, PING).status_code == 404
        assert "Traceback" not in a.log() + b.log()


def test_writes_made_while_redis_is_stopped_are_applied_after(outdir: str, shm_name: str,
                                                              shm_names: list[str]) -> None:
    """A session minted on A while Redis is stopped (its publish is owed) is accepted on B once
    Redis answers; a session deleted on A meanwhile (its delete is owed) ends in Redis and on B,
    which had adopted it before; a call that ended meanwhile leaves no in-flight row."""
    with running() as srv, two_hosts(srv.url, outdir, shm_name, shm_names) as (a, b, prefix):
        r = redis.Redis.from_url(srv.url)
        old = Client(a.url)
        assert old.call(b.url, 0, "echo", {"text": "x"})["result"]  # adopted on B
        with srv.paused():
            new = Client(a.url)  # minted on A: publish owed
            assert old.delete(a.url, retry_for=0).status_code == 204  # delete owed
            assert new.call(a.url, 1, "echo", {"text": "y"})["result"]  # untrack owed
        wait_until(lambda: new.post(b.url, PING).status_code == 200 or None,
                   time.monotonic() + 20, interval=0.05, what="the owed publish")
        wait_until(lambda: r.get(f"{prefix}sess:{old.sid}") is None or None,
                   time.monotonic() + 20, interval=0.05, what="the owed delete")
        wait_until(lambda: old.post(b.url, PING).status_code == 404 or None,
                   time.monotonic() + 20, interval=0.05, what="B to end the deleted session")
        wait_until(lambda: not list(r.scan_iter(match=prefix + "*:if:*")) or None,
                   time.monotonic() + 20, interval=0.05, what="no in-flight row left")
        r.close()
