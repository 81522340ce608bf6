"""The in-flight rows of a registry as the tests read them: the shared ``in_flight`` table's and
the processes' lanes' (``shm/lanes.py``), where a handle's row usually is; and the scope counts
above 0 (a count that fell to 0 may keep its row, ``cancel/tables.py``)."""

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


def scope_counts(reg: Registry, *, zeros: bool = False) -> dict[bytes, int]:
    """``{scope digest: count}`` of the ``scope_counts`` rows holding more than 0 (``zeros``:
    of every row, those left at 0 too)."""
    t = reg.table("scope_counts")
    got = {k: t.word(k) or 0 for k, _ in t.scan()}
    return got if zeros else {k: n for k, n in got.items() if n}
