"""A ``tools/call``'s session row in its process's lane (contract §6.1: a session with a call in
flight is never evicted): written without the lock, yet never missed by a mint that gives a
session up or a sweep that expires it, which decide inside the lanes' seal (``shm/lanes.py``).
Real registries, real forked processes."""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Iterator

import pytest
from helpers.procs import child, first_message, reap, recv
from helpers.session_calls import lane_row, small_registry

from shmcancel.mcp.sessions import Call, SessionStore
from shmcancel.shm.registry import Registry

CLIENT = "ip:192.0.2.40"


@pytest.fixture
def reg(shm_name: str) -> Iterator[Registry]:
    with small_registry(shm_name) as r:
        yield r


def test_a_call_takes_no_lock_and_leaves_no_row(reg: Registry) -> None:
    store = SessionStore(reg)
    s = store.create("2025-06-18", CLIENT)
    store.end_call(store.begin_call(s))  # type: ignore[arg-type]  # claims the lane (locked)
    gen = reg.info()["lock_generation"]
    c = store.begin_call(s)
    assert c is not None and c.way >= 0 and lane_row(reg, s.id)
    assert not reg.table("session_calls").member(s.id)
    store.end_call(c)
    assert not lane_row(reg, s.id)
    assert reg.info()["lock_generation"] == gen  # neither end took the lock


def test_a_busy_session_is_kept_by_a_mint_and_by_expiry(reg: Registry) -> None:
    now = [1000.0]
    store = SessionStore(reg, clock=lambda: now[0])
    s = store.create("2025-06-18", CLIENT)
    c = store.begin_call(s)
    assert c is not None and c.way >= 0
    other = store.create("2025-06-18", CLIENT)
    now[0] += 10
    store.create("2025-06-18", CLIENT)  # at the bound: gives up `other`, not the older busy `s`
    assert store.get(other.id) is None and store.get(s.id) is not None
    now[0] += 2 * store.ttl
    assert store.sweep_all() == 1  # the idle newest one expired; `s` has its call
    assert store.get(s.id) is not None
    store.end_call(c)
    now[0] += 2 * store.ttl
    assert store.get(s.id) is None


def test_a_call_that_finds_the_lanes_sealed_waits_for_the_decision(reg: Registry) -> None:
    """A sealer holds the lock; the call publishes its row, sees the seal and must wait for the
    lock before trusting the session row it can read. The sealer then removes the session (as
    one that decided before seeing the row would): the call must answer "gone" (None) and take
    its row back. Without the seal check it returns a call in a removed session."""
    store = SessionStore(reg)
    s = store.create("2025-06-18", CLIENT)
    store.end_call(store.begin_call(s))  # type: ignore[arg-type]  # lane claimed beforehand
    lanes = reg.lanes["session_calls"]
    result: list[Call | None] = []

    def call() -> None:
        result.append(store.begin_call(s))

    t = threading.Thread(target=call)
    with reg.lock, lanes.seal():
        t.start()
        deadline = time.monotonic() + 10
        while not lane_row(reg, s.id):  # published, then sealed out: now waiting for the lock
            assert time.monotonic() < deadline and t.is_alive(), result
            time.sleep(0.001)
        assert reg.table("sessions").delete(s.id)
    t.join(10)
    assert not t.is_alive() and result == [None]
    assert not lane_row(reg, s.id) and not lanes.sealed()


def test_a_sealer_that_died_inside_leaves_no_lasting_seal(reg: Registry, shm_name: str) -> None:
    store = SessionStore(reg)
    s = store.create("2025-06-18", CLIENT)

    def die_sealed(w: int) -> None:
        r = Registry.attach(shm_name)
        r.lock.__enter__()
        seal = r.lanes["session_calls"].seal()
        seal.__enter__()
        os.write(w, b"sealed")
        time.sleep(60)
        seal.__exit__(None, None, None)

    first_message(die_sealed)  # killed inside the seal, holding the lock
    assert reg.lanes["session_calls"].sealed()
    c = store.begin_call(s)  # takes the lock (recovered from the dead holder), clears the seal
    assert c is not None and not reg.lanes["session_calls"].sealed()
    store.end_call(c)
    gen = reg.info()["lock_generation"]
    store.end_call(store.begin_call(s))  # type: ignore[arg-type]
    assert reg.info()["lock_generation"] == gen  # back to the lock-free path


def test_calls_racing_mints_never_run_in_a_given_up_session(reg: Registry,
                                                          shm_name: str) -> None:
    """Two processes for 3 s: one keeps calling in session S (re-adopting S whenever a mint gave
    it up while idle); the other keeps minting sessions for the same client (2 per client), and
    each mint gives up the least recently seen idle session: S unless a call runs in it. A call
    that began must find S still there until it ends."""
    store = SessionStore(reg)
    sid = store.create("2025-06-18", CLIENT).id
    stop_at = time.monotonic() + 3.0

    def minter(w: int) -> None:
        st = SessionStore(Registry.attach(shm_name))
        n = 0
        while time.monotonic() < stop_at:
            st.create("2025-06-18", CLIENT)
            n += 1
        os.write(w, str(n).encode())

    pid, r = child(minter)
    calls = lost = 0
    idle = itertools.cycle(range(0, 400, 23))
    try:
        while time.monotonic() < stop_at:
            for _ in range(next(idle)):  # idle a little between calls: S is often given up
                pass
            s = store.get(sid)
            if s is None:
                store.create("2025-06-18", CLIENT, session_id=sid)
                continue
            c = store.begin_call(s)
            if c is None:
                continue
            calls += 1
            if store.get(sid) is None:
                lost += 1
            store.end_call(c)
        mints = int(recv(r, 30))
    finally:
        os.close(r)
        reap(pid)
    assert lost == 0, f"{lost} of {calls} calls ran in a session given up under them"
    assert calls > 1000 and mints > 500, (calls, mints)  # both sides really raced
