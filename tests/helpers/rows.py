"""The in-flight rows of a registry as the tests read them: the shared ``in_flight`` table's and
the processes' lanes' (``shm/lanes.py``), where a handle's row usually is."""

from __future__ import annotations

from typing import Any

from shmcancel.cancel.shm_storage import ShmBackend
from shmcancel.shm.registry import Registry


def in_flight_rows(reg: Registry | Any) -> list[tuple[Any, Any]]:
    """``(key, owner)`` of every in-flight row, table and lanes (a lock-free snapshot). Given a
    view of another store that mimics a registry's tables (the Redis tests'), its rows."""
    if not isinstance(reg, Registry):
        return list(reg.table("in_flight").scan())
    return ShmBackend(reg).in_flight_rows()


def in_flight_count(reg: Registry | Any) -> int:
    if not isinstance(reg, Registry):
        return int(reg.table("in_flight").count())
    return len(in_flight_rows(reg))
