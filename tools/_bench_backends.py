"""The measuring parts of ``tools/bench.py``: the interleaved floor/measure rounds, the
backends compared (shmcancel and the alternatives a user would pick instead), and the writer
processes. Public API of shmcancel only (``Registry``, ``Config``, ``Cancellation``, the handle of
``Cancellation.begin``, ``shmcancel.cancelled``), so table or transport changes do not break it.

Every process started here is a ``fork`` child of the caller, stopped by its pid (joined by a
deadline, then SIGKILLed); every shared-memory name and file made here is removed by the
``close`` of what made it.
"""

from __future__ import annotations

import contextlib
import mmap
import multiprocessing as mp
import os
import shutil
import signal
import sqlite3
import statistics
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import posix_ipc

import shmcancel
from shmcancel import Cancellation, Config, Registry

PIP_BENCH = "pip install -e '.[bench]'"
_NOW = time.perf_counter_ns
_CTX = mp.get_context("fork")
SCOPE = "ip:198.51.100.7"  # the scope of the polled request
RID = 42  # its id
ME = 5  # the writer number of the measuring process's own writes (others: 1..4; scaling: 16+)
UNTIL_SECONDS = 10.0  # the longest interleaved() measures on, waiting for its `until`
WITH_A_ROW = 6  # the measuring process's scope holding another request's cancellation row


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(len(s) * p / 100))]


# ------------------------------------------------------------------ measuring


@dataclass
class Measure:
    """``batch(n)``: ns for ``n`` operations; ``one()``: ns of one operation, timed alone."""

    label: str
    batch: Callable[[int], int]
    one: Callable[[], int]
    n: int


@dataclass
class Result:
    ns: float  # median ns/op of the batches
    ratio: float  # median of per-round ratios to the floor batch run just before
    p50: float  # per-op timed
    p99: float
    samples: list[float] = field(default_factory=list)


class Floor:
    """One ``struct.unpack_from`` of a 16-byte slot of a posix_ipc mapping (64 KiB, unlinked on
    :meth:`close`)."""

    def __init__(self) -> None:
        # not under the registries' "shmcancel." prefix: shmtool would take it for one
        self.name = f"/shmcancel-bench-floor-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        shm = posix_ipc.SharedMemory(self.name, posix_ipc.O_CREX, 0o600, size=1 << 16)
        try:
            self.mm = mmap.mmap(shm.fd, 1 << 16)
        finally:
            shm.close_fd()
        unpack_from = struct.Struct("<QQ").unpack_from
        mm = self.mm

        def batch(n: int) -> int:
            offs = [4096] * n
            t0 = _NOW()
            for o in offs:
                unpack_from(mm, o)
            return _NOW() - t0

        def one() -> int:
            t0 = _NOW()
            unpack_from(mm, 4096)
            return _NOW() - t0

        self.measure = Measure("floor: struct.unpack_from of shm", batch, one, 500)

    def close(self) -> None:
        self.mm.close()
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory(self.name)


def interleaved(measures: list[Measure], floor: Measure, rounds: int,
                per_op: int, min_seconds: float = 0.0,
                until: Callable[[], bool] | None = None) -> dict[str, Result]:
    """Each round, for each measure: a floor batch, the measure's batch (their ratio), then
    ``per_op`` single operations of the measure timed one by one; at least ``rounds`` rounds,
    and more until ``min_seconds`` have passed (at most ``20 * rounds``); with ``until``, more
    again while it returns False, up to ``UNTIL_SECONDS`` in all. The floor is also reported
    (label of ``floor``), its ratio 1 by construction."""
    ns: dict[str, list[float]] = {m.label: [] for m in [floor, *measures]}
    ratio: dict[str, list[float]] = {m.label: [] for m in measures}
    ones: dict[str, list[float]] = {m.label: [] for m in [floor, *measures]}
    for m in [floor, *measures]:  # warm up
        m.batch(min(m.n, 20))
    t0 = time.monotonic()
    r = 0
    while True:
        took = time.monotonic() - t0
        if (r >= 20 * rounds or (r >= rounds and took >= min_seconds)) and (
                until is None or took >= UNTIL_SECONDS or until()):
            break
        order = measures if r % 2 == 0 else measures[::-1]
        for m in order:
            f = floor.batch(floor.n) / floor.n
            x = m.batch(m.n) / m.n
            ns[floor.label].append(f)
            ns[m.label].append(x)
            ratio[m.label].append(x / f if f > 0 else float("inf"))
            for _ in range(per_op):
                ones[m.label].append(m.one())
                ones[floor.label].append(floor.one())
        r += 1
    out = {floor.label: Result(med(ns[floor.label]), 1.0, med(ones[floor.label]),
                               pct(ones[floor.label], 99), ones[floor.label])}
    for m in measures:
        out[m.label] = Result(med(ns[m.label]), med(ratio[m.label]), med(ones[m.label]),
                              pct(ones[m.label], 99), ones[m.label])
    return out


# ------------------------------------------------------------------ backends


Loop = Callable[[Iterable[int]], None]  # one write operation over the ids given


class Backend:
    """One way to share "is this request cancelled?" between processes. ``client()`` is called
    once in each process (after a fork) and gives what the operations take; ``thread_client``
    what another thread of that process uses. Write operations of writer ``w`` stay in its own
    scope, so writers never collide on keys."""

    name = ""
    skipped: str | None = None  # why this backend is not run

    def client(self) -> Any:
        raise NotImplementedError

    def thread_client(self, cl: Any) -> Any:
        return cl

    def close_client(self, cl: Any) -> None:
        pass

    def fill(self, n: int, tag: str) -> None:
        """``n`` cancellation rows in 50 scopes named after ``tag``."""
        raise NotImplementedError

    def mark_in_flight(self, cl: Any, w: int, i: int) -> None:
        """Mark request ``i`` of writer ``w`` in flight (one row of its own)."""
        raise NotImplementedError

    def mark_unmark(self, cl: Any, w: int, i: int) -> None:
        raise NotImplementedError

    def cancel(self, cl: Any, w: int, i: int) -> None:
        raise NotImplementedError

    def clear(self, cl: Any, w: int, i: int) -> None:
        raise NotImplementedError

    def polls(self, cl: Any) -> list[Measure]:
        """The poll measures of request ``RID`` (marked in flight, not cancelled)."""
        raise NotImplementedError

    def server_pid(self) -> int | None:
        return None

    def storage_bytes(self) -> int | None:
        return None

    def close(self) -> None:
        pass

    def write_labels(self) -> tuple[str, str, str]:
        return ("mark + unmark in flight", "cancel", "clear")

    def write_loops(self, cl: Any, w: int) -> tuple[Loop, Loop, Loop]:
        """Mark + unmark, cancel and clear of writer ``w``, each a loop over the ids it is
        given. A backend whose operations take a few µs loops over its own API, as a caller
        would (a frame of adapter per operation is ~5 % of one of them); this default goes
        through the per-id methods above."""
        mu, cancel, clear = self.mark_unmark, self.cancel, self.clear

        def loop_mu(ids: Iterable[int]) -> None:
            for i in ids:
                mu(cl, w, i)

        def loop_cancel(ids: Iterable[int]) -> None:
            for i in ids:
                cancel(cl, w, i)

        def loop_clear(ids: Iterable[int]) -> None:
            for i in ids:
                clear(cl, w, i)

        return loop_mu, loop_cancel, loop_clear


def _scope(w: int) -> str:
    return f"ip:writer{w}" if w else SCOPE


def _generic_poll(label: str, fn: Callable[[], object], n: int) -> Measure:
    def batch(k: int) -> int:
        t0 = _NOW()
        for _ in range(k):
            fn()
        return _NOW() - t0

    def one() -> int:
        t0 = _NOW()
        fn()
        return _NOW() - t0

    return Measure(label, batch, one, n)


class ShmBackend(Backend):
    name = "shmcancel"

    def __init__(self) -> None:
        self.reg_name = f"bench-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.reg = Registry.create(self.reg_name, Config(janitor_interval=3600.0))
        self.c = Cancellation(self.reg)
        self.handles: dict[tuple[int, int], Any] = {}
        self.pid = os.getpid()

    def client(self) -> Any:
        """This process's ``Cancellation`` (shared by its threads, as under gthread); a forked
        child attaches the registry by name, as a gunicorn worker does."""
        if os.getpid() == self.pid:
            return self.c
        return Cancellation(Registry.attach(self.reg_name))

    def fill(self, n: int, tag: str) -> None:
        for i in range(n):
            self.c.cancel(i, "filler", f"ip:{tag}{i % 50}")

    def mark_in_flight(self, cl: Any, w: int, i: int) -> None:
        self.handles[w, i] = cl.begin(i, _scope(w))

    def mark_unmark(self, cl: Any, w: int, i: int) -> None:
        cl.begin(i, _scope(w)).end()

    def cancel(self, cl: Any, w: int, i: int) -> None:
        cl.cancel(i, "bench", _scope(w))

    def clear(self, cl: Any, w: int, i: int) -> None:
        cl.clear(i, _scope(w))

    def write_labels(self) -> tuple[str, str, str]:
        return ("begin + end", "cancel", "clear")

    def write_loops(self, cl: Any, w: int) -> tuple[Loop, Loop, Loop]:
        scope = _scope(w)
        begin, cancel, clear = cl.begin, cl.cancel, cl.clear

        def loop_mu(ids: Iterable[int]) -> None:
            for i in ids:
                begin(i, scope).end()

        def loop_cancel(ids: Iterable[int]) -> None:
            for i in ids:
                cancel(i, "bench", scope)

        def loop_clear(ids: Iterable[int]) -> None:
            for i in ids:
                clear(i, scope)

        return loop_mu, loop_cancel, loop_clear

    def polls(self, cl: Any) -> list[Measure]:
        c = cl
        handle = self.handles.get((0, RID)) or c.begin(RID, SCOPE)
        self.handles[0, RID] = handle
        conn = {"REMOTE_ADDR": SCOPE[3:], "shmcancel.request_id": RID,
                "shmcancel.handle": handle}
        bare = {"REMOTE_ADDR": SCOPE[3:], "shmcancel.request_id": RID,
                "shmcancel.cancellation": c}
        if shmcancel.cancelled(conn) or c.cancelled(bare) or not c.in_flight(RID, SCOPE):
            raise SystemExit("bench: shmcancel's request is not in the state measured")
        cancelled, cpoll, infl = shmcancel.cancelled, c.cancelled, c.in_flight
        n = 500

        def m_handle(k: int) -> int:
            xs = [conn] * k
            t0 = _NOW()
            for x in xs:
                cancelled(x)
            return _NOW() - t0

        def m_bare(k: int) -> int:
            xs = [bare] * k
            t0 = _NOW()
            for x in xs:
                cpoll(x)
            return _NOW() - t0

        def m_id(k: int) -> int:
            xs = [RID] * k
            t0 = _NOW()
            for x in xs:
                cpoll(x, SCOPE)
            return _NOW() - t0

        def m_infl(k: int) -> int:
            xs = [RID] * k
            t0 = _NOW()
            for x in xs:
                infl(x, SCOPE)
            return _NOW() - t0

        def one(fn: Callable[..., object], *args: object) -> Callable[[], int]:
            def timed() -> int:
                t0 = _NOW()
                fn(*args)
                return _NOW() - t0
            return timed

        return [Measure("shmcancel.cancelled(conn), handle", m_handle, one(cancelled, conn), n),
                Measure("c.cancelled(conn), no handle", m_bare, one(cpoll, bare), n),
                Measure("c.cancelled(id, scope)", m_id, one(cpoll, RID, SCOPE), n),
                Measure("c.in_flight(id, scope)", m_infl, one(infl, RID, SCOPE), n)]

    def storage_bytes(self) -> int | None:
        """Bytes of the segment allocated in /dev/shm (its file is larger: shm/layout.py)."""
        return os.stat(f"/dev/shm/shmcancel.{self.reg_name}").st_blocks * 512

    def close(self) -> None:
        try:
            for h in self.handles.values():
                h.end()  # never raises
        finally:
            try:
                self.reg.close()
            finally:
                self.reg.unlink()


class RedisBackend(Backend):
    name = "redis GET flag"

    def __init__(self) -> None:
        self.srv: Any = None
        if shutil.which("redis-server") is None:
            self.skipped = "no redis-server (Debian: apt-get install redis-server)"
            return
        try:
            import redis  # noqa: F401
        except ImportError:
            self.skipped = f"no redis-py ({PIP_BENCH})"
            return
        from helpers.redis_server import RedisServer

        self.srv = RedisServer(own_session=True)  # Ctrl-C: stopped by close()
        try:
            self.srv.start()
        except BaseException:
            self.srv.stop()
            raise

    def client(self) -> Any:
        import redis

        return redis.Redis(host="127.0.0.1", port=self.srv.port, socket_timeout=10)

    def close_client(self, cl: Any) -> None:
        cl.close()

    def fill(self, n: int, tag: str) -> None:
        cl = self.client()
        with cl.pipeline(transaction=False) as p:
            for i in range(n):
                p.set(f"c:ip:{tag}{i % 50}:{i}", "filler", ex=300)
            p.execute()
        cl.close()

    def mark_in_flight(self, cl: Any, w: int, i: int) -> None:
        cl.set(f"f:{_scope(w)}:{i}:{os.getpid()}", 1, ex=300)

    def mark_unmark(self, cl: Any, w: int, i: int) -> None:
        key = f"f:{_scope(w)}:{i}:{os.getpid()}"
        cl.set(key, 1, ex=300)
        cl.delete(key)

    def cancel(self, cl: Any, w: int, i: int) -> None:
        cl.set(f"c:{_scope(w)}:{i}", "bench", ex=300)

    def clear(self, cl: Any, w: int, i: int) -> None:
        cl.delete(f"c:{_scope(w)}:{i}")

    def polls(self, cl: Any) -> list[Measure]:
        self.mark_in_flight(cl, 0, RID)
        key = f"c:{SCOPE}:{RID}"
        return [_generic_poll("redis GET flag", lambda: cl.get(key), 50)]

    def server_pid(self) -> int | None:
        return int(self.srv.proc.pid)

    def close(self) -> None:
        if self.srv is not None:
            self.srv.stop()


class ManagerBackend(Backend):
    name = "Manager dict"

    def __init__(self) -> None:
        before = {p.pid for p in mp.active_children()}
        self.manager = _CTX.Manager()
        self.pid = next((p.pid for p in mp.active_children() if p.pid not in before), None)
        self.d = self.manager.dict()

    def client(self) -> Any:
        return self.d  # a proxy: a connection of its own in each process and thread

    def fill(self, n: int, tag: str) -> None:
        self.d.update({f"c:ip:{tag}{i % 50}:{i}": "filler" for i in range(n)})

    def mark_in_flight(self, cl: Any, w: int, i: int) -> None:
        cl[f"f:{_scope(w)}:{i}:{os.getpid()}"] = 1

    def mark_unmark(self, cl: Any, w: int, i: int) -> None:
        key = f"f:{_scope(w)}:{i}:{os.getpid()}:{threading.get_ident()}"
        cl[key] = 1
        cl.pop(key, None)

    def cancel(self, cl: Any, w: int, i: int) -> None:
        cl[f"c:{_scope(w)}:{i}"] = "bench"

    def clear(self, cl: Any, w: int, i: int) -> None:
        cl.pop(f"c:{_scope(w)}:{i}", None)

    def polls(self, cl: Any) -> list[Measure]:
        self.mark_in_flight(cl, 0, RID)
        key = f"c:{SCOPE}:{RID}"
        return [_generic_poll("Manager dict .get", lambda: cl.get(key), 50)]

    def server_pid(self) -> int | None:
        return self.pid

    def close(self) -> None:
        self.manager.shutdown()


_SQL_MARK = "INSERT OR REPLACE INTO in_flight VALUES (?, ?, ?)"
_SQL_UNMARK = "DELETE FROM in_flight WHERE scope = ? AND id = ? AND owner = ?"
_SQL_CANCEL = "INSERT OR REPLACE INTO cancelled VALUES (?, ?, 'bench', ?)"
_SQL_CLEAR = "DELETE FROM cancelled WHERE scope = ? AND id = ?"


def _sql_owner() -> str:
    """The in-flight owner of the calling thread: its process and thread."""
    return f"{os.getpid()}:{threading.get_ident()}"


class SqliteBackend(Backend):
    name = "sqlite WAL"

    def __init__(self) -> None:
        self.path = f"/dev/shm/shmcancel-bench-{os.getpid()}-{uuid.uuid4().hex[:8]}.sqlite"
        db = self.client()
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("CREATE TABLE cancelled (scope TEXT, id TEXT, reason TEXT, at REAL, "
                   "PRIMARY KEY (scope, id)) WITHOUT ROWID")
        db.execute("CREATE TABLE in_flight (scope TEXT, id TEXT, owner TEXT, "
                   "PRIMARY KEY (scope, id, owner)) WITHOUT ROWID")
        self.db = db

    def client(self) -> Any:
        db = sqlite3.connect(self.path, timeout=30, isolation_level=None,
                             check_same_thread=False)
        db.execute("PRAGMA synchronous=NORMAL")
        return db

    def thread_client(self, cl: Any) -> Any:
        return self.client()

    def close_client(self, cl: Any) -> None:
        cl.close()

    def fill(self, n: int, tag: str) -> None:
        self.db.executemany("INSERT OR REPLACE INTO cancelled VALUES (?, ?, 'filler', ?)",
                            [(f"ip:{tag}{i % 50}", str(i), time.time()) for i in range(n)])

    def mark_in_flight(self, cl: Any, w: int, i: int) -> None:
        cl.execute(_SQL_MARK, (_scope(w), str(i), _sql_owner()))

    def mark_unmark(self, cl: Any, w: int, i: int) -> None:
        row = (_scope(w), str(i), _sql_owner())
        cl.execute(_SQL_MARK, row)
        cl.execute(_SQL_UNMARK, row)

    def cancel(self, cl: Any, w: int, i: int) -> None:
        cl.execute(_SQL_CANCEL, (_scope(w), str(i), time.time()))

    def clear(self, cl: Any, w: int, i: int) -> None:
        cl.execute(_SQL_CLEAR, (_scope(w), str(i)))

    def write_loops(self, cl: Any, w: int) -> tuple[Loop, Loop, Loop]:
        scope, owner = _scope(w), _sql_owner()
        ex, now = cl.execute, time.time

        def loop_mu(ids: Iterable[int]) -> None:
            for i in ids:
                row = (scope, str(i), owner)
                ex(_SQL_MARK, row)
                ex(_SQL_UNMARK, row)

        def loop_cancel(ids: Iterable[int]) -> None:
            for i in ids:
                ex(_SQL_CANCEL, (scope, str(i), now()))

        def loop_clear(ids: Iterable[int]) -> None:
            for i in ids:
                ex(_SQL_CLEAR, (scope, str(i)))

        return loop_mu, loop_cancel, loop_clear

    def polls(self, cl: Any) -> list[Measure]:
        self.mark_in_flight(cl, 0, RID)
        q, args = "SELECT 1 FROM cancelled WHERE scope = ? AND id = ?", (SCOPE, str(RID))
        return [_generic_poll("sqlite WAL SELECT", lambda: cl.execute(q, args).fetchone(), 200)]

    def storage_bytes(self) -> int | None:
        return sum(os.path.getsize(self.path + s) for s in ("", "-wal", "-shm")
                   if os.path.exists(self.path + s))

    def close(self) -> None:
        self.db.close()
        for s in ("", "-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path + s)


# ------------------------------------------------------------------ processes


def _stop_procs(procs: list[Any], deadline: float = 10.0) -> None:
    """Join ``procs`` (``multiprocessing`` processes) by ``deadline`` seconds, SIGKILL by pid
    what is still running, and reap it."""
    end = time.monotonic() + deadline
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)


def _writer_main(b: Backend, w: int, counters: Any, stop: Any, max_seconds: float) -> None:
    """Writer ``w``: mark + unmark, cancel, clear in its own scope until ``stop`` is set (or
    ``max_seconds``); its rounds that succeeded and those that failed go to ``counters[2w]``,
    ``counters[2w + 1]``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the parent stops it by pid
    cl = b.client()
    i = done = errors = 0
    end = time.monotonic() + max_seconds
    while not stop.value and (i & 63 or time.monotonic() < end):
        try:
            b.mark_unmark(cl, w, i % 100)
            b.cancel(cl, w, i % 100)
            b.clear(cl, w, i % 100)
            done += 1
        except Exception:
            errors += 1
        i += 1
        counters[2 * w], counters[2 * w + 1] = done, errors
    b.close_client(cl)


@contextlib.contextmanager
def other_writers(b: Backend, n: int) -> Iterator[Callable[[], tuple[float, int, list[str]]]]:
    """``n`` writer processes on ``b`` for the block, each writing before the block starts;
    yields a function giving (their successful write rounds/s so far, their failures, what
    went wrong: a writer that wrote nothing since the block started or is no longer
    running)."""
    counters = _CTX.RawArray("d", 2 * (n + 1))
    stop = _CTX.RawValue("b", 0)
    procs = [_CTX.Process(target=_writer_main, args=(b, w, counters, stop, 900.0), daemon=True)
             for w in range(1, n + 1)]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + 30
        while (any(counters[2 * w] == 0 for w in range(1, n + 1))
               and time.monotonic() < deadline):
            time.sleep(0.005)
        t0 = time.monotonic()
        c0 = [counters[2 * w] for w in range(1, n + 1)]
        e0 = [counters[2 * w + 1] for w in range(1, n + 1)]

        def rate() -> tuple[float, int, list[str]]:
            now = [counters[2 * w] for w in range(1, n + 1)]
            err = [counters[2 * w + 1] for w in range(1, n + 1)]
            trouble = [f"writer {w + 1} wrote nothing" for w in range(n) if now[w] <= c0[w]]
            trouble += [f"writer {w + 1} exited" for w, p in enumerate(procs)
                        if not p.is_alive()]
            return (sum(now) - sum(c0)) / max(1e-9, time.monotonic() - t0), int(
                sum(err) - sum(e0)), trouble

        yield rate
    finally:
        stop.value = 1
        _stop_procs(procs)


def _pairs_main(b: Backend, w: int, threads: int, go: Any, ready: Any, out: Any,
                seconds: float) -> None:
    """Scaling child ``w``: ``threads`` threads doing mark + unmark pairs for ``seconds`` after
    ``go``; pairs/s of each thread summed into ``out[w]`` (NaN when a thread's writes failed)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the parent stops it by pid
    cl = b.client()
    rates = [0.0] * threads

    def run(t: int) -> None:
        tcl = cl if t == 0 else b.thread_client(cl)
        ww = w * 16 + t
        n = 0
        t0 = time.monotonic()
        end = t0 + seconds
        try:
            while True:
                b.mark_unmark(tcl, ww, n % 100)
                n += 1
                if not n & 7 and time.monotonic() >= end:
                    break
            rates[t] = n / (time.monotonic() - t0)
        except Exception:
            rates[t] = float("nan")
        if tcl is not cl:
            b.close_client(tcl)

    ready[w] = 1
    if not go.wait(60):
        return
    ts = [threading.Thread(target=run, args=(t,)) for t in range(1, threads)]
    for t in ts:
        t.start()
    run(0)
    for t in ts:
        t.join(seconds + 60)
    out[w] = sum(rates)
    b.close_client(cl)


def aggregate_pairs(b: Backend, procs: int, threads: int, seconds: float) -> float:
    """Mark + unmark pairs/s of ``procs`` processes of ``threads`` threads each, all at once."""
    go = _CTX.Event()
    ready = _CTX.RawArray("b", procs + 1)
    out = _CTX.RawArray("d", procs + 1)
    ps = [_CTX.Process(target=_pairs_main, args=(b, w, threads, go, ready, out, seconds),
                       daemon=True) for w in range(1, procs + 1)]
    try:
        for p in ps:
            p.start()
        deadline = time.monotonic() + 30
        while not all(ready[1:]) and time.monotonic() < deadline:
            time.sleep(0.002)
        go.set()
        _stop_procs(ps, seconds + 60)
    finally:
        _stop_procs(ps, 0)
    return float(sum(out[1:]))


def write_measures(b: Backend, cl: Any) -> list[Measure]:
    """Mark + unmark, cancel, clear of ``b`` in this process's own scope (writer ``ME``), ids
    cycling, each timed over a batch run by the backend's own loop (``write_loops``);
    ``cancel`` is timed alone and its rows cleared untimed, ``clear`` the reverse."""
    n = {"shmcancel": 100, "sqlite WAL": 100}.get(b.name, 40)
    base = {"i": 0}
    lm, lc, lx = (f"{b.name}: {x}" for x in b.write_labels())

    def ids(k: int) -> range:
        i0 = base["i"]
        base["i"] = (i0 + k) % 100_000
        return range(i0, i0 + k)

    loop_mu, loop_cancel, loop_clear = b.write_loops(cl, ME)

    def timed(loop: Loop) -> Callable[[int], int]:
        def run(k: int) -> int:
            r = ids(k)
            t0 = _NOW()
            loop(r)
            return _NOW() - t0
        return run

    mu = timed(loop_mu)

    def cancel(k: int) -> int:
        r = ids(k)
        t0 = _NOW()
        loop_cancel(r)
        t = _NOW() - t0
        loop_clear(r)
        return t

    def clear(k: int) -> int:
        r = ids(k)
        loop_cancel(r)
        t0 = _NOW()
        loop_clear(r)
        return _NOW() - t0

    out = [Measure(lm, mu, lambda: mu(1), n), Measure(lc, cancel, lambda: cancel(1), n),
           Measure(lx, clear, lambda: clear(1), n)]
    if b.name == "shmcancel":  # begin + end where the scope holds another request's row
        cl.cancel("another request", "bench", _scope(WITH_A_ROW))
        mu_row = timed(b.write_loops(cl, WITH_A_ROW)[0])
        out.insert(1, Measure(f"{lm}, a row in scope", mu_row, lambda: mu_row(1), n))
    return out
