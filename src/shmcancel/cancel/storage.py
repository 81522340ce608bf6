"""The storage interface of the cancellation layer: what its policy needs of a store.

The shared-memory implementation is :mod:`shmcancel.cancel.shm_storage`.

The policy (id validation, the order of checks in ``cancel``, telemetry, when the janitor runs)
lives in :mod:`shmcancel.cancel.policy`; the eviction order in :mod:`shmcancel.cancel.eviction`.
A backend only stores rows and keeps its per-scope counts true. A second backend (Redis, for
deployments that outgrow one host) implements :class:`Storage` and runs the same tests.

Rows
----
- cancellation: key ``(scope, request_id)`` (both ``str``; ``request_id`` is already ``str(id)``),
  value ``(reason: str | None, cancelled_at: float)``; one row per key.
- in-flight: key ``(scope, request_id)``, value an :data:`Owner`
  ``(pid, start_time, thread_ident, token)``; several rows per key (one per running request).
- per-scope counts of cancellation rows, so the quota check reads one row instead of scanning.

Consistency of the counts: writers change a count and its rows inside one :meth:`Storage.atomic`
section, the count first on insert and last on delete. A writer killed in between leaves the
count one *too high*, which only makes that scope's quota stricter, never looser;
:meth:`Storage.expire` (run by every cleanup) recounts from the rows and repairs any drift.
"""

from __future__ import annotations

import contextlib
from collections.abc import Container
from typing import Any, Protocol, runtime_checkable

from ..config import Config

__all__ = ["Owner", "Poll", "Storage"]

#: Who runs an in-flight request: ``(pid, start_time, thread_ident, token)``. ``token`` tells
#: apart two requests of one thread (0 for plain ``track``; unique per ``RequestHandle``).
Owner = tuple[int, int, int, int]


class Poll(Protocol):
    """A cached lookup of one cancellation key (see ``table.Watch``)."""

    def member(self) -> bool: ...


@runtime_checkable
class Storage(Protocol):
    """What :class:`~shmcancel.cancellation.Cancellation` needs of a store.

    Reads (``exists``, ``get``, ``watch``, ``rows``, ``scope_rows``, ``in_flight``, ...) never
    block on writers. Every write is atomic by itself; :meth:`atomic` groups several into one
    step (it is reentrant), which ``cancel`` uses for check-then-insert.
    """

    #: The limits and timings the policy applies (shared by every process using the store).
    config: Config
    #: Physical cancellation rows the store can hold.
    capacity: int

    def atomic(self) -> contextlib.AbstractContextManager[Any]: ...

    # --- cancellation rows
    def exists(self, scope: str, rid: str) -> bool: ...
    def get(self, scope: str, rid: str) -> tuple[str | None, float] | None: ...
    def watch(self, scope: str, rid: str) -> Poll: ...
    def rows(self) -> int: ...
    def scope_rows(self, scope: str) -> int: ...
    def put(self, scope: str, rid: str, reason: str | None, at: float) -> bool:
        """Insert or overwrite; True when the row is new (it then counts for its scope)."""
    def evict(self, batch: int) -> int:
        """Remove ``min(batch, rows)`` rows in :mod:`~shmcancel.cancel.eviction` order; the
        count."""
    def clear(self, scope: str, rid: str) -> bool:
        """Remove one row; reads first and takes no lock when there is none."""
    def clear_before(self, scope: str, rid: str, before: float) -> bool:
        """Remove the row only if its ``cancelled_at < before`` (checked under the lock, so a
        newer row written meanwhile stays); reads first and takes no lock when there is none."""
    def expire(self, now: float, ttl: float) -> int:
        """Remove rows with ``now - cancelled_at > ttl``; repair the scope counts."""
    def cancellations(self) -> list[tuple[str, str, str | None, float]]: ...

    # --- in-flight rows
    def track(self, scope: str, rid: str, owner: Owner) -> None:
        """Add a row; when full, drop dead owners' rows and retry; ``TableFull`` if still full."""
    def untrack(self, scope: str, rid: str, owner: Owner) -> bool: ...
    def untrack_thread(self, scope: str, rid: str, pid: int, start: int, tid: int) -> bool:
        """Remove one row of this thread for the key (a token-0 row first)."""
    def in_flight(self, scope: str, rid: str) -> bool: ...
    def in_flight_ids(self, scope: str) -> list[str]: ...
    def reap(self, pid: int | None = None) -> int:
        """Remove in-flight rows whose owner process is gone (only ``pid``'s, when given)."""
    def reap_ended(self, pid: int, start: int, running: Container[int]) -> int:
        """Remove the rows of the live process ``(pid, start)`` whose token (non-zero) is not
        in ``running``: requests it no longer runs, whose end was lost. Scans without the
        lock and takes it only when there is something to remove."""

    # --- janitor
    def claim_sweep(self, now: float, interval: float) -> bool: ...
