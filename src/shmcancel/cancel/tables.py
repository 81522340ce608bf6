"""The cancellation layer's tables, declared to the shared-memory layer on import (see
:mod:`shmcancel.shm.schema`); :mod:`shmcancel.cancel.shm_storage` reaches them by these names.

Keys and values as msgpack packs them:

- ``cancellations`` (set, ``config.effective_max_rows`` rows: the cap evicts before an insert
  passes it, contract §4.4): ``(scope, request_id)`` -> ``(reason | None, cancelled_at)``;
- ``in_flight`` (bag, ``config.in_flight_capacity``): ``(scope, request_id)`` ->
  ``(pid, start, thread_ident, token)``;
- ``scope_counts`` (set, ``effective_max_rows`` + :func:`zero_counts_kept`): 16-byte keyed digest
  of a scope -> None; the count is the row's word (``shm/layout.py``), changed in place by one
  store instead of a fresh record per change. A scope holding rows has a row; one whose count
  fell to 0 keeps it (its next cancel is then one store, not an insert and a delete per
  cancel-and-clear) while the table holds at most :func:`zero_counts_kept` rows, so rows at 0
  never number more than that and a scope holding rows always finds room. Sweeps remove them.

Record sizes come from the worst-case packed sizes of those shapes (``KEY_*``/``VAL_*``; tests
pack the worst cases). ``cancellations`` and ``in_flight`` keep small records for the common row
(``SMALL_*``), the ones a scan reads, and a worst-case record for every row besides
(``LARGE_*``): the contract promises its row counts whatever the rows' sizes (§2 ``capacity``,
§4.2's whole reason, §4.4's cap, §4.5's ``in_flight_capacity``), so no valid row is ever
refused, cut or evicted for its size. That costs memory only where a bound lets it: a default
registry reserves ~16 MB of worst-case records, ``max_rows`` brings it down in proportion.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any

from ..shm.schema import (
    EVERY_ROW,
    PACKED_FLOAT,
    PACKED_INT,
    PACKED_NIL,
    TableDecl,
    declare,
    packed_bin,
    packed_str,
)
from .ids import MAX_KEY_BYTES
from .reasons import MAX_REASON_BYTES

__all__ = ["CANCELLATIONS", "IN_FLIGHT", "SCOPE_COUNTS", "TABLES", "zero_counts_kept"]

CANCELLATIONS = "cancellations"
IN_FLIGHT = "in_flight"
SCOPE_COUNTS = "scope_counts"

SCOPE_MAX = 512  # UTF-8 bytes (contract §3)
SCOPE_DIGEST = 16  # bytes
KEY_REQUEST = 1 + packed_str(SCOPE_MAX) + packed_str(MAX_KEY_BYTES)  # [scope, id] = 839
VAL_CANCEL = 1 + packed_str(MAX_REASON_BYTES) + PACKED_FLOAT  # [reason, cancelled_at] = 813
VAL_OWNER = 1 + 4 * PACKED_INT  # [pid, start, thread_ident, token] = 37
KEY_SCOPE_COUNT = packed_bin(SCOPE_DIGEST)  # 18
VAL_SCOPE_COUNT = PACKED_NIL  # the count is the word


# Small records (bytes, header included), sized for the common row measured from the transport:
# ids of 1-36 characters (a UUID), scopes of a minted session id (32), a principal or "global",
# reasons None or a short text. A cancellation's 192 hold 168 packed bytes: a [32-char scope,
# 36-char id] key (71) with a reason of <= 85 bytes (<= 117 with an int id); an in-flight row's
# 224 hold 200: a key of <= 163 bytes (a 125-character scope with a UUID) with its owner (<= 37).
SMALL_CANCELLATION = 192
SMALL_IN_FLIGHT = 224
# Large rows each table holds: every row (a count past the capacity is the capacity).
LARGE_CANCELLATIONS = LARGE_IN_FLIGHT = EVERY_ROW




_MAX_ROWS = attrgetter("effective_max_rows")
_IN_FLIGHT = attrgetter("in_flight_capacity")


def zero_counts_kept(config: Any) -> int:
    """The most ``scope_counts`` rows a count falling to 0 leaves in place (a quarter of
    ``effective_max_rows``, at least 1): the table's room beyond one row per cancellation."""
    return max(1, config.effective_max_rows // 4)


def _counts_capacity(config: Any) -> int:
    return config.effective_max_rows + zero_counts_kept(config)

TABLES = (
    TableDecl(CANCELLATIONS, "set", _MAX_ROWS, KEY_REQUEST, VAL_CANCEL, SMALL_CANCELLATION,
              LARGE_CANCELLATIONS),
    TableDecl(IN_FLIGHT, "bag", _IN_FLIGHT, KEY_REQUEST, VAL_OWNER, SMALL_IN_FLIGHT,
              LARGE_IN_FLIGHT, lanes=True),
    TableDecl(SCOPE_COUNTS, "set", _counts_capacity, KEY_SCOPE_COUNT, VAL_SCOPE_COUNT),
)
declare(*TABLES)
