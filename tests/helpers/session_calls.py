"""What the tests of a 2025-wire call's session row share (``SessionStore.begin_call``): a small
registry (two sessions per client) and whether a session's row is in a process's lane."""

from __future__ import annotations

from shmcancel import Config
from shmcancel.shm.registry import Registry


def small_registry(shm_name: str, lock_timeout: float = 10.0) -> Registry:
    """A registry of 64 sessions, 2 per client (a third mint gives one up)."""
    return Registry.create(shm_name, Config(capacity=64, max_rows=64, in_flight_capacity=16,
                                            session_capacity=64, sessions_per_client=2,
                                            lock_timeout=lock_timeout))


def lane_row(reg: Registry, sid: str) -> bool:
    """A ``session_calls`` row of ``sid`` in some process's lane."""
    return reg.lanes["session_calls"].member(reg.table("session_calls").prepare(sid))
