"""A fake clock for the ``clock=`` a Cancellation or SessionStore takes (contract §4)."""

from __future__ import annotations


class Clock:
    """A seeded clock: ``clock()`` reads it, ``tick(dt)`` or ``clock.t += dt`` advances it."""

    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def tick(self, dt: float = 0.001) -> float:
        self.t += dt
        return self.t
