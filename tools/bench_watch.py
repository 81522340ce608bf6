#!/usr/bin/env python3
"""What watching a ``tools/call``'s client for a disconnect costs (contract §6.3).

    python tools/bench_watch.py [--rounds 15] [--ops 2000] [--baseline REV]
                                [--http] [--seconds 3] [--http-rounds 5] [--conns 16]
                                [--requests 50000] [--wire legacy|modern|both] [--src DIR]

Per call (one process, a connected socketpair), median ns per call over ``--rounds`` rounds of
``--ops`` calls, the variants interleaved in every round, as ratios against the floor measured in
the same rounds (one ``epoll_ctl`` ADD + DEL on a private epoll set):

- ``Watcher start+stop``: this checkout's per-process watcher (register + unregister);
- ``thread start+join``: a bare ``threading.Thread`` started and joined (the least a thread per
  call costs);
- with ``--baseline REV`` (default: ``e81deb4``, the commit before the per-process watcher;
  ``none`` to skip): ``Watcher`` of ``src/shmcancel/disconnect.py`` at that git revision (a
  thread, a pipe and a ``poll`` per call).

``--http``: end to end, the example app (``examples/gunicorn``) under gunicorn on loopback, 4
workers, ``sync`` and ``gthread`` (4 threads), ``tools/call echo``: for each worker class two
servers run side by side, one as shipped and one with ``McpServer(watch_disconnects=False)``,
loaded in turn (interleaved, alternating which goes first) for ``--seconds`` each by a Python
load generator (asyncio, ``--conns`` concurrent connections, keep-alive where the server keeps
the connection: the ``sync`` workers close it after every response), each load bounded by
``--requests`` requests. ``--untracked``: the second server also tracks nothing (no in-flight or
session-call rows: its wrapper app swaps ``Cancellation.begin`` for an untracked handle), and the
verdict against issue #9's end-to-end target (shipped >= 0.90 x off) is printed.
Prints the median req/s of each, the workers' CPU time (user + system,
from ``/proc``) per request of each, and the medians and ranges of the per-round ratios
watched/unwatched (the CPU ratio is the steadier one on a shared machine: it does not count the
time other processes take). ``--src DIR`` serves another checkout's ``src`` (``git archive REV
src | tar -x -C /tmp/base``, then ``--src /tmp/base/src``; where it has no ``watch_disconnects``
the unwatched server replaces ``McpServer._watch``) for a before/after.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also when loaded by path

from _benchlib import GunicornServer, echo_request, load

from shmcancel.mcp.disconnect import Watcher

ROOT = Path(__file__).resolve().parent.parent
_NOW = time.perf_counter_ns


def _nothing() -> None:
    pass


def _load_old_disconnect(rev: str) -> ModuleType | None:
    """``src/shmcancel/disconnect.py`` at git revision ``rev`` as a module, or ``None``."""
    try:
        src = subprocess.run(["git", "show", f"{rev}:src/shmcancel/disconnect.py"], cwd=ROOT,
                             check=True, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        print(f"(no baseline: git show {rev} failed: {e})")
        return None
    spec = importlib.util.spec_from_loader(f"disconnect_{rev}", loader=None)
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)
    exec(compile(src, f"{rev}:disconnect.py", "exec"), mod.__dict__)
    return mod


def bench_calls(rounds: int, ops: int, baseline: str | None) -> None:
    mine, peer = socket.socketpair()
    ep = select.epoll()
    fd = mine.fileno()
    mask = select.EPOLLIN | select.EPOLLRDHUP
    old = _load_old_disconnect(baseline) if baseline else None

    def floor() -> int:
        t0 = _NOW()
        for _ in range(ops):
            ep.register(fd, mask)
            ep.unregister(fd)
        return _NOW() - t0

    def new() -> int:
        t0 = _NOW()
        for _ in range(ops):
            w = Watcher(mine, on_disconnect=_nothing, on_timeout=_nothing, grace=5.0)
            w.start()
            w.stop()
        return _NOW() - t0

    def bare_thread() -> int:
        n = max(1, ops // 10)
        t0 = _NOW()
        for _ in range(n):
            t = threading.Thread(target=_nothing)
            t.start()
            t.join()
        return (_NOW() - t0) * ops // n

    variants: list[tuple[str, Callable[[], int]]] = [
        ("floor: epoll_ctl ADD+DEL", floor), ("Watcher start+stop (this checkout)", new),
        ("thread start+join", bare_thread)]
    if old is not None:
        def old_watcher() -> int:
            n = max(1, ops // 10)
            t0 = _NOW()
            for _ in range(n):
                w = old.Watcher(mine, on_disconnect=_nothing, on_timeout=_nothing, grace=5.0)
                w.start()
                w.stop()
            return (_NOW() - t0) * ops // n

        variants.append((f"Watcher start+stop at {baseline}", old_watcher))
    for _, fn in variants:  # warm up
        fn()
    per: dict[str, list[float]] = {name: [] for name, _ in variants}
    ratios: dict[str, list[float]] = {name: [] for name, _ in variants}
    for r in range(rounds):
        order = variants if r % 2 == 0 else variants[::-1]
        got = {name: fn() / ops for name, fn in order}
        for name, ns in got.items():
            per[name].append(ns)
            ratios[name].append(ns / got[variants[0][0]])
    mine.close()
    peer.close()
    ep.close()
    print(f"per call, median of {rounds} interleaved rounds of {ops}:")
    for name, _ in variants:
        print(f"  {name:42s} {statistics.median(per[name]) / 1000:9.2f} us"
              f"  {statistics.median(ratios[name]):8.1f}x floor")


# ------------------------------------------------------------------------------ HTTP

_WRAPPER = '''\
import os

import app as _example
from shmcancel.server import McpServer

_mode = os.environ["BENCH_WATCH"]  # "1": as shipped; "0": unwatched; "off": also untracked
if _mode != "1":
    if hasattr(_example.server, "watch_disconnects"):
        _example.server.watch_disconnects = False
    else:  # a checkout from before the switch
        McpServer._watch = lambda self, *a, **kw: None
if _mode == "off":
    # no rows for a call: an untracked handle (no id: begin, cancelled and end write nothing)
    # and no session_calls row; sessions are still minted, checked and touched
    from shmcancel.cancel.policy import Cancellation, RequestHandle

    Cancellation.begin = lambda self, request_id, scope: RequestHandle(self, None, scope)
    try:
        from shmcancel.mcp.sessions import Call, SessionStore
    except ImportError:  # a checkout from before the split
        from shmcancel.sessions import Call, SessionStore
    SessionStore.begin_call = lambda self, session: Call(session.id, None)
app = _example.app
'''


class Server(GunicornServer):
    """The example under gunicorn, watching or not (``bench_watch_app`` in ``tmp``)."""

    def __init__(self, tmp: str, kind: str, watch: bool, src: str | None, *,
                 threads: int = 4, workers: int = 4, untracked: bool = False,
                 extra_args: Sequence[str] = ()) -> None:
        """``threads``: per ``gthread`` worker; ``untracked`` (with ``watch`` false): no
        in-flight or session-call rows either (shmcancel's per-call machinery off, from the
        wrapper app, not a production switch). ``tmp`` must hold the wrapper app
        (:func:`write_wrapper`)."""
        mode = "1" if watch else "off" if untracked else "0"
        super().__init__(tmp, kind, "bench_watch_app:app", {"BENCH_WATCH": mode},
                         f"{kind}-{mode}-{os.getpid()}-{id(self):x}", src, workers=workers,
                         threads=threads, registry_prefix="bench-watch", extra_args=extra_args)


def write_wrapper(tmp: str) -> None:
    """Write the app :class:`Server` serves (``bench_watch_app``) into ``tmp``."""
    Path(tmp, "bench_watch_app.py").write_text(_WRAPPER)


def bench_http(seconds: float, rounds: int, conns: int, max_requests: int, wires: list[str],
               src: str | None, untracked: bool = False) -> list[float]:
    """Print the watched/unwatched comparison (``untracked``: against a server with tracking
    off too); return the median req/s ratios, one per worker class and wire."""
    medians: list[float] = []
    on_name, off_name = ("shipped", "off") if untracked else ("watched", "unwatched")
    with tempfile.TemporaryDirectory(prefix="bench-watch-") as tmp:
        write_wrapper(tmp)
        for kind in ("sync", "gthread"):
            servers: list[Server] = []
            try:  # the first one stopped too when the second does not start
                servers.append(Server(tmp, kind, True, src))
                servers.append(Server(tmp, kind, False, src, untracked=untracked))
                on, off = servers
                for wire in wires:
                    reqs = {s: echo_request(s.port, wire) for s in (on, off)}
                    for s in (on, off):  # warm up every worker
                        asyncio.run(load(s.port, reqs[s], 0.5, conns, max_requests))
                    rate: dict[bool, list[float]] = {True: [], False: []}
                    cpu: dict[bool, list[float]] = {True: [], False: []}
                    ratio: list[float] = []
                    cpu_ratio: list[float] = []
                    bad = 0
                    for r in range(rounds):
                        got, used = {}, {}
                        for s in ((on, off) if r % 2 == 0 else (off, on)):
                            c0 = s.worker_cpu()
                            n, b, dt = asyncio.run(load(s.port, reqs[s], seconds, conns,
                                                         max_requests))
                            got[s is on] = n / dt
                            used[s is on] = (s.worker_cpu() - c0) / max(n, 1)
                            bad += b
                        for w in (True, False):
                            rate[w].append(got[w])
                            cpu[w].append(used[w])
                        ratio.append(got[True] / got[False])
                        cpu_ratio.append(used[True] / used[False] if used[False] else 0.0)
                    med = statistics.median
                    medians.append(med(ratio))
                    print(f"  {kind:8s} {wire:7s} req/s {on_name} {med(rate[True]):6.0f} "
                          f"{off_name} {med(rate[False]):6.0f} ratio {med(ratio):.2f} "
                          f"[{min(ratio):.2f}..{max(ratio):.2f}] | worker CPU/request {on_name} "
                          f"{med(cpu[True]) * 1e6:5.0f} us {off_name} {med(cpu[False]) * 1e6:5.0f}"
                          f" us ratio {med(cpu_ratio):.2f} [{min(cpu_ratio):.2f}.."
                          f"{max(cpu_ratio):.2f}] | other outcomes {bad}")
            finally:
                for s in servers:
                    s.close()
    return medians


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--ops", type=int, default=2000)
    ap.add_argument("--baseline", default="e81deb4",
                    help="git revision whose disconnect.Watcher to compare ('none': skip)")
    ap.add_argument("--http", action="store_true", help="also the end-to-end measurement")
    ap.add_argument("--no-calls", action="store_true", help="skip the per-call measurement")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--http-rounds", type=int, default=5)
    ap.add_argument("--conns", type=int, default=16)
    ap.add_argument("--requests", type=int, default=50_000,
                    help="the most requests one load sends")
    ap.add_argument("--wire", choices=["legacy", "modern", "both"], default="both")
    ap.add_argument("--src", help="the src directory gunicorn serves (default: this checkout)")
    ap.add_argument("--untracked", action="store_true",
                    help="compare against a server with tracking off too (the issue #9 target: "
                         ">= 0.90)")
    a = ap.parse_args(argv)
    if not 1 <= a.rounds <= 1000 or not 1 <= a.ops <= 1_000_000 or not 0 < a.seconds <= 600:
        ap.error("--rounds 1..1000, --ops 1..1000000, --seconds up to 600")
    if not a.no_calls:
        bench_calls(a.rounds, a.ops, None if a.baseline == "none" else a.baseline)
    if a.http:
        wires = ["legacy", "modern"] if a.wire == "both" else [a.wire]
        print(f"end to end: echo, 4 workers, {a.conns} connections, median of {a.http_rounds}"
              f" interleaved rounds of {a.seconds:g}s, serving "
              f"{a.src or 'this checkout'}:")
        got = bench_http(a.seconds, a.http_rounds, a.conns, a.requests, wires, a.src,
                         a.untracked)
        if a.untracked and got:
            print(f"  target shipped/off >= 0.90 on every worker class and wire: "
                  f"{'met' if min(got) >= 0.90 else 'MISSED'} (lowest median {min(got):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
