#!/usr/bin/env python3
"""Torture a real gunicorn serving the example and print one line of figures per scenario.

    .venv/bin/python tools/torture.py [--seconds 60] [--json] [--no-fail] [--only NAME ...]

Each scenario starts its own gunicorn (``tools/torture_gunicorn.conf.py``: the example's config
with a 0.5 s ``lock_timeout`` and 256 sessions; ``-w 4``, ``-b 127.0.0.1:0``, a registry name
of its own; ``gthread`` x 8 threads by default, so that 20 sleeping calls and a flood run side by
side: ``--worker-class sync``, the example's own, queues calls behind the 4 workers), measures
a well-behaved client unloaded, runs its load, waits for the calls to end, reads what is left in
the registry, and stops everything it started (by pid, in a ``finally``; the registry's names
are unlinked). Scenarios:

``steady``         mixed load on both wires (echo; sleep; echo or sleep raced by one or two
                   ``notifications/cancelled``, its id then reused; sleep + disconnect on
                   2026-07-28; ``initialize`` + ``DELETE``) while a worker is SIGKILLed every
                   0.3-0.9 s.
``lock-stall``     the same load while another process attached to the registry holds its lock,
                   SIGSTOPped, for 3 x ``lock_timeout``.
``hup-usr2``       the same load across a ``HUP``, then a ``USR2`` whose new master takes over
                   (the old one is TERMed).
``session-flood``  two connections from 127.0.0.2 loop ``initialize`` while 8 idle clients
                   (127.0.1.x) keep using their sessions.
``cancel-flood``   one client (127.0.0.3, its own session, no principal) cancels ids 1..1000 in
                   a loop while 20 sessions run ``sleep`` with ids 1..3.

Figures (``*``: must be 0; the tool exits 1 when one is not, unless ``--no-fail``):
``served`` HTTP replies received; ``5xx*`` replies 500-599 other than a 503 with
``Retry-After`` (``503`` counts those); ``bystander*`` calls nobody cancelled that ended
``-32800``; ``lost*`` a 404 for a session nobody deleted, sent to a well-behaved client;
``rows*`` cancellation and in-flight rows left once the load stopped and its calls ended (a
cancellation row of a call whose worker was SIGKILLed may stay until its TTL: counted apart as
``killed_rows``); ``p50``/``p99`` of a well-behaved client's ``echo`` under load against the
same client unloaded, measured in the same run; ``error*`` a scenario that could not run.
Informational: ``conn`` requests whose connection dropped without a reply (killed workers),
``timeouts``, ``other`` (unexpected statuses or JSON-RPC errors, with samples in ``--json``),
``cancelled`` calls the load cancelled that ended ``-32800``, ``kills``, ``tracebacks`` in the
gunicorn log.

``--seconds`` is the budget for all the scenarios together, split evenly; each has a minimum load
phase (2 s) and every wait (start, requests, drain, stop) has its own deadline, so a run lasts
``--seconds`` plus a few seconds per scenario for starting and stopping gunicorn, never
unboundedly longer. Clients are loopback only, each request on its
own connection (``Connection: close``), the standard library's ``http.client``.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "tests"))

try:
    from helpers.gunicorn_harness import Gunicorn, alive, wait_until
    from helpers.mcp_client import ACCEPT, LEGACY, MODERN, meta
except ImportError as e:  # gunicorn, httpx, pytest: the test extra
    sys.exit(f"tools/torture.py needs the test extra (bash tools/test.sh makes .venv): {e}")

from shmcancel import Registry  # noqa: E402
from shmcancel.shm import procinfo  # noqa: E402

CONFIG = str(REPO_ROOT / "tools" / "torture_gunicorn.conf.py")
SCENARIOS = ("steady", "lock-stall", "hup-usr2", "session-flood", "cancel-flood")
MUST_BE_ZERO = ("5xx", "bystander", "lost", "rows", "error")
CANCELLED = -32800
REQUEST_TIMEOUT = 8.0  # seconds a client waits for one reply
MIN_LOAD = 2.0  # seconds of load per scenario, whatever the budget
DRAIN = 2.0  # seconds reserved at the end of a scenario's slice for draining and reading rows
ROWS_WAIT = 5.0  # seconds to wait for rows to go once the load stopped
BASELINE_CALLS = 40
WARMUP_CALLS = 10
LATENCY_SOURCE = "127.0.0.1"
MODERN_SOURCE = "127.0.0.1"  # anonymous 2026-07-28 clients share one ip: scope, as behind a NAT
FLOOD_SOURCE = "127.0.0.2"
CANCEL_FLOOD_SOURCE = "127.0.0.3"

HOLDER = r"""
import os, signal, sys
from shmcancel import Registry
reg = Registry.attach(sys.argv[1])
with reg.lock:
    sys.stdout.write("held\n")
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGSTOP)
reg.close()
"""


def legit_source(i: int) -> str:
    """A loopback address of its own for well-behaved client ``i`` (any 127/8 address binds)."""
    return f"127.0.1.{1 + i % 250}"


# ------------------------------------------------------------------------------ figures


@dataclass
class Stats:
    """Counters of one scenario, shared by its client threads (guarded by ``lock``)."""

    served: int = 0
    s5xx: int = 0
    s503: int = 0
    conn: int = 0
    timeouts: int = 0
    bystander: int = 0
    lost: int = 0
    other: int = 0
    cancelled: int = 0
    kills: int = 0
    unloaded: list[float] = field(default_factory=list)  # seconds
    loaded: list[float] = field(default_factory=list)
    killed_keys: set[tuple[str, str]] = field(default_factory=set)  # (scope, id) maybe left
    samples: dict[str, list[str]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, what: str, sample: str | None = None, n: int = 1) -> None:
        with self.lock:
            setattr(self, what, getattr(self, what) + n)
            if sample is not None:
                kept = self.samples.setdefault(what, [])
                if len(kept) < 5:
                    kept.append(sample[:300])


def percentile(xs: list[float], q: float) -> float | None:
    """The ``q``-quantile of ``xs`` (nearest rank), ``None`` when empty."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


# ------------------------------------------------------------------------------ HTTP


class ConnLost(Exception):
    """The connection failed or closed without a reply (a SIGKILLed worker, a full backlog)."""


class NoReply(Exception):
    """No reply within the client's timeout."""


@dataclass
class Reply:
    status: int
    headers: dict[str, str]  # lower-case names
    msg: dict[str, Any] | None  # the JSON-RPC message carrying an "id", if any


def _message(content_type: str, data: bytes) -> dict[str, Any] | None:
    if not data:
        return None
    try:
        if content_type.startswith("text/event-stream"):
            for line in data.decode().splitlines():
                if line.startswith("data:"):
                    obj = json.loads(line[5:])
                    if isinstance(obj, dict) and "id" in obj:
                        return obj
            return None
        obj = json.loads(data)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


class Http:
    """One request per connection to the server under test, from a chosen loopback address;
    every reply is counted in ``stats``."""

    def __init__(self, port: int, stats: Stats) -> None:
        self.port = port
        self.stats = stats

    def connect(self, source: str, timeout: float = REQUEST_TIMEOUT) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout,
                                          source_address=(source, 0))

    def send(self, method: str, body: Any, headers: dict[str, str], source: str) -> Reply:
        conn = self.connect(source)
        try:
            conn.request(method, "/mcp", body=None if body is None else json.dumps(body).encode(),
                         headers={**headers, "Connection": "close"})
            r = conn.getresponse()
            data = r.read()
        except TimeoutError:
            self.stats.add("timeouts", f"{method} {str(body)[:120]}")
            raise NoReply from None
        except (OSError, http.client.HTTPException) as e:
            self.stats.add("conn")
            time.sleep(0.01)  # a dead server is not hammered by clients that retry at once
            raise ConnLost(str(e)) from None
        finally:
            conn.close()
        reply = Reply(r.status, {k.lower(): v for k, v in r.getheaders()},
                      _message(r.getheader("Content-Type") or "", data))
        self.stats.add("served")
        if 500 <= r.status < 600:
            if r.status == 503 and "retry-after" in reply.headers:
                self.stats.add("s503")
            else:
                self.stats.add("s5xx", f"{r.status} {data[:200]!r} for {str(body)[:100]}")
        return reply


def _legacy_headers(sid: str | None, version: str | None = LEGACY) -> dict[str, str]:
    h = {"Accept": ACCEPT, "Content-Type": "application/json"}
    if version is not None:
        h["MCP-Protocol-Version"] = version
    if sid is not None:
        h["Mcp-Session-Id"] = sid
    return h


def _modern_call(rid: int, tool: str, args: dict[str, Any]) -> tuple[dict[str, str], Any]:
    headers = {"Accept": ACCEPT, "Content-Type": "application/json",
               "MCP-Protocol-Version": MODERN, "Mcp-Method": "tools/call", "Mcp-Name": tool}
    body = {"jsonrpc": "2.0", "id": rid, "method": "tools/call",
            "params": {"name": tool, "arguments": args, "_meta": meta("torture")}}
    return headers, body


def _initialize(rid: int = 0) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": rid, "method": "initialize",
            "params": {"protocolVersion": LEGACY, "capabilities": {},
                       "clientInfo": {"name": "torture", "version": "1"}}}


class Outcome:
    """What became of a ``tools/call``."""

    OK, CANCELLED, ERROR, LOST, CONN, TIMEOUT, STATUS = (
        "ok", "cancelled", "error", "lost", "conn", "timeout", "status")


class SessionClient:
    """A 2025-11-25 client with a session, from one loopback address. ``legit``: a 404 for its
    session, which it never deleted, counts as a lost session (then it starts a new one)."""

    def __init__(self, http_: Http, source: str, *, legit: bool = True) -> None:
        self.http = http_
        self.source = source
        self.legit = legit
        self.sid: str | None = None

    @property
    def scope(self) -> str:
        return f"session:{self.sid}"

    def open(self) -> bool:
        """``initialize`` + ``notifications/initialized``; False when no session came of it."""
        self.sid = None
        try:
            r = self.http.send("POST", _initialize(), _legacy_headers(None, None), self.source)
        except (ConnLost, NoReply):
            return False
        sid = r.headers.get("mcp-session-id")
        if r.status != 200 or not sid:
            if not 500 <= r.status < 600:  # a 5xx is counted (5xx or 503) already
                self.http.stats.add("other", f"initialize: {r.status} {r.msg}")
            return False
        self.sid = sid
        with contextlib.suppress(ConnLost, NoReply):
            self.post({"jsonrpc": "2.0", "method": "notifications/initialized"})
        return True

    def post(self, body: Any) -> Reply:
        r = self.http.send("POST", body, _legacy_headers(self.sid), self.source)
        if r.status == 404 and self.legit:
            self.http.stats.add("lost", f"{self.source} session {self.sid}: {r.msg}")
            self.sid = None
        return r

    def call(self, rid: int, tool: str, args: dict[str, Any]) -> tuple[str, Any]:
        """``(Outcome, detail)``. Reopens the session first if it has none."""
        if self.sid is None and not self.open():
            return Outcome.LOST, None
        try:
            r = self.post({"jsonrpc": "2.0", "id": rid, "method": "tools/call",
                           "params": {"name": tool, "arguments": args}})
        except ConnLost:
            return Outcome.CONN, None
        except NoReply:
            return Outcome.TIMEOUT, None
        return classify(r)

    def cancel(self, rid: int) -> int | None:
        """Send ``notifications/cancelled``; its HTTP status, ``None`` without a reply."""
        if self.sid is None:
            return None
        try:
            return self.post({"jsonrpc": "2.0", "method": "notifications/cancelled",
                              "params": {"requestId": rid, "reason": "torture"}}).status
        except ConnLost:
            return 0
        except NoReply:
            return None

    def delete(self) -> None:
        if self.sid is None:
            return
        with contextlib.suppress(ConnLost, NoReply):
            r = self.http.send("DELETE", None, _legacy_headers(self.sid), self.source)
            if r.status == 404 and self.legit:
                self.http.stats.add("lost", f"DELETE {self.sid}: 404")
        self.sid = None


def classify(r: Reply) -> tuple[str, Any]:
    """A ``tools/call`` reply as ``(Outcome, detail)``."""
    if r.status == 404:
        return Outcome.LOST, None
    if r.status != 200 or r.msg is None:
        return Outcome.STATUS, r.status
    if "error" in r.msg:
        code = r.msg["error"].get("code") if isinstance(r.msg["error"], dict) else None
        return (Outcome.CANCELLED, code) if code == CANCELLED else (Outcome.ERROR, r.msg)
    return Outcome.OK, r.msg.get("result")


def modern_call(http_: Http, rid: int, tool: str, args: dict[str, Any]) -> tuple[str, Any]:
    headers, body = _modern_call(rid, tool, args)
    try:
        return classify(http_.send("POST", body, headers, MODERN_SOURCE))
    except ConnLost:
        return Outcome.CONN, None
    except NoReply:
        return Outcome.TIMEOUT, None


def modern_disconnect(http_: Http, rid: int, after: float) -> None:
    """Start a 2026-07-28 ``sleep`` and close the connection ``after`` seconds later: the
    cancellation of that wire."""
    headers, body = _modern_call(rid, "sleep", {"seconds": 5})
    conn = http_.connect(MODERN_SOURCE)
    try:
        conn.request("POST", "/mcp", body=json.dumps(body).encode(),
                     headers={**headers, "Connection": "close"})
        time.sleep(after)
    except OSError:
        http_.stats.add("conn")
    finally:
        conn.close()


def judge(stats: Stats, outcome: tuple[str, Any], *, was_cancelled: bool, what: str) -> None:
    """Count an outcome: -32800 for a call nobody cancelled is a bystander; a JSON-RPC error or
    an HTTP status other than 503 + Retry-After (counted already) is unexpected."""
    kind, detail = outcome
    if kind == Outcome.CANCELLED:
        if was_cancelled:
            stats.add("cancelled")
        else:
            stats.add("bystander", what)
    elif kind == Outcome.ERROR or (kind == Outcome.STATUS and not 500 <= detail < 600):
        stats.add("other", f"{what}: {detail}")  # a 5xx is counted (5xx or 503) already


# ------------------------------------------------------------------------------ clients


class Ids:
    """Request ids a client reuses (1..3): reusing an id is where a stale cancellation row shows.
    An id whose cancel got no reply (the server may still record it) is retired."""

    def __init__(self) -> None:
        self.pool = [1, 2, 3]
        self.next_fresh = 1000
        self.last: dict[int, str] = {}  # what was last done with an id (for the samples)

    def after(self, rid: int) -> str:
        return f"id {rid} (last: {self.last.pop(rid, 'a plain call')})"

    def take(self, i: int) -> int:
        return self.pool[i % len(self.pool)]

    def retire(self, rid: int) -> None:
        self.pool = [self.next_fresh if x == rid else x for x in self.pool]
        self.next_fresh += 1


@dataclass
class Ctx:
    """What the threads of one scenario share."""

    g: Gunicorn
    http: Http
    stats: Stats
    stop: threading.Event
    seed: int


def mixed_client(ctx: Ctx, idx: int) -> None:
    """Both wires, all kinds of calls, until ``ctx.stop``; one operation at a time."""
    rng = random.Random(ctx.seed * 1000 + idx)
    st = ctx.stats
    s = SessionClient(ctx.http, legit_source(idx))
    ids = Ids()
    n = 0
    while not ctx.stop.is_set():
        n += 1
        rid = ids.take(n)
        x = rng.random()
        if x < 0.25:
            judge(st, s.call(rid, "echo", {"text": "hi"}), was_cancelled=False,
                  what=f"echo {s.sid} {ids.after(rid)}")
        elif x < 0.45:
            cancel_race(ctx, s, ids, rid, rng)
        elif x < 0.60:
            judge(st, modern_call(ctx.http, rid, "echo", {"text": "hi"}), was_cancelled=False,
                  what="modern echo")
        elif x < 0.70:
            judge(st, modern_call(ctx.http, rid, "sleep", {"seconds": rng.uniform(0.01, 0.2)}),
                  was_cancelled=False, what="modern sleep")
        elif x < 0.80:
            modern_disconnect(ctx.http, rid, rng.uniform(0.0, 0.2))
        elif x < 0.90:
            short = SessionClient(ctx.http, s.source)
            if short.open():
                judge(st, short.call(1, "echo", {"text": "short"}), was_cancelled=False,
                      what="short-session echo")
                short.delete()
        else:
            judge(st, s.call(rid, "sleep", {"seconds": rng.uniform(0.01, 0.2)}),
                  was_cancelled=False, what=f"sleep {s.sid} {ids.after(rid)}")


def cancel_race(ctx: Ctx, s: SessionClient, ids: Ids, rid: int, rng: random.Random) -> None:
    """An ``echo`` or a short ``sleep``, and one or two ``notifications/cancelled`` for it sent
    together from other connections at a random moment between its start and shortly after its
    end: often while it runs, often as it ends. The next call with this id (cancelled by
    nobody) tells whether a cancellation outlived it."""
    if s.sid is None and not s.open():
        return
    sid = s.sid
    args: dict[str, Any]
    if rng.random() < 0.4:
        tool, args, span = "echo", {"text": "race"}, 0.005  # ~ the call's time in the server
    else:
        seconds = rng.uniform(0.005, 0.3)
        tool, args, span = "sleep", {"seconds": seconds}, seconds + 0.02
    result: list[tuple[str, Any]] = []
    statuses: list[int | None] = []
    call = threading.Thread(target=lambda: result.append(s.call(rid, tool, args)), daemon=True)
    cancels = [threading.Thread(target=lambda: statuses.append(s.cancel(rid)), daemon=True)
               for _ in range(rng.choice((1, 2)))]
    call.start()
    time.sleep(rng.uniform(0.0, span * 1.2))
    for t in cancels:
        t.start()
    for t in (call, *cancels):
        t.join(REQUEST_TIMEOUT + 2)
    if any(t.is_alive() for t in (call, *cancels)) or len(statuses) < len(cancels) \
            or None in statuses:
        ids.retire(rid)  # the server may record a cancel later: not a reusable id any more
    for status in statuses:
        if status not in (202, None, 0, 404) and not 500 <= status < 600:
            ctx.stats.add("other", f"notifications/cancelled: {status}")
    ids.last[rid] = (f"{tool} raced by {len(cancels)} cancel(s) {statuses}, "
                     f"outcome {result[0][0] if result else 'none'}")
    if result:
        if result[0][0] == Outcome.CONN:
            ctx.stats.killed_keys.add((f"session:{sid}", str(rid)))
        judge(ctx.stats, result[0], was_cancelled=True, what=f"cancelled {tool} {sid} {rid}")


def latency_client(ctx: Ctx, out: list[float], until: Callable[[], bool]) -> None:
    """The well-behaved client: one ``echo`` at a time in its own session, 10 ms apart; the
    latency of each successful one goes to ``out`` (seconds)."""
    s = SessionClient(ctx.http, LATENCY_SOURCE)
    n = 0
    while not until():
        n += 1
        t0 = time.monotonic()
        outcome = s.call(n, "echo", {"text": "latency"})
        dt = time.monotonic() - t0
        judge(ctx.stats, outcome, was_cancelled=False, what="latency echo")
        if outcome[0] == Outcome.OK:
            out.append(dt)
        time.sleep(0.01)


def killer(ctx: Ctx) -> None:
    """SIGKILL a random worker of the current master every 0.3-0.9 s."""
    rng = random.Random(ctx.seed)
    while not ctx.stop.wait(rng.uniform(0.3, 0.9)):
        pids = ctx.g.worker_pids()
        if pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(rng.choice(pids), signal.SIGKILL)
                ctx.stats.add("kills")


def idle_client(ctx: Ctx, s: SessionClient, idx: int) -> None:
    """A client that keeps its session and uses it every 0.5-1.5 s."""
    rng = random.Random(ctx.seed * 1000 + idx)
    n = 0
    while not ctx.stop.wait(rng.uniform(0.5, 1.5)):
        n += 1
        judge(ctx.stats, s.call(n, "echo", {"text": "idle"}), was_cancelled=False,
              what="idle echo")


def session_flooder(ctx: Ctx) -> None:
    """``initialize`` in a loop from one address, never deleting a session."""
    while not ctx.stop.is_set():
        with contextlib.suppress(ConnLost, NoReply):
            ctx.http.send("POST", _initialize(), _legacy_headers(None, None), FLOOD_SOURCE)


def sleeper(ctx: Ctx, idx: int) -> None:
    """A session running ``sleep`` 0.1-0.4 s with ids 1..3, cancelled by nobody."""
    rng = random.Random(ctx.seed * 1000 + idx)
    s = SessionClient(ctx.http, legit_source(idx))
    n = 0
    while not ctx.stop.is_set():
        n += 1
        judge(ctx.stats, s.call(1 + n % 3, "sleep", {"seconds": rng.uniform(0.1, 0.4)}),
              was_cancelled=False, what="sleeper")


def cancel_flooder(ctx: Ctx) -> None:
    """One client cancelling ids 1..1000, round and round, in its own session."""
    s = SessionClient(ctx.http, CANCEL_FLOOD_SOURCE, legit=False)
    i = 0
    while not ctx.stop.is_set():
        if s.sid is None and not s.open():
            ctx.stop.wait(0.05)
            continue
        status = s.cancel(1 + i % 1000)
        if status not in (202, None, 0, 404) and not 500 <= status < 600:
            ctx.stats.add("other", f"flood cancel: {status}")
        i += 1


# ------------------------------------------------------------------------------ processes


def proc_state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return data[data.rindex(b")") + 2:].split()[0].decode()


@contextlib.contextmanager
def lock_holder(g: Gunicorn, deadline: float) -> Iterator[subprocess.Popen[bytes]]:
    """A process attached to ``g``'s registry that takes its lock and SIGSTOPs itself; yields
    once it is stopped. On leaving it is SIGCONTed (it releases the lock and exits) and, if it
    lingers, SIGKILLed, by pid."""
    env = {**os.environ, "SHMCANCEL_REGISTRY": g.registry_name}
    p = subprocess.Popen([sys.executable, "-c", HOLDER, g.registry_name], cwd=REPO_ROOT,
                         env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         start_new_session=True)
    try:
        assert p.stdout is not None
        left = deadline - time.monotonic()
        ready, _, _ = select.select([p.stdout], [], [], max(0.0, left))
        if not ready or p.stdout.readline().strip() != b"held":
            raise RuntimeError("the lock holder did not take the lock in time")
        wait_until(lambda: proc_state(p.pid) in ("T", "t"), deadline,
                   what="the lock holder to stop")
        yield p
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signal.SIGCONT)
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
            p.wait(timeout=5)
        if p.stdout is not None:
            p.stdout.close()


def _owner_alive(value: Any) -> bool:
    """Whether the process of an in-flight row's ``(pid, start, thread, token)`` lives."""
    if isinstance(value, tuple | list) and len(value) >= 2 and all(
            isinstance(x, int) for x in value[:2]):
        return procinfo.alive(value[0], value[1])
    return False


def rows_left(name: str, killed: set[tuple[str, str]]) -> tuple[int, int, list[str]]:
    """``(rows, killed_rows, samples)`` of registry ``name``, read-only: cancellation and
    in-flight rows, where a cancellation row of a call whose worker was killed is counted apart."""
    reg = Registry.attach(name, readonly=True)
    try:
        cancels = [k for k, _ in reg.table("cancellations").scan()]
        flights = [(k, v) for k, v in reg.table("in_flight").scan()]
    finally:
        reg.close()
    explained = [k for k in cancels if isinstance(k, tuple | list) and tuple(k) in killed]
    rest = [f"cancellation {k!r}" for k in cancels if k not in explained]
    rest += [f"in flight {k!r} owner {v!r} "
             f"{'alive' if _owner_alive(v) else 'gone'}" for k, v in flights]
    return len(rest), len(explained), rest[:5]


# ------------------------------------------------------------------------------ scenarios


def run_threads(ctx: Ctx, targets: list[Callable[[], None]], load_end: float,
                events: Callable[[], None] | None = None) -> None:
    """Run ``targets`` in threads until ``load_end`` (``events``, if any, runs meanwhile in this
    thread and must return by then); then stop them and join each with a deadline."""
    threads = [threading.Thread(target=t, daemon=True) for t in targets]
    for t in threads:
        t.start()
    try:
        if events is not None:
            events()
        ctx.stop.wait(max(0.0, load_end - time.monotonic()))
    finally:
        ctx.stop.set()
        deadline = time.monotonic() + REQUEST_TIMEOUT + 5
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        stuck = sum(t.is_alive() for t in threads)
        if stuck:
            raise RuntimeError(f"{stuck} client thread(s) did not finish in time")


def with_latency(ctx: Ctx) -> list[Callable[[], None]]:
    return [lambda: latency_client(ctx, ctx.stats.loaded, ctx.stop.is_set)]


def steady(ctx: Ctx, load_end: float, clients: int) -> None:
    targets = [lambda i=i: mixed_client(ctx, i) for i in range(clients)]
    run_threads(ctx, [*targets, *with_latency(ctx), lambda: killer(ctx)], load_end)


def lock_stall(ctx: Ctx, load_end: float, clients: int, lock_timeout: float) -> None:
    stall = 3 * lock_timeout
    t0 = time.monotonic()
    load_end = max(load_end, t0 + stall + 1.5)
    start_at = t0 + min(0.5, (load_end - t0 - stall) / 3)

    def events() -> None:
        if ctx.stop.wait(max(0.0, start_at - time.monotonic())):
            return
        with lock_holder(ctx.g, time.monotonic() + 10):
            ctx.stop.wait(stall)

    targets = [lambda i=i: mixed_client(ctx, i) for i in range(clients)]
    run_threads(ctx, [*targets, *with_latency(ctx)], load_end, events)


def hup_usr2(ctx: Ctx, load_end: float, clients: int) -> None:
    g = ctx.g
    t0 = time.monotonic()
    load_end = max(load_end, t0 + 3.0)
    span = load_end - t0

    def events() -> None:
        ctx.stop.wait(span / 4)
        before = set(g.worker_pids())
        g.signal(signal.SIGHUP)
        wait_until(lambda: (lambda now: len(now) == g.workers and not now & before)(
            set(g.worker_pids())), time.monotonic() + 20, what="new workers after HUP")
        ctx.stop.wait(max(0.0, t0 + span / 2 - time.monotonic()))
        old = g.pid
        g.upgrade(time.monotonic() + 30)
        os.kill(old, signal.SIGTERM)
        wait_until(lambda: not alive(old), time.monotonic() + 20,
                   what=f"the old master {old} to exit after USR2")

    targets = [lambda i=i: mixed_client(ctx, i) for i in range(clients)]
    run_threads(ctx, [*targets, *with_latency(ctx)], load_end, events)


def session_flood(ctx: Ctx, load_end: float) -> None:
    idle = [SessionClient(ctx.http, legit_source(i)) for i in range(8)]
    for s in idle:
        if not s.open():
            raise RuntimeError("a well-behaved client could not open a session")
    targets = [lambda s=s, i=i: idle_client(ctx, s, i) for i, s in enumerate(idle)]
    flood = [lambda: session_flooder(ctx) for _ in range(2)]
    run_threads(ctx, [*targets, *flood, *with_latency(ctx)], load_end)


def cancel_flood(ctx: Ctx, load_end: float) -> None:
    targets = [lambda i=i: sleeper(ctx, i) for i in range(20)]
    run_threads(ctx, [*targets, lambda: cancel_flooder(ctx), *with_latency(ctx)], load_end)


@dataclass
class Options:
    seconds: float
    clients: int
    worker_class: str
    threads: int
    lock_timeout: float
    sessions: int
    prefix: str
    seed: int
    keep_logs: str | None


def run_scenario(name: str, slice_end: float, opts: Options) -> dict[str, Any]:
    """Start a gunicorn, measure the baseline, run scenario ``name``, read the rows left, stop."""
    stats = Stats()
    reg_name = f"{opts.prefix}-{name}"
    result: dict[str, Any] = {"name": name, "registry": reg_name, "error": None}
    env = {"SHMCANCEL_TORTURE_LOCK_TIMEOUT": str(opts.lock_timeout),
           "SHMCANCEL_TORTURE_SESSIONS": str(opts.sessions)}
    g = Gunicorn(None, registry_name=reg_name, config=CONFIG, workers=4,
                 worker_class=opts.worker_class, threads=opts.threads, env=env, timeout=30.0)
    t0 = time.monotonic()
    rows = killed_rows = 0
    row_samples: list[str] = []
    try:
        g.start()
        ctx = Ctx(g, Http(g.port, stats), stats, threading.Event(), opts.seed)
        base = Ctx(g, ctx.http, stats, threading.Event(), opts.seed)
        warm: list[float] = []  # the first calls of fresh workers are not the baseline
        latency_client(base, warm, lambda: len(warm) >= WARMUP_CALLS
                       or time.monotonic() > t0 + 40)
        latency_client(base, stats.unloaded, lambda: len(stats.unloaded) >= BASELINE_CALLS
                       or time.monotonic() > t0 + 40)
        load_end = max(time.monotonic() + MIN_LOAD, slice_end - DRAIN)
        if name == "steady":
            steady(ctx, load_end, opts.clients)
        elif name == "lock-stall":
            lock_stall(ctx, load_end, opts.clients, opts.lock_timeout)
        elif name == "hup-usr2":
            hup_usr2(ctx, load_end, opts.clients)
        elif name == "session-flood":
            session_flood(ctx, load_end)
        else:
            cancel_flood(ctx, load_end)
        rows_deadline = time.monotonic() + max(ROWS_WAIT, 2 * opts.lock_timeout)
        while True:
            rows, killed_rows, row_samples = rows_left(reg_name, stats.killed_keys)
            if rows == 0 or time.monotonic() > rows_deadline:
                break
            time.sleep(0.05)
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    finally:
        try:
            log = g.log()
            result["tracebacks"] = log.count("Traceback (most recent call last)")
            if opts.keep_logs:
                os.makedirs(opts.keep_logs, exist_ok=True)
                with contextlib.suppress(OSError):
                    shutil.copy(g.log_path, os.path.join(opts.keep_logs, f"{name}.log"))
            g.stop()
        finally:
            g.cleanup()
    p50, p99 = percentile(stats.loaded, 0.5), percentile(stats.loaded, 0.99)
    u50, u99 = percentile(stats.unloaded, 0.5), percentile(stats.unloaded, 0.99)
    def ms(x: float | None) -> float | None:
        return None if x is None else round(x * 1000, 2)

    result.update({
        "served": stats.served, "5xx": stats.s5xx, "503": stats.s503,
        "bystander": stats.bystander, "lost": stats.lost, "rows": rows,
        "killed_rows": killed_rows, "conn": stats.conn, "timeouts": stats.timeouts,
        "other": stats.other, "cancelled": stats.cancelled, "kills": stats.kills,
        "p50_ms": ms(p50), "p99_ms": ms(p99), "p50_unloaded_ms": ms(u50),
        "p99_unloaded_ms": ms(u99), "latency_samples": len(stats.loaded),
        "seconds": round(time.monotonic() - t0, 1),
        "samples": {**stats.samples, **({"rows": row_samples} if row_samples else {})},
    })
    result["failed"] = [k for k in MUST_BE_ZERO if result[k]]
    return result


def line(r: dict[str, Any]) -> str:
    def must(k: str, label: str) -> str:
        return f"{label} {r[k]}{'!' if r[k] else '*'}"

    def ratio(a: float | None, b: float | None) -> str:
        if a is None or b is None:
            return "n/a"
        return f"{a:.1f} ms ({a / b:.1f}x of {b:.1f})" if b > 0 else f"{a:.1f} ms"

    s = (f"{r['name']:<14} served {r['served']:>6}  {must('5xx', '5xx')}  "
         f"{must('bystander', 'bystander')}  {must('lost', 'lost')}  {must('rows', 'rows')}  | "
         f"503 {r['503']} conn {r['conn']} timeouts {r['timeouts']} other {r['other']} "
         f"cancelled {r['cancelled']} kills {r['kills']} killed_rows {r['killed_rows']} "
         f"tracebacks {r.get('tracebacks', 0)} | p50 {ratio(r['p50_ms'], r['p50_unloaded_ms'])} "
         f"p99 {ratio(r['p99_ms'], r['p99_unloaded_ms'])}")
    if r["error"]:
        s += f"  ERROR! {r['error']}"
    return s + ("  FAIL" if r["failed"] else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0,
                    help="budget for all scenarios together (default 60)")
    ap.add_argument("--only", nargs="+", choices=SCENARIOS, help="run only these scenarios")
    ap.add_argument("--json", action="store_true",
                    help="print one JSON object on stdout (the lines go to stderr)")
    ap.add_argument("--no-fail", action="store_true", help="exit 0 even when a figure is not 0")
    ap.add_argument("--clients", type=int, default=6, help="mixed-load clients (default 6)")
    ap.add_argument("--worker-class", default="gthread", choices=("gthread", "sync"))
    ap.add_argument("--threads", type=int, default=8, help="threads per gthread worker")
    ap.add_argument("--lock-timeout", type=float, default=0.5)
    ap.add_argument("--sessions", type=int, default=256, help="the registry's session_capacity")
    ap.add_argument("--registry-prefix", default=f"torture-{os.getpid()}-{uuid.uuid4().hex[:6]}",
                    help="registry names are PREFIX-SCENARIO")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--keep-logs", metavar="DIR", help="copy each scenario's gunicorn log here")
    a = ap.parse_args(argv)
    if not 1 <= a.seconds <= 3600 or not 1 <= a.clients <= 64 or not 0.05 <= a.lock_timeout <= 5:
        ap.error("--seconds 1..3600, --clients 1..64, --lock-timeout 0.05..5")
    opts = Options(a.seconds, a.clients, a.worker_class,
                   a.threads if a.worker_class == "gthread" else 1, a.lock_timeout, a.sessions,
                   a.registry_prefix, random.randrange(1 << 30) if a.seed is None else a.seed,
                   a.keep_logs)
    out = sys.stderr if a.json else sys.stdout

    def on_term(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)  # unwinds through every finally: all is stopped

    signal.signal(signal.SIGTERM, on_term)
    names = list(a.only or SCENARIOS)
    print(f"torture: {len(names)} scenario(s) in ~{opts.seconds:g} s, 4 {opts.worker_class} "
          f"workers x {opts.threads} threads, lock_timeout {opts.lock_timeout:g} s, seed "
          f"{opts.seed}; * must be 0, ! is a non-zero one", file=out, flush=True)
    t0 = time.monotonic()
    end = t0 + opts.seconds
    results = []
    for i, name in enumerate(names):
        slice_end = time.monotonic() + max(0.0, end - time.monotonic()) / (len(names) - i)
        r = run_scenario(name, slice_end, opts)
        results.append(r)
        print(line(r), file=out, flush=True)
    ok = not any(r["failed"] for r in results)
    if a.json:
        print(json.dumps({"ok": ok, "seed": opts.seed, "seconds": round(time.monotonic() - t0, 1),
                          "must_be_zero": list(MUST_BE_ZERO), "scenarios": results}))
    return 0 if ok or a.no_fail else 1


if __name__ == "__main__":
    sys.exit(main())
