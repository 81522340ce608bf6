"""Stopping a tool that runs on after its client left (contract §6.3): its rows go first, then in a
``sync`` worker the worker quits (``SIGQUIT``, ``os._exit`` if that does not end it), in
``gthread`` :class:`RequestStopped` is raised in the tool's thread. A tool that even that does
not end (blocked in a C call) keeps its thread while the worker serves on with the others; once
no other call runs in the worker (at most :data:`_RETIRE_WAIT` later) the worker is asked to
exit gracefully (``SIGTERM``), and ends itself (``os._exit``) once that is over. Called by the
disconnect watcher's timeout (:mod:`.call`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

from ..cancel import owed
from .disconnect import Watcher

log = logging.getLogger("shmcancel.server")  # one logger for the whole app, as before

_HARD_EXIT_GRACE = 1.0  # seconds between SIGQUIT and os._exit for a sync worker's stuck tool
_GRACEFUL_TIMEOUT = 30.0  # gunicorn's default graceful_timeout, when the hooks did not record it
_QUIET_POLL = 0.1  # seconds between two looks for a moment with no other call in the worker
# the longest (seconds) a gthread worker holding a stuck tool serves on waiting for that moment;
# past it the worker is retired anyway, its calls given gunicorn's graceful_timeout
_RETIRE_WAIT = 600.0
_given_up: set[int] = set()  # ids of the watchers of the tools whose threads were given up


class RequestStopped(BaseException):
    """Raised inside a ``gthread`` tool's thread when its client left and it did not return
    within ``stream_cancel_timeout``. A ``BaseException`` so ``except Exception`` in tool code
    does not swallow it."""


def gunicorn_quits(environ: Mapping[str, Any]) -> bool:
    """Whether a ``SystemExit`` raised while serving ``environ`` is one gunicorn would catch
    itself, answering its HTML 500: a request of a gunicorn worker (``gunicorn.socket``) served
    in the main thread, as a ``sync`` worker serves it. There gunicorn's signal handlers raise
    it after marking the worker not alive: its quit (``SIGQUIT``, a quick shutdown's
    ``SIGINT``; and :func:`_stop_request`'s) and its abort (``SIGABRT``, the worker timeout),
    so the worker exits once the request is answered, whoever answers it. (A ``gthread`` tool
    runs in a thread of the pool, where no handler raises.)"""
    return "gunicorn.socket" in environ and threading.current_thread() is threading.main_thread()


def _stop_request(watcher: Watcher, handle: Any, tool_thread: int, multithread: bool,
                  grace: float) -> None:
    """The client left ``grace`` seconds ago and the tool is still running: stop it.

    First its rows go (untrack, clear), so nothing of the request stays in the tables whatever
    happens next. Then, in a ``sync`` worker (the request is the process), gunicorn's own quit
    (``SIGQUIT``: ``SystemExit`` in the main thread, which unwinds the tool) and gunicorn forks a
    replacement; ``os._exit`` if the tool is stuck where no signal handler can run. In
    ``gthread``, :class:`RequestStopped` is raised in the tool's thread; if it has still not
    returned after another ``grace``, its thread is lost to it, and the worker serves on with
    the others until no other client's call runs in it (another client's request is never cut
    for this one: §6.3), then is asked to exit gracefully (``SIGTERM``). Exiting, the process
    joins every thread of its pool, the stuck one's too: it would linger, accepting nothing and
    not replaced, until the tool returned (or gunicorn's ``timeout`` killed it). So once the
    graceful period is over, it ends itself (``os._exit``) and gunicorn forks a replacement.
    """
    handle.end()
    if not multithread:
        with watcher.running() as running:
            if not running:
                return
            log.warning("a tool did not return %.1fs after its client left; the worker exits "
                        "(gunicorn replaces it)", grace)
            os.kill(os.getpid(), signal.SIGQUIT)
        if not watcher.wait_stopped(_HARD_EXIT_GRACE):
            _exit_unless_stopped(watcher, b"shmcancel: a stuck tool ignored the worker's quit; "
                                          b"exiting now\n")
        return
    with watcher.running() as running:
        if not running:
            return
        log.warning("a tool did not return %.1fs after its client left; stopping its thread",
                    grace)
        _async_raise(tool_thread, RequestStopped)
    if watcher.wait_stopped(max(grace, 1.0)):
        return
    with watcher.running() as running:  # the tool may have ended as the wait timed out
        if not running:
            return
        _given_up.add(id(watcher))
        others = len(owed.running)
        if others:
            log.error("a stopped tool still runs; the worker serves on without its thread and "
                      "is replaced once none of its %d other call(s) runs", others)
    try:
        if not _wait_quiet(watcher, time.monotonic() + _RETIRE_WAIT):
            return
        with watcher.running() as running:
            if not running:
                return
            log.error("a stopped tool still runs; asking the worker to exit gracefully")
            os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + _graceful_timeout() + _HARD_EXIT_GRACE
        if _wait_drained(watcher, deadline):
            _exit_unless_stopped(watcher, b"shmcancel: a stuck tool ignored RequestStopped; "
                                          b"its worker's graceful shutdown is over: exiting "
                                          b"now\n")
    finally:
        _given_up.discard(id(watcher))


def _wait_quiet(watcher: Watcher, deadline: float) -> bool:
    """Wait until no request of this process is running but stuck ones (their handles ended:
    no token in ``owed.running``), or ``deadline`` (monotonic) passed: ``True``; ``False`` when
    the tool ended first."""
    while not watcher.wait_stopped(_QUIET_POLL):
        if not owed.running or time.monotonic() >= deadline:
            return True
    return False


def _wait_drained(watcher: Watcher, deadline: float) -> bool:
    """After the worker was asked to exit: wait until its graceful shutdown has nothing left
    but given-up tools (gunicorn's count of the worker's open connections, ``nr_conns``, no
    more than their number, and no call running), or ``deadline`` (monotonic): ``True``;
    ``False`` when the tool ended first. Without the count (another worker class, a gunicorn
    without it) only the deadline ends the wait: the stuck connection keeps the graceful
    shutdown going until its ``graceful_timeout``, and the worker accepts nothing meanwhile."""
    while not watcher.wait_stopped(_QUIET_POLL):
        conns = _worker_conns()
        if time.monotonic() >= deadline or (
                conns is not None and conns <= len(_given_up) and not owed.running):
            return True
    return False


def _worker_conns() -> int | None:
    """The open connections of this process's gunicorn worker (``gthread``'s ``nr_conns``),
    or ``None`` when not known."""
    hooks = sys.modules.get("shmcancel.gunicorn")
    n = getattr(getattr(getattr(hooks, "_state", None), "worker", None), "nr_conns", None)
    return n if type(n) is int else None


def _exit_unless_stopped(watcher: Watcher, why: bytes) -> None:
    """End the process now, unless the tool ended after all. Decided under the watcher's lock:
    ``wait_stopped`` timing out says nothing of a ``stop()`` made just then (it sets its event
    after letting go of the lock), and once the decision is taken here a ``stop()`` waits for
    it, so a worker whose tool ended (answering its call, serving on) is never cut short."""
    with watcher.running() as running:
        if not running:
            return
        with contextlib.suppress(OSError):
            os.write(2, why)
        os._exit(1)


def _graceful_timeout() -> float:
    """The worker's ``graceful_timeout``, as ``shmcancel.gunicorn``'s ``post_fork`` recorded it
    (not imported here: without those hooks, gunicorn's default)."""
    hooks = sys.modules.get("shmcancel.gunicorn")
    value = getattr(getattr(hooks, "_state", None), "graceful_timeout", None)
    return value if isinstance(value, float) else _GRACEFUL_TIMEOUT


def _async_raise(thread_ident: int, exc: type[BaseException]) -> bool:
    import ctypes  # here: loading it costs every worker memory, and this runs rarely

    n = ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_ident),
                                                   ctypes.py_object(exc))
    if n > 1:  # pragma: no cover - cannot happen for one ident; undo as the C API asks
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_ident), None)
        return False
    return n == 1
