"""Forked helper processes for the tests that need a second process: a child that reports over a
pipe, a bounded read of that pipe, and a reaper for ``finally``."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import time
import traceback
from collections.abc import Callable


def child(fn: Callable[[int], None]) -> tuple[int, int]:
    """Fork a child running fn(write_fd); returns (pid, read_fd). The child exits when fn
    returns (status 0) or raises (status 1)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.close(r)
            fn(w)
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    return pid, r


def recv(fd: int, timeout: float = 10) -> bytes:
    """What the child wrote to ``fd``, waiting at most ``timeout`` seconds for it."""
    ready, _, _ = select.select([fd], [], [], timeout)
    assert ready, "no message from child"
    return os.read(fd, 4096)


def reap(pid: int) -> None:
    """For ``finally``: kill ``pid`` and reap it, whatever state it is in."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


def wait_zombie(pid: int, timeout: float = 5.0) -> None:
    """Poll /proc until ``pid`` is a zombie (it exited and nobody reaped it yet)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split()[0]
        if state == b"Z":
            return
        select.select([], [], [], 0.005)
    raise AssertionError(f"pid {pid} did not become a zombie")
