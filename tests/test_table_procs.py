"""Tables shared by real forked processes: concurrent writers end in the model's state; a
lock-free reader never sees a torn row while writers rewrite the same keys."""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Callable

import pytest
from test_table import Rig, healthy

from shmcancel.exceptions import TableFull

pytestmark = pytest.mark.timeout(120)


def fork(fn: Callable[[], None]) -> int:
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 1
        try:
            fn()
            code = 0
        finally:
            os._exit(code)
    return pid


def wait_all(pids: list[int], timeout: float = 60.0) -> list[int]:
    """Exit codes of ``pids``; on timeout kill the rest (by pid) and fail."""
    deadline = time.monotonic() + timeout
    codes = {}
    while len(codes) < len(pids):
        for pid in pids:
            if pid not in codes:
                got, status = os.waitpid(pid, os.WNOHANG)
                if got:
                    codes[pid] = os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            raise AssertionError(f"children still running after {timeout}s")
        if len(codes) < len(pids):
            time.sleep(0.005)  # polling for exit, not synchronising
    return [codes[p] for p in pids]


def stop(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


N_PROCS, N_OPS, N_KEYS = 4, 1500, 10


def ops_of(proc: int) -> list[tuple[str, object, object]]:
    """Deterministic ops of one process over its own keys (so the end state is the model's)."""
    rng = random.Random(proc)
    out = []
    for _ in range(N_OPS):
        k = (proc, rng.randrange(N_KEYS))
        x = rng.random()
        v = (rng.randrange(3), "v" * rng.randrange(0, 40))
        if x < 0.4:
            out.append(("insert", k, v))
        elif x < 0.5:
            out.append(("insert_new", k, v))
        elif x < 0.7:
            out.append(("delete_object", k, v))
        else:
            out.append(("delete", k, None))
    return out


def model_of(kind: str, ops: list[tuple[str, object, object]]) -> dict[object, set]:
    m: dict[object, set] = {}
    for name, k, v in ops:
        vals = m.setdefault(k, set())
        if name == "insert":
            if kind == "set":
                vals.clear()
            vals.add(v)
        elif name == "insert_new":
            if not vals:
                vals.add(v)
        elif name == "delete_object":
            vals.discard(v)
        else:
            vals.clear()
        if not vals:
            del m[k]
    return m


@pytest.mark.parametrize("kind", ["set", "bag"])
def test_concurrent_writers_end_in_the_model_state(shm_name, kind: str) -> None:
    cap = N_PROCS * N_KEYS * (1 if kind == "set" else 3)
    rig = Rig(shm_name, [(kind, cap, 128)])
    t = rig.tables[0]
    pids: list[int] = []
    try:
        def work(proc: int) -> None:
            rig.lock.after_fork_child()
            for name, k, v in ops_of(proc):
                if name == "insert":
                    t.insert(k, v)
                elif name == "insert_new":
                    t.insert_new(k, v)
                elif name == "delete_object":
                    t.delete_object(k, v)
                else:
                    t.delete(k)

        pids = [fork(lambda p=p: work(p)) for p in range(N_PROCS)]
        assert wait_all(pids) == [0] * N_PROCS
        pids = []
        want: dict[object, set] = {}
        for p in range(N_PROCS):
            want.update(model_of(kind, ops_of(p)))
        got: dict[object, set] = {}
        for k, v in t.scan():
            got.setdefault(k, set()).add(v)
        assert got == want
        assert t.count() == sum(len(v) for v in want.values())
        healthy(t)
    except TableFull:  # pragma: no cover - capacity is sized for every key
        raise
    finally:
        stop(pids)
        rig.close()


def valid(v: object) -> bool:
    return isinstance(v, tuple) and len(v) == 2 and v[1] == "x" * v[0]


def test_reader_never_sees_a_torn_row(shm_name) -> None:
    """Two writers rewrite (and delete, reinsert) the same keys with values whose length varies
    from a few bytes to nearly the record; the reader (this process) checks every read."""
    keys = [("k", i) for i in range(6)]
    rig = Rig(shm_name, [("set", 16, 320), ("bag", 40, 320)])  # bag: 6 keys x 6 values
    st, bag = rig.tables
    pids: list[int] = []
    try:
        def writer(seed: int) -> None:
            rig.lock.after_fork_child()
            rng = random.Random(seed)
            for i in range(6000):
                k = keys[rng.randrange(len(keys))]
                n = rng.choice((0, 1, 7, 50, 120, 280))
                st.insert(k, (n, "x" * n))
                if i % 7 == 0:
                    st.delete(k)
                bag.insert(k, (n, "x" * n))
                if i % 3 == 0:
                    bag.delete(k)

        pids = [fork(lambda s=s: writer(s)) for s in (1, 2)]
        watches = [st.watch(k) for k in keys] + [bag.watch(k) for k in keys]
        prepared = [st.prepare(k) for k in keys]
        reads = hits = scans = 0
        lengths = set()
        running = list(pids)
        codes = []
        while running:
            for pk in prepared:
                for v in st.lookup(pk):
                    assert valid(v), v
                    hits += 1
                    lengths.add(v[0])
                reads += 1
            for k in keys:
                vals = bag.lookup(k)
                assert all(valid(v) for v in vals), vals
                reads += 1
            for w in watches:
                assert all(valid(v) for v in w.values())
                reads += 1
            if reads % 50 == 0:
                assert all(valid(v) for _, v in st.scan())
                scans += 1
            if reads % 600 == 0:
                for p in list(running):
                    got, status = os.waitpid(p, os.WNOHANG)
                    if got:
                        running.remove(p)
                        codes.append(os.waitstatus_to_exitcode(status))
        assert codes == [0, 0]
        assert reads >= 5000 and hits >= 1000, (reads, hits)
        assert len(lengths) >= 4 and scans >= 10
        with rig.lock:
            healthy(st)
            healthy(bag)
        pids = []
    finally:
        stop(pids)
        rig.close()
