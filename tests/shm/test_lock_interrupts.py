"""RegistryLock's own bookkeeping cut short by a signal handler's exception at any line.

gunicorn's quit raises SystemExit from a Python signal handler, which CPython runs in the main
thread at the next bytecode even when that thread has its signals blocked (another thread of the
process takes the signal: every worker has its janitor's). Raised at each line of the lock's
acquire and release in turn (``sys.settrace``), the exception goes on to the caller and the lock
is left as a normal release leaves it: no unit held or lost, no owner recorded, the thread lock
free, a repair owed run before the release; and the unwinding code's next ``with`` (a request's
``finally``) takes the semaphore for real.
"""

from __future__ import annotations

import dis
import sys
import threading
from typing import Any

import pytest

from shmcancel.shm.lock import _OWNER, RegistryLock
from shmcancel.shm.segment import Segment

pytestmark = pytest.mark.timeout(60)

_CODES = {f.__code__ for f in (RegistryLock.__enter__, RegistryLock.__exit__,
                               RegistryLock._release_unit, RegistryLock._run_repair,
                               RegistryLock._stamp, RegistryLock._trywait_posix)}
_CODES |= {getattr(RegistryLock, n).__code__ for n in ("_repair_again",)
           if hasattr(RegistryLock, n)}
_EXIT = RegistryLock.__exit__.__code__


_OPS: dict[Any, dict[int, str]] = {}
_EXIT_ENTRY_LINES = {RegistryLock.__exit__.__code__.co_firstlineno + 1,
                     RegistryLock.__exit__.__code__.co_firstlineno + 2}


def _ops(code: Any) -> dict[int, str]:
    got = _OPS.get(code)
    if got is None:
        got = _OPS[code] = {i.offset: i.opname for i in dis.get_instructions(code)}
    return got


def _interrupted(at: int, body: Any) -> tuple[bool, int | None]:
    """Run ``body`` with SystemExit raised at the ``at``-th point of the lock's code where
    CPython runs a pending signal handler (the eval loop's checks: a function's entry, right
    after a call returns, a backward jump), traced opcode by opcode; (whether it was raised,
    the line). Not at ``__exit__``'s entry and its first line: raised there, before it reads
    whether the hold is this thread's, the hold stays (a residual window of a few bytecodes)."""
    seen = [0, None]
    prev: dict[int, str] = {}

    def point(frame: Any) -> None:
        if frame.f_code is _EXIT and frame.f_lineno in _EXIT_ENTRY_LINES:
            return
        seen[0] += 1
        if seen[0] == at:
            seen[1] = frame.f_lineno
            raise SystemExit("quit")

    def local(frame: Any, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        if event == "opcode":
            before = prev.get(id(frame))
            prev[id(frame)] = _ops(frame.f_code).get(frame.f_lasti, "")
            if before is None or before in ("CALL", "JUMP_BACKWARD"):
                point(frame)
        elif event == "return":
            prev.pop(id(frame), None)
        return local

    def glob(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code in _CODES:
            frame.f_trace_opcodes = True
            return local
        return None

    sys.settrace(glob)
    try:
        body()
        return False, None
    except SystemExit:
        return True, seen[1]
    finally:
        sys.settrace(None)


def _assert_free(lk: RegistryLock, seg: Segment) -> None:
    st = lk._st
    assert st.holder is None and st.depth == 0 and not st.dirty
    assert seg.sem is not None and seg.sem.value == 1, "the unit is lost or posted twice"
    assert lk._w[_OWNER] == 0
    # another thread gets it at once (not after lock_timeout)
    got: list[bool] = []

    def other() -> None:
        other_lock = RegistryLock(seg, timeout=0.5)
        try:
            with other_lock:
                got.append(seg.sem.value == 0)  # type: ignore[union-attr]
        except Exception:
            got.append(False)
    t = threading.Thread(target=other)
    t.start()
    t.join(5)
    assert got == [True]
    # the unwinding code's next hold is a real one: the semaphore taken, then given back once
    with lk:
        assert seg.sem.value == 0 and lk._w[_OWNER] == st.me
    assert seg.sem.value == 1 and st.holder is None


class _PastTwoToThe31:
    """The SemLock of a process past 2**31 acquires: its count (a C int that only grows) reads
    negative."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def _count(self) -> int:
        return self._real._count() - 2**32

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


@pytest.mark.parametrize("count", ["fresh", "past 2**31"])
@pytest.mark.parametrize("dirty", [False, True])
def test_an_exception_at_any_line_of_acquire_or_release_leaves_the_lock_free(
        seg: Segment, dirty: bool, count: str) -> None:
    repairs: list[int] = []
    lk = RegistryLock(seg, repair=lambda: repairs.append(1), timeout=0.5)
    if count != "fresh":
        assert lk._fast is not None
        lk._fast = _PastTwoToThe31(lk._fast)

    wrote = [False]

    def body() -> None:
        with lk:
            if dirty:
                lk.dirty = True
                wrote[0] = True
    at = 0
    while True:
        at += 1
        repairs.clear()
        wrote[0] = False
        raised, line = _interrupted(at, body)
        if not raised:
            break
        _assert_free(lk, seg)
        if wrote[0]:
            assert repairs, f"released without the repair owed (line {line})"
    assert at > 5
