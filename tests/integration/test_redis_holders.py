"""A session's holders in Redis (``sess:<sid>:boxes``, the worker boxes a DELETE tells) stay
bounded: each worker that ever served a session was listed until the session ended, so a
long-lived session gathered every recycled worker, and its DELETE pushed to each. Real
redis-server (the run's); holders are listed and dropped by the Lua scripts the bridge runs."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from helpers.gunicorn_harness import wait_until
from helpers.redis_server import unique_prefix
from test_redis_bridge import bridge

from shmcancel import Config
from shmcancel.redis import RedisStore, connect
from shmcancel.shm.registry import Registry

HOLDERS_KEPT = 8  # common.lua: a holders set this small is not pruned


@pytest.fixture
def store(redis_server: Any) -> Iterator[RedisStore]:
    s = RedisStore(connect(redis_server.url, timeout=5.0), Config(session_ttl=600),
                   prefix=unique_prefix())
    try:
        yield s
    finally:
        s.client.close()


def holders(st: RedisStore, sid: str) -> set[str]:
    return {b.decode() for b in st.client.smembers(f"{st.prefix}sess:{sid}:boxes")}


def test_a_long_lived_sessions_holders_stay_bounded_as_workers_come_and_go(
        store: RedisStore) -> None:
    """40 workers serve one session in turn, each stopped after (a recycled worker): the set
    held all 40 and more, and a DELETE told each. Now gone holders leave at the next renewal
    past 8; live ones and those of workers that never beat (an older version) stay, and a
    DELETE tells only those."""
    sid = "s-holders"
    assert store.put_session(sid, "2025-11-25", "ip:203.0.113.9", now_ms=int(time.time() * 1000),
                             box="live0")
    store.beat("live0")
    assert store.touch_session(sid, box="older-version") == 1  # it never beats
    most = 0
    for i in range(40):
        box = f"worker{i}"
        store.beat(box)
        store.beat("live1")
        assert store.touch_session(sid, box=box) == 1
        assert store.touch_session(sid, box="live1") == 1
        most = max(most, len(holders(store, sid)))
        store.beat(box, stopping=True)
    assert most <= HOLDERS_KEPT
    now = holders(store, sid)
    assert {"live0", "live1", "older-version"} <= now and len(now) <= HOLDERS_KEPT
    told = store.delete_session(sid, own_box="live1", box_lease_ms=10_000)
    assert told == 2  # live0 and the older version's: no gone worker's box
    for box in now - {"live0", "older-version", "live1"}:
        assert not store.client.exists(store.box_key(box))
    assert store.client.exists(store.box_key("live0"))
    assert store.client.exists(store.box_key("older-version"))


def test_a_killed_workers_box_leaves_the_holders_once_its_beat_is_old(
        store: RedisStore) -> None:
    """A worker killed (no stop: its beats just end) leaves the holders once its last beat is
    older than ``box_gone_after``; until then it stays (a live worker's beats are a second
    apart at most)."""
    store.box_gone_after = 2.0
    sid = "s-killed"
    boxes = [f"w{i}" for i in range(HOLDERS_KEPT + 1)]
    for b in boxes:
        store.beat(b)
    assert store.put_session(sid, "2025-11-25", "ip:203.0.113.9", now_ms=int(time.time() * 1000),
                             box=boxes[0])
    for b in boxes[1:]:
        assert store.touch_session(sid, box=b) == 1
    assert holders(store, sid) == set(boxes)  # over 8, every beat fresh: nobody leaves
    killed, live = boxes[-1], boxes[:-1]

    def pruned() -> bool | None:
        for b in live:
            store.beat(b)
        store.touch_session(sid, box=live[0])
        return killed not in holders(store, sid) or None

    wait_until(pruned, time.monotonic() + 20, interval=0.2, what="the killed box to leave")
    assert holders(store, sid) == set(live)


def test_a_bridge_beats_while_it_runs_and_its_box_is_gone_once_it_stops(
        redis_server: Any, shm_name: str) -> None:
    """The bridge's thread beats at every renewal; its stop takes its box for gone at once, so
    the next renewal of a session it held drops it."""
    reg = Registry.create(shm_name, Config(capacity=400, max_rows=200, in_flight_capacity=64,
                                           session_capacity=16))
    r = redis.Redis.from_url(redis_server.url)
    try:
        with bridge(reg, redis_server, thread=True, lease=0.6) as b:
            up, box = f"{b.store.prefix}{{g}}:up", b.remote.box
            first = wait_until(lambda: r.zscore(up, box), time.monotonic() + 10,
                               interval=0.05, what="a first beat")
            wait_until(lambda: (r.zscore(up, box) or 0) > first or None,
                       time.monotonic() + 10, interval=0.05, what="a later beat")
            sid = "s-bridge"
            st = b.store
            assert st.put_session(sid, "2025-11-25", "ip:203.0.113.9",
                                  now_ms=int(time.time() * 1000), box=box)
            others = [f"o{i}" for i in range(HOLDERS_KEPT)]
            for o in others:
                st.beat(o)
                assert st.touch_session(sid, box=o) == 1
            assert box in holders(st, sid)
            b.stop()
            assert st.touch_session(sid, box=others[0]) == 1
            assert holders(st, sid) == set(others)
    finally:
        r.close()
        reg.close()
        reg.unlink()
