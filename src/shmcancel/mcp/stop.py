"""Stopping a tool that runs on after its client left (contract §6.3): its rows go first, then in a
``sync`` worker the worker quits (``SIGQUIT``, ``os._exit`` if that does not end it), in
``gthread`` :class:`RequestStopped` is raised in the tool's thread. A tool that even that does
not end (blocked in a C call) keeps its thread while the worker serves on with the others; once
nothing else is busy in the worker (:func:`_quiet`, at most :data:`_RETIRE_WAIT` later) the
worker is asked to exit gracefully (``SIGTERM``), and ends itself (``os._exit``) as soon as
nothing but given-up tools is left. Called by the disconnect watcher's timeout (:mod:`.call`).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
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
#: The requests this process's MCP app is serving: the thread that called it -> its token,
#: from the call until the answer's ``close()`` (the server calls it once the answer is
#: written): :class:`Served`. One entry per thread: a request whose answer was never closed
#: (a middleware breaking PEP 3333) is replaced by its thread's next one.
serving: dict[int, int] = {}
_tokens = itertools.count()


def counted(app: Callable[[Any, Any, Any], Iterable[bytes]]
            ) -> Callable[[Any, Any, Any], Iterable[bytes]]:
    """A WSGI app's ``__call__`` whose every request is counted in :data:`serving` from its
    call until the server closes its answer (:class:`Served`)."""
    def call(self: Any, environ: Any, start_response: Any) -> Iterable[bytes]:
        ident, token = threading.get_ident(), next(_tokens)
        serving[ident] = token
        try:
            return Served(app(self, environ, start_response), ident, token)
        except BaseException:
            _served(ident, token)
            raise
    call.__doc__ = app.__doc__
    return call


def _served(ident: int, token: int) -> None:
    if serving.get(ident) == token:
        serving.pop(ident, None)


class Served(list[bytes]):
    """An answer's body (the chunks of ``inner``, a WSGI iterable) that keeps its request in
    :data:`serving` until the server closes it (``inner``'s own ``close()`` called first)."""

    __slots__ = ("_ident", "_inner", "_token")

    def __init__(self, inner: Iterable[bytes], ident: int, token: int) -> None:
        super().__init__(inner)
        self._inner = inner
        self._ident = ident
        self._token = token

    def close(self) -> None:
        try:
            close = getattr(self._inner, "close", None)
            if close is not None:
                close()
        finally:
            _served(self._ident, self._token)


os.register_at_fork(after_in_child=serving.clear)  # a fork child serves none of these


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
    the others until nothing else is busy in it (another client's request is never cut for
    this one: §6.3), then is asked to exit gracefully (``SIGTERM``). Exiting, the process
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
        if not _wait_until(watcher, lambda: _quiet(None), time.monotonic() + _RETIRE_WAIT):
            return
        with watcher.running() as running:
            if not running:
                return
            log.error("a stopped tool still runs; asking the worker to exit gracefully")
            os.kill(os.getpid(), signal.SIGTERM)
        drained_by = time.monotonic() + _graceful_timeout() + _HARD_EXIT_GRACE
        if _wait_until(watcher, lambda: _quiet(drained_by), time.monotonic() + _RETIRE_WAIT):
            _exit_unless_stopped(watcher, b"shmcancel: a stuck tool ignored RequestStopped; "
                                          b"its worker's graceful shutdown is over: exiting "
                                          b"now\n")
    finally:
        _given_up.discard(id(watcher))


def _wait_until(watcher: Watcher, ready: Callable[[], bool], deadline: float) -> bool:
    """Look every :data:`_QUIET_POLL` seconds until ``ready()`` or ``deadline`` (monotonic):
    ``True``; ``False`` when the tool ended first."""
    while not watcher.wait_stopped(_QUIET_POLL):
        if ready() or time.monotonic() >= deadline:
            return True
    return False


def _quiet(drained_by: float | None) -> bool:
    """Whether nothing but given-up tools is left in this worker: no call running
    (``owed.running``) and no other connection that counts (:func:`_worker_load`), or every
    thread given up (no other request could be served). ``drained_by``: the exit was asked for,
    and its graceful shutdown's time (monotonic) is over then; gunicorn's count stops moving
    there, and the requests in the app (:data:`serving`, answers being written included: the
    given-up ones are in it too) are waited for instead, for at most the worker's ``timeout``
    more (after which gunicorn kills a worker that stopped notifying it). Where gunicorn's
    worker does not say, those requests decide before the exit is asked for, and after it
    once ``drained_by`` is over."""
    if owed.running:
        return False
    conns, threads, timeout = _worker_load(stopping=drained_by is not None)
    if threads is not None and len(_given_up) >= threads:
        return True
    if conns is not None and conns <= len(_given_up):
        return True
    if drained_by is None:
        return conns is None and len(serving) <= len(_given_up)
    now = time.monotonic()
    return now >= drained_by and (len(serving) <= len(_given_up)
                                  or now >= drained_by + (timeout or _GRACEFUL_TIMEOUT))


def _worker_load(stopping: bool) -> tuple[int | None, int | None, float | None]:
    """This process's gunicorn ``gthread`` worker's connections that count, its threads and
    its ``timeout`` (seconds); ``None`` where not known. On gunicorn 24 and later the open
    ones (``nr_conns``) less those idle between kept-alive requests (``keepalived_conns``),
    and while ``stopping`` all the open ones (its graceful shutdown serves, then closes, the
    idle ones); on gunicorn 23 the requests it is serving (``futures`` not done: a connection
    that has sent nothing yet is not busy, and once stopping it serves nothing else and closes
    nothing)."""
    worker = _worker()
    cfg = getattr(worker, "cfg", None)
    threads = getattr(cfg, "threads", None)
    threads = threads if type(threads) is int else None
    limit: Any = getattr(cfg, "timeout", None)
    timeout = float(limit) if type(limit) in (int, float) and limit > 0 else None
    conns: Any = getattr(worker, "nr_conns", None)
    idle = getattr(worker, "keepalived_conns", None)
    try:
        if idle is not None:
            return (conns if stopping else conns - len(idle)), threads, timeout
        return sum(not f.done() for f in list(worker.futures)), threads, timeout
    except (AttributeError, TypeError, RuntimeError):  # not a gthread worker we know
        return None, threads, timeout


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


def _worker() -> Any:
    """This process's gunicorn worker, as ``shmcancel.gunicorn``'s ``post_fork`` recorded it
    (not imported here), or ``None``."""
    hooks = sys.modules.get("shmcancel.gunicorn")
    return getattr(getattr(hooks, "_state", None), "worker", None)


def _graceful_timeout() -> float:
    """The worker's ``graceful_timeout`` (without those hooks, gunicorn's default)."""
    value: Any = getattr(getattr(_worker(), "cfg", None), "graceful_timeout", None)
    return float(value) if type(value) in (int, float) else _GRACEFUL_TIMEOUT


def _async_raise(thread_ident: int, exc: type[BaseException]) -> bool:
    import ctypes  # here: loading it costs every worker memory, and this runs rarely

    n = ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_ident),
                                                   ctypes.py_object(exc))
    if n > 1:  # pragma: no cover - cannot happen for one ident; undo as the C API asks
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_ident), None)
        return False
    return n == 1
