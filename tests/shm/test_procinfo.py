"""procinfo: start times, liveness (exited, zombie, reused pid), the packed owner word."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import resource
import select
import signal
import threading
import time
from collections.abc import Callable

import posix_ipc
import pytest
from helpers.background import lock_held
from helpers.procs import child, fork, reap, recv, wait_exit, wait_zombie

from shmcancel.cancellation import Cancellation
from shmcancel.exceptions import LockTimeout
from shmcancel.shm import procinfo


def _fork_waiting() -> tuple[int, int]:
    """A child that blocks until its pipe closes. Returns (pid, write end)."""
    r, w = os.pipe()

    def run() -> None:
        os.close(w)
        os.read(r, 1)
    pid = fork(run)
    os.close(r)
    return pid, w


def test_me_and_own_start_time() -> None:
    pid, start = procinfo.me()
    assert pid == os.getpid()
    assert start == procinfo.start_time(pid)
    assert procinfo.alive(pid, start)
    assert procinfo.me() is procinfo.me()  # cached


def test_forked_child_start_time_and_me_reset() -> None:
    r, w = os.pipe()
    parent_me = procinfo.me()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            cp, cs = procinfo.me()
            os.write(w, f"{cp} {cs}".encode())
        finally:
            os._exit(0)
    try:
        os.close(w)
        cp, cs = map(int, os.read(r, 100).split())
        assert cp == pid != parent_me[0]
        assert cs >= parent_me[1]
    finally:
        os.close(r)
        os.waitpid(pid, 0)


def test_live_child_then_reaped_child_is_dead() -> None:
    pid, w = _fork_waiting()
    try:
        start = procinfo.start_time(pid)
        assert start is not None
        assert procinfo.alive(pid, start)
        assert not procinfo.alive(pid, start + 1)  # a reused pid: the start time differs
    finally:
        os.close(w)
        os.waitpid(pid, 0)
    assert procinfo.start_time(pid) is None
    assert not procinfo.alive(pid, start)


def test_unreaped_zombie_is_dead() -> None:
    pid, w = _fork_waiting()
    try:
        start = procinfo.start_time(pid)
        assert start is not None
        os.close(w)  # the child exits; we do not reap it yet
        w = -1
        wait_zombie(pid)
        os.kill(pid, 0)  # a zombie still "exists" for kill(2) ...
        assert not procinfo.alive(pid, start)  # ... but is dead
    finally:
        if w >= 0:
            os.close(w)
        os.waitpid(pid, 0)


def test_stopped_process_is_alive() -> None:
    pid, w = _fork_waiting()
    try:
        start = procinfo.start_time(pid)
        os.kill(pid, signal.SIGSTOP)
        assert procinfo.alive(pid, start)
        os.kill(pid, signal.SIGCONT)
    finally:
        os.close(w)
        os.waitpid(pid, 0)


def test_nonexistent_and_bad_pids() -> None:
    assert procinfo.start_time(0) is None
    assert not procinfo.alive(0, 0)
    assert not procinfo.alive(-1, 0)
    assert procinfo.start_time(2**22 + 5) is None


def test_comm_with_parens_and_spaces() -> None:
    # Set our own comm to something hostile in a child and read it from the parent.
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            with open("/proc/self/comm", "w") as f:
                f.write("a) b (c) 7 8")
            os.write(w, b"x")
            select.select([], [], [], 30)  # until the parent kills us
        finally:
            os._exit(0)
    try:
        os.close(w)
        assert os.read(r, 1) == b"x"
        with open(f"/proc/{pid}/stat", "rb") as f:
            assert b"a) b (c) 7 8" in f.read()
        start = procinfo.start_time(pid)
        assert start is not None and procinfo.alive(pid, start)
        assert start >= procinfo.me()[1]
    finally:
        os.close(r)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


@pytest.mark.parametrize(("pid", "start"), [
    (1, 0), (12345, 987654321), (2**22 - 1, 2**42 - 1), (4194303, 1),
])
def test_pack_roundtrip(pid: int, start: int) -> None:
    word = procinfo.pack_owner(pid, start)
    assert 0 < word < 2**64
    assert procinfo.unpack_owner(word) == (pid, start)


def test_pack_rejects_out_of_range_and_zero_is_none() -> None:
    assert procinfo.unpack_owner(0) is None
    for pid, start in [(0, 1), (2**22, 1), (1, 2**42), (1, -1)]:
        with pytest.raises(ValueError):
            procinfo.pack_owner(pid, start)


def _states_until(pid: int, ok: Callable[[list[str]], bool], timeout: float = 10) -> list[str]:
    """Poll ``thread_states(pid)`` until ``ok`` accepts them (both threads up); those states."""
    deadline = time.monotonic() + timeout
    while True:
        states = procinfo.thread_states(pid) or []
        if len(states) == 2 and ok(states):
            return states
        assert time.monotonic() < deadline, (pid, states)
        select.select([], [], [], 0.01)


def test_thread_states_and_settled() -> None:
    r, w = os.pipe()

    def run() -> None:  # a second thread sleeps; the main one spins until told to, then sleeps
        os.close(w)
        threading.Thread(target=select.select, args=([], [], [], 60), daemon=True).start()
        while not select.select([r], [], [], 0)[0]:
            pass
        os.read(r, 1)
        select.select([r], [], [], 60)
    pid = fork(run)
    try:
        os.close(r)
        _states_until(pid, lambda s: "R" in s)  # spinning: running or runnable
        assert not procinfo.settled(pid)
        os.write(w, b"s")
        _states_until(pid, lambda s: s == ["S", "S"])
        assert procinfo.settled(pid)
        os.kill(pid, signal.SIGSTOP)
        _states_until(pid, lambda s: "T" in s)
        assert not procinfo.settled(pid)  # stopped: not settled either
        os.kill(pid, signal.SIGCONT)
    finally:
        os.close(w)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert procinfo.thread_states(pid) is None and procinfo.settled(pid)  # gone


def test_mappers_finds_processes_with_a_semaphore_open_by_inode(shm_name: str) -> None:
    name = f"/{shm_name}"
    sem = posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=0o600, initial_value=1)
    try:
        ino = os.stat(f"/dev/shm/sem.{shm_name}").st_ino
        # Processes whose maps this one cannot read count whatever the inode (see the next test)
        unreadable = set(procinfo.mappers("/dev/shm/sem.", 1))
        assert os.getpid() not in unreadable
        assert set(procinfo.mappers("/dev/shm/sem.", ino)) == unreadable  # the caller left out
        pid, w = _fork_waiting()  # inherits the mapping
        try:
            assert set(procinfo.mappers("/dev/shm/sem.", ino)) == unreadable | {pid}
            assert set(procinfo.mappers("/dev/shm/sem.", ino + 1)) == unreadable
            assert set(procinfo.mappers("/dev/shm/other.", ino)) == unreadable
        finally:
            os.close(w)
            os.waitpid(pid, 0)
        assert set(procinfo.mappers("/dev/shm/sem.", ino)) == unreadable
    finally:
        sem.unlink()
        sem.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to another uid")
def test_unreadable_process_of_my_uid_counts_as_a_mapper() -> None:
    """Gunicorn workers that dropped privileges (its ``user`` setting) are not dumpable: they
    cannot read each other's maps. A sibling may have the semaphore open, so it counts (and
    must be asleep before an unrecorded holder is recovered). Here: two processes as nobody,
    one asking about the other and about inode 1, which nothing maps."""
    pid, r = child(_nobody_asks_about_a_sibling)
    try:
        got = recv(r, 20)
        # it reaps its sibling, then exits by itself
        assert wait_exit(pid, 20) is not None, "the asking child did not exit"
    finally:
        os.close(r)
        reap(pid)
    sibling, found = got.decode().split(":")
    assert sibling in found.split(","), got


def _nobody_asks_about_a_sibling(w: int) -> None:
    os.setgid(65534)
    os.setuid(65534)  # non-dumpable from here, and without capabilities
    rr, ww = os.pipe()

    def sibling() -> None:
        os.close(ww)
        os.read(rr, 1)  # until the asker closes its end
    sib = fork(sibling)
    try:
        found = procinfo.mappers("/dev/shm/sem.", 1)
        os.write(w, f"{sib}:{','.join(map(str, found))}".encode())
    finally:
        os.close(ww)
        os.waitpid(sib, 0)


def test_a_process_out_of_descriptors_judges_no_live_process_dead(registry) -> None:
    """A process at its descriptor limit (EMFILE: a loaded worker) cannot open any
    ``/proc/<pid>/stat``; ``alive()`` took that for "gone", so it took the registry lock over
    from a live holder (two holders) and its sweep reaped live processes' lane rows (their
    requests no longer in flight). What cannot be read says nothing: the process is alive."""
    reg = registry(lock_timeout=0.3)
    c = Cancellation(reg)
    h = c.begin(1, "s")  # a row of this live process, in its lane
    me = procinfo.me()
    go_r, go_w = os.pipe()
    def in_child(w: int) -> None:
        os.close(go_w)
        fd = os.open("/dev/null", os.O_RDONLY)
        os.close(fd)
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (fd, hard))  # no descriptor left
        try:
            os.close(os.open("/dev/null", os.O_RDONLY))
            out = {"emfile": False}
        except OSError as e:
            out = {"emfile": e.errno == errno.EMFILE}
        out["alive"] = procinfo.alive(*me)
        try:
            with reg.lock:
                out["lock"] = "taken from a live holder"
        except LockTimeout:
            out["lock"] = "timed out"
        os.write(w, b"1")
        select.select([go_r], [], [], 30)  # the holder lets go
        Cancellation(reg).cleanup()
        out["in_flight"] = Cancellation(reg).in_flight(1, "s")
        os.write(w, json.dumps(out).encode())

    held = contextlib.ExitStack()  # the lock, by another thread of this live process
    held.enter_context(lock_held(reg))
    pid, r = child(in_child)
    try:
        assert recv(r, 20) == b"1"
        held.close()  # the child tried: let go
        os.write(go_w, b"x")
        got = json.loads(recv(r, 20))
        assert got == {"emfile": True, "alive": True, "lock": "timed out", "in_flight": True}
        assert wait_exit(pid, 10) is not None
        assert c.in_flight(1, "s") and h.tracked
    finally:
        held.close()
        os.close(r)
        os.close(go_r)
        os.close(go_w)
        reap(pid)
        h.end()
