"""Reading a request's body: the declared length against ``max_body_bytes``, the media types,
and the body itself within ``body_timeout`` seconds in all (contract §5: 413, 415, 406, 411,
408, 400; never a 5xx).

A read of ``wsgi.input`` waits for every byte it asks for, so a socket timeout would bound a
stall but not a client trickling a byte at a time: a per-process watchdog thread
(:class:`_BodyDeadlines`) shuts the socket's read side at the deadline, which ends the blocked
``recv`` at once. Only when that thread cannot be had does each read run under a socket timeout
of the time left (two more system calls a read).
"""

from __future__ import annotations

import contextlib
import heapq
import io
import itertools
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

from ..shm import procinfo
from . import codes
from .reply import _error_reply, _Reply
from .wire import RequestHeaders, is_json_content_type

__all__ = ["EndingConnection", "body_left_unread", "end_connection", "read_body"]

BODY_READ_KEY = "shmcancel.body_read"  # environ: True once read_body read the body to its end

log = logging.getLogger("shmcancel.server")

_READ_CHUNK = 65536
_BUSY_WAIT = 1.0
"""Seconds the watchdog waits with no read in progress after some were (see ``_run``)."""


def read_body(environ: dict[str, Any], headers: RequestHeaders, acceptable: bool,
              limit: int, timeout: float | None) -> bytes | _Reply:
    """The body, or the reply refusing the request (``acceptable``: the client accepts
    JSON or SSE; ``limit``: the most bytes taken, ``max_body_bytes``; ``timeout``: the seconds
    the whole body may take, ``body_timeout``, ``None`` for no bound)."""
    length = _declared_length(environ, limit)
    if length == _INVALID:
        return _error_reply(400, None, codes.INVALID_REQUEST, "Invalid Content-Length")
    if length is not None and length > limit:  # its body unread: body_left_unread
        return _error_reply(413, None, codes.INVALID_REQUEST,
                            f"Request body too large (limit {limit} bytes)")
    if not is_json_content_type(headers.content_type):
        return _error_reply(415, None, codes.INVALID_REQUEST,
                            "Unsupported Media Type: Content-Type must be application/json")
    if not acceptable:
        return _error_reply(406, None, codes.INVALID_REQUEST,
                            "Not Acceptable: accept application/json or text/event-stream")
    stream = environ.get("wsgi.input")
    if stream is None:
        environ[BODY_READ_KEY] = True
        return b""
    if length is None and not environ.get("wsgi.input_terminated"):
        return _error_reply(411, None, codes.INVALID_REQUEST,
                            "Length Required: send Content-Length")
    # chunked: read to EOF, but never more than one byte past the limit
    body, how = _read(environ, stream, limit + 1 if length is None else length, timeout)
    if how == "timed out":
        return _body_timed_out(timeout)
    if how == "failed" or (length is not None and len(body) < length):
        # the client went away mid-body, a malformed chunk; EOF before Content-Length
        return _unread(_error_reply(400, None, codes.INVALID_REQUEST,
                                    "Could not read the body"))
    if len(body) > limit:  # chunked: its rest unread (body_left_unread)
        return _error_reply(413, None, codes.INVALID_REQUEST,
                            f"Request body too large (limit {limit} bytes)")
    environ[BODY_READ_KEY] = True
    return body


_INVALID = -1  # _declared_length of a Content-Length that is no length


def _declared_length(environ: dict[str, Any], limit: int) -> int | None:
    """The request's ``Content-Length`` (``None`` without one; :data:`_INVALID` when it is
    not a length; ``limit + 1`` for one of more than 18 digits, over any limit)."""
    raw_len = environ.get("CONTENT_LENGTH")
    if raw_len in (None, ""):
        return None
    text = str(raw_len).strip()
    if not (text.isascii() and text.isdigit()):
        return _INVALID
    # leading zeros are no digits of the value (1*DIGIT: "000150" is 150)
    digits = text.lstrip("0")
    return int(digits or "0") if len(digits) <= 18 else limit + 1


def _read(environ: dict[str, Any], stream: Any, want: int,
          timeout: float | None) -> tuple[bytes, str]:
    """Up to ``want`` bytes of ``stream`` (fewer at its end) within ``timeout`` seconds in all
    (``None``: no bound): ``(bytes, "ok")``, or what was read and ``"timed out"`` or
    ``"failed"`` (the client went away mid-body, a malformed chunk)."""
    chunks: list[bytes] = []
    got = 0
    sock = environ.get("gunicorn.socket") if timeout is not None else None
    deadline = time.monotonic() + timeout if timeout is not None else 0.0
    # Past the deadline the watchdog shuts the socket's read side (the read ends at once; the
    # reply is still written). Without it, a socket timeout bounds each recv (not a trickle).
    armed = _BODY_DEADLINES.arm(sock, deadline) if sock is not None else None
    timed = sock if armed is None and hasattr(sock, "gettimeout") \
        and hasattr(sock, "settimeout") else None  # the fallback's socket
    prior = timed.gettimeout() if timed is not None else None
    how = "ok"
    try:
        while got < want:
            if timed is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    how = "timed out"
                    break
                timed.settimeout(left)
            try:
                chunk = stream.read(min(_READ_CHUNK, want - got))
            except TimeoutError:  # the client stalled mid-body
                how = "timed out"
                break
            except Exception:  # the client went away mid-body, or a malformed chunk
                how = "failed"
                break
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
    finally:
        if armed is not None:
            _BODY_DEADLINES.disarm(armed)
        if timed is not None:
            with contextlib.suppress(OSError):
                timed.settimeout(prior)
    if armed is not None and armed.fired:  # even a body read whole just then: its
        how = "timed out"  # socket reads EOF now (a disconnect)
    return b"".join(chunks), how


DRAIN_WITHIN = 0.25
"""Seconds a refused request's unread body may take to be read and discarded before its reply
(:func:`body_left_unread`); longer, or more than :data:`DRAIN_OVER` bytes over
``max_body_bytes``, the reply ends the connection."""
DRAIN_OVER = 65536  # bytes past max_body_bytes an over-limit body may have and still be drained
# (a chunked one's: past the max_body_bytes + 1 read_body read of it)


def body_left_unread(environ: dict[str, Any], limit: int) -> bool:
    """Whether the request's body is still unread once what :func:`read_body` left of it (all
    of it, when the request was refused before: 413 by its declared length, 415, 406, 403, 404,
    405) was read and discarded within :data:`DRAIN_WITHIN` seconds, up to :data:`DRAIN_OVER`
    bytes past ``limit``. Its reply then ends the connection (:class:`EndingConnection`): left
    to the server, a ``gthread`` or ``sync`` worker reads and discards it before the connection
    ends or serves its next request, with a deadline it looks at only between 1 KiB reads, so
    a client trickling it held the thread for good. A body that is all there already (a
    refused request's, the common case, a modest 413's too) is read at once, and the
    connection kept: the server then serves a next request already sent on it."""
    if environ.get(BODY_READ_KEY) is True:
        return False
    stream = environ.get("wsgi.input")
    length = _declared_length(environ, limit)
    chunked = "chunked" in str(environ.get("HTTP_TRANSFER_ENCODING") or "").lower()
    if stream is None or (length is None and not chunked) or length == 0:
        return False  # no body
    cap = limit + DRAIN_OVER
    if length == _INVALID or (length is not None and length > cap):
        return True
    body, how = _read(environ, stream, cap + 1 if length is None else length, DRAIN_WITHIN)
    if how != "ok" or len(body) > cap or (length is not None and len(body) < length):
        return True
    environ[BODY_READ_KEY] = True
    return False


class _Deadline:
    """One armed body read: its socket, until :meth:`_BodyDeadlines.disarm`; ``fired`` once the
    watchdog shut its read side."""

    __slots__ = ("fired", "sock")

    def __init__(self, sock: Any) -> None:
        self.sock: Any = sock
        self.fired = False


class _BodyDeadlines:
    """A process's watchdog over body reads: a read still going at its deadline has its socket's
    read side shut (``shutdown(SHUT_RD)``), which ends a ``recv`` blocked on it at once.

    One daemon thread per process, started on the first :meth:`arm` (so never in a gunicorn
    master, which reads no body) and again in a fork child. Deadlines come from one constant
    ``body_timeout`` per server, so a new one is rarely earlier than the thread's next wake
    (``_wake_at``) and arming is a heap push under a lock, no wake-up; a disarmed entry leaves
    the heap at its deadline, or at once when the heap holds many of them (its size stays within
    twice the reads in progress, plus a constant)."""

    def __init__(self) -> None:
        self._pid = -1
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, _Deadline]] = []
        self._seq = itertools.count()
        self._live = 0
        self._wake_at = math.inf  # when the thread wakes next (monotonic), under _cond

    def arm(self, sock: Any, deadline: float) -> _Deadline | None:
        if not isinstance(sock, socket.socket):
            return None
        d = _Deadline(sock)
        if self._pid != procinfo.pid():
            with _START_LOCK:  # the first reads of a gthread worker may come together
                if self._pid != procinfo.pid():
                    try:
                        self._start()
                    except RuntimeError:  # no thread to be had: the per-recv timeout only
                        log.warning("cannot start the body deadline thread", exc_info=True)
                        return None
        with self._cond:
            heapq.heappush(self._heap, (deadline, next(self._seq), d))
            self._live += 1
            if deadline < self._wake_at:
                self._wake_at = deadline
                self._cond.notify()
        return d

    def disarm(self, d: _Deadline) -> None:
        with self._cond:  # after this, the watchdog never touches d.sock
            if d.sock is None:
                return
            d.sock = None
            self._live -= 1
            heap = self._heap
            if len(heap) > 2 * self._live + 64:
                self._heap = [e for e in heap if e[2].sock is not None]
                heapq.heapify(self._heap)

    def _start(self) -> None:
        self._cond = threading.Condition()  # a fork child's: the parent's may have been held
        self._heap = []
        self._live = 0
        self._wake_at = math.inf
        threading.Thread(target=self._run, name="shmcancel-body-deadline", daemon=True).start()
        self._pid = procinfo.pid()  # last: a read seeing it finds the new heap and its thread

    def _run(self) -> None:
        cond = self._cond
        busy = False
        while True:
            with cond:
                if cond is not self._cond:
                    return  # replaced (a fork child started its own)
                heap = self._heap
                now = time.monotonic()
                had = len(heap)
                while heap and (heap[0][2].sock is None or heap[0][0] <= now):
                    d = heapq.heappop(heap)[2]
                    if d.sock is not None:
                        d.fired = True
                        with contextlib.suppress(OSError):
                            d.sock.shutdown(socket.SHUT_RD)
                if heap:
                    self._wake_at = heap[0][0]
                    cond.wait(min(self._wake_at - now, threading.TIMEOUT_MAX))  # past: Overflow
                # An empty heap in a busy process: wait a while before the next arm must wake
                # the thread, or every request of a worker serving one at a time would (a
                # thread wake-up and a GIL handoff each). Idle twice over: wait for an arm.
                elif had or busy:
                    busy = bool(had)
                    self._wake_at = now + _BUSY_WAIT
                    cond.wait(_BUSY_WAIT)
                else:
                    self._wake_at = math.inf
                    cond.wait()


_START_LOCK = threading.Lock()
_BODY_DEADLINES = _BodyDeadlines()


def _after_fork_in_child() -> None:
    # A thread of the parent may have held the start lock at the fork: the child has no such
    # thread to release it (the disconnect watcher's state lock is replaced the same way).
    # Its pid is the parent's: a descendant given that pid back would take it for its own.
    global _START_LOCK
    _START_LOCK = threading.Lock()
    _BODY_DEADLINES._pid = -1


os.register_at_fork(after_in_child=_after_fork_in_child)


def _body_timed_out(seconds: float | None) -> _Reply:
    return _unread(_error_reply(408, None, codes.INVALID_REQUEST,
                                f"Request Timeout: the body did not arrive within {seconds:g} s"))


def _unread(reply: _Reply) -> _Reply:
    """``reply``, ending its connection: the body was cut off where the server cannot tell its
    end (a read side shut at the deadline, a read that failed), so what follows is no request."""
    reply.ends_connection = True
    return reply


class EndingConnection:
    """A reply's body (a WSGI iterable) whose ``close()``, which the server calls once the reply
    is written, ends the client connection (:func:`end_connection`) and drops what the server
    read ahead on it (:func:`_drop_read_ahead`)."""

    def __init__(self, body: bytes, sock: Any, stream: Any = None) -> None:
        self._body = body
        self._sock = sock
        self._stream = stream

    def __iter__(self) -> Iterator[bytes]:
        if self._body:
            yield self._body

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None and end_connection(sock):
            _drop_read_ahead(self._stream)


def _drop_read_ahead(stream: Any) -> None:
    """Keep gunicorn from serving a next request on a connection :func:`end_connection` took
    away, where its reply would be lost though it ran (a client pipelining a request after a
    refused body would retry it, running it twice): empty the buffer of bytes it read past the
    request (its ``wsgi.input``'s reader's unreader, a ``BytesIO``: a ``gthread`` worker runs a
    next request found there at once), and mark a chunked body's request ``must_close`` (its
    chunk parser holds bytes read ahead of its own, which it would hand back once the body
    ended: the connection is closed after the reply instead). Nothing for another server, or
    a gunicorn laid out otherwise."""
    reader = getattr(stream, "reader", None)
    req = getattr(reader, "req", None)  # a chunked body's reader keeps its request
    if req is not None and hasattr(req, "must_close"):
        req.must_close = True
    unreader = getattr(reader, "unreader", None) or getattr(req, "unreader", None)
    if unreader is not None and isinstance(getattr(unreader, "buf", None), io.BytesIO):
        unreader.buf = io.BytesIO()


def end_connection(sock: Any) -> bool:
    """End the connection of ``sock`` (gunicorn's, whose reply is written), taken away from the
    server: a refused body was cut off where the server cannot tell its end, and it would read
    a next request where the body stopped (keep-alive: a 408's socket read side was shut, and
    gunicorn takes the early end of stream for the body's end), running the body's rest as a
    request.

    The server's descriptor is pointed at a fresh unconnected socket: its next read fails
    (``ENOTCONN``, which gunicorn ignores, closing the connection) and its close closes that
    socket. The connection itself, kept on a descriptor of ours, gets an end of stream after
    the reply, then is read and discarded until the client closes it, for at most
    :data:`_LINGER` seconds and :data:`_LINGER_BYTES` bytes (closing a socket with unread bytes
    sends a reset, which can destroy the reply before the client reads it); a read side shut
    at the deadline reads as ended at once, and bytes that come after the close are reset.
    Plain sockets only (a TLS layer cannot be taken over): others are left as they are.
    Whether the connection was taken away (``False``: the server goes on with it)."""
    if type(sock) is not socket.socket:
        return False
    try:
        fd = sock.fileno()
        if fd < 0:
            return False
        own = socket.socket(fileno=os.dup(fd))
    except OSError:
        return False
    taken = False
    try:
        with socket.socket(own.family, own.type) as dead:
            os.dup2(dead.fileno(), fd)  # atomic: the number never names another file
        taken = True
        own.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + _LINGER
        drained = 0
        while drained < _LINGER_BYTES:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            own.settimeout(left)
            data = own.recv(4096)
            if not data:
                break
            drained += len(data)
    except OSError:  # the client reset it, or the linger timed out
        pass
    finally:
        own.close()
    return taken


_LINGER = 1.0
_LINGER_BYTES = 65536
