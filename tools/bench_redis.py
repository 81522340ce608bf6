#!/usr/bin/env python3
"""Figures for the cross-host layer (shmcancel.redis), against a redis-server this script starts
on loopback (no persistence) and stops.

    python tools/bench_redis.py [--rounds 60] [--polls 200000]

1. Poll cost, same process, same run: ``shmcancel.cancelled(conn)`` of a tracked request with
   shared memory only, then with a Redis bridge started in the process (its thread blocking on
   the worker's box and renewing leases) and the request also tracked in Redis; alternated over
   several batches, median ns per poll each, and their ratio (target <= 1.2x: polls never touch
   Redis).
2. Cross-host: two gunicorn "hosts" (2 sync workers each, own registries, one Redis): a
   ``sleep`` on A, its ``notifications/cancelled`` sent to B; p50/p99 of notification sent ->
   ``-32800`` reply received, at the client.
3. Same-host: the same flow on one host, with Redis configured (host A) and without (host C).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import httpx  # noqa: E402
from helpers.gunicorn_harness import Gunicorn  # noqa: E402
from helpers.names import TEST_PREFIX, unlink_registry_names  # noqa: E402
from helpers.redis_server import RedisServer, unique_prefix  # noqa: E402

import shmcancel  # noqa: E402
from shmcancel import redis as sredis  # noqa: E402

APP = "tests.apps.transport_app:app"
CONF = "tests/apps/transport_conf.py"


def poll_ns(conn: dict, n: int) -> float:
    cancelled = shmcancel.cancelled
    t0 = time.perf_counter_ns()
    for _ in range(n):
        cancelled(conn)
    return (time.perf_counter_ns() - t0) / n


def bench_polls(url: str, polls: int) -> tuple[float, float]:
    name = TEST_PREFIX + "bench" + uuid.uuid4().hex[:8]
    reg = shmcancel.Registry.create(name)
    try:
        c = shmcancel.Cancellation(reg)
        handle = c.begin(1, "ip:127.0.0.1")
        conn = {"shmcancel.handle": handle, "shmcancel.request_id": 1,
                "shmcancel.cancellation": c, "REMOTE_ADDR": "127.0.0.1"}
        batch = max(1000, polls // 20)
        shm: list[float] = []
        red: list[float] = []
        bridge = None
        for i in range(20):
            if i % 2 == 0:
                if bridge is not None:
                    sredis.stop()
                    bridge = None
                shm.append(poll_ns(conn, batch))
            else:
                if bridge is None:
                    bridge = sredis.start(reg, url, prefix=unique_prefix())
                    bridge.track(1, "ip:127.0.0.1")
                red.append(poll_ns(conn, batch))
        sredis.stop()
        handle.end()
        return statistics.median(shm), statistics.median(red)
    finally:
        reg.close()
        reg.unlink()
        unlink_registry_names(name)


class Client:
    def __init__(self, url: str) -> None:
        r = httpx.post(url, json={"jsonrpc": "2.0", "id": 0, "method": "initialize",
                                  "params": {"protocolVersion": "2025-11-25",
                                             "capabilities": {},
                                             "clientInfo": {"name": "bench", "version": "1"}}},
                       headers={"Accept": "application/json, text/event-stream"})
        self.sid = r.headers["mcp-session-id"]
        self.h = {"Accept": "application/json, text/event-stream",
                  "Mcp-Session-Id": self.sid, "MCP-Protocol-Version": "2025-11-25"}
        # One httpx client per thread that posts (calls / notifications): a client per request
        # would add its own set-up (tens of ms here) to every figure.
        self.local = threading.local()

    def post(self, url: str, obj: dict) -> httpx.Response:
        cl = getattr(self.local, "client", None)
        if cl is None:
            cl = self.local.client = httpx.Client(timeout=30)
        return cl.post(url, json=obj, headers=self.h)


def flow(run_on: str, cancel_on: str, outdir: str, rounds: int) -> list[float]:
    """Seconds from sending the notification to receiving -32800, per round."""
    c = Client(run_on)
    out = []
    for i in range(rounds):
        tag = "b" + uuid.uuid4().hex[:10]
        box: dict = {}

        def call(i: int = i, tag: str = tag, box: dict = box) -> None:
            r = c.post(run_on, {"jsonrpc": "2.0", "id": i, "method": "tools/call",
                                "params": {"name": "sleep",
                                           "arguments": {"seconds": 20, "tag": tag}}})
            box["done"] = time.perf_counter()
            box["reply"] = r.json()
        t = threading.Thread(target=call)
        t.start()
        started = os.path.join(outdir, f"{tag}.started")
        deadline = time.monotonic() + 10
        while not os.path.exists(started) and time.monotonic() < deadline:
            time.sleep(0.001)
        # (the call's Redis row is written before its tool starts, so before `started`)
        sent = time.perf_counter()
        c.post(cancel_on, {"jsonrpc": "2.0", "method": "notifications/cancelled",
                           "params": {"requestId": i}})
        t.join(30)
        if box.get("reply", {}).get("error", {}).get("code") != -32800:
            raise SystemExit(f"round {i}: not cancelled: {box.get('reply')}")
        out.append(box["done"] - sent)
    return out


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))] * 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--polls", type=int, default=200_000)
    args = ap.parse_args()
    srv = RedisServer().start()
    outdir = tempfile.mkdtemp(prefix="shmcancel-bench-redis-")
    try:
        shm, red = bench_polls(srv.url, args.polls)
        print(f"poll cancelled(conn): shm only {shm:.0f} ns, Redis configured {red:.0f} ns, "
              f"ratio {red / shm:.2f}x")
        prefix = unique_prefix()
        env = {"SHMCANCEL_TEST_DIR": outdir, "SHMCANCEL_REDIS_URL": srv.url,
               "SHMCANCEL_REDIS_PREFIX": prefix}
        names = [TEST_PREFIX + "bench" + uuid.uuid4().hex[:8] for _ in range(3)]
        with Gunicorn(APP, registry_name=names[0], config=CONF, workers=2,
                      env={**env, "SHMCANCEL_HOST_ID": "A"}) as a, \
                Gunicorn(APP, registry_name=names[1], config=CONF, workers=2,
                         env={**env, "SHMCANCEL_HOST_ID": "B"}) as b, \
                Gunicorn(APP, registry_name=names[2], config=CONF, workers=2,
                         env={"SHMCANCEL_TEST_DIR": outdir}) as c:
            for label, run_on, cancel_on in (("cross-host (A runs, B notified)", a, b),
                                             ("same-host, Redis configured", a, a),
                                             ("same-host, shm only", c, c)):
                lat = flow(run_on.url, cancel_on.url, outdir, args.rounds)
                print(f"{label}: notification -> -32800 p50 {pct(lat, 50):.1f} ms, "
                      f"p99 {pct(lat, 99):.1f} ms (n={len(lat)})")
        return 0
    finally:
        srv.stop()
        import shutil
        shutil.rmtree(outdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
