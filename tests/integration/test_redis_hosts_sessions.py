"""Two hosts sharing one real Redis: what a session's DELETE and a cross-host cancellation do to
the calls and copies on the *other* host (found by the Redis-layer audit). Real redis-server;
real gunicorn where the transport matters, two bridges over two registries in this process
where an interleaving must be forced."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from helpers.background import Background, lock_held
from helpers.gunicorn_harness import wait_until
from helpers.mcp_client import tag, wait_file
from helpers.procs import Child
from helpers.redis_server import running, unique_prefix
from helpers.stalled_lock import stalled_lock
from test_redis_bridge import bridge
from test_redis_hosts import PING, Client, outdir, two_hosts

from shmcancel import Cancellation, Config, RemoteUnavailable, errors, telemetry
from shmcancel.mcp import legacy, remote, wake
from shmcancel.mcp.conn import HANDLE_KEY
from shmcancel.mcp.sessions import SessionStore
from shmcancel.redis import RedisCancellation, RedisStore, connect
from shmcancel.redis.bridge import Bridge
from shmcancel.redis.store import BOX_MAX
from shmcancel.shm.registry import Registry

__all__ = ["outdir"]  # the module fixture, shared
CANCELLED = ("shmcancel", "request", "cancelled")


def test_a_waiting_tool_is_woken_by_a_cancellation_sent_to_another_host(
        redis_server: Any, outdir: str, shm_name: str, shm_names: list[str]) -> None:
    """``wait_cancelled`` returns as soon as its call is cancelled (README): the worker that
    records a cancellation rings the doorbells. A cancellation (or a DELETE) sent to B reaches
    A's worker through its bridge, which recorded it in A's segment without ringing: the tool
    slept its whole 20 s. Nothing but a ring looks at A's waits here (``RINGS_ONLY``): the
    watcher's own look every 5 ms would otherwise hide a missing ring."""
    with two_hosts(redis_server.url, outdir, shm_name, shm_names,
                   env_extra={"SHMCANCEL_TEST_RINGS_ONLY": "1"}) as (a, b, _):
        c = Client(a.url)
        assert c.call(b.url, 0, "echo", {"text": "x"})["result"]  # adopted on B
        for how in ("notification", "delete"):
            t = tag()
            call = Background(lambda t=t: c.call(a.url, 1, "waiter", {"seconds": 20, "tag": t}))
            call.start()
            wait_file(f"{outdir}/{t}.started", time.monotonic() + 10)
            sent = time.monotonic()
            if how == "notification":
                assert c.cancel(b.url, 1).status_code == 202
            else:
                assert c.delete(b.url).status_code == 204
            reply = call.result(25)
            assert reply["error"]["code"] == errors.REQUEST_CANCELLED, (how, reply)
            assert call.done_at - sent < 5.0, how  # not the tool's 20 s


@contextlib.contextmanager
def hosts_in_process(srv: Any, shm_name: str, shm_names: list[str],
                     config: Config | None = None, *, lease: float = 30.0,
                     thread_a: bool = False, thread_b: bool = False
                     ) -> Iterator[tuple[tuple[Registry, Bridge], tuple[Registry, Bridge]]]:
    """Hosts A and B as two registries, each with a thread-less bridge (only the calls a test
    makes reach Redis; ``thread_a``, ``thread_b``: that host's thread runs), of one deployment
    (one key prefix), their in-flight rows on a ``lease`` of that many seconds. A thread-less
    bridge's alive key is set as its thread would set it first: a live worker's box."""
    cfg = config or Config(capacity=400, max_rows=200, in_flight_capacity=64,
                           session_capacity=16)
    other = shm_name + "b"
    shm_names.append(other)
    prefix = unique_prefix()
    ra, rb = Registry.create(shm_name, cfg), Registry.create(other, cfg)
    try:
        with bridge(ra, srv, prefix=prefix, host="A", lease=lease, thread=thread_a) as a, \
                bridge(rb, srv, prefix=prefix, host="B", lease=lease, thread=thread_b) as b:
            for br, threaded in ((a, thread_a), (b, thread_b)):
                if not threaded:
                    br.store.set_alive(br.remote.box, int(lease * 1000))
            yield (ra, a), (rb, b)
    finally:
        for r in (ra, rb):
            r.close()
            r.unlink()


def take_box(srv: Any, br: Bridge) -> list[bytes]:
    """What waits in ``br``'s box, oldest first (taken)."""
    r = redis.Redis.from_url(srv.url)
    out = []
    while (raw := r.rpop(br.store.box_key(br.remote.box))) is not None:
        out.append(raw)
    r.close()
    return out


def test_a_call_that_begins_on_a_while_b_deletes_its_session_is_cancelled(
        redis_server: Any, shm_name: str, shm_names: list[str]) -> None:
    """contract §6.1: DELETE cancels every request still in flight in the session. A DELETE on
    B cancels the calls Redis lists in flight, then tells A (its box) to end its copy. A call
    beginning on A in between passes its session check (A's copy is still there) and is not
    among them: ending A's copy must cancel it, as a local DELETE would (the same Dekker pair
    as the transport's: the call re-reads its session after it is tracked). It ran on."""
    with hosts_in_process(redis_server, shm_name, shm_names) as ((ra, a), (rb, b)):
        sa, sb = SessionStore(ra), SessionStore(rb)
        sid, scope = adopted(a, sa, b, sb)  # B adopts it (legacy._adopt_session)
        # B's DELETE (legacy.LegacyWire._delete), up to its cancel_scope through Redis
        assert sb.delete(sid)
        assert Cancellation(rb).cancel_scope(scope, "session deleted") == 0
        assert b.cancel_scope(scope, "session deleted") == 0
        # A call begins on A now: tracked here and in Redis, its session still found here
        handle = Cancellation(ra).begin(7, scope)
        assert handle.tracked and a.track(7, scope) is not None
        assert sa.get(sid) is not None  # the call's re-check passes: its tool runs
        b.delete_session(sid)  # the rest of B's DELETE: A is told through its box
        for raw in take_box(redis_server, a):
            a._apply(raw)  # A's bridge thread
        assert sa.get(sid) is None
        assert handle.cancelled() and handle.reason() == "session deleted"
        handle.end()


def test_a_delete_ends_the_copies_of_a_session_used_past_its_ttl(
        redis_server: Any, outdir: str, shm_name: str, shm_names: list[str]) -> None:
    """``session_ttl`` is an idle lifetime: a session in use lives on, in Redis too (each
    holder renews its copy). The set of its holders' boxes, which a DELETE tells, must live as
    long: it was given the TTL once, at the store, and renewals left it to expire, so a DELETE
    on A after two TTLs of use told nobody; B served the session on (and stored it again in
    Redis at its next renewal)."""
    with two_hosts(redis_server.url, outdir, shm_name, shm_names,
                   env_extra={"SHMCANCEL_TEST_SESSION_TTL": "2"}) as (a, b, prefix):
        r = redis.Redis.from_url(redis_server.url)
        c = Client(a.url)
        assert c.call(b.url, 0, "echo", {"text": "x"})["result"]  # adopted on B
        boxes = f"{prefix}sess:{c.sid}:boxes"
        end = time.monotonic() + 5.0  # two and a half TTLs, in use on both hosts
        i = 0
        while time.monotonic() < end:
            i += 1
            # a 503 (Redis slow to answer under load) is retried as a client does; a 404 fails
            assert c.post((a.url, b.url)[i % 2], PING).status_code == 200
            time.sleep(0.1)  # the client's pace, not a synchronisation
        assert r.exists(f"{prefix}sess:{c.sid}") and r.exists(boxes)
        assert c.delete(a.url).status_code == 204
        wait_until(lambda: c.post(b.url, PING, retry_for=0).status_code == 404 or None,
                   time.monotonic() + 10, interval=0.1, what="B to end its copy")
        assert not r.exists(f"{prefix}sess:{c.sid}")
        r.close()


def adopted(a: Bridge, sa: SessionStore, b: Bridge, sb: SessionStore) -> tuple[str, str]:
    """A session minted on A and adopted on B: its id and scope."""
    s = sa.create("2025-11-25", "ip:203.0.113.9")
    a.publish_session(s.id, s.protocol_version, "ip:203.0.113.9")
    got = b.lookup_session(s.id)
    assert got is not None and sb.create(*got, session_id=s.id) is not None
    return s.id, f"session:{s.id}"


def test_a_delete_between_an_adoptions_store_and_its_insert_ends_the_copy(
        redis_server: Any, shm_name: str, shm_names: list[str]) -> None:
    """An adoption (legacy._adopt_session) stores the session in Redis, listing this worker
    among its holders, then inserts the copy here. A DELETE on A in between told this worker,
    whose bridge found no copy to end; the insert then made one, served until a renewal was
    refused (a minute), or for good once Redis forgot the end. The bridge now marks the
    session ended before it ends the copy, and the adoption looks after its insert."""
    with hosts_in_process(redis_server, shm_name, shm_names) as ((ra, a), (rb, b)):
        sa, sb = SessionStore(ra), SessionStore(rb)
        s = sa.create("2025-11-25", "ip:203.0.113.9")
        a.publish_session(s.id, s.protocol_version, "ip:203.0.113.9")
        lookup = b.lookup_session

        def lookup_then_delete(sid: str, may_use: Any = None) -> Any:
            got = lookup(sid, may_use)  # stored, B listed: now A's DELETE, told to B
            assert sa.delete(sid)
            a.delete_session(sid)
            told = take_box(redis_server, b)
            assert [RedisStore.decode_box_item(x) for x in told] == [sid]
            for raw in told:
                b._apply(raw)  # B's bridge thread, before the insert
            return got

        b.lookup_session = lookup_then_delete  # type: ignore[method-assign]
        st = types.SimpleNamespace(sessions=sb)
        saved = remote._provider  # the bridge module's: this process's bridge
        remote.install(lambda: b)
        try:
            assert legacy._adopt_session(st, s.id, {"REMOTE_ADDR": "203.0.113.9"}) is None
        finally:
            remote.install(saved)
        assert sb.get(s.id) is None
        assert b.session_ended(s.id)


def test_two_registries_under_one_host_name_are_two_hosts_to_a_session_end(
        redis_server: Any, shm_name: str, shm_names: list[str]) -> None:
    """Two servers on one machine (or containers sharing its name) have one host id and a
    registry each, and each registry keeps its own copy of an adopted session. A DELETE took
    them for one host: told through B's live holder, it told no worker of the other registry,
    whose only holder had stopped, and that copy was served on. A box's host part now names its
    registry too."""
    with hosts_in_process(redis_server, shm_name, shm_names) as ((ra, a), (rb, b)):
        rc = Registry.create(shm_name + "c", ra.config)
        shm_names.append(shm_name + "c")
        try:
            with bridge(rc, redis_server, prefix=a.store.prefix, host="B") as c1, \
                    bridge(rc, redis_server, prefix=a.store.prefix, host="B") as c2:
                sa, sb, sc = SessionStore(ra), SessionStore(rb), SessionStore(rc)
                sid, _scope = adopted(a, sa, b, sb)
                got = c1.lookup_session(sid)  # the second server adopts it too
                assert got is not None and sc.create(*got, session_id=sid) is not None
                for live in (b, c2):
                    live.store.set_alive(live.remote.box, 10_000)  # as their threads do
                c1.store.box_stopped(c1.remote.box)  # its only holder recycled
                assert sa.delete(sid)
                a.delete_session(sid)
                told = take_box(redis_server, c2)
                assert [RedisStore.decode_box_item(x) for x in told] == [sid]
                for raw in told:
                    c2._apply(raw)
                assert sc.get(sid) is None
        finally:
            rc.close()
            rc.unlink()


def test_a_delete_made_before_the_holders_store_their_sessions_again_is_not_undone(
        shm_name: str, shm_names: list[str]) -> None:
    """Redis restarts empty while A runs a call in a session B adopted; the client's DELETE
    reaches B before A's bridge has stored its sessions again (its probe comes every 0.5 s).
    Redis lists no call in flight and no holder to tell, so only A's recovery can learn of the
    DELETE: it stored the session again (alive everywhere, for any host to adopt) and its call
    ran on."""
    with running() as srv, hosts_in_process(srv, shm_name, shm_names) as ((ra, a), (rb, b)):
        sa, sb = SessionStore(ra), SessionStore(rb)
        sid, scope = adopted(a, sa, b, sb)
        handle = Cancellation(ra).begin(7, scope)
        assert handle.tracked and a.track(7, scope) is not None
        srv.kill()
        srv.start()  # empty
        assert sb.delete(sid)  # B's DELETE, answered by the Redis that lost everything
        assert b.cancel_scope(scope, "session deleted") == 0
        b.delete_session(sid)
        assert b.owed() == 0
        assert a.remote.renew() == 1  # A's recovery, as its thread runs it after an outage
        assert a._republish() == 1
        a._settle()
        assert a.owed() == 0
        r = redis.Redis.from_url(srv.url)
        assert not r.exists(a.store._sess_key(sid))
        r.close()
        assert sa.get(sid) is None
        assert handle.cancelled() and handle.reason() == "session deleted"
        handle.end()


def test_a_holders_renewal_racing_a_delete_does_not_store_the_session_again(
        redis_server: Any, shm_name: str, shm_names: list[str]) -> None:
    """A DELETE on A tells B through its box; B, serving the session before its bridge thread
    read the box, renewed its copy in Redis, found it gone and stored it again: once B had
    applied the DELETE no host held the session, yet it lived on in Redis, for a third host
    to adopt."""
    with hosts_in_process(redis_server, shm_name, shm_names) as ((ra, a), (rb, b)):
        sa, sb = SessionStore(ra), SessionStore(rb)
        sid, _ = adopted(a, sa, b, sb)
        assert sa.delete(sid)
        a.delete_session(sid)
        b._kept.pop(sid)  # B's renewal of its copy is due (a minute has passed)
        b.keep_session(sid)  # a request on B, before B's thread reads its box
        for raw in take_box(redis_server, b):
            b._apply(raw)
        assert sb.get(sid) is None
        with bridge(ra, redis_server, prefix=a.store.prefix, host="C") as c:
            assert c.lookup_session(sid) is None


def test_a_cancellation_in_the_box_of_a_host_stalled_past_its_lease_still_lands(
        redis_server: Any, shm_name: str, shm_names: list[str]) -> None:
    """Host A is cut off from Redis (a partition: its bridge reads neither its box nor renews)
    while its call runs; a cancellation sent to B in time finds the call in flight and waits in
    A's box. The cut outlasts the lease: the box expires with what it held. When A is back, its
    renewal finds its row's lease run out and must add the row back with the cancellation
    recorded for it: the row was only extended and the cancellation was lost (its row sat in
    Redis, never delivered)."""
    with hosts_in_process(redis_server, shm_name, shm_names, lease=0.5) as ((ra, a), (_, b)):
        handle = _tracked_on_a(ra, a)
        assert b.cancel(7, "stop", "session:s") is True  # in A's box now
        r = redis.Redis.from_url(redis_server.url)
        box = a.store.box_key(a.remote.box)
        wait_until(lambda: not r.exists(box) or None, time.monotonic() + 10,
                   what="A's box to expire while A is cut off")
        r.close()
        a.remote.renew()  # A is back: its thread renews, then reads its box
        for raw in take_box(redis_server, a):
            a._apply(raw)
        assert handle.cancelled() and handle.reason() == "stop"
        handle.end()


def test_a_call_on_a_host_stopped_past_its_lease_is_cancelled_when_it_resumes(
        redis_server: Any, outdir: str, shm_name: str, shm_names: list[str]) -> None:
    """End to end: host A SIGSTOPped (master and workers) right after its call started, and
    kept stopped until its worker's box has expired. The cancellation sent to B meanwhile is
    not lost: Redis hands it to the BLPOP the stopped bridge thread had under way (it waits in
    the socket), or, had the lease run out first, it waits in Redis as a pending one. On
    SIGCONT the call ends with -32800."""
    with two_hosts(redis_server.url, outdir, shm_name, shm_names) as (a, b, prefix):
        r = redis.Redis.from_url(redis_server.url)
        c = Client(a.url)
        assert c.call(b.url, 0, "echo", {"text": "x"})["result"]  # adopted on B
        t = tag()
        call = Background(lambda: c.call(a.url, 1, "sleep", {"seconds": 20, "tag": t}))
        call.start()
        pid = int(wait_file(f"{outdir}/{t}.started", time.monotonic() + 10))
        tree = a._tree()
        for p in tree:
            os.kill(p, signal.SIGSTOP)
        try:
            assert c.cancel(b.url, 1).status_code == 202
            wait_until(lambda: not list(r.scan_iter(match=f"{prefix}box:A:{pid}:*")) or None,
                       time.monotonic() + 10, interval=0.05, what="A's box to expire")
        finally:
            for p in tree:
                os.kill(p, signal.SIGCONT)
        reply = call.result(25)
        assert reply["error"]["code"] == errors.REQUEST_CANCELLED, reply
        r.close()


def test_workers_of_two_hosts_named_alike_with_the_same_pid_keep_apart(
        redis_server: Any, shm_name: str, shm_names: list[str]) -> None:
    """Two containers on one machine with host networking share its host name (the default
    ``SHMCANCEL_HOST_ID``) and, each in its own pid namespace, number their workers alike: two
    bridges of one process with one host id are those two workers. Their box was one list, so
    a cancellation for a call on one went to whichever read first, and the other dropped it."""
    with hosts_in_process(redis_server, shm_name, shm_names) as ((ra, a), (rb, _)), \
            bridge(ra, redis_server, prefix=a.store.prefix, host="A") as twin, \
            bridge(rb, redis_server, prefix=a.store.prefix, host="C") as c:
        handle = Cancellation(ra).begin(7, "session:s")
        assert handle.tracked and a.track(7, "session:s") is not None
        assert c.cancel(7, "stop", "session:s") is True
        assert take_box(redis_server, twin) == []  # the twin's thread reads nothing of a's
        for raw in take_box(redis_server, a):
            a._apply(raw)
        assert handle.cancelled() and handle.reason() == "stop"
        handle.end()


def test_a_box_overwritten_by_another_client_is_given_back(
        redis_server: Any, shm_name: str, shm_names: list[str]) -> None:
    """Someone with Redis access writes a string over a worker's box. Every cancellation for
    that worker's calls then failed with WRONGTYPE on every host (each failure counting
    towards marking the canceller's Redis down), and the worker's thread, failing its reads,
    kept the key alive with its renewals: it never recovered. Its thread mends the key."""
    cfg = Config(capacity=400, max_rows=200, in_flight_capacity=64, session_capacity=16)
    with hosts_in_process(redis_server, shm_name, shm_names, cfg) as ((ra, a), _):
        a.start()  # A's thread reads its box
        handle = Cancellation(ra).begin(7, "session:s")
        assert handle.tracked and a.track(7, "session:s") is not None
        r = redis.Redis.from_url(redis_server.url)
        r.set(a.store.box_key(a.remote.box), b"garbage")
        other = RedisCancellation(RedisStore(connect(redis_server.url, timeout=2.0), cfg,
                                             prefix=a.store.prefix), host="B")

        def cancelled_through_b() -> bool | None:
            try:
                return other.cancel_if_in_flight(7, "stop", "session:s") or None
            except redis.ResponseError:
                return None
        wait_until(cancelled_through_b, time.monotonic() + 10, interval=0.05,
                   what="a cancellation to reach A's box")
        wait_until(lambda: handle.cancelled() or None, time.monotonic() + 10,
                   what="A's thread to deliver it")
        assert handle.reason() == "stop"
        handle.end()
        r.close()


def _small(**kw: Any) -> Config:
    """A small registry's config for in-process hosts (``kw``: what a test sets besides)."""
    return Config(capacity=400, max_rows=200, in_flight_capacity=64, session_capacity=16, **kw)


# Hosts whose registry lock a stopped holder stalls past a short lock_timeout.
STALLS = _small(lock_timeout=0.3)


def _tracked_on_a(ra: Registry, a: Bridge) -> Any:
    """Request 7 of scope ``session:s`` in flight on host A, here and in Redis: its handle."""
    handle = Cancellation(ra).begin(7, "session:s")
    assert handle.tracked and a.track(7, "session:s") is not None
    return handle


def _taken_while_stalled(srv: Any, a: Bridge, spawn: Callable[..., Child], name: str,
                         handle: Any) -> None:
    """A's bridge takes the one cancellation in its box while a stopped process holds the
    lock of registry ``name``: kept for retry (waiting ``lock_timeout`` first), not recorded."""
    with stalled_lock(spawn, name):
        raws = take_box(srv, a)
        assert len(raws) == 1
        a._apply(raws[0])
        assert not handle.cancelled() and a.undelivered() == 1 and a.owed() == 0


def test_a_cancellation_taken_from_the_box_while_the_lock_is_stalled_still_lands(
        redis_server: Any, shm_name: str, shm_names: list[str],
        spawn: Callable[..., Child]) -> None:
    """A's bridge takes a cancellation out of its box while a live process holds A's registry
    lock past ``lock_timeout`` (or /dev/shm is full: the same path, ``TableFull``). It is out of
    Redis, so it must be kept and recorded once the registry takes it (within CANCEL_TTL): it
    was logged and dropped, and the call ran on."""
    with hosts_in_process(redis_server, shm_name, shm_names, STALLS) as ((ra, a), (_, b)):
        handle = _tracked_on_a(ra, a)
        assert b.cancel(7, "stop", "session:s") is True  # in A's box now
        _taken_while_stalled(redis_server, a, spawn, shm_name, handle)
        a._redeliver()  # the bridge thread's next turn
        assert handle.cancelled() and handle.reason() == "stop" and a.undelivered() == 0
        handle.end()


def test_a_session_end_taken_from_the_box_while_the_lock_is_stalled_still_lands(
        redis_server: Any, shm_name: str, shm_names: list[str],
        spawn: Callable[..., Child]) -> None:
    """contract §6.1: a DELETE on B tells A, through its box, to end its copy of the session
    and cancel its calls there. Taken out of the box while a live process holds A's registry
    lock past ``lock_timeout``, that end was logged and dropped: A's copy stayed and its call
    ran on. It is kept (counted in ``undelivered``) and lands on the thread's next turn."""
    with hosts_in_process(redis_server, shm_name, shm_names, STALLS) as ((ra, a), (rb, b)):
        sa, sb = SessionStore(ra), SessionStore(rb)
        sid, scope = adopted(a, sa, b, sb)  # B adopts it (legacy._adopt_session)
        handle = Cancellation(ra).begin(7, scope)
        assert handle.tracked
        b.delete_session(sid)  # B's DELETE tells A through its box
        with stalled_lock(spawn, shm_name):
            raws = take_box(redis_server, a)
            assert len(raws) == 1
            assert a._apply(raws[0]) is False  # the lock timed out: the thread waits a turn
            assert not handle.cancelled() and a.undelivered() == 1
        assert a._redeliver()  # the bridge thread's next turn
        assert a.undelivered() == 0 and sa.get(sid) is None
        assert handle.cancelled() and handle.reason() == "session deleted"
        handle.end()


@pytest.mark.parametrize("stall", ["ending the copy", "after the copy went"])
def test_a_session_end_retried_after_a_stall_reports_each_call_cancelled_once(
        redis_server: Any, shm_name: str, shm_names: list[str], stall: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """contract §4.7: a session end taken from A's box cancels A's calls, ends A's copy, then
    cancels again; a lock stall at either of the last two steps keeps the end for the thread's
    next turn. That turn ran the whole end again and reported every call a second time (its
    first pass had reported them already). Each call is reported once."""
    seen: list[dict[str, Any]] = []
    telemetry.attach("test-end-retried", CANCELLED, lambda e, m, md, cfg: seen.append(md))
    with hosts_in_process(redis_server, shm_name, shm_names, STALLS) as ((ra, a), (rb, b)):
        sa, sb = SessionStore(ra), SessionStore(rb)
        sid, scope = adopted(a, sa, b, sb)  # B adopts it (legacy._adopt_session)
        handle = Cancellation(ra).begin(7, scope)
        holding, release = threading.Event(), threading.Event()

        def hold() -> None:
            with ra.lock:
                holding.set()
                release.wait(10)

        holder = threading.Thread(target=hold, daemon=True)
        store = a._session_store()
        delete = store.delete

        def delete_with_a_stall(sid: str) -> bool:
            if stall == "ending the copy":
                holder.start()
                assert holding.wait(10)
            done = delete(sid)
            if stall == "after the copy went":
                holder.start()
                assert holding.wait(10)
            return done

        try:
            b.delete_session(sid)  # B's DELETE tells A through its box
            raws = take_box(redis_server, a)
            assert len(raws) == 1
            monkeypatch.setattr(store, "delete", delete_with_a_stall)
            assert a._apply(raws[0]) is False  # the lock timed out: the thread waits a turn
            assert a.undelivered() == 1
            release.set()
            holder.join(10)
            monkeypatch.setattr(store, "delete", delete)
            assert a._redeliver()  # the bridge thread's next turn
            assert a.undelivered() == 0 and sa.get(sid) is None
            assert handle.cancelled() and handle.reason() == "session deleted"
            assert [e["request_id"] for e in seen] == ["7"], seen
        finally:
            release.set()
            telemetry.detach("test-end-retried")
            handle.end()


def test_a_box_nobody_reads_keeps_its_newest_items_only(
        redis_server: Any, shm_name: str, shm_names: list[str]) -> None:
    """Bounded memory: every cancellation of a running call pushes an item into its worker's
    box, a repeated one too (a client resending notifications/cancelled for one id: the quota
    counts rows, and the row is overwritten in place). A box its worker does not read (its
    registry lock stalled, so the bridge leaves the box in Redis) grew by one item a
    notification, each push renewing its lease; it keeps its newest BOX_MAX items."""
    with hosts_in_process(redis_server, shm_name, shm_names, STALLS) as ((ra, a), (_, b)):
        handle = _tracked_on_a(ra, a)
        for i in range(BOX_MAX + 500):  # A's bridge thread does not run: nobody reads its box
            assert b.cancel(7, f"stop {i}", "session:s") is True
        r = redis.Redis.from_url(redis_server.url)
        try:
            box = a.store.box_key(a.remote.box)
            assert r.llen(box) == BOX_MAX
            newest = RedisStore.decode_box_item(r.lindex(box, 0))
        finally:
            r.close()
        assert isinstance(newest, tuple) and newest[2] == f"stop {BOX_MAX + 499}", newest
        handle.end()


def test_a_session_end_stalled_after_cancelling_its_calls_wakes_them(
        redis_server: Any, shm_name: str, shm_names: list[str],
        monkeypatch: pytest.MonkeyPatch, rings_only: None) -> None:
    """README: ``wait_cancelled`` returns as soon as its call is cancelled. A session end taken
    from A's box cancels A's calls, then ends A's copy; a lock stall there kept the end for a
    later turn and rang no bell (only an end that got through rang), so a call it had cancelled
    slept in ``wait_cancelled`` for as long as the stall lasted, as 5b4af98 fixed for a local
    DELETE."""
    with hosts_in_process(redis_server, shm_name, shm_names, STALLS) as ((ra, a), (rb, b)):
        sa, sb = SessionStore(ra), SessionStore(rb)
        sid, scope = adopted(a, sa, b, sb)  # B adopts it (legacy._adopt_session)
        handle = Cancellation(ra).begin(7, scope)
        waiter = Background(lambda: wake.wait_cancelled({HANDLE_KEY: handle}, 30))
        stall = contextlib.ExitStack()
        store = a._session_store()
        delete = store.delete

        def stall_then_delete(sid: str) -> bool:
            stall.enter_context(lock_held(ra, hold_for=20))  # another thread keeps the lock
            return delete(sid)

        try:
            waiter.start()
            end = time.monotonic() + 10
            while wake.waiting() < 1:  # its wait registered: only a ring ends it (rings_only)
                assert time.monotonic() < end, "the waiter never waited"
                time.sleep(0.001)
            b.delete_session(sid)  # B's DELETE tells A through its box
            raws = take_box(redis_server, a)
            assert len(raws) == 1
            monkeypatch.setattr(store, "delete", stall_then_delete)
            assert a._apply(raws[0]) is False  # the lock timed out: the end is kept
            assert handle.cancelled()  # by the pass before the copy went
            assert waiter.result(5) is True, "the cancelled call was not woken"
        finally:
            stall.close()
            monkeypatch.undo()
            handle.end()
            waiter.join(35)


RETRYING = "could not apply a cross-host cancellation"


def test_a_cancellation_kept_for_a_stalled_lock_is_retried_quietly_not_as_a_redis_write(
        redis_server: Any, shm_name: str, shm_names: list[str],
        spawn: Callable[..., Child], caplog: pytest.LogCaptureFixture) -> None:
    """The bridge thread keeps retrying, turn after turn, a cancellation the registry could not
    take (its lock stalled). Retrying it is local work: it was counted as an owed Redis write
    applied (``owed_applied``) at every turn, reset the count of failed Redis calls
    (``_answered``), and logged a warning at every turn: once, and once more if given up, is
    the log a worker needs. (While the holder stays stalled, a turn does not even try.)"""
    caplog.set_level(logging.DEBUG, logger="shmcancel.redis")
    with hosts_in_process(redis_server, shm_name, shm_names, STALLS) as ((ra, a), (_, b)):
        handle = _tracked_on_a(ra, a)
        assert b.cancel(7, "stop", "session:s") is True
        with stalled_lock(spawn, shm_name):
            raws = take_box(redis_server, a)
            assert len(raws) == 1
            a._apply(raws[0])  # the thread's read: the lock stalled, kept for retry
            assert a.undelivered() == 1
            a.start()
            until = time.monotonic() + 6 * STALLS.lock_timeout  # turns of a stalled lock
            while time.monotonic() < until:
                assert not handle.cancelled() and a.undelivered() == 1
                time.sleep(0.05)
        wait_until(handle.cancelled, time.monotonic() + 5, what="the cancellation to land")
        assert handle.reason() == "stop"
        assert a.owed_applied == 0 and a.owed() == 0  # no Redis write was ever owed
        warned = [r for r in caplog.records
                  if RETRYING in r.getMessage() and r.levelno >= logging.WARNING]
        assert len(warned) == 1, [r.getMessage() for r in warned]
        handle.end()


def test_a_stalled_lock_leaves_the_box_in_redis_and_every_cancellation_lands_after(
        redis_server: Any, shm_name: str, shm_names: list[str],
        spawn: Callable[..., Child]) -> None:
    """While A's registry lock is held by a stopped process, A's bridge thread took every item
    out of its box, each after its own ``lock_timeout`` wait: 1000 of them cost a turn of
    1000 waits (10 000 s at the default), with no lease renewed meanwhile. A turn now stops at
    the first lock timeout, and the next turns retry what they hold without taking more out of
    Redis; once the holder goes, every cancellation lands."""
    n = 30
    with hosts_in_process(redis_server, shm_name, shm_names, STALLS) as ((ra, a), (_, b)):
        c = Cancellation(ra)
        handles = []
        for i in range(1, n + 1):
            h = c.begin(i, "session:s")
            assert h.tracked and a.track(i, "session:s") is not None
            handles.append(h)
        for i in range(1, n + 1):
            assert b.cancel(i, "stop", "session:s") is True  # in A's box now
        box = a.store.box_key(a.remote.box)
        r = redis.Redis.from_url(redis_server.url)
        try:
            assert r.llen(box) == n
            with stalled_lock(spawn, shm_name):
                a.start()
                # Six lock timeouts' worth of turns: the old thread took one more item out of
                # the box per timeout; this one sees the holder stalled and takes none.
                seen = []
                until = time.monotonic() + 6 * STALLS.lock_timeout
                while time.monotonic() < until:
                    seen.append((r.llen(box), a.undelivered()))
                    time.sleep(0.05)
                assert min(q for q, _ in seen) == n, seen
                assert max(u for _, u in seen) == 0, seen
                assert not any(h.cancelled() for h in handles)
            wait_until(lambda: all(h.cancelled() for h in handles), time.monotonic() + 15,
                       what="every cancellation to land")
            assert r.llen(box) == 0 and a.undelivered() == 0
        finally:
            r.close()
            for h in handles:
                h.end()


def test_leases_are_renewed_while_the_lock_is_stalled(
        redis_server: Any, shm_name: str, shm_names: list[str],
        spawn: Callable[..., Child]) -> None:
    """A's registry lock is held by a stopped process past ``lock_timeout``, which is longer
    than A's lease. A's bridge thread waited ``lock_timeout`` on it every turn (to apply the
    cancellation it took out of its box, then to retry it), renewing its leases only between
    the waits: its calls' rows lapsed in Redis (here a 3 s timeout, a 1.5 s lease), and a
    cancellation sent meanwhile found them not in flight and was dropped. It now sees the
    holder stalled and does not wait on it: the leases stay, and the cancellation lands once
    the lock is free."""
    cfg = _small(lock_timeout=3.0)
    r = redis.Redis.from_url(redis_server.url)
    try:
        with hosts_in_process(redis_server, shm_name, shm_names, cfg, lease=1.5,
                              thread_a=True) as ((ra, a), (_, b)):
            handle = _tracked_on_a(ra, a)
            rows = a.store.if_key("session:s", "7")

            def lease_left_ms() -> float:
                got = r.zrange(rows, 0, -1, withscores=True)
                return max((score for _, score in got), default=0) - time.time() * 1000

            with stalled_lock(spawn, shm_name):
                assert b.cancel(7, "stop", "session:s") is True  # in A's box now
                until = time.monotonic() + 2 * cfg.lock_timeout
                while time.monotonic() < until:
                    assert lease_left_ms() > 0, "the row's lease lapsed in Redis"
                    time.sleep(0.02)
                assert not handle.cancelled()
            wait_until(handle.cancelled, time.monotonic() + 10, what="the cancellation to land")
            assert handle.reason() == "stop"
            handle.end()
    finally:
        r.close()


def test_a_cancellation_kept_for_a_stalled_lock_lands_while_redis_is_down(
        shm_name: str, shm_names: list[str], spawn: Callable[..., Child]) -> None:
    """A cancellation taken out of the box that the registry could not take then is kept for
    ``CANCEL_TTL``; applying it needs the registry only. Redis going down meanwhile stopped it:
    the thread only probed Redis while it was down, and the cancellation expired unapplied (the
    call ran on)."""
    with running() as srv, \
            hosts_in_process(srv, shm_name, shm_names, STALLS) as ((ra, a), (_, b)):
        handle = _tracked_on_a(ra, a)
        assert b.cancel(7, "stop", "session:s") is True  # in A's box now
        _taken_while_stalled(srv, a, spawn, shm_name, handle)
        srv.kill()
        with pytest.raises(RemoteUnavailable):
            a.lookup_session("s" * 32)  # connection refused: the bridge is down
        assert a.down
        a.start()
        wait_until(handle.cancelled, time.monotonic() + 5, what="the cancellation to land")
        assert handle.reason() == "stop" and a.down
        handle.end()


def test_concurrent_first_requests_of_a_session_on_another_host_are_all_served(
        redis_server: Any, outdir: str, shm_name: str, shm_names: list[str]) -> None:
    """contract §6.1: sessions are accepted by every worker (and, with Redis, every host), and
    a client's session is never displaced but by its own minting. The first requests of a
    session on B race to adopt it there: the second adoption found the id already stored, gave
    up another session of the same client to make room for it, listed the id twice and raised
    a "session id collision", which the request answered 404 (its session gone, for the
    client, when it was not)."""
    import threading

    with two_hosts(redis_server.url, outdir, shm_name, shm_names) as (a, b, _):
        statuses: list[int] = []
        for _ in range(15):
            c = Client(a.url)
            go = threading.Barrier(4)

            def first(c: Client = c, go: threading.Barrier = go) -> None:
                go.wait(10)
                statuses.append(c.post(b.url, PING, retry_for=0).status_code)

            threads = [threading.Thread(target=first) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            assert not any(t.is_alive() for t in threads)
        assert [s for s in statuses if s != 200] == []


def test_a_deleted_session_does_not_count_against_its_client_in_redis(
        redis_server: Any, shm_name: str, shm_names: list[str]) -> None:
    """contract §6.1: sessions are bounded per client, and a client's live sessions are served by
    every host. sessions_per_client=2: the client mints s1 and s2 on A, deletes s2, mints s3.
    It holds two sessions, its bound, yet Redis still counted the deleted s2 (session_delete.lua
    left it in the client's set) and gave up s1 for s3: B answered s1 404 (lookup: no such
    session), though A serves it on."""
    cfg = _small(sessions_per_client=2)
    with hosts_in_process(redis_server, shm_name, shm_names, cfg) as ((ra, a), (_rb, b)):
        sa, client = SessionStore(ra), "ip:203.0.113.77"
        s1, s2 = sa.create("2025-11-25", client), sa.create("2025-11-25", client)
        for s in (s1, s2):
            a.publish_session(s.id, s.protocol_version, client)
        assert sa.delete(s2.id)
        a.delete_session(s2.id)  # A's DELETE of s2 (legacy.LegacyWire._delete)
        s3 = _mint(a, sa, client)
        assert sa.get(s1.id) is not None and sa.get(s3.id) is not None
        assert b.lookup_session(s1.id) == ("2025-11-25", client)
        assert b.lookup_session(s3.id) == ("2025-11-25", client)
        assert a.owed() == 0 and b.owed() == 0


def test_a_client_keeps_its_session_bound_in_redis_past_one_session_ttl(
        redis_server: Any, shm_name: str, shm_names: list[str]) -> None:
    """contract §6.1: sessions are bounded per client (README: "at most sessions_per_client per
    client there"). A session in use is renewed in Redis (keep_session), but the client's set of
    sessions was not: it expired one session_ttl after the client's last mint, so its sessions
    in use were counted no more and every mint after that added to them (here three sessions
    in Redis for a bound of two; a client keeping its sessions busy had no bound at all)."""
    with hosts_in_process(redis_server, shm_name, shm_names, BOUND_2) as ((ra, a), (_rb, _b)):
        sa, client = SessionStore(ra), "ip:203.0.113.78"
        # a request of each: renewed every ttl/4 at most
        kept = _two_sessions_in_use(sa, a, client, lambda s: a.keep_session(s.id))
        _a_third_mint_leaves_two(redis_server, a, sa, client, kept)


def test_a_session_end_reaches_a_live_worker_when_its_hosts_holders_stopped(
        redis_server: Any, shm_name: str, shm_names: list[str]) -> None:
    """A session's end skips the box of a stopped holder (nobody reads it). When every holder
    of host B stopped, one live box of B is told instead (its alive key set): its worker never
    held the session, yet ends B's copy and cancels the call begun on it since A's DELETE
    cancelled those Redis listed, as a holder would. Nobody on B was told."""
    with hosts_in_process(redis_server, shm_name, shm_names) as ((ra, a), (rb, b1)), \
            bridge(rb, redis_server, prefix=a.store.prefix, host="B") as b2:
        sa, sb = SessionStore(ra), SessionStore(rb)
        sid, scope = adopted(a, sa, b1, sb)  # b1 adopts it: B's only holder
        b1.keep_session(sid)
        b2.store.set_alive(b2.remote.box, 10_000)  # as b2's thread does
        b1.store.box_stopped(b1.remote.box)  # b1's worker exits
        handle = Cancellation(rb).begin(7, scope)  # a call begins on B, in another worker
        assert handle.tracked and sb.get(sid) is not None
        assert sa.delete(sid)  # A's DELETE
        assert Cancellation(ra).cancel_scope(scope, "session deleted") == 0
        a.delete_session(sid)
        assert take_box(redis_server, b1) == []
        told = take_box(redis_server, b2)
        assert [RedisStore.decode_box_item(x) for x in told] == [sid]
        for raw in told:
            b2._apply(raw)  # b2's bridge thread
        assert sb.get(sid) is None
        assert handle.cancelled() and handle.reason() == "session deleted"
        handle.end()


def test_a_delete_ends_a_copy_whose_adopting_worker_has_died(
        redis_server: Any, outdir: str, shm_name: str, shm_names: list[str]) -> None:
    """README: a DELETE on any host ends the copies other hosts adopted. A copy lives in its
    host's registry, for every worker there; only the box of the worker that adopted it was
    told. Once that worker had died (killed, recycled by max_requests), the DELETE on B told a
    dead box: host A went on serving the deleted session (200) until its idle TTL."""
    with two_hosts(redis_server.url, outdir, shm_name, shm_names, a_workers=1) as (a, b, _p):
        c = Client(b.url)
        assert c.post(a.url, PING).status_code == 200  # adopted on A by its only worker
        (old,) = a.worker_pids()
        os.kill(old, signal.SIGKILL)
        wait_until(lambda: (a.worker_pids() not in ([], [old])) or None,
                   time.monotonic() + 20, what="A's new worker")
        assert c.post(a.url, PING).status_code == 200  # the copy outlives its adopter
        assert c.delete(b.url).status_code == 204
        wait_until(lambda: c.post(a.url, PING, retry_for=0).status_code == 404 or None,
                   time.monotonic() + 10, interval=0.1, what="A to end its copy")


@pytest.mark.parametrize("how", ["recycled", "killed"])
def test_a_delete_ends_a_copy_whose_only_holder_is_gone(
        redis_server: Any, outdir: str, shm_name: str, shm_names: list[str], how: str) -> None:
    """README: a DELETE on any host ends the copies other hosts adopted. B's copy lives in its
    registry for both its workers, but only the one that adopted it was listed among the
    holders. Recycled (SIGTERM, as max_requests does), its box was marked stopped, and a DELETE
    skips stopped boxes; killed outright (SIGKILL: the OOM killer), its box was never marked, so
    the DELETE counted B told through a box nobody reads. Either way no live worker of B was
    told, and B served the deleted session on (past the gone marker, storing it again). Now a
    live box of B is told (for a killed holder once its alive key expired with it), and its
    worker, which never held the session, ends B's copy."""
    with two_hosts(redis_server.url, outdir, shm_name, shm_names, a_workers=1) as (a, b, prefix):
        b_registry = shm_names[-1]  # two_hosts' second registry
        r = redis.Redis.from_url(redis_server.url)
        c = Client(a.url)
        assert c.post(b.url, PING).status_code == 200  # adopted on B by one of its workers
        (holder,) = [m.decode() for m in r.smembers(f"{prefix}sess:{c.sid}:boxes")
                     if m.startswith(b"B/")]
        pid = int(holder.split(":")[1])
        assert pid in b.worker_pids()
        if how == "recycled":
            os.kill(pid, signal.SIGTERM)  # its bridge marks its box stopped
            wait_until(lambda: r.zscore(f"{prefix}{{g}}:stopped", holder) is not None or None,
                       time.monotonic() + 20, interval=0.05, what="the holder's stopped mark")
        else:
            os.kill(pid, signal.SIGKILL)  # no exit hook runs: its box is never marked stopped
            wait_until(lambda: not r.exists(f"{prefix}alive:{holder}") or None,
                       time.monotonic() + 20, interval=0.05, what="its alive key to expire")
        wait_until(lambda: (len(p := b.worker_pids()) == 2 and pid not in p) or None,
                   time.monotonic() + 20, what="B's new worker")
        assert (r.zscore(f"{prefix}{{g}}:stopped", holder) is None) == (how == "killed")
        assert c.delete(a.url).status_code == 204
        with Registry.attach(b_registry) as reg:
            sb = SessionStore(reg)
            wait_until(lambda: sb.get(c.sid) is None or None, time.monotonic() + 10,
                       interval=0.05, what="B's copy to end")
        # its next request: never served (a 503 "retry later" when B's Redis calls time out
        # under load, then the 404 the retry gets)
        assert c.post(b.url, PING).status_code == 404
        r.close()


def test_a_session_whose_minting_worker_died_is_found_again_after_redis_restarts(
        outdir: str, shm_name: str, shm_names: list[str]) -> None:
    """README: Redis back, even empty after a restart, other hosts find the sessions again:
    each worker stores again the sessions it published. A session lives on in its host's
    registry after the worker that minted it died (killed, recycled by max_requests); no live
    worker had published it, so once Redis restarted empty every other host answered 404 for a
    session its host still served. The host's workers serving it store it again."""
    with running() as srv, \
            two_hosts(srv.url, outdir, shm_name, shm_names, a_workers=1) as (a, b, _p):
        c = Client(a.url)
        (old,) = a.worker_pids()
        os.kill(old, signal.SIGKILL)
        wait_until(lambda: (a.worker_pids() not in ([], [old])) or None,
                   time.monotonic() + 20, what="A's new worker")
        assert c.post(a.url, PING).status_code == 200  # the copy outlives its minter
        srv.kill()
        srv.start()

        def found_on_b() -> bool | None:
            assert c.post(a.url, PING, retry_for=0).status_code == 200  # in use on A
            return c.post(b.url, PING, retry_for=0).status_code == 200 or None
        wait_until(found_on_b, time.monotonic() + 20, interval=0.2,
                   what="B to find the session again")


def test_a_clients_session_bound_in_redis_outlives_the_worker_that_minted_its_sessions(
        redis_server: Any, shm_name: str, shm_names: list[str]) -> None:
    """contract §6.1: sessions are bounded per client (README: "at most sessions_per_client per
    client there"). A session lives in its host's registry for every worker there, and each
    one serving it renews its Redis copy (keep_session); but only the process that published
    it renewed the client's set of sessions. Once that worker had died (killed, recycled by
    max_requests) the set expired one session_ttl later while the client's sessions lived on,
    renewed by the other workers: they were counted no more, and every mint added to them
    (three sessions in Redis for a bound of two)."""
    with hosts_in_process(redis_server, shm_name, shm_names, BOUND_2) as ((ra, a1), (_rb, _b)), \
            bridge(ra, redis_server, prefix=a1.store.prefix, host="A") as a2:
        sa, client = SessionStore(ra), "ip:203.0.113.79"

        def request(s: Any) -> None:  # a1 is gone: host A's other worker serves the client
            sa.touch(s)
            a2.keep_session(s.id, client)  # as legacy.py makes it

        kept = _two_sessions_in_use(sa, a1, client, request)
        _a_third_mint_leaves_two(redis_server, a2, sa, client, kept)


BOUND_2 = _small(sessions_per_client=2, session_ttl=1.0)


def _two_sessions_in_use(sa: SessionStore, publisher: Bridge, client: str,
                         request: Callable[[Any], None]) -> tuple[Any, Any]:
    """Two sessions of ``client`` minted here and published by ``publisher``, then in use (a
    ``request`` of each every 20 ms) for 2.5 s: past two of ``BOUND_2``'s session TTLs."""
    s1, s2 = sa.create("2025-11-25", client), sa.create("2025-11-25", client)
    for s in (s1, s2):
        publisher.publish_session(s.id, s.protocol_version, client)
    end = time.monotonic() + 2.5
    while time.monotonic() < end:
        for s in (s1, s2):
            request(s)
        time.sleep(0.02)
    return s1, s2


def _a_third_mint_leaves_two(srv: Any, br: Bridge, sa: SessionStore, client: str,
                             kept: tuple[Any, Any]) -> None:
    """``client``'s two sessions ``kept`` are alive in Redis, and a third it mints (published
    by ``br``) leaves two of the three there, the new one among them (sessions_per_client 2)."""
    r = redis.Redis.from_url(srv.url)
    try:
        assert r.exists(*(br.store._sess_key(s.id) for s in kept)) == 2  # kept alive
        s3 = _mint(br, sa, client)
        held = [s.id for s in (*kept, s3) if r.exists(br.store._sess_key(s.id))]
    finally:
        r.close()
    assert s3.id in held and len(held) == 2, held


def _mint(host: Any, store: SessionStore, client: str) -> Any:
    """A session minted in ``store`` (a host's table) for ``client`` and stored in Redis by
    that host's bridge ``host``, as the transport's ``initialize`` does."""
    s = store.create("2025-11-25", client)
    host.publish_session(s.id, s.protocol_version, client)
    return s


def _adopt(host: Any, store: SessionStore, sid: str) -> None:
    """Session ``sid`` looked up in Redis by bridge ``host`` and adopted in its table ``store``,
    as the transport does for a session another host minted."""
    got = host.lookup_session(sid)
    assert got is not None and store.create(*got, session_id=sid) is not None


def _in_redis(redis_server: Any, host: Any, sessions: tuple[Any, ...]) -> list[str]:
    """The ids of ``sessions`` whose copy Redis holds (read through bridge ``host``'s keys)."""
    r = redis.Redis.from_url(redis_server.url)
    try:
        return [s.id for s in sessions if r.exists(host.store._sess_key(s.id))]
    finally:
        r.close()


def _next_ms() -> None:
    """Return once the wall clock's millisecond has changed: Redis orders a client's sessions
    by the millisecond of their last use (ties by id), and a test relies on that order."""
    now = int(time.time() * 1000)
    wait_until(lambda: int(time.time() * 1000) > now, time.monotonic() + 1, interval=0.0005,
               what="the next millisecond")


def _ended_on_both(gone: Client, kept: tuple[Client, ...], hosts: tuple[Any, ...],
                   within: float = 10) -> None:
    """Session ``gone`` comes to answer 404 on every host of ``hosts`` within ``within``
    seconds; each of ``kept`` is served on every one."""
    for h in hosts:
        wait_until(lambda h=h: gone.post(h.url, PING, retry_for=0).status_code == 404 or None,
                   time.monotonic() + within, interval=0.05, what=f"the session to end on {h.url}")
    for c in kept:
        for h in hosts:
            assert c.post(h.url, PING).status_code == 200, h.url


def test_a_session_given_up_for_its_clients_bound_ends_on_every_host(
        redis_server: Any, shm_name: str, shm_names: list[str]) -> None:
    """README: Redis keeps at most sessions_per_client sessions of a client, giving up its
    oldest without a call in flight. It deleted only its own copy: the hosts holding one (A
    minted it, B adopted it) served it on, every other host answered it 404. Now it ends as at
    a DELETE: A, whose store gave it up, ends its own copy at once (its box is not told), B is
    told through its box, and a holder that missed that (its renewal before its box is read)
    is refused its store (the gone marker) and ends its copy too."""
    cfg = _small(sessions_per_client=2)
    with hosts_in_process(redis_server, shm_name, shm_names, cfg) as ((ra, a), (rb, b)):
        sa, sb, client = SessionStore(ra), SessionStore(rb), "ip:203.0.113.80"
        s1 = _mint(a, sa, client)
        _adopt(b, sb, s1.id)  # on B
        _next_ms()
        s2 = _mint(b, sb, client)
        _next_ms()
        s3 = _mint(a, sa, client)  # s1 is given up
        assert sa.get(s1.id) is None
        assert take_box(redis_server, a) == []
        assert [RedisStore.decode_box_item(x) for x in take_box(redis_server, b)] == [s1.id]
        b._kept.pop(s1.id)  # B's renewal of its copy is due, its box not read (taken above)
        b.keep_session(s1.id, client)
        assert sb.get(s1.id) is None
        with bridge(ra, redis_server, prefix=a.store.prefix, host="C") as c:
            assert c.lookup_session(s1.id) is None
            assert c.lookup_session(s2.id) == c.lookup_session(s3.id) == ("2025-11-25", client)
        assert a.owed() == 0 and b.owed() == 0


def test_a_session_given_up_for_its_clients_bound_is_unknown_on_both_hosts(
        redis_server: Any, outdir: str, shm_name: str, shm_names: list[str]) -> None:
    """README: a client holds at most sessions_per_client sessions in Redis. With a bound of 2
    the client mints s1 on A (used on B too), s2 on B, s3 on A: Redis gave up s1 but A (which
    minted it, and whose only worker stored s3) and B (which adopted it) kept their copies: s1
    was served on both, and answered 404 by any third host. Now s1 is 404 on both hosts; s2
    and s3 are served on both."""
    with two_hosts(redis_server.url, outdir, shm_name, shm_names, a_workers=1,
                   env_extra={"SHMCANCEL_TEST_SESSIONS_PER_CLIENT": "2"}) as (a, b, _p):
        s1 = Client(a.url)
        assert s1.post(b.url, PING).status_code == 200  # adopted on B
        _next_ms()
        s2 = Client(b.url)
        _next_ms()
        s3 = Client(a.url)
        _ended_on_both(s1, (s2, s3), (a, b))


def test_a_session_with_a_call_in_flight_is_not_given_up_for_its_clients_bound(
        redis_server: Any, outdir: str, shm_name: str, shm_names: list[str]) -> None:
    """contract §6.1: a session with a call in flight is never given up. With a bound of 2 the
    client runs a call in s1 on A, mints s2 on B and s3 on A: Redis gives up s2, not s1, and s2
    ends on both hosts (B, which minted it, served it on); s1's call runs on."""
    with two_hosts(redis_server.url, outdir, shm_name, shm_names,
                   env_extra={"SHMCANCEL_TEST_SESSIONS_PER_CLIENT": "2"}) as (a, b, prefix):
        r = redis.Redis.from_url(redis_server.url)
        s1 = Client(a.url)
        t = tag()
        call = Background(lambda: s1.call(a.url, 1, "sleep", {"seconds": 20, "tag": t}))
        call.start()
        wait_file(f"{outdir}/{t}.started", time.monotonic() + 10)
        wait_until(lambda: list(r.scan_iter(match=prefix + "*:if:*")) or None,
                   time.monotonic() + 5, what="the call's in-flight row")
        s2 = Client(b.url)
        s3 = Client(a.url)
        _ended_on_both(s2, (s1, s3), (a, b))
        assert call.is_alive()  # not cancelled
        assert s1.cancel(b.url, 1).status_code == 202
        assert call.result()["error"]["code"] == errors.REQUEST_CANCELLED
        r.close()


def test_a_session_a_hosts_table_drops_stays_in_redis_and_is_served_everywhere(
        outdir: str, shm_name: str, shm_names: list[str]) -> None:
    """README: a host's own table dropping a session for its client's bound (its least
    recently seen there) is a local cache eviction: the session stays in Redis, served on every
    host and adopted again there at its next use; Redis's bound, by global recency, is the one
    bound. With a bound of 2 the client mints s1 and s2 on A and uses s1 on B (its adoption
    there stores it anew: s2 is Redis's oldest), then mints s3 on A. A's table, which saw s1
    least recently, drops s1; Redis gives up s2. A's give-up used to end s1 everywhere, the
    session in use on B, leaving s2, idle, to live on."""
    with running() as srv, two_hosts(srv.url, outdir, shm_name, shm_names, a_workers=1,
                                     env_extra={"SHMCANCEL_TEST_SESSIONS_PER_CLIENT": "2"}
                                     ) as (a, b, _p):
        s1 = Client(a.url)
        _next_ms()
        s2 = Client(a.url)
        _next_ms()
        assert s1.post(b.url, PING).status_code == 200
        _next_ms()
        s3 = Client(a.url)
        _ended_on_both(s2, (s1, s3), (a, b))
        assert "Traceback" not in a.log() + b.log()


@pytest.mark.parametrize("renewed_on", ["A", "B"])
def test_a_session_renewed_in_use_is_not_given_up_before_an_idle_one(
        redis_server: Any, shm_name: str, shm_names: list[str], renewed_on: str) -> None:
    """README: Redis gives up a client's least recently used sessions, by their use on any
    host as fresh as the renewal period. It ordered them by their last store (a mint, an
    adoption), which a renewal never moved: s1, minted first and in use since (its renewal on
    A, which minted it, or on B, which adopted it), was given up at s3's mint while s2, idle,
    lived on. Now a renewal moves s1 past s2: s2 is given up, s1 and s3 kept."""
    cfg = _small(sessions_per_client=2, session_ttl=4.0)  # renewals every ttl/4: 1 s
    with hosts_in_process(redis_server, shm_name, shm_names, cfg) as ((ra, a), (rb, b)):
        sa, sb, client = SessionStore(ra), SessionStore(rb), "ip:203.0.113.82"
        s1 = _mint(a, sa, client)
        _adopt(b, sb, s1.id)  # on B
        _next_ms()
        s2 = _mint(a, sa, client)
        host, store = (a, sa) if renewed_on == "A" else (b, sb)
        adopted_at = time.monotonic()
        wait_until(lambda: time.monotonic() - adopted_at > 1.05 or None,
                   time.monotonic() + 5, interval=0.02, what="the renewal period to pass")
        store.touch(store.get(s1.id))  # type: ignore[arg-type]
        host.keep_session(s1.id, client)  # a request of s1, as legacy.py makes it
        _next_ms()
        s3 = _mint(a, sa, client)
        assert _in_redis(redis_server, a, (s1, s2, s3)) == [s1.id, s3.id]
        assert a.owed() == 0 and b.owed() == 0


def test_a_session_in_use_on_its_host_between_renewals_is_not_given_up_before_an_idle_one(
        redis_server: Any, shm_name: str, shm_names: list[str]) -> None:
    """contract §6.1: a client's least recently seen session is given up. Only host A is used:
    s1 is in use (its table's last_seen moved on past s2's mint), s2 minted after s1's last
    renewal and idle since. Redis knew of s1's use only at its renewals (its mint marked it
    renewed): s3's mint gave s1 up and kept s2. Now a store sends the host's last use of the
    client's other sessions: s2 is given up, s1 and s3 kept, on A too."""
    with hosts_in_process(redis_server, shm_name, shm_names,
                          _small(sessions_per_client=2)) as ((ra, a), _b):
        sa, client = SessionStore(ra), "ip:203.0.113.85"
        s1 = _mint(a, sa, client)
        _next_ms()
        s2 = _mint(a, sa, client)
        minted = time.time()
        wait_until(lambda: time.time() - minted > 1.05 or None, time.monotonic() + 5,
                   interval=0.02, what="a touch interval to pass")
        sa.touch(sa.get(s1.id))  # type: ignore[arg-type]  # a request of s1 here
        a.keep_session(s1.id, client)  # its renewal not due: Redis is not told
        _next_ms()
        s3 = _mint(a, sa, client)
        assert _in_redis(redis_server, a, (s1, s2, s3)) == [s1.id, s3.id]
        assert sa.get(s1.id) is not None and sa.get(s2.id) is None
        assert a.owed() == 0


def test_sessions_stored_again_after_redis_lost_them_keep_their_clients_order(
        redis_server: Any, shm_name: str, shm_names: list[str]) -> None:
    """README: a session's place in its client's order is its last use; a restore is none.
    Redis lost the deployment's keys; the client mints s3 on B before A stores s1 and s2 (used
    before s3) again. Those were stored with the time of their restore, newer than s3's mint,
    so the client's newest session was its oldest in Redis (its bound gave s3 up first). Now
    they keep their last use on A: s1, s2, s3 in Redis's order."""
    cfg = _small(sessions_per_client=4)
    with hosts_in_process(redis_server, shm_name, shm_names, cfg) as ((ra, a), (rb, b)):
        sa, sb, client = SessionStore(ra), SessionStore(rb), "ip:203.0.113.83"
        s1 = _mint(a, sa, client)
        _next_ms()
        s2 = _mint(a, sa, client)
        r = redis.Redis.from_url(redis_server.url)
        try:
            for k in list(r.scan_iter(match=a.store.prefix + "*")):  # the deployment's data lost
                r.delete(k)
            _next_ms()
            s3 = _mint(b, sb, client)
            _next_ms()
            assert a._republish() == 2
            a._settle()
            assert a.owed() == 0
            (cl,) = r.scan_iter(match=a.store.prefix + "{cl:*")
            order = [m.decode() for m in r.zrange(cl, 0, -1)]
        finally:
            r.close()
        assert order == [s1.id, s2.id, s3.id]


@pytest.mark.parametrize("stored_again_by", ["B's renewals, before it saw the loss",
                                             "B's thread, restoring"])
def test_no_session_is_given_up_while_redis_may_be_restoring(
        redis_server: Any, shm_name: str, shm_names: list[str], stored_again_by: str) -> None:
    """contract §6.1: a session with a call in flight is never given up. Redis lost the
    deployment's data (a FLUSHALL); each worker stores its in-flight rows and sessions again on
    its own schedule. B stored s1 and s2 again before A added back the row of the call it runs
    in s1; the client's s3, minted on A meanwhile, made Redis give up s1 (oldest, its call
    unseen): ended everywhere, its call cancelled "session deleted". Now no session is given
    up while Redis may be restoring (a lease and a renewal period after a worker saw the loss,
    or a store found its worker's alive key gone): the client holds three meanwhile."""
    cfg = _small(sessions_per_client=2)
    restoring = stored_again_by == "B's thread, restoring"
    with hosts_in_process(redis_server, shm_name, shm_names, cfg,
                          thread_b=restoring) as ((ra, a), (rb, b)):
        sa, sb, client = SessionStore(ra), SessionStore(rb), "ip:203.0.113.84"
        r = redis.Redis.from_url(redis_server.url)
        try:
            s1 = _mint(b, sb, client)
            handle = a.track(7, f"session:{s1.id}")  # a call of s1's runs on A
            assert handle is not None and handle[3]
            _next_ms()
            s2 = _mint(b, sb, client)
            alive = b.store.alive_key(b.remote.box)
            if restoring:
                wait_until(lambda: r.exists(alive) or None, time.monotonic() + 10,
                           interval=0.02, what="B's thread to set its alive key")
            else:
                b._lost(alive, 30_000)  # as B's thread does at its start
            for k in list(r.scan_iter(match=a.store.prefix + "*")):  # Redis lost the data
                r.delete(k)
            if restoring:
                wait_until(lambda: r.exists(*(b.store._sess_key(s.id) for s in (s1, s2))) == 2
                           or None, time.monotonic() + 10, interval=0.02,
                           what="B to store s1 and s2 again")
            else:
                for s in (s1, s2):  # each one's renewal is due: its copy is missing
                    b._kept.pop(s.id)
                    sb.touch(s)
                    b.keep_session(s.id, client)
            _next_ms()
            s3 = _mint(a, sa, client)
            held = [s.id for s in (s1, s2, s3) if r.exists(a.store._sess_key(s.id))]
            assert take_box(redis_server, b) == []
        finally:
            r.close()
        assert held == [s1.id, s2.id, s3.id]
        assert sb.get(s1.id) is not None and a.owed() == 0 and b.owed() == 0
        a.untrack(handle)


def test_a_store_while_redis_may_be_restoring_does_not_walk_its_clients_sessions(
        redis_server: Any, shm_name: str, shm_names: list[str]) -> None:
    """While Redis may be restoring no session is given up; yet every store past the bound
    looked up each of the client's sessions first (to drop those gone), so a client minting in
    that window made each store cost as many lookups as it held sessions. Now the set is not
    walked then: an id whose session is gone stays listed while restoring, and goes at the
    first store after."""
    with hosts_in_process(redis_server, shm_name, shm_names,
                          _small(sessions_per_client=2)) as ((_ra, a), _b):
        st, client = a.store, "ip:203.0.113.87"
        r = redis.Redis.from_url(redis_server.url)

        def put(sid: str) -> list[str] | None:
            return st.put_session(sid, "2025-11-25", client, now_ms=int(time.time() * 1000),
                                  box=a.remote.box, box_lease_ms=10_000)

        try:
            sids = [c * 32 for c in "pqrs"]
            assert put(sids[0]) == put(sids[1]) == []
            r.delete(st._sess_key(sids[0]))  # its session gone (expired), still listed
            st.set_restoring(60_000)
            assert put(sids[2]) == put(sids[3]) == []
            (cl,) = r.scan_iter(match=st.prefix + "{cl:*")
            assert sorted(m.decode() for m in r.zrange(cl, 0, -1)) == sids
            r.delete(st._restoring)
            assert len(put(sids[3]) or ()) == 1  # one of sids[1:3] given up, sids[0] dropped
            assert sids[0] not in {m.decode() for m in r.zrange(cl, 0, -1)}
            assert r.zcard(cl) == 2
        finally:
            r.close()


@pytest.mark.parametrize("how", ["a notification on B", "a DELETE on A"])
def test_a_cancellation_through_redis_is_reported_once(
        redis_server: Any, shm_name: str, shm_names: list[str], how: str) -> None:
    """contract §4.7: one ``request cancelled`` event per cancellation. A call runs on A. A
    notification landing on B was reported by B (its record in Redis) and again by A (the
    delivery from its box); a DELETE on A, by A's own pass and again when its box delivered
    the Redis copy back to A. Each is reported once now: where the request runs, by whoever
    recorded it there first."""
    seen: list[str] = []
    telemetry.attach("test-once", CANCELLED, lambda e, m, md, cfg: seen.append(md["request_id"]))
    with hosts_in_process(redis_server, shm_name, shm_names) as ((ra, a), (rb, b)):
        scope = "session:" + "s" * 32
        c = Cancellation(ra)
        handle = c.begin(7, scope)  # running on A: its local row and its Redis row
        token = a.track(7, scope)
        try:
            assert handle.tracked and token is not None
            if how == "a notification on B":
                assert not Cancellation(rb).cancel_if_in_flight(7, "stop", scope)  # not on B
                assert b.cancel(7, "stop", scope) is True
            else:
                def end() -> bool:
                    a.cancel_scope(scope, "stop")
                    return True
                assert c.cancel_scope_around(scope, "stop", end, reported=[],
                                             ring=lambda: None) == ["7"]
            raws = take_box(redis_server, a)
            assert len(raws) == 1
            assert a._apply(raws[0])
            assert handle.cancelled() and handle.reason() == "stop"
            assert seen == ["7"], seen
        finally:
            telemetry.detach("test-once")
            handle.end()
            a.untrack(token)


def test_another_principals_request_neither_adopts_nor_renews_a_session(
        redis_server: Any, shm_name: str, shm_names: list[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A session minted for a principal is unknown to another (contract §6.1, docs). On a host
    with no copy yet, bob's request with alice's session id was answered 404 only after the
    session was adopted there and renewed in Redis: a leaked id kept someone else's session
    alive, counted on that host against its owner. It is now refused before either."""
    from helpers.wsgi import environ_for, run

    from shmcancel.mcp import remote
    from shmcancel.server import McpServer

    def post(app: McpServer, obj: dict, sid: str | None, who: str | None) -> Any:
        h = {"MCP-Protocol-Version": "2025-11-25"}
        if sid is not None:
            h["Mcp-Session-Id"] = sid
        extra = {"REMOTE_ADDR": "203.0.113.70"}
        if who is not None:
            extra["shmcancel.principal"] = {"id": who}
        return run(app, environ_for("POST", json.dumps(obj).encode(), headers=h, extra=extra))

    init = {"jsonrpc": "2.0", "id": 0, "method": "initialize",
            "params": {"protocolVersion": "2025-11-25", "capabilities": {},
                       "clientInfo": {"name": "t", "version": "1"}}}
    ping = {"jsonrpc": "2.0", "id": 1, "method": "ping"}
    current: list[Bridge | None] = [None]
    # the provider the bridge module installed is put back after (later tests consult it)
    monkeypatch.setattr(remote, "_provider", lambda: current[0])
    with hosts_in_process(redis_server, shm_name, shm_names) as ((ra, a), (rb, b)):
        host_a = McpServer(name="a", version="1", registry=ra)
        host_b = McpServer(name="b", version="1", registry=rb)
        current[0] = a
        sid = post(host_a, init, None, "alice").headers["mcp-session-id"]
        anonymous = post(host_a, init, None, None).headers["mcp-session-id"]
        current[0] = b
        held = redis.Redis.from_url(redis_server.url)
        keys = held.keys(f"{a.store.prefix}*{sid}*")
        assert keys, "the session is in Redis"
        for k in keys:
            held.pexpire(k, 60_000)
        assert post(host_b, ping, sid, "bob").status == 404
        assert post(host_b, ping, sid, None).status == 404  # nor anonymously
        assert SessionStore(rb).get(sid) is None  # not adopted on B
        assert all(held.pttl(k) <= 60_000 for k in keys)  # not renewed (to session_ttl)
        assert post(host_b, ping, sid, "alice").status == 200  # its owner's: adopted
        # minted anonymously from an address, used under a principal from that address
        assert post(host_b, ping, anonymous, "dave").status == 200
        assert post(host_b, ping, anonymous, None).status == 200
        held.close()


def test_sessions_redis_lost_while_it_answered_are_stored_again(
        redis_server: Any, shm_name: str, shm_names: list[str]) -> None:
    """A FLUSHALL (or an eviction, or a restart between two looks) while Redis answered lost a
    live session's copy for good: only an outage (a refused connection) made a worker store its
    sessions again, so every other host answered the session 404 until a worker of its own
    host renewed it (a minute at most per worker, and only on a request). The worker's alive
    key, missing though it set it, now says Redis lost data: it stores its sessions again."""
    client = "ip:203.0.113.79"
    with hosts_in_process(redis_server, shm_name, shm_names, thread_a=True) as ((ra, a), (_, b)):
        s = SessionStore(ra).create("2025-11-25", client)
        a.publish_session(s.id, s.protocol_version, client)
        r = redis.Redis.from_url(redis_server.url)
        try:
            wait_until(lambda: r.exists(a.store.alive_key(a.remote.box)), time.monotonic() + 10,
                       what="A's bridge thread to set its alive key")
            assert b.store.get_session(s.id) == ("2025-11-25", client)
            for _ in range(2):  # the second right after the first's restore: seen as well
                # as a FLUSHALL would, but of this deployment's keys only (others share Redis)
                r.delete(*r.keys(f"{a.store.prefix}*"))
                wait_until(lambda: b.store.get_session(s.id) is not None,
                           time.monotonic() + 10, what="A to store its session again")
            assert b.lookup_session(s.id) == ("2025-11-25", client)
        finally:
            r.close()


def test_a_session_redis_lost_is_not_answered_unknown_before_its_host_restores_it(
        redis_server: Any, shm_name: str, shm_names: list[str]) -> None:
    """After a FLUSHALL, another host looking up a live session before the session's host had
    stored it again found nothing and answered 404: the client, told its session is gone for
    good, dropped it (and its running call's cancellation with it). The lookup reads the
    worker's alive key with the session: missing though the worker set it, Redis lost data,
    and the lookup raises ``RemoteUnavailable`` (503 with ``Retry-After``) instead."""
    client = "ip:203.0.113.81"
    with hosts_in_process(redis_server, shm_name, shm_names, thread_b=True) as ((ra, a), (_, b)):
        s = SessionStore(ra).create("2025-11-25", client)
        a.publish_session(s.id, s.protocol_version, client)
        r = redis.Redis.from_url(redis_server.url)
        alive = b.store.alive_key(b.remote.box)
        try:
            # the key, and the thread's note that it set it (a moment later: a lookup between
            # the two cannot tell the key's loss, nor could this test)
            wait_until(lambda: r.exists(alive) and b._alive_set, time.monotonic() + 10,
                       what="B's bridge thread to set its alive key")
            assert b.lookup_session(s.id) == ("2025-11-25", client)
            for _ in range(5):
                # as a FLUSHALL would, but of this deployment's keys only (others share Redis);
                # A has no thread: it does not store its session again
                r.delete(*r.keys(f"{a.store.prefix}*"))
                try:
                    got = b.lookup_session(s.id)
                except RemoteUnavailable as e:
                    assert "lost data" in str(e)
                    break
                # B's thread set its key again between the two (it noticed the loss first)
                assert got is None and r.exists(alive)
            else:
                pytest.fail("the lookup never saw that Redis lost data")
            # B's thread sees the loss and restores; the lookup still answers 503 for the
            # time the other hosts take to see it too; A (no thread) never stores its session
            # again: from then on the session is unknown
            wait_until(lambda: b._restoring_until > time.monotonic(), time.monotonic() + 30,
                       what="B's bridge thread to see the loss and restore")
            with pytest.raises(RemoteUnavailable):
                b.lookup_session(s.id)

            def unknown() -> bool:
                try:
                    return b.lookup_session(s.id) is None
                except RemoteUnavailable:
                    return False
            wait_until(unknown, time.monotonic() + 30, what="the lookup to answer again")
        finally:
            r.close()
