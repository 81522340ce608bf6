"""Owed request ends (``shmcancel.cancel.owed``) under a test's control."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from shmcancel.cancel import owed


@contextlib.contextmanager
def as_if_a_janitor_listened() -> Iterator[None]:
    """A listener on owed ends, as a running janitor is: no lander thread starts, so an end
    stays owed until the test's own calls land it (a lander lands it on its own schedule)."""
    def janitor() -> None:
        pass
    owed.listeners.add(janitor)
    try:
        yield
    finally:
        owed.listeners.discard(janitor)
