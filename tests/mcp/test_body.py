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
        near = body._BODY_DEADLINES.arm(near_a, time.monotonic() + 0.2)
        assert near is not None
        near_a.settimeout(5)
        t0 = time.monotonic()
        assert near_a.recv(1) == b""  # its read side shut at its deadline
        assert time.monotonic() - t0 < 3
        assert near.fired and not far.fired
        body._BODY_DEADLINES.disarm(near)
        body._BODY_DEADLINES.disarm(far)
    finally:
        for s in (far_a, far_b, near_a, near_b):
            s.close()
