"""The body watchdog (``shmcancel.mcp.body``) across a fork."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

from helpers.procs import fork, wait_exit

from shmcancel.mcp import body


def test_a_fork_child_arms_a_body_read_while_the_parent_held_the_start_lock() -> None:
    """A process forked while one of its threads held the watchdog's start lock (the first
    body reads of a ``gthread`` worker start the thread under it) inherits that lock held,
    with no thread left to release it: the child's first body read must still arm (its own
    thread started), not wait forever."""
    a, b = socket.socketpair()
    try:
        with body._START_LOCK:
            pid = fork(lambda: _arm_and_disarm(a))
        status = wait_exit(pid, 10)
        if status is None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        assert status == 0, "the child's first body read hung on the inherited start lock"
    finally:
        a.close()
        b.close()


def _arm_and_disarm(sock: socket.socket) -> None:
    d = body._BODY_DEADLINES.arm(sock, time.monotonic() + 10)
    assert d is not None
    body._BODY_DEADLINES.disarm(d)


def _a_near_deadline_fires(sock: socket.socket) -> None:
    """A read of ``sock`` armed 0.2 s from now has its read side shut at that deadline."""
    near = body._BODY_DEADLINES.arm(sock, time.monotonic() + 0.2)
    assert near is not None
    sock.settimeout(5)
    t0 = time.monotonic()
    assert sock.recv(1) == b""  # its read side shut at its deadline
    assert time.monotonic() - t0 < 3
    assert near.fired
    body._BODY_DEADLINES.disarm(near)


def test_a_deadline_past_the_longest_wait_does_not_end_the_watchdog() -> None:
    """A ``body_timeout`` longer than ``threading.TIMEOUT_MAX`` (finite, so accepted) made the
    watchdog's wait raise ``OverflowError``, ending its thread: every later read of the
    process, with any server's deadline, had no bound at all (its per-recv timeout is not set
    while the watchdog is armed)."""
    far_a, far_b = socket.socketpair()
    near_a, near_b = socket.socketpair()
    try:
        far = body._BODY_DEADLINES.arm(far_a, time.monotonic() + 1e12)
        assert far is not None
        # the watchdog takes up the far deadline: waits on it again, or (the bug) dies of it
        cond = body._BODY_DEADLINES._cond
        watchdog = [t for t in threading.enumerate() if t.name == "shmcancel-body-deadline"]
        deadline = time.monotonic() + 5
        while not cond._waiters and any(t.is_alive() for t in watchdog):  # type: ignore[attr-defined]
            assert time.monotonic() < deadline
            time.sleep(0.001)
        _a_near_deadline_fires(near_a)
        assert not far.fired
        body._BODY_DEADLINES.disarm(far)
    finally:
        for s in (far_a, far_b, near_a, near_b):
            s.close()


def _watchdog_waiters(timeout: float = 5) -> list[object]:
    """The watchdog's waiter on its condition once it waits again (its thread is running)."""
    cond = body._BODY_DEADLINES._cond
    deadline = time.monotonic() + timeout
    while not cond._waiters:  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, "the body watchdog does not wait"
        time.sleep(0.001)
    return list(cond._waiters)  # type: ignore[attr-defined]


def test_reads_one_after_another_do_not_wake_the_watchdog() -> None:
    """A worker serving one request at a time arms and disarms a body read per request. The
    watchdog dropped the disarmed entry as soon as it ran, so every next arm found the heap
    empty and woke it: a thread wake-up and a GIL handoff per request (in a burst of
    cancellations, a sixth of what shmcancel added to gunicorn's own CPU). A read whose deadline
    is not earlier than the watchdog's next wake must not wake it."""
    a, b = socket.socketpair()
    try:
        first = body._BODY_DEADLINES.arm(a, time.monotonic() + 30)
        assert first is not None
        body._BODY_DEADLINES.disarm(first)
        waiting = _watchdog_waiters()
        for _ in range(50):
            d = body._BODY_DEADLINES.arm(a, time.monotonic() + 30)
            assert d is not None
            # a notify takes the watchdog's waiter off the condition
            assert list(body._BODY_DEADLINES._cond._waiters) == waiting  # type: ignore[attr-defined]
            body._BODY_DEADLINES.disarm(d)
        _a_near_deadline_fires(a)  # an earlier deadline still wakes it, and is kept
    finally:
        a.close()
        b.close()


class _Req:
    must_close = False

    def __init__(self, unreader: object) -> None:
        self.unreader = unreader


def _gunicorn_like_input(chunked: bool) -> tuple[object, object, object]:
    """A ``wsgi.input`` laid out as gunicorn's (``Body.reader``: a length reader's
    ``.unreader``, a chunked reader's ``.req.unreader``), its unreader (bytes read ahead in
    ``.buf``) and its request."""
    import io
    import types

    unreader = types.SimpleNamespace(buf=io.BytesIO(b"POST /mcp HTTP/1.1\r\n..."))
    req = _Req(unreader)
    reader = types.SimpleNamespace(req=req) if chunked else types.SimpleNamespace(
        unreader=unreader)
    return types.SimpleNamespace(reader=reader), unreader, req


def test_an_ended_connection_drops_what_gunicorn_read_ahead_and_closes() -> None:
    """A reply that takes its connection away leaves gunicorn nothing to run on it: the bytes
    it read past the request are dropped, and a chunked body's request is marked to close
    (its chunk parser holds read-ahead bytes of its own)."""
    for chunked in (False, True):
        stream, unreader, req = _gunicorn_like_input(chunked)
        a, b = socket.socketpair()
        try:
            ending = body.EndingConnection(b"reply", a, stream)
            assert list(ending) == [b"reply"]
            b.close()  # the client leaves: the linger ends at once
            ending.close()
        finally:
            a.close()
        assert unreader.buf.getvalue() == b""
        assert req.must_close is chunked


def test_a_connection_that_cannot_be_taken_away_keeps_its_read_ahead() -> None:
    """A TLS socket (anything not a plain socket) is not taken over: gunicorn goes on with the
    connection, so what it read ahead is its next request's and must stay (a reviewer's TLS
    client lost its pipelined request when it was dropped)."""
    for chunked in (False, True):
        stream, unreader, req = _gunicorn_like_input(chunked)
        body.EndingConnection(b"reply", object(), stream).close()
        assert unreader.buf.getvalue().startswith(b"POST /mcp")
        assert req.must_close is False
