"""Work on another thread of the test's process: a call whose ``result()`` joins it (bounded)
and returns or re-raises; the registry lock held for a ``with`` block."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any


class Background(threading.Thread):
    """``Background(fn).start()`` runs ``fn()``; ``done_at`` is when it finished (monotonic)."""

    def __init__(self, fn: Any) -> None:
        super().__init__(daemon=True)
        self.fn = fn
        self.value: Any = None
        self.error: BaseException | None = None
        self.done_at: float | None = None

    def run(self) -> None:
        try:
            self.value = self.fn()
        except BaseException as e:
            self.error = e
        self.done_at = time.monotonic()

    def result(self, timeout: float = 20.0) -> Any:
        self.join(timeout)
        assert not self.is_alive(), "request did not finish"
        if self.error is not None:
            raise self.error
        return self.value


@contextlib.contextmanager
def lock_held(reg: Any, *, hold_for: float = 30.0) -> Iterator[None]:
    """Hold ``reg.lock`` on another thread of this process for the ``with`` body (at most
    ``hold_for`` seconds); the body runs once the lock is held."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with reg.lock:
            held.set()
            release.wait(hold_for)

    t = threading.Thread(target=hold, daemon=True)
    t.start()
    try:
        assert held.wait(5), "could not take the registry lock"
        yield
    finally:
        release.set()
        t.join(10)
