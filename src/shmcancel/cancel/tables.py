"""The cancellation layer's tables, declared to the shared-memory layer on import (see
:mod:`shmcancel.shm.schema`); :mod:`shmcancel.cancel.shm_storage` reaches them by these names.

Keys and values as msgpack packs them:

- ``cancellations`` (set, ``config.capacity`` rows): ``(scope, request_id)`` ->
  ``(reason | None, cancelled_at)``;
- ``in_flight`` (bag, ``config.in_flight_capacity``): ``(scope, request_id)`` ->
  ``(pid, start, thread_ident, token)``;
- ``scope_counts`` (set, ``config.capacity``): 16-byte keyed digest of a scope -> int.

Record sizes come from the worst-case packed sizes of those shapes (``KEY_*``/``VAL_*``; tests
pack the worst cases).
"""

from __future__ import annotations

from ..config import Config
from ..shm.schema import PACKED_FLOAT, PACKED_INT, TableDecl, declare, packed_bin, packed_str
from .ids import MAX_ID_BYTES
from .reasons import MAX_REASON_BYTES

__all__ = ["CANCELLATIONS", "IN_FLIGHT", "SCOPE_COUNTS", "TABLES"]

CANCELLATIONS = "cancellations"
IN_FLIGHT = "in_flight"
SCOPE_COUNTS = "scope_counts"

SCOPE_MAX = 512  # UTF-8 bytes (contract §3)
SCOPE_DIGEST = 16  # bytes
KEY_REQUEST = 1 + packed_str(SCOPE_MAX) + packed_str(MAX_ID_BYTES)  # [scope, id] = 775
VAL_CANCEL = 1 + packed_str(MAX_REASON_BYTES) + PACKED_FLOAT  # [reason, cancelled_at] = 813
VAL_OWNER = 1 + 4 * PACKED_INT  # [pid, start, thread_ident, token] = 37
KEY_SCOPE_COUNT = packed_bin(SCOPE_DIGEST)  # 18
VAL_SCOPE_COUNT = PACKED_INT


def _capacity(config: Config) -> int:
    assert config.capacity is not None  # Config resolves None
    return config.capacity


def _in_flight_capacity(config: Config) -> int:
    return config.in_flight_capacity


TABLES = (
    TableDecl(CANCELLATIONS, "set", _capacity, KEY_REQUEST, VAL_CANCEL),
    TableDecl(IN_FLIGHT, "bag", _in_flight_capacity, KEY_REQUEST, VAL_OWNER),
    TableDecl(SCOPE_COUNTS, "set", _capacity, KEY_SCOPE_COUNT, VAL_SCOPE_COUNT),
)
declare(*TABLES)
