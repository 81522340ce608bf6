"""contract §4 across real forked processes sharing one registry in /dev/shm.

Synchronisation is by messages over socketpairs (never by sleeping); every child is stopped by
its pid in a ``finally``. Children attach the registry themselves, as gunicorn workers do.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
from helpers import procs
from helpers.gunicorn_harness import wait_until
from helpers.procs import TIMEOUT, Chan, Child, fork, wait_exit, wait_zombie
from helpers.rows import in_flight_count, in_flight_rows
from helpers.stalled_lock import stalled_lock

from shmcancel import CancellationLimitReached, TableFull, telemetry
from shmcancel.cancel import owed
from shmcancel.cancellation import CLEANUP_EVENT, Cancellation
from shmcancel.shm.registry import Registry


# ------------------------------------------------------------------------------ child programs
def poller(chan: Chan, name: str, rid: Any, scope: str) -> None:
    """Begin a request, poll it on command: "poll" -> answers the poll's result; "end"."""
    c = Cancellation(Registry.attach(name))
    h = c.begin(rid, scope)
    chan.send({"pid": os.getpid(), "tracked": h.tracked, "cancelled": h.cancelled()})
    while True:
        cmd = chan.recv()
        if cmd == "poll":
            chan.send({"cancelled": h.cancelled(), "reason": h.reason()})
        elif cmd == "spin":  # poll a few thousand times (warms the cached watch)
            chan.send({"any": any(h.cancelled() for _ in range(5000))})
        elif cmd == "end":
            h.end()
            chan.send("ended")
        elif cmd == "exit":
            return


def canceller(chan: Chan, name: str, ids: list, scope: str, reason: str) -> None:
    """Wait for "go", cancel every id, report how many were refused by the quota."""
    c = Cancellation(Registry.attach(name))
    chan.send("ready")
    assert chan.recv() == "go"
    refused = 0
    for rid in ids:
        try:
            c.cancel(rid, reason, scope)
        except CancellationLimitReached:
            refused += 1
    chan.send({"refused": refused})


def tracker(chan: Chan, name: str, ids: list, scope: str) -> None:
    """Track ids (plain track, no handle), report, then wait to be killed or told to exit."""
    c = Cancellation(Registry.attach(name))
    for rid in ids:
        c.track(rid, scope)
    chan.send({"pid": os.getpid()})
    cmd = chan.recv(60)
    assert cmd == "exit"


def writer(chan: Chan, name: str, scope: str) -> None:
    """On command ["cancel", id] / ["clear", id]: do it and answer "done"; "exit" returns."""
    c = Cancellation(Registry.attach(name))
    while True:
        cmd = chan.recv()
        if cmd == "exit":
            return
        op, rid = cmd
        if op == "cancel":
            c.cancel(rid, "from writer", scope)
        else:
            c.clear(rid, scope)
        chan.send("done")


# ------------------------------------------------------------------------------ tests
def test_cached_polls_follow_another_processes_writes_both_ways(registry, spawn):
    """A poll answered from its cache (c.cancelled(id, scope) with a warm watch; a handle's
    poll) sees the very next change another process makes: a cancel, a clear (the plain poll
    goes back to False, the handle stays latched), and a neighbour's write moving the bucket
    version without changing the answer."""
    reg = registry()
    c = Cancellation(reg)
    scope = "ip:198.51.100.1"
    h = c.begin(5, scope)
    child = spawn(writer, reg.name, scope)
    for rid in (5, "5"):
        for _ in range(100):  # warm: answered from the cached watch
            assert c.cancelled(rid, scope) is False and h.cancelled() is False
    for op, rid, plain, handle in [
        ("cancel", 6, False, False),  # a neighbour: the bucket may move, the answer not
        ("cancel", 5, True, True),
        ("clear", 6, True, True),
        ("clear", 5, False, True),  # the handle latched
        ("cancel", 5, True, True),
    ]:
        child.send([op, rid])
        assert child.recv() == "done"
        for _ in range(3):  # the first poll after the change, then cached ones
            assert c.cancelled(5, scope) is plain and c.cancelled("5", scope) is plain
            assert h.cancelled() is handle
    h.end()
    child.send("exit")
    assert child.wait() == 0


def gated_canceller(chan: Chan, name: str, rid: Any, scope: str) -> None:
    """On "go": cancel_if_in_flight(rid) (its in-flight check prepares the key first, the
    cancellation row reuses it), report whether it recorded."""
    c = Cancellation(Registry.attach(name))
    chan.send("ready")
    assert chan.recv() == "go"
    chan.send({"recorded": c.cancel_if_in_flight(rid, "gated", scope)})


def test_keys_reused_across_tables_find_the_rows_other_processes_write(registry, spawn):
    """A key prepared once per request serves both tables (a handle's begin prepares the
    in-flight key, its poll reuses it for the cancellation row; a gated cancel's in-flight
    check prepares it, its row reuses it): rows written through a reused key are found through
    a freshly prepared one in another process, and the other way round."""
    reg = registry()
    c = Cancellation(reg)
    scope = "session:reuse"
    h = c.begin("r-1", scope)
    assert h.cancelled() is False  # the watch, from the key begin prepared
    child = spawn(gated_canceller, reg.name, "r-1", scope)
    assert child.recv() == "ready"
    child.send("go")
    assert child.recv() == {"recorded": True}
    assert h.cancelled() is True and h.reason() == "gated"
    fresh = Cancellation(Registry.attach(reg.name))  # new key caches: keys prepared afresh
    assert fresh.cancelled("r-1", scope) and fresh.reason("r-1", scope) == "gated"
    assert fresh.in_flight("r-1", scope)
    h.end()
    assert not fresh.in_flight("r-1", scope) and not fresh.cancelled("r-1", scope)
    assert child.wait() == 0
    fresh.registry.close()  # type: ignore[union-attr]


def test_cancel_in_one_process_is_seen_by_the_next_poll_in_another(registry, spawn):
    reg = registry()
    c = Cancellation(reg)
    child = spawn(poller, reg.name, 7, "session:S")
    hello = child.recv()
    assert hello["tracked"] and not hello["cancelled"]
    assert c.in_flight(7, "session:S")
    child.send("spin")
    assert child.recv() == {"any": False}
    c.cancel("7", "stop please", "session:S")
    child.send("poll")  # the very next poll sees it
    assert child.recv() == {"cancelled": True, "reason": "stop please"}
    child.send("end")
    assert child.recv() == "ended"
    assert not c.in_flight(7, "session:S") and not c.cancelled(7, "session:S")
    child.send("exit")
    assert child.wait() == 0


def test_a_cancel_from_a_child_reaches_the_parents_handle(registry, spawn):
    reg = registry()
    c = Cancellation(reg)
    h = c.begin(3, "ip:192.0.2.1")
    for _ in range(1000):
        assert not h.cancelled()
    child = spawn(canceller, reg.name, [3], "ip:192.0.2.1", "from child")
    assert child.recv() == "ready"
    child.send("go")
    assert child.recv() == {"refused": 0}
    assert h.cancelled() and h.reason() == "from child"
    h.end()
    assert child.wait() == 0


@pytest.mark.parametrize("other_row", [False, True], ids=["alone", "beside-another-row"])
def test_an_unpolled_request_ends_and_clears_the_row_another_process_recorded(
        registry, spawn, other_row):
    """The usual way a cancellation lands: another worker records it, the tool never polls
    (its handle keeps no watch) and ends. The end clears the row, which this process never
    prepared a key for (``ShmBackend.exists`` asks through the request's own in-flight key),
    and leaves the scope's other row."""
    reg = registry()
    c = Cancellation(reg)
    scope = "ip:192.0.2.7"
    if other_row:
        c.cancel("another", None, scope)
    h = c.begin(3, scope)
    child = spawn(canceller, reg.name, [3], scope, "from child")
    assert child.recv() == "ready"
    child.send("go")
    assert child.recv() == {"refused": 0}
    assert child.wait() == 0
    rows = reg.table("cancellations")
    assert sorted(k for k, _ in rows.scan()) == [(scope, "3")] + [(scope, "another")] * other_row
    h.end()
    assert [k for k, _ in rows.scan()] == [(scope, "another")] * other_row
    assert not c.in_flight(3, scope)


def test_concurrent_duplicates_of_one_id_across_processes(registry, spawn):
    reg = registry()
    c = Cancellation(reg)
    kids = [spawn(poller, reg.name, 1, "ip:203.0.113.9") for _ in range(4)]
    pids = {k.recv()["pid"] for k in kids}
    assert in_flight_count(reg) == 4
    assert {owner[0] for _, owner in in_flight_rows(reg)} == pids
    c.cancel(1, "all of them", "ip:203.0.113.9")
    for k in kids:
        k.send("poll")
        assert k.recv()["cancelled"] is True
    # one namesake ends: its own in-flight row goes; the others stay in flight, cancelled, and
    # the key's row stays theirs (one that had not polled yet still finds it); the last to end
    # clears it
    kids[0].send("end")
    assert kids[0].recv() == "ended"
    assert in_flight_count(reg) == 3 and c.in_flight(1, "ip:203.0.113.9")
    assert c.cancelled(1, "ip:203.0.113.9")
    for k in kids[1:]:
        k.send("poll")
        assert k.recv()["cancelled"] is True
        k.send("end")
        assert k.recv() == "ended"
    assert in_flight_count(reg) == 0
    assert not c.cancelled(1, "ip:203.0.113.9") and reg.table("cancellations").count() == 0
    for k in kids:
        k.send("exit")
        assert k.wait() == 0


def test_a_namesake_beginning_after_a_cancellation_leaves_it_to_the_request_it_was_for(
        registry, spawn):
    """contract §4.3/§6.1: a row older than a request is not that request's, so a namesake
    beginning after a cancellation does not start out cancelled; but while the request it was
    for still runs, the row is that one's. The namesake's first look removed it (a row older
    than itself taken for a leftover), and the cancelled request, polling next, ran on."""
    reg = registry()
    c = Cancellation(reg)
    scope = "ip:203.0.113.9"
    first = spawn(poller, reg.name, 1, scope)
    assert first.recv()["tracked"] is True
    c.cancel(1, "stop", scope)
    later = spawn(poller, reg.name, 1, scope)
    got = later.recv()  # its first look, after the cancellation
    assert got["tracked"] is True and got["cancelled"] is False
    first.send("poll")
    assert first.recv() == {"cancelled": True, "reason": "stop"}
    later.send("poll")
    assert later.recv()["cancelled"] is False
    for k in (first, later):
        k.send("end")
        assert k.recv() == "ended"
    assert in_flight_count(reg) == 0 and reg.table("cancellations").count() == 0
    for k in (first, later):
        k.send("exit")
        assert k.wait() == 0


def start_together(kids: list[Child]) -> None:
    """Wait until every canceller is ready, then let them all go."""
    for k in kids:
        assert k.recv() == "ready"
    for k in kids:
        k.send("go")


def test_concurrent_cancels_of_one_id_make_one_row(registry, spawn):
    reg = registry()
    kids = [spawn(canceller, reg.name, [9] * 50, "s", f"from {i}") for i in range(3)]
    start_together(kids)
    for k in kids:
        assert k.recv() == {"refused": 0}
    assert reg.table("cancellations").count() == 1
    assert Cancellation(reg)._store.scope_rows("s") == 1
    assert reg.table("cancellations").get(("s", "9"))[0] in {"from 0", "from 1", "from 2"}


def test_quota_holds_under_concurrent_writers(registry, spawn):
    reg = registry(max_rows_per_scope=20)
    kids = [spawn(canceller, reg.name, list(range(i * 30, i * 30 + 30)), "ip:x", "flood")
            for i in range(3)]
    start_together(kids)
    refused = sum(k.recv()["refused"] for k in kids)
    assert refused == 70
    assert reg.table("cancellations").count() == 20
    assert Cancellation(reg)._store.scope_rows("ip:x") == 20
    Cancellation(reg).cancel(1, None, "session:victim")  # another scope is still served


def test_cap_holds_under_concurrent_writers(registry, spawn):
    reg = registry(max_rows=60, max_rows_per_scope=None)
    kids = [spawn(canceller, reg.name, list(range(100)), f"s{i}", "x") for i in range(3)]
    start_together(kids)
    for k in kids:
        assert k.recv() == {"refused": 0}
    assert reg.table("cancellations").count() <= 60
    c = Cancellation(reg)
    assert sum(c._store.scope_rows(f"s{i}") for i in range(3)) == reg.table("cancellations").count()
    assert reg.evictions == 300 - reg.table("cancellations").count()


def test_cleanup_drops_a_dead_processs_row_while_a_live_one_keeps_the_id(registry, spawn):
    reg = registry()
    c = Cancellation(reg)
    dead = spawn(tracker, reg.name, [5], "s")
    dead_pid = dead.recv()["pid"]
    live = spawn(poller, reg.name, 5, "s")
    live_pid = live.recv()["pid"]
    assert in_flight_count(reg) == 2
    dead.kill()  # SIGKILL: no untrack ran
    seen = []
    telemetry.attach("procs-cleanup", CLEANUP_EVENT, lambda e, m, md, cfg: seen.append(m))
    try:
        assert c.cleanup() == 0
    finally:
        telemetry.detach("procs-cleanup")
    assert seen == [{"removed": 0, "in_flight_removed": 1}]
    assert c.in_flight(5, "s")
    assert [o[0] for _, o in in_flight_rows(reg)] == [live_pid] != [dead_pid]
    live.send("exit")
    assert live.wait() == 0


def test_an_unreaped_zombie_counts_as_dead(registry, spawn):
    reg = registry()
    c = Cancellation(reg)
    z = spawn(tracker, reg.name, [1, 2], "s")
    z.recv()
    z.send("exit")  # exits without untracking; not reaped yet
    wait_zombie(z.pid, TIMEOUT)
    assert c.reap() == 2
    assert in_flight_count(reg) == 0
    assert z.wait() == 0


def test_reap_pid_drops_only_that_workers_rows(registry, spawn):
    reg = registry()
    c = Cancellation(reg)
    a = spawn(tracker, reg.name, [1, 2], "s")
    b = spawn(tracker, reg.name, [1, 3], "s")
    a_pid, b_pid = a.recv()["pid"], b.recv()["pid"]
    a.kill()
    b.kill()
    assert c.reap(a_pid) == 2  # what gunicorn's child_exit does for the worker it reaped
    assert {o[0] for _, o in in_flight_rows(reg)} == {b_pid}
    assert c.reap() == 2


def test_reaping_a_dead_request_takes_its_cancellation_with_it(registry, spawn):
    """A request cancelled, then its process killed before it ended (a tool that does not
    poll, a worker killed): its in-flight row was reaped, but its cancellation row stayed for
    ``ttl`` (300 s), counted against its scope's quota (contract §4.3: "a cancellation never
    outlives its request"). It goes with the reap, a handle's (lane) row's and a plain
    track's alike; a key whose namesake still runs keeps its row (the cancellation is that
    namesake's too)."""
    reg = registry()
    c = Cancellation(reg)
    handle = spawn(poller, reg.name, 1, "s")  # a lane row
    hp = handle.recv()["pid"]
    plain = spawn(tracker, reg.name, [2, 3], "s")  # shared-table rows
    plain.recv()
    live = spawn(poller, reg.name, 3, "s")  # a namesake of 3 that lives on
    live.recv()
    for rid in (1, 2, 3):
        assert c.cancel_if_in_flight(rid, "stop", "s")
    c.cancel(9, "not a request's", "other")  # no in-flight row: the reap leaves it
    handle.kill()
    plain.kill()
    assert c.reap(hp) == 1  # as gunicorn's child_exit does, one worker at a time
    assert not c.cancelled(1, "s") and c.cancelled(2, "s")
    assert c.sweep(3600) == (1, 2)  # cleanup's: the cancellation it cleared counts (§4.6)
    assert not c.cancelled(2, "s")
    assert c.cancelled(3, "s") and c.in_flight(3, "s")  # the namesake's
    assert c.cancelled(9, "other")
    assert c._store.scope_rows("s") == 1 and reg.table("cancellations").count() == 2
    assert reg.check() == {}
    live.send("exit")
    assert live.wait() == 0


def test_a_lane_claimed_from_a_dead_owner_takes_its_cancellations_with_it(registry, spawn):
    """No reap needed: a process's first ``begin`` claims a dead owner's lane, clearing its
    rows, and the cancellations of those requests go with them (a reviewer's case: they
    stayed for ``ttl``, the reap that clears them finding nothing dead any more)."""
    reg = registry()
    c = Cancellation(reg)
    dead = spawn(poller, reg.name, 42, "s")  # begin: a row in the first lane
    dead_pid = dead.recv()["pid"]
    assert c.cancel_if_in_flight(42, "stop", "s")
    c.cancel(43, "kept", "s")  # no request's: no in-flight row cleared it
    dead.kill()
    nxt = spawn(poller, reg.name, 7, "s")  # its begin claims the dead owner's lane
    nxt_pid = nxt.recv()["pid"]
    assert [o[0] for _, o in reg.lanes["in_flight"].lane_owners()] == [nxt_pid] != [dead_pid]
    assert not c.in_flight(42, "s") and not c.cancelled(42, "s")
    assert c.cancelled(43, "s") and c._store.scope_rows("s") == 1
    assert reg.check() == {}
    nxt.send("exit")
    assert nxt.wait() == 0


def test_track_reclaims_dead_owners_rows_before_table_full(registry, spawn):
    reg = registry(in_flight_capacity=4)
    c = Cancellation(reg)
    k = spawn(tracker, reg.name, [1, 2, 3, 4], "s")
    k.recv()
    with pytest.raises(TableFull):
        c.track(5, "s")  # all four owners alive
    k.kill()
    c.track(5, "s")  # the dead child's rows are removed first
    assert in_flight_count(reg) == 1 and c.in_flight(5, "s")


def reaper(chan: Chan, name: str) -> None:
    """Remove dead owners' rows (a track that found the table full does it), report how many."""
    c = Cancellation(Registry.attach(name))
    chan.send(c._store.reap())


def test_track_adds_after_another_process_reaped_the_dead_rows_first(registry, spawn):
    """Two processes finding the table full of dead owners' rows reap at once: the one that
    reaps second finds nothing left to remove, and raised ``TableFull`` for a table with room
    (a reviewer's race: 19 of 80 tracks of four processes; contract §4.5 refuses only a table
    full *after* dead owners' rows are removed). Here the other process reaps in between."""
    reg = registry(in_flight_capacity=4)
    c = Cancellation(reg)
    k = spawn(tracker, reg.name, [1, 2, 3, 4], "s")
    k.recv()
    k.kill()
    own = c._store.reap

    def reap_second(pid: int | None = None) -> int:
        other = spawn(reaper, reg.name)
        assert other.recv() == 4 and other.wait() == 0
        return own(pid)
    c._store.reap = reap_second
    c.track(5, "s")
    assert in_flight_count(reg) == 1 and c.in_flight(5, "s")


def test_janitor_runs_in_whichever_process_is_active(registry, spawn):
    reg = registry(janitor_interval=0.3, ttl=0.05)
    Cancellation(reg).cancel(1, None, "s")
    created = reg.created_at
    # the parent now only reads the table; the child only polls its own request
    child = spawn(poller, reg.name, 2, "s")
    child.recv()
    deadline = time.monotonic() + TIMEOUT
    while reg.table("cancellations").count() and time.monotonic() < deadline:
        child.send("poll")
        assert child.recv()["cancelled"] is False
    assert reg.table("cancellations").count() == 0, "the janitor never ran"
    assert reg.last_sweep - created >= 0.3
    assert reg.info()["last_sweeper_pid"] == child.pid
    child.send("exit")
    assert child.wait() == 0


def _busy_writer(name: str, stop: int) -> None:
    """Cancel and clear in a scope of its own until ``stop`` (a pipe's read end) is readable:
    the lock taken a few thousand times a second."""
    c = Cancellation(Registry.attach(name))
    i = 0
    while not select.select([stop], [], [], 0)[0]:
        c.cancel(i, None, "busy")  # one row at a time: under any quota
        c.clear(i, "busy")
        i += 1


@pytest.mark.parametrize("busy", [False, True], ids=["quiet", "busy"])
def test_a_writer_killed_between_count_and_row_leaves_the_quota_whole(registry, busy):
    """A cancel writes its scope's count first and its row second: a writer SIGKILLed in
    between leaves the count one too high. The next caller under its quota is still served
    (contract §4.4), without waiting for a sweep, also while another process writes all the
    time (a lock-free recount never settles then), in every scope the dead writer left off
    (not only the first one refused): the lock's recovery tells the quota check to recount
    the scopes under the lock, once."""
    reg = registry(max_rows_per_scope=3, janitor_interval=3600.0)
    stop_r, stop_w = os.pipe()
    writer = procs.fork(lambda: (os.close(stop_w), _busy_writer(reg.name, stop_r))) \
        if busy else None
    c = Cancellation(reg)
    for i in (1, 2, 3):
        c.cancel(i, None, "s")
        c.cancel(i, None, "t")
    with pytest.raises(CancellationLimitReached):
        c.cancel(4, None, "s")  # a true refusal: recounted, nothing to fix
    c.clear(3, "s")
    c.clear(3, "t")
    store = c._store

    def killed_mid_cancel() -> None:
        with store._lock:
            store._add("s", +1)  # the count of a row never written
            store._add("t", +1)  # (two writes' worth, as two writers killed in turn leave)
            os.kill(os.getpid(), signal.SIGKILL)

    try:
        pid = fork(killed_mid_cancel)
        status = wait_exit(pid, TIMEOUT)
        assert status is not None and os.WIFSIGNALED(status)
        for scope in ("s", "t"):
            c.cancel(5, None, scope)  # two rows: under the quota of 3
            assert c.cancelled(5, scope)
            with pytest.raises(CancellationLimitReached):
                c.cancel(6, None, scope)
            assert c._store.scope_rows(scope) == 3
    finally:
        os.close(stop_w)  # the busy writer stops
        if writer is not None:
            assert wait_exit(writer, TIMEOUT) == 0
        os.close(stop_r)


def owing_tracker(chan: Chan, name: str, rid: Any, scope: str) -> None:
    """Track ``rid`` and cancel it; on "end", untrack and clear it (meeting a stalled lock: both
    owed) and report how many ends are owed; then sit idle, making no call, until "exit"."""
    c = Cancellation(Registry.attach(name))
    c.track(rid, scope)
    c.cancel(rid, "stop", scope)
    chan.send("tracked")
    assert chan.recv() == "end"
    c.untrack(rid, scope)
    c.clear(rid, scope)
    chan.send(owed.owed_ends())
    assert chan.recv() == "exit"


def test_an_idle_process_lands_its_owed_ends_once_the_lock_is_free(registry, spawn):
    """contract §4.3: a request's end is never lost. A library process (no janitor) whose
    untrack and clear met a stalled lock, then made no more calls, kept its ended in-flight row
    and cancellation row for as long as it lived: only it knows they ended, and it lands them
    only on a call of its own. It now lands them by itself once the lock is free."""
    reg = registry(lock_timeout=0.3)
    c = Cancellation(reg)
    idle = spawn(owing_tracker, reg.name, 5, "S")
    assert idle.recv() == "tracked"
    with stalled_lock(spawn, reg.name):
        idle.send("end")
        assert idle.recv() == 2  # the untrack and the clear
        assert c.in_flight(5, "S") and c.cancelled(5, "S")
    wait_until(lambda: not c.in_flight(5, "S") and not c.cancelled(5, "S"),
               time.monotonic() + 10, what="the idle process to land its owed ends")
    idle.send("exit")
    assert idle.wait() == 0


# A process that owes a plain clear() (met a stalled lock) and then exits normally: a worker
# whose janitor listens for owed ends (so no lander thread runs), told when to exit on stdin.
_CLEAR_THEN_EXIT = """
import sys
from shmcancel import Cancellation, Registry
from shmcancel.cancel import owed
owed.listeners.add(lambda: None)  # a running janitor's wake-up: no lander thread starts
c = Cancellation(Registry.attach(sys.argv[1]))
c.clear(5, "S")
print(owed.owed_ends(), flush=True)
sys.stdin.readline()
"""


def _owing_exiter(name: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", _CLEAR_THEN_EXIT, name],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _finish(p: subprocess.Popen[str]) -> tuple[int, str]:
    """Tell ``p`` to exit; its status and stderr (killed by pid past TIMEOUT)."""
    try:
        _, err = p.communicate("exit\n", timeout=TIMEOUT)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return p.returncode, err


def _owing_exiter_started(name: str) -> subprocess.Popen[str]:
    """:func:`_owing_exiter` once it owes its clear (it says how many ends it owes: 1)."""
    p = _owing_exiter(name)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "1"
    except BaseException:
        _finish(p)
        raise
    return p


def test_a_clear_owed_at_exit_lands_before_the_process_ends(registry, spawn):
    """contract §4.3: a clear is never lost. A plain ``clear()`` that met a stalled lock was
    owed, and lost when its process exited before landing it (nothing else knows of it: unlike
    a handle's end, no in-flight row of the dead process leads a reaper to it), leaving the
    cancellation row until its TTL. An exiting process now lands what it owes first."""
    reg = registry(lock_timeout=0.3)
    c = Cancellation(reg)
    c.cancel(5, "stop", "S")
    with stalled_lock(spawn, reg.name):
        p = _owing_exiter_started(reg.name)
        assert c.cancelled(5, "S")
    status, err = _finish(p)  # the lock is free: the exit lands the clear
    assert status == 0, err
    assert not c.cancelled(5, "S")


def test_an_exit_waits_for_a_stalled_lock_only_so_long(registry, spawn):
    """The lock stays stalled: the exiting process gives up after ``owed.EXIT_WAIT`` seconds of
    tries (each at most the lock timeout), says so in one line, and exits 0."""
    reg = registry(lock_timeout=0.3)
    c = Cancellation(reg)
    c.cancel(5, "stop", "S")
    with stalled_lock(spawn, reg.name):
        p = _owing_exiter_started(reg.name)
        t0 = time.monotonic()
        status, err = _finish(p)
        took = time.monotonic() - t0
        assert status == 0, err
        assert "exiting with 1 request ends still owed" in err
        assert owed.EXIT_WAIT <= took < owed.EXIT_WAIT + 10  # bounded (generous for load)
    assert c.cancelled(5, "S")
