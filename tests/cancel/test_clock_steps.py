"""A step back of the wall clock (an NTP step) during a request (contract §4.3): a cancellation
recorded after it is stamped before the request began, and is still that request's. The step is
played by a wall clock the handle module reads as ``time.time`` (the real one is the machine's),
its monotonic clock the real one."""

from __future__ import annotations

import time
import types

import pytest

from shmcancel import Config
from shmcancel.cancel import handle as handle_mod
from shmcancel.cancel.policy import Cancellation
from shmcancel.shm.registry import Registry

S = "session:abc"


class SteppedWall:
    """``time.time`` plus ``offset`` seconds (negative after a step back)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def time(self) -> float:
        return time.time() + self.offset


@pytest.fixture
def wall(monkeypatch):
    w = SteppedWall()
    monkeypatch.setattr(handle_mod, "time",
                        types.SimpleNamespace(time=w.time, monotonic=time.monotonic), raising=False)
    return w


@pytest.fixture
def c(shm_name, wall):
    reg = Registry.create(shm_name, Config(capacity=64, max_rows=64, in_flight_capacity=16,
                                           session_capacity=16))
    try:
        yield Cancellation(reg, clock=wall.time)
    finally:
        reg.close()
        reg.unlink()


def test_a_cancellation_recorded_after_a_step_back_is_the_running_requests(c, wall):
    h = c.begin(7, S)
    assert h.cancelled() is False
    wall.offset = -2.0  # the clock steps back 2 s: the cancellation's stamp is before `began`
    assert c.cancel_if_in_flight(7, "stop", S)
    assert h.cancelled() is True
    assert h.reason() == "stop"
    h.end()
    assert c.cancelled(7, S) is False


def test_without_a_step_a_row_older_than_the_request_stays_a_leftover(c, wall):
    wall.offset = -2.0
    c.cancel(7, "old", S)  # an earlier namesake's, 2 s "ago"
    wall.offset = 0.0  # the clock is where it was: no step during the request
    h = c.begin(7, S)
    assert h.cancelled() is False and h.reason() is None
    h.end()


def test_a_leftover_older_than_the_step_stays_a_leftover(c, wall):
    wall.offset = -10.0
    c.cancel(7, "old", S)  # 10 s before the request
    wall.offset = 0.0
    h = c.begin(7, S)
    wall.offset = -2.0  # a step back of 2 s during the request: only rows within it are taken
    assert h.cancelled() is False and h.reason() is None
    assert c.cancel_if_in_flight(7, "new", S)
    assert h.cancelled() is True and h.reason() == "new"
    h.end()


def test_an_injected_clock_is_compared_as_it_is(shm_name):
    """A clock other than the wall clock (a test's) is taken at its word: no step is inferred
    from the monotonic clock running on while it stands still."""
    now = [100.0]
    reg = Registry.create(shm_name, Config(capacity=64, max_rows=64, in_flight_capacity=16,
                                           session_capacity=16))
    try:
        c = Cancellation(reg, clock=lambda: now[0])
        now[0] = 99.0
        c.cancel(7, "old", S)
        now[0] = 100.0
        h = c.begin(7, S)
        time.sleep(0.01)  # the monotonic clock moves; this clock does not
        assert h.cancelled() is False
        h.end()
    finally:
        reg.close()
        reg.unlink()
