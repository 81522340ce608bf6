"""The registry lock: one POSIX semaphore per registry, an owner record, dead-owner recovery.

Header words (see segment.py): ``owner`` = ``procinfo.pack_owner(pid, start)`` of the holder or 0,
``generation`` = +1 on every acquire and every recovery. Protocol:

- acquire: take the semaphore, then ``generation += 1``, then ``owner = me`` (one aligned u64
  store each). Release: ``owner = 0``, then ``sem.release()``.
- a waiter whose bounded wait (``step``) times out looks at the owner. It takes over the held unit
  when the owner is dead (gone, zombie, or its pid reused), or when the owner is 0 while the
  semaphore stays taken, the generation has not moved for two whole steps and, at each of the
  last two timeouts, every other process that has the semaphore open was seen asleep within
  ``_SETTLE_WINDOW`` (a holder that died between acquiring and recording itself; a live one
  starved of CPU there is runnable, or its GIL holder is). Taking over is NOT
  release-then-acquire (that could let two processes in): under an ``flock`` on the segment's own
  file (each process's description of its own; the kernel drops it when its holder dies; not
  the lock file, which a name lookup finds and an operator can remove or replace under live
  processes, leaving two sets of recoverers each under a flock of its own), the waiter re-checks
  owner, generation,
  ``sem.value == 0`` and the other processes, then writes ``generation += 1``, ``owner = me``,
  ``recoveries += 1`` and carries on as the holder, after running ``repair()`` (the registry's
  fsck). The ``("shmcancel", "lock", "recovered")`` telemetry event comes once that hold is
  released (``__exit__``): a handler never runs under the lock, and what it lets out (a
  signal's SystemExit) finds the holder's writes complete.
- a live owner is never robbed: a stopped holder makes waiters wait, then raise ``LockTimeout``.

Within a process a ``threading.Lock`` serialises threads before the semaphore (a waiter yields
the GIL a few times before it blocks on it: see ``_wait_local``), and the lock is
reentrant per thread. All per-process state is rebuilt in a fork child.

Signals: posix_ipc runs a pending Python signal handler when a wait is interrupted and then
replaces whatever it raised (gunicorn's SystemExit) with ``SignalError``. So the blocking waits run
with the process's Python-handled signals blocked, a step at a time; between steps the handlers run
normally and what they raise propagates, with nothing taken. Residual windows of a bytecode or two
(a handler raising just after the non-blocking fast-path acquire, or inside the release sequence)
can strand the unit; the dead-owner and stable-generation rules recover it, and a unit stranded by
this very process (owner == me while no thread of it holds the lock) is taken back at once.
Why this recovers exactly once: docs/design.md, "The lock and its recovery".
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable
from threading import get_ident as _get_ident
from typing import TYPE_CHECKING, Any

import posix_ipc

try:  # the stdlib's semaphore type: its non-blocking acquire keeps the GIL (posix_ipc's drops it)
    from _multiprocessing import SemLock as _SemLock
except ImportError:  # pragma: no cover - CPython on Linux always has it
    _SemLock = None

from .. import telemetry
from ..exceptions import LockTimeout, RegistryClosed, ShmCancelError
from . import procinfo
from .layout import _M64
from .names import SHM_DIR, close_with, kept_by, segment_path, sem_path
from .segment import OFF_LOCK_GENERATION, OFF_LOCK_OWNER, OFF_RECOVERIES

if TYPE_CHECKING:
    from .segment import Segment

__all__ = ["RegistryLock"]

log = logging.getLogger("shmcancel.lock")

_OWNER = OFF_LOCK_OWNER >> 3
_GEN = OFF_LOCK_GENERATION >> 3
_RECOVERIES = OFF_RECOVERIES >> 3
DEFAULT_TIMEOUT = 10.0  # seconds, when no timeout is given (the Registry gives its Config's)
_BUSY_SPIN = 100e-6  # seconds of non-yielding sem_trywait polling before the yields
_SPIN = 200e-6  # seconds of sched_yield polling before blocking waits
_SETTLE_WINDOW = 0.02  # seconds to see each other process on the semaphore asleep once
_SETTLE_POLL = 0.002  # seconds between those looks
_LOCAL_YIELDS = 16  # yields before a thread blocks on another thread's hold (_wait_local)
_FAULTS = {signal.SIGKILL, signal.SIGSTOP, signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE,
           signal.SIGILL}
_CATCHABLE = frozenset(signal.valid_signals()) - _FAULTS

_locks: weakref.WeakSet[RegistryLock] = weakref.WeakSet()


def _handled_signals() -> set[int]:
    """Signals that currently have a Python handler (the ones posix_ipc could swallow)."""
    out: set[int] = set()
    for s in _CATCHABLE:
        try:
            h = signal.getsignal(s)
        except (ValueError, OSError):  # pragma: no cover
            continue
        if callable(h):
            out.add(s)
    return out


class _SignalsBlocked:
    """Block catchable signals in this thread; pending ones are delivered on exit (and a
    handler's exception then propagates from the ``with`` statement)."""

    __slots__ = ("_old", "_sigs")

    def __init__(self, sigs: set[int] | frozenset[int] = _CATCHABLE) -> None:
        self._sigs = sigs
        self._old: set[int] | None = None

    def __enter__(self) -> None:
        self._old = signal.pthread_sigmask(signal.SIG_BLOCK, self._sigs) if self._sigs else None

    def __exit__(self, *exc: object) -> None:
        if self._old is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, self._old)


class _ProcState:
    """Per-process, per-registry lock state (rebuilt in a fork child)."""

    __slots__ = ("__weakref__", "depth", "dirty", "holder", "me", "recovered", "stalled_until",
                 "tlock")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        # serialises this process's threads before the semaphore; an RLock for _is_owned()
        # (an exception right after its acquire), taken twice only under exclusive() (a close
        # releasing its lane takes the registry lock once more)
        self.tlock: Any = threading.RLock()
        self.holder: int | None = None  # thread ident of the holding thread
        self.depth = 0
        self.dirty = False
        self.stalled_until = 0.0  # monotonic: a wait of this process timed out until then
        # (thread, dead pid or 0, seconds waited) of recoveries whose event is due once that
        # thread's hold that recovered is released (see RegistryLock._emit_recovered)
        self.recovered: list[tuple[int, int, float]] = []
        # In a fork child procinfo's own after-fork reset has run already: it registered first
        # (after_in_child hooks run in registration order), so me() is the child's.
        self.me = procinfo.pack_owner(*procinfo.me())


_states: weakref.WeakValueDictionary[tuple[str, int], _ProcState] = (
    weakref.WeakValueDictionary())


def _stopped_advice(pid: int) -> str:
    """What to do about a holder found stopped (SIGSTOP, a debugger), else ""."""
    if not procinfo.stopped(pid):
        return ""
    return (f"; pid {pid} is stopped (SIGSTOP or a debugger): `kill -CONT {pid}` resumes it; "
            "if it is killed instead, the lock is recovered")


class RegistryLock:
    """``with lock:`` holds the registry (every table of it). Reentrant per thread.

    ``dirty``: a writer sets it True right before its first store into shared memory and False
    after its last; leaving the outermost ``with`` (or any ``with`` by an exception) while it is
    True runs ``repair()`` with signals blocked before the lock is released.
    """

    def __init__(self, segment: Segment, *, repair: Callable[[], Any] | None = None,
                 timeout: float | None = None, step: float = 0.1) -> None:
        if segment.readonly or segment.sem is None:
            raise ShmCancelError(f"registry {segment.name} is attached read-only: no lock")
        self.name = segment.name
        self._seg = segment
        self._sem = segment.sem
        self._w = segment.words
        self._timeout = DEFAULT_TIMEOUT if timeout is None else float(timeout)
        self._step = float(step)
        self._repair = repair
        self._fd: int | None = None
        self._fd_closer: Any = None  # closes _fd should the lock be collected unclosed
        self._set_fd(segment.reopen())
        self._fast: Any = None  # see _trywait
        self._trywait = self._trywait_posix
        self._open_fast(segment)
        # Every lock object of this process on the same semaphore shares one state (two
        # attachments of one registry in one process must not take each other for strangers).
        key = (segment.name, segment.sem_ino)
        st = _states.get(key)
        if st is None:
            st = _states[key] = _ProcState()
        self._st = st
        _locks.add(self)

    @property
    def flags(self) -> _ProcState:
        """The object holding this process's ``dirty`` (the same object for the lock's life,
        a fork child's included: it is reset in place), for writers that set it directly."""
        return self._st

    @property
    def dirty(self) -> bool:
        return self._st.dirty

    @dirty.setter
    def dirty(self, value: bool) -> None:
        self._st.dirty = value

    def _open_fast(self, segment: Segment) -> None:
        """Open the registry's semaphore a second time, as the stdlib's ``SemLock``, for
        :meth:`_trywait`: its non-blocking acquire keeps the GIL, while posix_ipc's releases it,
        which lets another thread of this process run (and queue behind the thread lock) in
        the middle of every write. Kept only if the entry opened is the segment's semaphore
        (same inode as recorded at attach, checked after opening); else posix_ipc serves."""
        if _SemLock is None:  # pragma: no cover
            return
        try:
            fast = _SemLock._rebuild(0, 1, 1, self._sem.name)  # handle, kind=SEMAPHORE, max, name
        except (OSError, TypeError, ValueError, AttributeError):  # pragma: no cover
            return
        try:
            same = os.lstat(sem_path(self.name)).st_ino == segment.sem_ino
        except OSError:
            same = False
        if same:
            self._fast = fast
            self._trywait = fast.acquire

    def _trywait_posix(self, block: bool = False) -> bool:
        """A non-blocking ``sem_trywait`` through posix_ipc (when ``SemLock`` is unavailable)."""
        try:
            self._sem.acquire(0)
        except posix_ipc.BusyError:
            return False
        return True

    def _after_fork_child(self) -> None:
        # The inherited fd shares its open file description (and any flock) with the parent:
        # take a fresh one on the same inode, even if the path was unlinked meanwhile. Only if
        # it is still the segment's file: a number the parent closed (closerange) may be
        # another file's by now, the child's too, never reopened nor closed here.
        old = self._kept_fd()
        self._set_fd(None)
        if old is not None:
            with contextlib.suppress(OSError):
                self._set_fd(self._seg.reopen())
            os.close(old)

    def _kept_fd(self) -> int | None:
        """The recovery flock's fd if it is still open on the segment's file (and is not the
        segment's own kept fd, nor any other object's of this process: ``names.kept_by``);
        else None, and the number is let go of without being closed: a process that closed
        every fd (``closerange`` in a daemonising child) may have that number on another file,
        or on the segment's file reopened by the segment itself or by another attachment."""
        fd = self._fd
        if fd is None:
            return None
        with contextlib.suppress(OSError):
            # kept_by: not taken since by another object of this process (this segment's
            # reopen, another attachment's segment or lock), open on the same file maybe
            if kept_by(fd, self._fd_closer) and self._seg._ours(fd):
                return fd
        self._set_fd(None)
        return None

    def _set_fd(self, fd: int | None) -> None:
        """Keep ``fd`` as the recovery flock's (None: none), letting go of the one kept before
        without closing it (the caller does, or it is not ours any more)."""
        if self._fd_closer is not None:
            self._fd_closer.detach()
        self._fd, self._fd_closer = fd, None if fd is None else close_with(self, fd)

    def _if_closed(self) -> None:
        """In an ``except`` clause: raise :class:`~shmcancel.RegistryClosed` in place of the
        error being handled (posix_ipc's on the closed semaphore, ValueError from the released
        header view) when the registry's segment is closed; else return (the caller
        re-raises). Nothing is tested before: an open lock pays nothing for it."""
        if self._seg.closed:
            raise RegistryClosed.of(self.name) from None

    # --- introspection ---
    def _word(self, i: int) -> int:
        """Header word ``i`` (``RegistryClosed`` once the registry is closed)."""
        try:
            return self._w[i]
        except Exception:
            self._if_closed()
            raise

    @property
    def generation(self) -> int:
        return self._word(_GEN)

    @property
    def recoveries(self) -> int:
        return self._word(_RECOVERIES)

    def owner(self) -> tuple[int, int] | None:
        """(pid, start) recorded as holder, or None."""
        return procinfo.unpack_owner(self._word(_OWNER))

    def idle_generation(self) -> int | None:
        """The generation while nobody holds the lock, else None. Read before and after a
        lock-free read of several tables: the same value twice (and ``generation`` one above
        it once this thread holds the lock) means no writer ran in between, because every
        holder bumps the generation after taking the semaphore and before its first store."""
        try:
            gen = self._w[_GEN]
            return gen if self._sem.value > 0 else None
        except Exception:
            self._if_closed()
            raise

    def held_by_me(self) -> bool:
        """True when the calling thread holds the lock."""
        return self._st.holder == threading.get_ident() and self._st.depth > 0

    @property
    def timeout(self) -> float:
        """Seconds a waiter waits for a live holder before ``LockTimeout`` (this process's lock
        object only; the registry's ``Config.lock_timeout`` by default)."""
        return self._timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) \
                or not 0 < seconds < 1e9:
            raise ValueError(f"lock timeout must be a positive number of seconds, got {seconds!r}")
        self._timeout = float(seconds)

    # --- with ---
    def __enter__(self) -> RegistryLock:
        # The uncontended path is the cost of every write: no clock read, no timed waits.
        st = self._st
        tid = _get_ident()
        if st.holder == tid:
            st.depth += 1
            return self
        tlock = st.tlock
        fast = self._fast
        t0 = None
        # SemLock's count of its own acquires before this one's (None: not read yet). Any int:
        # the count only grows (units go back through posix_ipc), so past 2**31 acquires in
        # one process it reads negative; only a change of it says a unit was taken.
        taken: int | None = None
        # Everything from the thread lock's acquire on is inside the try: a signal handler's
        # exception (raised as a call returns) must not strand the thread lock, nor a unit
        # taken but not recorded yet (SemLock counts its acquires: that tells), nor a repair
        # owed by a recovery (``dirty``, set with the takeover).
        try:
            if not tlock.acquire(False):
                t0 = time.monotonic()
                self._wait_local(tlock, t0)
            if fast is not None:
                taken = fast._count()
            if not self._trywait(False):  # fast path: sem_trywait, never interrupted
                self._acquire_slow(tid, time.monotonic() if t0 is None else t0)
            else:
                st.holder = tid
                st.depth = 1
                w = self._w
                w[_GEN] = (w[_GEN] + 1) & _M64  # garbage there must not fail the hold
                w[_OWNER] = st.me  # ordering: see _stamp
            return self
        except BaseException as e:
            if st.holder == tid or (taken is not None and fast._count() != taken):
                st.holder = tid
                if st.dirty:
                    self._repair_again()
                self._release_unit()
            if tlock._is_owned():
                tlock.release()
            if isinstance(e, Exception):  # a signal handler's exception goes on as it is
                self._if_closed()
            raise

    def __exit__(self, et: object, ev: object, tb: object) -> None:
        st = self._st
        if st.holder != _get_ident() or st.depth == 0:
            return  # not ours (state reset by fork in a child): nothing to release
        if st.depth > 1:
            st.depth -= 1
            if et is not None and st.dirty:
                self._run_repair()  # cut short: dirty stays set for the outermost exit
            return
        # Released even when an exception (a signal handler's) cuts this short anywhere below:
        # the repair owed is completed first, the hold forgotten before the unit is posted (a
        # hold still recorded after the post would make this thread's next ``with`` a hold
        # without the semaphore, and its release a second post: two holders ever after), and
        # the thread lock released whatever the post raised.
        try:
            if st.dirty:
                self._run_repair()
        finally:
            try:
                if st.dirty:
                    self._repair_again()  # a third exception may leave it: released anyway
            finally:
                st.depth = 0
                st.holder = None
                self._w[_OWNER] = 0
                try:
                    self._sem.release()
                finally:
                    st.tlock.release()
        if st.recovered:  # a recovery's event, now that the hold's writes are complete
            self._emit_recovered()

    def depth(self) -> int:
        """How many ``with`` blocks of this lock this thread is inside (0: it holds none)."""
        st = self._st
        return st.depth if st.holder == _get_ident() else 0

    def release_leaked(self, keep: int = 0) -> bool:
        """End the holds of this thread that outlived their ``with`` blocks, down to ``keep``
        (its :meth:`depth` where those blocks began: the start of a request); True if there
        were any. A signal handler's exception (gunicorn's quit) runs as ``__exit__`` is
        entered, before any line of it: its release never began, and the unit stayed taken,
        recorded to a live process, until that process died (forever, if the exception was
        caught and the process served on). At ``keep`` 0 the lock is released; above, the
        outer hold goes on. Either way a write the leaked hold left half done is repaired
        first, as an exception leaving a nested ``with`` does (the outer hold's own writes
        would clear the mark before its release could)."""
        st = self._st
        if st.holder != _get_ident() or st.depth <= keep:
            return False
        if keep:
            st.depth = keep
            if st.dirty:
                self._run_repair()
            return True
        st.depth = 1
        self.__exit__(SystemExit, None, None)
        return True

    def _wait_local(self, tlock: Any, t0: float) -> None:
        """Take the thread lock held by another thread of this process, by ``t0 +
        lock_timeout`` or raise :class:`LockTimeout`.

        First up to ``_LOCAL_YIELDS`` GIL-releasing yields, each followed by a non-blocking try:
        the holder is usually runnable and only waiting for the GIL (it was switched out
        mid-write), so this lets it finish. Blocking on the thread lock at once would form a
        convoy: a ``threading.Lock`` release wakes a sleeping waiter, which then owns the lock
        while it waits for the GIL, so the releasing thread blocks at its next write, and so on,
        a context switch per write (4 threads ran at 0.2x one thread's throughput)."""
        for _ in range(_LOCAL_YIELDS):
            os.sched_yield()  # releases the GIL
            if tlock.acquire(False):
                return
        if not tlock.acquire(timeout=max(0.0, t0 + self._timeout - time.monotonic())):
            self._st.stalled_until = time.monotonic() + self._timeout
            raise LockTimeout(
                f"registry {self.name}: another thread of this process (pid {os.getpid()}) "
                f"held the lock for more than {self._timeout:.1f}s")

    def still_stalled(self) -> bool:
        """Whether a hold that outlasted ``lock_timeout`` goes on: a wait of this process timed
        out within the last ``lock_timeout`` seconds and another live process holds the lock
        right now. Work that can be owed instead of done now skips its own wait then; once the
        holder lets go, it waits (briefly) as ever."""
        return time.monotonic() < self._st.stalled_until and self._held_elsewhere()

    def _held_elsewhere(self) -> bool:
        """Another live process holds the lock right now (a lock-free read of the owner word);
        ``True`` on a closed registry (there is nothing to do)."""
        try:
            owner = self._w[_OWNER]
        except (ValueError, IndexError, TypeError):  # the mapping is gone: registry closed
            return True
        return owner != 0 and owner != self._st.me and not self._owner_dead(owner)

    def stalled(self) -> bool:
        """Whether work that can wait (sweeps, settling owed ends on a request's or a poll's
        way) should skip its turn: a wait of this process for the lock timed out within the
        last ``lock_timeout`` seconds, or another process holds the lock right now (a lock-free
        read of the owner word; a holder stopped mid-hold would make that work wait
        ``lock_timeout`` first, and a poll must not wait at all). A busy moment only defers the
        work to its next turn. A dead holder does not count: the work's own wait recovers the
        lock from it. On a closed registry: ``True`` (there is nothing to do)."""
        return time.monotonic() < self._st.stalled_until or self._held_elsewhere()

    def _stamp(self) -> None:
        w = self._w
        w[_GEN] = (w[_GEN] + 1) & _M64
        # Memory ordering: x86-64 (TSO) makes plain stores visible in program order and never
        # reorders loads with older loads, so a waiter that reads this owner also reads the
        # generation bumped above; each u64 store through the 'Q' memoryview is one aligned
        # 8-byte move, never seen torn. A weakly ordered CPU (ARM) would need fences here.
        w[_OWNER] = self._st.me

    def _release_unit(self) -> None:
        st = self._st
        st.depth = 0
        st.holder = None
        st.dirty = False
        self._w[_OWNER] = 0
        self._sem.release()

    def _run_repair(self, after: str = "an interrupted write") -> None:
        if self._repair is not None:
            with _SignalsBlocked():
                try:
                    self._repair()
                except Exception:
                    log.exception("registry %s: repair after %s failed", self.name, after)
        self._st.dirty = False

    def _repair_again(self) -> None:
        """The repair owed (``dirty``) after an exception cut it or its write short: run to
        completion while another exception (a later signal's) cuts it short again; the one
        already on its way goes on."""
        for _ in range(3):
            try:
                self._run_repair()
                return
            except BaseException:  # the first exception is the caller's to raise
                continue

    # --- waiting and recovery ---
    def _spin(self) -> bool:
        """Whether ``sem_trywait`` polling took the semaphore within ``_BUSY_SPIN`` then
        ``_SPIN`` seconds. First without yielding: a holder running on another CPU releases
        within microseconds, while a yield with every CPU busy hands this one's slice to
        another process (a cancel beside 4 other writers on 2 CPUs: 54 us median on yields
        alone, 9 us with this phase first)."""
        trywait = self._trywait
        end = time.monotonic() + _BUSY_SPIN
        while True:
            for _ in range(32):
                if trywait(False):
                    return True
            if time.monotonic() >= end:
                break
        end = time.monotonic() + _SPIN
        while time.monotonic() < end:
            os.sched_yield()
            if trywait(False):
                return True
        return False

    def _acquire_slow(self, tid: int, t0: float) -> None:
        sem, w = self._sem, self._w
        fast = self._fast
        taken = fast._count() if fast is not None else 0
        try:
            got = self._spin()
        except BaseException:
            # A signal handler raised right after a sem_trywait that took the unit (the eval
            # loop runs pending handlers as a call returns; in the busy spin a signal landing
            # there is common): the unit is ours though unrecorded. SemLock counts its own
            # acquires, so this is known exactly: mark it held, and __enter__ releases it.
            if fast is not None and fast._count() != taken:
                self._st.holder = tid
                self._st.depth = 1
            raise
        if got:
            self._st.holder = tid
            self._st.depth = 1
            self._stamp()
            return
        deadline = t0 + self._timeout
        sigs = _handled_signals()
        zero_gen, zero_seen = -1, 0  # owner-0 observations with an unchanged generation
        calm_seen, busy = 0, []  # ... of which with no other mapper of the semaphore busy
        while True:
            got = False
            with _SignalsBlocked(sigs):  # pending handlers run (and may raise) on unblock
                try:
                    if fast is not None:  # counted: see __enter__
                        got = fast.acquire(True, self._step)
                    else:
                        sem.acquire(self._step)
                        got = True
                except posix_ipc.BusyError:
                    pass
                except posix_ipc.SignalError:  # not ours to swallow anything: just wait again
                    pass
                if got:
                    self._st.holder = tid
                    self._st.depth = 1
                    self._stamp()
            if got:
                return
            owner, gen = w[_OWNER], w[_GEN]
            if owner == 0:
                if sem.value == 0 and gen == zero_gen:
                    zero_seen += 1
                else:
                    zero_gen, zero_seen, calm_seen = gen, (1 if sem.value == 0 else 0), 0
                if zero_seen >= 2:
                    busy = self._busy_mappers()
                    calm_seen = 0 if busy else calm_seen + 1
                # Seen at three consecutive timeouts (nobody recorded itself for two steps), and
                # every other process on the semaphore asleep at the last two of them.
                if zero_seen >= 3 and calm_seen >= 2 and self._recover(
                        owner, gen, tid, time.monotonic() - t0):
                    return
            else:
                zero_gen, zero_seen, calm_seen, busy = -1, 0, 0, []
                if self._owner_dead(owner) and self._recover(
                        owner, gen, tid, time.monotonic() - t0):
                    return
            if time.monotonic() >= deadline:
                self._st.stalled_until = time.monotonic() + self._timeout
                raise LockTimeout(self._timeout_message(owner, busy))

    def _owner_dead(self, owner: int) -> bool:
        if owner == self._st.me:
            # Our own pid: we hold the thread lock, so no thread of ours holds the unit; it was
            # stranded by an exception raised inside acquire/release in this process.
            return self._st.holder is None
        p = procinfo.unpack_owner(owner)
        return p is None or not procinfo.alive(*p)

    def _busy_mappers(self) -> list[int]:
        """Other processes with the semaphore open that were not once seen asleep within
        ``_SETTLE_WINDOW`` (see ``procinfo``). A window, not one sample: the other waiters wake
        at their own timeouts, in step with this one when they began waiting together, and are
        briefly running then; a live holder inside its window is never asleep at any instant."""
        # The creator maps it under glibc's temporary name, linked to sem_path() afterwards.
        busy = [pid for pid in procinfo.mappers(f"{SHM_DIR}/sem.", self._seg.sem_ino)
                if not procinfo.settled(pid)]
        deadline = time.monotonic() + _SETTLE_WINDOW
        while busy and time.monotonic() < deadline:
            time.sleep(_SETTLE_POLL)
            busy = [pid for pid in busy if not procinfo.settled(pid)]
        return busy

    def _timeout_message(self, owner: int, busy: list[int]) -> str:
        p = procinfo.unpack_owner(owner)
        if p is not None and not procinfo.alive(*p):  # (not _owner_dead: never our own pid)
            # its recovery needs the flock on the segment's file, held elsewhere all along
            return (f"registry {self.name}: lock held by dead pid {p[0]} for more than "
                    f"{self._timeout:.1f}s (generation {self._w[_GEN]}): its recovery is "
                    "blocked, another process holds the recovery flock on "
                    f"{segment_path(self.name)} (a recovering process stopped or stalled; "
                    "/proc/locks names it)")
        who = (f"live pid {p[0]}" if p is not None
               else "a process that has not recorded itself yet (one of the busy pids "
                    f"{sorted(busy)} that have the semaphore open)" if busy
               else "a process that has not recorded itself yet")
        return (f"registry {self.name}: lock held by {who} for more than {self._timeout:.1f}s "
                f"(generation {self._w[_GEN]}); a live holder is never robbed"
                + (_stopped_advice(p[0]) if p is not None else ""))

    def _lockfd(self) -> int:
        """The fd the recovery flock is taken on: the kept one while it is still the segment's
        file (:meth:`_kept_fd`), else a new description of the segment's file (``reopen``)."""
        fd = self._kept_fd()
        if fd is None:
            fd = self._seg.reopen()
            self._set_fd(fd)
        return fd

    def _take_over(self, owner: int, gen: int, tid: int | None = None) -> bool:
        """Under the flock: take the held unit over if nothing moved, for thread ``tid``, with
        the repair owed (``dirty``) recorded in the same stores (no call between them: a
        signal handler's exception cannot come between the owner word and the hold)."""
        if tid is None:
            tid = _get_ident()
        fd = self._lockfd()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # another process is recovering
        try:
            w = self._w
            if w[_OWNER] != owner or w[_GEN] != gen or self._sem.value != 0:
                return False
            if owner != 0 and not self._owner_dead(owner):
                return False
            if owner == 0 and self._busy_mappers():
                return False  # a live holder may be between its acquire and its record
            st = self._st
            w[_GEN] = (gen + 1) & _M64
            w[_OWNER] = st.me
            st.holder = tid
            st.depth = 1
            st.dirty = True
            w[_RECOVERIES] = (w[_RECOVERIES] + 1) & _M64
            return True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def _recover(self, owner: int, gen: int, tid: int, waited: float) -> bool:
        with _SignalsBlocked():
            if not self._take_over(owner, gen, tid):
                return False
            self._run_repair("lock recovery")
        self._recovered(owner, waited, tid)  # its event once this hold is released
        return True

    def _recovered(self, owner: int, waited: float, tid: int) -> None:
        """Log a recovery now and queue its event for the release of the hold it began (thread
        ``tid``'s)."""
        p = procinfo.unpack_owner(owner)
        dead = p[0] if p is not None else 0
        log.warning("registry %s: took over the lock from dead pid %s after %.3fs",
                    self.name, dead or "(unrecorded)", waited)
        self._st.recovered.append((tid, dead, waited))

    def _emit_recovered(self) -> None:
        """Emit the ``lock recovered`` events queued by recoveries, with no hold of this thread
        left: a telemetry handler runs outside the lock (it may take it, or be slow), and what
        it raises past ``telemetry.execute`` (a ``BaseException``: SystemExit from a signal)
        reaches the caller with the hold's writes complete and the lock released. Only this
        thread's events, each once: another thread's release (one that looks at the queue just
        after its post, while this one recovers) would emit one under the hold that recovered,
        before its writes."""
        queue = self._st.recovered
        me = _get_ident()
        while True:
            mine = next((e for e in queue if e[0] == me), None)
            if mine is None:
                return
            queue.remove(mine)  # only this thread removes its own
            _, dead, waited = mine
            telemetry.execute(("shmcancel", "lock", "recovered"), {"waited": waited},
                              {"dead_pid": dead})

    def recover_from(self, pid: int) -> bool:
        """If the lock's recorded owner is the dead process ``pid``, take it over, repair and
        release. Never blocks (for gunicorn's ``child_exit``): False when ``pid`` is not the
        dead owner or someone else is busy recovering."""
        owner, gen = self._w[_OWNER], self._w[_GEN]
        p = procinfo.unpack_owner(owner)
        if p is None or p[0] != pid or procinfo.alive(*p):
            return False
        tid = threading.get_ident()
        if self._st.holder == tid or not self._st.tlock.acquire(blocking=False):
            return False  # a thread of ours is already waiting: it will recover
        try:
            with _SignalsBlocked():
                if not self._take_over(owner, gen, tid):
                    return False
                self._run_repair("lock recovery")
                self._release_unit()
        except BaseException:
            if self._st.holder == tid:  # taken over: repaired, then given back
                if self._st.dirty:
                    self._repair_again()
                self._release_unit()
            raise
        finally:
            self._st.tlock.release()
        self._recovered(owner, 0.0, tid)
        self._emit_recovered()  # released already: emitted now
        return True

    def exclusive(self, fn: Callable[[], object]) -> None:
        """Run ``fn()`` (a close of the registry) while no thread of this process holds the lock
        or is taking or releasing it: a hold's release still stores into the header view and
        posts the semaphore, and a close releasing those under it stranded the lock for every
        process while this one lived (its pid alive: never recovered). Waits for another
        thread's hold (or wait) to end, by ``timeout`` seconds, holding this process's thread
        lock, so that no hold begins before ``fn`` returns; ``fn`` may take the lock itself
        (reentrant). Nothing of ``fn`` runs, and :class:`~shmcancel.ShmCancelError` is raised,
        when the calling thread is inside the lock itself (a ``with`` of its own, or a signal
        handler run in the middle of an acquire or release); :class:`~shmcancel.LockTimeout`
        when another thread's hold is still running after ``timeout``. The lock is shared with
        every attachment of the registry in this process: a hold through any of them counts.
        Only here, never on an acquire or release: those pay nothing for it."""
        tlock = self._st.tlock
        if tlock._is_owned():
            raise ShmCancelError(
                f"registry {self.name}: cannot be closed by a thread inside its lock (a `with "
                f"registry.lock:` of its own is still running); close it after the hold ends")
        try:
            if not tlock.acquire(timeout=self._timeout):
                holder = self._st.holder
                who = next((f"thread {t.name!r}" for t in threading.enumerate()
                            if holder is not None and t.ident == holder), "another thread")
                raise LockTimeout(
                    f"registry {self.name}: not closed: {who} of this process (pid "
                    f"{os.getpid()}) held or waited for its lock for more than "
                    f"{self._timeout:.1f}s; a running hold is never cut short (the registry "
                    f"stays open: close it again once that hold ends)")
            fn()
        finally:
            if tlock._is_owned():
                tlock.release()

    def close(self) -> None:
        """Close the recovery flock's descriptor (the segment owns the semaphore and the header).
        The caller makes sure no hold of this process is running (:meth:`exclusive`)."""
        closer, self._fd_closer, self._fd = self._fd_closer, None, None
        if closer is not None:
            closer()  # the fd, unless its number is another file's by now
        self._trywait = self._trywait_posix
        self._fast = None  # sem_close of the second opening
        _locks.discard(self)

    def __repr__(self) -> str:
        if self._seg.closed:
            return f"<RegistryLock {self.name} closed>"
        return f"<RegistryLock {self.name} owner={self.owner()} gen={self.generation}>"


def _after_fork_in_child() -> None:
    for st in list(_states.values()):
        st.reset()
    for lk in list(_locks):
        lk._after_fork_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
