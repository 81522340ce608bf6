"""Shared fixtures. Every shared-memory name a test uses comes from ``shm_name`` so that it is
unique per test and unlinked afterwards, pass or fail."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator

import posix_ipc
import pytest

SHM_DIR = "/dev/shm"
# Names a registry NAME occupies (SPEC §2: derived from the name). Kept in one place here so a
# test run can clean up even when the library under test is broken.
SEGMENT_PREFIX = "shmcancel."
LOCKFILE_PREFIX = "shmcancel-lock."
TEST_PREFIX = f"t{os.getpid()}-"


def unlink_registry_names(name: str) -> None:
    """Remove the segment, semaphore and lock file of registry ``name``; missing ones are fine."""
    for unlink in (posix_ipc.unlink_shared_memory, posix_ipc.unlink_semaphore):
        with contextlib.suppress(posix_ipc.ExistentialError):
            unlink("/" + SEGMENT_PREFIX + name)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(SHM_DIR, LOCKFILE_PREFIX + name))


def leftovers(name: str) -> list[str]:
    """What is left in /dev/shm of registry ``name`` (its names and any ``~`` temporaries)."""
    return sorted(f for f in os.listdir(SHM_DIR) if f.endswith(name) or name + "~" in f)


@contextlib.contextmanager
def _registry_name() -> Iterator[str]:
    """A fresh registry name of this run; everything under it is unlinked on leaving."""
    name = TEST_PREFIX + uuid.uuid4().hex[:12]
    try:
        yield name
    finally:
        unlink_registry_names(name)


@pytest.fixture
def shm_name() -> Iterator[str]:
    """A registry name unique to this test; everything under it is unlinked afterwards."""
    with _registry_name() as name:
        yield name


@pytest.fixture(scope="module")
def module_shm_name() -> Iterator[str]:
    """Like ``shm_name``, for a module-scoped resource (a gunicorn serving a whole module)."""
    with _registry_name() as name:
        yield name


@pytest.fixture
def shm_names() -> Iterator[list[str]]:
    """A list to which a test appends extra registry names it makes; all unlinked afterwards."""
    names: list[str] = []
    try:
        yield names
    finally:
        for name in names:
            unlink_registry_names(name)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail loudly if this run left anything of its own in /dev/shm."""
    try:
        left = [f for f in os.listdir(SHM_DIR) if TEST_PREFIX in f]
    except OSError:
        return
    if left:
        for f in left:
            name = f.split(TEST_PREFIX, 1)[1]
            unlink_registry_names(TEST_PREFIX + name)
        print(f"\nshmcancel tests left {len(left)} file(s) in {SHM_DIR}: {sorted(left)[:10]}")
        session.exitstatus = 1


@pytest.fixture(scope="session")
def redis_server() -> Iterator[object]:
    """A real redis-server for the whole run (loopback, free port, no persistence), stopped
    by pid at the end; tests keep apart by key prefix (``redis_prefix``)."""
    from redis_server import running
    with running() as srv:
        yield srv


@pytest.fixture
def redis_prefix() -> str:
    """A key prefix unique to this test."""
    from redis_server import unique_prefix
    return unique_prefix()
