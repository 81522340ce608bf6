"""Forked helper processes for the tests that need a second process: a child that reports over a
pipe, a bounded read of that pipe, a reaper for ``finally`` (``first_message`` does all three);
and ``Child``, a forked process with a message channel (``Chan``, JSON over a socketpair), which
the ``spawn`` fixture makes."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any


def fork(fn: Callable[[], object]) -> int:
    """Fork a child running ``fn()``; its pid. The child exits when fn returns (status 0) or
    raises (status 1, the traceback on stderr), never returning into the caller's code."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 1
        try:
            fn()
            code = 0
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
        finally:
            os._exit(code)
    return pid


def child(fn: Callable[[int], None]) -> tuple[int, int]:
    """Fork a child running fn(write_fd); returns (pid, read_fd)."""
    r, w = os.pipe()

    def run() -> None:
        os.close(r)
        fn(w)
    pid = fork(run)
    os.close(w)
    return pid, r


def communicate(proc: subprocess.Popen[str], timeout: float, *, grace: float = 0.0
                ) -> tuple[str, str, bool]:
    """``proc.communicate()`` within ``timeout`` seconds: ``(stdout, stderr, overran)``. Past
    the deadline the process gets SIGTERM and ``grace`` seconds to stop what it started (when
    ``grace`` > 0), then SIGKILL; what it printed until then is returned."""
    try:
        out, err = proc.communicate(timeout=timeout)
        return out or "", err or "", False
    except subprocess.TimeoutExpired:
        pass
    if grace > 0:
        proc.send_signal(signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=grace)
            return out or "", err or "", True
        except subprocess.TimeoutExpired:
            pass
    proc.kill()
    out, err = proc.communicate(timeout=30)
    return out or "", err or "", True


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


def first_message(fn: Callable[[int], None], timeout: float = 10) -> tuple[int, bytes]:
    """Fork a child running fn(write_fd), wait for its first message, then kill and reap it
    (whatever it was doing); ``(pid, message)``."""
    pid, r = child(fn)
    try:
        return pid, recv(r, timeout)
    finally:
        os.close(r)
        reap(pid)


def wait_exit(pid: int, timeout: float) -> int | None:
    """Reap the child ``pid`` once it exits by itself, polling for up to ``timeout`` seconds:
    its raw wait status, or None if it is still running then (not reaped)."""
    deadline = time.monotonic() + timeout
    while True:
        got, status = os.waitpid(pid, os.WNOHANG)
        if got:
            return status
        if time.monotonic() > deadline:
            return None
        select.select([], [], [], 0.005)


def proc_state(pid: int) -> str:
    """The state letter of ``pid`` in /proc (R, S, T, Z, ...)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rpartition(b")")[2].split()[0].decode()


def wait_zombie(pid: int, timeout: float = 5.0) -> None:
    """Poll /proc until ``pid`` is a zombie (it exited and nobody reaped it yet)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc_state(pid) == "Z":
            return
        select.select([], [], [], 0.005)
    raise AssertionError(f"pid {pid} did not become a zombie")


# ----------------------------------------------------- a forked child with a message channel
TIMEOUT = 10.0


class Chan:
    """JSON lines over one end of a socketpair."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def send(self, obj: Any) -> None:
        self.sock.sendall(json.dumps(obj).encode() + b"\n")

    def recv(self, timeout: float = TIMEOUT) -> Any:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no message from the other process")
            self.sock.settimeout(left)
            data = self.sock.recv(65536)
            if not data:
                raise EOFError("the other process closed its end")
            self.buf += data
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)


class Child:
    def __init__(self, pid: int, chan: Chan) -> None:
        self.pid = pid
        self.chan = chan
        self.status: int | None = None

    def send(self, obj: Any) -> None:
        self.chan.send(obj)

    def recv(self, timeout: float = TIMEOUT) -> Any:
        return self.chan.recv(timeout)

    def wait(self, timeout: float = TIMEOUT) -> int:
        """Reap the child (it must exit by itself); its exit code."""
        if self.status is None:
            self.status = wait_exit(self.pid, timeout)
            if self.status is None:
                raise TimeoutError(f"child {self.pid} did not exit")
        return os.waitstatus_to_exitcode(self.status)

    def kill(self) -> None:
        if self.status is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            _, self.status = os.waitpid(self.pid, 0)


def stuck_mid_write(reg: Any) -> Callable[[int], None]:
    """A :func:`child` body: takes ``reg``'s lock and leaves bucket 0 of ``cancellations`` odd
    (a write in progress), says ``b"mid"``, then waits to be SIGKILLed there."""

    def body(w: int) -> None:
        t = reg.table("cancellations")
        with reg.lock:
            reg.lock.dirty = True
            t._ver[0] += 1
            os.write(w, b"mid")
            select.select([], [], [], 60)

    return body


def shmtool_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``python -m shmcancel.shmtool ARGS`` in a fresh interpreter (this one's), its output
    captured as text; ``subprocess.TimeoutExpired`` past ``timeout`` seconds (the child killed).
    The interpreter's directory (the venv's ``shmtool``) is on its ``PATH``, as under
    ``tools/test.sh``: its advice names ``shmtool`` however pytest was started."""
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    return subprocess.run([sys.executable, "-m", "shmcancel.shmtool", *args],
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PATH": path})


_SIGQUIT_BIT = 1 << (signal.SIGQUIT - 1)


def waits_for_the_lock(pid: int) -> bool:
    """Whether process ``pid``'s main thread has SIGQUIT blocked: the registry lock's waits
    block the signals Python handles, a step at a time."""
    return pid in sigquit_blockers(pid, [pid])


def sigquit_blockers(pid: int, tids: list[int] | None = None) -> set[int]:
    """The threads of process ``pid`` (of ``tids``, else all) that have SIGQUIT blocked (see
    :func:`waits_for_the_lock`; a thread may block it for good: compare with a set taken
    before the wait)."""
    try:
        tids = tids if tids is not None else [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return set()
    out = set()
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                mask = next(int(line.split()[1], 16) for line in f
                            if line.startswith("SigBlk:"))
        except (OSError, StopIteration):
            continue
        if mask & _SIGQUIT_BIT:
            out.add(tid)
    return out
