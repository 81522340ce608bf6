"""Request ends this process owes to a store, and the requests it runs (contract §4.3).

An end that meets :class:`~shmcancel.LockTimeout` is queued here (at most ``_OWED_MAX``, the
oldest dropped, logged once per process) and landed later, oldest first, by
:func:`settle_owed`: on the process's next write, by ``Cancellation.settle``, by the
worker's janitor thread, which ``listeners`` wake, and at interpreter exit (tries for at most
:data:`EXIT_WAIT` seconds, :func:`_settle_at_exit`). A process with no janitor (a library user's)
starts a lander thread instead, which tries every :data:`RETRY` seconds and ends once nothing is
owed: an idle process still lands its ends once the lock is free, and no other process could
(which requests ended is known only here). ``running`` holds the tokens of the requests
this process runs: a token enters before its in-flight row is written and leaves when its end
begins, so a row of this process whose token is absent belongs to an ended request (and is
removed by ``Cancellation.settle``). All of it is per process: cleared in a fork child.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable

from ..exceptions import LockTimeout, RegistryClosed
from .storage import Owner, Storage

__all__ = ["forgo_untrack", "listeners", "owe", "owed_ends", "queue", "running",
           "settle_owed", "unlisten"]

log = logging.getLogger("shmcancel.cancellation")

_OWED_MAX = 1024
RETRY = 0.25  # seconds between two tries at landing owed ends (the lander's, the janitor's)
# seconds an exiting process goes on trying to land what it owes (each try waits at most the
# store's lock timeout): a plain clear() has no row of the process a reaper could find after it
EXIT_WAIT = 2.0
#: Owed ends, oldest first: (store, scope, rid, owner, ended_at); ``ended_at`` ``None``: only
#: the untrack of ``owner``'s row (a plain ``Cancellation.untrack``), no clear.
queue: collections.deque[tuple[Storage, str, str, Owner | None, float | None]] = \
    collections.deque()
_owed_lock = threading.Lock()  # one thread lands owed ends at a time
_dropped_logged = False
#: Tokens of the requests this process runs (see the module docstring).
running: set[int] = set()
#: Called (from the thread that owes) whenever an end becomes owed: a janitor's wake-up.
listeners: set[Callable[[], None]] = set()
_lander: threading.Thread | None = None  # see the module docstring
_lander_lock = threading.Lock()  # a lander decides to end under it, and owe() to start one


def _reset_after_fork() -> None:
    global _dropped_logged, _owed_lock, _lander, _lander_lock
    _dropped_logged = False
    queue.clear()  # the parent's requests: the parent (or the reaper of its rows) ends them
    running.clear()
    listeners.clear()  # threads do not survive a fork
    _owed_lock = threading.Lock()
    _lander = None
    _lander_lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_after_fork)


def owe(st: Storage, scope: str, rid: str, owner: Owner | None,
        ended_at: float | None) -> None:
    """Queue an end that could not land (``ended_at`` ``None``: only the untrack of ``owner``'s
    row). At ``_OWED_MAX`` the oldest is dropped (logged once per process): a handle's in-flight
    row is still removed by :meth:`Cancellation.settle`."""
    global _dropped_logged
    if len(queue) >= _OWED_MAX:
        with contextlib.suppress(IndexError):
            queue.popleft()
        if not _dropped_logged:
            _dropped_logged = True
            log.warning("more than %d request ends are owed to a stalled registry; the oldest "
                        "are dropped (their rows are reaped later). (Logged once per process.)",
                        _OWED_MAX)
    queue.append((st, scope, rid, owner, ended_at))
    for wake in list(listeners):
        try:
            wake()
        except Exception:
            log.debug("an owed-end listener failed", exc_info=True)
    if not listeners:
        _start_lander()


def unlisten(listener: Callable[[], None]) -> None:
    """Remove ``listener`` (a janitor stopping); the last one to go leaves the ends still owed
    to a lander."""
    listeners.discard(listener)
    if queue and not listeners:
        _start_lander()


def _start_lander() -> None:
    """Start the lander thread unless one runs (see the module docstring)."""
    global _lander
    with _lander_lock:
        if _lander is not None:
            return
        t = threading.Thread(target=_land_until_settled, name="shmcancel-owed", daemon=True)
        _lander = t
    try:
        t.start()
    except RuntimeError:  # no thread to be had (interpreter shutting down): the next write lands
        with _lander_lock:
            _lander = None


def _land_until_settled() -> None:
    """The lander: every :data:`RETRY` seconds, land what is owed; end once nothing is (or a
    janitor took over). Decided under ``_lander_lock``, which :func:`owe`'s start takes too: an
    end owed as it decides either is seen here or starts the next lander."""
    global _lander
    while True:
        time.sleep(RETRY)
        try:
            settle_owed()
        except Exception:  # never ends the thread with ends still owed
            log.debug("landing owed request ends failed", exc_info=True)
        with _lander_lock:
            if not queue or listeners:
                _lander = None
                return


def _settle_at_exit() -> None:
    """At interpreter exit, where the lander and the janitor (daemon threads) die: land what
    is owed, a try every :data:`RETRY` seconds until :data:`EXIT_WAIT` seconds have passed (a
    try that meets the stalled lock waits at most the store's lock timeout). An owed handle
    end is left to the reaper of the dead process's rows, but a plain clear would be lost:
    its cancellation row would stand until its TTL. What still cannot land is logged."""
    if not queue:
        return
    deadline = time.monotonic() + EXIT_WAIT
    while True:
        try:
            settle_owed()
        except Exception:
            log.debug("landing owed request ends at exit failed", exc_info=True)
        left = deadline - time.monotonic()
        if not queue or left <= 0:
            break
        time.sleep(min(RETRY, left))
    if queue:
        log.warning("exiting with %d request ends still owed to a stalled registry: their "
                    "in-flight rows are reaped later; a cancellation row a clear() owed stays "
                    "until its TTL", len(queue))


atexit.register(_settle_at_exit)


def forgo_untrack(st: Storage, scope: str, rid: str, owner: Owner) -> bool:
    """Drop an owed untrack (no clear) of ``owner``'s row of ``(scope, rid)``: that thread
    tracks the id again, and the row the untrack would remove stands for the new request (a
    thread's ``track`` rows of one key are one row). Waits for an owed end landing meanwhile,
    so it cannot land after this returns. Returns whether one was dropped."""
    with _owed_lock:
        for entry in list(queue):
            if (entry[0] is st and entry[4] is None and entry[3] == owner
                    and entry[1] == scope and entry[2] == rid):
                with contextlib.suppress(ValueError):
                    queue.remove(entry)
                return True
    return False


def owed_ends() -> int:
    """How many request ends this process still owes to a registry (see the module docstring)."""
    return len(queue)


def _land(st: Storage, scope: str, rid: str, owner: Owner | None,
          ended_at: float | None) -> None:
    """An owed end, as one store operation (:meth:`Storage.end`; an owed plain untrack:
    :meth:`Storage.untrack` of its owner's row)."""
    if ended_at is None:
        if owner is not None:
            st.untrack(scope, rid, owner)
        return
    st.end(scope, rid, owner, ended_at)


def settle_owed() -> int:
    """Land the ends this process owes, oldest first; stops at the first
    :class:`~shmcancel.LockTimeout` (the rest stay owed). Other errors drop that end (logged).
    One thread at a time (another caller returns 0 at once). Returns the ends landed."""
    lock = _owed_lock
    if not queue or not lock.acquire(blocking=False):
        return 0
    n = 0
    try:
        for _ in range(len(queue)):  # bounded: ends owed meanwhile wait for the next call
            try:
                entry = queue[0]
            except IndexError:
                break
            try:
                _land(*entry)
            except LockTimeout:
                break
            except RegistryClosed as e:  # closed since it was owed: nowhere to land it
                log.warning("dropping an owed request end: %s", e)
            except Exception:
                log.warning("dropping an owed request end", exc_info=True)
            else:
                n += 1
            if queue and queue[0] is entry:  # owe() may have dropped it meanwhile
                queue.popleft()
    finally:
        lock.release()
    return n
