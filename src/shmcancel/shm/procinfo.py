"""Process identity: a pid plus its start time, so a reused pid never passes for the original.

The start time is field 22 of ``/proc/<pid>/stat`` (``starttime``, clock ticks since boot). It is
fixed for the life of a process, and a new process that later gets the same pid has a later one.

An owner (pid, start) packs into one u64 so shared memory can hold it in a single aligned store
that no reader sees torn: pid in the low 22 bits (Linux caps ``pid_max`` at 2**22), start time in
the high 42 bits (2**42 ticks at 100 Hz is over a thousand years of uptime). 0 means "no owner";
a packed owner is never 0 because a pid is never 0.

``mappers`` and ``settled`` serve the lock's one judgement without an owner record: which other
processes have a semaphore open (``sem_open`` maps its file, so it shows in ``/proc/<pid>/maps``),
and whether any thread of theirs could be running (state R), in the kernel (D) or stopped (T).
A process whose maps are unreadable (not dumpable) counts as mapping when it could: see
``mappers``.
"""

from __future__ import annotations

import errno
import os

__all__ = ["PID_BITS", "START_BITS", "alive", "mappers", "me", "pack_owner", "pid", "settled",
           "start_time", "thread_states", "unpack_owner"]

PID_BITS = 22
START_BITS = 42
_PID_MASK = (1 << PID_BITS) - 1
_START_MASK = (1 << START_BITS) - 1
_GONE = (errno.ENOENT, errno.ESRCH)  # a /proc entry missing: the process (or thread) is gone


def _stat(pid: int, task: str = "") -> tuple[str, int] | None:
    """(state, starttime) of ``pid`` (or of its thread ``task/<tid>``), or None when it has no
    /proc entry (or an unparsable one). Raises ``OSError`` when the entry could not be read for
    another reason (this process out of descriptors or memory: EMFILE, ENFILE, ENOMEM; no
    permission): that says nothing of the process."""
    try:
        with open(f"/proc/{pid}/{task}stat", "rb") as f:
            data = f.read()
    except OSError as e:
        if e.errno in _GONE:
            return None
        raise
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
    """Start time of ``pid`` in clock ticks since boot, or None if there is no such process.
    Raises ``OSError`` when that cannot be told (see :func:`_stat`)."""
    st = _stat(pid)
    return None if st is None else st[1]


def alive(pid: int, start: int) -> bool:
    """True while the process ``pid`` that started at ``start`` is still running.

    False when the pid is gone, is a zombie or dead task (state Z or X: ``kill(pid, 0)`` still
    succeeds on an unreaped zombie, but it will never release anything), or now belongs to a
    different process (its start time differs). True when that cannot be told (its /proc entry
    unreadable for a reason that is not its absence: this process out of descriptors, say): a
    process is judged dead only on evidence, or a live lock holder would be robbed and live
    lanes reaped.
    """
    if pid <= 0:
        return False
    try:
        st = _stat(pid)
    except OSError:
        return True
    if st is None:
        return False
    state, started = st
    return state not in ("Z", "X", "x") and (started & _START_MASK) == (start & _START_MASK)


def thread_states(pid: int) -> list[str] | None:
    """The state letter of every thread of ``pid`` (``R``, ``S``, ``D``, ``T``, ...), or None
    when the process is gone. A thread that exits during the scan is left out. Raises
    ``OSError`` when that cannot be told (see :func:`_stat`)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError as e:
        if e.errno in _GONE:
            return None
        raise
    out = []
    for tid in tids:
        st = _stat(pid, f"task/{tid}/")
        if st is not None:
            out.append(st[0])
    return out


_SETTLED = frozenset("SIZXx")  # asleep, idle kernel thread, or dead: not between two bytecodes


def settled(pid: int) -> bool:
    """True when no thread of ``pid`` is running, runnable, in uninterruptible sleep or stopped
    (or the process is gone). A Python thread waiting for the GIL sleeps (S), but then the
    thread holding the GIL is running or runnable: a process that is anywhere inside a critical
    section is never settled, except for an instant."""
    try:
        states = thread_states(pid)
    except OSError:  # cannot tell: not settled (the caller waits on)
        return False
    return states is None or all(s in _SETTLED for s in states)


def stopped(pid: int) -> bool:
    """True when a thread of ``pid`` is stopped (``T``: SIGSTOP, ``t``: a debugger); False
    when none is, the process is gone, or that cannot be told."""
    try:
        states = thread_states(pid)
    except OSError:
        return False
    return states is not None and any(s in "Tt" for s in states)


def _euid(pid: int) -> int | None:
    """Effective uid of ``pid`` (``/proc/<pid>/status`` is readable for any process)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Uid:"):
                    return int(line.split()[2])
    except (OSError, ValueError, IndexError):
        pass
    return None


def mappers(path_prefix: str, inode: int, *, seen_only: bool = False) -> list[int]:
    """Pids, other than the caller's, that map the file ``inode`` under ``path_prefix`` (a POSIX
    semaphore: ``/dev/shm/sem.``; its creator's mapping names the temporary file glibc linked
    to the semaphore's name, `` (deleted)``, so only the inode identifies it), or may: a process
    whose maps are unreadable (made non-dumpable, e.g. by dropping privileges) counts when it
    runs as the caller's effective uid or is the caller's parent (a gunicorn master that stayed
    root), unless ``seen_only``. Another user's process cannot open an owner-only file. Scans
    ``/proc``: milliseconds, for a slow path only."""
    me_ = os.getpid()
    euid, ppid = os.geteuid(), os.getppid()
    prefix = path_prefix.encode()
    ino = str(inode).encode()
    out = []
    for ent in os.listdir("/proc"):
        if not ent.isdigit() or int(ent) == me_:
            continue
        try:
            with open(f"/proc/{ent}/maps", "rb") as f:
                data = f.read()
        except PermissionError:
            if not seen_only and (_euid(int(ent)) == euid or int(ent) == ppid):
                out.append(int(ent))
            continue
        except OSError as e:
            if not seen_only and e.errno not in _GONE:  # cannot tell (out of descriptors)
                out.append(int(ent))
            continue
        if prefix not in data:
            continue
        for line in data.splitlines():
            fields = line.split(None, 5)
            if len(fields) == 6 and fields[4] == ino and fields[5].startswith(prefix):
                out.append(int(ent))
                break
    return out


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


_pid = os.getpid()
_pid_ns: int | None = None


def pid_namespace() -> int:
    """The inode of this process's pid namespace (``/proc/self/ns/pid``), 0 when unknown. A pid
    and a start time name a process only within one pid namespace: from another (a container
    sharing ``/dev/shm`` but not the pids), every process of the first looks gone."""
    global _pid_ns
    if _pid_ns is None:
        try:
            _pid_ns = os.stat("/proc/self/ns/pid").st_ino
        except OSError:  # pragma: no cover - no /proc, or namespaces not compiled in
            _pid_ns = 0
    return _pid_ns


def foreign(pid_ns: int) -> bool:
    """Whether ``pid_ns`` (a :func:`pid_namespace`, 0: unknown) is known to be another pid
    namespace than this process's: its processes cannot be told alive or gone from here."""
    mine = pid_namespace()
    return pid_ns != 0 and mine != 0 and pid_ns != mine


def pid() -> int:
    """The calling process's pid without a system call (``os.getpid()`` is one: ~0.2 us here),
    kept by an at-fork hook."""
    return _pid


def _reset_after_fork() -> None:
    global _me, _pid, _pid_ns
    _me = None
    _pid = os.getpid()
    _pid_ns = None  # a child of a process that unshared its pids is in the new namespace


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
