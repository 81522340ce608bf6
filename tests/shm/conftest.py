"""Fixtures of the shared-memory layer's tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from helpers.table_rig import Rig

from shmcancel.shm.segment import Segment, TableSpec


@pytest.fixture
def seg(shm_name: str) -> Iterator[Segment]:
    """A bare segment (one table of one row) under this test's name: its lock, no registry."""
    s = Segment.create(shm_name, b"", [TableSpec("t", "set", 1, 64, 4096)], timeout=5)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def rig_factory(shm_name: str) -> Iterator[Callable[[list[tuple[str, int, int]]], Rig]]:
    """Makes this test's one :class:`Rig` (tables ``(kind, capacity, record_size)`` in a
    registry under its name); closed afterwards."""
    rigs: list[Rig] = []

    def make(specs: list[tuple[str, int, int]]) -> Rig:
        assert not rigs, "one rig per test (one shm_name)"
        rigs.append(Rig(shm_name, specs))
        return rigs[0]

    try:
        yield make
    finally:
        for r in rigs:
            r.close()
