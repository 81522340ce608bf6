#!/usr/bin/env python3
"""How long sweeps hold the registry lock, and what other processes' writes wait meanwhile.

    python tools/bench_sweeps.py [--rows 10000] [--reps 5] [--seconds 3]
                                 [--chunks | --writer [PAIRS_PER_S]]

Every outermost hold of the registry lock in this process is timed (``RegistryLock.__enter__``
and ``__exit__`` wrapped here, in the benchmark only). Over a full cancellations table of
``--rows`` rows (``max_rows`` = ``--rows``), filled twice: in 60 scopes of ~170 rows, then in a
scope per row (many clients with a cancellation each: an eviction batch then spans ``rows // 20``
scopes, each losing its count row):

- ``evict``: one ``cancel`` at the cap, which evicts a batch of ``rows // 20``;
- ``cleanup, none expired``: ``Cancellation.cleanup()`` over the full table, nothing to remove;
- ``cleanup, all expired``: the same once every row is past ``ttl``;

each printed as the median over ``--reps`` of the operation's wall time, its longest single lock
hold and its total lock time (milliseconds), in wall time and in this thread's CPU time (on a
loaded machine a holder preempted mid-hold makes the wall figure a scheduler's time slice).
Then two other processes run ``begin`` + ``end`` pairs for ``--seconds`` while this one repeats
evictions and cleanups, and again with this one idle: their pair latency p50 / p99 / max
(microseconds). Targets (issue #9), each printed ``met`` or ``MISSED`` (medians of the wall
figures): longest hold <= 1 ms; total lock time per eviction batch and per full sweep <= 10 ms.

A batch or sweep of 256 rows or more deletes its rows by rewrites of the index, a window of about
2 048 rows per hold, and their scope counts by rewrites of theirs in the same holds; each is
planned without the lock and stored only if no bucket it touches moved meanwhile. What another
writer's moves left goes by windows of about 128 rows, then 16 (planned again without what
moved), and the rest row by row. ``--writer`` runs the same while another process cancels and
clears (as fast as it can, or ``PAIRS_PER_S`` pairs a second), which keeps moving both indexes;
the eviction is then a direct batch of ``rows // 20`` (the cap is left 64 rows above the fill,
for the writer's), and the report says how many rows the rewrites left to the row-by-row
deletion. ``--chunks`` measures that row-by-row deletion alone, for every row: its holds stay
short, but a full sweep's total lock time is ~30-130 ms (MISSED).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from typing import Any

from shmcancel import Config
from shmcancel.cancellation import Cancellation
from shmcancel.shm import sweep
from shmcancel.shm.lock import RegistryLock
from shmcancel.shm.registry import Registry
from shmcancel.shm.sweep import Sweeps

_now = time.perf_counter

_cpu = time.thread_time

holds: list[tuple[float, float]] = []  # (wall, this thread's CPU time) of each hold, seconds


bulk = [0, 0]  # rows the bulk rewrites deleted, rows they left to the row-by-row deletion


def _count_bulk() -> None:
    real = Sweeps._bulk_delete

    def counted(self: Sweeps, *a: Any, **kw: Any) -> Any:
        got = real(self, *a, **kw)
        if got is not None:
            bulk[0] += len(got[0])
            bulk[1] += len(got[1])
        return got

    Sweeps._bulk_delete = counted  # type: ignore[method-assign]


def _instrument() -> None:
    """Record every outermost hold of any RegistryLock of this process into ``holds``."""
    enter, exit_ = RegistryLock.__enter__, RegistryLock.__exit__
    t0: dict[int, tuple[float, float]] = {}

    def timed_enter(self: RegistryLock) -> RegistryLock:
        outer = not self.held_by_me()
        r = enter(self)
        if outer:
            t0[id(self)] = (_now(), _cpu())
        return r

    def timed_exit(self: RegistryLock, et: Any, ev: Any, tb: Any) -> None:
        outer = self.held_by_me() and self._st.depth == 1
        exit_(self, et, ev, tb)
        if outer:
            w, c = t0.pop(id(self))
            holds.append((_now() - w, _cpu() - c))

    RegistryLock.__enter__ = timed_enter  # type: ignore[method-assign]
    RegistryLock.__exit__ = timed_exit  # type: ignore[method-assign]


@contextmanager
def _registry(rows: int) -> Iterator[Registry]:
    name = f"bench-sweeps-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    # No per-scope quota: the refills after each eviction go round-robin over 60 scopes while
    # the evictions take the largest scopes' rows, so some scope would pass 256 rows in time.
    reg = Registry.create(name, Config(max_rows=rows + HEADROOM, max_rows_per_scope=None,
                                       janitor_interval=3600.0))
    try:
        yield reg
    finally:
        reg.unlink()
        reg.close()


SHAPES = {"60 scopes": 60, "a scope per row": 0}  # label -> scopes (0: one per row)
HEADROOM = 0  # rows the cap leaves above the fill (--writer: its rows)


def _cancel_and_clear(name: str, stop: Any, out: Connection, rate: float) -> None:
    """Cancel and clear rows of one scope until ``stop``, ``rate`` pairs a second (0: as fast
    as it can); send the pairs."""
    c = Cancellation(Registry.attach(name))
    i = 0
    t0 = _now()
    while not stop.is_set():
        c.cancel(i, "bench", "ip:writer")
        c.clear(i, "ip:writer")
        i += 1
        if rate and not i % 8:
            ahead = t0 + i / rate - _now()
            if ahead > 0:
                time.sleep(ahead)
    out.send(i)


@contextmanager
def _writer_beside(name: str | None, pace: float = 0.0) -> Iterator[list[float]]:
    """With ``name``: another process cancels and clears in that registry meanwhile; yields a
    list that gets its pairs per second."""
    rate: list[float] = []
    if name is None:
        yield rate
        return
    ctx = mp.get_context("fork")
    stop = ctx.Event()
    r, w = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_cancel_and_clear, args=(name, stop, w, pace), daemon=True)
    t = _now()
    p.start()
    try:
        yield rate
    finally:
        stop.set()
        if r.poll(30):
            rate.append(r.recv() / (_now() - t))
        p.join(10)
        if p.is_alive():
            p.kill()
            p.join()


def _fill(c: Cancellation, rows: int, start: int = 0, scopes: int = 60) -> None:
    for i in range(start, start + rows):
        c.cancel(i, "bench", f"ip:s{i % scopes if scopes else i}")


def _measure(op: Callable[[], object]) -> tuple[float, ...]:
    """(wall, longest hold, longest hold CPU, total hold, total hold CPU) of ``op()``, ms."""
    holds.clear()
    t = _now()
    op()
    wall = _now() - t
    w = [h[0] for h in holds] or [0.0]
    c = [h[1] for h in holds] or [0.0]
    return tuple(x * 1e3 for x in (wall, max(w), max(c), sum(w), sum(c)))


def _row(label: str, runs: list[tuple[float, ...]]) -> tuple[float, ...]:
    med = [statistics.median(x) for x in zip(*runs, strict=True)]
    print(f"{label:<44} " + " ".join(f"{x:9.2f}" for x in med))
    return tuple(med)


def _writer(name: str, go: Any, stop: Any, out: Connection, k: int) -> None:
    c = Cancellation(Registry.attach(name))
    lat: list[float] = []
    go.wait(30)
    i = 0
    while not stop.is_set():
        t = _now()
        c.begin(f"w{k}-{i}", f"ip:w{k}").end()
        lat.append(_now() - t)
        i += 1
    out.send(lat)


def _contended(name: str, seconds: float, work: Callable[[], object] | None) -> list[float]:
    ctx = mp.get_context("fork")
    go, stop = ctx.Event(), ctx.Event()
    pipes, procs = [], []
    for k in range(2):
        r, w = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_writer, args=(name, go, stop, w, k), daemon=True)
        p.start()
        pipes.append(r)
        procs.append(p)
    go.set()
    end = _now() + seconds
    while _now() < end:
        if work is not None:
            work()
        else:
            time.sleep(0.01)
    stop.set()
    lat: list[float] = []
    for r in pipes:
        if r.poll(30):
            lat.extend(r.recv())
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
            p.join()
    return sorted(lat)


def _measure_shape(reg: Registry, clock: list[float], rows: int, scopes: int, shape: str,
                   reps: int, got: dict[str, tuple[float, ...]], writer: bool = False
                   ) -> tuple[Cancellation, int]:
    """Print and keep in ``got`` the three operations over a table filled as ``shape``; the
    Cancellation that ran them and the next unused id."""
    c = Cancellation(reg, clock=lambda: clock[0])
    _fill(c, rows, 0, scopes)
    n = rows
    runs = []
    for _ in range(reps):
        if writer:  # a direct batch: the writer's rows move the count at the cap
            runs.append(_measure(lambda: c._store.evict(rows // 20)))  # type: ignore[attr-defined]
        else:
            runs.append(_measure(lambda: c.cancel(n, "bench", "ip:new")))  # noqa: B023
        _fill(c, rows - _ours(reg), n + 1, scopes)
        n += rows
    label = f"evict, {shape}"
    got[label] = _row(label, runs)
    label = f"cleanup, none expired, {shape}"
    got[label] = _row(label, [_measure(c.cleanup) for _ in range(reps)])
    runs = []
    for _ in range(reps):
        clock[0] += 10 * reg.config.ttl
        runs.append(_measure(c.cleanup))
        _fill(c, rows - _ours(reg), n, scopes)
        n += rows
    label = f"cleanup, all expired, {shape}"
    got[label] = _row(label, runs)
    return c, n


def _ours(reg: Registry) -> int:
    """The rows of the table (the writer's one at most among them: a fill may fall one row
    short, which changes no figure)."""
    return reg.table("cancellations").count()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=10_000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=3.0)
    how = ap.add_mutually_exclusive_group()
    how.add_argument("--chunks", action="store_true",
                     help="never a bulk rewrite: every row deleted on its own, in short holds "
                          "(what a sweep does with the rows its rewrites leave)")
    how.add_argument("--writer", type=float, nargs="?", const=0.0, default=None,
                     metavar="PAIRS_PER_S",
                     help="another process cancels and clears meanwhile, PAIRS_PER_S cancel + "
                          "clear pairs a second (default: as fast as it can)")
    args = ap.parse_args(argv)
    rows = args.rows
    global HEADROOM
    if args.chunks:
        sweep.SWEEP_BULK = 1 << 62
    writer = args.writer is not None
    if writer:
        HEADROOM = 64
    _instrument()
    _count_bulk()
    print(f"{rows} rows, ms (median of {args.reps}):                 "
          "wall  max hold   max cpu  total hold  total cpu")
    clock = [1000.0]
    got: dict[str, tuple[float, ...]] = {}
    rates: list[float] = []
    with _registry(rows) as reg, \
            _writer_beside(reg.name if writer else None, args.writer or 0.0) as rate:
        _measure_shape(reg, clock, rows, SHAPES["a scope per row"], "a scope per row",
                       args.reps, got, writer)
    rates += rate
    with _registry(rows) as reg:
        with _writer_beside(reg.name if writer else None, args.writer or 0.0) as rate:
            c, n = _measure_shape(reg, clock, rows, SHAPES["60 scopes"], "60 scopes",
                                  args.reps, got, writer)
        rates += rate
        if writer:
            print(f"  the writer: {statistics.mean(rates or [0]):,.0f} cancel + clear pairs/s;"
                  f" the rewrites deleted {bulk[0]} rows, left {bulk[1]} to row by row "
                  "(changed meanwhile, or in buckets the writer kept moving)")
        for label, (_, longest, _, total, _) in got.items():
            print(f"  target {label}: longest hold {longest:.2f} ms <= 1 ms "
                  f"{'met' if longest <= 1.0 else 'MISSED'}, lock time in all {total:.2f} ms "
                  f"<= 10 ms {'met' if total <= 10.0 else 'MISSED'}"
                  + (" (row by row: every row on its own)" if args.chunks else "")
                  + (" (beside a writer)" if writer else ""))

        def sweeps() -> None:
            nonlocal n
            if writer:
                c._store.evict(rows // 20)  # type: ignore[attr-defined]
            else:
                c.cancel(n, "bench", "ip:new")
            _fill(c, rows - _ours(reg), n + 1)
            n += rows
            c.cleanup()

        print("other processes' begin+end, us:   p50      p99      max    pairs")
        for label, work in (("idle", None), ("while sweeping", sweeps)):
            lat = _contended(reg.name, args.seconds, work)
            if not lat:
                print(f"{label:<26} no samples")
                continue
            q = [lat[int(f * (len(lat) - 1))] * 1e6 for f in (0.5, 0.99)]
            print(f"{label:<26} {q[0]:9.1f} {q[1]:8.1f} {lat[-1] * 1e6:8.0f} {len(lat):8d}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
