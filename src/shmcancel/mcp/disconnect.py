"""Disconnect is cancellation (contract §6.3): watch a request's client socket while its tool runs.

Once the request body is read, the socket turning readable means: end of stream or
``ECONNRESET`` — the client is gone (a half-close counts as gone); data — a pipelined next
request, not a disconnect (the watcher then waits for ``EPOLLRDHUP``/``EPOLLHUP`` only);
``EAGAIN`` — a spurious wake-up.

A :class:`Watcher` is one request's registration with its process's single watcher thread
(``shmcancel-disconnect``, level-triggered epoll over every watched socket). While calls keep
starting, a call still running a :data:`TICK` after its start is registered (so a call
shorter than a tick costs no ``epoll_ctl``, each of which releases the GIL: in a busy
``gthread`` worker a handoff to another thread and back). This step is taken by the first
call's ``start`` that finds the oldest waiting call a tick old, so under load the thread
itself need not wake for it: it wakes :data:`LATE` after the oldest waiting call's start, and
a tick after it once calls stop starting or events woke it. A disconnect is seen at most two
ticks late while calls keep starting or clients leave, at most :data:`LATE` and a tick late
when the starts stop or come further apart than a tick. When the thread sleeps longer (no call
started for :data:`ACTIVE_FOR`), ``start`` registers at once. The thread starts on the first
watch in a process (never in a gunicorn master) and again in a fork child. On a disconnect it calls
``on_disconnect()``; ``grace`` seconds later, if the request has not ended, ``on_timeout()`` runs
in a thread of its own.
``stop()`` before either callback guarantees neither runs later. An event is trusted only for
registrations older than the ``epoll_wait`` that returned it (descriptor numbers are reused).

Bounds: at most :data:`MAX_WATCHED` sockets per process (beyond: unwatched, logged once); the
thread never sleeps longer than :data:`IDLE_WAIT`. Its epoll descriptor closed behind its back
(a ``closerange``), the loop ends and the next watch starts another. TLS sockets are not watched
(:func:`watchable`); without ``select.epoll`` nothing is. Why this shape: docs/design.md.
"""

from __future__ import annotations

import contextlib
import errno
import heapq
import itertools
import logging
import math
import os
import select
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from ..shm import procinfo

__all__ = ["IDLE_WAIT", "MAX_WATCHED", "Watcher", "client_gone", "watchable", "watched_count",
           "watcher_thread"]

log = logging.getLogger("shmcancel.disconnect")

MAX_WATCHED = 4096
"""The most client sockets one process watches at once; a call beyond it runs unwatched."""
IDLE_WAIT = 1.0
"""The longest the watcher thread blocks in ``epoll_wait`` (seconds)."""
TICK = 0.005
"""Seconds a call runs before its socket is registered while calls keep starting (a shorter
call costs no ``epoll_ctl``; see the module docstring)."""
LATE = 0.05
"""The longest a running call waits for its registration while the calls' starts take the steps
(seconds): the thread takes the step :data:`LATE` after the oldest waiting call's start."""
ACTIVE_FOR = 0.1
"""Seconds after a call started during which registrations stay deferred (:data:`TICK`); after
that, a starting call is registered at once."""

_HAS_EPOLL = hasattr(select, "epoll")
_EPOLLIN = getattr(select, "EPOLLIN", 0)
_EPOLLRDHUP = getattr(select, "EPOLLRDHUP", 0)
_GONE_EVENTS = (getattr(select, "EPOLLHUP", 0) | getattr(select, "EPOLLERR", 0)
                | _EPOLLRDHUP)
_WATCH_MASK = _EPOLLIN | _EPOLLRDHUP
_HANGUP_MASK = _EPOLLRDHUP  # EPOLLHUP and EPOLLERR are always reported
_MAX_EVENTS = 256
_GONE_ERRNOS = (errno.ECONNRESET, errno.ENOTCONN, errno.EPIPE, errno.ETIMEDOUT,
                errno.ECONNABORTED)


def watchable(sock: Any) -> bool:
    """Whether ``sock`` can be watched: a plain, open stream socket (not TLS) and ``epoll`` is
    available."""
    return _watchable_fd(sock) >= 0


def _watchable_fd(sock: Any) -> int:
    """``sock``'s descriptor when it can be watched (see :func:`watchable`), else -1."""
    if not _HAS_EPOLL or not isinstance(sock, socket.socket):
        return -1
    # ssl is not imported for this check: with no ssl module loaded there is no SSLSocket
    ssl = sys.modules.get("ssl")
    if ssl is not None and isinstance(sock, ssl.SSLSocket):
        return -1
    try:
        return sock.fileno()
    except OSError:
        return -1


def client_gone(sock: socket.socket) -> bool | None:
    """Peek one byte without blocking: ``True`` when the peer closed or reset, ``False`` when it
    is still there with nothing to read, ``None`` when data is waiting (a pipelined request)."""
    try:
        data = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return False
    except OSError as e:
        return e.errno in _GONE_ERRNOS or isinstance(e, ConnectionError)
    return True if data == b"" else None


class Watcher:
    """One request's watch over its client socket, from :meth:`start` to :meth:`stop` (see the
    module doc). ``disconnected_at`` is the ``time.monotonic()`` of the detection, ``None`` until
    then."""

    __slots__ = ("_done", "_fd", "_grace", "_lock", "_loop", "_on_disconnect", "_on_timeout",
                 "_sock", "_stopped", "disconnected_at")

    def __init__(self, sock: socket.socket, *, on_disconnect: Callable[[], None],
                 on_timeout: Callable[[], None] | None, grace: float) -> None:
        self._sock = sock
        self._on_disconnect: Callable[[], None] | None = on_disconnect
        self._on_timeout = on_timeout
        self._grace = max(0.0, float(grace))
        self._lock = threading.Lock()  # orders stop() against the callbacks
        self._stopped = False
        self._done: threading.Event | None = None  # made by the first wait_stopped()
        self._loop: _Loop | None = None
        self._fd = -1
        self.disconnected_at: float | None = None

    def start(self) -> bool:
        """Start watching; ``False`` (and nothing registered) when the socket cannot be watched,
        the process watches :data:`MAX_WATCHED` sockets already, or the watcher thread cannot
        be started."""
        fd = _watchable_fd(self._sock)
        if fd < 0:
            return False
        loop = _process_loop()
        if loop is None:
            return False
        self._loop, self._fd = loop, fd
        if loop.add(self, fd):
            return True
        self._loop, self._fd = None, -1
        return False

    @property
    def stopped(self) -> bool:
        return self._stopped

    def wait_stopped(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for :meth:`stop`; ``True`` once it was called."""
        with self._lock:
            if self._stopped:
                return True
            if self._done is None:
                self._done = threading.Event()
            done = self._done
        return done.wait(timeout)

    def stop(self) -> None:
        """Stop watching. After it returns no callback starts; an ``on_timeout`` already running
        (stopping a tool) is not waited for. The callbacks are dropped: one that refers back to
        its watcher (as the transport's does) then leaves no reference cycle, which only the
        cyclic garbage collector would free (a full collection in a worker costs milliseconds).
        Called again, it finishes a stop that an exception cut short: ``RequestStopped``, raised
        while the stop thread held the lock, lands in here once the tool's thread has it (at the
        first call: the event's ``set``, which a stop that merely returned then never made)."""
        with self._lock:
            self._stopped = True
            self._on_disconnect = self._on_timeout = None
            done, loop = self._done, self._loop
        if done is not None:
            done.set()
        if loop is not None:
            loop.remove(self, self._fd)
            self._loop = None

    @contextlib.contextmanager
    def running(self) -> Iterator[bool]:
        """Hold off :meth:`stop` for the ``with`` block; yields whether the watcher is still
        running. ``on_timeout`` uses it so nothing is done to a request that has just ended."""
        with self._lock:
            yield not self._stopped

    # --------------------------------------------------- called by the watcher thread

    def _disconnected(self) -> bool:
        """The client is gone: ``on_disconnect()`` unless stopped; whether a deadline is due."""
        with self._lock:
            on_disconnect = self._on_disconnect
            if self._stopped or on_disconnect is None:
                return False
            self.disconnected_at = time.monotonic()
            try:
                on_disconnect()
            except Exception:
                log.warning("on_disconnect callback failed", exc_info=True)
        return self._on_timeout is not None

    def _timed_out(self) -> None:
        """``grace`` has passed since the disconnect (run in a thread of its own)."""
        with self._lock:
            if self._stopped or self._on_timeout is None:
                return
            on_timeout = self._on_timeout
        # The request did not end within the grace period: the callback stops the tool. It may
        # take a while (it waits for the tool); stop() does not wait for it.
        try:
            on_timeout()
        except Exception:
            log.warning("on_timeout callback failed", exc_info=True)


class _Loop:
    """A process's watcher: one epoll set and the thread waiting on it.

    ``_watched`` maps each registered descriptor to its :class:`Watcher` and the registration's
    generation (a counter bumped by every registration); it and the epoll set change together
    under ``_lock``. ``_pending`` (also under ``_lock``) holds the watchers started but not
    registered yet, with their start times, in start order; ``_oldest`` is no later than the
    first one's start (``inf`` when none: a stop leaves it older, the next step corrects it);
    ``_ticking`` says registrations are deferred (:meth:`_step`) now. ``_due`` (a heap of
    ``(deadline, seq, watcher)``) is the thread's own.
    """

    def __init__(self) -> None:
        self.pid = procinfo.pid()
        self._running = True  # until the thread's loop ends (alive() reads it: no lock taken)
        self._ep = select.epoll()  # EPOLL_CLOEXEC
        self._lock = threading.Lock()
        self._watched: dict[int, tuple[Watcher, int]] = {}
        self._pending: dict[Watcher, tuple[int, float]] = {}  # watcher -> (fd, start time)
        self._oldest = math.inf  # at or before the first pending one's start (under _lock)
        self._ticking = False
        self._last_start = -math.inf  # monotonic time of the latest start (under _lock)
        self._woken_at = -math.inf  # when the thread last handled events (the thread's own)
        self._gen = 0
        self._due: list[tuple[float, int, Watcher]] = []
        self._seq = itertools.count()
        self._warned_full = False
        self._readers: dict[int, Callable[[], None]] = {}  # fd -> what to call when readable
        self._ticker: Callable[[], float] | None = None  # see set_ticker
        self.thread = threading.Thread(target=self._run, name="shmcancel-disconnect",
                                       daemon=True)
        try:
            self.thread.start()
        except BaseException:
            self._ep.close()
            raise

    def alive(self) -> bool:
        return self._running and self.pid == procinfo.pid()

    def count(self) -> int:
        return len(self._watched) + len(self._pending)

    def add(self, w: Watcher, fd: int) -> bool:
        with self._lock:
            if len(self._watched) + len(self._pending) >= MAX_WATCHED \
                    and fd not in self._watched:
                if not self._warned_full:
                    self._warned_full = True
                    log.warning("%d client sockets are watched in this process already; calls "
                                "beyond that run without disconnect detection", MAX_WATCHED)
                return False
            now = self._last_start = time.monotonic()
            if self._ticking:  # registered if it still runs a tick on
                if not self._pending:
                    self._oldest = now
                self._pending[w] = (fd, now)
                if now - self._oldest >= TICK:
                    self._step(now)
                return True
            return self._register(w, fd)

    def _register(self, w: Watcher, fd: int) -> bool:
        """Add ``w``'s socket to the epoll set; the caller holds ``_lock``."""
        self._gen += 1
        # A reader on this number had its descriptor closed behind the loop's back (a
        # closerange): the number is this socket's now, and so are its events. Dropped before
        # the registration: epoll_ctl releases the GIL, and the thread must not hand an event
        # of this socket to that reader (it would read the client's bytes).
        self._readers.pop(fd, None)
        try:
            try:
                self._ep.register(fd, _WATCH_MASK)
            except FileExistsError:  # a registration left behind on this socket
                self._ep.modify(fd, _WATCH_MASK)
        except (OSError, ValueError):
            log.warning("cannot watch a client socket", exc_info=True)
            self._watched.pop(fd, None)
            return False
        self._watched[fd] = (w, self._gen)
        return True

    def remove(self, w: Watcher, fd: int) -> None:
        if self.pid != procinfo.pid():
            return  # a copy inherited across fork: its epoll set is the parent's
        with self._lock:
            if self._pending.pop(w, None) is not None:
                return  # never registered
            cur = self._watched.get(fd)
            if cur is None or cur[0] is not w:
                return  # the thread dropped it at the disconnect, or the fd was reused
            # Unregistered first: a signal handler's exception between the two (gunicorn's quit
            # in a sync worker) leaves the entry, which stop() called again removes; the other
            # order left the fd in the epoll set with no entry, level-triggered: a spinning
            # thread once its client left. A loop that ended (its epoll descriptor closed behind
            # its back) leaves the number alone: it may be another epoll set's now.
            if self._running:
                with contextlib.suppress(OSError, ValueError):
                    self._ep.unregister(fd)
            del self._watched[fd]

    def _step(self, now: float) -> None:
        """Register the pending watchers started a :data:`TICK` or more before ``now`` (still
        running: :meth:`remove` takes a stopped one out) and set ``_oldest``; the caller holds
        ``_lock``, which ``stop`` takes too, so each one's request has not ended and its socket
        is still open."""
        pending = self._pending
        while pending:
            w = next(iter(pending))
            fd, started = pending[w]
            if now - started < TICK:
                self._oldest = started
                return
            del pending[w]
            self._register(w, fd)  # a failure is logged; the call runs on unwatched
        self._oldest = math.inf

    def _promote(self) -> float:
        """In the thread, at a wake: take the step if the oldest pending call is a tick old and
        no call's start will take it, or if it has waited :data:`LATE`; return how long the next
        wait may be (seconds: until then, at most :data:`LATE`, so a call started meanwhile waits
        no longer). The starts are trusted with the step while one came within a tick and after
        the thread last handled events (``_woken_at``: a disconnect, a doorbell): clients leaving
        or calls cancelled may be what stops the starts (a burst of them), and the calls started
        just before must be registered within ticks, not :data:`LATE`. After a step the oldest
        pending call is younger than a tick: the wait is never zero twice."""
        with self._lock:
            now = time.monotonic()
            busy = self._last_start > self._woken_at and now - self._last_start < TICK
            wait = LATE if busy else TICK
            if now - self._oldest >= wait:
                self._step(now)
            self._ticking = bool(self._pending) or now - self._last_start < ACTIVE_FOR
            if not self._ticking:
                return IDLE_WAIT
            return max(0.0, min(self._oldest + wait - now, LATE))

    def add_reader(self, fd: int, fn: Callable[[], None]) -> bool:
        """Call ``fn()`` in the watcher thread whenever ``fd`` is readable (level-triggered: it
        must drain ``fd``); for as long as the process runs. ``False`` when it cannot be added."""
        with self._lock:
            # A watched socket on this number was closed behind the loop's back: its entry
            # goes (and a deferred one), or its request's stop (or the deferred registration)
            # would take this descriptor out of the set. The reader is in
            # place before the registration (epoll_ctl releases the GIL: see _register).
            self._watched.pop(fd, None)
            for w, (pfd, _) in list(self._pending.items()):
                if pfd == fd:  # a deferred registration on that number: stale too
                    del self._pending[w]
            self._readers[fd] = fn
            try:
                self._ep.register(fd, _EPOLLIN)
            except (OSError, ValueError):
                self._readers.pop(fd, None)
                log.warning("cannot watch a descriptor", exc_info=True)
                return False
        return True

    def set_ticker(self, fn: Callable[[], float]) -> None:
        """Call ``fn()`` in the watcher thread at every turn, for as long as the process runs; it
        returns how long the thread may wait before calling it again (seconds; ``math.inf``: only
        at the next turn, when other events or timeouts take it)."""
        self._ticker = fn

    # ----------------------------------------------------------------- the thread

    def _run(self) -> None:
        try:
            while True:
                try:
                    if not self._turn():
                        return
                except Exception:  # keep watching the others; a bug must not end detection
                    log.warning("disconnect watcher failed", exc_info=True)
                    time.sleep(0.01)
        finally:
            self._running = False

    def _turn(self) -> bool:
        """One wait and what it found; ``False`` once the epoll set is closed."""
        timeout = self._promote()
        if self._due:
            timeout = min(timeout, max(0.0, self._due[0][0] - time.monotonic()))
        ticker = self._ticker
        if ticker is not None:
            timeout = min(timeout, max(0.0, ticker()))
        seen_gen = self._gen
        try:
            events = self._ep.poll(timeout, _MAX_EVENTS)
        except ValueError:  # closed
            return False
        except OSError as e:
            if e.errno not in (errno.EBADF, errno.EINVAL):
                raise
            # The epoll descriptor was closed behind the loop's back (a closerange; EINVAL: its
            # number is another file's already): this loop ends, and the next watch starts
            # another. The object is kept, never closed: its number may be another file's.
            _abandoned.append(self._ep)
            return False
        for fd, ev in events:
            reader = self._readers.get(fd)
            if reader is not None:
                reader()
                continue
            w = self._look(fd, ev, seen_gen)
            if w is not None and w._disconnected():
                heapq.heappush(self._due, (time.monotonic() + w._grace, next(self._seq), w))
        if events:
            self._woken_at = time.monotonic()
        self._run_due()
        return True

    def _look(self, fd: int, ev: int, seen_gen: int) -> Watcher | None:
        """The watcher whose client is gone, unregistered; ``None`` when no one's is."""
        with self._lock:
            cur = self._watched.get(fd)
            if cur is None:
                return None
            w, gen = cur
            if gen > seen_gen:
                return None  # the event may be the fd's previous socket's; ask again
            if ev & _GONE_EVENTS:
                gone: bool | None = True
            elif ev & _EPOLLIN:
                gone = client_gone(w._sock)
                if gone is None:
                    # a pipelined request: readable until served; wait for a hang-up only
                    with contextlib.suppress(OSError):
                        self._ep.modify(fd, _HANGUP_MASK)
            else:
                gone = False
            if not gone:
                return None
            del self._watched[fd]
            with contextlib.suppress(OSError, ValueError):
                self._ep.unregister(fd)
        return w

    def _run_due(self) -> None:
        due = self._due
        now = time.monotonic()
        while due and due[0][0] <= now:
            w = heapq.heappop(due)[2]
            if w.stopped:
                continue
            try:
                threading.Thread(target=w._timed_out, name="shmcancel-stop", daemon=True).start()
            except RuntimeError:  # cannot start threads (interpreter shutting down)
                log.warning("cannot stop a tool whose client left", exc_info=True)
        if len(due) > 2 * MAX_WATCHED:  # many ended in their grace period: drop them
            self._due = [d for d in due if not d[2].stopped]
            heapq.heapify(self._due)


_state_lock = threading.Lock()
_loop: _Loop | None = None
_abandoned: list[Any] = []  # epoll objects whose descriptor was closed behind their back


def process_loop() -> _Loop | None:
    """This process's watcher (started on first use), ``None`` when it cannot be started."""
    return _process_loop()


def _process_loop() -> _Loop | None:
    """This process's watcher, started on first use; ``None`` when it cannot be started."""
    global _loop
    loop = _loop
    if loop is not None and loop.alive():
        return loop
    with _state_lock:
        loop = _loop
        if loop is not None and loop.alive():
            return loop
        # A parent's loop (its epoll set) in a fork child; like procinfo.me(), this relies on
        # the at-fork hooks, which os.fork always runs.
        if loop is not None and loop.pid != procinfo.pid():
            _close_inherited(loop)
        try:
            _loop = loop = _Loop()
        except (OSError, RuntimeError):
            log.warning("cannot start the disconnect watcher", exc_info=True)
            return None
        return loop


def _after_fork_in_child() -> None:
    # The child has none of the parent's threads; the epoll set it inherited is the parent's.
    global _loop, _state_lock
    _state_lock = threading.Lock()
    loop, _loop = _loop, None
    if loop is not None:
        _close_inherited(loop)


def _close_inherited(loop: _Loop) -> None:
    """In a fork child: close the parent's epoll set, unless that loop ended because its
    descriptor was closed behind its back (the number may be another file's now)."""
    if any(ep is loop._ep for ep in _abandoned):
        return
    with contextlib.suppress(OSError, ValueError):
        loop._ep.close()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def watcher_thread() -> threading.Thread | None:
    """This process's watcher thread, ``None`` before the first watch (or after a fork)."""
    loop = _loop
    return loop.thread if loop is not None and loop.alive() else None


def watched_count() -> int:
    """How many client sockets this process watches now."""
    loop = _loop
    return loop.count() if loop is not None and loop.alive() else 0
