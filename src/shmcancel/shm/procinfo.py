"""Process identity: a pid plus its start time, so a reused pid never passes for the original.

The start time is field 22 of ``/proc/<pid>/stat`` (``starttime``, clock ticks since boot). It is
fixed for the life of a process, and a new process that later gets the same pid has a later one.

An owner (pid, start) packs into one u64 so shared memory can hold it in a single aligned store
that no reader sees torn: pid in the low 22 bits (Linux caps ``pid_max`` at 2**22), start time in
the high 42 bits (2**42 ticks at 100 Hz is over a thousand years of uptime). 0 means "no owner";
a packed owner is never 0 because a pid is never 0.
"""

from __future__ import annotations

import os

__all__ = ["PID_BITS", "START_BITS", "alive", "me", "pack_owner", "start_time", "unpack_owner"]

PID_BITS = 22
START_BITS = 42
_PID_MASK = (1 << PID_BITS) - 1
_START_MASK = (1 << START_BITS) - 1


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, starttime) of ``pid``, or None when it has no /proc entry (or it is unreadable)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:  # FileNotFoundError, ProcessLookupError (ESRCH on a vanishing task), ...
        return None
    # comm (field 2) is in parentheses and may itself contain spaces and ')': split after the
    # LAST ')'. What follows starts at field 3 (state); starttime is field 22, i.e. index 19.
    _, sep, rest = data.rpartition(b")")
    fields = rest.split()
    if not sep or len(fields) < 20:
        return None
    try:
        return fields[0].decode("ascii", "replace"), int(fields[19])
    except ValueError:
        return None


def start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot, or None if there is no such process."""
    st = _stat(pid)
    return None if st is None else st[1]


def alive(pid: int, start: int) -> bool:
    """True while the process ``pid`` that started at ``start`` is still running.

    False when the pid is gone, is a zombie or dead task (state Z or X: ``kill(pid, 0)`` still
    succeeds on an unreaped zombie, but it will never release anything), or now belongs to a
    different process (its start time differs).
    """
    if pid <= 0:
        return False
    st = _stat(pid)
    if st is None:
        return False
    state, started = st
    return state not in ("Z", "X", "x") and (started & _START_MASK) == (start & _START_MASK)


_me: tuple[int, int] | None = None


def me() -> tuple[int, int]:
    """(pid, start time) of the calling process; read once per process (reset in a fork child)."""
    global _me
    if _me is None:
        pid = os.getpid()
        start = start_time(pid)
        if start is None:  # pragma: no cover - /proc not mounted
            raise RuntimeError("shmcancel needs /proc/<pid>/stat to identify processes")
        _me = (pid, start)
    return _me


def _reset_after_fork() -> None:
    global _me
    _me = None


os.register_at_fork(after_in_child=_reset_after_fork)


def pack_owner(pid: int, start: int) -> int:
    """One nonzero u64 naming (pid, start): pid in the low 22 bits, start in the high 42."""
    if not 0 < pid <= _PID_MASK:
        raise ValueError(f"pid {pid} does not fit {PID_BITS} bits")
    if not 0 <= start <= _START_MASK:
        raise ValueError(f"start time {start} does not fit {START_BITS} bits")
    return (start << PID_BITS) | pid


def unpack_owner(word: int) -> tuple[int, int] | None:
    """Inverse of :func:`pack_owner`; None for 0 (no owner)."""
    if word == 0:
        return None
    return word & _PID_MASK, word >> PID_BITS
