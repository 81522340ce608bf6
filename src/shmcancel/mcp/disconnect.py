"""Disconnect is cancellation (SPEC §6.3): watch a request's client socket while its tool runs.

A sync WSGI worker writes nothing while a tool computes, so a client that goes away is not
noticed by a failed write. Once the request body has been read completely, the client has
nothing more to send on that request, so the socket becoming readable means one of:

- end of stream (``recv(1, MSG_PEEK | MSG_DONTWAIT) == b""``) or a reset (``ECONNRESET``):
  the client is gone;
- data: a pipelined next request — *not* a disconnect. The watcher then stops asking for
  ``POLLIN`` (it would stay readable) and keeps waiting for ``POLLRDHUP``/``POLLHUP``, which the
  kernel raises when the peer shuts its side down;
- ``EAGAIN`` (``BlockingIOError``): a spurious wake-up; the client is still there.

A client that half-closes (``shutdown(SHUT_WR)``) after its request is indistinguishable from
one that left, and counts as gone — as in nginx and most servers.

:class:`Watcher` is one short-lived daemon thread per request, blocking in ``poll(2)`` on the
client fd and on a private wake-up pipe (so :meth:`Watcher.stop` returns at once), with
``interval`` as the longest sleep between two looks at its own state. On a disconnect it calls
``on_disconnect()`` (the transport cancels exactly that request: ``handle.cancel_local``), then
waits ``grace`` seconds for the request to end; if it has not, it calls ``on_timeout()`` (the
transport stops the tool). ``stop()`` before either callback guarantees neither runs later.

TLS sockets (``ssl.SSLSocket``) refuse ``MSG_PEEK``; they are not watched (:func:`watchable`).
Linux is assumed (``POLLRDHUP``); elsewhere the watcher relies on ``POLLIN``/``POLLHUP`` only.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["Watcher", "client_gone", "watchable"]

log = logging.getLogger("shmcancel.disconnect")

_POLLRDHUP = getattr(select, "POLLRDHUP", 0)
_GONE_EVENTS = select.POLLHUP | select.POLLERR | _POLLRDHUP
_GONE_ERRNOS = (errno.ECONNRESET, errno.ENOTCONN, errno.EPIPE, errno.ETIMEDOUT,
                errno.ECONNABORTED)


def watchable(sock: Any) -> bool:
    """Whether ``sock`` can be watched: a plain, open stream socket (not TLS) and ``poll(2)``
    is available."""
    if not hasattr(select, "poll") or not isinstance(sock, socket.socket):
        return False
    if isinstance(sock, ssl.SSLSocket):
        return False
    try:
        return sock.fileno() >= 0
    except OSError:
        return False


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
    """Watch one client socket from a daemon thread until :meth:`stop` (see the module doc).

    ``disconnected_at`` is the ``time.monotonic()`` of the detection, ``None`` until then.
    """

    def __init__(self, sock: socket.socket, *, on_disconnect: Callable[[], None],
                 on_timeout: Callable[[], None] | None, grace: float,
                 interval: float = 0.01) -> None:
        self._sock = sock
        self._on_disconnect = on_disconnect
        self._on_timeout = on_timeout
        self._grace = max(0.0, float(grace))
        self._interval_ms = max(1, int(interval * 1000))
        self._lock = threading.Lock()  # orders stop() against the callbacks
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._wake_r = self._wake_w = -1
        self.disconnected_at: float | None = None

    def start(self) -> bool:
        """Start watching; ``False`` (and nothing started) when the socket cannot be watched."""
        if not watchable(self._sock):
            return False
        try:
            self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            t = threading.Thread(target=self._run, name="shmcancel-disconnect", daemon=True)
            t.start()
        except (OSError, RuntimeError):
            log.warning("cannot start the disconnect watcher", exc_info=True)
            self._close_pipe()
            return False
        self._thread = t
        return True

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    def wait_stopped(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for :meth:`stop`; ``True`` once it was called."""
        return self._stopped.wait(timeout)

    def stop(self, join_timeout: float = 1.0) -> None:
        """Stop watching. After it returns no callback starts; an ``on_timeout`` already running
        (stopping a tool) is not waited for beyond ``join_timeout``."""
        with self._lock:
            if self._stopped.is_set():
                return
            self._stopped.set()
            if self._wake_w >= 0:
                with contextlib.suppress(OSError):
                    os.write(self._wake_w, b"x")
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(join_timeout)

    @contextlib.contextmanager
    def running(self) -> Iterator[bool]:
        """Hold off :meth:`stop` for the ``with`` block; yields whether the watcher is still
        running. ``on_timeout`` uses it so nothing is done to a request that has just ended."""
        with self._lock:
            yield not self._stopped.is_set()

    def _close_pipe(self) -> None:
        # Only ever under self._lock (or before the thread exists), so stop() never writes to a
        # descriptor number that was closed and reused.
        for attr in ("_wake_r", "_wake_w"):
            fd = getattr(self, attr)
            if fd >= 0:
                setattr(self, attr, -1)
                with contextlib.suppress(OSError):
                    os.close(fd)

    # ----------------------------------------------------------------- the thread

    def _run(self) -> None:
        try:
            if self._wait_for_disconnect():
                self._after_disconnect()
        except Exception:
            log.warning("disconnect watcher failed", exc_info=True)
        finally:
            with self._lock:
                self._close_pipe()

    def _wait_for_disconnect(self) -> bool:
        try:
            fd = self._sock.fileno()
        except OSError:
            return False
        if fd < 0:
            return False
        poller = select.poll()
        mask = select.POLLIN | _POLLRDHUP
        poller.register(fd, mask)
        poller.register(self._wake_r, select.POLLIN)
        while not self._stopped.is_set():
            try:
                events = poller.poll(self._interval_ms)
            except InterruptedError:  # pragma: no cover - PEP 475 retries
                continue
            for efd, ev in events:
                if efd == self._wake_r or self._stopped.is_set():
                    return False
                if ev & select.POLLNVAL:
                    return False  # the fd was closed under us: the request is over
                if ev & _GONE_EVENTS:
                    return True
                if ev & select.POLLIN:
                    gone = client_gone(self._sock)
                    if gone:
                        return True
                    if gone is None and mask & select.POLLIN:
                        # a pipelined request: readable until served; wait for a hang-up only
                        mask = _POLLRDHUP or select.POLLHUP
                        poller.modify(fd, mask)
        return False

    def _after_disconnect(self) -> None:
        with self._lock:
            if self._stopped.is_set():
                return
            self.disconnected_at = time.monotonic()
            try:
                self._on_disconnect()
            except Exception:
                log.warning("on_disconnect callback failed", exc_info=True)
        if self._on_timeout is None or self._stopped.wait(self._grace):
            return
        with self._lock:
            if self._stopped.is_set():
                return
        # The request did not end within the grace period: the callback stops the tool. It may
        # take a while (it waits for the tool); stop() no longer waits for it.
        try:
            self._on_timeout()
        except Exception:
            log.warning("on_timeout callback failed", exc_info=True)
