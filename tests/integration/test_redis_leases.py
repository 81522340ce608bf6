"""The Redis backend's leases, running-ids sets and outages against contract §4 and README's
"Several hosts: Redis" (what the other Redis tests leave open). A real ``redis-server``
(``redis_server``), keys under a per-test prefix (``redis_prefix``)."""

from __future__ import annotations

import contextlib
import os
import select
import time

import pytest
import redis
from helpers.procs import child, reap, recv, wait_exit
from helpers.redis_server import RedisServer, free_port

from shmcancel import Cancellation, Config
from shmcancel.redis import RedisCancellation, RedisStorage, RedisStore, connect


def _storage(url, prefix, *, lease=10.0, host="h1", timeout=2.0, auto_renew=True):
    store = RedisStore(connect(url, timeout=timeout), Config(), prefix=prefix)
    return RedisStorage(store, lease=lease, host=host, auto_renew=auto_renew)


def test_a_request_of_redis_storage_alone_stays_in_flight_past_its_lease(redis_server,
                                                                        redis_prefix):
    """README: ``Cancellation(None, backend=RedisStorage(store))`` is contract §4 over Redis
    alone; §4.5: a request is in flight while its (live) owner runs it. Nobody but the bridge
    renewed leases, so a request running longer than the lease (10 s by default) silently
    stopped being in flight and a gated cancellation of it was dropped."""
    st = _storage(redis_server.url, redis_prefix, lease=0.3)
    c = Cancellation(None, backend=st)
    try:
        with c.begin(7, "s") as h:
            c.track(8, "s")
            time.sleep(1.0)  # more than three leases
            assert c.in_flight(7, "s") and c.in_flight(8, "s")
            assert c.cancel_if_in_flight(7, "late", "s")
            assert h.cancelled()
            c.untrack(8, "s")
        assert not c.in_flight(7, "s") and not c.in_flight(8, "s")
    finally:
        for k in st.store.client.scan_iter(redis_prefix + "*"):
            st.store.client.delete(k)


def test_begin_never_raises_when_redis_is_unreachable(redis_prefix, caplog):
    """``Cancellation.begin`` never raises (the transport serves the request uncancellable):
    over RedisStorage a refused connection escaped from it as ``redis.ConnectionError``."""
    # no renewer: its rows never reach Redis, so it would outlive the test, reconnecting
    st = _storage(f"redis://127.0.0.1:{free_port()}/0", redis_prefix, timeout=0.5,
                  auto_renew=False)
    c = Cancellation(None, backend=st)
    h = c.begin(1, "s")
    assert not h.tracked and h.error is not None
    h.cancel_local("gone")
    assert h.cancelled()
    h.end()  # never raises either


def test_running_ids_of_dead_owners_do_not_pile_up_in_a_busy_scope(redis_server,
                                                                  redis_prefix):
    """README: a dead host's in-flight rows expire within a lease. The scope's set of running
    ids (``:ifs``) kept every id whose untrack never landed (a worker killed, a host died)
    for as long as anything else in the scope was tracked (each track extends that set's
    life): an unbounded set in a long-lived scope, walked by every ``cancel_scope``."""
    dead = RedisCancellation(RedisStore(connect(redis_server.url, timeout=2.0), Config(),
                                        prefix=redis_prefix), lease=0.3, host="dead")
    live = RedisCancellation(dead.store, lease=0.3, host="live")
    live.track("long", "ip:10.0.0.1")  # the scope stays busy throughout
    for i in range(200):
        dead.track(f"d{i}", "ip:10.0.0.1")  # the owner dies: never untracked nor renewed
    end = time.monotonic() + 1.0  # their lease ends meanwhile
    i = 0
    while time.monotonic() < end or i < 300:
        live.renew()
        live.track(f"x{i}", "ip:10.0.0.1")
        live.untrack(f"x{i}", "ip:10.0.0.1")
        i += 1
    assert not live.in_flight("d0", "ip:10.0.0.1") and live.in_flight("long", "ip:10.0.0.1")
    assert live.store.client.scard(live.store.ifs_key("ip:10.0.0.1")) <= 10
    assert len(live.storage.in_flight_ids("ip:10.0.0.1")) <= 10


def test_a_request_that_ended_while_redis_was_down_is_not_renewed_back(redis_prefix):
    """§4.3: a request's end is never lost. It ended while Redis was down (its untrack got no
    answer); Redis came back empty: the row must not be added back as in flight by the lease
    renewal of the process (only the rows of requests it still runs)."""
    srv = RedisServer()
    try:
        srv.start()
        st = _storage(srv.url, redis_prefix, lease=0.3, timeout=0.5)
        c = Cancellation(None, backend=st)
        h = c.begin(1, "s")
        running = c.begin(2, "s")
        assert h.tracked and running.tracked
        srv.kill()
        h.end()  # its untrack gets no answer: logged, swallowed
        srv.start()  # back, empty
        deadline = time.monotonic() + 5
        while not c.in_flight(2, "s") and time.monotonic() < deadline:
            time.sleep(0.05)  # the renewal adds back the request still running
        time.sleep(0.5)
        assert c.in_flight(2, "s")
        assert not c.in_flight(1, "s")
        running.end()
    finally:
        srv.stop()


def test_a_plain_untrack_redis_did_not_answer_is_not_renewed_back(redis_prefix):
    """§4.3: the end of a request is never lost (the process finishes it later); §4.1:
    ``untrack`` raises nothing for the caller. ``Cancellation.untrack`` (a ``track`` row, token
    0) while Redis was unreachable raised ``redis.ConnectionError`` to the caller and left the
    row held: the lease renewal (which ends only ended *handles'* rows) added it back once Redis
    returned and renewed it for as long as the process lived, so the ended request stayed in
    flight and a gated cancellation recorded a row for it."""
    srv = RedisServer()
    try:
        srv.start()
        st = _storage(srv.url, redis_prefix, lease=0.3, timeout=0.5)
        c = Cancellation(None, backend=st)
        c.track(1, "s")
        c.track(2, "s")
        srv.kill()
        c.untrack(1, "s")  # no answer: never raised to the caller
        srv.start()  # back, empty
        deadline = time.monotonic() + 5
        while not c.in_flight(2, "s"):  # the renewal adds back the request still running
            assert time.monotonic() < deadline, "the running request was not added back"
            time.sleep(0.02)
        st.renew()  # and renews on: a full pass of its own, whatever the thread did
        assert not c.in_flight(1, "s")
        assert not c.cancel_if_in_flight(1, "late", "s") and not c.cancelled(1, "s")
        c.untrack(2, "s")
        assert not c.in_flight(2, "s") and st.held() == 0
    finally:
        srv.stop()


def test_a_fork_childs_renewal_thread_does_not_bring_back_the_parents_ended_request(
        redis_server, redis_prefix):
    """RedisStorage renews its rows from a thread of its own. A fork child (a tool's
    multiprocessing worker, say) inherits the parent's held rows; once it tracks a request of
    its own, its renewal thread renewed the parent's rows too: a request the parent had ended
    meanwhile was tracked back in Redis (in flight for good, while the child lives)."""
    lease = 0.3
    st = _storage(redis_server.url, redis_prefix, lease=lease)
    c = Cancellation(None, backend=st)
    end_r, end_w = os.pipe()  # the parent's word to the child: end your request
    pid = None
    try:
        h = c.begin(1, "s")
        assert h.tracked

        def in_child(w: int) -> None:  # a request of its own, running until told to end it
            os.close(end_w)
            with c.begin(2, "s") as h2:
                os.write(w, b"1" if h2.tracked else b"0")
                select.select([end_r], [], [], 30)

        pid, r = child(in_child)
        try:
            assert recv(r, 10) == b"1"  # the child's request is tracked
        finally:
            os.close(r)
        h.end()
        assert not c.in_flight(1, "s")
        # past two leases: the child's row lives only by its renewals, which must not bring
        # the parent's ended request back
        end = time.monotonic() + 2 * lease
        while time.monotonic() < end:
            assert c.in_flight(2, "s") and not c.in_flight(1, "s")
            time.sleep(0.02)
        os.write(end_w, b"x")
        status = wait_exit(pid, 10)
        assert status is not None and os.waitstatus_to_exitcode(status) == 0
        pid = None
        assert not c.in_flight(1, "s") and not c.in_flight(2, "s")
    finally:
        os.close(end_r)
        os.close(end_w)
        if pid is not None:
            reap(pid)
        for k in st.store.client.scan_iter(redis_prefix + "*"):
            st.store.client.delete(k)


def test_rows_of_requests_ended_while_redis_is_away_are_bounded(redis_prefix):
    """Bounded everything: a request that ends while Redis gives no answer leaves its row held
    for ``reap_ended`` (its track never landed, or its end got no answer). Nothing bounded
    them: every request of an outage (distinct ids from any client) stayed in the process's
    memory until Redis answered. At most ``ENDED_MAX`` are kept; a running request's row
    always is."""
    from shmcancel.redis import storage

    bound = getattr(storage, "ENDED_MAX", 1024)
    # no renewer: its rows never reach Redis, so it would outlive the test, reconnecting
    st = _storage(f"redis://127.0.0.1:{free_port()}/0", redis_prefix, timeout=0.5,
                  auto_renew=False)
    c = Cancellation(None, backend=st)
    running = c.begin("still-running", "ip:10.0.0.9")
    for i in range(3 * bound):
        c.begin(f"r{i}", "ip:10.0.0.1").end()
        with contextlib.suppress(Exception):  # track raises the backend's error
            c.track(f"t{i}", "ip:10.0.0.2")
        c.untrack(f"t{i}", "ip:10.0.0.2")
        assert st.held() <= 2 * bound + 8  # pruned as it doubles: never more
    assert ("ip:10.0.0.9", "still-running") in {(s, r) for s, r, _ in st._mine}
    running.end()


@pytest.mark.parametrize("owner", [True, False], ids=["a request's end", "a plain clear"])
@pytest.mark.parametrize("row_at", [120.0, 200.0], ids=["older", "newer"])
def test_an_end_landing_late_takes_only_a_row_from_before_it(redis_server, redis_prefix,
                                                            owner, row_at):
    """An owed end (or plain clear) asked at 150 lands later (``Storage.end``, what the owed
    queue runs): the key's cancellation row goes only if it was recorded before 150; one
    recorded since is a later cancellation's and stays (untrack.lua used to take any row)."""
    st = _storage(redis_server.url, redis_prefix)
    now = [100.0]
    c = Cancellation(None, backend=st, clock=lambda: now[0])
    h = c.begin(5, "s")
    try:
        assert h.tracked
        now[0] = row_at
        assert c.cancel_if_in_flight(5, "why", "s")
        if not owner:
            h.end()  # the request is over (its end took the row)
            c.cancel(5, "why", "s")  # recorded again, at row_at
        st.end("s", "5", h._owner if owner else None, 150.0)
        assert not c.in_flight(5, "s")
        assert c.cancelled(5, "s") is (row_at > 150.0)
        assert st.scope_rows("s") == (1 if row_at > 150.0 else 0)
    finally:
        h.end()
        for k in st.store.client.scan_iter(redis_prefix + "*"):
            st.store.client.delete(k)


def test_a_track_that_raises_leaves_no_row_behind(redis_prefix):
    """``Cancellation.track`` over RedisStorage while Redis is down raises to its caller, who
    then never untracks. Its row stayed held and the renewer added it back once Redis
    returned, renewing it for the process's life: the id in flight for good, and a gated
    cancellation of it recorded. Now a failed plain track is let go of."""
    srv = RedisServer()  # not started yet: Redis is down
    st = _storage(srv.url, redis_prefix, timeout=0.2, auto_renew=False)
    c = Cancellation(None, backend=st)
    try:
        with pytest.raises(redis.ConnectionError):
            c.track(42, "s")
        assert st.held() == 0
        srv.start()
        assert st.renew() == 0  # the renewer's turn: nothing of the failed track to add back
        assert not c.in_flight(42, "s") and st.held() == 0
        assert c.cancel_if_in_flight(42, "x", "s") is False
        h = c.begin(43, "s")  # Redis answers: tracked as ever
        assert h.tracked and c.in_flight(43, "s")
        h.end()
        assert not c.in_flight(43, "s")
    finally:
        srv.stop()
