"""The janitor thread: sweeps a registry while nothing calls it (contract §4.6), one sweep per
interval across processes; and gunicorn workers run one, so an idle server still sweeps."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import tempfile
import threading
import time
from collections.abc import Iterator

import pytest
from helpers.background import lock_held
from helpers.gunicorn_harness import Gunicorn, wait_until
from helpers.mcp_client import dump
from helpers.rows import in_flight_count

from shmcancel import Cancellation, Config, Registry, cancelled
from shmcancel.cancel import owed
from shmcancel.cancel.janitor import MIN_WAIT, Janitor
from shmcancel.shm import procinfo

FAST = Config(max_rows=100, capacity=100, in_flight_capacity=16, session_capacity=16,
              ttl=0.1, janitor_interval=0.3)


def _dead_owner() -> tuple[int, int]:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    start = procinfo.start_time(pid)
    os.waitpid(pid, 0)
    assert start is not None
    return pid, start


@contextlib.contextmanager
def _janitor_child(name: str) -> Iterator[int]:
    """A process that attaches and runs only a Janitor (no other call that could sweep)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            reg = Registry.attach(name)
            Janitor(Cancellation(reg)).start()
            os.write(w, b"up")
            select.select([], [], [], 30)
        finally:
            os._exit(0)
    try:
        os.close(w)
        assert select.select([r], [], [], 10)[0] and os.read(r, 2) == b"up"
        yield pid
    finally:
        os.close(r)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_janitor_thread_sweeps_without_calls(shm_name: str) -> None:
    reg = Registry.create(shm_name, FAST)
    try:
        c = Cancellation(reg)
        c.cancel(1, "old", "global")
        dead_pid, dead_start = _dead_owner()
        reg.table("in_flight").insert(("global", "2"), (dead_pid, dead_start, 1, 1))
        with _janitor_child(shm_name) as jpid:
            # Observed through the tables only: table reads never sweep.
            wait_until(lambda: reg.table("cancellations").count() == 0
                       and in_flight_count(reg) == 0, time.monotonic() + 5,
                       what="the janitor thread's sweep")
            info = reg.info()
            assert info["sweeps"] >= 1 and info["last_sweeper_pid"] == jpid
    finally:
        reg.close()
        reg.unlink()


def test_janitor_start_is_idempotent_and_stop_is_prompt(shm_name: str) -> None:
    reg = Registry.create(shm_name, Config(max_rows=100, capacity=100, in_flight_capacity=16,
                                           session_capacity=16, janitor_interval=3600))
    try:
        j = Janitor(Cancellation(reg))
        j.start()
        j.start()
        names = [t.name for t in threading.enumerate()]
        assert names.count("shmcancel-janitor") == 1
        t0 = time.monotonic()
        j.stop(timeout=5)
        assert time.monotonic() - t0 < 1.0  # woken, not left to its hour-long wait
        assert not j.running
        assert "shmcancel-janitor" not in [t.name for t in threading.enumerate()]
    finally:
        reg.close()
        reg.unlink()


@pytest.fixture
def idle_server(shm_name: str) -> Iterator[Gunicorn]:
    with tempfile.TemporaryDirectory(prefix="shmcancel-janitor-") as d:
        env = {"SHMCANCEL_TEST_DIR": d, "SHMCANCEL_TEST_TTL": "0.5",
               "SHMCANCEL_TEST_JANITOR_INTERVAL": "0.3"}
        with Gunicorn("tests.apps.transport_app:app", registry_name=shm_name,
                      config="tests/apps/transport_conf.py", env=env, workers=2) as g:
            yield g


@pytest.mark.integration
def test_idle_gunicorn_sweeps_expired_rows(idle_server: Gunicorn) -> None:
    name = idle_server.registry_name
    reg = Registry.attach(name)
    try:
        Cancellation(reg).cancel("stale", "from a request long gone", "ip:192.0.2.1")
        # a table read: no sweep
        assert reg.table("cancellations").member(("ip:192.0.2.1", "stale"))
    finally:
        reg.close()  # from here on nothing but read-only dumps touches the registry
    wait_until(lambda: dump(name)["cancellations"] == [], time.monotonic() + 5,
               what="an idle server's workers to sweep the expired row")


@pytest.mark.parametrize("poll", ["handle", "conn", "id"])
def test_a_tool_that_only_polls_still_drives_the_janitor(shm_name: str, monkeypatch,
                                                         poll: str) -> None:
    """Contract §4.6, with no janitor thread: a process whose only use of the registry is a
    long tool's cached poll still sweeps once the interval is due (every POLLS_PER_CLOCK polls
    read the clock)."""
    from shmcancel.cancel import policy

    now = [time.time()]
    monkeypatch.setattr(policy, "_now", lambda: now[0])
    reg = Registry.create(shm_name, FAST)
    try:
        c = Cancellation(reg, clock=lambda: now[0])
        c.cancel(1, None, "ip:192.0.2.9")  # expires after ttl = 0.1 s
        h = c.begin(7, "ip:192.0.2.9")
        polls = {"handle": h.cancelled, "conn": lambda: cancelled({"shmcancel.handle": h}),
                 "id": lambda: c.cancelled(7, "ip:192.0.2.9")}[poll]
        for _ in range(3 * policy.POLLS_PER_CLOCK):
            assert polls() is False
        assert c.cancelled(1, "ip:192.0.2.9") is True  # not swept: the interval is not due
        now[0] += 2 * FAST.janitor_interval
        for _ in range(policy.POLLS_PER_CLOCK + 1):
            assert polls() is False
        assert reg.table("cancellations").count() == 0  # the expired row went
        h.end()
    finally:
        reg.close()
        reg.unlink()


def test_a_tick_on_a_closed_registry_returns_false(registry) -> None:
    """The janitor's turn after the registry was closed (a late call): nothing to do, no
    exception (its lock-free look at the lock's owner reads a mapping that is gone)."""
    reg = registry()
    c = Cancellation(reg)
    reg.close()
    assert c.tick() is False


def test_ends_owed_when_the_janitor_stops_are_left_to_a_lander(registry) -> None:
    """contract §4.3: a janitor's process starts no lander (the janitor lands what it owes);
    a janitor stopped with ends still owed left them owed until the process wrote again, for
    as long as it stayed idle. Its stop now hands them to a lander."""
    reg = registry(lock_timeout=0.2, janitor_interval=3600.0)
    c = Cancellation(reg)
    j = Janitor(c)
    j.start()
    h = c.begin(1, "s")
    c.cancel(1, "stop", "s")
    with lock_held(reg):
        h.end()  # the clear meets the held lock: owed, to the janitor
        assert owed.owed_ends() == 1
        j.stop()
    wait_until(lambda: owed.owed_ends() == 0 and not c.cancelled(1, "s"),
               time.monotonic() + 10, what="the owed clear to land")


def test_a_tiny_janitor_interval_does_not_make_the_thread_spin(registry) -> None:
    """``Config`` takes any positive ``janitor_interval``; the janitor's wait floor
    (``MIN_WAIT``, "never spins faster") was undone by capping the wait at the interval: at
    1e-6 s it swept ~200 times a second, a CPU core per worker."""
    reg = registry(janitor_interval=1e-6)
    j = Janitor(Cancellation(reg))
    j.start()
    try:
        start, t0 = reg.info()["sweeps"], time.monotonic()
        wait_until(lambda: reg.info()["sweeps"] >= start + 3, t0 + 10, what="a few sweeps")
        while time.monotonic() - t0 < 0.5:  # the loop's pace over half a second
            time.sleep(0.05)
        swept, took = reg.info()["sweeps"] - start, time.monotonic() - t0
    finally:
        j.stop()
    assert swept <= took / MIN_WAIT + 3, (swept, took)
