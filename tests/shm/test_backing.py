"""Large records backed on demand (``shm/layout.py``): a registry created while /dev/shm had room
for all of it, then filled by someone else. A large row that needs a page no longer to be had is
refused with ``ShmFull`` (a ``TableFull``) before any store: no SIGBUS, no row lost or half
written, and the same write succeeds once room is made. Real tmpfs, really full: each scenario
runs with a small /dev/shm of its own (``helpers.small_shm``)."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from helpers import small_shm
from helpers.names import TEST_PREFIX
from helpers.procs import fork, wait_exit

import shmcancel
from shmcancel import Cancellation, Config, Registry

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The scenarios run the shmcancel under test (a worktree's src on PYTHONPATH), not whichever
# one the interpreter has installed: PYTHONPATH is not replaced by the tests' directory alone.
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(
    [os.path.dirname(os.path.dirname(os.path.abspath(shmcancel.__file__))), TESTS])}
def run_small(script: str, size: str, name: str) -> Any:
    """What ``script`` (Python, given the registry name ``name``) prints as JSON, run with a
    /dev/shm of ``size`` of its own; skips where that cannot run. A non-zero exit fails the
    test with its stderr (-7: SIGBUS)."""
    if (why := small_shm.unavailable()) is not None:
        pytest.skip(why)
    proc = subprocess.run(small_shm.command(size, [sys.executable, "-c", script, name]),
                          capture_output=True, text=True, timeout=120, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


SCENARIO = r'''
import json, os, sys
from shmcancel import Cancellation, Config, Registry
from shmcancel.exceptions import TableFull
from shmcancel.shm.table import ShmFull
from helpers import small_shm

SCOPE = "principal:" + "\U0001f600" * 125
REASON = "\U0001f600" * 200
worst = lambda i: f"{i:06d}" + "i" * 250
out = {}
reg = Registry.create(sys.argv[1], Config(max_rows=2000, max_rows_per_scope=None))
c = Cancellation(reg)
t = reg.table("cancellations")
for i in range(5):
    c.cancel(worst(i), REASON, scope=SCOPE)
c.cancel("small", "short", scope="s")
fd = small_shm.fill("/dev/shm")  # someone fills /dev/shm
i, refused = 5, None
while i < 2000 and refused is None:
    try:
        c.cancel(worst(i), REASON, scope=SCOPE)
        i += 1
    except ShmFull as e:
        refused = str(e)
out["written"], out["refused"] = i, refused
out["rows"] = t.count()
out["refused_row"] = c.reason(worst(i), SCOPE)
out["earlier_intact"] = all(c.reason(worst(k), SCOPE) == REASON for k in range(i))
c.cancel("small2", "short", scope="s")  # a small row still fits
out["small_after"] = c.reason("small2", "s")
try:
    c.cancel("small", REASON, scope="s")  # a small row growing large
    out["grown"] = "written"
except ShmFull:
    out["grown"] = c.reason("small", "s")
tracked, out["track"] = 0, "tracked"
while out["track"] == "tracked" and tracked < 200:  # those that fit pages backed already
    try:
        c.track(worst(10000 + tracked), SCOPE)
        tracked += 1
    except TableFull as e:
        out["track"] = type(e).__name__
out["in_flight"] = c.in_flight(worst(10000 + tracked), SCOPE)
out["tracked_in_flight"] = all(c.in_flight(worst(10000 + k), SCOPE) for k in range(tracked))
out["fsck"] = sum(n for rep in reg.fsck().values() for n in rep.values())
os.ftruncate(fd, 0)  # room again
c.cancel(worst(i), REASON, scope=SCOPE)
c.cancel("small", REASON, scope="s")
out["after_room"] = [c.reason(worst(i), SCOPE) == REASON, c.reason("small", "s") == REASON]
out["rows_after"] = t.count()
reg.unlink()
print(json.dumps(out))
'''


def test_a_large_row_refused_for_want_of_room_in_dev_shm_loses_nothing(shm_name: str) -> None:
    out = run_small(SCENARIO, "16m", shm_name)
    assert 5 < out["written"] < 2000  # the chunk backed before /dev/shm filled, then a refusal
    assert "/dev/shm has no room left" in out["refused"]
    assert out["rows"] == out["written"] + 1  # + "small": the refused row is not there
    assert out["refused_row"] is None and out["earlier_intact"]
    assert out["small_after"] == "short"
    assert out["grown"] == "short"  # refused, and the row kept as it was
    assert out["track"] == "ShmFull" and out["in_flight"] is False
    assert out["tracked_in_flight"]
    assert out["fsck"] == 0
    assert out["after_room"] == [True, True]
    assert out["rows_after"] == out["written"] + 3


SCOPE = "principal:" + "\U0001f600" * 125
REASON = "\U0001f600" * 200


def test_a_closed_segment_fd_whose_number_was_reused_is_never_written(shm_name: str,
                                                                    tmp_path: Path) -> None:
    """A process that closed every fd (a daemonizing child's ``closerange``) and opened a file
    that took the kept fd's number: backing large records reopens the segment by its name
    rather than fallocate that file, and closing the registry leaves the file's fd open."""
    with Registry.create(shm_name, Config(max_rows_per_scope=None)) as reg:
        c = Cancellation(reg)
        kept = reg._seg._fd
        os.close(kept)
        other = os.open(tmp_path / "log", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            assert other == kept  # the lowest free number
            for i in range(100):  # more than a backing chunk
                c.cancel(f"{i:06d}" + "i" * 250, REASON, scope=SCOPE)
            assert reg.table("cancellations").count() == 100
            assert os.fstat(other).st_size == 0 and os.fstat(other).st_blocks == 0
            reg.close()
            assert os.fstat(other).st_size == 0  # still open: not closed as the segment's
        finally:
            os.close(other)
        reg.unlink()


def _lowest_free_is(n: int) -> list[int]:
    """Fill every free fd number below ``n`` (free itself) so that the next open takes ``n``;
    the fillers, for the caller to close."""
    fillers = []
    while (fd := os.open(os.devnull, os.O_RDONLY)) != n:
        assert fd < n, (fd, n)
        fillers.append(fd)
    os.close(fd)
    return fillers


@pytest.mark.parametrize("whose", ["segment", "lock"])
def test_an_attachment_closed_leaves_the_others_reopened_fd_open(shm_name: str,
                                                                 whose: str) -> None:
    """Two attachments of one registry in one process; every fd closed (closerange), and the
    second one's segment reopened onto a number the first still kept (its segment's, or its
    lock's recovery fd). The number's device and inode are the segment's, so closing the first
    closed the second's fd, and so did every fork child's hook of the first's lock: unlinked
    since (``unlink`` closes nothing, attached processes keep using the segment), the second
    could back no page any more, every large row refused."""
    first = Registry.create(shm_name, Config(max_rows_per_scope=None))
    second = Registry.attach(shm_name)
    fillers: list[int] = []
    try:
        target = first._seg._fd if whose == "segment" else first.lock._fd
        assert target is not None
        for fd in (first._seg._fd, first.lock._fd, second._seg._fd, second.lock._fd):
            assert fd is not None
            os.close(fd)  # closerange
        fillers = _lowest_free_is(target)
        assert second._seg._file() == target  # the second reopened onto the first's number

        def child() -> None:  # a fork child's hook reopens (and closes) the lock's fd
            assert os.fstat(target).st_ino == second._seg.ino, "the child lost the second's fd"

        status = wait_exit(fork(child), 10)
        assert status is not None and os.waitstatus_to_exitcode(status) == 0, status
        first.close()
        assert os.fstat(target).st_ino == second._seg.ino, "the second's fd was closed"
        second.unlink()
        c = Cancellation(second)
        for i in range(100):  # more than a backing chunk
            c.cancel(f"{i:06d}" + "i" * 250, REASON, scope=SCOPE)
        assert second.table("cancellations").count() == 100
    finally:
        for fd in fillers:
            os.close(fd)
        first.close()
        second.close()
        second.unlink()


OTHERS_BACKED = r'''
import json, sys
from shmcancel import Config, Registry
from shmcancel.shm.base import BACK_CHUNK
from shmcancel.shm.table import ShmFull
from helpers import small_shm

name = sys.argv[1]
big = "x" * 700  # a large record's row
out = {}
first = Registry.create(name, Config(max_rows=2000, max_rows_per_scope=None))
t1 = first.table("cancellations")
chunk = BACK_CHUNK // t1.record_size
n = chunk + 10
for i in range(n):  # this attachment backs two chunks of large records
    t1.insert(("a", i), big)
backed = t1._backed - t1.capacity  # large records backed, all of them by `first`
fd = small_shm.fill("/dev/shm")  # someone fills /dev/shm
second = Registry.attach(name)  # a worker started since: it has backed nothing itself
t2 = second.table("cancellations")
written, refused = 0, None
while refused is None and written < backed:
    try:
        t2.insert(("b", written), big)
        written += 1
    except ShmFull as e:
        refused = str(e)
out["backed_free"], out["written"], out["refused"] = backed - n, written, refused
second.close()
first.close()
first.unlink()
print(json.dumps(out))
'''


def test_a_record_another_process_backed_is_written_with_dev_shm_full(shm_name: str) -> None:
    """A worker that has backed nothing itself writes into large records another one backed:
    /dev/shm being full since does not refuse those (only rows needing new pages are)."""
    out = run_small(OTHERS_BACKED, "16m", shm_name)
    assert out["backed_free"] > 1
    assert out["written"] >= out["backed_free"], out  # every record backed already was written


SAME_INODE = r'''
import json, os, subprocess, sys, tempfile
from shmcancel import Cancellation, Config, Registry

SCOPE = "principal:" + "\U0001f600" * 125
REASON = "\U0001f600" * 200
out = {}
reg = Registry.create(sys.argv[1], Config(max_rows=2000, max_rows_per_scope=None))
c = Cancellation(reg)
ino = os.fstat(reg._seg._fd).st_ino
d = tempfile.mkdtemp(prefix="shmcancel-other-fs-")
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "shmcancel-test-other", d], check=True,
               timeout=30)
try:
    other = -1
    for i in range(1000):  # another file system's inode numbers count from 1 as well
        fd = os.open(f"{d}/f{i}", os.O_RDWR | os.O_CREAT, 0o600)
        if os.fstat(fd).st_ino == ino:
            other = fd
            break
        os.close(fd)
    out["found"] = other >= 0
    kept = reg._seg._fd
    os.dup2(other, kept)  # the kept number closed, now another file's (closerange, then open)
    os.close(other)
    for i in range(100):  # more than a backing chunk
        c.cancel(f"{i:06d}" + "i" * 250, REASON, scope=SCOPE)
    out["rows"] = reg.table("cancellations").count()
    out["other_size"] = os.fstat(kept).st_size
    reg.close()
    try:
        os.fstat(kept)
        out["other_open"] = True
        os.close(kept)
    except OSError:
        out["other_open"] = False
finally:
    subprocess.run(["umount", d], timeout=30)
    os.rmdir(d)
reg.unlink()
print(json.dumps(out))
'''


def test_a_reused_fd_number_with_the_segments_inode_number_on_another_fs_is_not_written(
        shm_name: str) -> None:
    """An inode number is unique within its file system only: the file that took the kept fd's
    number may be another tmpfs's (/run, another /dev/shm) with the segment's inode number.
    Backing reopens the segment rather than fallocate that file; closing leaves it open."""
    out = run_small(SAME_INODE, "16m", shm_name)
    assert out["found"] and out["rows"] == 100
    assert out["other_size"] == 0, out  # not grown by a fallocate meant for the segment
    assert out["other_open"], out  # not closed as the segment's


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_registry_dropped_without_close_leaves_no_fd_open(shm_names: list[str]) -> None:
    """The segment fd each attachment keeps (to back pages) and its lock file's are closed when
    a registry is collected unclosed, as a file object's is: 30 registries created and dropped
    leave at most the last one's (kept as ``current()``) open."""
    gc.collect()
    before = _fds()
    for i in range(30):
        name = f"{TEST_PREFIX}{os.getpid()}-drop{i}-{uuid.uuid4().hex[:6]}"
        shm_names.append(name)
        Registry.create(name, Config(max_rows=100))  # dropped at once, never closed
    gc.collect()
    assert _fds() - before <= 3


AT_EXIT = r'''
import atexit, json, os, sys
from shmcancel import Config, Registry

out = {}

def at_exit():  # registered before the registry: runs after weakref's own exit hook
    try:
        with reg.lock:  # its holder died holding it: taken over (under the lock file's flock)
            out["taken"] = True
    except Exception as e:
        out["taken"] = repr(e)
    print(json.dumps(out), flush=True)
    reg.close()
    reg.unlink()

atexit.register(at_exit)
reg = Registry.create(sys.argv[1], Config(lock_timeout=5.0))
pid = os.fork()
if pid == 0:
    Registry.attach(sys.argv[1]).lock.__enter__()
    os._exit(0)  # dies holding the lock
os.waitpid(pid, 0)
'''


def test_a_registry_still_in_use_at_interpreter_exit_keeps_its_fds(shm_name: str) -> None:
    """Cleanup that runs at exit (an ``atexit`` handler registered before the registry, a daemon
    thread such as the janitor or the Redis bridge) still uses the registry. The fd finalizers
    ran as ``atexit`` hooks and closed the lock file's fd under the live lock object, so taking
    over the lock from a dead holder then failed with EBADF (or flocked whatever file took the
    number). The OS closes a process's fds at exit: the finalizers are for registries
    collected unclosed, not for exit."""
    proc = subprocess.run([sys.executable, "-c", AT_EXIT, shm_name], capture_output=True,
                          text=True, timeout=60, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout) == {"taken": True}, proc.stderr[-3000:]


SESSIONS_FULL = r'''
import json, sys
from shmcancel import Config, Registry
from shmcancel.mcp.sessions import SessionsFull, SessionStore
from helpers import small_shm

reg = Registry.create(sys.argv[1], Config(max_rows=2000))
store = SessionStore(reg)
made = [store.create("2025-11-25", client=f"c{k}").id for k in range(100) for _ in range(8)]
fd = small_shm.fill("/dev/shm")
out = {"ninth": "made"}
for k in range(100):  # a ninth session makes a client's list large (some fit pages backed)
    try:
        store.create("2025-11-25", client=f"c{k}")
    except SessionsFull as e:
        out["ninth"] = str(e)
        break
out["kept"] = all(store.get(s) is not None for s in made)
out["other_client"] = store.create("2025-11-25", client="d") is not None  # a small row: served
reg.close()
reg.unlink()
print(json.dumps(out))
'''


def test_a_session_that_needs_a_large_row_with_dev_shm_full_is_refused_saying_why(
        shm_name: str) -> None:
    """A client's ninth session makes its session list large: with /dev/shm full (once the
    pages backed already are used) that is ``SessionsFull`` (-32000 with Retry-After at the
    transport) naming /dev/shm, not "table full"; the clients' sessions stay, and another
    client's first session is served."""
    out = run_small(SESSIONS_FULL, "40m", shm_name)
    assert "/dev/shm has no room left" in out["ninth"], out
    assert out["kept"] and out["other_client"]


PREALLOCATED = r'''
import json, sys
from shmcancel import Cancellation, Config, Registry
from helpers import small_shm

SCOPE = "principal:" + "\U0001f600" * 125
REASON = "\U0001f600" * 200
reg = Registry.create(sys.argv[1], Config(max_rows=2000, max_rows_per_scope=None,
                                          preallocate=True))
c = Cancellation(reg)
fd = small_shm.fill("/dev/shm")  # someone fills /dev/shm
for i in range(2000):  # every row of the worst size: their pages were allocated at create
    c.cancel(f"{i:06d}" + "i" * 250, REASON, scope=SCOPE)
print(json.dumps({"rows": reg.table("cancellations").count(), "evictions": reg.evictions}))
reg.close()
reg.unlink()
'''


def test_a_preallocated_registry_stores_every_worst_size_row_with_dev_shm_full(
        shm_name: str) -> None:
    """``Config(preallocate=True)``: every page at create, so a /dev/shm filled since refuses
    nothing: max_rows rows of the worst size all stored."""
    assert run_small(PREALLOCATED, "40m", shm_name) == {"rows": 2000, "evictions": 0}
