"""The names a registry occupies in /dev/shm, kept here (not taken from the library) so a test
run can clean up even when the library under test is broken."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator

import posix_ipc

SHM_DIR = "/dev/shm"
# Names a registry NAME occupies (contract §2: derived from the name). Kept in one place here so a
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
def fresh_registry_name() -> Iterator[str]:
    """A fresh registry name of this run; everything under it is unlinked on leaving."""
    name = TEST_PREFIX + uuid.uuid4().hex[:12]
    try:
        yield name
    finally:
        unlink_registry_names(name)
