#!/usr/bin/env python3
"""Burst cancellation latency: many ``sleep`` calls in flight, all cancelled at once (issue #9).

    python tools/bench_burst.py [--calls 50] [--rounds 5] [--seq 20] [--workers 4]
                                [--threads 16] [--wire legacy|modern|both] [--target-ms 15]
                                [--by-thread] [--count-calls] [--check]

The example app (``examples/gunicorn``, as shipped) under gunicorn ``gthread`` (``--workers`` x
``--threads``, ``--reuse-port``: a listening socket per worker, so that the kernel spreads the
calls over the workers) on loopback, its own registry (unlinked by gunicorn's ``on_exit`` when the
bench stops it, by pid). Per round ``--calls`` clients each POST ``tools/call sleep`` (30 s) on a
connection of their own; once every call is in flight (read from the registry, lock-free) all are
cancelled as fast as one thread can:

- ``legacy`` (2025-era wire): a ``notifications/cancelled`` POST per call, each on a new
  connection; latency = from the notification's connect to the ``-32800`` received on the call's
  connection;
- ``modern`` (2026-07-28): the call's connection closed (``shutdown``); latency = from the close
  to the call's in-flight row gone (the tool observed the cancellation and its rows were ended),
  seen by a thread polling the registry.

``floor``: after each burst, as many ``notifications/cancelled`` of calls not in flight, sent
the same way (latency: connect -> 202): what serving a burst of small requests costs on this
machine now. ``bare``: the same requests to a second gunicorn of the same shape serving a WSGI
app that only answers 202 (no shmcancel in the request path): what gunicorn alone costs.
``bare burst`` (legacy): the burst's shape against that second gunicorn, whose app holds each
call (a thread blocked on a datagram socket of its own) until a request of its own, on a new
connection, sends it one datagram: what a burst costs gunicorn and this machine with the
cheapest cross-worker cancellation there is, no MCP and no registry.
``sequential``: the same as the burst, one call at a time (``--seq`` per round).
``--by-thread``: the workers' CPU a burst also by thread (``pool``: gunicorn's request threads,
``main``: its main threads, ``disconnect``: our watcher threads, ...), each thread of the two
gunicorns named by its role (``prctl``) by a ``sitecustomize`` given to them only.
``--count-calls``: the interpreter calls (Python functions and builtins) the workers make per
cancelled call, by the kind of code that makes them (``_callcount.py``): the Python work a burst
costs, a figure that load does not move; the counting itself slows that run's latencies.
Prints p50/p99/max of the latencies over all rounds (ms), the range of the rounds' p99, and
whether the burst p99 meets ``--target-ms`` (``--check``: exit 1 when it does not), and when it
misses, whether the bare app's own p99 is over the target too: then the machine, at that
moment, is too slow for any cancellation through gunicorn to meet it. A run that
measured no burst, or in which a cancelled call was not answered ``-32800`` (legacy) or did not
end (modern), exits 1 with or without ``--check``. The calls start one after the other, each
in flight before the next; a round is skipped and run again (at most 30 tries) when some call
does not get in flight within 0.5 s (a worker accepted more calls than it has threads), or,
on the legacy wire and in the bare burst, when some worker runs as many calls as it has threads
(the cancellations it accepts would wait for one of its calls to end: that measures the round's
luck, not the cancellation; a close needs no thread).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import selectors
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from _benchlib import GunicornServer, call_request, post_request, response_body, session
from _callcount import KINDS, SITECUSTOMIZE, CallCounter
from bench_watch import Server, write_wrapper

from shmcancel.cancel.shm_storage import ShmBackend
from shmcancel.exceptions import RegistryNotFound
from shmcancel.mcp.principal import scope as scope_of
from shmcancel.shm.registry import Registry

SLEEP = 30.0  # seconds each call would sleep uncancelled
IN_FLIGHT_WAIT = 10.0  # seconds a round waits for its calls to be in flight
ANSWER_WAIT = 10.0  # seconds a round waits for its cancellations to land
TRIES = 30  # tries at a round before it is given up (a worker may get more calls than threads)
# Each worker listens on a socket of its own and the kernel spreads connections over them at
# random: on one shared socket gthread workers race to accept, and the same one can win nearly
# every time (on 2026-12-05 one worker took all 50 calls of every try: nothing was measured).
SPREAD = ("--reuse-port",)
_now = time.perf_counter
_BARE_APP = """import json
import socket


def _hold_address(port, rid):  # abstract Unix datagram socket of held call rid of this server
    return f"\\0bench-burst-hold-{port}-{rid}".encode()


def app(environ, start_response):
    body = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
    path = environ.get("PATH_INFO")
    if path == "/hold":  # held until released: a burst's call without MCP or shmcancel
        rid = int(json.loads(body)["id"])
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.bind(_hold_address(environ["SERVER_PORT"], rid))
            s.settimeout(30)
            try:
                s.recv(1)
                answer = {"error": {"code": -32800, "message": "released"}}
            except TimeoutError:  # never released: the bench counts it lost
                answer = {"result": "not released"}
        out = json.dumps({"jsonrpc": "2.0", "id": rid, **answer}).encode()
        start_response("200 OK", [("Content-Type", "application/json"),
                                  ("Content-Length", str(len(out)))])
        return [out]
    if path == "/release":  # the cheapest cross-worker cancellation: one datagram
        rid = int(json.loads(body)["id"])
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            try:
                s.sendto(b"", _hold_address(environ["SERVER_PORT"], rid))
            except OSError:
                pass
    start_response("202 Accepted", [("Content-Length", "0")])  # else: gunicorn alone
    return [b""]
"""


# --by-thread: names each thread of the gunicorns by its role, for /proc/<pid>/task/*/comm
_THREAD_NAMES = """import ctypes
import threading

try:
    _prctl = ctypes.CDLL(None).prctl
except (OSError, AttributeError):
    _prctl = None
_run = threading.Thread._bootstrap_inner


def _named(self):
    if _prctl is not None:
        n = self.name
        role = "pool" if n.startswith("ThreadPoolExecutor") else n.removeprefix("shmcancel-")
        _prctl(15, role[:15].encode(), 0, 0, 0)  # PR_SET_NAME
    _run(self)


threading.Thread._bootstrap_inner = _named
"""


def _bare_post(port: int, path: str, rid: int) -> bytes:
    """A ``POST path`` of ``{"id": rid}`` to the bare app (``/hold`` or ``/release``)."""
    return post_request(port, {"id": rid}, {}).replace(b"POST /mcp ", f"POST {path} ".encode(), 1)


def _hold_address(port: int, rid: int) -> bytes:
    """The abstract socket the bare app's held call ``rid`` waits on (as ``_BARE_APP``)."""
    return f"\0bench-burst-hold-{port}-{rid}".encode()


def _held(port: int, rid: int) -> Callable[[], bool]:
    """Whether the bare app holds call ``rid`` now: its socket is bound (a datagram socket's
    connect sends nothing)."""
    addr = _hold_address(port, rid)

    def poll() -> bool:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            try:
                s.connect(addr)
            except OSError:
                return False
            return True
    return poll


def _busiest_bare_worker(server: GunicornServer) -> int:
    """The most calls one worker of the bare app holds now (its sockets bound to a hold
    address, found through ``/proc/net/unix`` and the workers' descriptors)."""
    prefix = f"@bench-burst-hold-{server.port}-"
    inodes = set()
    with contextlib.suppress(OSError), open("/proc/net/unix") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 8 and parts[7].startswith(prefix):
                inodes.add(f"socket:[{parts[6]}]")
    most = 0
    for pid in server.worker_pids():
        n = 0
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    n += os.readlink(f"/proc/{pid}/fd/{fd}") in inodes
        most = max(most, n)
    return most


class _Call:
    """One POST on a connection of its own; :attr:`answered_at` (``perf_counter``) and
    :attr:`code` (the JSON-RPC error code, or ``None``) once its response arrived, or the
    connection closed; read by a :class:`_Reader`."""

    __slots__ = ("answered_at", "buf", "code", "done", "reader", "sock")

    def __init__(self, port: int, req: bytes, reader: _Reader) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.answered_at: float | None = None
        self.code: int | None = None
        self.buf = b""
        self.done = threading.Event()
        self.sock.sendall(req)
        self.sock.setblocking(False)
        self.reader = reader
        reader.add(self)

    def _readable(self) -> bool:
        """Read what is there; ``True`` once the response is complete or the peer closed."""
        try:
            chunk = self.sock.recv(65536)
        except BlockingIOError:
            return False
        except OSError:  # reset
            chunk = b""
        self.buf += chunk
        body = response_body(self.buf) if chunk else b""
        if body is None:
            return False
        self.answered_at = _now()
        with contextlib.suppress(ValueError, AttributeError):
            self.code = json.loads(body).get("error", {}).get("code")
        return True  # the reader unregisters the socket, then sets done

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.done.wait(ANSWER_WAIT)
        with contextlib.suppress(KeyError, ValueError):
            self.reader.sel.unregister(self.sock)
        self.sock.close()


class _Reader:
    """One thread reading every :class:`_Call`'s response (no thread per connection: the
    bench shares two cores with the server it measures)."""

    def __init__(self) -> None:
        # registered from other threads while select() waits: epoll allows it, and the
        # selector's map is only read by select() under the GIL
        self.sel = selectors.EpollSelector()
        self.running = True
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def add(self, call: _Call) -> None:
        self.sel.register(call.sock, selectors.EVENT_READ, call)

    def _run(self) -> None:
        while self.running:
            for key, _ in self.sel.select(0.05):
                if key.data._readable():
                    # before done: once done, the round may close the socket and a new one
                    # reuse its descriptor number
                    with contextlib.suppress(KeyError, ValueError):
                        self.sel.unregister(key.fileobj)
                    key.data.done.set()

    def close(self) -> None:
        self.running = False
        self.thread.join(5)
        self.sel.close()


def _wait_all(polls: list[Callable[[], bool]], want: bool, deadline: float,
              seen: list[float | None] | None = None) -> bool:
    """Poll until every ``poll()`` is ``want`` (recording when each first was, in ``seen``);
    ``False`` at the deadline."""
    left = set(range(len(polls)))
    while left:
        for i in list(left):
            if polls[i]() is want:
                left.discard(i)
                if seen is not None:
                    seen[i] = _now()
        if left:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.0002)
    return True


class Bench:
    def __init__(self, server: Server, wire: str, threads: int) -> None:
        self.server = server
        self.threads = threads
        self.wire = wire
        self.port = server.port
        deadline = time.monotonic() + IN_FLIGHT_WAIT
        while True:  # the master creates it once its sockets are bound: wait for that
            try:
                self.reg = Registry.attach(server.registry)  # reads; may lock on a torn read
                break
            except RegistryNotFound:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        self.store = ShmBackend(self.reg)
        self.sid = session(self.port) if wire == "legacy" else None
        self.scope = (f"session:{self.sid}" if self.sid is not None
                      else scope_of({"REMOTE_ADDR": "127.0.0.1"}))
        self.next_id = 1000
        self.reader = _Reader()
        self.lost = 0  # cancelled calls not answered -32800 (legacy) or still in flight (modern)
        self.answered: list[float] = []  # seconds from a notification's connect to its 202
        # per burst / floor: (workers' CPU, this process's CPU, wall), seconds, from the first
        # send to the last answer
        self.cpu: dict[str, list[tuple[float, float, float]]] = {}
        self.by_thread: dict[str, list[dict[str, int]]] | None = None  # mode -> per burst
        self._names0: dict[str, int] = {}  # by thread name, at the span's start
        self.counter: CallCounter | None = None  # --count-calls
        self.calls: dict[str, list[tuple[int, Counter[str]]]] = {}  # mode -> (calls, counts)
        self.calls_lost: dict[str, int] = {}  # mode -> spans measured but not counted

    def close(self) -> None:
        self.reader.close()
        self.reg.close()

    def _no_thread_left(self, ids: list[int]) -> bool:
        """Whether some worker runs as many of the calls ``ids`` as it has threads, on the
        legacy wire: the cancellations it accepts would wait for one of its calls to end
        (gthread accepts past its threads), which measures the round's luck, not the
        cancellation. Never on the modern wire: a close is seen by the worker's watcher
        thread, which needs no free thread."""
        if self.wire != "legacy":
            return False
        per_pid: dict[int, int] = {}
        for rid in ids:
            for pid in self.store.in_flight_pids(self.scope, str(rid)):
                per_pid[pid] = per_pid.get(pid, 0) + 1
        return max(per_pid.values(), default=0) >= self.threads

    def _cpu0(self, server: GunicornServer | None = None) -> tuple[int, float, float]:
        self._names0 = {}
        if self.counter is not None:  # acknowledged before the span starts
            self.counter.start((server or self.server).worker_pids)
        names = self._names0 if self.by_thread is not None else None
        return (server or self.server).worker_run_ns(names), time.process_time(), _now()

    def _cpu1(self, mode: str | None, t0: tuple[int, float, float] | None,
              last: list[float | None], server: GunicornServer | None = None) -> None:
        """Record under ``mode`` what the span since ``t0`` cost, up to the last of ``last``
        (answers); nothing without a mode (``t0`` is then ``None``: nothing was read)."""
        if mode is None or t0 is None:
            return
        client = time.process_time() - t0[1]
        names: dict[str, int] | None = {} if self.by_thread is not None else None
        workers = ((server or self.server).worker_run_ns(names) - t0[0]) / 1e9
        ends = [t for t in last if t is not None]
        if self.counter is not None:
            counts = self.counter.stop((server or self.server).worker_pids)
            if counts is not None and ends:
                self.calls.setdefault(mode, []).append((len(last), counts))
            elif ends:  # a worker did not acknowledge a switch in time, or was replaced
                self.calls_lost[mode] = self.calls_lost.get(mode, 0) + 1
        if ends:
            self.cpu.setdefault(mode, []).append((workers, client, max(ends) - t0[2]))
            if names is not None and self.by_thread is not None:
                self.by_thread.setdefault(mode, []).append(
                    {k: v - self._names0.get(k, 0) for k, v in names.items()})

    def _notify(self, rid: int, port: int | None = None) -> _Call:
        port = self.port if port is None else port
        body = {"jsonrpc": "2.0", "method": "notifications/cancelled",
                "params": {"requestId": rid, "reason": "bench"}}
        headers = {"MCP-Protocol-Version": "2025-11-25", "Mcp-Session-Id": self.sid or ""}
        return _Call(port, post_request(port, body, headers), self.reader)

    def floor(self, n: int, server: GunicornServer | None = None) -> list[float]:
        """``n`` notifications for calls not in flight (nothing runs), as fast as the burst
        sends them: seconds from each one's connect to its 202 (what serving them costs). To
        ``server`` (the bare app, kept as ``bare``) when given, else to this bench's server."""
        ids = list(range(self.next_id, self.next_id + n))
        self.next_id += n
        sent: list[float] = []
        notes: list[_Call] = []
        port = None if server is None else server.port
        try:
            t0 = self._cpu0(server)
            for rid in ids:
                sent.append(_now())
                notes.append(self._notify(rid, port))
            for c in notes:
                c.done.wait(ANSWER_WAIT)
            self._cpu1("floor" if server is None else "bare", t0,
                       [c.answered_at for c in notes], server)
            return [c.answered_at - t for c, t in zip(notes, sent, strict=True)
                    if c.answered_at is not None]
        finally:
            for c in notes:
                c.close()

    def round(self, n: int, mode: str | None = "burst") -> list[float] | None:
        """Start ``n`` calls, cancel them all at once; their latencies in seconds, or ``None``
        when some call never got in flight. What the cancelling cost is kept under ``mode``
        (:attr:`cpu`)."""
        ids = list(range(self.next_id, self.next_id + n))
        self.next_id += n
        polls = [self.store.watch_in_flight(self.scope, str(i)).member for i in ids]
        calls: list[_Call] = []
        notes: list[_Call] = []
        try:
            # one at a time, each in flight before the next: a call queued behind a worker's
            # busy threads (gthread accepts past its threads) would never see its cancellation
            for i, rid in enumerate(ids):
                calls.append(_Call(self.port, call_request(self.port, self.wire, "sleep",
                                                            {"seconds": SLEEP}, rid, self.sid),
                                   self.reader))
                if not _wait_all(polls[i:i + 1], True, time.monotonic() + IN_FLIGHT_WAIT / 20):
                    return None
            if mode is not None and self._no_thread_left(ids):
                return None
            sent: list[float] = []
            gone: list[float | None] = [None] * n
            t0 = self._cpu0() if mode is not None else None  # the warm-up reads no /proc
            if self.wire == "legacy":
                for rid in ids:
                    sent.append(_now())
                    notes.append(self._notify(rid))
                for c in calls:
                    c.done.wait(ANSWER_WAIT)
                for c in notes:
                    c.done.wait(ANSWER_WAIT)
                self._cpu1(mode, t0, [c.answered_at for c in calls])
                self.answered += [c.answered_at - t for c, t in zip(notes, sent, strict=True)
                                  if c.answered_at is not None]
                self.lost += sum(c.code != -32800 for c in calls)
                return [c.answered_at - t for c, t in zip(calls, sent, strict=True)
                        if c.answered_at is not None and c.code == -32800]
            watcher = threading.Thread(
                target=_wait_all, args=(polls, False, time.monotonic() + ANSWER_WAIT, gone))
            watcher.start()
            for c in calls:
                sent.append(_now())
                with contextlib.suppress(OSError):
                    c.sock.shutdown(socket.SHUT_RDWR)
            watcher.join()
            self._cpu1(mode, t0, gone)
            self.lost += sum(g is None for g in gone)
            return [g - t for g, t in zip(gone, sent, strict=True) if g is not None]
        finally:
            for c in calls + notes:
                c.close()

    def bare_round(self, n: int, bare: GunicornServer) -> list[float] | None:
        """:meth:`round` on the legacy wire's shape against the bare app: ``n`` calls held,
        each in flight before the next, then released at once, each by a POST of its own on a
        new connection that sends one datagram to the held call's thread. What a burst costs
        gunicorn and this machine with the cheapest cross-worker cancellation there is (no
        MCP, no registry). Latencies in seconds, ``None`` when some call never got a thread."""
        ids = list(range(self.next_id, self.next_id + n))
        self.next_id += n
        calls: list[_Call] = []
        releases: list[_Call] = []
        try:
            for rid in ids:
                calls.append(_Call(bare.port, _bare_post(bare.port, "/hold", rid), self.reader))
                if not _wait_all([_held(bare.port, rid)], True,
                                 time.monotonic() + IN_FLIGHT_WAIT / 20):
                    return None
            if _busiest_bare_worker(bare) >= self.threads:
                return None
            sent: list[float] = []
            t0 = self._cpu0(bare)
            for rid in ids:
                sent.append(_now())
                releases.append(_Call(bare.port, _bare_post(bare.port, "/release", rid),
                                      self.reader))
            for c in calls + releases:
                c.done.wait(ANSWER_WAIT)
            self._cpu1("bare burst", t0, [c.answered_at for c in calls], bare)
            self.lost += sum(c.code != -32800 for c in calls)
            return [c.answered_at - t for c, t in zip(calls, sent, strict=True)
                    if c.answered_at is not None and c.code == -32800]
        finally:
            # a round cut short leaves no thread held: calls queued behind a worker's busy
            # threads bind their socket only once they run, so until each is answered
            deadline = time.monotonic() + ANSWER_WAIT
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
                # calls: those started (a round cut short started fewer than ids)
                while (left := [rid for rid, c in zip(ids, calls, strict=False)
                                if not c.done.is_set()]) and time.monotonic() < deadline:
                    for rid in left:
                        with contextlib.suppress(OSError):
                            s.sendto(b"", _hold_address(bare.port, rid))
                    time.sleep(0.001)
            for c in calls + releases:
                c.close()


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def _print_cpu(cpu: dict[str, list[tuple[float, float, float]]]) -> None:
    """Per mode, the median CPU one burst (or one sequential cancel, or one floor) cost the
    workers and this process, and the least wall time that CPU takes on this machine's cores."""
    cores = len(os.sched_getaffinity(0))
    print(f"  CPU per burst (from the first send to the last answer; medians, ms), {cores} "
          "cores:")
    for mode in ("sequential", "burst", "floor", "bare", "bare burst"):
        spans = cpu.get(mode)
        if not spans:
            continue
        med = statistics.median
        workers, client, wall = (med(x[i] for x in spans) * 1e3 for i in range(3))
        print(f"  {mode:10s} workers {workers:6.2f}  this client {client:6.2f}  -> at least "
              f"{(workers + client) / cores:6.2f} ms of wall time on {cores} cores; took "
              f"{wall:6.2f}")


def _print_by_thread(by_thread: dict[str, list[dict[str, int]]]) -> None:
    """Per mode, the median CPU one burst cost each kind of the workers' threads (ms)."""
    print("  the workers' CPU per burst by thread (--by-thread; medians, ms):")
    for mode in ("sequential", "burst", "floor", "bare", "bare burst"):
        spans = by_thread.get(mode)
        if not spans:
            continue
        names = sorted({k for d in spans for k in d})
        med = {k: statistics.median(d.get(k, 0) for d in spans) / 1e6 for k in names}
        print(f"  {mode:10s} " + "  ".join(f"{k} {med[k]:.2f}" for k in
                                           sorted(names, key=lambda k: -med[k])))


def _print_calls(calls: dict[str, list[tuple[int, Counter[str]]]], lost: dict[str, int]
                 ) -> None:
    """Per mode, the interpreter calls the workers made per call cancelled (burst: the call,
    its notification and the release; floor, bare: per notification), by the calling code's
    kind (Python functions + builtins), summed over every counted span."""
    print("  interpreter calls per call cancelled (floor, bare: per notification), all workers,"
          " Python + builtin (--count-calls; the counting slowed this run's latencies):")
    totals: dict[str, float] = {}
    for mode in ("sequential", "burst", "floor", "bare", "bare burst"):
        spans = calls.get(mode)
        if not spans:
            if lost.get(mode):
                print(f"  {mode:10s} not counted: a worker did not acknowledge the counting's "
                      f"switch in time ({lost[mode]} span(s))")
            continue
        n = sum(k for k, _ in spans)
        counts: Counter[str] = Counter()
        for _, c in spans:
            counts.update(c)
        per = {k: (counts[f"{k} py"] / n, counts[f"{k} c"] / n) for k in KINDS}
        total = totals[mode] = sum(py + c for py, c in per.values())
        print(f"  {mode:10s} total {total:7.1f}  " + "  ".join(
            f"{k} {py + c:6.1f} ({py:.0f}+{c:.0f})" for k, (py, c) in per.items()))
    if "burst" in totals and "bare burst" in totals:
        print(f"  burst / bare burst: {totals['burst'] / totals['bare burst']:.2f}x the calls")


def run(a: argparse.Namespace) -> tuple[bool, bool]:
    """Run and print the benchmark; ``(every target met, every run valid)``: a run is not
    valid when it measured nothing or a cancelled call was lost."""
    ok = valid = True
    with tempfile.TemporaryDirectory(prefix="bench-burst-") as tmp:
        write_wrapper(tmp)
        Path(tmp, "bench_burst_bare.py").write_text(_BARE_APP)
        saved_path = os.environ.get("PYTHONPATH")
        saved_dir = os.environ.get("BENCH_CALLS_DIR")
        if a.by_thread or a.count_calls:  # the gunicorns only: this process started without
            Path(tmp, "names").mkdir()
            Path(tmp, "names", "sitecustomize.py").write_text(
                (_THREAD_NAMES if a.by_thread else "")
                + (SITECUSTOMIZE if a.count_calls else ""))
            os.environ["PYTHONPATH"] = os.pathsep.join(
                p for p in (str(Path(tmp, "names")), saved_path) if p)
        if a.count_calls:
            Path(tmp, "calls").mkdir()
            os.environ["BENCH_CALLS_DIR"] = str(Path(tmp, "calls"))
        servers: list[GunicornServer] = []
        try:  # the first one stopped too when the second does not start
            servers.append(Server(tmp, "gthread", True, a.src, threads=a.threads,
                                  workers=a.workers, extra_args=SPREAD))
            servers.append(GunicornServer(tmp, "gthread", "bench_burst_bare:app", {}, "bare",
                                          a.src, workers=a.workers, threads=a.threads,
                                          registry_prefix="bench-burst-bare", extra_args=SPREAD))
            server, bare = servers
            for wire in (["legacy", "modern"] if a.wire == "both" else [a.wire]):
                b = Bench(server, wire, a.threads)
                if a.by_thread:
                    b.by_thread = {}
                if a.count_calls:
                    b.counter = CallCounter(str(Path(tmp, "calls")))
                try:
                    # warm every worker up, never with all of one worker's threads: its
                    # notifications would queue behind the calls they cancel (gthread accepts
                    # past its threads)
                    b.round(max(1, min(a.calls, 8, a.threads - 1)), None)
                    got: dict[str, list[list[float]]] = {"sequential": [], "burst": [],
                                                         "floor": [], "bare": []}
                    if wire == "legacy":
                        got["bare burst"] = []
                    skipped = 0
                    for _ in range(a.rounds):
                        seq: list[float] = []
                        for _ in range(a.seq):
                            seq += b.round(1, "sequential") or []
                        got["sequential"].append(seq)
                        for _ in range(TRIES):  # a round some call of which never got a thread
                            lat = b.round(a.calls)
                            if lat is not None:
                                got["burst"].append(lat)
                                got["floor"].append(b.floor(a.calls))
                                got["bare"].append(b.floor(a.calls, bare))
                                break
                            skipped += 1
                        if wire == "legacy":
                            for _ in range(TRIES):
                                lat = b.bare_round(a.calls, bare)
                                if lat is not None:
                                    got["bare burst"].append(lat)
                                    break
                                skipped += 1
                    what = ("notification -> -32800" if wire == "legacy"
                            else "close -> row gone")
                    print(f"{wire} ({what}; floor: as many notifications, nothing in flight, "
                          "-> 202; bare: the same to an app that only answers 202"
                          + ("; bare burst: the burst to an app that holds calls and releases "
                             "each by a datagram" if wire == "legacy" else "")
                          + "), gthread "
                          f"{a.workers}x{a.threads}, {a.rounds} "
                          f"round{'s' if a.rounds != 1 else ''}:")
                    for mode, rounds in got.items():
                        flat = [x for r in rounds for x in r]
                        if not flat:
                            print(f"  {mode:10s} no samples")
                            continue
                        p99s = [_pct(r, 0.99) * 1e3 for r in rounds if r]
                        print(f"  {mode:10s} n={len(flat):4d}  p50 {_pct(flat, 0.5) * 1e3:6.2f}"
                              f"  p99 {_pct(flat, 0.99) * 1e3:6.2f}  max {max(flat) * 1e3:6.2f}"
                              f" ms  (rounds' p99 {min(p99s):.1f}..{max(p99s):.1f}, median "
                              f"{statistics.median(p99s):.1f})")
                    if b.answered:
                        ans = b.answered
                        print(f"  (notifications answered 202: p50 {_pct(ans, 0.5) * 1e3:.2f}"
                              f" p99 {_pct(ans, 0.99) * 1e3:.2f} ms)")
                    _print_cpu(b.cpu)
                    if b.by_thread is not None:
                        _print_by_thread(b.by_thread)
                    if b.calls or b.calls_lost:
                        _print_calls(b.calls, b.calls_lost)
                    flat = [x for r in got["burst"] for x in r]
                    if b.lost:
                        valid = False  # a cancelled call not answered -32800: a failure
                    if not flat:
                        valid = False
                        print(f"  target burst p99 <= {a.target_ms:g} ms: nothing measured "
                              f"(every try of every round skipped: {skipped})")
                    if flat:
                        p99 = _pct(flat, 0.99) * 1e3
                        met = p99 <= a.target_ms
                        ok = ok and met
                        fl = _pct([x for r in got["floor"] for x in r], 0.99) * 1e3
                        bp = _pct([x for r in got["bare"] for x in r], 0.99) * 1e3
                        held = [x for r in got.get("bare burst", []) for x in r]
                        bb = (f", {p99 / (_pct(held, 0.99) * 1e3):.1f}x the bare burst's "
                              f"{_pct(held, 0.99) * 1e3:.2f} ms" if held else "")
                        print(f"  target burst p99 <= {a.target_ms:g} ms: "
                              f"{'met' if met else 'MISSED'} ({p99:.2f} ms; {p99 / fl:.1f}x the "
                              f"floor's p99 {fl:.2f} ms, {p99 / bp:.1f}x the bare app's "
                              f"{bp:.2f} ms{bb})"
                              + (f"; {skipped} round(s) skipped" if skipped else "")
                              + (f"; {b.lost} call(s) lost (not answered -32800 / not ended)"
                                 if b.lost else ""))
                        if not met and bp > a.target_ms:
                            print(f"  (the bare app, answering the same {a.calls} requests 202 "
                                  "and cancelling nothing, is itself over the target: no "
                                  "cancellation through gunicorn can meet it on this machine "
                                  "now)")
                finally:
                    b.close()
        finally:
            for s in servers:
                s.close()
            for var, saved in (("PYTHONPATH", saved_path), ("BENCH_CALLS_DIR", saved_dir)):
                if saved is None:
                    os.environ.pop(var, None)
                else:
                    os.environ[var] = saved
    return ok, valid


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seq", type=int, default=20, help="sequential cancellations per round")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--wire", choices=["legacy", "modern", "both"], default="both")
    ap.add_argument("--target-ms", type=float, default=15.0)
    ap.add_argument("--src", help="the src directory gunicorn serves (default: this checkout)")
    ap.add_argument("--by-thread", action="store_true",
                    help="also the workers' CPU per burst by thread (request, main, watcher)")
    ap.add_argument("--count-calls", action="store_true",
                    help="also the interpreter calls the workers make per cancelled call, by "
                         "kind of code (shmcancel, gunicorn, app, other): a figure load does "
                         "not move (slows the run's latencies)")
    ap.add_argument("--check", action="store_true", help="exit 1 when the target is missed")
    a = ap.parse_args(argv)
    if not 1 <= a.calls <= 1000 or not 1 <= a.rounds <= 100 or not 0 <= a.seq <= 1000:
        ap.error("--calls 1..1000, --rounds 1..100, --seq 0..1000")
    ok, valid = run(a)
    return 0 if valid and (ok or not a.check) else 1


if __name__ == "__main__":
    sys.exit(main())

