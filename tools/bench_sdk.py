#!/usr/bin/env python3
"""Figures of ``shmcancel.sdk`` on a real gunicorn with three uvicorn workers (stateless, JSON).

    .venv/bin/python tools/bench_sdk.py [--cancels 100] [--seconds 5] [--concurrency 8] [--rounds 3]
                                        [--hop-calls 200]

- cancel latency: a ``sleep`` (async) and a ``sleep_sync`` call are started on one connection, a
  ``notifications/cancelled`` is posted on a fresh connection (any worker); measured from just
  before that POST is sent to the call's ``-32800`` answer arriving (so it includes two loopback
  HTTP exchanges: an upper bound of "notification reaches a worker → call ends"). p50/p99/max.
- the routing hop: a small call of a stateful session over a keep-alive connection to the
  worker holding it, and over one to another worker (forwarded through the unix socket): medians.
- echo throughput: ``tools/call echo`` over ``--concurrency`` keep-alive connections for
  ``--seconds``, with the integration and without it (the SDK's app alone), same workers.

The machine's load shows in the figures: run it on a quiet machine for numbers to quote.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid

import anyio
import httpx

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from helpers.gunicorn_harness import Gunicorn  # noqa: E402

from shmcancel import Cancellation, Registry  # noqa: E402

CONF = "examples/sdk/gunicorn.conf.py"
HEADERS = {"content-type": "application/json", "accept": "application/json, text/event-stream",
           "mcp-protocol-version": "2025-11-25"}


def _server(bare: bool, stateful: bool = False) -> Gunicorn:
    env = {"SHMCANCEL_SDK_BENCH_BARE": "1" if bare else "0",
           "SHMCANCEL_SDK_BENCH_STATEFUL": "1" if stateful else "0"}
    return Gunicorn("sdk_bench_app:app", registry_name=f"bench-sdk-{uuid.uuid4().hex[:8]}",
                    config=CONF, workers=3, worker_class="uvicorn_worker.UvicornWorker",
                    env=env, extra_args=["--pythonpath", HERE])


async def _cancel_once(url: str, reg: Registry, tool: str, rid: int) -> float:
    call = {"jsonrpc": "2.0", "id": rid, "method": "tools/call",
            "params": {"name": tool, "arguments": {"seconds": 30}}}
    note = {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": rid}}
    async with httpx.AsyncClient(timeout=20) as h, anyio.create_task_group() as tg:
        done = anyio.Event()
        answer: list[dict] = []

        async def post_call() -> None:
            answer.append((await h.post(url, json=call, headers=HEADERS)).json())
            done.set()

        tg.start_soon(post_call)
        c = Cancellation(reg)  # in_flight reads the table and the processes' lanes
        with anyio.fail_after(10):  # the layer records a cancel only for a call in flight
            while not c.in_flight(rid, "ip:127.0.0.1"):
                await anyio.sleep(0.002)
        async with httpx.AsyncClient(timeout=10) as h2:
            sent = time.perf_counter()
            r = await h2.post(url, json=note, headers=HEADERS)
            if r.status_code != 202:
                raise RuntimeError(f"notification answered {r.status_code}")
            with anyio.fail_after(10):
                await done.wait()
        took = time.perf_counter() - sent
    if answer[0].get("error", {}).get("code") != -32800:
        raise RuntimeError(f"unexpected answer {answer[0]}")
    return took


async def _echo_rate(url: str, seconds: float, concurrency: int) -> float:
    n = 0
    stop = time.perf_counter() + seconds

    async def loop(k: int) -> None:
        nonlocal n
        async with httpx.AsyncClient(timeout=10) as h:
            i = 0
            while time.perf_counter() < stop:
                i += 1
                call = {"jsonrpc": "2.0", "id": i, "method": "tools/call",
                        "params": {"name": "echo", "arguments": {"text": "x"}}}
                r = await h.post(url, json=call, headers=HEADERS)
                if r.status_code != 200 or "result" not in r.json():
                    raise RuntimeError(f"echo failed: {r.status_code} {r.text[:200]}")
                n += 1

    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for k in range(concurrency):
            tg.start_soon(loop, k)
    return n / (time.perf_counter() - started)


def _session(h: httpx.Client, url: str) -> dict[str, str]:
    r = h.post(url, headers=HEADERS, json={
        "jsonrpc": "2.0", "id": 0, "method": "initialize",
        "params": {"protocolVersion": "2025-11-25", "capabilities": {},
                   "clientInfo": {"name": "bench", "version": "0"}}})
    hdrs = dict(HEADERS, **{"mcp-session-id": r.headers["mcp-session-id"]})
    h.post(url, headers=hdrs, json={"jsonrpc": "2.0", "method": "notifications/initialized"})
    return hdrs


def _hop(url: str, calls: int) -> tuple[float, float]:
    """Median ms of a small call of one session over a keep-alive connection to the worker
    holding it, and over one to another worker (forwarded)."""
    clients = [httpx.Client(timeout=10)]
    try:
        owner = _session(clients[0], url)
        token = owner["mcp-session-id"].split("-")[0]
        other = None
        for _ in range(200):  # fresh connections (kept open) until one reaches another worker
            c = httpx.Client(timeout=10)
            clients.append(c)
            if _session(c, url)["mcp-session-id"].split("-")[0] != token:
                other = c
                break
        if other is None:
            raise RuntimeError("every connection reached the same worker")
        out = []
        for h in (clients[0], other):
            ts = []
            for i in range(calls):
                t = time.perf_counter()
                r = h.post(url, headers=owner, json={
                    "jsonrpc": "2.0", "id": i + 1, "method": "tools/call",
                    "params": {"name": "echo", "arguments": {"text": "x"}}})
                ts.append(time.perf_counter() - t)
                if r.status_code != 200:
                    raise RuntimeError(f"echo failed: {r.status_code}")
            out.append(statistics.median(ts) * 1000)
        return out[0], out[1]
    finally:
        for c in clients:
            c.close()


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cancels", type=int, default=100)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hop-calls", type=int, default=200)
    args = ap.parse_args(argv)

    with _server(bare=False) as g:
        reg = Registry.attach(g.registry_name, readonly=True)
        for tool in ("sleep", "sleep_sync"):
            lat = [anyio.run(_cancel_once, g.url, reg, tool, 10_000 + i)
                   for i in range(args.cancels)]
            ms = [x * 1000 for x in lat]
            print(f"cancel {tool:10s} n={len(ms)} p50={statistics.median(ms):.1f} ms "
                  f"p99={_pct(ms, 99):.1f} ms max={max(ms):.1f} ms")
        reg.close()
    with _server(bare=False, stateful=True) as g:
        direct, forwarded = _hop(g.url, args.hop_calls)
        print(f"stateful session, small call: {direct:.2f} ms median on its worker, "
              f"{forwarded:.2f} ms forwarded from another (hop {forwarded - direct:+.2f} ms)")
    rates: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.rounds):  # alternated, so a change of the machine's load hits both
        for bare in (False, True):
            with _server(bare=bare) as g:
                anyio.run(_echo_rate, g.url, 0.5, args.concurrency)  # warm-up
                rates[bare].append(anyio.run(_echo_rate, g.url, args.seconds, args.concurrency))
    with_, bare_ = statistics.median(rates[False]), statistics.median(rates[True])
    print(f"echo throughput, 3 workers, {args.concurrency} connections, median of "
          f"{args.rounds} rounds: with shmcancel.sdk {with_:.0f}/s "
          f"({', '.join(f'{r:.0f}' for r in rates[False])}), without {bare_:.0f}/s "
          f"({', '.join(f'{r:.0f}' for r in rates[True])}): {(with_ / bare_ - 1) * 100:+.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
