"""Lane writes interrupted at chosen points (shm/lanes.py): a child blocks inside a store of its
own lane (its ``Lanes._q`` replaced, in that child only, by a view that stops before or after one
chosen store), is then SIGKILLed or SIGSTOPped there, and other processes check what they read:
no row of the dead process passes for another's, its rows are reaped, a gated cancel of its
request finds no live request once reaped, the lane serves a new process, and ``shmtool`` shows
and fixes the state. Every child is killed by pid at teardown (the ``spawn`` fixture)."""

from __future__ import annotations

import json
import os
import select
import signal
import time
from typing import Any

import pytest
from helpers.procs import Chan, proc_state, wait_zombie
from helpers.procs import shmtool_cli as shmtool

from shmcancel.cancellation import Cancellation
from shmcancel.shm import lanes, procinfo
from shmcancel.shm.registry import Registry

SCOPE = "session:kills"
RID = "victim"


class StopAt:
    """A stand-in for a lane's ``_q`` (its u64 words) that reports and blocks forever at the
    first store ``match(index, value)`` accepts, before or after making it."""

    def __init__(self, q: Any, chan: Chan, match: Any, after: bool) -> None:
        self._real = q
        self._chan = chan
        self._match = match
        self._after = after

    def __getitem__(self, i: Any) -> Any:
        return self._real[i]

    def __setitem__(self, i: int, v: int) -> None:
        if not self._match(i, v):
            self._real[i] = v
            return
        if self._after:
            self._real[i] = v
        self._chan.send({"at": True})
        select.select([], [], [], 600)  # until killed or stopped
        raise AssertionError("not killed")

    def release(self) -> None:
        self._real.release()


def _hash_word(i: int) -> bool:
    return lanes._HQ <= i < lanes._HQ + lanes.BUCKETS * lanes.LANES * lanes.WAYS


POINTS = {
    # name: (phase, match(index, value), stop after the store?, row visible once stopped?)
    "add-before-publish": ("add", lambda i, v: _hash_word(i) and v != 0, False, False),
    "add-after-publish": ("add", lambda i, v: _hash_word(i) and v != 0, True, True),
    "remove-before-unpublish": ("remove", lambda i, v: _hash_word(i) and v == 0, False, True),
    "remove-after-unpublish": ("remove", lambda i, v: _hash_word(i) and v == 0, True, False),
    "claim-before-owner": ("claim", lambda i, v: i >= lanes._OQ and i < lanes._OQ + lanes.LANES
                           and v != 0, False, False),
    "claim-before-high-water": ("claim", lambda i, v: i == lanes._HWQ, False, False),
}


def writer(chan: Chan, name: str, point: str) -> None:
    """Attach, then begin (and for a removal point end) ``RID`` in its lane, stopping at
    ``point``."""
    phase, match, after, _ = POINTS[point]
    reg = Registry.attach(name)
    c = Cancellation(reg)
    ln = reg.lanes["in_flight"]
    chan.send({"pid": os.getpid()})
    if phase != "claim":
        c.begin("warm-up", SCOPE).end()  # the lane is claimed before the chosen store
    if phase != "remove":
        ln._q = StopAt(ln._q, chan, match, after)  # type: ignore[assignment]
    h = c.begin(RID, SCOPE)
    assert type(h._receipt) is int, h._receipt  # in the lane
    ln._q = StopAt(ln._q, chan, match, after)  # type: ignore[assignment]
    h.end()
    raise AssertionError("not stopped")


def lane_row_owners(c: Cancellation) -> list[tuple[str, str, int]]:
    return [(k[0], k[1], o[0]) for k, o in c._store.lane_rows()]  # type: ignore[attr-defined]


@pytest.mark.parametrize("point", sorted(POINTS))
def test_a_writer_killed_at_a_lane_store_leaves_nothing_another_process_trusts(
        registry, spawn, point):
    reg = registry(lock_timeout=2.0, janitor_interval=3600.0)
    c = Cancellation(reg)
    c.begin("mine", SCOPE).end()  # this process's lane, claimed first
    child = spawn(writer, reg.name, point)
    pid = child.recv()["pid"]
    assert child.recv() == {"at": True}
    os.kill(pid, signal.SIGKILL)
    wait_zombie(pid)  # dead, unreaped: its pid is still there
    visible = POINTS[point][3]
    assert c.in_flight(RID, SCOPE) is visible
    assert c.in_flight_pids(RID, SCOPE) == ({pid} if visible else set())
    assert all(o == pid for _, _, o in lane_row_owners(c))  # nobody else's row
    dump = shmtool("dump", reg.name, "--json")
    assert dump.returncode == 0, dump.stderr
    rows = json.loads(dump.stdout)["in_flight"]
    assert [(r["request_id"], r["alive"]) for r in rows] == ([(RID, False)] if visible else [])
    assert c.reap() == (1 if visible else 0)  # the lock a dead claimer held is recovered
    assert not c.in_flight(RID, SCOPE) and lane_row_owners(c) == []
    assert c.cancel_if_in_flight(RID, "late", SCOPE) is False
    assert not c.cancelled(RID, SCOPE)
    assert [o for _, o in reg.lanes["in_flight"].lane_owners()] == [procinfo.me()]
    clean = shmtool("cleanup", reg.name)
    assert clean.returncode == 0, clean.stderr
    child.kill()
    # the lane serves a new process, and this one's still works
    fresh = spawn(writer, reg.name, "add-after-publish")
    fpid = fresh.recv()["pid"]
    assert fresh.recv() == {"at": True}
    assert c.in_flight_pids(RID, SCOPE) == {fpid}
    assert c.cancel_if_in_flight(RID, "live", SCOPE) is True
    h = c.begin("mine-2", SCOPE)
    assert type(h._receipt) is int and c.in_flight("mine-2", SCOPE)
    h.end()
    fresh.kill()
    assert c.reap() == 1 and lane_row_owners(c) == []


@pytest.mark.parametrize("point", ["add-after-publish", "remove-before-unpublish",
                                   "claim-before-owner"])
def test_a_writer_stopped_at_a_lane_store_delays_no_reader(registry, spawn, point):
    """SIGSTOP at the store: lock-free reads go on; the stopped owner is alive, so its row
    stays through a reap and a gated cancel of it is recorded; one stopped while claiming
    holds the lock: a write here times out after ``lock_timeout``, never hangs."""
    reg = registry(lock_timeout=0.5, janitor_interval=3600.0)
    c = Cancellation(reg)
    c.begin("mine", SCOPE).end()
    child = spawn(writer, reg.name, point)
    pid = child.recv()["pid"]
    assert child.recv() == {"at": True}
    os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 10
        while proc_state(pid) != "T":
            assert time.monotonic() < deadline
            time.sleep(0.002)
        t0 = time.monotonic()
        for i in range(200):  # this process's lane: no lock
            h = c.begin(i, SCOPE)
            assert h.tracked
            h.end()
        visible = POINTS[point][3]
        assert c.in_flight(RID, SCOPE) is visible
        dump = shmtool("dump", reg.name, "--json")
        assert dump.returncode == 0, dump.stderr
        if point == "claim-before-owner":
            from shmcancel import LockTimeout
            with pytest.raises(LockTimeout):
                c.cancel(1, None, SCOPE)
        else:
            assert c.reap() == 0
            assert c.cancel_if_in_flight(RID, "stopped", SCOPE) is True
        assert time.monotonic() - t0 < 8
    finally:
        os.kill(pid, signal.SIGCONT)
    child.kill()


def test_a_lane_of_a_reused_pid_is_not_inherited(registry):
    """A lane whose owner word names this process's pid with another start time (the process
    that had the pid before) holds rows: they are another process's, dead: reaped by pid,
    never read as this process's, and this process's claim clears them."""
    reg = registry(janitor_interval=3600.0)
    c = Cancellation(reg)
    ln = reg.lanes["in_flight"]
    pid, start = procinfo.me()
    old = (pid, start - 1)
    pk = c._store._fk(SCOPE, RID)  # type: ignore[attr-defined]
    with reg.lock:  # forge the predecessor's lane 0 and one row in it
        ln._q[lanes._OQ] = procinfo.pack_owner(*old)
        ln._q[lanes._HWQ] = 1
        w = (lanes._bucket(pk.hash) * lanes.LANES + 0) * lanes.WAYS
        lanes._BODY.pack_into(ln._buf, lanes._D + lanes.BODY * w, 1, 7, len(pk.kbytes),
                              pk.kbytes)
        ln._q[lanes._HQ + w] = pk.hash
    assert c.in_flight(RID, SCOPE) and c.in_flight_pids(RID, SCOPE) == {pid}
    assert ln.own_rows() == []  # not this process's
    assert c._store.untrack_thread(SCOPE, RID, pid, start, 1) is False  # type: ignore[attr-defined]
    assert c.sweep() == (0, 1)  # dead: the start time differs
    assert not c.in_flight(RID, SCOPE) and ln.lane_owners() == []
    with reg.lock:  # again; this time this process claims the lane
        ln._q[lanes._OQ] = procinfo.pack_owner(*old)
        ln._q[lanes._HQ + w] = pk.hash
    h = c.begin("mine", SCOPE)
    assert type(h._receipt) is int
    assert ln.lane_owners() == [(0, (pid, start))]
    assert not c.in_flight(RID, SCOPE)  # cleared by the claim, not inherited
    h.end()


# ------------------------------------------------------------------ a lane changing owners
def holder(chan: Chan, name: str, rid: str) -> None:
    """Begin ``rid`` in this process's lane; on "close" close the registry (the lane is
    released); exit on "exit"."""
    reg = Registry.attach(name)
    h = Cancellation(reg).begin(rid, SCOPE)
    assert type(h._receipt) is int
    chan.send({"pid": os.getpid(), "lane": (h._receipt // lanes.WAYS) % lanes.LANES})
    while (cmd := chan.recv(60)) != "exit":
        assert cmd == "close"
        reg.close()
        chan.send("closed")


def test_a_dead_owners_row_read_while_a_new_process_claims_its_lane_is_not_the_new_ones(
        registry, spawn):
    """A reader finds a dead process's row, then (before it reads the lane's owner word) a new
    process claims that lane, clearing the row: the row is not reported as the new process's
    (``in_flight_pids`` would ring it; a session's call so misread keeps the session "busy")."""
    reg = registry(janitor_interval=3600.0)
    c = Cancellation(reg)
    dead = spawn(holder, reg.name, RID)
    got = dead.recv()
    os.kill(got["pid"], signal.SIGKILL)
    wait_zombie(got["pid"])
    ln = reg.lanes["in_flight"]
    real = ln._hits
    fresh: list[Any] = []

    def hits(pk: Any) -> Any:
        for w in real(pk):
            if not fresh:  # between the row's hash and the lane's owner word
                fresh.append(spawn(holder, reg.name, "other"))
                claimed = fresh[0].recv()
                assert claimed["lane"] == got["lane"]
            yield w

    ln._hits = hits  # type: ignore[method-assign]
    pids = c.in_flight_pids(RID, SCOPE)
    del ln._hits
    assert fresh and fresh[0].pid not in (pids or set())
    assert not c.in_flight(RID, SCOPE)  # the claim cleared it
    fresh[0].send("exit")
    assert fresh[0].wait() == 0


def test_rows_of_a_lane_read_while_it_changes_owners_are_not_the_old_owners(registry, spawn):
    """``rows()`` (shmtool dump, in_flight_rows) reads the owners, then the rows: a lane
    released by its live owner and claimed by a new process in between must not show the new
    process's rows as the old (live) owner's."""
    reg = registry(janitor_interval=3600.0)
    c = Cancellation(reg)
    first = spawn(holder, reg.name, "first")
    got = first.recv()
    ln = reg.lanes["in_flight"]
    real = ln.lane_owners
    second: list[Any] = []

    def lane_owners() -> Any:
        out = real()
        if not second:  # the owners read, the rows not yet
            assert ask_close(first) == "closed"
            second.append(spawn(holder, reg.name, "second"))
            assert second[0].recv()["lane"] == got["lane"]
        return out

    ln.lane_owners = lane_owners  # type: ignore[method-assign]
    rows = lane_row_owners(c)
    del ln.lane_owners
    assert ("session:kills", "second", got["pid"]) not in rows
    assert lane_row_owners(c) == [("session:kills", "second", second[0].pid)]
    for ch in (first, second[0]):
        ch.send("exit")
        assert ch.wait() == 0


def ask_close(ch: Any) -> Any:
    ch.send("close")
    return ch.recv()
