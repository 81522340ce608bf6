#!/usr/bin/env python3
"""A cancellation that lands on a ``gthread`` worker whose threads all run calls (README, Limits).

    python tools/saturated_worker.py [--trials 20] [--worker-connections N] [--sleep 3]

The example app under gunicorn ``gthread``, 2 workers x 2 threads, on loopback, a registry of
its own (unlinked when the script stops gunicorn, by pid). Per trial: two ``sleep`` calls
(``--sleep`` seconds), each in flight before the next, then a ``notifications/cancelled`` for
the first on a new connection. When both calls run in one worker and that worker accepts the
notification too, the notification waits for a thread: until a call ends. Prints how often the
two calls shared a worker, the cancel latencies (notification sent -> the call's answer) and how
many calls ran out uncancelled: with gunicorn's default ``worker_connections`` (1000) some do;
with ``--worker-connections 2`` (= threads) a busy worker stops accepting and none do.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from _benchlib import ROOT, call_request, free_port, post_request, response_body, session

from shmcancel import Registry, ShmCancelError
from shmcancel.cancel.shm_storage import ShmBackend
from shmcancel.exceptions import RegistryNotFound

WAIT = 10.0  # seconds any one step may take


def _recv_response(sock: socket.socket) -> bytes:
    """The body of the one HTTP response ``sock`` receives (``b""`` if it closes first)."""
    sock.settimeout(WAIT + 60)
    data = b""
    while (body := response_body(data)) is None:
        chunk = sock.recv(65536)
        if not chunk:
            return b""
        data += chunk
    return body


def _until(poll: Callable[[], bool], deadline: float, what: str) -> None:
    while not poll():
        if time.monotonic() > deadline:
            raise SystemExit(f"saturated_worker: {what}")
        time.sleep(0.001)


def run(a: argparse.Namespace) -> list[float]:
    port = free_port()
    name = f"bench-saturated-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    extra = [] if a.worker_connections is None else ["--worker-connections",
                                                      str(a.worker_connections)]
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "gunicorn"), "-c",
         str(ROOT / "examples/gunicorn/gunicorn.conf.py"),
         "-b", f"127.0.0.1:{port}", "-w", "2", "-k", "gthread", "--threads", "2", *extra],
        env={**os.environ, "SHMCANCEL_REGISTRY": name}, cwd=ROOT,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    reg = None
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                reg = Registry.attach(name)
                break
            except (OSError, RegistryNotFound):
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise SystemExit("saturated_worker: gunicorn did not start") from None
                time.sleep(0.05)
        store = ShmBackend(reg)
        sid = session(port)
        scope = f"session:{sid}"
        headers = {"MCP-Protocol-Version": "2025-11-25", "Mcp-Session-Id": sid}
        shared = ran_out = 0
        latencies: list[float] = []
        for trial in range(a.trials):
            ids = [100 + 2 * trial, 101 + 2 * trial]
            calls = []
            try:
                for rid in ids:
                    s = socket.create_connection(("127.0.0.1", port), WAIT)
                    calls.append(s)
                    s.sendall(call_request(port, "legacy", "sleep", {"seconds": a.sleep}, rid,
                                           sid))
                    _until(lambda rid=rid: store.in_flight(scope, str(rid)),
                           time.monotonic() + WAIT, f"call {rid} did not get in flight")
                owners = [store.in_flight_pids(scope, str(rid)) for rid in ids]
                shared += owners[0] == owners[1]
                t0 = time.monotonic()
                with socket.create_connection(("127.0.0.1", port), WAIT) as n:
                    n.sendall(post_request(port, {"jsonrpc": "2.0",
                                                  "method": "notifications/cancelled",
                                                  "params": {"requestId": ids[0]}}, headers))
                    reply = _recv_response(calls[0])
                    code = None
                    latencies.append(time.monotonic() - t0)
                    with contextlib.suppress(ValueError, AttributeError):
                        code = json.loads(reply).get("error", {}).get("code")
                    ran_out += code != -32800  # the notification was served too late
            finally:
                for s in calls:
                    s.close()
            # the second call sees its client gone and ends: wait for it before the next trial
            _until(lambda rid=str(ids[1]): not store.in_flight(scope, rid),
                   time.monotonic() + WAIT, f"call {ids[1]} did not end with its connection")
        wc = a.worker_connections if a.worker_connections is not None else "default (1000)"
        print(f"gthread 2x2, worker_connections {wc}, {a.trials} trials of two {a.sleep:g} s "
              f"calls: both on one worker {shared} times; cancel latency p50 "
              f"{statistics.median(latencies) * 1e3:.1f} ms, max {max(latencies) * 1e3:.0f} ms; "
              f"{sum(x > 1 for x in latencies)} waited over 1 s, {ran_out} served only after the "
              "call ran out (not cancelled)")
        return latencies
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        if reg is not None:
            reg.close()
        if os.path.exists(f"/dev/shm/shmcancel.{name}"):  # on_exit did not run
            with contextlib.suppress(ShmCancelError, OSError):
                Registry.attach(name).unlink()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--worker-connections", type=int, default=None,
                    help="gunicorn's --worker-connections (default: gunicorn's, 1000)")
    ap.add_argument("--sleep", type=float, default=3.0, help="seconds each call would sleep")
    a = ap.parse_args(argv)
    if not 1 <= a.trials <= 1000 or not 0.5 <= a.sleep <= 30 \
            or (a.worker_connections is not None and not 1 <= a.worker_connections <= 10000):
        ap.error("--trials 1..1000, --sleep 0.5..30, --worker-connections 1..10000")
    run(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
