"""The end of a ``tools/call`` whose ``session_calls`` row is in its process's lane (contract
§6.1): a call that ran longer than the session's ttl left ``last_seen`` stale, so its session is
kept only by the row, and the end must touch the session before that row goes. Removed first
(and the touch then waiting for the lock, or owed after a lock timeout), another worker finds the
session idle, long unseen and with no call in flight, and expires it: the client's next request,
right after a call that just succeeded, is answered 404. Real registries, a real second process.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import pytest
from helpers.procs import child, reap, recv
from helpers.session_calls import lane_row, small_registry

from shmcancel import Config
from shmcancel.mcp.sessions import SessionStore
from shmcancel.shm.lanes import Lanes
from shmcancel.shm.registry import Registry

CLIENT = "ip:192.0.2.41"
T0 = 1000.0


@pytest.fixture
def reg(shm_name: str) -> Iterator[Registry]:
    with small_registry(shm_name) as r:
        yield r


@pytest.fixture
def reg_short(shm_name: str) -> Iterator[Registry]:
    with small_registry(shm_name, lock_timeout=0.3) as r:
        yield r


def long_call(reg: Registry) -> tuple[SessionStore, str, object, float]:
    """A store, a session, a call in it (its row in this process's lane) that has run for twice
    the ttl (the store's clock moved on), and that clock's time."""
    now = [T0]
    store = SessionStore(reg, clock=lambda: now[0])
    s = store.create("2025-06-18", CLIENT)
    store.end_call(store.begin_call(s))  # type: ignore[arg-type]  # claims the lane
    c = store.begin_call(s)
    assert c is not None and c.way >= 0 and lane_row(reg, s.id)
    now[0] += 2 * store.ttl
    return store, s.id, c, now[0]


def other_worker(shm_name: str, sid: str, later: float, *, look_holding_the_lock: bool
                 ) -> tuple[int, int, int]:
    """Another worker, at the store's clock ``later``: takes the registry lock, writes
    ``held``, waits for ``go`` on the pipe, then looks at the session (``get``, which expires an
    idle, long-unseen one) holding the lock or just after releasing it, and writes ``kept`` or
    ``expired``. ``(pid, its messages' read end, the go pipe's write end)``."""
    go_r, go_w = os.pipe()

    def run(w: int) -> None:
        os.close(go_w)
        r = Registry.attach(shm_name)
        st = SessionStore(r, clock=lambda: later)
        with r.lock:
            os.write(w, b"held")
            recv(go_r, 30)
            if look_holding_the_lock:
                os.write(w, b"kept" if st.get(sid) is not None else b"expired")
        if not look_holding_the_lock:
            os.write(w, b"kept" if st.get(sid) is not None else b"expired")

    pid, r = child(run)
    os.close(go_r)
    return pid, r, go_w


def thread_lock_free(reg: Registry) -> bool:
    """Whether no thread of this process holds the registry lock's thread lock (the one a
    thread takes before the semaphore): a non-blocking take, given back at once."""
    tlock = reg.lock._st.tlock
    if not tlock.acquire(False):
        return False
    tlock.release()
    return True


def test_a_long_calls_end_touches_its_session_before_its_row_goes(reg: Registry,
                                                                  shm_name: str) -> None:
    """Another worker holds the lock while the call ends; it looks at the session (``get``,
    which expires an idle, long-unseen one) once the ending thread waits for the lock."""
    store, sid, call, later = long_call(reg)
    pid, r, go_w = other_worker(shm_name, sid, later, look_holding_the_lock=True)
    t = threading.Thread(target=store.end_call, args=(call,))
    try:
        assert recv(r, 30) == b"held"
        t.start()
        deadline = time.monotonic() + 10
        while thread_lock_free(reg):  # until the ending thread waits for the lock
            assert time.monotonic() < deadline and t.is_alive()
            time.sleep(0.001)
        os.write(go_w, b"go")
        seen = recv(r, 30)
        t.join(30)
        assert not t.is_alive()
    finally:
        os.close(go_w)
        os.close(r)
        reap(pid)
    assert seen == b"kept", "the session was expired between its call's end and its touch"
    assert store.get(sid) is not None and not lane_row(reg, sid)


def test_an_owed_end_keeps_its_session(reg_short: Registry, shm_name: str) -> None:
    """The end's lock wait times out (the end is owed to a later call of this store); another
    worker then sweeps before the owed end ran: the session must still count as in use, as it
    did when the row was in the table (removed with the touch, in one lock hold)."""
    reg = reg_short
    store, sid, call, later = long_call(reg)
    pid, r, go_w = other_worker(shm_name, sid, later, look_holding_the_lock=False)
    try:
        assert recv(r, 30) == b"held"
        store.end_call(call)  # type: ignore[arg-type]  # times out: owed
        assert store._owed
        os.write(go_w, b"go")
        seen = recv(r, 30)
    finally:
        os.close(go_w)
        os.close(r)
        reap(pid)
    assert seen == b"kept", "the session was expired while its call's end was owed"
    deadline = time.monotonic() + 10
    while store._owed:  # settled by the store's next call, once the lock is not stalled
        assert time.monotonic() < deadline
        store.sweep()
        time.sleep(0.01)
    assert store.get(sid) is not None and not lane_row(reg, sid)


def test_while_a_live_hold_outlasts_lock_timeout_only_the_first_end_waits(
        shm_name: str) -> None:
    """A reviewer's server answered a finished 2025-wire session call lock_timeout late while
    another live process held the lock, every such call: its end waited for the lock to touch
    the session. The first end of a process learns the hold is long (it waits, times out, is
    owed); the ends after it, while the hold goes on, are owed at once; an end after the hold,
    even within lock_timeout of the timeout, lands then and there (a second review: owed, it
    waited for this process's next request, and the session of a worker that served none
    expired); the owed ones land later."""
    with small_registry(shm_name, lock_timeout=2.0) as reg:
        now = [T0]
        store = SessionStore(reg, clock=lambda: now[0])
        calls, sids = [], []
        for n in range(3):  # three long calls (their ends touch their sessions)
            s = store.create("2025-06-18", f"ip:192.0.2.{42 + n}")
            sids.append(s.id)
            calls.append(store.begin_call(s))
            assert calls[-1] is not None
        sid = sids[0]
        first, second, third = calls
        now[0] += 2 * store.ttl
        go_r, go_w = os.pipe()

        def holder(w: int) -> None:
            os.close(go_w)
            r = Registry.attach(shm_name)
            with r.lock:
                os.write(w, b"held")
                recv(go_r, 60)

        pid, r = child(holder)
        os.close(go_r)
        try:
            assert recv(r, 30) == b"held"
            t0 = time.monotonic()
            store.end_call(first)  # type: ignore[arg-type]  # waits lock_timeout: owed
            assert time.monotonic() - t0 >= 2.0 and len(store._owed) == 1
            t0 = time.monotonic()
            store.end_call(second)  # type: ignore[arg-type]
            assert time.monotonic() - t0 < 1.5, "the second end waited for the lock again"
            assert len(store._owed) == 2
        finally:
            os.write(go_w, b"go")
            os.close(go_w)
            os.close(r)
            reap(pid)
        store.end_call(third)  # type: ignore[arg-type]  # the hold is over: it lands
        assert len(store._owed) == 2 and not lane_row(reg, sids[2])
        assert store.get(sids[2]) is not None  # touched: untouched, it expires at this get
        deadline = time.monotonic() + 10
        while store._owed:  # settled by the store's later calls, once the lock is free
            assert time.monotonic() < deadline
            store.sweep()
            time.sleep(0.01)
        assert store.get(sid) is not None and not lane_row(reg, sid)


def test_an_end_that_cannot_be_owed_still_removes_its_row(reg_short: Registry, shm_name: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The owed ends are bounded: one past the bound loses its touch, never its row (a row left
    in the lane would pin its session for as long as this process lives)."""
    monkeypatch.setattr("shmcancel.mcp.sessions._OWED_MAX", 0)
    reg = reg_short
    store, sid, call, _ = long_call(reg)

    def holder(w: int) -> None:
        r = Registry.attach(shm_name)
        with r.lock:
            os.write(w, b"held")
            time.sleep(60)

    pid, r = child(holder)
    try:
        assert recv(r, 30) == b"held"
        store.end_call(call)  # type: ignore[arg-type]  # times out, and cannot be owed
    finally:
        os.close(r)
        reap(pid)
    assert not store._owed and not lane_row(reg, sid)


def test_a_long_calls_end_never_lets_its_session_expire(reg: Registry) -> None:
    """A call longer than ``session_ttl`` ends: its row goes and the session is touched. Another
    worker's request landing at the instant the row goes must find the session (it was in use a
    moment ago, and its end refreshes it): the row went first, without the lock, and the touch
    came after, so that request expired the session (and got 404); so did every later one."""
    now = [1000.0]
    store = SessionStore(reg, clock=lambda: now[0])
    other = SessionStore(reg, clock=lambda: now[0])  # another worker's store
    s = store.create("2025-06-18", CLIENT)
    c = store.begin_call(s)
    assert c is not None and c.way >= 0
    now[0] += 3 * store.ttl  # the call runs longer than the session's ttl
    assert other.get(s.id) is not None  # kept meanwhile: a call runs in it
    lanes = reg.lanes["session_calls"]
    seen: list[bool] = []

    def remove(w: int, token: int) -> bool:
        gone = Lanes.remove(lanes, w, token)
        seen.append(other.get(s.id) is not None)  # a request of another worker, right then
        return gone

    lanes.remove = remove  # type: ignore[method-assign]
    try:
        store.end_call(c)
    finally:
        del lanes.remove
    assert seen == [True]
    assert store.get(s.id) is not None and other.get(s.id) is not None


def test_no_request_misses_a_session_as_its_long_calls_end(shm_name: str) -> None:
    """Two processes for 3 s, session_ttl 200 ms: one runs calls longer than the ttl back to back
    in session S (each end refreshes S, so S is never idle past its ttl); the other reads S
    without pause, as requests of other workers do. No read may miss S, and S is never lost."""
    ttl = 0.2
    r0 = Registry.create(shm_name, Config(session_capacity=64, sessions_per_client=2,
                                                session_ttl=ttl))
    try:
        store = SessionStore(r0)
        sid = store.create("2025-06-18", CLIENT).id
        stop_at = time.monotonic() + 3.0

        def reader(w: int) -> None:
            st = SessionStore(Registry.attach(shm_name))
            reads = missed = 0
            while time.monotonic() < stop_at:
                reads += 1
                missed += st.get(sid) is None
            os.write(w, f"{reads} {missed}".encode())

        pid, r = child(reader)
        calls = lost = 0
        try:
            while time.monotonic() < stop_at:
                s = store.get(sid)
                if s is None:  # lost: adopt it again, to go on racing
                    store.create("2025-06-18", CLIENT, session_id=sid)
                    continue
                c = store.begin_call(s)
                assert c is not None
                calls += 1
                busy_until = time.time() + 1.2 * ttl
                while time.time() < busy_until:
                    pass
                store.end_call(c)
                lost += store.get(sid) is None
            reads, missed = map(int, recv(r, 30).split())
        finally:
            os.close(r)
            reap(pid)
        assert (lost, missed) == (0, 0), f"{calls} calls: S lost at {lost} ends, " \
                                         f"missed by {missed} of {reads} reads"
        assert calls > 5 and reads > 1000, (calls, reads)
    finally:
        r0.close()
