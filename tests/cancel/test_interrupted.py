"""An exception raised between two steps of the library's own code, as a signal handler's (or an
async exception) is, at the points CPython runs them: after a C call returns, as a function
returns. Played by a profile hook that raises there once; the caller catches it and serves on.
The process's state must not be left stranded: a lock that blocks every later caller, a row no
one will remove."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from helpers.rows import in_flight_rows

from shmcancel import Cancellation
from shmcancel.shm import lanes

S = "s"


class Interrupt(BaseException):
    """What a signal handler raises (as gunicorn's quit raises SystemExit)."""


@contextmanager
def interrupted_at(when: Callable[[Any, str, Any], bool]) -> Iterator[None]:
    """Raise :class:`Interrupt` once, at the first profile event ``when(frame, event, arg)``
    is true for (in this thread)."""
    def hook(frame: Any, event: str, arg: Any) -> None:
        if when(frame, event, arg):
            sys.setprofile(None)
            raise Interrupt()
    sys.setprofile(hook)
    try:
        yield
    finally:
        sys.setprofile(None)


def test_a_fence_with_every_lock_left_taken_never_blocks() -> None:
    """``fence`` is a barrier made of a lock's acquire and release. An exception landing
    between the two left that lock taken for good; with all four so taken (over a process's
    life) every fence blocked forever, the one a cancellation runs under the registry lock
    too, and every other process then waited on that lock."""
    taken = [lk for lk in lanes._fences if lk.acquire(False)]
    try:
        assert len(taken) == len(lanes._fences)
        t = threading.Thread(target=lanes.fence, daemon=True)
        t.start()
        t.join(5)
        assert not t.is_alive(), "fence blocked"
    finally:
        for lk in taken:
            lk.release()


def test_an_end_cut_short_in_its_lane_still_has_its_row_removed(registry) -> None:
    """``end`` takes the row's way from this process's list, then clears its hash: cut short
    between the two, the row stayed in the lane, listed nowhere, so no reap of ended rows
    found it (its request no longer running) and it stayed in flight for the process's life."""
    reg = registry()
    c = Cancellation(reg)
    h = c.begin(1, S)
    assert type(h._receipt) is int  # a lane row
    with pytest.raises(Interrupt), interrupted_at(
            lambda f, e, a: e == "c_return" and f.f_code.co_name == "remove"
            and getattr(a, "__name__", "") == "pop"):
        h.end()
    assert [k for k, _ in in_flight_rows(reg)] == [(S, "1")]  # cut short before the row went
    c.settle()
    assert not c.in_flight(1, S)


def test_a_begin_cut_short_as_its_row_is_written_leaves_no_row_for_good(registry) -> None:
    """The exception lands as the row's write returns: the caller gets no handle to end it,
    and the request's token stayed in this process's running set, so its row was never
    taken for an ended request's and stayed in flight for the process's life."""
    reg = registry()
    c = Cancellation(reg)
    with pytest.raises(Interrupt), interrupted_at(
            lambda f, e, a: e == "return" and f.f_code.co_name == "track"):
        c.begin(1, S)
    assert [k for k, _ in in_flight_rows(reg)] == [(S, "1")]  # written (read without a call)
    c.settle()
    assert not c.in_flight(1, S)


def test_a_begin_cut_short_in_its_tick_leaves_no_row_for_good(registry) -> None:
    """After its row is written, ``begin`` lands owed ends and ticks the janitor (a sweep, when
    one is due): cut short there, the caller got no handle, and the request's token stayed
    running, its row in flight for the process's life."""
    reg = registry()
    c = Cancellation(reg)
    with pytest.raises(Interrupt), interrupted_at(
            lambda f, e, a: e == "call" and f.f_code.co_name == "_tick"):
        c.begin(1, S)
    assert [k for k, _ in in_flight_rows(reg)] == [(S, "1")]
    c.settle()
    assert not c.in_flight(1, S)
