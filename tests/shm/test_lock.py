"""RegistryLock: mutual exclusion across processes and threads, reentrancy, repair of interrupted
writes, recovery of a unit held by a dead process (once), and no robbing of a live holder.

Real segment, real semaphore, real forked processes; children are stopped by pid in ``finally``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import signal
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from helpers.procs import fork, wait_exit

from shmcancel import telemetry
from shmcancel.exceptions import LockTimeout
from shmcancel.shm import procinfo
from shmcancel.shm.lock import _GEN, _OWNER, RegistryLock
from shmcancel.shm.names import lock_path, open_lockfile, segment_path
from shmcancel.shm.segment import OFF_LOCK_GENERATION, OFF_RECOVERIES, Segment

pytestmark = pytest.mark.timeout(30)

RECOVERED = ("shmcancel", "lock", "recovered")


# --- helpers ------------------------------------------------------------------------------------

class Child:
    """A forked child running ``fn(ctl)``; ``ctl`` talks to the parent over two pipes."""

    def __init__(self, fn: Callable[[Child], object]) -> None:
        up_r, up_w = os.pipe()
        down_r, down_w = os.pipe()

        def run() -> None:
            os.close(up_r)
            os.close(down_w)
            self._w, self._r = up_w, down_r
            fn(self)
        self.pid = fork(run)
        os.close(up_w)
        os.close(down_r)
        self._r, self._w = up_r, down_w
        self.reaped = False

    # both sides
    def send(self, msg: bytes) -> None:
        os.write(self._w, msg)

    def recv(self, timeout: float = 10.0) -> bytes:
        ready, _, _ = select.select([self._r], [], [], timeout)
        if not ready:
            raise AssertionError(f"no message within {timeout}s")
        return os.read(self._r, 4096)

    # parent side
    def kill(self, sig: int = signal.SIGKILL) -> None:
        if not self.reaped:
            os.kill(self.pid, sig)

    def wait(self, timeout: float = 10.0) -> int:
        status = wait_exit(self.pid, timeout)
        if status is None:
            raise AssertionError(f"child {self.pid} did not exit within {timeout}s")
        self.reaped = True
        return os.waitstatus_to_exitcode(status)

    def stop(self) -> None:
        """For ``finally``: kill and reap whatever state the child is in."""
        if not self.reaped:
            try:
                os.kill(self.pid, signal.SIGCONT)
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(self.pid, 0)
            self.reaped = True
        for fd in (self._r, self._w):
            with contextlib.suppress(OSError):
                os.close(fd)


def holding(lock: RegistryLock) -> Callable[[Child], None]:
    """A child's body: take ``lock``, say b"h", and keep it until killed."""
    def holder(ctl: Child) -> None:
        with lock:
            ctl.send(b"h")
            select.select([], [], [], 60)
    return holder


@pytest.fixture
def events() -> Iterator[list[tuple[Any, ...]]]:
    got: list[tuple[Any, ...]] = []
    telemetry.attach("test-lock", RECOVERED,
                     lambda ev, m, md, cfg: got.append((dict(m), dict(md))))
    try:
        yield got
    finally:
        telemetry.detach("test-lock")


class Counter:
    """A u64 in the segment's scratch region (a view released at the end of the test)."""

    def __init__(self, seg: Segment, index: int = 0) -> None:
        self.q = seg.region(0).cast("Q")
        self.i = index

    def get(self) -> int:
        return self.q[self.i]

    def set(self, v: int) -> None:
        self.q[self.i] = v

    def release(self) -> None:
        self.q.release()


def _forever(ctl: Child) -> None:
    select.select([], [], [], 60)


# --- basic behaviour ----------------------------------------------------------------------------

def test_reentrant_per_thread(seg: Segment) -> None:
    lock = RegistryLock(seg)
    g0 = lock.generation
    assert lock.owner() is None and not lock.held_by_me()
    with lock:
        assert lock.held_by_me()
        assert lock.owner() == procinfo.me()
        with lock, lock:
            assert seg.sem.value == 0
        assert lock.held_by_me() and seg.sem.value == 0
    assert lock.generation == g0 + 1  # the semaphore was taken once
    assert lock.owner() is None and not lock.held_by_me() and seg.sem.value == 1
    lock.close()


def test_threads_serialised(seg: Segment) -> None:
    lock = RegistryLock(seg)
    order: list[str] = []

    def other() -> None:
        with lock:
            order.append("other")

    with lock:
        t = threading.Thread(target=other)
        t.start()
        t.join(0.3)
        assert t.is_alive()  # waiting for us
        assert lock.held_by_me()
        order.append("main")
    t.join(5)
    assert order == ["main", "other"]
    lock.close()


def test_two_lock_objects_in_one_process_share_state(seg: Segment) -> None:
    """Two attachments of one registry in one process: nesting them is reentrant, and a thread
    using the other object waits; nobody takes the other for a stranded owner."""
    a, b = RegistryLock(seg, timeout=2), RegistryLock(seg, timeout=2)
    with a:
        with b:
            assert b.held_by_me() and seg.sem.value == 0
        assert a.held_by_me() and seg.sem.value == 0
        got: list[BaseException | None] = []

        def other() -> None:
            try:
                with b:
                    got.append(None)
            except BaseException as e:
                got.append(e)

        t = threading.Thread(target=other)
        t.start()
        t.join(0.5)  # several steps: it must keep waiting, not "recover" from us
        assert t.is_alive() and got == []
    t.join(5)
    assert got == [None]
    assert seg.u64(OFF_RECOVERIES) == 0 and seg.sem.value == 1
    a.close()
    b.close()


def test_thread_waiting_for_another_threads_hold_honours_the_timeout(seg: Segment) -> None:
    """A thread of this process holds the lock: another thread (yielding, then blocking on the
    thread lock) gives up after its lock object's timeout, naming the cause; the holder is
    left alone and the lock works afterwards."""
    lock = RegistryLock(seg)
    short = RegistryLock(seg, timeout=0.3)
    got: list[BaseException | float] = []

    def other() -> None:
        t0 = time.monotonic()
        try:
            with short:
                got.append(0.0)
        except BaseException as e:
            got.append(e)
        got.append(time.monotonic() - t0)

    with lock:
        t = threading.Thread(target=other)
        t.start()
        t.join(5)
        assert not t.is_alive()
        assert lock.held_by_me() and seg.sem.value == 0
    assert isinstance(got[0], LockTimeout) and "another thread of this process" in str(got[0])
    assert 0.3 <= got[1] < 1.5, got  # type: ignore[operator]
    with short:
        pass
    assert seg.sem.value == 1 and seg.u64(OFF_RECOVERIES) == 0
    short.close()
    lock.close()


def test_threads_contending_while_a_dead_process_holds_the_lock(seg: Segment) -> None:
    """Four threads of this process write under the lock while another process holds it and
    is killed: the unit is recovered once (one repair), every thread gets through, and no
    increment is lost (each thread's read-modify-write is exclusive)."""
    calls: list[int] = []
    lock = RegistryLock(seg, repair=lambda: calls.append(1))
    counter = Counter(seg)
    counter.set(0)
    n, nthreads = 300, 4
    errors: list[BaseException] = []
    started = threading.Barrier(nthreads + 1)

    def writer() -> None:
        try:
            started.wait(5)
            for i in range(n):
                with lock:
                    v = counter.get()
                    if i % 7 == 0:
                        os.sched_yield()  # invite a race
                    counter.set(v + 1)
        except BaseException as e:
            errors.append(e)

    ch = Child(holding(lock))
    threads = [threading.Thread(target=writer) for _ in range(nthreads)]
    try:
        assert ch.recv() == b"h"
        for t in threads:
            t.start()
        started.wait(5)
        time.sleep(0.05)  # not synchronisation: lets them pile up behind the holder first
        ch.kill()
        for t in threads:
            t.join(10)
        assert not any(t.is_alive() for t in threads)
        assert errors == []
        assert counter.get() == n * nthreads
        assert seg.u64(OFF_RECOVERIES) == 1 and calls == [1]
        assert seg.sem.value == 1 and lock.owner() is None
    finally:
        ch.stop()
        counter.release()
        lock.close()


def test_trywait_opens_the_segments_semaphore_or_falls_back(seg: Segment) -> None:
    """The GIL-keeping trywait is a second opening of the semaphore by name, used only when the
    entry is the one recorded in the segment (same inode); otherwise posix_ipc's serves. Either
    way a unit held by another process is not taken."""
    fast = RegistryLock(seg, timeout=0.3)
    assert fast._fast is not None
    real_ino = seg.sem_ino
    seg.sem_ino = real_ino + 1  # as if the entry at the name were another semaphore
    try:
        slow = RegistryLock(seg, timeout=0.3)
    finally:
        seg.sem_ino = real_ino
    assert slow._fast is None
    ch = Child(holding(RegistryLock(seg)))
    try:
        assert ch.recv() == b"h"
        for lk in (fast, slow):
            with pytest.raises(LockTimeout, match=f"held by live pid {ch.pid}"), lk:
                pass
        ch.kill()
        ch.wait()
        with slow:  # recovered through the fallback, then released
            assert seg.sem.value == 0
        with fast:
            assert seg.sem.value == 0
        assert seg.sem.value == 1 and seg.u64(OFF_RECOVERIES) == 1
    finally:
        ch.stop()
        fast.close()
        slow.close()


def test_mutual_exclusion_across_processes(seg: Segment) -> None:
    lock = RegistryLock(seg)
    n, procs = 1500, 4
    counter = Counter(seg)

    def worker(ctl: Child) -> None:
        ctl.recv()  # start together
        c = Counter(seg)
        for i in range(n):
            with lock:
                v = c.get()
                if i % 5 == 0:
                    os.sched_yield()  # invite a race
                c.set(v + 1)
        ctl.send(b"d")

    children = [Child(worker) for _ in range(procs)]
    try:
        for ch in children:
            ch.send(b"g")
        for ch in children:
            assert ch.recv(25) == b"d"
            assert ch.wait() == 0
        assert counter.get() == n * procs
        assert seg.sem.value == 1 and lock.owner() is None
        assert seg.u64(OFF_RECOVERIES) == 0
    finally:
        for ch in children:
            ch.stop()
        counter.release()
        lock.close()


def test_repair_runs_when_interrupted_while_dirty(seg: Segment) -> None:
    calls: list[tuple[bool, int, Any]] = []
    lock = RegistryLock(seg)
    lock._repair = lambda: calls.append((lock.held_by_me(), seg.sem.value, lock.owner()))

    with lock:  # clean exits cost nothing
        pass
    with pytest.raises(ValueError), lock:
        raise ValueError("not dirty")
    assert calls == []

    with pytest.raises(ValueError), lock:
        lock.dirty = True
        raise ValueError("mid-write")
    assert calls == [(True, 0, procinfo.me())]  # ran while still held
    assert lock.dirty is False and seg.sem.value == 1 and lock.owner() is None

    with lock:  # an inner block interrupted while dirty repairs at once
        try:
            with lock:
                lock.dirty = True
                raise KeyError("inner")
        except KeyError:
            pass
        assert len(calls) == 2 and seg.sem.value == 0
    assert len(calls) == 2 and seg.sem.value == 1
    lock.close()


def test_systemexit_from_signal_handler_mid_write_repairs_before_release(seg: Segment) -> None:
    lock = RegistryLock(seg)
    counter = Counter(seg)

    def child(ctl: Child) -> None:
        c = Counter(seg)
        lock._repair = lambda: c.set(c.get() + 100)  # evidence that repair ran under the lock

        def on_term(signum: int, frame: object) -> None:
            raise SystemExit(3)

        signal.signal(signal.SIGTERM, on_term)
        try:
            with lock:
                lock.dirty = True
                c.set(1)
                os.kill(os.getpid(), signal.SIGTERM)
                for _ in range(10**7):  # the handler raises at the next bytecode boundary
                    pass
                c.set(-1 % 2**64)  # never reached
        except SystemExit:
            ctl.send(b"exited")

    ch = Child(child)
    try:
        assert ch.recv() == b"exited"
        ch.wait()
        assert counter.get() == 101
        assert seg.sem.value == 1 and lock.owner() is None
    finally:
        ch.stop()
        counter.release()
        lock.close()


def test_a_signal_handled_as_the_release_is_entered_leaves_a_hold_release_leaked_ends(
        seg: Segment) -> None:
    """A signal whose handler raises (gunicorn's quit) runs as ``__exit__`` is entered (the
    check at a function's start), before any line of it: the release never begins, and the
    hold outlives its block, the unit taken and recorded to this live process. Where no
    ``with`` of the lock can be running (the end of a request), ``release_leaked`` ends it;
    elsewhere it does nothing."""
    lock = RegistryLock(seg)

    def on_usr1(signum: int, frame: object) -> None:
        raise SystemExit(3)

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if event == "call" and frame.f_code is RegistryLock.__exit__.__code__:
            sys.settrace(None)
            os.kill(os.getpid(), signal.SIGUSR1)  # handled at __exit__'s first instruction
        return None

    old = signal.signal(signal.SIGUSR1, on_usr1)
    try:
        assert not lock.release_leaked()
        with pytest.raises(SystemExit), lock:
            lock.dirty = True
            sys.settrace(tracer)
        assert lock.held_by_me() and lock.owner() is not None and seg.sem.value == 0
        repaired = []
        lock._repair = lambda: repaired.append(1)
        assert lock.release_leaked()
        assert repaired == [1] and not lock.dirty
        assert not lock.held_by_me() and lock.owner() is None and seg.sem.value == 1
        assert not lock.release_leaked()
        with lock:  # usable again
            assert lock.held_by_me()
    finally:
        sys.settrace(None)
        signal.signal(signal.SIGUSR1, old)
        lock.close()


def test_release_leaked_keeps_the_holds_a_request_began_inside(seg: Segment) -> None:
    """A hold left inside an outer ``with`` (a middleware's, around the request) ends down to
    the depth at the request's start: the outer block still holds the lock, and its own exit
    releases it. A write the leaked hold left half done is repaired there and then: the outer
    block's own writes clear the mark, and its release left the table torn."""
    lock = RegistryLock(seg)
    repaired: list[int] = []
    lock._repair = lambda: repaired.append(1)
    try:
        assert lock.depth() == 0
        with lock:
            keep = lock.depth()
            assert keep == 1
            lock.__enter__()  # the request's hold, left behind mid-write
            lock.dirty = True
            assert lock.depth() == 2
            assert lock.release_leaked(keep)
            assert repaired == [1] and not lock.dirty
            assert lock.depth() == 1 and lock.held_by_me() and seg.sem.value == 0
            assert not lock.release_leaked(keep)
        assert lock.depth() == 0 and lock.owner() is None and seg.sem.value == 1
    finally:
        lock.close()


def test_child_after_fork_takes_lock_parent_does_not_hold(seg: Segment) -> None:
    lock = RegistryLock(seg)
    with lock:
        pass

    def child(ctl: Child) -> None:
        with lock:
            ctl.send(f"{lock.owner()[0]}".encode())

    ch = Child(child)
    try:
        assert int(ch.recv()) == ch.pid
        assert ch.wait() == 0
        assert seg.sem.value == 1
    finally:
        ch.stop()
    with lock:
        assert lock.owner() == procinfo.me()
    lock.close()


def test_child_forked_inside_the_lock_waits_for_parent(seg: Segment) -> None:
    lock = RegistryLock(seg)

    def child(ctl: Child) -> None:
        assert not lock.held_by_me()  # per-process state was reset by the fork
        ctl.send(b"trying")
        with lock:
            ctl.send(b"got")

    with lock:
        ch = Child(child)
        try:
            assert ch.recv() == b"trying"
            r, _, _ = select.select([ch._r], [], [], 0.3)
            assert not r  # the child waits while we hold it
        except BaseException:
            ch.stop()
            raise
    try:
        assert ch.recv() == b"got"
        assert ch.wait() == 0
        assert seg.u64(OFF_RECOVERIES) == 0
    finally:
        ch.stop()
    lock.close()


def test_signal_handler_exception_during_wait_propagates(seg: Segment) -> None:
    """posix_ipc replaces a handler's exception with SignalError; the lock must not let that
    swallow it."""
    lock = RegistryLock(seg, timeout=5)

    class Shutdown(BaseException):
        pass

    def on_alarm(signum: int, frame: object) -> None:
        raise Shutdown()

    ch = Child(holding(lock))
    old = signal.signal(signal.SIGALRM, on_alarm)
    try:
        assert ch.recv() == b"h"
        signal.setitimer(signal.ITIMER_REAL, 0.25)
        t0 = time.monotonic()
        with pytest.raises(Shutdown), lock:
            pass
        assert time.monotonic() - t0 < 2
        assert not lock.held_by_me() and lock.owner()[0] == ch.pid and seg.sem.value == 0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        ch.stop()
        lock.close()


def test_signal_handler_raising_right_after_the_spin_took_the_unit_strands_nothing(
        seg: Segment) -> None:
    """The eval loop runs a pending handler right after a call returns, so one landing during
    the spin can raise just after a ``sem_trywait`` that took the unit, before the lock records
    it: the exception must release it, not leave it taken by nobody (the other processes then
    wait for the unrecorded-holder rule, 0.3 s at best, longer beside a busy process)."""
    lock = RegistryLock(seg, timeout=5)

    class Shutdown(BaseException):
        pass

    def on_usr1(signum: int, frame: object) -> None:
        raise Shutdown()

    real = lock._trywait
    calls = [0]

    def trywait(block: bool = False) -> bool:
        calls[0] += 1
        if calls[0] == 1:
            return False  # the fast path misses: into the spin
        got = real(block)
        if got:  # the signal lands right after the successful try, as in a busy spin
            os.kill(os.getpid(), signal.SIGUSR1)
        return got

    old = signal.signal(signal.SIGUSR1, on_usr1)
    try:
        lock._trywait = trywait
        with pytest.raises(Shutdown), lock:
            pass
        lock._trywait = real
        assert calls[0] >= 2
        assert not lock.held_by_me() and lock.owner() is None
        assert seg.sem.value == 1  # released, not stranded
        t0 = time.monotonic()
        with lock:
            pass
        assert time.monotonic() - t0 < 0.05
    finally:
        signal.signal(signal.SIGUSR1, old)
        lock._trywait = real
        lock.close()


# --- recovery -----------------------------------------------------------------------------------

def test_dead_holder_recovered_once(seg: Segment, events: list[tuple[Any, ...]]) -> None:
    calls: list[int] = []
    lock = RegistryLock(seg, repair=lambda: calls.append(seg.sem.value))

    ch = Child(holding(lock))
    try:
        assert ch.recv() == b"h"
        assert lock.owner()[0] == ch.pid
        gen = lock.generation
        ch.kill()  # not reaped: a zombie is dead too
        t0 = time.monotonic()
        with lock:
            waited = time.monotonic() - t0
            assert lock.owner() == procinfo.me() and seg.sem.value == 0
            assert lock.generation == gen + 1
        assert waited < 1.0, waited
        assert calls == [0]  # repair ran once, while the unit was held
        assert seg.u64(OFF_RECOVERIES) == 1
        assert len(events) == 1
        m, md = events[0]
        assert md == {"dead_pid": ch.pid} and 0 < m["waited"] < 1.0
        assert seg.sem.value == 1 and lock.owner() is None
        with lock:  # business as usual
            pass
        assert seg.u64(OFF_RECOVERIES) == 1 and calls == [0]
    finally:
        ch.stop()
        lock.close()


def test_garbage_over_the_generation_and_recovery_counters_wraps_them(seg: Segment) -> None:
    """All ones over the generation and recovery-count words (garbage: no holder leaves it):
    an acquire, and a dead holder's recovery, still go through, each counter wrapping to 0 (a
    raw ValueError from the 'Q' view before, failing every locked write)."""
    lock = RegistryLock(seg, repair=lambda: None)

    def holder(ctl: Child) -> None:
        ctl.recv()
        holding(lock)(ctl)

    ch = Child(holder)
    try:
        seg.set_u64(OFF_LOCK_GENERATION, 2**64 - 1)
        with lock:
            assert lock.generation == 0
        ch.send(b"go")
        assert ch.recv() == b"h"
        seg.set_u64(OFF_LOCK_GENERATION, 2**64 - 1)
        seg.set_u64(OFF_RECOVERIES, 2**64 - 1)
        ch.kill()
        with lock:  # the dead holder's recovery
            assert lock.owner() == procinfo.me()
            assert (lock.generation, seg.u64(OFF_RECOVERIES)) == (0, 0)
        with lock:
            assert lock.generation == 1
    finally:
        ch.stop()
        lock.close()


def test_a_dead_holder_whose_recovery_is_blocked_is_not_called_live(seg: Segment) -> None:
    """A dead holder's recovery takes the flock on the segment's file: held elsewhere (a
    recovering process stopped), every write timed out saying the lock was "held by live pid",
    a dead one, and naming nothing of what blocked. The message says the holder is dead and
    that the recovery flock is held."""
    lock = RegistryLock(seg, timeout=0.3)
    ch = Child(holding(lock))
    fd = os.open(segment_path(seg.name), os.O_RDONLY)
    try:
        assert ch.recv() == b"h"
        fcntl.flock(fd, fcntl.LOCK_EX)  # as a recovering process stopped mid-way would
        ch.kill()
        with pytest.raises(LockTimeout) as e, lock:
            pass
        msg = str(e.value)
        assert f"dead pid {ch.pid}" in msg and "live" not in msg, msg
        assert f"recovery flock on {segment_path(seg.name)}" in msg, msg
        fcntl.flock(fd, fcntl.LOCK_UN)
        with lock:  # recovered once the flock is free
            assert lock.owner() == procinfo.me()
    finally:
        os.close(fd)
        ch.stop()
        lock.close()


def test_holder_killed_before_recording_itself(seg: Segment,
                                               events: list[tuple[Any, ...]]) -> None:
    calls: list[int] = []
    lock = RegistryLock(seg, repair=lambda: calls.append(1))

    def raw(ctl: Child) -> None:
        seg.sem.acquire()  # the unit, but neither generation nor owner written
        ctl.send(b"h")
        select.select([], [], [], 60)

    ch = Child(raw)
    try:
        assert ch.recv() == b"h"
        assert lock.owner() is None and seg.sem.value == 0
        ch.kill()
        ch.wait()
        t0 = time.monotonic()
        with lock:
            waited = time.monotonic() - t0
        assert 0.2 <= waited < 1.5, waited  # the generation must stay put for two steps
        assert calls == [1] and seg.u64(OFF_RECOVERIES) == 1
        assert events and events[0][1] == {"dead_pid": 0}
        assert seg.sem.value == 1
    finally:
        ch.stop()
        lock.close()


def _raw_holder(seg: Segment, *, busy: bool) -> Callable[[Child], None]:
    """A child's body: take the bare semaphore (no generation, no owner: a holder caught between
    its acquire and its record), say b"h", then spin on the CPU or sleep until b"go"; release."""
    def run(ctl: Child) -> None:
        seg.sem.acquire()
        ctl.send(b"h")
        if busy:
            while not select.select([ctl._r], [], [], 0)[0]:
                pass
        assert ctl.recv(30) == b"go"
        seg.sem.release()
        ctl.send(b"released")
    return run


def _resume_release_and_take(ch: Child, lock: RegistryLock, seg: Segment) -> None:
    """The holder (stopped or not) goes on and releases normally; then ``lock`` is free to take
    with nothing recovered: it was never robbed."""
    os.kill(ch.pid, signal.SIGCONT)
    ch.send(b"go")
    assert ch.recv() == b"released"
    assert ch.wait() == 0
    with lock:
        assert lock.owner() == procinfo.me()
    assert seg.u64(OFF_RECOVERIES) == 0 and seg.sem.value == 1


@pytest.mark.parametrize("how", ["busy", "stopped"])
def test_live_holder_before_recording_itself_is_not_robbed(seg: Segment, how: str) -> None:
    """Owner 0 with the unit taken and the generation still is also what a LIVE holder looks
    like while it waits for the CPU (or the GIL) between its acquire and its record: under load
    that lasts longer than two steps. It must not be robbed while it runs or is stopped."""
    lock = RegistryLock(seg, timeout=1.0)
    ch = Child(_raw_holder(seg, busy=how == "busy"))
    try:
        assert ch.recv() == b"h"
        if how == "stopped":
            os.kill(ch.pid, signal.SIGSTOP)
        gen = seg.words[_GEN]
        t0 = time.monotonic()
        with pytest.raises(LockTimeout, match=f"not recorded itself yet .*{ch.pid}"), lock:
            pass
        assert time.monotonic() - t0 >= 1.0
        assert lock.owner() is None and seg.sem.value == 0 and seg.words[_GEN] == gen
        assert seg.u64(OFF_RECOVERIES) == 0
        _resume_release_and_take(ch, lock, seg)
    finally:
        ch.stop()
        lock.close()


def test_live_unrecorded_holder_that_settles_then_dies_is_recovered(seg: Segment) -> None:
    """Busy at first (waited for), then killed: the waiter recovers it once, in the same wait."""
    lock = RegistryLock(seg, timeout=10.0)
    ch = Child(_raw_holder(seg, busy=True))
    got: list[float] = []
    try:
        assert ch.recv() == b"h"
        t = threading.Thread(target=lambda: (lock.__enter__(), got.append(time.monotonic()),
                                             lock.__exit__(None, None, None)))
        t.start()
        select.select([], [], [], 0.6)  # a real wait, longer than the stable-generation rule
        assert not got and seg.u64(OFF_RECOVERIES) == 0
        ch.kill()
        ch.wait()
        t.join(5)
        assert got and seg.u64(OFF_RECOVERIES) == 1 and seg.sem.value == 1
    finally:
        ch.stop()
        lock.close()


def test_stopped_holder_is_not_robbed(seg: Segment) -> None:
    lock = RegistryLock(seg)

    def holder(ctl: Child) -> None:
        with lock:
            ctl.send(b"h")
            assert ctl.recv(30) == b"go"
        ctl.send(b"released")

    ch = Child(holder)
    try:
        assert ch.recv() == b"h"
        os.kill(ch.pid, signal.SIGSTOP)
        short = RegistryLock(seg, timeout=0.5)  # > 4 steps of 0.1 s
        t0 = time.monotonic()
        with pytest.raises(LockTimeout, match=f"held by live pid {ch.pid}") as e, short:
            pass
        assert 0.5 <= time.monotonic() - t0 < 2
        # what to do about it, as the operator reads it (shmtool cleanup, a worker's log)
        assert str(e.value).endswith(f"; pid {ch.pid} is stopped (SIGSTOP or a debugger): "
                                     f"`kill -CONT {ch.pid}` resumes it; if it is killed "
                                     "instead, the lock is recovered"), str(e.value)
        assert lock.owner()[0] == ch.pid and seg.sem.value == 0
        assert seg.u64(OFF_RECOVERIES) == 0
        _resume_release_and_take(ch, short, seg)
        short.close()
    finally:
        ch.stop()
        lock.close()


def test_timeout_can_be_shortened_for_one_lock_object(seg: Segment) -> None:
    # What a gunicorn master does (it must never wait long on a live worker): the config says 5 s
    # (a Registry gives its lock Config.lock_timeout).
    lock = RegistryLock(seg, timeout=5)
    ch = Child(holding(lock))
    try:
        assert ch.recv() == b"h"
        master = RegistryLock(seg, timeout=5)
        assert master.timeout == 5.0
        master.timeout = 0.3
        t0 = time.monotonic()
        with pytest.raises(LockTimeout, match=f"held by live pid {ch.pid}") as e, master:
            pass
        assert 0.3 <= time.monotonic() - t0 < 1.5
        assert "stopped" not in str(e.value)  # a holder that runs (or sleeps) is not
        assert lock.timeout == 5.0  # other lock objects keep theirs
        for bad in (0, -1, float("nan"), True, "1"):
            with pytest.raises(ValueError, match="lock timeout"):
                master.timeout = bad  # type: ignore[assignment]
        assert master.timeout == 0.3
        master.close()
    finally:
        ch.stop()
        lock.close()


@pytest.mark.parametrize("recorded", [True, False], ids=["recorded", "unrecorded"])
def test_waiters_race_to_recover(seg: Segment, recorded: bool) -> None:
    """Three waiting processes, one dead holder: recovered exactly once. Unrecorded (killed
    before writing its owner), the waiters also sample each other's thread states, each of them
    briefly running at its own timeouts."""
    lock = RegistryLock(seg)
    counter = Counter(seg)

    def waiter(ctl: Child) -> None:
        c = Counter(seg, 1)
        ctl.send(b"w")
        with lock:
            c.set(c.get() + 1)
            assert seg.sem.value == 0
        ctl.send(b"d")

    h = Child(holding(lock) if recorded else _raw_holder(seg, busy=False))
    ws: list[Child] = []
    try:
        assert h.recv() == b"h"
        ws = [Child(waiter) for _ in range(3)]
        for w in ws:
            assert w.recv() == b"w"
        select.select([], [], [], 0.15)  # let them reach their waits (not needed for safety)
        h.kill()
        for w in ws:
            assert w.recv(15) == b"d"
            assert w.wait() == 0
        assert counter.q[1] == 3
        assert seg.u64(OFF_RECOVERIES) == 1
        assert seg.sem.value == 1
    finally:
        h.stop()
        for w in ws:
            w.stop()
        counter.release()
        lock.close()


def test_recover_from(seg: Segment, events: list[tuple[Any, ...]]) -> None:
    calls: list[int] = []
    lock = RegistryLock(seg, repair=lambda: calls.append(seg.sem.value))

    ch = Child(holding(lock))
    try:
        assert ch.recv() == b"h"
        assert not lock.recover_from(ch.pid)  # alive: never robbed
        assert not lock.recover_from(ch.pid + 1)  # not the owner
        ch.kill()
        ch.wait()
        t0 = time.monotonic()
        assert lock.recover_from(ch.pid)
        assert time.monotonic() - t0 < 0.5
        assert calls == [0]
        assert seg.sem.value == 1 and lock.owner() is None
        assert seg.u64(OFF_RECOVERIES) == 1
        assert events == [({"waited": 0.0}, {"dead_pid": ch.pid})]
        assert not lock.recover_from(ch.pid)  # nothing left to recover
        with lock:
            pass
    finally:
        ch.stop()
        lock.close()


def test_recover_from_does_not_block_on_a_busy_recoverer(seg: Segment) -> None:
    lock = RegistryLock(seg)

    ch = Child(holding(lock))
    fd = seg.reopen()  # the segment's file, as a recoverer flocks it
    try:
        assert ch.recv() == b"h"
        ch.kill()
        ch.wait()
        fcntl.flock(fd, fcntl.LOCK_EX)  # "someone else is recovering"
        t0 = time.monotonic()
        assert not lock.recover_from(ch.pid)
        assert time.monotonic() - t0 < 0.1
        fcntl.flock(fd, fcntl.LOCK_UN)
        assert lock.recover_from(ch.pid)
    finally:
        os.close(fd)
        ch.stop()
        lock.close()


def test_recoverers_exclude_each_other_after_the_lock_file_is_replaced(seg: Segment) -> None:
    """Taking a dead holder's unit over happens under an flock that must be the same file for
    every process of the registry. On the lock file (looked up by name), a lock file removed
    or replaced under live processes split them: those attached before and after flocked
    different files, and two could take the same unit over at once (two holders). The flock
    is on the segment's own file: a lock attached after the replacement still waits for one
    attached before."""
    before = RegistryLock(seg)
    os.unlink(lock_path(seg.name))
    os.close(open_lockfile(seg.name))  # an operator's or a creator's new lock file
    after = RegistryLock(seg)
    ch = Child(holding(before))
    try:
        assert ch.recv() == b"h"
        ch.kill()
        ch.wait()
        dead, gen = seg.words[_OWNER], seg.words[_GEN]
        fd = before._lockfd()
        fcntl.flock(fd, fcntl.LOCK_EX)  # "before" is recovering
        try:
            assert not after._take_over(dead, gen), "two recoverers at once"
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
        with after:  # recovered once, by "after" alone
            assert seg.u64(OFF_RECOVERIES) == 1
    finally:
        ch.stop()
        before.close()
        after.close()


def _reuse_number(fd: int) -> tuple[int, int]:
    """Close ``fd`` (as a daemonising ``closerange`` does) and give its number to another file,
    the read end of a new pipe (both ends returned; the read end is ``fd``)."""
    os.close(fd)
    r, w = os.pipe()
    if r != fd:
        os.dup2(r, fd)
        os.close(r)
    return fd, w


def test_a_fork_child_leaves_alone_a_number_its_parent_closed_and_reused(seg: Segment) -> None:
    """The fork hook reopens the lock's recovery fd in the child (the inherited one shares the
    parent's description, and so its flock) and closes the inherited one. After the parent
    closed every fd (closerange) and the number went to another file, the hook closed that
    file in every fork child (a socket, a log, a pipe the child was handed)."""
    lock = RegistryLock(seg)
    r, w = _reuse_number(lock._fd)  # type: ignore[arg-type]

    def body() -> None:
        assert stat.S_ISFIFO(os.fstat(r).st_mode), "the child lost its pipe"
        assert os.write(w, b"x") == 1
        assert os.read(r, 1) == b"x"

    try:
        pid = fork(body)
        status = wait_exit(pid, 10)
        assert status is not None and os.waitstatus_to_exitcode(status) == 0, status
        assert stat.S_ISFIFO(os.fstat(r).st_mode)
    finally:
        lock.close()
        os.close(r)
        os.close(w)


def test_a_dead_holder_is_recovered_after_every_fd_was_closed(seg: Segment) -> None:
    """A process that closed every fd (closerange in a daemonising child) still recovers the
    unit of a dead holder, under an flock of its own on the segment's file: the recovery took
    the flock on the kept number, EBADF (``with lock`` raised OSError) or, once the number was
    another file's, on that file (excluding no other recoverer)."""
    lock = RegistryLock(seg)
    r, w = _reuse_number(lock._fd)  # type: ignore[arg-type]
    ch = Child(holding(lock))
    try:
        assert ch.recv() == b"h"
        ch.kill()
        ch.wait()
        with lock:
            assert seg.u64(OFF_RECOVERIES) == 1
            fd = lock._fd
            assert fd is not None and fd != r
            assert os.fstat(fd).st_ino == seg.ino
        assert stat.S_ISFIFO(os.fstat(r).st_mode)
    finally:
        ch.stop()
        lock.close()
        os.close(r)
        os.close(w)


def _hold_forever(lock: RegistryLock) -> Callable[[Child], None]:
    def run(ctl: Child) -> None:
        with lock:
            ctl.send(b"h")
            select.select([], [], [], 60)
    return run


def test_take_over_rechecks_what_it_saw_under_the_flock(seg: Segment) -> None:
    """A recoverer that read (owner, generation) before another one recovered must not take
    over: under the flock it re-checks owner, generation and that the unit is still taken, and
    never robs a live owner. Racing two real recoverers into that window is rare, so this calls
    the take-over step itself, in another process, with the stale view such a recoverer has."""
    lock = RegistryLock(seg)
    w = seg.words
    children: list[Child] = []

    def stale_take_over(owner: int, gen: int) -> bool:
        ch = Child(lambda ctl: ctl.send(
            b"1" if RegistryLock(seg)._take_over(owner, gen) else b"0"))
        children.append(ch)
        got = ch.recv()
        assert ch.wait() == 0
        return got == b"1"

    def state() -> tuple[int, int, int, int]:
        return w[_OWNER], w[_GEN], seg.u64(OFF_RECOVERIES), seg.sem.value

    try:
        x = Child(_hold_forever(lock))
        children.append(x)
        assert x.recv() == b"h"
        x.kill()
        x.wait()
        dead, gen = w[_OWNER], w[_GEN]
        with lock:  # the first recoverer
            assert lock.owner() == procinfo.me() and seg.u64(OFF_RECOVERIES) == 1
            s = state()
            assert not stale_take_over(dead, gen), "took over from a live recoverer"
            assert state() == s
        s = state()
        assert s[0] == 0 and s[3] == 1
        assert not stale_take_over(dead, gen), "took over a released unit"
        assert not stale_take_over(0, w[_GEN]), "took over a free unit (owner 0)"
        assert state() == s
        y = Child(_hold_forever(lock))
        children.append(y)
        assert y.recv() == b"h"
        s = state()
        assert not stale_take_over(w[_OWNER], w[_GEN]), "robbed a live owner"
        assert state() == s and lock.owner()[0] == y.pid
    finally:
        for ch in children:
            ch.stop()
        lock.close()


def test_a_dead_holders_unit_is_never_free_during_recovery(seg: Segment) -> None:
    """Taking over is not release-then-acquire: an observer process polling the semaphore while
    20 dead holders are recovered never sees the unit free while an owner is recorded (a normal
    release clears the owner first; an acquire bumps the generation before recording itself).
    Released, the unit would be free for anyone to take, with the repair not yet run."""
    lock = RegistryLock(seg, step=0.01)
    stop_flag = Counter(seg)
    w = seg.words

    def observer(ctl: Child) -> None:
        flag = Counter(seg)
        sem = seg.sem
        free = bad = 0
        ctl.send(b"r")
        while not flag.get():
            g = w[_GEN]
            if sem.value:
                free += 1
                if w[_OWNER] and w[_GEN] == g:
                    bad += 1
        ctl.send(f"{free} {bad}".encode())

    obs = Child(observer)
    children = [obs]
    try:
        assert obs.recv() == b"r"
        for _ in range(20):
            h = Child(_hold_forever(lock))
            children.append(h)
            assert h.recv() == b"h"
            h.kill()
            h.wait()
            with lock:
                assert seg.sem.value == 0
        assert seg.u64(OFF_RECOVERIES) == 20
        stop_flag.set(1)
        free, bad = map(int, obs.recv().split())
        assert obs.wait() == 0
        assert bad == 0, f"the unit was free with a dead owner recorded ({bad} observations)"
        assert free > 0  # the observer did run (it saw the normal releases)
    finally:
        for ch in children:
            ch.stop()
        stop_flag.release()
        lock.close()
