"""Per-process lanes of the in-flight rows (shm/lanes.py) through the policy and ShmBackend,
across real forked processes sharing one registry in /dev/shm.

A handle's row goes to its process's lane (receipt: the way, an int) while the lane and the
shared ``in_flight`` table have room, else to the table (receipt: a tuple). Synchronisation is
by messages over socketpairs or a poll with a deadline; every child is stopped by its pid (the
``spawn`` fixture). No sweep runs on its own here: the first claim of the janitor succeeds one
``janitor_interval`` (60 s) after the registry's creation.
"""

from __future__ import annotations

import mmap
import os
import signal
import struct
import time
from collections import Counter
from typing import Any

from helpers.gunicorn_harness import wait_until
from helpers.procs import Chan, proc_state, wait_zombie
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from shmcancel.cancellation import Cancellation
from shmcancel.shm import lanes
from shmcancel.shm.registry import Registry

SCOPE = "session:lanes"
DEADLINE = 10.0


# ------------------------------------------------------------------------------ helpers
def kind(receipt: object) -> str | None:
    """Where a handle's row went: "lane" (a way), "table" (a Table.add receipt), else None."""
    if type(receipt) is int:
        return "lane"
    if type(receipt) is tuple:
        return "table"
    return None


def lane_of(receipt: object) -> int | None:
    """The lane of a lane receipt (a way index: [bucket][lane][way])."""
    return (receipt // lanes.WAYS) % lanes.LANES if type(receipt) is int else None


def bucket_of(c: Cancellation, rid: object, scope: str = SCOPE) -> int:
    """The lane bucket of ``(scope, str(rid))``'s in-flight key (lanes.py: hash bits 32..)."""
    h = c._store._fk(scope, str(rid)).hash  # type: ignore[attr-defined]
    return (h >> 32) & (lanes.BUCKETS - 1)


def same_bucket(c: Cancellation, n: int, scope: str = SCOPE, avoid: int | None = None
                ) -> tuple[int, list[int]]:
    """``n`` int ids whose keys share one lane bucket (not ``avoid``): (bucket, ids)."""
    groups: dict[int, list[int]] = {}
    for rid in range(100_000):
        b = bucket_of(c, rid, scope)
        if b == avoid:
            continue
        g = groups.setdefault(b, [])
        g.append(rid)
        if len(g) == n:
            return b, g
    raise AssertionError("no bucket with enough ids")


def owner_pids(reg: Registry) -> dict[int, int]:
    """lane -> pid of every claimed lane."""
    return {lane: owner[0] for lane, owner in reg.lanes["in_flight"].lane_owners()}


def lane_row_pids(c: Cancellation) -> list[int]:
    return [owner[0] for _, owner in c._store.lane_rows()]  # type: ignore[attr-defined]


def poll_until(fn: Any, timeout: float = DEADLINE) -> Any:
    """``fn()`` until it returns something true (returned), for at most ``timeout`` seconds."""
    return wait_until(fn, time.monotonic() + timeout, interval=0.002)


# ------------------------------------------------------------------------------ child programs
def server(chan: Chan, name: str) -> None:
    """Attach the registry, then run commands ``[op, rid, scope]`` until "exit":
    begin (answers where the row went), end (the oldest open handle of that id), in_flight,
    pids (in_flight_pids), lanes (lane -> pid), close (Registry.close)."""
    reg = Registry.attach(name)
    c = Cancellation(reg)
    open_: dict[tuple[str, Any], list[Any]] = {}
    chan.send({"pid": os.getpid()})
    while True:
        cmd = chan.recv()
        if cmd == "exit":
            return
        if cmd == "lanes":
            chan.send(sorted(owner_pids(reg).items()))
            continue
        if cmd == "close":
            reg.close()
            chan.send("closed")
            continue
        op, rid, scope = cmd
        if op == "begin":
            h = c.begin(rid, scope)
            open_.setdefault((scope, rid), []).append(h)
            chan.send({"tracked": h.tracked, "kind": kind(h._receipt),
                       "lane": lane_of(h._receipt)})
        elif op == "end":
            open_[scope, rid].pop(0).end()
            chan.send("ended")
        elif op == "in_flight":
            chan.send(c.in_flight(rid, scope))
        elif op == "pids":
            chan.send(sorted(c.in_flight_pids(rid, scope) or ()))
        else:
            raise AssertionError(f"unknown command {cmd!r}")


def ask(child: Any, *cmd: Any) -> Any:
    child.send(list(cmd) if len(cmd) > 1 else cmd[0])
    return child.recv()


def holder(chan: Chan, name: str, ids: list[int], scope: str) -> None:
    """Begin ``ids`` (never ended), report pid and where the rows went, wait for "exit"."""
    c = Cancellation(Registry.attach(name))
    hs = [c.begin(rid, scope) for rid in ids]
    chan.send({"pid": os.getpid(), "kinds": [kind(h._receipt) for h in hs],
               "lanes": sorted({lane_of(h._receipt) for h in hs} - {None})})
    assert chan.recv(60) == "exit"


# ------------------------------------------------------------------------------ 1. the lane row
def test_a_handles_row_is_in_its_lane_seen_by_other_processes_and_ended(registry, spawn):
    reg = registry()
    c = Cancellation(reg)
    f = reg.table("in_flight")
    h = c.begin("p-1", SCOPE)
    assert h.tracked and kind(h._receipt) == "lane"
    assert f.count() == 0  # in the lane, not in the shared table
    assert lane_row_pids(c) == [os.getpid()]
    assert c.in_flight("p-1", SCOPE) and c.in_flight_pids("p-1", SCOPE) == {os.getpid()}

    child = spawn(server, reg.name)
    cpid = child.recv()["pid"]
    assert ask(child, "in_flight", "p-1", SCOPE) is True  # the parent's lane, read by the child
    assert ask(child, "pids", "p-1", SCOPE) == [os.getpid()]
    assert ask(child, "in_flight", "c-1", SCOPE) is False

    got = ask(child, "begin", "c-1", SCOPE)
    assert got["tracked"] and got["kind"] == "lane"
    assert c.in_flight("c-1", SCOPE) and c.in_flight_pids("c-1", SCOPE) == {cpid}
    assert ask(child, "in_flight", "c-1", SCOPE) is True
    assert f.count() == 0
    assert sorted(lane_row_pids(c)) == sorted([os.getpid(), cpid])
    assert not c.in_flight("c-1", "another scope") and not c.in_flight("c-2", SCOPE)

    assert ask(child, "end", "c-1", SCOPE) == "ended"
    assert not c.in_flight("c-1", SCOPE) and c.in_flight_pids("c-1", SCOPE) == set()
    assert c.in_flight("p-1", SCOPE)  # the other process's row is untouched
    h.end()
    assert not c.in_flight("p-1", SCOPE)
    assert ask(child, "in_flight", "p-1", SCOPE) is False
    assert ask(child, "pids", "p-1", SCOPE) == []
    assert c._store.in_flight_rows() == []  # type: ignore[attr-defined]
    child.send("exit")
    assert child.wait() == 0


# ------------------------------------------------------------------------------ 2. fork children
def forked_copy(chan: Chan, c: Cancellation, h: Any) -> None:
    """A fork child of a process holding a lane and the handle ``h``: reports the lanes it
    sees before and after its own begin, then ends its copy of ``h`` and sweeps."""
    reg = c.registry
    assert reg is not None
    before = sorted(owner_pids(reg).items())
    mine = c.begin("child-own", SCOPE)
    after = sorted(owner_pids(reg).items())
    h.end()  # a copy of the parent's handle: ends nothing
    # the store's own refusal, below the handle's (whose running set the fork emptied)
    untracked = c._store.untrack(h.scope, h._rid, h._owner, h._receipt)
    swept = c.sweep()
    chan.send({"pid": os.getpid(), "before": before, "after": after, "kind": kind(mine._receipt),
               "lane": lane_of(mine._receipt), "untracked": untracked,
               "parent_in_flight": c.in_flight("parent-req", SCOPE),
               "own_in_flight": c.in_flight("child-own", SCOPE), "swept": list(swept)})
    assert chan.recv() == "end"
    mine.end()
    chan.send({"own_in_flight": c.in_flight("child-own", SCOPE)})
    assert chan.recv() == "exit"


def test_a_fork_child_claims_its_own_lane_and_its_copy_of_a_handle_ends_nothing(
        registry, spawn):
    reg = registry()
    c = Cancellation(reg)
    h = c.begin("parent-req", SCOPE)
    assert kind(h._receipt) == "lane"
    plane = lane_of(h._receipt)
    assert owner_pids(reg) == {plane: os.getpid()}

    child = spawn(forked_copy, c, h)
    got = child.recv()
    assert got["before"] == [[plane, os.getpid()]]  # not claimed before its first begin
    assert got["kind"] == "lane" and got["lane"] != plane
    assert got["after"] == sorted([[plane, os.getpid()], [got["lane"], got["pid"]]])
    assert got["untracked"] is False
    assert got["parent_in_flight"] is True and got["own_in_flight"] is True
    assert got["swept"] == [0, 0]
    # the parent's row stays, in the parent's lane
    assert c.in_flight("parent-req", SCOPE) and c.in_flight_pids("parent-req", SCOPE) == {
        os.getpid()}
    assert owner_pids(reg) == {plane: os.getpid(), got["lane"]: got["pid"]}
    child.send("end")
    assert child.recv() == {"own_in_flight": False}
    assert not c.in_flight("child-own", SCOPE)
    assert c.in_flight("parent-req", SCOPE)
    child.send("exit")
    assert child.wait() == 0
    h.end()
    assert not c.in_flight("parent-req", SCOPE)
    assert c._store.in_flight_rows() == []  # type: ignore[attr-defined]


# ------------------------------------------------------------------------------ 3. dead owners
def lane_ids(reg: Registry, n: int, start: int = 0) -> list[int]:
    """``n`` ids from ``start`` on whose rows all fit one lane: at most ``WAYS`` in a bucket (the
    bucket is the keyed hash's, random per registry: 12 consecutive ids put 5 in one bucket
    about once in 1300 registries, and the 5th row then goes to the shared table)."""
    f = reg.table("in_flight")
    per: Counter[int] = Counter()
    out = []
    rid = start
    while len(out) < n:
        b = lanes._bucket(f.prepare((SCOPE, str(rid))).hash)
        if per[b] < lanes.WAYS:
            per[b] += 1
            out.append(rid)
        rid += 1
    return out


def _dead_holder(registry: Any, spawn: Any, n: int
                 ) -> tuple[Registry, Cancellation, Any, int, list[int]]:
    """A child that began ``n`` requests (ids returned), all in its lane, SIGKILLed."""
    reg = registry()
    c = Cancellation(reg)
    rids = lane_ids(reg, n)
    child = spawn(holder, reg.name, rids, SCOPE)
    got = child.recv()
    assert got["kinds"] == ["lane"] * n and len(got["lanes"]) == 1
    lane = got["lanes"][0]
    assert owner_pids(reg) == {lane: got["pid"]}
    os.kill(child.pid, signal.SIGKILL)
    wait_zombie(child.pid)  # dead, not yet reaped: its pid still exists
    for rid in rids:  # a dead owner's rows stay until reaped
        assert c.in_flight(rid, SCOPE) and c.in_flight_pids(rid, SCOPE) == {got["pid"]}
    assert owner_pids(reg) == {lane: got["pid"]}
    return reg, c, child, lane, rids


def test_reap_removes_a_dead_owners_lane_rows_and_frees_its_lane(registry, spawn):
    n = 12
    reg, c, child, lane, rids = _dead_holder(registry, spawn, n)
    assert c.reap(os.getpid()) == 0  # another pid's rows only: nothing
    assert c.reap() == n
    assert owner_pids(reg) == {}
    for rid in rids:
        assert not c.in_flight(rid, SCOPE) and c.in_flight_pids(rid, SCOPE) == set()
    assert c._store.in_flight_rows() == []  # type: ignore[attr-defined]
    assert c.reap() == 0
    child.kill()
    # the freed lane is claimed again, by a new process
    fresh = spawn(holder, reg.name, [100], SCOPE)
    got = fresh.recv()
    assert got["kinds"] == ["lane"] and got["lanes"] == [lane]
    assert owner_pids(reg) == {lane: got["pid"]}
    assert c.in_flight(100, SCOPE)
    fresh.send("exit")
    assert fresh.wait() == 0


def test_reap_by_pid_and_cleanup_remove_a_dead_owners_lane_rows(registry, spawn):
    n = 7
    reg, c, child, lane, rids = _dead_holder(registry, spawn, n)
    assert c.reap(child.pid) == n
    assert owner_pids(reg) == {}
    assert not any(c.in_flight(rid, SCOPE) for rid in rids)
    # and through cleanup() (sweep(): its in-flight count is the dead lane's rows)
    more = lane_ids(reg, n, 50)
    other = spawn(holder, reg.name, more, SCOPE)
    got = other.recv()
    assert got["kinds"] == ["lane"] * n and got["lanes"] == [lane]
    os.kill(other.pid, signal.SIGKILL)
    wait_zombie(other.pid)
    assert all(c.in_flight(rid, SCOPE) for rid in more)
    assert c.sweep() == (0, n)
    assert owner_pids(reg) == {}
    assert not any(c.in_flight(rid, SCOPE) for rid in more)
    assert c.cleanup() == 0 and c.sweep() == (0, 0)
    assert c._store.in_flight_rows() == []  # type: ignore[attr-defined]


def test_a_new_process_claims_a_dead_owners_lane_clearing_its_rows(registry, spawn):
    n = 5
    reg, c, _, lane, rids = _dead_holder(registry, spawn, n)
    fresh = spawn(holder, reg.name, [200], SCOPE)
    got = fresh.recv()
    assert got["kinds"] == ["lane"] and got["lanes"] == [lane]  # the first lane: the dead one's
    assert owner_pids(reg) == {lane: got["pid"]}
    assert not any(c.in_flight(rid, SCOPE) for rid in rids)  # cleared by the claim
    assert c.in_flight(200, SCOPE) and lane_row_pids(c) == [got["pid"]]
    assert c.reap() == 0  # nothing dead left
    fresh.send("exit")
    assert fresh.wait() == 0


# ------------------------------------------------------------------------------ 4. overflow
def test_a_full_lane_bucket_overflows_to_the_shared_table(registry):
    reg = registry(in_flight_capacity=64)
    c = Cancellation(reg)
    f = reg.table("in_flight")
    _, ids = same_bucket(c, lanes.WAYS + 3)
    hs = [c.begin(rid, SCOPE) for rid in ids]
    assert [kind(h._receipt) for h in hs] == ["lane"] * lanes.WAYS + ["table"] * 3
    assert all(h.tracked for h in hs)
    assert f.count() == 3 and len(c._store.lane_rows()) == lanes.WAYS  # type: ignore[attr-defined]
    for rid in ids:
        assert c.in_flight(rid, SCOPE) and c.in_flight_pids(rid, SCOPE) == {os.getpid()}
    # a lane way freed is taken by the next row of that bucket
    hs[1].end()
    assert not c.in_flight(ids[1], SCOPE)
    again = c.begin(ids[1], SCOPE)
    assert kind(again._receipt) == "lane" and again._receipt == hs[1]._receipt
    assert c.in_flight(ids[1], SCOPE)
    for h in [*hs, again]:
        h.end()
    assert f.count() == 0 and c._store.in_flight_rows() == []  # type: ignore[attr-defined]
    assert not any(c.in_flight(rid, SCOPE) for rid in ids)


def test_more_rows_than_a_lane_holds_go_to_the_table_and_all_end(registry):
    n = 200
    reg = registry(in_flight_capacity=256)
    c = Cancellation(reg)
    f = reg.table("in_flight")
    hs = [c.begin(rid, SCOPE) for rid in range(n)]
    kinds = Counter(kind(h._receipt) for h in hs)
    assert all(h.tracked for h in hs)
    assert kinds["lane"] + kinds["table"] == n
    assert 0 < kinds["lane"] <= lanes.BUCKETS * lanes.WAYS and kinds["table"] >= n - 128
    assert f.count() == kinds["table"]
    assert len({lane_of(h._receipt) for h in hs} - {None}) == 1
    assert all(c.in_flight(rid, SCOPE) for rid in range(n))
    rows = Counter(k for k, _ in c._store.in_flight_rows())  # type: ignore[attr-defined]
    assert rows == Counter((SCOPE, str(rid)) for rid in range(n))
    for h in hs[::2]:
        h.end()
    assert [c.in_flight(rid, SCOPE) for rid in range(n)] == [rid % 2 == 1 for rid in range(n)]
    for h in hs[1::2]:
        h.end()
    assert f.count() == 0 and c._store.in_flight_rows() == []  # type: ignore[attr-defined]
    assert not any(c.in_flight(rid, SCOPE) for rid in range(n))


def test_a_key_longer_than_a_lane_body_goes_to_the_table(registry):
    reg = registry()
    c = Cancellation(reg)
    f = reg.table("in_flight")
    long_scope = "s" * 300
    assert len(c._store._fk(long_scope, "1").kbytes) > lanes.KEY_MAX  # type: ignore[attr-defined]
    edge = "e" * (lanes.KEY_MAX - 5)  # packed: fixarray, str8 header (2), the scope, fixstr "1"
    over = edge + "e"
    assert len(c._store._fk(edge, "1").kbytes) == lanes.KEY_MAX  # type: ignore[attr-defined]
    h = c.begin(1, long_scope)
    fits = c.begin(1, edge)
    just_over = c.begin(1, over)
    assert h.tracked and kind(h._receipt) == "table"
    assert just_over.tracked and kind(just_over._receipt) == "table" and f.count() == 2
    assert kind(fits._receipt) == "lane"
    assert c.in_flight(1, over)
    just_over.end()
    assert not c.in_flight(1, over) and f.count() == 1
    assert c.in_flight(1, long_scope) and c.in_flight(1, edge)
    assert c._store.in_flight_ids(long_scope) == ["1"]  # type: ignore[attr-defined]
    assert c._store.in_flight_ids(edge) == ["1"]  # type: ignore[attr-defined]
    assert c.cancel_if_in_flight(1, "stop", long_scope) and h.cancelled()
    assert c.cancel_if_in_flight(1, "stop", edge) and fits.cancelled()
    h.end()
    fits.end()
    assert not c.in_flight(1, long_scope) and not c.in_flight(1, edge)
    assert f.count() == 0 and c._store.in_flight_rows() == []  # type: ignore[attr-defined]
    assert c._store.cancellations() == []  # type: ignore[attr-defined]


def test_a_full_shared_table_refuses_a_handle_even_with_room_in_the_lane(registry):
    reg = registry(in_flight_capacity=8)
    c = Cancellation(reg)
    f = reg.table("in_flight")
    for rid in range(f.capacity):
        c.track(f"plain-{rid}", SCOPE)
    assert f.count() == f.capacity
    h = c.begin("refused", SCOPE)
    assert not h.tracked and not c.in_flight("refused", SCOPE)
    assert c._store.lane_rows() == []  # type: ignore[attr-defined]
    h.end()
    c.untrack("plain-0", SCOPE)
    ok = c.begin("now", SCOPE)
    assert ok.tracked and kind(ok._receipt) == "lane"
    ok.end()
    assert not c.in_flight("now", SCOPE)


# ------------------------------------------------------------------------------ 5. no lane free
def test_with_every_lane_taken_by_live_processes_a_begin_goes_to_the_table(registry, spawn):
    reg = registry()
    c = Cancellation(reg)
    f = reg.table("in_flight")
    kids = [spawn(holder, reg.name, [i], SCOPE) for i in range(lanes.LANES)]
    got = [k.recv() for k in kids]
    assert all(g["kinds"] == ["lane"] for g in got)
    assert sorted(g["lanes"][0] for g in got) == list(range(lanes.LANES))
    assert owner_pids(reg) == {g["lanes"][0]: g["pid"] for g in got}

    h = c.begin("no-lane", SCOPE)  # this process is the 33rd
    assert h.tracked and kind(h._receipt) == "table" and f.count() == 1
    assert c.in_flight("no-lane", SCOPE) and c.in_flight_pids("no-lane", SCOPE) == {os.getpid()}
    assert os.getpid() not in owner_pids(reg).values()
    h.end()
    assert not c.in_flight("no-lane", SCOPE) and f.count() == 0

    # two owners die: a new process claims the first dead one's lane at once, this one its
    # next claim (after its retry pause) gets the other
    for k in kids[:2]:
        k.kill()
    fresh = spawn(holder, reg.name, [1000], SCOPE)
    g = fresh.recv()
    assert g["kinds"] == ["lane"] and g["lanes"] == [min(got[0]["lanes"][0], got[1]["lanes"][0])]

    def lane_begin() -> Any:
        h = c.begin("retry", SCOPE)
        if kind(h._receipt) == "lane":
            return h
        h.end()
        return None
    h = poll_until(lane_begin, timeout=5)
    assert lane_of(h._receipt) == max(got[0]["lanes"][0], got[1]["lanes"][0])
    assert owner_pids(reg)[lane_of(h._receipt)] == os.getpid()
    h.end()
    for k in [*kids[2:], fresh]:
        k.send("exit")
    for k in [*kids[2:], fresh]:
        assert k.wait() == 0


# ------------------------------------------------------------------------------ 6. the end race
_CUR, _STOP = 0, 8  # u64 offsets in the shared page: the id in flight (+1), the stop flag


def racer(chan: Chan, name: str, page: mmap.mmap, scope: str) -> None:
    """begin(i) / publish i / a short varied run / end(), for i = 0, 1, ... until told to stop;
    reports how many requests ran."""
    c = Cancellation(Registry.attach(name))
    chan.send("ready")
    i = 0
    while not struct.unpack_from("<Q", page, _STOP)[0]:
        h = c.begin(i, scope)
        struct.pack_into("<Q", page, _CUR, i + 1)
        for _ in range(i % 7):
            h.cancelled()
        h.end()
        i += 1
    chan.send({"ran": i})
    assert chan.recv() == "exit"


def test_a_gated_cancel_racing_the_end_of_its_request_leaves_no_row(registry, spawn):
    """contract §4.3: cancel_if_in_flight racing the request's end (its lane row removed
    without the registry lock) leaves no cancellation row once the request ended, and a False
    answer never leaves one."""
    reg = registry(capacity=2000, max_rows=1000, max_rows_per_scope=None)  # leftovers: counted
    c = Cancellation(reg)
    st_ = c._store
    scope = "session:race"
    page = mmap.mmap(-1, mmap.PAGESIZE)  # shared with the fork child
    child = spawn(racer, reg.name, page, scope)
    assert child.recv() == "ready"
    outcomes: Counter[bool] = Counter()
    done = -1
    t_end = time.monotonic() + 2.0
    try:
        while time.monotonic() < t_end:
            cur = struct.unpack_from("<Q", page, _CUR)[0] - 1
            if cur <= done:
                continue
            done = cur  # one gated cancel per request: nothing else writes its row
            rec = c.cancel_if_in_flight(cur, "racing", scope)
            outcomes[rec] += 1
            if not rec:
                assert not st_.exists(scope, str(cur)), f"a refused cancel left a row: {cur}"
    finally:
        struct.pack_into("<Q", page, _STOP, 1)
    ran = child.recv()["ran"]
    assert ran > 1000
    # every request ended: no cancellation row may remain, nor a count of one
    assert st_.cancellations() == []  # type: ignore[attr-defined]
    assert st_.scope_rows(scope) == 0  # type: ignore[attr-defined]
    assert not c.in_flight(done, scope)
    assert outcomes[True] > 0 and outcomes[False] > 0, outcomes
    child.send("exit")
    assert child.wait() == 0
    page.close()


# ------------------------------------------------------------------------------ 7. LaneWatch
def test_a_cached_in_flight_poll_follows_another_processes_lane_both_ways(registry, spawn):
    reg = registry()
    c = Cancellation(reg)
    b, (a, nb, *fill) = same_bucket(c, 2 + lanes.WAYS)
    _, (far,) = same_bucket(c, 1, avoid=b)
    child = spawn(server, reg.name)
    child.recv()

    def polls(rid: int, want: bool) -> None:
        for _ in range(3):  # the first poll after the change, then cached ones
            assert c.in_flight(rid, SCOPE) is want, (rid, want)

    polls(a, False)
    assert ask(child, "begin", a, SCOPE)["kind"] == "lane"
    polls(a, True)  # a cached "absent" is stale once its bucket moved
    assert ask(child, "begin", far, SCOPE)["kind"] == "lane"  # another bucket moves
    polls(a, True)
    polls(far, True)
    assert ask(child, "end", a, SCOPE) == "ended"
    polls(a, False)  # a cached "present in a lane" is stale once the way's hash went
    assert ask(child, "begin", nb, SCOPE)["kind"] == "lane"  # takes a's way in the bucket
    polls(nb, True)
    polls(a, False)  # the way holds another key now
    assert ask(child, "end", nb, SCOPE) == "ended"
    polls(nb, False)
    polls(far, True)
    # a's row in the table (its bucket's ways full), then in a lane again
    for rid in fill:
        assert ask(child, "begin", rid, SCOPE)["kind"] == "lane"
    polls(a, False)
    assert ask(child, "begin", a, SCOPE)["kind"] == "table"
    polls(a, True)
    assert ask(child, "end", a, SCOPE) == "ended"
    polls(a, False)
    assert ask(child, "end", fill[0], SCOPE) == "ended"
    assert ask(child, "begin", a, SCOPE)["kind"] == "lane"
    polls(a, True)
    assert ask(child, "end", a, SCOPE) == "ended"
    polls(a, False)
    for rid in [*fill[1:], far]:
        assert ask(child, "end", rid, SCOPE) == "ended"
        polls(rid, False)
    assert c._store.in_flight_rows() == []  # type: ignore[attr-defined]
    child.send("exit")
    assert child.wait() == 0


# ------------------------------------------------------------------------------ 8. the model
_LONG = "L" * 120  # its keys go to the table


def test_begin_and_end_sequences_match_a_model(registry):
    """In one process: after every begin / end, in_flight (cached polls) and the rows of the
    lane and table are exactly the model's multiset. Three of the ids share one lane bucket,
    so more than a bucket's ways of their rows overflow to the table; ids 3 and "3" are one
    key; the long scope's keys always go to the table."""
    reg = registry(in_flight_capacity=64)
    c = Cancellation(reg)
    st_ = c._store
    _, shared = same_bucket(c, 3)
    keys: list[tuple[str, Any]] = [(SCOPE, rid) for rid in shared]
    keys += [(SCOPE, str(shared[0])), ("other", 1), (_LONG, 2)]
    begin = st.tuples(st.just("begin"), st.integers(0, len(keys) - 1))
    ops = st.lists(st.one_of(begin, begin, begin, st.tuples(st.just("end"), st.integers(0, 63)),
                             st.tuples(st.just("end_again"), st.integers(0, 63))),
                   max_size=40)

    def check(model: Counter[tuple[str, str]]) -> None:
        for scope, rid in keys:
            assert c.in_flight(rid, scope) is (model[scope, str(rid)] > 0), (scope, rid)
        rows = st_.in_flight_rows()  # type: ignore[attr-defined]
        assert Counter(tuple(k) for k, _ in rows) == +model
        assert {v[0] for _, v in rows} <= {os.getpid()}

    @settings(max_examples=50, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(ops=ops)
    # the bucket's ways filled (keys 0..3 share it), two rows over in the table, lane and
    # table rows ended out of order and a way taken again
    @example(ops=[("begin", 0), ("begin", 1), ("begin", 3), ("begin", 2), ("begin", 0),
                  ("begin", 3), ("end", 1), ("end", 3), ("begin", 2), ("end_again", 0),
                  ("end", 0), ("begin", 5), ("end", 0)])
    def run(ops: list[tuple[str, int]]) -> None:
        model: Counter[tuple[str, str]] = Counter()
        live: list[Any] = []
        ended: list[Any] = []
        try:
            for op, x in ops:
                if op == "begin":
                    scope, rid = keys[x]
                    h = c.begin(rid, scope)
                    assert h.tracked
                    if scope == _LONG:
                        assert kind(h._receipt) == "table"
                    live.append(h)
                    model[scope, str(rid)] += 1
                elif op == "end" and live:
                    h = live.pop(x % len(live))
                    h.end()
                    ended.append(h)
                    model[h.scope, str(h.request_id)] -= 1
                elif op == "end_again" and ended:
                    ended[x % len(ended)].end()  # idempotent: removes nobody else's row
                check(model)
        finally:
            for h in live:
                h.end()
        check(Counter())

    run()


# ------------------------------------------------------------------------------ 9. close
def test_registry_close_releases_the_processes_lane(registry, spawn):
    reg = registry()
    c = Cancellation(reg)
    mine = c.begin("p", SCOPE)
    plane = lane_of(mine._receipt)
    child = spawn(server, reg.name)
    cpid = child.recv()["pid"]
    got = ask(child, "begin", "c", SCOPE)
    assert got["kind"] == "lane" and got["lane"] != plane
    assert owner_pids(reg) == {plane: os.getpid(), got["lane"]: cpid}
    assert ask(child, "lanes") == sorted([[plane, os.getpid()], [got["lane"], cpid]])
    assert ask(child, "close") == "closed"
    # the child is alive, its registry closed: its lane and its row are gone
    assert owner_pids(reg) == {plane: os.getpid()}
    assert not c.in_flight("c", SCOPE) and c.in_flight("p", SCOPE)
    assert c.reap() == 0
    # the freed lane is claimed again
    other = spawn(server, reg.name)
    opid = other.recv()["pid"]
    assert ask(other, "begin", "o", SCOPE)["lane"] == got["lane"]
    assert owner_pids(reg) == {plane: os.getpid(), got["lane"]: opid}
    child.send("exit")
    assert child.wait() == 0
    assert ask(other, "end", "o", SCOPE) == "ended"
    other.send("exit")
    assert other.wait() == 0
    mine.end()
    # and this process's own close releases its lane too (seen through another attachment)
    reg2 = Registry.attach(reg.name)
    try:
        assert owner_pids(reg2)[plane] == os.getpid()
        reg.close()
        assert plane not in owner_pids(reg2)
    finally:
        reg2.close()


# ------------------------------------------------------------------------------ killed, stopped
def churner(chan: Chan, name: str, page: mmap.mmap, scope: str) -> None:
    """Claim a lane, report the pid, then begin and end requests forever, three open at a
    time, counting them in ``page`` (u64 at 0): what a SIGKILL or SIGSTOP interrupts."""
    c = Cancellation(Registry.attach(name))
    c.begin(-1, scope).end()  # the lane is claimed before the count starts
    chan.send({"pid": os.getpid()})
    open_: list[Any] = []
    i = 0
    while True:
        open_.append(c.begin(i, scope))
        if len(open_) > 3:
            open_.pop(0).end()
        i += 1
        struct.pack_into("<Q", page, 0, i)


def _count(page: mmap.mmap) -> int:
    return struct.unpack_from("<Q", page, 0)[0]


def test_a_lane_released_while_a_thread_adds_to_it_keeps_no_row(registry, monkeypatch):
    """``Registry.close()`` on one thread gives up the process's lane (``Lanes.release``: its
    rows cleared, its owner word zeroed) while a request thread is inside ``Lanes.add``, past
    taking a way: the thread's hash stored after the clear stayed in a lane nobody owns, in
    flight for good (no sweep reaps an unowned lane; only a later claim of it cleared it). The
    release is made to land right there, between the body's store and the hash's."""
    reg = registry()
    c = Cancellation(reg)
    c.begin("first", SCOPE).end()  # this process's lane is claimed
    ln = reg.lanes["in_flight"]
    real = lanes._BODY

    class ReleasingBody:
        size = real.size

        def pack_into(self, *a: Any) -> None:
            real.pack_into(*a)
            ln.release()  # another thread's close, landing in the middle of this add

    monkeypatch.setattr(lanes, "_BODY", ReleasingBody())
    pk = reg.table("in_flight").prepare((SCOPE, "42"))
    assert ln.add(pk, 1, 12345) is None  # not published: the lane is not ours any more
    monkeypatch.undo()
    assert not ln.member(pk) and owner_pids(reg) == {}
    assert not c.in_flight("42", SCOPE)


def test_processes_killed_mid_write_leave_lanes_that_reap_restores(registry, spawn):
    """SIGKILL at arbitrary points of a begin/end loop (the kill lands inside a lane write more
    often than not): the dead lane's rows are at most the open handles plus one, reap removes
    exactly those and frees the lane, nothing ever went to the shared table, and the next
    process claims the lane and works."""
    reg = registry(janitor_interval=3600.0)
    c = Cancellation(reg)
    page = mmap.mmap(-1, mmap.PAGESIZE)
    try:
        for rnd in range(8):
            struct.pack_into("<Q", page, 0, 0)
            child = spawn(churner, reg.name, page, SCOPE)
            pid = child.recv()["pid"]
            target = 200 + 37 * rnd  # kill at a different point of the loop each round
            poll_until(lambda t=target: _count(page) >= t)
            os.kill(pid, signal.SIGKILL)
            wait_zombie(pid)
            left = [o for _, o in c._store.lane_rows() if o[0] == pid]  # type: ignore[attr-defined]
            assert 3 <= len(left) <= 4, left
            assert c.reap() == len(left)
            assert lane_row_pids(c) == [] and owner_pids(reg) == {}
            assert reg.table("in_flight").count() == 0
            assert not any(c.in_flight(i, SCOPE) for i in range(_count(page) + 2))
            h = c.begin(10**6 + rnd, SCOPE)  # this process's lane still works beside it
            assert kind(h._receipt) == "lane" and c.in_flight(10**6 + rnd, SCOPE)
            h.end()
            assert not c.in_flight(10**6 + rnd, SCOPE)
            assert child.wait() == -signal.SIGKILL
            c._store._lanes.release()  # type: ignore[attr-defined]  # leave lane 0 to the next child
    finally:
        page.close()


def test_a_process_stopped_mid_write_never_delays_another_processes_calls(registry, spawn):
    """A lane owner SIGSTOPped anywhere in its begin/end loop holds no lock another process
    needs: this process's calls go on, and a gated cancel of the stopped process's open
    requests (which takes the registry lock) is recorded without waiting."""
    reg = registry(lock_timeout=0.5, janitor_interval=3600.0)
    c = Cancellation(reg)
    page = mmap.mmap(-1, mmap.PAGESIZE)
    child = spawn(churner, reg.name, page, SCOPE)
    pid = child.recv()["pid"]
    try:
        poll_until(lambda: _count(page) >= 300)
        os.kill(pid, signal.SIGSTOP)
        poll_until(lambda: proc_state(pid) == "T")
        t0 = time.monotonic()
        for i in range(2000):
            h = c.begin(i, "session:other")
            assert h.tracked and h.error is None
            h.end()
        open_ids = [int(k[1]) for k, o in c._store.lane_rows()  # type: ignore[attr-defined]
                    if o[0] == pid and k[1].isdigit()]
        assert open_ids
        for rid in open_ids:
            assert c.cancel_if_in_flight(rid, "stopped", SCOPE) is True
        assert time.monotonic() - t0 < DEADLINE
    finally:
        os.kill(pid, signal.SIGCONT)
        page.close()
    child.kill()


def test_threads_of_one_process_never_share_a_way_and_give_every_way_back(registry):
    """8 threads begin and end requests as fast as they can (a few open each) while another
    thread keeps running settle() (reap_ended: it removes rows of ended requests, racing their
    own end()). No two open handles ever hold one way, each sees its own row, and afterwards
    every way is free exactly once and no row is left."""
    import threading

    reg = registry(janitor_interval=3600.0)
    c = Cancellation(reg)
    ln = reg.lanes["in_flight"]
    guard = threading.Lock()
    open_ways: set[int] = set()
    errors: list[str] = []
    stop = threading.Event()

    def worker(k: int) -> None:
        mine: list[Any] = []
        try:
            for i in range(1500):
                rid = f"{k}-{i}"
                h = c.begin(rid, SCOPE)
                if kind(h._receipt) == "lane":
                    with guard:
                        if h._receipt in open_ways:
                            errors.append(f"way {h._receipt} given twice")
                        open_ways.add(h._receipt)
                if not c.in_flight(rid, SCOPE):
                    errors.append(f"{rid} not in flight while open")
                mine.append(h)
                if len(mine) > 3:
                    old = mine.pop(0)
                    if kind(old._receipt) == "lane":
                        with guard:
                            open_ways.discard(old._receipt)
                    old.end()
            for h in mine:
                if kind(h._receipt) == "lane":
                    with guard:
                        open_ways.discard(h._receipt)
                h.end()
        except Exception as e:  # pragma: no cover - reported below
            errors.append(repr(e))

    def settler() -> None:  # paced: a settle() also scans the shared table
        while not stop.wait(0.0005):
            c.settle()

    ts = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    s = threading.Thread(target=settler)
    s.start()
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    stop.set()
    s.join(60)
    assert not any(t.is_alive() for t in [*ts, s])
    assert errors == []
    assert c._store.in_flight_rows() == []  # type: ignore[attr-defined]
    free = [w for ways in ln._free for w in ways]
    assert len(free) == len(set(free)) == lanes.BUCKETS * lanes.WAYS
    assert ln._held == {}


def test_a_row_gone_and_back_in_the_same_way_during_a_poll_is_seen(registry, monkeypatch):
    """The cached "absent" is a snapshot of hash words read before the scan. When the key's
    row is removed between the snapshot and the scan (forced here) and later comes back in
    the same way, the words equal the snapshot again: the poll must not trust it."""
    reg = registry()
    c = Cancellation(reg)
    h = c.begin(5, SCOPE)
    way = h._receipt
    assert kind(way) == "lane"
    real = lanes.Lanes._hits

    def end_then_scan(self: lanes.Lanes, pk: Any, *args: Any) -> Any:
        h.end()  # after the snapshot, before the scan
        return real(self, pk, *args)

    monkeypatch.setattr(lanes.Lanes, "_hits", end_then_scan)
    assert c.in_flight(5, SCOPE) is False  # the scan found no row: right at that moment
    monkeypatch.undo()
    again = c.begin(5, SCOPE)
    assert again._receipt == way  # the same way, the same words as the snapshot
    assert c.in_flight(5, SCOPE) is True
    again.end()
    assert c.in_flight(5, SCOPE) is False
