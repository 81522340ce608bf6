"""The MCP sessions' tables, declared to the shared-memory layer on import (see
:mod:`shmcancel.shm.schema`); :mod:`shmcancel.mcp.sessions` reaches them by these names.

Keys and values as msgpack packs them:

- ``sessions`` (set, ``config.session_capacity`` rows): ``session_id`` -> a value of at most
  ``SESSION_VALUE_MAX`` packed bytes;
- ``session_clients`` (set, ``config.session_capacity``): 16-byte client digest -> the ids of
  that client's sessions (at most ``config.sessions_per_client`` minted ids: the record grows
  with it);
- ``session_calls`` (bag, ``config.in_flight_capacity``, with lanes): ``session_id`` -> ``(pid,
  start, thread_ident, token)`` of each ``tools/call`` running in that session; in the writing
  process's lane when it has room (no lock), else in the table.

``sessions`` and ``session_clients`` keep a small record for the common row and a worst-case one
for every row, whose memory is allocated only when a row needs it (``shm/layout.py``): every
row may be large, so only a full table refuses a session (``SessionsFull``).
"""

from __future__ import annotations

from operator import attrgetter

from ..config import Config
from ..shm.schema import EVERY_ROW, PACKED_INT, TableDecl, declare, packed_bin, packed_str

__all__ = ["SESSIONS", "SESSION_CALLS", "SESSION_CLIENTS", "TABLES"]

SESSIONS = "sessions"
SESSION_CLIENTS = "session_clients"
SESSION_CALLS = "session_calls"

SESSION_ID_MAX = 128  # UTF-8 bytes (an Mcp-Session-Id: 1-128 visible ASCII characters)
SESSION_VALUE_MAX = 512  # packed bytes
MINTED_ID_LEN = 32  # characters of a minted session id (secrets.token_urlsafe(24))
CLIENT_DIGEST = 16  # bytes
KEY_SESSION = packed_str(SESSION_ID_MAX)  # str8 = 130
KEY_CLIENT = packed_bin(CLIENT_DIGEST)  # bin8 = 18
VAL_CALL = 1 + 4 * PACKED_INT  # [pid, start, thread_ident, token] = 37
# Small records (bytes, header included): a session's value is ~50 packed bytes; a client's
# list holds up to 8 minted ids in 320 (24 + 18 + fixarray 1 + 8 x 34). Large rows: any row
# (their pages are allocated as they come, so this costs no memory until then).
SMALL_SESSION = 160
SMALL_CLIENT = 320
LARGE_SESSIONS = LARGE_CLIENTS = EVERY_ROW


def val_session_clients(config: Config) -> int:
    """[id, ...] of ``sessions_per_client`` minted ids: array16 3 + n x str8 (2 + 32)."""
    n = config.sessions_per_client
    assert n is not None  # Config resolves None
    return 3 + n * packed_str(MINTED_ID_LEN)




_SESSIONS = attrgetter("session_capacity")

TABLES = (
    TableDecl(SESSIONS, "set", _SESSIONS, KEY_SESSION, SESSION_VALUE_MAX, SMALL_SESSION,
              LARGE_SESSIONS),
    TableDecl(SESSION_CLIENTS, "set", _SESSIONS, KEY_CLIENT, val_session_clients,
              SMALL_CLIENT, LARGE_CLIENTS),
    TableDecl(SESSION_CALLS, "bag", attrgetter("in_flight_capacity"), KEY_SESSION, VAL_CALL,
              lanes=True),
)
declare(*TABLES)
