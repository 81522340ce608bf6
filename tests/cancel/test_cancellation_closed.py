"""The cancellation layer over a registry closed in this process (``Registry.close()``): the
calls that can fail raise ``RegistryClosed`` (a ``ShmCancelError`` naming the registry), the
ones the contract says never raise give their safe answer (a handle's ``cancelled()`` keeps its
latch), a handle begun before the close ends without raising or owing, and the janitor stops.
Real registries in /dev/shm, one process."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
from helpers.background import lock_held
from helpers.clock import Clock
from helpers.owed import as_if_a_janitor_listened

import shmcancel
from shmcancel import Cancellation, RegistryClosed, ShmCancelError
from shmcancel.cancel import owed
from shmcancel.cancel.janitor import Janitor

S = "session:s"

# What raises RegistryClosed, as ``name: call(cancellation)``.
RAISING: dict[str, Callable[[Cancellation], Any]] = {
    "cancel": lambda c: c.cancel(3, "why", S),
    "cancel_if_in_flight": lambda c: c.cancel_if_in_flight(2, "why", S),
    "cancel_key_if_in_flight": lambda c: c.cancel_key_if_in_flight("2", "why", S),
    "cancel_scope": lambda c: c.cancel_scope(S),
    "reason": lambda c: c.reason(1, S),
    "cancelled_at": lambda c: c.cancelled_at(1, S),
    "clear": lambda c: c.clear(1, S),
    "track": lambda c: c.track(4, S),
    "untrack": lambda c: c.untrack(2, S),
    "cleanup": lambda c: c.cleanup(),
    "sweep": lambda c: c.sweep(),
    "reap": lambda c: c.reap(),
}

# What never raises (contract §4), as ``name: (call(cancellation), safe answer)``.
SAFE: dict[str, tuple[Callable[[Cancellation], Any], Any]] = {
    "cancelled, cached": (lambda c: c.cancelled(1, S), False),
    "cancelled, new id": (lambda c: c.cancelled(9, S), False),
    "cancelled(conn)": (lambda c: c.cancelled({"shmcancel.request_id": 1,
                                               "shmcancel.session_id": "s"}), False),
    "in_flight, cached": (lambda c: c.in_flight(2, S), False),
    "in_flight, new id": (lambda c: c.in_flight(9, S), False),
    "in_flight_pids": (lambda c: c.in_flight_pids(2, S), None),
    "tick": (lambda c: c.tick(), False),
    "settle": (lambda c: c.settle(), 0),
    "shmcancel.cancelled": (lambda c: shmcancel.cancelled({"shmcancel.request_id": 1}), False),
}


@pytest.fixture
def used(registry) -> tuple[Any, Cancellation]:
    """A registry with a cancellation (1) and a request in flight (2) in ``S``, each polled
    once (so the hot paths' caches hold them), and its Cancellation; not closed yet."""
    reg = registry()
    c = Cancellation(reg, clock=Clock())
    c.cancel(1, "why", S)
    c.track(2, S)
    assert c.cancelled(1, S) is True and c.in_flight(2, S) is True
    return reg, c


def _names_closed(e: BaseException, name: str) -> None:
    assert type(e) is RegistryClosed and isinstance(e, ShmCancelError)
    assert f"registry {name} is closed" in str(e), str(e)


def _no_traceback_logged(caplog: pytest.LogCaptureFixture) -> None:
    """Nothing logged at warning level or above with a traceback, nor any error (a debug
    record of a never-raising call's failure keeps its traceback)."""
    bad = [r for r in caplog.records if r.levelno >= logging.ERROR
           or (r.levelno >= logging.WARNING and r.exc_info)]
    assert not bad, [r.getMessage() for r in bad]


def test_a_cancellation_over_a_closed_registry_is_refused(registry) -> None:
    reg = registry()
    reg.close()
    with pytest.raises(RegistryClosed) as excinfo:
        Cancellation(reg)
    _names_closed(excinfo.value, reg.name)


@pytest.mark.parametrize("op", RAISING)
def test_a_call_through_a_closed_registry_raises_registry_closed(used, op: str) -> None:
    reg, c = used
    reg.close()
    with pytest.raises(RegistryClosed) as excinfo:
        RAISING[op](c)
    _names_closed(excinfo.value, reg.name)


@pytest.mark.parametrize("op", SAFE)
def test_what_never_raises_answers_safely_after_close(used, op: str, caplog) -> None:
    reg, c = used
    reg.close()
    call, answer = SAFE[op]
    with caplog.at_level(logging.DEBUG, logger="shmcancel"):
        assert call(c) == answer
    _no_traceback_logged(caplog)


def test_begin_on_a_closed_registry_gives_an_untracked_handle(used, caplog) -> None:
    reg, c = used
    reg.close()
    with caplog.at_level(logging.WARNING, logger="shmcancel"):
        h = c.begin(5, S)
    assert h.tracked is False
    _names_closed(h.error, reg.name)  # type: ignore[arg-type]
    assert not any("in_flight_capacity" in r.getMessage() for r in caplog.records)
    _no_traceback_logged(caplog)
    assert h.cancelled() is False
    h.cancel_local("client disconnected")
    assert h.cancelled() is True and h.reason() == "client disconnected"
    h.end()


@pytest.mark.parametrize("polled", [False, True])
def test_a_handle_begun_before_the_close_ends_quietly(used, polled: bool, caplog) -> None:
    """``end()`` never raises (contract §4.3: it runs in a ``finally``): one line naming the
    closed registry, no traceback, and nothing owed (no registry to land it in)."""
    reg, c = used
    h = c.begin(7, S)
    assert h.tracked
    if polled:
        assert h.cancelled() is False
    reg.close()
    assert h.cancelled() is False
    with caplog.at_level(logging.WARNING, logger="shmcancel"):
        h.end()
        h.end()  # idempotent
    _no_traceback_logged(caplog)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and f"registry {reg.name} is closed" in lines[0], lines
    assert owed.owed_ends() == 0


@pytest.mark.parametrize("how", ["shared row", "cancel_local"])
def test_a_cancelled_handle_stays_cancelled_after_the_close(used, how: str) -> None:
    """A handle's ``cancelled()`` latches (contract §4.3): the close of its registry does not
    un-cancel a running tool. Polled first, so that its hot path holds the table's version
    view (released by the close)."""
    reg, c = used
    h = c.begin(8, S)
    assert h.cancelled() is False
    if how == "shared row":
        c.cancel(8, "stop", S)
    else:
        h.cancel_local("stop")
    assert h.cancelled() is True
    reg.close()
    assert h.cancelled() is True
    assert h.reason() == "stop"
    h.end()


def test_an_end_owed_to_a_registry_closed_since_is_dropped_in_one_line(registry,
                                                                       caplog) -> None:
    reg = registry(lock_timeout=0.2)
    c = Cancellation(reg, clock=Clock())
    h = c.begin(1, S)
    c.cancel(1, "why", S)  # so the end has a row to clear, under the lock
    with as_if_a_janitor_listened():  # no lander lands the end meanwhile
        with lock_held(reg):
            h.end()  # the lock times out: owed
        assert owed.owed_ends() == 1
        reg.close()
        with caplog.at_level(logging.WARNING, logger="shmcancel"):
            assert owed.settle_owed() == 0
    assert owed.owed_ends() == 0
    _no_traceback_logged(caplog)
    assert any(f"registry {reg.name} is closed" in r.getMessage() for r in caplog.records)


def test_the_janitor_stops_once_its_registry_is_closed(used, caplog) -> None:
    reg, c = used
    j = Janitor(c)
    with caplog.at_level(logging.INFO, logger="shmcancel"):
        j.start()
        t = j._thread
        assert t is not None
        reg.close()
        j._wake.set()  # what stop() and an owed end do: its next turn comes now
        t.join(5)
        assert not t.is_alive(), "the janitor went on over a closed registry"
    _no_traceback_logged(caplog)
    assert [r.getMessage() for r in caplog.records if r.name == "shmcancel.janitor"] == [
        f"janitor: registry {reg.name} was closed; the janitor stops"]
    assert j._wake.set not in owed.listeners
    j.stop()


def test_a_janitor_cannot_start_on_a_closed_registry(used) -> None:
    reg, c = used
    j = Janitor(c)
    reg.close()
    with pytest.raises(RegistryClosed) as excinfo:
        j.start()
    _names_closed(excinfo.value, reg.name)
    assert not j.running
