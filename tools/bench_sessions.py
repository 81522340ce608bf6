#!/usr/bin/env python3
"""Benchmark of session minting, and of a bystander's latency during a session flood.

    python tools/bench_sessions.py [--baseline REV] [--batches 15] [--http] [--seconds 25]

Store (one process, default ``Config``: 4096 sessions, 32 per client), median ns/op over
``--batches`` batches, as ratios against the floor of ``tools/bench_table.py`` (one
``struct.unpack_from`` of a shared-memory slot): every batch runs right after a floor batch and
the ratio is the median of the per-batch ratios; and against the mint into an empty table (the
ratio of the two floor ratios):

- ``mint, empty table``: a new client's first session;
- ``mint, full table, own bound``: a client holding its 32 in a table full of others' sessions
  (each mint replaces its own least recently seen);
- ``mint refused, full of others``: a new client, nothing of its own to give up (``SessionsFull``);
- with ``--baseline REV``: the ``SessionStore`` of git revision ``REV`` (e.g. the commit before
  the per-client bound) minting into an empty and into a full table, in its own registry.

``--http``: a real gunicorn (the example app, 2 ``sync`` workers, loopback). A bystander at
127.0.0.1 holds two sessions: it calls ``echo`` in a loop in one, alone, then while two connections
from 127.0.0.2 loop ``initialize`` for ``--seconds``; the other stays idle until the end. Prints
the bystander's p50/p90 alone and once the flood has minted a table's worth, its 404s, the idle
session's status afterwards, and the mints. ``--src DIR`` serves another checkout's ``src`` (e.g.
``git archive REV src | tar -x -C /tmp/base`` then ``--src /tmp/base/src``) for a before/after.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_table import _floor_measures, _segment

from shmcancel import Config, Registry
from shmcancel.mcp.sessions import SessionsFull, SessionStore

ROOT = Path(__file__).resolve().parent.parent
_NOW = time.perf_counter_ns


def _name() -> str:
    return f"bench-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def _load_store(rev: str) -> Any:
    """The ``SessionStore`` class of ``src/shmcancel/mcp/sessions.py`` at git revision ``rev``
    (``src/shmcancel/sessions.py`` before the layer packages)."""
    package = "shmcancel.mcp"
    shown = subprocess.run(["git", "show", f"{rev}:src/shmcancel/mcp/sessions.py"], cwd=ROOT,
                           capture_output=True, text=True)
    if shown.returncode != 0:
        package = "shmcancel"
        shown = subprocess.run(["git", "show", f"{rev}:src/shmcancel/sessions.py"], cwd=ROOT,
                               capture_output=True, text=True)
        # its relative imports name the flat modules of that time
        for old, new in (("procinfo", "shm.procinfo"), ("wire", "mcp.wire")):
            sys.modules.setdefault(f"shmcancel.{old}", importlib.import_module(f"shmcancel.{new}"))
    shown.check_returncode()
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(shown.stdout)
    try:
        spec = importlib.util.spec_from_file_location(f"{package}._bench_base_sessions", f.name)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # dataclasses look their module up
        spec.loader.exec_module(mod)
    finally:
        os.unlink(f.name)
    return mod.SessionStore


_FLOOR: list[tuple[Callable[[], int], int]] = []  # (batch, ops): set by bench_store
_FLOORS: list[float] = []  # every floor batch's ns/op


def _median_ns(fn: Callable[[], int], ops: int, batches: int) -> tuple[float, float]:
    """(median ns/op, median of the per-batch ratios to a floor batch run just before)."""
    ffn, fops = _FLOOR[0]
    ns, ratio = [], []
    for _ in range(batches):
        f = ffn() / fops
        m = fn() / ops
        _FLOORS.append(f)
        ns.append(m)
        ratio.append(m / f)
    return statistics.median(ns), statistics.median(ratio)


def bench_store(batches: int, baseline: str | None) -> None:
    with _segment(1 << 16) as (_, mm):
        _FLOOR[:] = [_floor_measures(mm, 500)["raw read (struct)"]]
        try:
            _bench_store(batches, baseline)
        finally:
            _FLOOR.clear()


def _bench_store(batches: int, baseline: str | None) -> None:
    cfg = Config()
    per, cap = int(cfg.sessions_per_client), cfg.session_capacity  # type: ignore[arg-type]
    res: dict[str, tuple[float, float]] = {}
    reg = Registry.create(_name(), cfg)
    try:
        store = SessionStore(reg)
        store._next_sweep = float("inf")  # measure mints, not the amortised sweep
        batch = 50
        fresh = iter(range(10**9))

        def empty() -> int:
            t0 = _NOW()
            made = [store.create("2025-11-25", f"ip:10.0.{next(fresh)}") for _ in range(batch)]
            dt = _NOW() - t0
            for s in made:
                store.delete(s.id)
            return dt

        res["mint, empty table"] = _median_ns(empty, batch, batches)
        for i in range(cap // per):  # full: 128 clients x 32
            for _ in range(per):
                store.create("2025-11-25", f"ip:10.1.{i}")
        assert store.count() == cap

        def own() -> int:
            t0 = _NOW()
            for _ in range(batch):
                store.create("2025-11-25", "ip:10.1.0")
            return _NOW() - t0

        def refused() -> int:
            t0 = _NOW()
            for _ in range(batch):
                with contextlib.suppress(SessionsFull):
                    store.create("2025-11-25", "ip:192.0.2.1")
            return _NOW() - t0

        res["mint, full table, own bound"] = _median_ns(own, batch, batches)
        res["mint refused, full of others"] = _median_ns(refused, batch, batches)
    finally:
        reg.unlink()
        reg.close()
    if baseline:
        old_cls = _load_store(baseline)
        reg = Registry.create(_name(), cfg)
        try:
            old = old_cls(reg)

            def old_empty() -> int:
                t0 = _NOW()
                made = [old.create("2025-11-25") for _ in range(batch)]
                dt = _NOW() - t0
                for s in made:
                    old.delete(s.id)
                return dt

            res[f"[{baseline}] mint, empty table"] = _median_ns(old_empty, batch, batches)
            for _ in range(cap):
                old.create("2025-11-25")

            def old_full() -> int:
                t0 = _NOW()
                for _ in range(5):
                    old.create("2025-11-25")
                return _NOW() - t0

            res[f"[{baseline}] mint, full table"] = _median_ns(old_full, 5, max(3, batches // 3))
        finally:
            reg.unlink()
            reg.close()
    base = res["mint, empty table"][1]
    print(f"floor (struct read of a shared slot): {statistics.median(_FLOORS):.0f} ns, "
          f"interleaved batch by batch; sessions {cap}, per client {per}")
    print(f"{'operation':44} {'us/op':>10} {'x floor':>10} {'x empty mint':>13}")
    for k, (v, r) in res.items():
        print(f"{k:44} {v / 1000:10.1f} {r:10.0f} {r / base:13.2f}")


# ------------------------------------------------------------------------------ HTTP


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(http: Any, url: str, obj: dict[str, Any], sid: str | None = None) -> Any:
    h = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
    if obj.get("method") != "initialize":
        h["MCP-Protocol-Version"] = "2025-11-25"
    if sid:
        h["Mcp-Session-Id"] = sid
    return http.post(url, content=json.dumps(obj).encode(), headers=h)


INIT = {"jsonrpc": "2.0", "id": 0, "method": "initialize",
        "params": {"protocolVersion": "2025-11-25", "capabilities": {},
                   "clientInfo": {"name": "bench", "version": "1"}}}


def bench_http(seconds: float, src: str | None) -> None:
    import httpx

    capacity = Config().session_capacity  # the example's config keeps the default

    port = _free_port()
    name = _name()
    env = {**os.environ, "SHMCANCEL_REGISTRY": name}
    if src:
        env["PYTHONPATH"] = os.path.abspath(src)
    gunicorn = Path(sys.executable).parent / "gunicorn"
    fd, log_path = tempfile.mkstemp(prefix="bench-sessions-", suffix=".log")
    proc = subprocess.Popen([str(gunicorn), "-c", str(ROOT / "examples/gunicorn/gunicorn.conf.py"),
                             "-b", f"127.0.0.1:{port}", "-w", "2"], env=env, cwd=ROOT,
                            stdout=fd, stderr=subprocess.STDOUT)
    os.close(fd)
    url = f"http://127.0.0.1:{port}/mcp"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise SystemExit(f"gunicorn did not start; see {log_path}") from None
                time.sleep(0.05)
        bystander = httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.1"),
                                 timeout=30)
        sid = _post(bystander, url, INIT).headers["mcp-session-id"]
        idle_sid = _post(bystander, url, INIT).headers["mcp-session-id"]  # unused until the end

        def echo() -> tuple[float, int]:
            t0 = time.perf_counter()
            r = _post(bystander, url, {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                                       "params": {"name": "echo", "arguments": {"text": "x"}}},
                      sid)
            return time.perf_counter() - t0, r.status_code

        for _ in range(20):
            echo()
        alone = [echo()[0] for _ in range(200)]
        stop = threading.Event()
        mints: list[int] = []
        full_at: list[float] = []  # when the flood had minted a table's worth

        def flood() -> None:
            with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"),
                              timeout=30) as h:
                while not stop.is_set():
                    mints.append(_post(h, url, INIT).status_code)
                    if len(mints) >= capacity and not full_at:
                        full_at.append(time.monotonic() - t_start)

        threads = [threading.Thread(target=flood, daemon=True) for _ in range(2)]
        t_start = time.monotonic()
        for t in threads:
            t.start()
        during: list[tuple[float, float, int]] = []
        while time.monotonic() - t_start < seconds:
            dt, status = echo()
            during.append((time.monotonic() - t_start, dt, status))
        stop.set()
        for t in threads:
            t.join(30)
        elapsed = time.monotonic() - t_start
        full = full_at[0] if full_at else seconds
        late = [d for at, d, s in during if at > full and s == 200]
        lost = sum(1 for _, _, s in during if s == 404)
        r = _post(bystander, url, {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                                   "params": {"name": "echo", "arguments": {"text": "x"}}},
                  idle_sid)
        p = statistics.quantiles
        print(f"shmcancel from {src or 'this checkout'}: {len(mints)} initialize in "
              f"{elapsed:.1f}s ({len(mints) / elapsed:.0f}/s; {mints.count(200)} x 200, "
              f"{sum(1 for m in mints if m == 503)} x 503)")
        print(f"bystander echo alone:              p50 {statistics.median(alone) * 1e3:6.2f} ms"
              f"  p90 {p(alone, n=10)[-1] * 1e3:6.2f} ms")
        print(f"the flood had minted {capacity} sessions (a table's worth) after "
              f"{full:.1f}s" if full_at else f"the flood never minted {capacity} sessions")
        if late and full_at:  # without a full table there is no "after"
            print(f"bystander echo after that:         p50 {statistics.median(late) * 1e3:6.2f} ms"
                  f"  p90 {p(late, n=10)[-1] * 1e3 if len(late) > 1 else late[0] * 1e3:6.2f} ms"
                  f"  ({statistics.median(late) / statistics.median(alone):.1f}x alone)")
        print(f"bystander calls during the flood: {len(during)}, answered 404 (session lost): "
              f"{lost}; its idle session afterwards: HTTP {r.status_code}")
        bystander.close()
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        os.unlink(log_path)
        if os.path.exists(f"/dev/shm/shmcancel.{name}"):  # gunicorn's on_exit did not run
            with contextlib.suppress(Exception):
                Registry.attach(name).unlink()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=15)
    ap.add_argument("--baseline", help="git revision whose SessionStore to measure too")
    ap.add_argument("--http", action="store_true", help="also the bystander-during-flood run")
    ap.add_argument("--seconds", type=float, default=25.0)
    ap.add_argument("--src", help="the src directory gunicorn serves (default: this checkout)")
    ap.add_argument("--no-store", action="store_true", help="skip the store figures")
    args = ap.parse_args(argv)
    if not args.no_store:
        bench_store(args.batches, args.baseline)
    if args.http:
        bench_http(args.seconds, args.src)
    return 0


if __name__ == "__main__":
    sys.exit(main())
