"""``Registry.close()`` while a thread of this process holds the registry lock: the hold is never
cut short. Its release stores into the header view and posts the semaphore; closed under it,
the store raised before the post, the unit stayed taken and recorded to this live pid, and every
other process got ``LockTimeout`` for as long as this one lived. Now the close waits for the
hold (up to ``lock_timeout``), refuses past it (``LockTimeout``, nothing closed), and refuses
at once from inside the caller's own hold. Real segments, real threads, a second real process
that must take the lock within a second afterwards."""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from helpers.gunicorn_harness import wait_until
from helpers.procs import Chan, Child

from shmcancel import Config, LockTimeout, RegistryClosed, ShmCancelError
from shmcancel.cancel.janitor import Janitor
from shmcancel.cancel.policy import Cancellation
from shmcancel.shm.registry import Registry

KEY = ("s", "1")
TAKE_WITHIN = 1.0  # seconds another process may wait for the lock once the holder is done


def _taker(chan: Chan, name: str) -> None:
    """A second process: attached before anything happens, then, on each ``"take"``, takes
    the lock with a ``TAKE_WITHIN`` timeout and says how that went."""
    reg = Registry.attach(name)
    reg.lock.timeout = TAKE_WITHIN
    chan.send("ready")
    while chan.recv(60) == "take":
        t0 = time.monotonic()
        try:
            with reg.lock:
                pass
            chan.send({"took": time.monotonic() - t0})
        except Exception as e:
            chan.send({"error": f"{type(e).__name__}: {e}"})
    reg.close()


@pytest.fixture
def taker(spawn: Callable[..., Child]) -> Callable[[Registry], Callable[[], dict[str, Any]]]:
    """taker(reg) forks the second process (before any thread starts) and returns ``take()``:
    its attempt at the lock, ``{"took": seconds}`` or ``{"error": ...}``."""
    def make(reg: Registry) -> Callable[[], dict[str, Any]]:
        child = spawn(_taker, reg.name)
        assert child.recv() == "ready"

        def take() -> dict[str, Any]:
            child.send("take")
            out: dict[str, Any] = child.recv(TAKE_WITHIN + 10)
            return out
        return take
    return make


class Holder:
    """A thread inside ``with reg.lock:`` until :meth:`release`; ``outcome`` says how its
    ``with`` ended ("released", or the exception that came out of it)."""

    def __init__(self, reg: Registry) -> None:
        self.reg = reg
        self.inside = threading.Event()
        self.go = threading.Event()
        self.outcome: str | None = None
        self.thread = threading.Thread(target=self._run, name="test-holder")
        self.thread.start()
        assert self.inside.wait(10), "the holder never got the lock"

    def _run(self) -> None:
        try:
            with self.reg.lock:
                self.reg.table("cancellations").insert(KEY, ("held", 1.0))
                self.inside.set()
                self.go.wait(60)
            self.outcome = "released"
        except BaseException as e:
            self.outcome = f"{type(e).__name__}: {e}"

    def release(self) -> None:
        self.go.set()
        self.thread.join(10)
        assert not self.thread.is_alive()


@pytest.fixture
def holders() -> Iterator[list[Holder]]:
    made: list[Holder] = []
    try:
        yield made
    finally:
        for h in made:  # a failed test must not leave a thread blocked in a hold
            h.go.set()
            h.thread.join(10)


def _in_function(thread: threading.Thread, name: str) -> bool:
    """Whether ``thread``'s innermost Python frame is in function ``name`` (it is blocked in a
    C call made there)."""
    frame = sys._current_frames().get(thread.ident or -1)
    return frame is not None and frame.f_code.co_name == name


def _poll(cond: Callable[[], bool], timeout: float, what: str) -> None:
    wait_until(cond, time.monotonic() + timeout, interval=0.002, what=what)


def test_close_waits_for_another_threads_hold_to_end(registry, taker, holders) -> None:
    reg = registry()
    take = taker(reg)
    holder = Holder(reg)
    holders.append(holder)
    closed: list[object] = []

    def closer() -> None:
        try:
            reg.close()
            closed.append("closed")
        except BaseException as e:
            closed.append(e)

    c = threading.Thread(target=closer, name="test-closer")
    c.start()
    # The close is under way: waiting for the hold (or, unfixed, done already).
    _poll(lambda: bool(closed) or _in_function(c, "exclusive"), 10, "the close to begin")
    assert not closed and not reg.closed, f"closed under a running hold: {closed}"
    assert reg.table("cancellations").get(KEY) == ("held", 1.0)  # lock-free read: still mapped
    holder.release()
    c.join(10)
    assert holder.outcome == "released"
    assert closed == ["closed"] and reg.closed
    got = take()
    assert "took" in got and got["took"] < TAKE_WITHIN, got
    with pytest.raises(RegistryClosed):
        reg.table("cancellations")


def test_a_hold_outlasting_lock_timeout_makes_close_refuse(registry, taker, holders) -> None:
    reg = registry(lock_timeout=0.3)
    take = taker(reg)
    holder = Holder(reg)
    holders.append(holder)
    t0 = time.monotonic()
    with pytest.raises(LockTimeout) as excinfo:
        reg.close()
    assert time.monotonic() - t0 >= 0.3
    msg = str(excinfo.value)
    assert f"registry {reg.name}: not closed" in msg and "'test-holder'" in msg, msg
    assert not reg.closed  # nothing was closed: the registry is still usable
    holder.release()
    assert holder.outcome == "released"
    t = reg.table("cancellations")
    assert t.get(KEY) == ("held", 1.0)
    t.delete(KEY)
    got = take()
    assert "took" in got and got["took"] < TAKE_WITHIN, got
    reg.close()  # again, now that the hold is over
    assert reg.closed
    assert "took" in take()


def test_close_inside_the_callers_own_hold_is_refused(registry, taker) -> None:
    reg = registry()
    take = taker(reg)
    with reg.lock:
        with pytest.raises(ShmCancelError) as excinfo:
            reg.close()
        assert type(excinfo.value) is ShmCancelError
        assert "cannot be closed by a thread inside its lock" in str(excinfo.value)
        assert not reg.closed
        reg.table("cancellations").insert(KEY, ("mine", 1.0))
    assert reg.lock.owner() is None
    got = take()
    assert "took" in got and got["took"] < TAKE_WITHIN, got
    reg.close()
    assert reg.closed


def test_closes_from_two_threads_close_once(registry, holders) -> None:
    """Two threads closing while a third holds: both wait, one closes, the other finds it
    closed; neither raises."""
    reg = registry()
    holder = Holder(reg)
    holders.append(holder)
    errors: list[BaseException] = []

    def closer() -> None:
        try:
            reg.close()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=closer) for _ in range(2)]
    for th in threads:
        th.start()
    _poll(lambda: all(_in_function(th, "exclusive") or not th.is_alive() for th in threads),
          10, "both closes to begin")
    holder.release()
    for th in threads:
        th.join(10)
    assert not errors and reg.closed and holder.outcome == "released"


def test_a_thread_queued_with_the_close_holds_before_it_or_finds_it_closed(registry, taker,
                                                                          holders) -> None:
    """A thread waiting for the lock beside the close: either it gets the lock first (a whole
    hold, then the close) or it finds the registry closed (``RegistryClosed``, nothing taken);
    the other process takes the lock either way."""
    reg = registry()
    take = taker(reg)
    holder = Holder(reg)
    holders.append(holder)
    out: dict[str, object] = {}

    def waiter() -> None:
        try:
            with reg.lock:
                reg.table("cancellations").insert(("s", "2"), ("queued", 1.0))
            out["waiter"] = "released"
        except BaseException as e:
            out["waiter"] = e

    def closer() -> None:
        try:
            reg.close()
            out["closer"] = "closed"
        except BaseException as e:
            out["closer"] = e

    w = threading.Thread(target=waiter)
    w.start()
    _poll(lambda: _in_function(w, "_wait_local") or not w.is_alive(), 10, "the waiter to queue")
    c = threading.Thread(target=closer)
    c.start()
    _poll(lambda: _in_function(c, "exclusive") or not c.is_alive(), 10, "the close to begin")
    holder.release()
    w.join(10)
    c.join(10)
    assert holder.outcome == "released" and out["closer"] == "closed", out
    assert out["waiter"] == "released" or type(out["waiter"]) is RegistryClosed, out
    got = take()
    assert "took" in got and got["took"] < TAKE_WITHIN, got


def test_a_janitor_sweep_cut_by_the_close_ends_quietly(shm_name: str, caplog) -> None:
    """The close waits for a sweep's hold, not for its lock-free steps between holds: a sweep
    that meets the closed registry there is no failure (no warning, no traceback), and the
    janitor then stops, saying so once."""
    reg = Registry.create(shm_name, Config(max_rows=100, capacity=100, in_flight_capacity=16,
                                           session_capacity=16, ttl=0.1,
                                           janitor_interval=0.05))
    try:
        armed, in_sweep, closed = threading.Event(), threading.Event(), threading.Event()

        def clock() -> float:  # the sweep reads it between its check and its deletions
            if armed.is_set() and threading.current_thread().name == "shmcancel-janitor":
                armed.clear()
                in_sweep.set()
                closed.wait(10)
            return time.time()

        c = Cancellation(reg, clock=clock)
        c.cancel(1, None, "ip:192.0.2.1")
        j = Janitor(c)
        with caplog.at_level(logging.INFO, logger="shmcancel"):
            armed.set()
            j.start()
            assert in_sweep.wait(10), "the janitor never swept"
            reg.close()
            closed.set()
            t = j._thread
            assert t is not None
            t.join(10)
            assert not t.is_alive()
        assert [r.levelname for r in caplog.records if r.levelno >= logging.WARNING] == []
        assert [r.getMessage() for r in caplog.records if r.name == "shmcancel.janitor"] == [
            f"janitor: registry {reg.name} was closed; the janitor stops"]
        j.stop()
    finally:
        reg.close()
        reg.unlink()
