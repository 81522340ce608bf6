"""A call run on a daemon thread; ``result()`` joins it (bounded) and returns or re-raises."""

from __future__ import annotations

import threading
import time
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
