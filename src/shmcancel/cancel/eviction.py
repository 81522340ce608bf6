"""The global-cap eviction order (contract §4.4), as a pure function of the rows.

When an insert finds the table at its cap, ``batch_size`` rows are removed first: every row is
ranked by ``(-rows_in_its_scope, cancelled_at, scope, request_id)`` ascending and the first
``batch`` go. So the largest scope loses its oldest rows first, then the next largest; scopes of
equal size tie and age decides (when every scope holds one row, the oldest rows go, whoever owns
them); ``scope`` and ``request_id`` only break exact ties, so the choice is deterministic. Scope
sizes are counted once, before any row goes. The batch is always full (``min(batch, rows)``), so
a lone writer pays for the full scan at most once per ``batch`` inserts.

A session's ``DELETE`` cancels every call in flight in it (contract §6.1), which §4.4's order
would defeat: each of its rows makes that scope the largest, so the next one evicts it before its
tool has seen it. Its inserts ``spare`` their scope: its rows rank after every other scope's
(the order otherwise the same), so they go only when nothing else is left.

This module knows nothing of storage: backends hand it the rows and delete what it picks. The
shared-memory backend ranks a lock-free read of the rows and deletes the batch in short holds,
re-validating each row under the lock (see ``ShmBackend.evict``): without concurrent writers the
batch is exactly this one; a row another writer clears or rewrites meanwhile is not the row that
was ranked and stays (the caller re-checks the cap and evicts again if still at it).
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable, Sequence

__all__ = ["batch_size", "choose", "rank"]

Row = tuple[str, str, float]  # (scope, request_id, cancelled_at)


def batch_size(max_rows: int | None, capacity: int) -> int:
    """Rows one eviction removes: ``max(1, max_rows // 20)``; with ``max_rows=None`` the cap
    is the physical ``capacity`` and the batch ``max(1, capacity // 20)``."""
    cap = capacity if max_rows is None else max_rows
    return max(1, cap // 20)


def rank(rows: Sequence[Row]) -> list[Row]:
    """All ``rows`` in eviction order (first evicted first)."""
    sizes = Counter(r[0] for r in rows)
    return sorted(rows, key=lambda r: (-sizes[r[0]], r[2], r[0], r[1]))


def choose(rows: Iterable[Row], batch: int, spare: str | None = None
           ) -> list[tuple[str, str]]:
    """The ``(scope, request_id)`` keys of the first ``batch`` rows in eviction order, the rows
    of scope ``spare`` (a ``DELETE``'s, see above) last."""
    rows = list(rows)
    if batch <= 0 or not rows:
        return []
    sizes = Counter(r[0] for r in rows)

    def order(r: Row) -> tuple[bool, int, float, str, str]:
        return (r[0] == spare, -sizes[r[0]], r[2], r[0], r[1])

    if batch >= len(rows):
        picked = sorted(rows, key=order)
    else:
        picked = heapq.nsmallest(batch, rows, key=order)
    return [(r[0], r[1]) for r in picked]
