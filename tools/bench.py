#!/usr/bin/env python3
"""The report of issue #9: shmcancel against its floors and against what a user would pick
instead, and each of the issue's targets met or MISSED.

    python tools/bench.py [--quick] [--only poll,write,scaling,footprint,e2e] [--plot out.png]
                          [--load auto|python|wrk] [--seconds S] [--conns N]
                          [--wire legacy|modern|both] [--kind sync|gthread|both] [--e2e-rounds R]

One process tree: this process, the processes it forks, a ``redis-server`` on a free loopback
port (``--save '' --appendonly no``), a ``multiprocessing.Manager`` server process and, for
``e2e``, two gunicorns. Each is stopped by its pid in a ``finally`` (also on Ctrl-C); every
shared-memory name and file it creates is removed; every wait has a deadline.

The backends, each asked the same questions for one request id in one caller's scope:

- ``shmcancel``: a registry of its own (``Registry.create``, ``Cancellation``), public API only;
- ``redis GET flag``: redis-py against the ``redis-server`` (a key per cancelled id, ``SET ..
  EX 300``; skipped, saying so, without ``redis-server`` or redis-py);
- ``Manager dict``: a ``multiprocessing.Manager().dict()`` shared by every process;
- ``sqlite WAL``: a sqlite database in WAL mode (``synchronous=NORMAL``, autocommit) on
  ``/dev/shm``.

Sections (``--only`` picks some):

- ``poll``: "is this id cancelled?" for an in-flight, uncancelled request, among 5 000 other
  cancellation rows; alone, then while 4 other processes write the same backend;
- ``write``: mark in flight + unmark (shmcancel: ``begin`` + ``end``; and again in a scope
  holding another request's cancellation row, where ``end`` has a row to look for),
  ``cancel``, ``clear``; alone, then while 4 other processes write;
- ``scaling``: 1, 2 and 4 processes doing mark + unmark pairs at once: aggregate pairs/s and
  the ratio to 1 process; 4 threads of one process against 1;
- ``footprint``: shmcancel's segment bytes (allocated at create, and the file's size) for
  ``Config()`` and ``Config(max_rows=100)``; the
  RSS of a process that imports each client only against bare Python (and whether ``import
  shmcancel`` loads the server or ``ssl``); the server's RSS (or the file's bytes) holding
  10 000 cancellation rows;
- ``e2e``: the example app (``examples/gunicorn``) under gunicorn on loopback, 4 workers,
  ``sync`` and ``gthread`` (4 threads), both MCP wires, ``tools/call echo``: shipped against the
  same server with tracking and disconnect watching switched off by this script's wrapper app
  (``McpServer.watch_disconnects = False``, a ``Cancellation.begin`` returning a handle that
  writes nothing and, on the 2025 wire, no ``session_calls`` row per call), loaded in turn for
  ``--seconds`` each, alternating which goes first, by ``wrk`` when installed, else an asyncio
  load generator (``tools/_benchlib.py``) whose clients reconnect every ``--per-conn``
  requests: with keep-alive for a whole round, which ``gthread``
  worker holds which connection is left to chance (two of four workers often serve all 16), and
  an identical server's throughput moves by ±20 % from round to round.

Every micro figure is a median over rounds; in each round the floor (one ``struct.unpack_from``
of a 16-byte slot of a posix_ipc mapping) runs right before the measure and the ratio is taken
to that floor batch, so a slow stretch of this shared machine slows both alike. p99s come from
timing single operations (the timer and a call included: compare with the floor's own p99).
End to end, the ratio is shipped / off per round (req/s, and the workers' CPU time per request,
the steadier one on a shared machine). ``--plot`` needs matplotlib (``pip install -e
'.[bench]'``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.join(HERE, "..", "tests"))  # helpers.redis_server

from _bench_backends import (  # noqa: E402
    PIP_BENCH,
    Backend,
    Floor,
    ManagerBackend,
    Measure,
    RedisBackend,
    Result,
    ShmBackend,
    SqliteBackend,
    aggregate_pairs,
    interleaved,
    med,
    other_writers,
    pct,
    write_measures,
)
from _benchlib import GunicornServer, echo_request, load, wrk_load  # noqa: E402

from shmcancel import Config, Registry  # noqa: E402

SECTIONS = ("poll", "write", "scaling", "footprint", "e2e")
OTHER_WRITERS = 4
FILL_POLL = 5_000
FILL_FOOTPRINT = 10_000


# ------------------------------------------------------------------ the report


class Report:
    def __init__(self) -> None:
        self.targets: list[tuple[str, str, bool | None]] = []
        self.plots: dict[str, Any] = {"poll": {}, "write": {}, "scaling": {}, "e2e": {}}

    def target(self, what: str, got: str, ok: bool | None) -> str:
        self.targets.append((what, got, ok))
        return "" if ok is None else ("met" if ok else "MISSED")


def _table(rows: Sequence[tuple[str, Result, Result | None, str]]) -> None:
    print(f"  {'':38} {'median':>9} {'x floor':>8} {'p99':>9} | {'with 4 writers':>14}"
          f" {'x floor':>8} {'p99':>9}")
    for label, a, w, verdict in rows:
        busy = (f"{fmt_ns(w.ns):>14} {w.ratio:7.2f}x {fmt_ns(w.p99):>9}" if w is not None
                else f"{'':>14} {'':>8} {'':>9}")
        print(f"  {label:38} {fmt_ns(a.ns):>9} {a.ratio:7.2f}x {fmt_ns(a.p99):>9} | {busy}"
              f"  {verdict}".rstrip())


def fmt_ns(ns: float) -> str:
    if ns != ns:  # nan
        return "-"
    if ns < 10_000:
        return f"{ns:.0f} ns"
    if ns < 10_000_000:
        return f"{ns / 1000:.1f} us"
    return f"{ns / 1e6:.1f} ms"


BUSY_SECONDS = 1.0  # the least time measured while the other writers write
POLL_TARGETS = {"shmcancel.cancelled(conn), handle": 2.5, "c.cancelled(conn), no handle": 4.0,
                "c.cancelled(id, scope)": 3.0, "c.in_flight(id, scope)": 5.0}


def _alone_and_busy(b: Backend, ms: list[Measure], floor: Floor, a: argparse.Namespace
                    ) -> tuple[dict[str, Result], dict[str, Result], str]:
    """``ms`` measured interleaved with the floor alone, then while OTHER_WRITERS processes
    write; the two result maps and a line saying how fast those writers went (``INVALID``
    when one of them wrote nothing, had writes fail or exited: the busy figures are then
    dropped (NaN), so their targets are MISSED)."""
    alone = interleaved(ms, floor.measure, a.rounds, a.per_op)
    with other_writers(b, OTHER_WRITERS) as rate:
        # long enough for every writer to be scheduled (5 processes on 2 cores: a phase of a
        # few ms could end before one of them ran, and read as a writer that wrote nothing)
        # and on, up to UNTIL_SECONDS, until each writer has written: a lock that is not
        # fair (sqlite's busy handler sleeps and retries) can starve one for a second
        busy = interleaved(ms, floor.measure, max(3, a.rounds // 2), a.per_op,
                           min_seconds=BUSY_SECONDS,
                           until=lambda: not any("wrote nothing" in t for t in rate()[2]))
        wrate, werr, trouble = rate()
    if werr:
        trouble.append(f"{werr} write rounds failed")
    line = f"    ({b.name} writers: {wrate:,.0f} write rounds/s in all, {werr} failed)"
    if trouble:
        line += "\n    writers: INVALID: " + "; ".join(trouble)
        for r in busy.values():  # no busy verdict from a run without its writers
            r.ratio = r.ns = float("nan")
    return alone, busy, line


def section_poll(backends: list[Backend], floor: Floor, a: argparse.Namespace,
                 rep: Report) -> None:
    print(f"\n== poll: is this id cancelled? (an in-flight, uncancelled request; {FILL_POLL} "
          f"other cancellation rows; medians of {a.rounds} rounds)")
    for b in backends:
        if b.skipped:
            print(f"  {b.name}: skipped: {b.skipped}")
            continue
        b.fill(FILL_POLL, "pollfill")
        cl = b.client()
        ms = b.polls(cl)
        alone, busy, writers = _alone_and_busy(b, ms, floor, a)
        if b is backends[0]:
            f = alone[floor.measure.label]
            print(f"  floor {fmt_ns(f.ns)} (per-op timed p50 {fmt_ns(f.p50)}, p99 "
                  f"{fmt_ns(f.p99)}: the timer's share of every p99 below)")
        rows = []
        for m in ms:
            verdict = ""
            t = POLL_TARGETS.get(m.label)
            if t is not None:
                r1, r2 = alone[m.label].ratio, busy[m.label].ratio
                verdict = f"<= {t}x " + rep.target(
                    f"poll {m.label} <= {t}x floor, alone and with 4 writers",
                    f"{r1:.2f}x / {r2:.2f}x", r1 <= t and r2 <= t)
            rows.append((m.label, alone[m.label], busy[m.label], verdict))
            rep.plots["poll"][m.label] = alone[m.label].samples
        _table(rows)
        print(writers)
        if b.name != "shmcancel":
            b.close_client(cl)
        rep.plots["poll"].setdefault("floor", alone[floor.measure.label].samples)


def section_write(backends: list[Backend], floor: Floor, a: argparse.Namespace,
                  rep: Report) -> None:
    print(f"\n== write: mark in flight + unmark, cancel, clear (medians of {a.rounds} rounds)")
    first = True
    for b in backends:
        if b.skipped:
            print(f"  {b.name}: skipped: {b.skipped}")
            continue
        cl = b.client()
        ms = write_measures(b, cl)
        alone, busy, writers = _alone_and_busy(b, ms, floor, a)
        if first:
            print(f"  floor {fmt_ns(alone[floor.measure.label].ns)}")
            first = False
        rows = []
        for m in ms:
            verdict = ""
            x = alone[m.label].ns
            # busy against alone: each a median of per-batch ratios to the floor batch run just
            # before it (the two phases run one after the other: their ns alone would compare
            # two stretches of a noisy machine)
            q = busy[m.label].ratio / alone[m.label].ratio
            if b.name == "shmcancel" and not m.label.endswith("clear"):
                op = m.label.split(": ")[1]  # "begin + end" in an empty scope, and with a row
                v1 = rep.target(f"write {op} <= 5 us single-process", fmt_ns(x), x <= 5000)
                v2 = rep.target(f"write {op} with 4 other writers <= 4x alone (x floor)",
                                f"{q:.2f}x", q <= 4)
                verdict = f"<= 5 us {v1}; busy <= 4x {v2}"
            rows.append((m.label, alone[m.label], busy[m.label], verdict))
            rep.plots["write"][m.label] = alone[m.label].samples
        _table(rows)
        print(writers)
        if b.name != "shmcancel":
            b.close_client(cl)


def section_scaling(backends: list[Backend], a: argparse.Namespace, rep: Report) -> None:
    print(f"\n== scaling: mark + unmark pairs/s, all at once (medians of {a.scale_rounds} "
          f"rounds of {a.scale_seconds:g}s, configurations interleaved; {os.cpu_count()} cores)")
    print(f"  {'':24} {'1 proc':>10} {'2 procs':>10} {'4 procs':>10} {'4 threads':>10}"
          f" | {'2p/1':>5} {'4p/1':>5} {'4t/1':>5}")
    configs = [(1, 1), (2, 1), (4, 1), (1, 4)]
    for b in backends:
        if b.skipped:
            print(f"  {b.name}: skipped: {b.skipped}")
            continue
        got: dict[tuple[int, int], list[float]] = {c: [] for c in configs}
        ratios: dict[tuple[int, int], list[float]] = {c: [] for c in configs}
        for r in range(a.scale_rounds):
            now = {}
            for cfg in (configs if r % 2 == 0 else configs[::-1]):
                now[cfg] = aggregate_pairs(b, cfg[0], cfg[1], a.scale_seconds)
                got[cfg].append(now[cfg])
            for cfg in configs:
                ratios[cfg].append(now[cfg] / now[1, 1] if now[1, 1] else float("nan"))
        m = {c: med(v) for c, v in got.items()}
        q = {c: med(v) for c, v in ratios.items()}
        verdict = ""
        if b.name == "shmcancel":
            verdict = "4 threads >= 0.8x: " + rep.target(
                "4 threads of one process >= 0.8x one thread's begin+end throughput",
                f"{q[1, 4]:.2f}x", q[1, 4] >= 0.8)
        print(f"  {b.name:24} {m[1, 1]:10,.0f} {m[2, 1]:10,.0f} {m[4, 1]:10,.0f} "
              f"{m[1, 4]:10,.0f} | {q[2, 1]:5.2f} {q[4, 1]:5.2f} {q[1, 4]:5.2f}  {verdict}")
        rep.plots["scaling"][b.name] = {1: q[1, 1], 2: q[2, 1], 4: q[4, 1], "4t": q[1, 4]}


def _rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


_RSS_CODE = """import sys
{imp}
rss = next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmRSS:'))
print(rss, int('ssl' in sys.modules), int('shmcancel.mcp.server' in sys.modules))"""


def _import_rss(imp: str, runs: int) -> tuple[float, bool, bool]:
    """Median RSS (KiB) of a fresh interpreter after ``imp``; whether ``ssl`` / the server
    were loaded."""
    rss, ssl, server = [], False, False
    for _ in range(runs):
        out = subprocess.run([sys.executable, "-c", _RSS_CODE.format(imp=imp)],
                             capture_output=True, text=True, timeout=60, check=True).stdout
        k, s, v = (int(x) for x in out.split())
        rss.append(k)
        ssl, server = ssl or bool(s), server or bool(v)
    return med([float(x) for x in rss]), ssl, server


def section_footprint(backends: list[Backend], a: argparse.Namespace, rep: Report) -> None:
    print("\n== footprint")
    sizes, alloc = {}, {}
    for label, cfg in (("Config()", Config()), ("Config(max_rows=100)", Config(max_rows=100))):
        name = f"bench-fp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        reg = Registry.create(name, cfg)
        try:
            st = os.stat(f"/dev/shm/shmcancel.{name}")
            sizes[label], alloc[label] = st.st_size, st.st_blocks * 512
        finally:
            reg.close()
            reg.unlink()
    d, s = alloc["Config()"], alloc["Config(max_rows=100)"]
    v1 = rep.target("default segment <= 8 MiB (allocated)", f"{d / 2**20:.1f} MiB",
                    d <= 8 * 2**20)
    v2 = rep.target("the segment follows max_rows down (max_rows=100 < default)",
                    f"{s / 2**20:.2f} MiB",
                    s < d and sizes["Config(max_rows=100)"] < sizes["Config()"])
    for label, v in (("Config()", f"<= 8 MiB {v1}"), ("Config(max_rows=100)", f"< default {v2}")):
        print(f"  shmcancel segment, {label + ':':22} {alloc[label]:>12,} B "
              f"({alloc[label] / 2**20:.2f} MiB) allocated at create, a file of "
              f"{sizes[label] / 2**20:.2f} MiB  {v}")
    print("  (the file has a worst-case record for every cancellation and in-flight row, so the "
          "contract's counts hold for rows of any size; their pages are allocated as rows need "
          "them: docs/design.md)")
    runs = a.rss_runs
    bare, _, _ = _import_rss("", runs)
    print(f"  RSS of a fresh process (median of {runs}): python bare {bare / 1024:.1f} MiB;"
          f" after importing only:")
    imports = [("shmcancel", "import shmcancel"), ("redis GET flag", "import redis"),
               ("Manager dict", "import multiprocessing.managers"),
               ("sqlite WAL", "import sqlite3")]
    for label, imp in imports:
        b = next((x for x in backends if x.name == label), None)
        if b is not None and b.skipped and label == "redis GET flag" \
                and b.skipped.startswith("no redis-py"):
            print(f"    {label:22} skipped: {b.skipped}")
            continue
        k, ssl, server = _import_rss(imp, runs)
        extra = ""
        if label == "shmcancel":
            v = rep.target("import shmcancel loads neither the server nor ssl",
                           f"server {'loaded' if server else 'not loaded'}, ssl "
                           f"{'loaded' if ssl else 'not loaded'}", not ssl and not server)
            extra = (f"  server {'loaded' if server else 'not loaded'}, ssl "
                     f"{'loaded' if ssl else 'not loaded'}: {v}")
        print(f"    {label:22} {k / 1024:6.1f} MiB (+{(k - bare) / 1024:.1f}){extra}")
    print(f"  holding {FILL_FOOTPRINT:,} cancellation rows (the default max_rows):")
    for b in backends:
        if b.skipped:
            print(f"    {b.name:22} skipped: {b.skipped}")
            continue
        pid = b.server_pid()
        before = _rss_kib(pid) if pid else None
        b.fill(FILL_FOOTPRINT, "fp")
        if b.name == "shmcancel":
            print(f"    {b.name:22} segment {b.storage_bytes() or 0:>12,} B (allocated; "
                  f"no server)")
        elif pid is not None:
            after = _rss_kib(pid)
            print(f"    {b.name:22} server RSS {(after or 0) / 1024:6.1f} MiB (before the rows"
                  f" {(before or 0) / 1024:.1f})")
        else:
            print(f"    {b.name:22} files {b.storage_bytes() or 0:>12,} B (db + wal + shm;"
                  f" no server)")


# ------------------------------------------------------------------ end to end

_APP = '''\
"""tools/bench.py's app: the example as shipped (BENCH_MODE=shipped), or with tracking and
disconnect watching switched off (BENCH_MODE=off) by this wrapper only."""
import os

import app as _example
import shmcancel


class _Untracked:
    """What the transport uses of a RequestHandle, writing nothing to the registry."""

    tracked = False
    error = None
    began = 0.0

    def __init__(self, request_id, scope):
        self.request_id, self.scope = request_id, scope
        self._local, self._reason = False, None

    def cancelled(self):
        return self._local

    def cancel_local(self, reason=None):
        self._local, self._reason = True, reason

    def reason(self):
        return self._reason

    def end(self):
        pass


if os.environ["BENCH_MODE"] == "off":
    _example.server.watch_disconnects = False
    shmcancel.Cancellation.begin = lambda self, request_id, scope: _Untracked(request_id, scope)
    # nor the 2025 wire's session-call row (as tools/bench_watch.py --untracked): sessions are
    # still minted, checked and touched
    from shmcancel.mcp.sessions import Call, SessionStore

    SessionStore.begin_call = lambda self, session: Call(session.id, None)
app = _example.app
'''


def _check_answers(port: int, req: bytes) -> bool:
    ok, bad, _ = asyncio.run(load(port, req, 5.0, 1, 1))
    return ok == 1 and bad == 0


def section_e2e(a: argparse.Namespace, rep: Report) -> None:
    wrk = shutil.which("wrk") if a.load != "python" else None
    if a.load == "wrk" and wrk is None:
        raise SystemExit("bench: --load wrk but wrk is not installed (Debian: apt-get install "
                         "wrk)")
    gen = (f"wrk ({wrk}, 2 threads)" if wrk else "the asyncio load generator"
           + (f", each client reconnecting after {a.per_conn} requests" if a.per_conn else ""))
    print(f"\n== e2e: tools/call echo, example app, 4 workers, {a.conns} connections, "
          f"{gen}; medians of {a.e2e_rounds} interleaved rounds of {a.seconds:g}s")
    if not (Path(sys.executable).parent / "gunicorn").exists():
        print(f"  skipped: no gunicorn ({PIP_BENCH})")
        return
    print(f"  {'':16} {'req/s shipped':>13} {'off':>7} {'ratio':>6} | {'p50 shipped':>11}"
          f" {'off':>8} | {'p99 shipped':>11} {'off':>8} | {'CPU/req ratio':>13}")
    with tempfile.TemporaryDirectory(prefix="shmcancel-bench-") as tmp:
        Path(tmp, "shmcancel_bench_app.py").write_text(_APP)
        for kind in a.kinds:
            servers: list[GunicornServer] = []
            try:
                for mode in ("shipped", "off"):
                    servers.append(GunicornServer(tmp, kind, "shmcancel_bench_app:app",
                                                  {"BENCH_MODE": mode}, f"{kind}-{mode}",
                                                  registry_prefix="bench-e2e"))
                for wire in a.wires:
                    _e2e_pair(servers[0], servers[1], kind, wire, wrk, tmp, a, rep)
            finally:
                for s in servers:
                    s.close()


def _e2e_pair(on: GunicornServer, off: GunicornServer, kind: str, wire: str,
              wrk: str | None, tmp: str, a: argparse.Namespace, rep: Report) -> None:
    reqs = {on: echo_request(on.port, wire), off: echo_request(off.port, wire)}
    for s in (on, off):
        if not _check_answers(s.port, reqs[s]):
            raise SystemExit(f"bench: the {kind} server does not answer echo; see {s.log}")
        asyncio.run(load(s.port, reqs[s], 0.5, a.conns, 100_000))  # warm up every worker
    rate: dict[bool, list[float]] = {True: [], False: []}
    p50: dict[bool, list[float]] = {True: [], False: []}
    p99: dict[bool, list[float]] = {True: [], False: []}
    ratio: list[float] = []
    cpu_ratio: list[float] = []
    # for --plot: every request's latency (the Python generator), or wrk's percentiles
    lat_all: dict[bool, list[float]] = {True: [], False: []}
    wrk_pct: dict[bool, dict[int, list[float]]] = {True: {}, False: {}}
    bad = 0
    for r in range(a.e2e_rounds):
        got: dict[bool, float] = {}
        cpu: dict[bool, float] = {}
        for s in ((on, off) if r % 2 == 0 else (off, on)):
            c0 = s.worker_cpu()
            if wrk:
                w = wrk_load(wrk, s.port, reqs[s], a.seconds, a.conns, tmp)
                n, dt = int(w["requests"]), w["elapsed"]
                bad += int(w["bad"])
                q50, q99 = w["p50"], w["p99"]
                for k in (50, 75, 90, 99):
                    wrk_pct[s is on].setdefault(k, []).append(w[f"p{k}"])
            else:
                lat: list[float] = []
                n, b_, dt = asyncio.run(load(s.port, reqs[s], a.seconds, a.conns, 10**7, lat,
                                             per_conn=a.per_conn or None))
                bad += b_
                q50, q99 = med(lat), pct(lat, 99)
                lat_all[s is on].extend(lat)
            got[s is on] = n / dt
            cpu[s is on] = (s.worker_cpu() - c0) / max(n, 1)
            p50[s is on].append(q50)
            p99[s is on].append(q99)
        for k in (True, False):
            rate[k].append(got[k])
        ratio.append(got[True] / got[False] if got[False] else float("nan"))
        cpu_ratio.append(cpu[True] / cpu[False] if cpu[False] else float("nan"))
    q = med(ratio)
    v = rep.target(f"e2e {kind} {wire}: shipped >= 90% of off (req/s)", f"{q:.2f}", q >= 0.9)
    print(f"  {kind + ' ' + wire:16} {med(rate[True]):13,.0f} {med(rate[False]):7,.0f} "
          f"{q:6.2f} | {med(p50[True]) * 1e3:8.2f} ms {med(p50[False]) * 1e3:5.2f} ms | "
          f"{med(p99[True]) * 1e3:8.2f} ms {med(p99[False]) * 1e3:5.2f} ms | "
          f"{med(cpu_ratio):13.2f}  >= 0.90 {v}" + (f"  ({bad} other outcomes)" if bad else ""))
    rep.plots["e2e"][f"{kind} {wire}"] = {
        k: ([(med(v), p / 100) for p, v in wrk_pct[k].items()] if wrk else _cdf(lat_all[k]))
        for k in (True, False)}


# ------------------------------------------------------------------ plot


def _cdf(xs: list[float]) -> list[tuple[float, float]]:
    s = sorted(xs)
    return [(x, (i + 1) / len(s)) for i, x in enumerate(s)]


def _line_style(label: str) -> dict[str, Any]:
    """The floor black and dotted; each alternative a dash pattern of its own."""
    if label == "floor":
        return {"color": "black", "linestyle": (0, (1, 1))}
    for prefix, dash in (("redis", "--"), ("Manager", "-."), ("sqlite", ":")):
        if label.startswith(prefix):
            return {"linestyle": dash}
    return {"linestyle": "-"}


def plot(path: str, rep: Report) -> None:
    """Four panels: per-op latency CDFs of the polls and of the writes (shmcancel and the
    alternatives), the scaling curves, and the end-to-end request latency (shipped solid, off
    dashed; wrk gives only its percentiles, drawn as points)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(14, 10))

    def empty(ax: Any, title: str) -> None:
        ax.set_title(title)
        ax.text(0.5, 0.5, "not run (--only)", ha="center", va="center", transform=ax.transAxes)

    for ax, key, title in ((axes[0][0], "poll", "poll: per-op latency CDF"),
                           (axes[0][1], "write", "write: per-op latency CDF")):
        if not rep.plots[key]:
            empty(ax, title)
            continue
        for label, xs in rep.plots[key].items():
            pts = _cdf(xs)
            ax.plot([x for x, _ in pts], [y for _, y in pts], label=label, **_line_style(label))
        ax.set_xscale("log")
        ax.set_xlabel("ns per operation (timed one by one, timer included)")
        ax.set_ylabel("fraction of operations")
        ax.set_title(title)
        ax.legend(fontsize=7)
    ax = axes[1][0]
    if not rep.plots["scaling"]:
        empty(ax, "scaling")
    for name, q in rep.plots["scaling"].items():
        (line,) = ax.plot([1, 2, 4], [q[1], q[2], q[4]], marker="o", label=f"{name}: processes")
        ax.plot([4], [q["4t"]], marker="x", markersize=10, linestyle="none",
                color=line.get_color(), label=f"{name}: 4 threads of 1 process")
    if rep.plots["scaling"]:
        ax.set_xticks([1, 2, 4])
        ax.set_xlabel("writers at once")
        ax.set_ylabel("aggregate mark+unmark pairs/s, / 1 process")
        ax.set_title("scaling")
        ax.legend(fontsize=7)
    ax = axes[1][1]
    if not rep.plots["e2e"]:
        empty(ax, "e2e: request latency")
    for name, lat in rep.plots["e2e"].items():
        color = None
        for shipped, style in ((True, "-"), (False, "--")):
            pts = lat[shipped]
            kw: dict[str, Any] = {"marker": "o"} if len(pts) <= 4 else {}
            (line,) = ax.plot([x * 1e3 for x, _ in pts], [y for _, y in pts], style,
                              color=color, label=f"{name} {'shipped' if shipped else 'off'}",
                              **kw)
            color = line.get_color()
    if rep.plots["e2e"]:
        ax.set_xscale("log")
        ax.set_xlabel("ms per request")
        ax.set_ylabel("fraction of requests")
        ax.set_title("e2e: request latency CDF (solid: shipped, dashed: off)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"\nplot written to {path}")


# ------------------------------------------------------------------ main


def _header(a: argparse.Namespace) -> None:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, timeout=10,
                             capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        rev = "?"
    print(f"shmcancel bench ({'quick' if a.quick else 'full'}): {rev or '?'}, "
          f"CPython {platform.python_version()}, {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.2f}, {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}")
    from shmcancel.shm import writer
    c_part = getattr(writer, "_add_small", None)  # absent before the C part existed
    print("  a new row's write, a key's removal and the index hash: "
          + ("C (shmcancel.shm._cwrite)" if c_part else
             "Python (the C part is not built, or SHMCANCEL_PURE_PYTHON)"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a short run (CI smoke)")
    ap.add_argument("--only", default=",".join(SECTIONS),
                    help=f"comma-separated sections of {','.join(SECTIONS)}")
    ap.add_argument("--plot", metavar="OUT.png", help="draw the distributions (matplotlib)")
    ap.add_argument("--load", choices=["auto", "python", "wrk"], default="auto",
                    help="e2e load generator (auto: wrk when installed)")
    ap.add_argument("--seconds", type=float, help="e2e: seconds per load (default 3, quick 1)")
    ap.add_argument("--conns", type=int, default=16, help="e2e: concurrent connections")
    ap.add_argument("--per-conn", type=int, default=20, metavar="N",
                    help="e2e, asyncio generator: a client reconnects after N requests "
                         "(0: keep-alive for the whole round)")
    ap.add_argument("--wire", choices=["legacy", "modern", "both"], default="both")
    ap.add_argument("--kind", choices=["sync", "gthread", "both"], default="both",
                    help="e2e: gunicorn worker classes")
    ap.add_argument("--e2e-rounds", type=int, help="e2e: interleaved rounds (default 3, quick 1)")
    a = ap.parse_args(argv)
    only = [s.strip() for s in a.only.split(",") if s.strip()]
    bad = [s for s in only if s not in SECTIONS]
    if bad or not only:
        ap.error(f"--only takes sections of {','.join(SECTIONS)}; got {a.only!r}")
    if (a.seconds is not None and not 0 < a.seconds <= 600) or not 1 <= a.conns <= 1000 \
            or (a.e2e_rounds is not None and not 1 <= a.e2e_rounds <= 50):
        ap.error("--seconds in (0, 600], --conns 1..1000, --e2e-rounds 1..50")
    if a.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print(f"bench: --plot needs matplotlib: {sys.executable} -m {PIP_BENCH}",
                  file=sys.stderr)
            return 2
    q = a.quick
    a.rounds, a.per_op = (4, 5) if q else (60, 20)
    a.scale_rounds, a.scale_seconds = (1, 0.3) if q else (3, 1.0)
    a.rss_runs = 1 if q else 3
    a.e2e_rounds = a.e2e_rounds or (1 if q else 3)
    a.kinds = ["sync", "gthread"] if a.kind == "both" else [a.kind]
    a.seconds = a.seconds or (1.0 if q else 3.0)
    a.wires = ["legacy", "modern"] if a.wire == "both" else [a.wire]
    _header(a)
    rep = Report()
    try:
        needs_backends = any(s in only for s in ("poll", "write", "scaling", "footprint"))
        with contextlib.ExitStack() as stack:
            backends: list[Backend] = []
            floor = Floor()
            stack.callback(floor.close)
            if needs_backends:
                for cls in (ShmBackend, RedisBackend, ManagerBackend, SqliteBackend):
                    b = cls()
                    stack.callback(b.close)
                    backends.append(b)
            for sec in SECTIONS:
                if sec not in only:
                    continue
                if sec == "poll":
                    section_poll(backends, floor, a, rep)
                elif sec == "write":
                    section_write(backends, floor, a, rep)
                elif sec == "scaling":
                    section_scaling(backends, a, rep)
                elif sec == "footprint":
                    section_footprint(backends, a, rep)
                else:
                    section_e2e(a, rep)
    except KeyboardInterrupt:
        print("\nbench: interrupted; everything it started was stopped", file=sys.stderr)
        return 130
    print("\n== targets (issue #9)")
    for what, got, ok in rep.targets:
        print(f"  {'met   ' if ok else 'MISSED'} {what}: {got}")
    print("  (not measured here: sweeps, tools/bench_sweeps.py; burst cancel latency, "
          "tools/bench_burst.py)")
    if a.plot:
        plot(a.plot, rep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
