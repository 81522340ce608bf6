"""Acting at an exact bytecode of a table write: the opcodes the table's modules run while a
write is in progress are counted (an opcode tracer), and the k-th calls ``act`` (a SIGKILL of
this process, an exception), so a test can stop a writer between any two of its stores."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from shmcancel.shm.table import Table

# The table's code is split over several modules (one per concern): trace all of them.
TABLE_FILES = frozenset(
    sys.modules[c.__module__].__file__ for c in Table.__mro__ if c is not object)


def at_bytecode(lock: Any, k: int, act: Callable[[], None], every: bool = False) -> list[int]:
    """Trace the table modules' opcodes run while ``lock.dirty`` (``every``: all of those run
    under the lock) and call ``act()`` at the k-th (k = 0: only count them). Returns the
    counter (its one item). The trace stays on: the caller ends it (``sys.settrace(None)``)."""
    seen = [0]

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "opcode" and (lock.dirty or (every and lock.held_by_me())):
            seen[0] += 1
            if seen[0] == k:
                act()
        return local

    def glob(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename in TABLE_FILES:
            frame.f_trace_opcodes = True
            return local
        return None

    sys.settrace(glob)
    return seen
