"""The storage interface of the cancellation layer: what its policy needs of a store.

Implementations: :class:`~shmcancel.cancel.shm_storage.ShmBackend` (one host's shared memory)
and :class:`~shmcancel.redis.storage.RedisStorage` (several hosts sharing one Redis).

The policy (id validation, reasons, telemetry, when the janitor runs, the owed ends) lives in
:mod:`shmcancel.cancel.policy`; the eviction order in :mod:`shmcancel.cancel.eviction`. A store
keeps rows and its per-scope counts true, and runs each multi-step rule of contract §4 as one
operation: every method below is atomic by itself (no caller ever groups several), so a
backend without a lock a client can hold (Redis: one Lua script per rule) implements it.

Rows
----
- cancellation: key ``(scope, request_id)`` (both ``str``; ``request_id`` is already ``str(id)``),
  value ``(reason: str | None, cancelled_at: float)``; one row per key.
- in-flight: key ``(scope, request_id)``, value an :data:`Owner`
  ``(pid, start_time, thread_ident, token)``; several rows per key (one per running request).
- per-scope counts of cancellation rows (the quota check reads one number, never a scan).
"""

from __future__ import annotations

from collections.abc import Callable, Container
from typing import Protocol, runtime_checkable

from ..config import Config

__all__ = ["Owner", "Poll", "Storage", "bad_clock"]


def bad_clock(at: object) -> ValueError:
    """The error for a ``clock()`` value a row cannot be stamped with: every row's time is a
    finite number (eviction sorts by it, cleanup subtracts it). Stores check ``at - at``,
    which is ``0`` only for a finite number."""
    return ValueError(f"clock() returned {at!r:.80}: a cancellation is stamped with a finite "
                      f"number of seconds")


def clock_seconds(at: object) -> float:
    """A ``clock()`` value that is not already a finite ``float`` (callers test that inline,
    the common case), as the float a row is stamped with: an ``int`` (not a ``bool``) or a
    ``float`` subclass converted; anything else, or a value not finite as a float, raises
    :func:`bad_clock`'s error. Every stamp stays a float (contract §4.3): a bool or a huge int
    stored as such would sort, print and encode unlike the others."""
    if isinstance(at, bool) or not isinstance(at, int | float):
        raise bad_clock(at)
    try:
        f = float(at)
    except OverflowError:
        raise bad_clock(at) from None
    if f - f:  # NaN or an infinity
        raise bad_clock(at)
    return f

#: Who runs an in-flight request: ``(pid, start_time, thread_ident, token)``. ``token`` tells
#: apart two requests of one thread (0 for plain ``track``; unique per ``RequestHandle``).
Owner = tuple[int, int, int, int]


class Poll(Protocol):
    """A cached lookup of one key: ``member()`` answers the question it was made for now."""

    def member(self) -> bool: ...


@runtime_checkable
class Storage(Protocol):
    """What :class:`~shmcancel.cancel.policy.Cancellation` needs of a store.

    Each method is one atomic step against every other process and host using the store;
    reads never block on writers. Optional capability: ``watch_in_flight(scope, rid) -> Poll``
    (a cached local poll of :meth:`in_flight`; without it the policy calls ``in_flight``).
    Errors: :class:`~shmcancel.LockTimeout` (or the backend's own) when the store does not
    answer in time; nothing is half-written by one.
    """

    #: The limits and timings the policy applies (shared by every process using the store).
    config: Config

    # --- cancellation rows
    def record(self, scope: str, rid: str, reason: str | None, clock: Callable[[], float], *,
               quota: int | None, cap: int, batch: int, only_in_flight: bool,
               spare: bool = False) -> bool:
        """Record a cancellation, contract §4.3 as one step: (when ``only_in_flight``) the key
        is in flight, else ``False`` and nothing written → an existing row is overwritten in
        place (reason and time) → a new row: the scope holds ``quota`` rows already →
        :class:`~shmcancel.CancellationLimitReached`, nothing written; the store holds ``cap``
        rows → evict ``batch`` rows in contract §4.4's order → insert. ``clock()`` is read
        after the in-flight check, in the step that writes (so a row recorded for a running
        request is never older than that request's begin); a value that is not a finite number
        raises :func:`bad_clock`'s ``ValueError`` before anything is written or evicted.
        ``spare``: the eviction takes ``scope``'s own rows last (a session's ``DELETE``: its
        pass must not evict the rows it wrote, :mod:`.eviction`). Returns ``True`` when a row
        was written."""
    def get(self, scope: str, rid: str) -> tuple[str | None, float] | None:
        """The row's ``(reason, cancelled_at)``, or ``None``."""
    def exists(self, scope: str, rid: str) -> bool:
        """Whether the row exists (lock-free; the cheapest read of the store)."""
    def watch(self, scope: str, rid: str) -> Poll:
        """A poll of whether the row exists (on shared memory a few loads; on a remote store
        it may cost a round trip per ``member()``)."""
    def scope_rows(self, scope: str) -> int:
        """Rows counted for ``scope``: never below its true rows."""
    def scope_has_rows(self, scope: str) -> bool:
        """``scope_rows(scope) > 0``, as cheaply as the store can (a request's end asks)."""
    def rows(self) -> int: ...
    def clear(self, scope: str, rid: str) -> bool:
        """Remove one row (and its count); True when one went."""
    def clear_before(self, scope: str, rid: str, before: float) -> bool:
        """Remove the row only if its ``cancelled_at < before`` (checked in the same step, so
        a newer row written meanwhile stays)."""
    def expire(self, now: float, ttl: float) -> int:
        """Remove rows with ``now - cancelled_at > ttl``; repair drifted scope counts. May run
        as several steps (each atomic), so a sweep never holds the store for long."""
    def cancellations(self) -> list[tuple[str, str, str | None, float]]:
        """Every row ``(scope, rid, reason, at)``: a snapshot for inspection and tests."""

    # --- in-flight rows
    def track(self, scope: str, rid: str, owner: Owner) -> object:
        """Add a row; when full, drop dead owners' rows and retry; ``TableFull`` if still full.
        Returns a receipt for :meth:`untrack` (opaque; ``None`` when the store keeps none). A
        store whose plain rows (token 0) are one per call, the same thread's again included,
        says so with a true ``track_rows_per_call`` attribute; without it a thread's plain
        rows of one key are one row (Redis's)."""
    def untrack(self, scope: str, rid: str, owner: Owner, receipt: object = None) -> bool:
        """Remove the row of ``owner``; ``receipt`` (what :meth:`track` returned, or ``None``)
        may let the store find it at once."""
    def untrack_thread(self, scope: str, rid: str, pid: int, start: int, tid: int) -> bool:
        """Remove one row of this thread for the key (a token-0 row first)."""
    def end(self, scope: str, rid: str, owner: Owner | None, ended_at: float) -> None:
        """A request's end as one step (an owed end landing late, at ``ended_at``, the store's
        clock): untrack ``owner``, then clear the key's row from before ``ended_at``
        (:func:`clear_ended`); ``owner`` ``None``: an owed plain clear, asked then."""
    def in_flight(self, scope: str, rid: str) -> bool: ...
    def in_flight_ids(self, scope: str) -> list[str]:
        """Ids in flight in ``scope`` (a snapshot; callers gate each again in ``record``)."""
    def reap(self, pid: int | None = None) -> int:
        """Remove in-flight rows whose owner process is gone (only ``pid``'s, when given)."""
    def reap_ended(self, pid: int, start: int, running: Container[int]) -> int:
        """Remove the rows of the live process ``(pid, start)`` whose token (non-zero) is not
        in ``running``: requests it no longer runs, whose end was lost. ``running`` is read
        again inside the removing step (a token enters it before its row is written)."""

    # --- janitor
    def claim_sweep(self, now: float, interval: float) -> bool:
        """True for one caller per ``interval`` seconds across every process of the store."""


def clear_ended(st: Storage, scope: str, rid: str, asked_at: float | None = None,
                plain: bool = False) -> None:
    """The clear after an untrack: the key's row goes, unless a namesake (same scope and id,
    another request) is still in flight. At a request's end the row then stays, whenever it
    was recorded: one recorded while both ran is the namesake's as much as this request's
    (§6.1: in flight in the caller's scope, so cancelled; taking it here left the namesake's
    cancellation to which of them polled first), one older than the namesake is not the
    namesake's (a row older than a request is not its own) but may be another's still
    running, and stays too; the last of them to end clears it. What every end runs: a
    handle's, an owed one's (:meth:`Storage.end`).

    Landing late (``asked_at``: when the end, or an owed ``plain`` clear, was asked) it takes
    only a row from before then, as it would have then: a cancellation recorded since is a
    later one's, and stays. A late plain clear does so with a namesake in flight too."""
    if asked_at is None:
        # the row first: usually there is none, and then no in-flight read is needed
        if st.exists(scope, rid) and not st.in_flight(scope, rid):
            st.clear(scope, rid)
    elif plain or not st.in_flight(scope, rid):
        st.clear_before(scope, rid, asked_at)
