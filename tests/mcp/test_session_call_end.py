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

from shmcancel import Config
from shmcancel.mcp.sessions import SessionStore
from shmcancel.shm.registry import Registry

CLIENT = "ip:192.0.2.41"
T0 = 1000.0


def make(shm_name: str, lock_timeout: float) -> Registry:
    return Registry.create(shm_name, Config(capacity=64, max_rows=64, in_flight_capacity=16,
                                            session_capacity=64, sessions_per_client=2,
                                            lock_timeout=lock_timeout))


@pytest.fixture
def reg(shm_name: str) -> Iterator[Registry]:
    r = make(shm_name, 10.0)
    try:
        yield r
    finally:
        r.close()


@pytest.fixture
def reg_short(shm_name: str) -> Iterator[Registry]:
    r = make(shm_name, 0.3)
    try:
        yield r
    finally:
        r.close()


def lane_row(reg: Registry, sid: str) -> bool:
    return reg.lanes["session_calls"].member(reg.table("session_calls").prepare(sid))


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


def test_a_long_calls_end_touches_its_session_before_its_row_goes(reg: Registry,
                                                                  shm_name: str) -> None:
    """Another worker holds the lock while the call ends; it looks at the session (``get``,
    which expires an idle, long-unseen one) once the ending thread waits for the lock."""
    store, sid, call, later = long_call(reg)
    go_r, go_w = os.pipe()

    def other_worker(w: int) -> None:
        os.close(go_w)
        r = Registry.attach(shm_name)
        st = SessionStore(r, clock=lambda: later)
        with r.lock:
            os.write(w, b"held")
            recv(go_r, 30)
            os.write(w, b"kept" if st.get(sid) is not None else b"expired")

    pid, r = child(other_worker)
    os.close(go_r)
    t = threading.Thread(target=store.end_call, args=(call,))
    try:
        assert recv(r, 30) == b"held"
        t.start()
        deadline = time.monotonic() + 10
        while not reg.lock._st.tlock.locked():  # the ending thread waits for the lock
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
    go_r, go_w = os.pipe()

    def other_worker(w: int) -> None:
        os.close(go_w)
        r = Registry.attach(shm_name)
        st = SessionStore(r, clock=lambda: later)
        with r.lock:
            os.write(w, b"held")
            recv(go_r, 30)
        os.write(w, b"kept" if st.get(sid) is not None else b"expired")

    pid, r = child(other_worker)
    os.close(go_r)
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
