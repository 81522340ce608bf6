"""Stopping a tool that runs on after its client left (contract §6.3): its rows go first, then in a
``sync`` worker the worker quits (``SIGQUIT``, ``os._exit`` if that does not end it), in
``gthread`` :class:`RequestStopped` is raised in the tool's thread (``SIGTERM`` for the worker if
even that does not end it, and ``os._exit`` once its graceful shutdown is over). Called by the
disconnect watcher's timeout (:mod:`.call`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Mapping
from typing import Any

from .disconnect import Watcher

log = logging.getLogger("shmcancel.server")  # one logger for the whole app, as before

_HARD_EXIT_GRACE = 1.0  # seconds between SIGQUIT and os._exit for a sync worker's stuck tool
_GRACEFUL_TIMEOUT = 30.0  # gunicorn's default graceful_timeout, when the hooks did not record it


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
    returned after another ``grace``, the worker is asked to exit gracefully (``SIGTERM``): its
    other calls get gunicorn's ``graceful_timeout``. Exiting, the process joins every thread of
    its pool, the stuck one's too: it would linger, accepting nothing and not replaced, until
    the tool returned (or gunicorn's ``timeout`` killed it). So once that graceful period is
    over, it ends itself (``os._exit``) and gunicorn forks a replacement.
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
        log.error("a stopped tool still runs; asking the worker to exit gracefully")
        os.kill(os.getpid(), signal.SIGTERM)
    if not watcher.wait_stopped(_graceful_timeout() + _HARD_EXIT_GRACE):
        _exit_unless_stopped(watcher, b"shmcancel: a stuck tool ignored RequestStopped past the "
                                      b"worker's graceful shutdown; exiting now\n")


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
