"""shmcancel.gunicorn against a real gunicorn (contract §6.4): the example's gunicorn.conf.py
serving tests/apps/hooks_app.py on loopback, real HTTP, real signals. Nothing here sleeps to
synchronise: every wait polls a condition with a deadline.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import types
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from helpers.gunicorn_harness import (
    REPO_ROOT,
    Gunicorn,
    alive,
    booted,
    carrying,
    children,
    gunicorn_command,
    upgraded_masters,
    wait_until,
)
from helpers.mcp_client import ACCEPT, LEGACY, reply_of
from helpers.procs import reap, recv, wait_exit
from helpers.rows import in_flight_rows

from shmcancel import Cancellation
from shmcancel import gunicorn as hooks
from shmcancel.errors import REQUEST_CANCELLED
from shmcancel.shm.registry import Registry

pytestmark = pytest.mark.integration

CONF = "examples/gunicorn/gunicorn.conf.py"
APP = "tests.apps.hooks_app:app"
SEGMENT_DIR = "/dev/shm"


def segment_exists(name: str) -> bool:
    return os.path.exists(os.path.join(SEGMENT_DIR, "shmcancel." + name))


def master_threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("Threads:")).split()[1])


# --- a minimal MCP client on the 2025-11-25 wire (the SDK is exercised in test_sdk.py) -------


class Session:
    """One MCP session; each call is its own HTTP connection, as separate clients would be."""

    def __init__(self, url: str, timeout: float = 10.0) -> None:
        self.url = url
        self.timeout = timeout
        self._next = 0
        r = self.post({"jsonrpc": "2.0", "id": self.next_id(), "method": "initialize",
                       "params": {"protocolVersion": LEGACY, "capabilities": {},
                                  "clientInfo": {"name": "hooks-test", "version": "0"}}},
                      session=False)
        assert r.status_code == 200, r.text
        self.sid = r.headers["mcp-session-id"]
        r = self.post({"jsonrpc": "2.0", "method": "notifications/initialized"})
        assert r.status_code == 202, r.text

    def next_id(self) -> int:
        self._next += 1
        return self._next

    def headers(self, session: bool = True) -> dict[str, str]:
        h = {"Content-Type": "application/json", "Accept": ACCEPT}
        if session:
            h["Mcp-Session-Id"] = self.sid
            h["MCP-Protocol-Version"] = LEGACY
        return h

    def post(self, msg: dict, session: bool = True, timeout: float | None = None) -> httpx.Response:
        with httpx.Client(timeout=timeout or self.timeout) as c:
            return c.post(self.url, json=msg, headers=self.headers(session))

    def call(self, tool: str, args: dict, rid: int | None = None,
             timeout: float | None = None) -> dict:
        rid = self.next_id() if rid is None else rid
        return reply_of(self.post({"jsonrpc": "2.0", "id": rid, "method": "tools/call",
                                 "params": {"name": tool, "arguments": args}}, timeout=timeout))

    def cancel(self, rid: int) -> httpx.Response:
        return self.post({"jsonrpc": "2.0", "method": "notifications/cancelled",
                          "params": {"requestId": rid, "reason": "test"}})


@contextlib.contextmanager
def background(fn, *args) -> Iterator[dict]:
    """Run ``fn(*args)`` in a thread; the dict gets ``"result"`` or ``"error"``."""
    out: dict = {}

    def run() -> None:
        try:
            out["result"] = fn(*args)
        except BaseException as e:  # the test inspects it
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        yield out
    finally:
        t.join(timeout=15)


def in_flight(reg: Registry) -> list[tuple[str, str, int]]:
    """``(scope, request_id, pid)`` of every in-flight row."""
    return [(k[0], k[1], v[0]) for k, v in in_flight_rows(reg)]


def get(url: str, timeout: float = 5.0) -> dict:
    r = httpx.get(url, timeout=timeout)
    assert r.status_code == 200, r.text
    return r.json()


def base(g: Gunicorn) -> str:
    return f"http://127.0.0.1:{g.port}"


# --- one sync server shared by the tests that only kill its workers -------------------------


@pytest.fixture(scope="module")
def sync_server(module_shm_name) -> Iterator[tuple[Gunicorn, Registry]]:
    with Gunicorn(APP, registry_name=module_shm_name, config=CONF, workers=3) as g, \
            Registry.attach(module_shm_name, readonly=True) as reg:
        yield g, reg


def test_master_creates_workers_attach(sync_server):
    g, reg = sync_server
    assert reg.creator[0] == g.pid, "the master creates the registry"
    assert master_threads(g.pid) == 1, "no thread may exist in the master when it forks"
    seen = {}
    deadline = time.monotonic() + 10
    workers = set(g.worker_pids())
    while set(seen) != workers and time.monotonic() < deadline:
        w = get(base(g) + "/whoami")
        seen[w["pid"]] = w["registry"]
    assert set(seen) == workers, "every worker answered"
    assert set(seen.values()) == {reg.name}, "every worker is attached to the master's registry"


def lane_pids(reg: Registry) -> set[int]:
    """Pids owning a lane of any table (in_flight, session_calls)."""
    return {o[0] for lanes in reg.lanes.values() for _, o in lanes.lane_owners()}


def test_killed_worker_leaves_no_in_flight_row(sync_server):
    """Nor a lane: its session-call row (the 2025 wire) is freed with its in-flight row. Nor
    the cancellation recorded for its call before it died (the worker stopped first, so that
    its tool never sees it): it went only at its ``ttl``."""
    g, reg = sync_server
    s = Session(g.url)
    with background(s.call, "sleep", {"seconds": 30}, 7, 30):
        rows = wait_until(lambda: [r for r in in_flight(reg) if r[1] == "7"],
                          time.monotonic() + 5, what="the sleep call to be in flight")
        scope, victim = rows[0][0], rows[0][2]
        assert victim in g.worker_pids()
        assert {"in_flight", "session_calls"} <= {
            t for t, lanes in reg.lanes.items() for _, o in lanes.lane_owners() if o[0] == victim}
        os.kill(victim, signal.SIGSTOP)
        writable = Registry.attach(reg.name)  # the fixture's is read-only
        try:
            c = Cancellation(writable)
            assert c.cancel_if_in_flight(7, "user stop", scope)
            os.kill(victim, signal.SIGKILL)
            t0 = time.monotonic()
            wait_until(lambda: not any(r[2] == victim for r in in_flight(reg))
                       and victim not in lane_pids(reg) and not c.cancelled(7, scope),
                       time.monotonic() + 5, what="the dead worker's rows, lanes and "
                       "cancellation to go")
            took = time.monotonic() - t0
        finally:
            writable.close()
    # The janitor sweeps once a minute: only the master's child_exit can have been this quick.
    assert took < 2.0, took
    g.wait_workers(3, time.monotonic() + 10)


def test_worker_killed_holding_the_lock(sync_server):
    g, reg = sync_server
    before = reg.recoveries
    with background(lambda: httpx.get(base(g) + "/hold-lock", timeout=20)):
        owner = wait_until(reg.lock.owner, time.monotonic() + 5, what="a worker to hold the lock")
        assert owner[0] in g.worker_pids()
        os.kill(owner[0], signal.SIGKILL)
        t0 = time.monotonic()
        wait_until(lambda: reg.recoveries > before and reg.lock.owner() is None,
                   time.monotonic() + 5, what="the master to recover the lock")
        took = time.monotonic() - t0
    assert took < 2.0, took
    # The hook logs once it has also reaped the worker's rows, just after releasing the lock.
    wait_until(lambda: f"worker {owner[0]} died holding the registry lock" in g.log(),
               time.monotonic() + 5, what="the master to log the recovery")
    # Every tools/call takes the lock (track/untrack): the other workers keep serving.
    s = Session(g.url)
    for i in range(6):
        assert s.call("echo", {"text": f"hi {i}"})["result"]["content"][0]["text"] == f"hi {i}"
    g.wait_workers(3, time.monotonic() + 10)


def test_stuck_lock_holder_does_not_stall_the_master(sync_server):
    """A live worker keeps the lock while the two others die together, one mid-call: the master
    does not wait for the lock (it would for lock_timeout, 10 s) but replaces both at once (up to
    gunicorn 24 the second death is signalled while the master waits on the lock for the first,
    SIGCHLD blocked); the rows go when the holder dies in turn."""
    g, reg = sync_server
    s = Session(g.url)
    holder = 0
    with contextlib.ExitStack() as stack:
        stack.enter_context(background(s.call, "sleep", {"seconds": 30}, 21, 30))
        # in flight first: tools/call takes the lock to track itself
        busy = wait_until(lambda: [p for _, rid, p in in_flight(reg) if rid == "21"],
                          time.monotonic() + 5, what="the sleep call")[0]
        stack.enter_context(background(lambda: httpx.get(base(g) + "/hold-lock", timeout=30)))
        try:
            holder = wait_until(reg.lock.owner, time.monotonic() + 5, what="the holder")[0]
            assert holder != busy
            dead = [p for p in g.worker_pids() if p != holder]
            assert busy in dead and len(dead) == 2
            for pid in dead:
                os.kill(pid, signal.SIGKILL)
            t0 = time.monotonic()
            wait_until(lambda: not set(dead) & set(w := g.worker_pids()) and len(w) == 3,
                       time.monotonic() + 5, what="the dead workers' replacements")
            respawned = time.monotonic() - t0
            assert respawned < 2.0, respawned
            assert "left for later" in g.log()
            assert any(p == busy for _, _, p in in_flight(reg)), "no write could happen"
        finally:
            if holder:  # a live holder would stall every later test
                os.kill(holder, signal.SIGKILL)
        wait_until(lambda: not in_flight(reg), time.monotonic() + 5, what="every row to go")
    g.wait_workers(3, time.monotonic() + 10)


def test_workers_dying_together(sync_server):
    """Every worker SIGKILLed at once, each mid-call: up to gunicorn 24 the master runs
    child_exit inside its SIGCHLD handler, so a death lands while it is cleaning up after
    another. It must not hang: all rows go, new workers serve."""
    g, reg = sync_server
    s = Session(g.url)
    with contextlib.ExitStack() as stack:
        for i in range(3):
            stack.enter_context(background(s.call, "sleep", {"seconds": 30}, 100 + i, 30))
        busy = wait_until(lambda: (len(r := {p for _, _, p in in_flight(reg)}) == 3 and r),
                          time.monotonic() + 10, what="three calls on three workers")
        for pid in busy:
            os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not in_flight(reg), time.monotonic() + 5, what="every row to go")
    g.wait_workers(3, time.monotonic() + 15)
    assert not set(busy) & set(g.worker_pids())
    assert s.call("echo", {"text": "again"})["result"]["content"][0]["text"] == "again"


def test_sync_cancel_across_workers(sync_server):
    g, _ = sync_server
    s = Session(g.url)
    with background(s.call, "sleep", {"seconds": 20}, 11, 30) as out:
        wait_until(lambda: s.cancel(11).status_code == 202 and "result" in out,
                   time.monotonic() + 5, interval=0.05, what="the cancelled call to return")
    assert out["result"]["error"]["code"] == REQUEST_CANCELLED, out


# --- reloads and upgrades --------------------------------------------------------------------


def test_hup_reload_keeps_the_registry(shm_name):
    with Gunicorn(APP, registry_name=shm_name, config=CONF, workers=2) as g:
        reg = Registry.attach(shm_name)
        try:
            old = set(g.worker_pids())
            g.signal(signal.SIGHUP)
            new = wait_until(lambda: (set(w := g.worker_pids()) & old == set() and len(w) == 2
                                      and w), time.monotonic() + 15, what="new workers")
            assert segment_exists(shm_name)
            again = Registry.attach(shm_name)
            assert again.creator == reg.creator, "the same registry, not a new one"
            again.close()
            assert {get(base(g) + "/whoami")["registry"] for _ in range(4)} == {shm_name}
            assert set(new) == set(g.worker_pids())
        finally:
            reg.close()


@pytest.mark.parametrize("first_to_go", ["old", "new"])
def test_usr2_upgrade_keeps_the_registry_until_the_last_master(shm_name, first_to_go):
    with Gunicorn(APP, registry_name=shm_name, config=CONF, workers=2) as g:
        old = g.pid
        new = g.upgrade(time.monotonic() + 20)
        assert "attached to registry" in g.log(), g.log_tail()
        assert master_threads(new) == 1
        gone, stays = (old, new) if first_to_go == "old" else (new, old)
        os.kill(gone, signal.SIGTERM)
        wait_until(lambda: not alive(gone), time.monotonic() + 20, what="the master to exit")
        assert segment_exists(shm_name), f"unlinked under master {stays}:\n{g.log_tail()}"
        g.pid = stays
        s = Session(g.url)
        assert s.call("echo", {"text": "still here"})["result"]["content"][0]["text"] \
            == "still here"
        assert get(base(g) + "/whoami")["registry"] == shm_name
        os.kill(stays, signal.SIGTERM)
        wait_until(lambda: not alive(stays), time.monotonic() + 20, what="the last master")
        assert not segment_exists(shm_name), "the last master to exit unlinks"


def _exiting_master(name: str, go: int, done: int, told: int | None,
                    paused: tuple[int, int] | None = None) -> None:
    """A stand-in master (child): attached to registry ``name``, its peer's pid read from
    ``go``; runs ``on_exit`` with the peer as its USR2 counterpart, writes ``done``, and lives
    until ``told`` is written (so that each sees the other alive throughout; None: exits).
    ``paused``: (write, read) descriptors: it says so on the first and waits on the second
    between its look at the peer and its exit mark (descheduled there)."""
    reg = Registry.attach(name)
    hooks._state.registry, hooks._state.registry_name = reg, name
    hooks._state.owner_pid = os.getpid()
    if paused is not None:
        real = Registry.begin_exit

        def begin_exit(self: Registry) -> Any:
            os.write(paused[0], b"p")
            os.read(paused[1], 1)
            return real(self)
        Registry.begin_exit = begin_exit  # type: ignore[method-assign]  # this child only
    peer = int(os.read(go, 32))
    server = types.SimpleNamespace(reexec_pid=peer, master_pid=0, log=hooks._log)
    hooks.on_exit(server)
    os.write(done, b"x")
    if told is not None:
        os.read(told, 1)


@contextlib.contextmanager
def _stand_in_masters(name: str, pause_b: bool) -> Iterator[types.SimpleNamespace]:
    """Registry ``name`` and two forked stand-in masters A and B of it (:func:`_exiting_master`),
    each waiting for its peer's pid (``m.go(i, peer)``). ``m.done[i]`` says its on_exit ran;
    unless ``pause_b`` both then live until ``m.told`` is written; with it they exit, and B
    says ``p`` on ``m.paused`` and waits for ``m.cont`` between its look at A and its mark.
    ``m.pids`` are reaped (the test clears what it reaped itself), the registry unlinked."""
    owner = Registry.create(name)
    pipes = [os.pipe() for _ in range(7)]
    (go_a, go_a_w), (go_b, go_b_w), (done_a, done_a_w), (done_b, done_b_w), (told, told_w), \
        (paused, paused_w), (cont, cont_w) = pipes
    m = types.SimpleNamespace(pids=[], done=(done_a, done_b), told=told_w, paused=paused,
                              cont=cont_w)
    m.go = lambda i, peer: os.write((go_a_w, go_b_w)[i], str(peer).encode())
    try:
        for go, done, pause in ((go_a, done_a_w, None),
                                (go_b, done_b_w, (paused_w, cont) if pause_b else None)):
            pid = os.fork()
            if pid == 0:  # pragma: no cover - child
                code = 1
                try:
                    _exiting_master(name, go, done, None if pause_b else told, pause)
                    code = 0
                finally:
                    os._exit(code)
            m.pids.append(pid)
        yield m
    finally:
        for pid in m.pids:
            reap(pid)
        for r, w in pipes:
            os.close(r)
            os.close(w)
        owner.close()
        owner.unlink()


def test_two_usr2_masters_exiting_together_unlink_the_registry_once(shm_name):
    """After a USR2 upgrade, both masters stopped at once (systemd's stop mid-upgrade): each
    one's on_exit sees the other alive, and each left the registry to the other, so it was
    never unlinked. Now the later of the two finds the earlier's exit begun and unlinks."""
    with _stand_in_masters(shm_name, pause_b=False) as m:
        a, b = m.pids
        m.go(0, b)
        m.go(1, a)
        for r in m.done:
            assert recv(r, 30) == b"x"
        assert alive(a) and alive(b)
        assert not segment_exists(shm_name), "neither master unlinked the registry"
        os.write(m.told, b"xx")
        for pid in (a, b):
            assert wait_exit(pid, 10) == 0
        m.pids.clear()


def test_a_usr2_master_that_looked_at_its_peer_before_the_peer_exited_unlinks(shm_name):
    """B looks at its peer A (alive) and is descheduled before its exit mark; A marks its own,
    leaves the registry to B and exits. B then finds A's mark but A gone: it must unlink (it
    left the registry to a master no longer there)."""
    with _stand_in_masters(shm_name, pause_b=True) as m:
        a, b = m.pids
        m.go(1, a)
        assert recv(m.paused, 30) == b"p"  # B looked at A (alive) and waits before its mark
        m.go(0, b)
        assert recv(m.done[0], 30) == b"x"
        assert wait_exit(a, 10) == 0
        assert segment_exists(shm_name)  # A left it to B
        os.write(m.cont, b"c")
        assert recv(m.done[1], 30) == b"x"
        assert wait_exit(b, 10) == 0
        m.pids.clear()
        assert not segment_exists(shm_name), "B left the registry to a master gone"


def test_usr2_masters_stopped_together_leave_no_registry(shm_name):
    """The same with real gunicorn masters: SIGTERM to the old and the new one at once."""
    with Gunicorn(APP, registry_name=shm_name, config=CONF, workers=2) as g:
        old = g.pid
        new = g.upgrade(time.monotonic() + 20)
        for pid in (old, new):
            os.kill(pid, signal.SIGTERM)
        wait_until(lambda: not alive(old) and not alive(new), time.monotonic() + 30,
                   what="both masters to exit")
        assert not segment_exists(shm_name), g.log_tail()


def _create_is_refused(name: str, owner: int) -> None:
    """Another process's ``Registry.create(name)`` fails, naming the live ``owner``, and the
    segment stays."""
    out = subprocess.run(
        [sys.executable, "-c", f"import shmcancel; shmcancel.Registry.create({name!r})"],
        capture_output=True, text=True, timeout=30)
    assert out.returncode != 0 and f"in use by live pid {owner}" in out.stderr, out.stderr
    assert segment_exists(name)


def _kill_new_master(g: Gunicorn, new: int) -> None:
    """SIGKILL a USR2 upgrade's new master and its workers (out of the harness's reach once
    their master is gone); return once all are dead."""
    orphans = g.worker_pids(master=new)
    try:
        os.kill(new, signal.SIGKILL)
        wait_until(lambda: not alive(new), time.monotonic() + 20, what="the new master to die")
    finally:
        for pid in orphans:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not any(alive(p) for p in orphans), time.monotonic() + 20,
               what="the failed master's workers to die")


def _a_process_at(pid: int, tries: int = 20) -> int | None:
    """Fork a child that waits (killed by the caller) at ``pid``, through ``ns_last_pid``
    (what CRIU restores pids with); ``None`` when the pid could not be had."""
    for _ in range(tries):
        try:
            with open("/proc/sys/kernel/ns_last_pid", "w") as f:
                f.write(str(pid - 1))
        except OSError:
            return None
        child = os.fork()
        if child == 0:  # pragma: no cover - child
            time.sleep(60)
            os._exit(0)
        if child == pid:
            return child
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
    return None


def test_a_usr2_upgrade_joins_its_old_masters_registry_after_the_pid_was_reused(shm_name):
    """A USR2 master whose old master has exited joins the registry that one recorded. When
    the old master's pid was another process's by then, its start time was read as the old
    master's and the upgrade was refused as a registry 'created again by' that process."""
    old = os.fork()
    if old == 0:  # pragma: no cover - child: the old master, gone without unlinking
        with contextlib.suppress(BaseException):
            Registry.create(shm_name)
        os._exit(0)
    os.waitpid(old, 0)
    namesake = _a_process_at(old)
    if namesake is None:
        pytest.skip("cannot choose a pid here (/proc/sys/kernel/ns_last_pid)")
    try:
        reg = hooks._attach_parents(shm_name, old)
        assert reg is not None
        reg.close()
    finally:
        os.kill(namesake, signal.SIGKILL)
        os.waitpid(namesake, 0)


def test_failed_usr2_upgrade_old_master_adopts_the_registry_again(shm_name):
    with Gunicorn(APP, registry_name=shm_name, config=CONF, workers=2) as g:
        old = g.pid
        new = g.upgrade(time.monotonic() + 20)
        with Registry.attach(shm_name, readonly=True) as ro:
            assert ro.creator[0] == new  # the new master adopted it
        _kill_new_master(g, new)  # the upgrade fails: no hook runs in the old master
        g.pid = old
        os.kill(g.worker_pids(master=old)[0], signal.SIGKILL)  # child_exit runs in the old one
        with Registry.attach(shm_name, readonly=True) as ro:
            wait_until(lambda: ro.creator[0] == old, time.monotonic() + 10,
                       what="the old master to adopt the registry again")
        # So another create of that name is refused rather than replacing a live registry.
        _create_is_refused(shm_name, old)


def test_a_rolled_back_upgrade_leaves_the_registry_in_use_at_once(shm_name):
    """The new master of a USR2 upgrade adopts the registry, then dies (a rollback). Until the
    old master's next child_exit re-adopts it, the recorded creator is dead: the registry
    looked stale, so `shmtool cleanup --stale` removed it under the serving old master and a
    second server of that name replaced it. The creator an adoption replaced counts too."""
    with Gunicorn(APP, registry_name=shm_name, config=CONF, workers=2) as g:
        old = g.pid
        new = g.upgrade(time.monotonic() + 20)
        _kill_new_master(g, new)
        g.pid = old
        with Registry.attach(shm_name, readonly=True) as ro:
            assert ro.creator[0] == old and ro.info()["creator_alive"]
        tool = [sys.executable, "-m", "shmcancel.shmtool"]
        listed = subprocess.run([*tool, "list", "--json"], capture_output=True, text=True,
                                timeout=30)
        row = {r["name"]: r for r in json.loads(listed.stdout)["registries"]}[shm_name]
        assert (row["state"], row["creator_pid"]) == ("alive", old), row
        kept = subprocess.run([*tool, "cleanup", "--stale", shm_name], capture_output=True,
                              text=True, timeout=30)
        assert kept.returncode == 1 and f"kept {shm_name}" in kept.stderr, kept
        _create_is_refused(shm_name, old)
        init = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
                "params": {"protocolVersion": LEGACY, "capabilities": {},
                           "clientInfo": {"name": "t", "version": "1"}}}
        r = httpx.post(g.url, json=init, headers={"Accept": ACCEPT}, timeout=10)
        assert r.status_code == 200, r.text  # the old master serves on its registry


_SLOW_UPGRADE_CONF = """
import os, time
exec(open({example!r}).read())


def on_starting(server):
    # A USR2 master slow to get ready (heavy imports, say): it reaches when_ready only once the
    # old master has exited (bounded, in case the test is gone).
    old = int(os.environ.get("GUNICORN_PID", "0") or 0)
    deadline = time.monotonic() + 30
    while old and time.monotonic() < deadline:
        try:  # gone, or a zombie its parent (the test) has not reaped yet
            with open(f"/proc/{{old}}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
        except FileNotFoundError:
            break
        time.sleep(0.01)
"""


def test_usr2_master_ready_after_the_old_one_exited_joins_its_registry(shm_name, tmp_path):
    """USR2, then the old master stopped before the new one is ready: the old master leaves
    the registry to the new one, which must join it (sessions minted before survive), not
    take it for stale and create a new one (an audit: 404 for the old sessions)."""
    conf = tmp_path / "slow_upgrade.conf.py"
    conf.write_text(_SLOW_UPGRADE_CONF.format(example=os.path.abspath(CONF)))
    with Gunicorn(APP, registry_name=shm_name, config=str(conf), workers=2) as g:
        s = Session(g.url)
        old = g.pid
        ino = os.stat(f"/dev/shm/shmcancel.{shm_name}").st_ino
        g.signal(signal.SIGUSR2)
        new = wait_until(lambda: (upgraded_masters(old) or [None])[0], time.monotonic() + 20,
                         what="the USR2 master")
        g.masters.append(new)
        os.kill(old, signal.SIGTERM)
        wait_until(lambda: not alive(old), time.monotonic() + 30, what="the old master to exit")
        g.pid = new
        wait_until(lambda: re.search(rf"Listening at: \S+ \({new}\)", g.log()),
                   time.monotonic() + 30, what="the USR2 master to listen")
        g.wait_workers(2, time.monotonic() + 30, master=new)
        assert f"attached to registry {shm_name!r} of master {old}" in g.log(), g.log_tail()
        assert os.stat(f"/dev/shm/shmcancel.{shm_name}").st_ino == ino, "the same registry"
        assert s.call("echo", {"text": "kept"})["result"]["content"][0]["text"] == "kept"


_PARKING_CONF = """
import os, time
import shmcancel.gunicorn
from shmcancel.gunicorn import child_exit, on_exit, when_ready  # noqa: F401

control_socket_disable = True
graceful_timeout = 30


def post_fork(server, worker):
    shmcancel.gunicorn.post_fork(server, worker)
    # The first worker stays in the window between fork and gunicorn's init_signals until the
    # test has signalled it and lets it go (bounded, in case the test is gone).
    if not os.path.exists({parked!r}):
        with open({parked!r} + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.rename({parked!r} + ".tmp", {parked!r})
        deadline = time.monotonic() + 30
        while not os.path.exists({go!r}) and time.monotonic() < deadline:
            time.sleep(0.01)
"""


def test_worker_stopped_while_it_boots(shm_name, tmp_path):
    """A SIGTERM that reaches a worker before gunicorn has installed its handlers (that is
    after post_fork) stops it once booted. gunicorn alone would lose it (the worker still runs the
    master's handler inherited by fork) and a stopping master would then wait graceful_timeout
    (30 s) for that worker: the USR2 test's new master, stopped right after its workers were
    forked, hung like this on a loaded machine."""
    parked, go = tmp_path / "parked", tmp_path / "go"
    conf = tmp_path / "parking.conf.py"
    conf.write_text(_PARKING_CONF.format(parked=str(parked), go=str(go)))
    # the worker parks before gunicorn installs its handlers: start() must not wait for that
    with Gunicorn(APP, registry_name=shm_name, config=str(conf), workers=1,
                  wait_booted=False) as g:
        pid = int(wait_until(lambda: parked.exists() and parked.read_text(),
                             time.monotonic() + 10, what="the first worker to park"))
        assert g.worker_pids() == [pid]
        os.kill(pid, signal.SIGTERM)
        go.touch()
        wait_until(lambda: not alive(pid), time.monotonic() + 10,
                   what="the worker signalled while booting to exit")
        g.wait_workers(1, time.monotonic() + 10)
        assert get(base(g) + "/whoami")["registry"] == shm_name, "its replacement serves"
        os.kill(g.pid, signal.SIGTERM)
        wait_until(lambda: not alive(g.pid), time.monotonic() + 10, what="the master to exit")


_FAILING_MASTER_CONF = """
import shmcancel.gunicorn
from shmcancel.gunicorn import child_exit, on_exit, post_fork, when_ready  # noqa: F401

control_socket_disable = True


def pre_fork(server, worker):
    raise RuntimeError("a hook of the master fails")
"""


def _run_master(conf: str, env: dict[str, str], log: Any) -> int:
    """Run a gunicorn of ``APP`` (2 workers) with config ``conf`` that is expected to stop by
    itself, its output to ``log``; its exit status (killed by pid past 30 s)."""
    with open(log, "wb") as out:
        p = subprocess.Popen([*gunicorn_command(), "-c", conf, "-b", "127.0.0.1:0", "-w", "2",
                              APP], cwd=REPO_ROOT, stdin=subprocess.DEVNULL, env=env,
                             stdout=out, stderr=subprocess.STDOUT)
    try:
        return p.wait(30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)


def test_a_master_ended_by_an_exception_still_unlinks_its_registry(shm_name, tmp_path):
    """gunicorn skips ``on_exit`` when its arbiter ends by an exception: here a hook of the
    master failing in its main loop ("Unhandled exception in main loop", exit -1); several
    workers failing to boot together do the same (``HaltServer`` raised again inside
    ``halt()``). The registry it created must not stay in /dev/shm: the hooks unlink it at
    the master's exit."""
    conf = tmp_path / "failing.conf.py"
    conf.write_text(_FAILING_MASTER_CONF)
    log = tmp_path / "gunicorn.log"
    status = _run_master(str(conf), {**os.environ, "SHMCANCEL_REGISTRY": shm_name}, log)
    text = log.read_text()
    assert f"created registry {shm_name!r}" in text, text[-3000:]
    assert "Unhandled exception in main loop" in text and status != 0, text[-3000:]
    assert f"registry {shm_name!r} unlinked" in text, text[-3000:]
    assert not segment_exists(shm_name)


def test_a_registry_truncated_under_the_server_stops_it_without_orphans(shm_name):
    """An operator truncates the live segment's file. A worker touching a page past its end
    dies of SIGBUS; the master's ``child_exit`` then reaped through the same mapping and died
    of it too: no ``on_exit``, the registry left behind, and the other workers orphaned,
    serving on over the broken mapping. Now the master touches none of it: the replacement
    worker cannot attach (one line), gunicorn stops, the registry's names go, nothing runs."""
    with Gunicorn(APP, registry_name=shm_name, config=CONF, workers=2) as g:
        os.truncate(f"{SEGMENT_DIR}/shmcancel.{shm_name}", 8192)
        victim = g.worker_pids()[0]
        os.kill(victim, signal.SIGKILL)  # the master's child_exit runs for it
        assert g._proc is not None
        code = g._proc.wait(30)
        assert code != -signal.SIGBUS, g.log_tail()
        assert "was truncated under the server" in g.log(), g.log_tail()
        wait_until(lambda: not carrying(shm_name) or None, time.monotonic() + 15,
                   what="every worker of the stopped server to exit")
        assert not segment_exists(shm_name)


def test_gthread_workers_serve_and_cancel(shm_name):
    with Gunicorn(APP, registry_name=shm_name, config=CONF, workers=2, worker_class="gthread",
                  threads=4) as g:
        assert master_threads(g.pid) == 1
        s = Session(g.url)
        assert s.call("echo", {"text": "t"})["result"]["content"][0]["text"] == "t"
        with background(s.call, "sleep", {"seconds": 20}, 5, 30) as out:
            wait_until(lambda: s.cancel(5).status_code == 202 and "result" in out,
                       time.monotonic() + 5, interval=0.05, what="the cancelled call to return")
        assert out["result"]["error"]["code"] == REQUEST_CANCELLED, out
        os.kill(g.pid, signal.SIGTERM)
        wait_until(lambda: not alive(g.pid), time.monotonic() + 20, what="the master to exit")
        assert not segment_exists(shm_name)


_CREATED = re.compile(r"shmcancel: created registry '([A-Za-z0-9_.-]+)'")


def test_two_instances_side_by_side(shm_name, shm_names):
    """Without SHMCANCEL_REGISTRY, each instance derives its own name (proc_name + address);
    a third one told to reuse a live instance's name refuses to start."""
    env = {"SHMCANCEL_REGISTRY": ""}  # the harness's registry_name (shm_name) goes unused
    with Gunicorn(APP, registry_name=shm_name, config=CONF, workers=1, env=env) as a, \
            Gunicorn(APP, registry_name=shm_name, config=CONF, workers=1, env=env) as b:
        names = []
        for g in (a, b):
            m = wait_until(lambda g=g: _CREATED.search(g.log()), time.monotonic() + 5,
                           what="the created line")
            names.append(m.group(1))
            shm_names.append(m.group(1))
        assert names[0] != names[1]
        assert all(n.startswith("gunicorn-shmcancel-example-") for n in names), names
        assert get(base(a) + "/whoami")["registry"] == names[0]
        assert get(base(b) + "/whoami")["registry"] == names[1]
        with pytest.raises(AssertionError) as e, \
                Gunicorn(APP, registry_name=shm_name, config=CONF, workers=1, timeout=15,
                         env={"SHMCANCEL_REGISTRY": names[0]}):
            pass
        assert f"Error: shmcancel: registry {names[0]} is in use by live pid {a.pid}, its " \
            "creator: stop that server first, or give this one another registry name (under " \
            "gunicorn: SHMCANCEL_REGISTRY)" in str(e.value), str(e.value)
        assert segment_exists(names[0]), "the refused instance left the live registry alone"


_RENAMED_CONF = """
exec(open({example!r}).read())
proc_name = open({proc_name!r}).read().strip()
"""


@pytest.mark.parametrize("reload_first", [False, True], ids=["usr2", "hup-then-usr2"])
def test_usr2_after_the_config_changed_the_derived_name_joins_the_live_registry(
        shm_name, shm_names, tmp_path, reload_first):
    """An upgrade deployed the usual way (edit gunicorn.conf.py, then USR2, perhaps after a HUP
    that re-read it): the new master reads the edited config, so a derived registry name (it
    covers ``proc_name``) comes out different. It created a second registry instead of joining
    the live one: the server split in two while both generations ran (a session minted before
    answered "Session not found"), and the old master left its registry "to" the new one, which
    never used it (leaked in /dev/shm). The USR2 master must join its old master's registry."""
    proc_name = tmp_path / "proc_name"
    proc_name.write_text("before-edit")
    conf = tmp_path / "renamed.conf.py"
    conf.write_text(_RENAMED_CONF.format(example=os.path.abspath(CONF),
                                         proc_name=str(proc_name)))
    with Gunicorn(APP, registry_name=shm_name, config=str(conf), workers=2,
                  env={"SHMCANCEL_REGISTRY": ""}) as g:  # derive the name from the config
        name = wait_until(lambda: _CREATED.search(g.log()), time.monotonic() + 5,
                          what="the created line").group(1)
        shm_names.append(name)
        s = Session(g.url)
        proc_name.write_text("after-edit")
        if reload_first:
            before = set(g.worker_pids())
            g.signal(signal.SIGHUP)
            wait_until(lambda: not set(g.worker_pids()) & before
                       and len(g.worker_pids()) == 2, time.monotonic() + 15, what="new workers")
            g.wait_workers(2, time.monotonic() + 15)
        old = g.pid
        new = g.upgrade(time.monotonic() + 20)
        shm_names.extend(_CREATED.findall(g.log()))  # whatever the USR2 master created
        assert f"attached to registry {name!r} of master {old}" in g.log(), g.log_tail()
        os.kill(old, signal.SIGTERM)
        wait_until(lambda: not alive(old), time.monotonic() + 20, what="the old master to exit")
        g.pid = new
        assert s.call("echo", {"text": "kept"})["result"]["content"][0]["text"] == "kept"
        assert get(base(g) + "/whoami")["registry"] == name
        with Registry.attach(name, readonly=True) as ro:
            assert ro.creator[0] == new
        assert _CREATED.findall(g.log()) == [name], "a second registry was created"


# --- the registry unlinked under a live server, its name taken by another -------------------


def _creator_words(name: str) -> tuple[int, int]:
    """The (pid, start) recorded as creator of the segment now at ``name`` (read-only)."""
    with Registry.attach(name, readonly=True) as ro:
        return ro.creator


def _maps_segment_at_name(pid: int, name: str) -> bool:
    """Process ``pid`` maps the segment now at registry ``name`` (not an unlinked one)."""
    path = os.path.join(SEGMENT_DIR, "shmcancel." + name)
    try:
        with open(f"/proc/{pid}/maps") as f:
            return any(line.rstrip("\n").endswith(" " + path) for line in f)
    except OSError:
        return False


def _joined(g: Gunicorn, before: set[int], name: str, master: int | None = None) -> list[int]:
    """Workers of ``g`` (of ``master``, default the current one) not in ``before`` that booted
    (gunicorn's init_signals ran) attached to the segment now at ``name``. Booted alone is not
    enough: a worker exiting has its signal handlers reset by the interpreter's finalization."""
    return [p for p in g.worker_pids(master)
            if p not in before and booted(p) and _maps_segment_at_name(p, name)]


@pytest.mark.parametrize("trigger", ["worker-killed", "hup", "usr2"])
def test_a_server_never_joins_another_servers_registry(shm_name, trigger):
    """§7: `shmtool unlink NAME --force` under a live server A makes its next worker fail to
    boot. When a second server B has meanwhile created a registry of the same name, A's next
    worker (a replacement, a HUP's new generation) or A's USR2 master attached to B's segment
    instead: A split in two (its old workers on the unlinked segment, the new one on B's), its
    sessions in B's table. Each must refuse with one line naming the registry, and leave B's
    registry alone (not adopted, not unlinked by A's exit)."""
    # A's graceful timeout bounds gunicorn's own halt, not ours: gunicorn 23 raises HaltServer
    # from reap_workers at the first worker that failed to boot, before it reaps the others.
    # After a HUP both new workers refuse; when both are dead before the master's SIGCHLD
    # handler runs (a busy CPU), their signals merge into one, the second stays an unreaped
    # zombie in WORKERS, and Arbiter.stop waits the whole graceful_timeout (30 s by default,
    # past this test's 20 s deadline) for it to leave.
    with Gunicorn(APP, registry_name=shm_name, config=CONF, workers=2,
                  extra_args=["--graceful-timeout", "5"]) as a:
        out = subprocess.run([sys.executable, "-m", "shmcancel.shmtool", "unlink", shm_name,
                              "--force"], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0 and not segment_exists(shm_name), out
        with Gunicorn(APP, registry_name=shm_name, config=CONF, workers=1) as b:
            b_creator = _creator_words(shm_name)
            assert b_creator[0] == b.pid
            b_ino = os.stat(os.path.join(SEGMENT_DIR, "shmcancel." + shm_name)).st_ino
            before = set(a.worker_pids())
            refused = f"registry {shm_name} was unlinked and created again by pid {b.pid}"
            deadline = time.monotonic() + 20
            if trigger == "usr2":
                a.signal(signal.SIGUSR2)
                # Refused: the new master logs the line and exits. Joined (the defect): it runs
                # workers of its own.
                joined = wait_until(
                    lambda: (refused in a.log() and "refused")
                    or [m for m in upgraded_masters(a.pid) if _joined(a, set(), shm_name, m)],
                    deadline, what="A's USR2 master to refuse or to boot workers")
                assert joined == "refused", f"A's USR2 master joined B's registry:\n{a.log_tail()}"
                # (Polled on A's children: an exiting master's environ is unreadable for a moment
                # before it is a zombie, which would make it look like a worker.)
                wait_until(lambda: set(children(a.pid)) == before, deadline,
                           what="A's USR2 master to exit, A's workers to stay")
                # A goes on serving on its own (unlinked) registry, all its workers alike.
                assert alive(a.pid)
                assert not [w for w in before if _maps_segment_at_name(w, shm_name)]
                assert get(base(a) + "/whoami")["registry"] == shm_name
            else:
                if trigger == "hup":
                    a.signal(signal.SIGHUP)
                else:
                    os.kill(sorted(before)[0], signal.SIGKILL)
                # Refused: A stops ("Worker failed to boot"). Joined (the defect): a new worker of
                # A boots, attached to B's segment.
                joined = wait_until(lambda: (not alive(a.pid) and ["none"])
                                    or _joined(a, before, shm_name),
                                    deadline, what="A to stop or to boot a worker into B's")
                assert joined == ["none"], \
                    f"A booted worker(s) {joined} into B's registry:\n{a.log_tail()}"
                assert refused in a.log(), a.log_tail()
                assert "Worker failed to boot" in a.log(), a.log_tail()
                if trigger == "worker-killed":
                    # (After a HUP, two new workers fail to boot: gunicorn's halt then raises
                    # HaltServer again while reaping the second and exits without on_exit.)
                    assert f"registry '{shm_name}' was unlinked already" in a.log(), a.log_tail()
            # B's registry is untouched: still at the name, still B's, B serves on it.
            assert os.stat(os.path.join(SEGMENT_DIR, "shmcancel." + shm_name)).st_ino == b_ino
            assert _creator_words(shm_name) == b_creator, "adopted by A"
            with Registry.attach(shm_name, readonly=True) as ro:
                assert ro.info()["creator_alive"]
            assert get(base(b) + "/whoami")["registry"] == shm_name
            s = Session(b.url)
            assert s.call("echo", {"text": "B"})["result"]["content"][0]["text"] == "B"


# --- the janitor's schedule and the wall clock ------------------------------------------------

_FAST_JANITOR_CONF = """
import shmcancel
exec(open({example!r}).read())
pythonpath = {pythonpath!r}
shmcancel.gunicorn.configure(config=shmcancel.Config(janitor_interval={interval!r}))
"""


def test_the_janitor_sweeps_on_after_the_clock_steps_back(shm_name, tmp_path):
    """§4.6: a janitor sweeps every janitor_interval while the registry is in use. Its schedule
    is on the wall clock (the header's last sweep, time.time(), shared by every process): after
    the clock steps back (NTP, a VM restored), the last sweep lies ahead, and no claim succeeded
    until the clock had caught up with it: an hour's step, no sweep for an hour (expired rows,
    dead owners' rows left). The header is given the last sweep such a step leaves."""
    from shmcancel.shm.segment import OFF_LAST_SWEEP

    interval = 0.3
    conf = tmp_path / "fast_janitor.conf.py"
    conf.write_text(_FAST_JANITOR_CONF.format(
        example=os.path.abspath(CONF), interval=interval,
        pythonpath=os.path.abspath(os.path.dirname(CONF))))
    with Gunicorn(APP, registry_name=shm_name, config=str(conf), workers=2) as g, \
            Registry.attach(shm_name) as reg:

        def sweeps() -> int:
            return reg.info()["sweeps"]

        wait_until(lambda: sweeps() >= 1, time.monotonic() + 10,
                   what="the janitors' first sweep")
        reg._seg.set_f64(OFF_LAST_SWEEP, time.time() + 3600)  # the clock stepped back 1 h
        before = sweeps()
        wait_until(lambda: sweeps() > before, time.monotonic() + 10,
                   what="a sweep after the clock stepped back")
        assert reg.last_sweep <= time.time(), "the schedule is back on the clock"
        # Still one sweep per interval across the workers, not one per look.
        after, t0 = sweeps(), time.monotonic()
        wait_until(lambda: sweeps() >= after + 5, time.monotonic() + 10,
                   what="five more sweeps")
        assert time.monotonic() - t0 >= 4 * interval
        assert alive(g.pid)


def test_a_redis_url_without_the_redis_package_stops_the_master_in_one_line(shm_name, tmp_path):
    """``SHMCANCEL_REDIS_URL`` set where redis-py cannot be imported: the master started, then
    every worker failed to boot on the import with a traceback each, and gunicorn halted. The
    master now says what is missing in one line, before it creates anything."""
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['redis'] = None\n")
    log = tmp_path / "gunicorn.log"
    env = {**os.environ, "SHMCANCEL_REGISTRY": shm_name,
           "SHMCANCEL_REDIS_URL": "redis://127.0.0.1:1/0",
           "PYTHONPATH": os.pathsep.join(
               [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])}
    status = _run_master(CONF, env, log)
    text = log.read_text()
    assert status != 0, text[-3000:]
    assert "SHMCANCEL_REDIS_URL is set but the redis package cannot be imported" in text, \
        text[-3000:]
    assert "pip install 'shmcancel[redis]'" in text and "Traceback" not in text, text[-3000:]
    assert not segment_exists(shm_name)
