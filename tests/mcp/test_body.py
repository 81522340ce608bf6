"""The body watchdog (``shmcancel.mcp.body``) across a fork."""

from __future__ import annotations

import os
import signal
import socket
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
