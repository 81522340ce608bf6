"""Keys of ours in Redis that another client wrote over (another type, bytes that are not ours),
and a Redis too full to store a new session: no cancellation is lost without a word, no live
session is answered 404. Real redis-server; two gunicorn "hosts" where the transport matters,
two bridges over two registries in this process elsewhere."""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any

import pytest
import redis
from helpers.background import Background
from helpers.gunicorn_harness import wait_until
from helpers.mcp_client import tag, wait_file
from helpers.redis_server import RedisServer, running, unique_prefix
from helpers.wsgi import environ_for, run
from test_redis_bridge import _served
from test_redis_hosts import PING, Client, assert_retry_later, outdir, two_hosts
from test_redis_hosts_sessions import hosts_in_process

from shmcancel import Cancellation, RemoteUnavailable, errors
from shmcancel.mcp.sessions import SessionStore
from shmcancel.redis.bridge import Bridge

__all__ = ["outdir"]  # the module fixture, shared
SCOPE = "session:s"


def _key(a: Bridge, which: str) -> bytes:
    """The key of ours named ``which`` for request 7 of :data:`SCOPE` run by ``a``."""
    st = a.store
    return {"all": st._all, "scopes": st._scopes, "pend": st._pend,
            "c": st._skeys(SCOPE)[0], "t": st._skeys(SCOPE)[1],
            "if": st.if_key(SCOPE, "7"), "ifs": st.ifs_key(SCOPE), "pc": st.pc_key(SCOPE),
            "box": st.box_key(a.remote.box), "stopped": st._stopped}[which]


@pytest.mark.parametrize("which", ["all", "scopes", "c", "t", "if", "ifs", "pc", "pend", "box"])
def test_a_cancellation_through_a_key_another_client_wrote_over_still_lands(
        redis_server: Any, shm_name: str, shm_names: list[str], which: str) -> None:
    """A string over one of our keys (the global index ``{g}:all``, say) made the cancel
    script fail with WRONGTYPE: B answered the notification 202, owed the cancellation, then
    gave it up (it could never land), and A's call ran on. An in-flight key so written made
    the call look not in flight. The scripts mend such a key (deleted; the index rebuilt
    from the scopes' rows): the cancellation lands, at once or, for a lost in-flight row,
    once A's renewal adds it back."""
    with hosts_in_process(redis_server, shm_name, shm_names, lease=1.5,
                          thread_a=True) as ((ra, a), (_, b)):
        handle = Cancellation(ra).begin(7, SCOPE)
        assert handle.tracked and a.track(7, SCOPE) is not None
        r = redis.Redis.from_url(redis_server.url)
        try:
            r.set(_key(a, which), b"garbage")
            try:
                b.cancel(7, "stop", SCOPE)
            except RemoteUnavailable:
                pytest.fail("the key was not mended")
            wait_until(lambda: handle.cancelled() or None, time.monotonic() + 10,
                       interval=0.02, what="the cancellation delivered on A")
            assert handle.reason() == "stop"
            assert not b.down and b.owed() == 0
            handle.end()
        finally:
            r.close()


@pytest.mark.parametrize("which", ["all", "scopes"])
def test_a_damaged_row_index_is_rebuilt_from_the_other(
        redis_server: Any, shm_name: str, shm_names: list[str], which: str) -> None:
    """The global index and the per-scope row counts rank every row for the cap's eviction and
    its expiry: one written over is rebuilt from the other, so no row is left out of either."""
    with hosts_in_process(redis_server, shm_name, shm_names) as ((_, a), _):
        for i in range(3):
            assert a.remote.storage.record(f"session:{i}", "1", "x", time.time, quota=None,
                                           cap=200, batch=10, only_in_flight=False)
        before = dict(a.store.client.zrange(_key(a, which), 0, -1, withscores=True))
        a.store.client.set(_key(a, which), b"garbage")
        assert a.remote.storage.record("session:new", "1", "x", time.time, quota=None,
                                       cap=200, batch=10, only_in_flight=False)
        after = dict(a.store.client.zrange(_key(a, which), 0, -1, withscores=True))
        assert len(before) == 3 and len(after) == 4
        assert all(after[m] == at for m, at in before.items())
        assert a.store.expire(time.time() + 3600, 1.0) == 4  # every row still expires


def test_a_cross_host_cancellation_through_a_garbled_index_ends_the_call(
        redis_server: Any, outdir: str, shm_name: str, shm_names: list[str]) -> None:
    """End to end, as found: ``SET <prefix>{g}:all garbage``, then a call on A cancelled
    through B was answered 202 and ran on."""
    with two_hosts(redis_server.url, outdir, shm_name, shm_names) as (a, b, prefix):
        c = Client(a.url)
        t = tag()
        call = Background(lambda: c.call(a.url, 1, "sleep", {"seconds": 20, "tag": t}))
        call.start()
        wait_file(f"{outdir}/{t}.started", time.monotonic() + 10)
        r = redis.Redis.from_url(redis_server.url)
        try:
            r.set(prefix + "{g}:all", b"garbage")
        finally:
            r.close()
        sent = time.monotonic()
        assert c.cancel(b.url, 1).status_code == 202
        reply = call.result(25)
        assert reply["error"]["code"] == errors.REQUEST_CANCELLED, reply
        assert call.done_at - sent < 5.0  # not the tool's 20 s


def test_a_taken_list_written_over_loses_nothing_waiting_in_the_box(
        redis_server: Any, shm_name: str, shm_names: list[str]) -> None:
    """A worker's thread meeting WRONGTYPE on its box or taken list deleted both: a cancellation
    waiting in the box (pushed there since, into a box cancel.lua mended) went with them, and
    the call ran on. The thread mends them (take.lua deletes only a key of another type) and
    applies what waited."""
    with hosts_in_process(redis_server, shm_name, shm_names) as ((ra, a), (_, b)):
        handle = Cancellation(ra).begin(7, SCOPE)
        assert handle.tracked and a.track(7, SCOPE) is not None
        assert b.cancel(7, "stop", SCOPE) is True  # waits in A's box: A's thread not started
        r = redis.Redis.from_url(redis_server.url)
        try:
            r.set(a.store.taken_key(a.remote.box), b"garbage")
        finally:
            r.close()
        a.start()  # its first turn reads the taken list
        wait_until(lambda: handle.cancelled() or None, time.monotonic() + 10, interval=0.02,
                   what="the cancellation delivered on A")
        assert handle.reason() == "stop"
        handle.end()


# ------------------------------------------------------------ a full Redis and initialize

def test_an_initialize_whose_session_a_full_redis_refuses_is_503(shm_name: str) -> None:
    """A full Redis (``maxmemory`` reached, ``noeviction``) refused the new session's store:
    the initialize was answered 200 with an id other hosts (Redis answering them) answered
    404. It is 503 with ``Retry-After`` and the request's id, and no session is left here."""
    from shmcancel import Config
    from shmcancel.shm.registry import Registry
    reg = Registry.create(shm_name, Config(capacity=400, max_rows=200, in_flight_capacity=64,
                                           session_capacity=16))
    try:
        with running() as srv, contextlib.contextmanager(_served)(
                reg, srv, unique_prefix()) as (app, b):
            r = redis.Redis.from_url(srv.url)
            try:
                r.config_set("maxmemory", 1)  # noeviction (the default)
                reply = _initialize(app, srv)
                assert reply.status == 503, reply
                assert int(reply.headers["retry-after"]) >= 1
                body = json.loads(reply.body)
                assert body["id"] == 9 and body["error"]["code"] == errors.SERVER_ERROR, body
                assert "is full" in body["error"]["message"], body  # not "did not answer"
                assert "mcp-session-id" not in reply.headers
                assert SessionStore(reg).count() == 0
                assert b.owed() == 0 and not b.down
                r.config_set("maxmemory", 0)
                reply = _initialize(app, srv)
                assert reply.status == 200, reply
                sid = reply.headers["mcp-session-id"]
                assert b.store.get_session(sid) is not None
            finally:
                r.config_set("maxmemory", 0)
                r.close()
    finally:
        reg.close()
        reg.unlink()


def _initialize(app: Any, srv: RedisServer) -> Any:
    body = json.dumps({"jsonrpc": "2.0", "id": 9, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {},
        "clientInfo": {"name": "t", "version": "1"}}}).encode()
    return run(app, environ_for("POST", body))


# ------------------------------------------------------------ a session's copy written over

@pytest.mark.parametrize("junk", ["bytes", "a hash"])
def test_a_sessions_copy_written_over_is_503_then_stored_again(
        redis_server: Any, shm_name: str, shm_names: list[str], junk: str) -> None:
    """Junk over a live session's copy in Redis made every other host answer the session 404
    (the client drops it for good) until its holder's next renewal stored it again, which a
    copy still there never did. The lookup deletes the junk and tells the holders' boxes:
    503 meanwhile, and the holder stores the session again at once."""
    client = "ip:203.0.113.90"
    with hosts_in_process(redis_server, shm_name, shm_names, thread_a=True) as ((ra, a), (_, b)):
        s = SessionStore(ra).create("2025-11-25", client)
        a.publish_session(s.id, s.protocol_version, client)
        key = f"{a.store.prefix}sess:{s.id}"
        r = redis.Redis.from_url(redis_server.url)
        try:
            r.delete(key)
            if junk == "bytes":
                r.set(key, b"\xc1junk")
            else:
                r.hset(key, "a", "b")
            with pytest.raises(RemoteUnavailable):
                b.lookup_session(s.id)

            def found() -> Any:
                try:
                    return b.lookup_session(s.id)
                except RemoteUnavailable:
                    return None
            got = wait_until(found, time.monotonic() + 10, interval=0.05,
                             what="A to store its session again")
            assert got == ("2025-11-25", client)
        finally:
            r.close()


def test_a_holders_renewal_stores_a_junk_copy_of_its_session_again(
        redis_server: Any, shm_name: str, shm_names: list[str]) -> None:
    """A holder's renewal of a copy Redis still held only extended its life, junk or not: the
    renewal (keep.lua) deletes a copy no host can adopt and the holder stores its own."""
    client = "ip:203.0.113.91"
    with hosts_in_process(redis_server, shm_name, shm_names) as ((ra, a), (_, b)):
        s = SessionStore(ra).create("2025-11-25", client)
        a.publish_session(s.id, s.protocol_version, client)
        a.store.client.set(f"{a.store.prefix}sess:{s.id}", b"junk")
        a._keep(s.id, ("2025-11-25", client), None)
        assert b.store.get_session(s.id) == ("2025-11-25", client)


def test_a_sessions_copy_written_over_is_never_404_on_another_host(
        redis_server: Any, outdir: str, shm_name: str, shm_names: list[str]) -> None:
    """End to end: a session minted on A whose copy in Redis is junk, first used on B: 503
    with ``Retry-After``, then served (A stored it again), never 404."""
    with two_hosts(redis_server.url, outdir, shm_name, shm_names) as (a, b, prefix):
        c = Client(a.url)
        r = redis.Redis.from_url(redis_server.url)
        try:
            r.set(f"{prefix}sess:{c.sid}", b"junk")
        finally:
            r.close()
        reply = c.post(b.url, PING, retry_for=0)
        assert_retry_later(reply)
        assert "damaged copy" in reply.json()["error"]["message"], reply.text
        assert c.post(b.url, PING).status_code == 200  # retried as a client does


def _lookup(b: Bridge, sid: str) -> Any:
    """``b``'s lookup of ``sid``: None while it answers "retry later"; a 404 (no session) fails
    the test."""
    try:
        got = b.lookup_session(sid)
    except RemoteUnavailable:
        return None
    assert got is not None, "a live session answered 404"
    return got


def test_a_sessions_copy_and_holders_written_over_are_stored_again(
        redis_server: Any, shm_name: str, shm_names: list[str]) -> None:
    """Junk over a live session's copy and over its holders' set: the lookup that mended them
    told nobody (the holders were in the junk), and the next one answered 404 while A served
    the session. Every live box is told then: A stores it again, 503 meanwhile."""
    client = "ip:203.0.113.92"
    with hosts_in_process(redis_server, shm_name, shm_names, thread_a=True) as ((ra, a), (_, b)):
        s = SessionStore(ra).create("2025-11-25", client)
        a.publish_session(s.id, s.protocol_version, client)
        r = a.store.client
        wait_until(lambda: r.exists(a.store.alive_key(a.remote.box)) or None,
                   time.monotonic() + 10, interval=0.02, what="A's bridge to run")
        key = f"{a.store.prefix}sess:{s.id}"
        r.set(key + ":boxes", b"junk")
        r.set(key, b"junk")
        with pytest.raises(RemoteUnavailable):
            b.lookup_session(s.id)
        got = wait_until(lambda: _lookup(b, s.id), time.monotonic() + 10, interval=0.05,
                         what="A to store its session again")
        assert got == ("2025-11-25", client)


def test_a_junk_copy_no_live_holder_can_store_is_503_until_its_host_serves_it(
        redis_server: Any, shm_name: str, shm_names: list[str]) -> None:
    """The worker that minted a session exited (its box stopped) and no other worker holds
    its client yet: the lookup mending its junk copy could tell nobody, and the next one
    answered 404 on B while A's other workers served the session. Lookups answer "retry
    later" for a box lease, and the next request A serves stores the session again."""
    client = "ip:203.0.113.93"
    with hosts_in_process(redis_server, shm_name, shm_names) as ((ra, a), (_, b)):
        s = SessionStore(ra).create("2025-11-25", client)
        a.publish_session(s.id, s.protocol_version, client)
        a.store.box_stopped(a.remote.box)
        with a._owed_lock:
            a._held.clear()  # as in another worker of A, which never served it
            a._kept.clear()
        a.store.client.set(f"{a.store.prefix}sess:{s.id}", b"junk")
        for _ in range(3):
            with pytest.raises(RemoteUnavailable):
                b.lookup_session(s.id)
        a.keep_session(s.id, client)  # a request of the session served on A
        assert b.lookup_session(s.id) == ("2025-11-25", client)


def test_the_live_index_keeps_only_boxes_renewed_lately(
        redis_server: Any, shm_name: str, shm_names: list[str]) -> None:
    """Every renewal lists its box in ``{g}:live`` (the boxes a damaged session's mend tells
    when its holders are unknown), and the key's TTL never runs out while any worker renews:
    without a prune the boxes of recycled workers piled up there for as long as the cluster
    ran. A renewal drops the boxes not renewed for ``LIVE_KEPT_MS``."""
    from shmcancel.redis.store import LIVE_KEPT_MS
    with hosts_in_process(redis_server, shm_name, shm_names) as ((_, a), (_rb, b)):
        r = a.store.client
        live = a.store._live
        old_ms = int(time.time() * 1000) - LIVE_KEPT_MS - 60_000
        r.zadd(live, {f"recycled-{i}".encode(): old_ms + i for i in range(100)})
        r.zadd(live, {b"renewed-lately": old_ms + 120_000})
        a.store.set_alive(a.remote.box, 5000)
        assert set(r.zrange(live, 0, -1)) == {a.remote.box.encode(), b.remote.box.encode(),
                                              b"renewed-lately"}  # b's: set as hosts start
