"""Fixtures of the shared-memory layer's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from shmcancel.shm.segment import Segment, TableSpec


@pytest.fixture
def seg(shm_name: str) -> Iterator[Segment]:
    """A bare segment (one table of one row) under this test's name: its lock, no registry."""
    s = Segment.create(shm_name, b"", [TableSpec("t", "set", 1, 64, 4096)], timeout=5)
    try:
        yield s
    finally:
        s.close()
