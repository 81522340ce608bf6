"""A session's holders in Redis (``sess:<sid>:boxes``, the worker boxes a DELETE tells) stay
bounded: each worker that ever served a session was listed until the session ended, so a
long-lived session gathered every recycled worker, and its DELETE pushed to each. A worker's
bridge now marks its box stopped when the worker exits; the holders' scripts drop marked boxes.
Real redis-server (the run's); real processes for the exits."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
from helpers.gunicorn_harness import wait_until
from helpers.redis_server import unique_prefix

from shmcancel import Config
from shmcancel.redis import RedisStore, connect

STORE = Config(session_ttl=600)


@pytest.fixture
def store(redis_server: Any) -> Iterator[RedisStore]:
    s = RedisStore(connect(redis_server.url, timeout=5.0), STORE, prefix=unique_prefix())
    try:
        yield s
    finally:
        s.client.close()


def holders(st: RedisStore, sid: str) -> set[str]:
    return {b.decode() for b in st.client.smembers(f"{st.prefix}sess:{sid}:boxes")}


def put(st: RedisStore, sid: str, box: str) -> None:
    assert st.put_session(sid, "2025-11-25", "ip:203.0.113.9", now_ms=int(time.time() * 1000),
                          box=box, box_lease_ms=10_000) == []


def test_a_long_lived_sessions_holders_stay_bounded_as_workers_come_and_go(
        store: RedisStore) -> None:
    """40 workers serve one session in turn, each stopped after (a recycled worker): the set
    held all 40 and more, and a DELETE told each. Now a stopped holder leaves at the session's
    next renewal; live ones and those never marked (killed, or of an older version) stay, and a
    DELETE tells only those."""
    sid = "s-holders"
    put(store, sid, "live0")
    assert store.touch_session(sid, box="unmarked") == 1
    most = 0
    for i in range(40):
        box = f"worker{i}"
        assert store.touch_session(sid, box=box) == 1
        assert store.touch_session(sid, box="live1") == 1
        most = max(most, len(holders(store, sid)))
        store.box_stopped(box)
    assert most == 4  # live0, unmarked, live1 and the worker serving now
    assert store.touch_session(sid, box="live1") == 1
    assert holders(store, sid) == {"live0", "unmarked", "live1"}
    put(store, sid, "worker-late")  # a store drops the stopped as a renewal does
    store.box_stopped("worker-late")
    put(store, sid, "live0")
    assert holders(store, sid) == {"live0", "unmarked", "live1"}
    assert store.touch_session(sid, box="worker-late") == 1  # its owed renewal, after the mark
    told = store.delete_session(sid, own_box="live1", box_lease_ms=10_000)
    assert told == 2  # live0 and unmarked: never a stopped worker's box
    assert not store.client.exists(store.box_key("worker-late"))
    assert store.client.exists(store.box_key("live0"))
    assert store.client.exists(store.box_key("unmarked"))


def test_a_hosts_last_listed_box_stays_though_stopped(store: RedisStore) -> None:
    """A renewal dropped every stopped holder: once the only listed box of host B stopped (its
    worker recycled), B was no longer listed at all, and a DELETE told no worker of B, whose
    registry keeps the copy for its other workers (they served the ended session on, and
    stored it again once Redis forgot the end). A stopped box now stays while no other box of
    its host is listed, so a DELETE tells a live box of B."""
    sid = "s-last-of-host"
    for box in ("A:1:a", "B:1:a", "B:3:a"):  # live workers (their bridges renew these keys)
        assert not store.set_alive(box, 10_000)
    put(store, sid, "A:1:a")
    assert store.touch_session(sid, box="B:1:a") == 1
    store.box_stopped("B:1:a")
    assert store.touch_session(sid, box="A:1:a") == 1
    assert holders(store, sid) == {"A:1:a", "B:1:a"}  # B's one box stays
    assert store.touch_session(sid, box="B:2:a") == 1
    assert holders(store, sid) == {"A:1:a", "B:2:a"}  # another box of B listed: it leaves
    store.box_stopped("B:2:a")
    assert store.touch_session(sid, box="A:1:a") == 1
    assert holders(store, sid) == {"A:1:a", "B:2:a"}
    assert store.delete_session(sid, own_box="A:1:a", box_lease_ms=10_000) == 1
    assert store.client.exists(store.box_key("B:3:a"))  # B's live worker
    assert not store.client.exists(store.box_key("B:2:a"))
    # a host gone for good (its server restarted: a new registry, a new host part) leaves
    put(store, "s-gone-host", "A:1:a")
    assert store.touch_session("s-gone-host", box="C:1:a") == 1
    store.box_stopped("C:1:a")
    assert store.touch_session("s-gone-host", box="A:1:a") == 1
    assert holders(store, "s-gone-host") == {"A:1:a"}


def test_a_holder_whose_alive_key_lapsed_stays_and_a_kept_mark_is_renewed(
        store: RedisStore) -> None:
    """A live worker's alive key can lapse (Redis full refused its renewal, its thread starved
    past a lease): a renewal that dropped it for that left its host unlisted, and a DELETE
    missed the host, whose copy was served on. Only a stop mark drops a holder. A host's last
    box, kept though stopped, keeps its mark as long: forgotten, the box would count as live
    and stay when its host has gone."""
    sid = "s-lapsed"
    for box in ("A:1:a", "B:1:a"):
        assert not store.set_alive(box, 10_000)
    put(store, sid, "A:1:a")
    assert store.touch_session(sid, box="B:1:a") == 1
    store.client.delete(store.alive_key("B:1:a"), f"{store.prefix}alive-host:B")  # lapsed
    assert store.touch_session(sid, box="A:1:a") == 1
    assert holders(store, sid) == {"A:1:a", "B:1:a"}
    assert not store.set_alive("B:2:a", 10_000)  # B lives
    stopped = f"{store.prefix}{{g}}:stopped"
    store.client.zadd(stopped, {"B:1:a": 1})  # stopped long ago: its mark about to go
    assert store.touch_session(sid, box="A:1:a") == 1
    assert holders(store, sid) == {"A:1:a", "B:1:a"}  # B's one box, B alive
    assert store.client.zscore(stopped, "B:1:a") > time.time() * 1000 - 60_000  # renewed
    assert store.client.pttl(stopped) > (STORE.session_ttl + 59) * 1000


def test_a_key_of_another_type_at_the_marks_keeps_every_holder_and_delete_tells_them(
        store: RedisStore) -> None:
    """Another client writes over ``{g}:stopped``: reading a mark fails, which counts as not
    stopped. Renewals, stores and DELETEs go on; holders are kept and told (as before marks)."""
    sid = "s-wrongtype"
    put(store, sid, "a")
    store.box_stopped("a")
    store.client.set(f"{store.prefix}{{g}}:stopped", b"not a zset")
    assert store.touch_session(sid, box="b") == 1
    assert holders(store, sid) == {"a", "b"}
    assert store.delete_session(sid, own_box="b", box_lease_ms=10_000) == 1
    assert not store.client.exists(f"{store.prefix}sess:{sid}")


def test_a_delete_tells_one_live_box_of_each_host_whose_holders_all_stopped(
        store: RedisStore) -> None:
    """A host's copy of a session lives in its registry for every worker there: when all its
    listed holders stopped (recycled), a DELETE told nobody on that host. Now it tells one live
    box of it (alive key set, not stopped; the newest in the live index first), and none of a
    host a holder was told on, of the DELETE's own host, or of a host with no live box."""
    sid = "s-recycled"
    for box in ("A:1:a", "A:2:a", "B:1:a", "B:2:a", "B:3:a", "B:4:a", "C:1:a", "C:2:a",
                "D:1:a"):  # live workers: their bridges renew these keys
        assert not store.set_alive(box, 10_000)
    put(store, sid, "A:1:a")  # the DELETE's own box
    for box in ("B:1:a", "B:2:a", "C:1:a", "D:1:a"):
        assert store.touch_session(sid, box=box) == 1
    for box in ("B:1:a", "B:2:a", "D:1:a"):
        store.box_stopped(box)
    store.client.zadd(f"{store.prefix}{{g}}:live", {"B:5:a": int(time.time() * 1000) + 1000})
    assert store.delete_session(sid, own_box="A:1:a", box_lease_ms=10_000) == 2
    told = {b for b in ("A:2:a", "B:1:a", "B:2:a", "B:3:a", "B:4:a", "B:5:a", "C:1:a", "C:2:a",
                        "D:1:a") if store.client.exists(store.box_key(b))}
    assert told in ({"C:1:a", "B:3:a"}, {"C:1:a", "B:4:a"}), told


def test_a_delete_tells_a_live_box_of_a_host_whose_holder_was_killed(store: RedisStore) -> None:
    """A worker killed outright (SIGKILL, the OOM killer) never marks its box stopped, so a
    DELETE counted its host told through a box nobody reads, and the host's other workers served
    the ended session on (past the gone marker, storing it again). A holder whose alive key has
    expired is still told, but a live box of its host is told as well; a host whose listed
    holder is alive is told through that holder only."""
    sid = "s-killed"
    for box in ("A:1:a", "B:1:a", "B:2:a", "C:1:a", "C:2:a"):  # live workers
        assert not store.set_alive(box, 10_000)
    put(store, sid, "A:1:a")  # the DELETE's own box
    for box in ("B:1:a", "C:1:a"):
        assert store.touch_session(sid, box=box) == 1
    store.client.delete(store.alive_key("B:1:a"))  # B:1:a was killed: its alive key expired
    assert store.delete_session(sid, own_box="A:1:a", box_lease_ms=10_000) == 3
    told = {b for b in ("B:1:a", "B:2:a", "C:1:a", "C:2:a")
            if store.client.exists(store.box_key(b))}
    assert told == {"B:1:a", "B:2:a", "C:1:a"}, told


EXITING = """
import os, sys, time
from shmcancel import Config
from shmcancel.redis import bridge
from shmcancel.shm.registry import Registry
reg = Registry.create(sys.argv[2], Config(capacity=400, max_rows=200, in_flight_capacity=64,
                                          session_capacity=16))
try:
    boxes = []
    for _ in range(2 if sys.argv[4] == "twice" else 1):  # twice: the first bridge replaced
        b = bridge.start(reg, sys.argv[1], prefix=sys.argv[3], lease=3.0)
        b.store.touch_session("s-exit", box=b.remote.box)
        boxes.append(b.remote.box)
    print(" ".join(boxes), flush=True)
    if sys.argv[4] == "kill":
        time.sleep(60)
finally:
    reg.close()
    reg.unlink()
"""


@pytest.mark.parametrize("how", ["exit", "twice", "kill"])
def test_a_worker_that_exits_marks_its_box_stopped_and_a_killed_one_stays_listed(
        redis_server: Any, store: RedisStore, shm_name: str, how: str) -> None:
    """A process with a bridge exits as a recycled worker does (normally, its bridge never
    stopped by hand): its box is marked stopped, and it leaves the session at the next
    renewal; so does a bridge the process replaced (its thread read its box to the end). A
    SIGKILLed one cannot mark: it stays listed and told (the session's TTL ends it), never
    dropped for what another process guesses. ``live`` is a worker of the same host (a
    stopped box stays while it is its host's last one listed)."""
    put(store, "s-exit", "first")
    proc = subprocess.Popen([sys.executable, "-c", EXITING, redis_server.url, shm_name,
                             store.prefix, how], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        boxes = set(proc.stdout.readline().split())
        assert len(boxes) == (2 if how == "twice" else 1)
        assert boxes <= holders(store, "s-exit")
        live = next(iter(boxes)).rsplit(":", 2)[0] + ":1:live"  # host part: host/registry
        if how == "kill":  # once its bridge's thread set its alive key
            wait_until(lambda: all(store.client.exists(store.alive_key(b)) for b in boxes)
                       or None, time.monotonic() + 10, interval=0.01, what="its alive key")
        assert store.touch_session("s-exit", box=live) == 1
        if how == "kill":
            os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == (-signal.SIGKILL if how == "kill" else 0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert store.touch_session("s-exit", box=live) == 1
    if how == "kill":
        # never marked: kept once its alive key (lease 3 s) expired too (a lapse says too
        # little to drop a holder for: Redis full, a starved thread)
        wait_until(lambda: not any(store.client.exists(store.alive_key(b)) for b in boxes)
                   or None, time.monotonic() + 10, interval=0.05, what="its alive key to expire")
        assert store.touch_session("s-exit", box=live) == 1
        assert holders(store, "s-exit") == {"first", live, *boxes}
    else:  # marked before the process ended
        assert holders(store, "s-exit") == {"first", live}
