"""Request-id validation (contract §4.1).

A valid request id is an ``int`` that is not a ``bool``, or a ``str`` of at most
:data:`MAX_ID_BYTES` UTF-8 bytes. Rows are keyed by ``str(id)``, so ``42`` and ``"42"`` name the
same request (JSON-RPC clients may send either). ``None`` means "no request" everywhere.

An ``int`` of more than :data:`MAX_ID_BYTES` characters (JSON can carry one; Python cannot even
print one past 4 300 digits) is keyed by a text of its own, longer than any valid ``str`` id so
never one's key: ``int:``, its sign and leading hex digits, its size in bits and a 256-bit digest
of its value (:data:`MAX_KEY_BYTES` bytes at most).

A ``str`` that is not encodable as UTF-8 (a lone surrogate, e.g. from ``"\\ud800"`` in JSON) is
invalid: it could not be written to the table.

Subclasses are reduced to the base type's text (an ``IntEnum`` member keys as its number).
"""

from __future__ import annotations

import re

from ..exceptions import InvalidRequestId
from ..shm.hashing import blake2b

__all__ = ["MAX_ID_BYTES", "MAX_KEY_BYTES", "key", "require_key", "require_row_key"]

MAX_ID_BYTES = 256
MAX_KEY_BYTES = 320  # the longest key text of a valid id: a long int's (_long_int_key)
_INT_LO = -(10 ** (MAX_ID_BYTES - 1))  # exclusive bounds of ints of at most 256 characters
_INT_HI = 10**MAX_ID_BYTES
_LEAD_HEX = 192  # leading hex digits a long int's key shows
# a long int's key, as _long_int_key writes it
_LONG_INT_KEY = re.compile(
    rf"int:-?0x[0-9a-f]{{2,{_LEAD_HEX}}}\.\.\.\([0-9]+ bits\)#[0-9a-f]{{64}}")


def _long_int_key(n: int) -> str:
    """The key of an int of more than ``MAX_ID_BYTES`` characters: over ``MAX_ID_BYTES``
    bytes (so no valid ``str`` id has it), at most ``MAX_KEY_BYTES``, the same for equal
    values, and a 256-bit digest apart for different ones. Costs O(size of n)."""
    m = -n if n < 0 else n
    raw = m.to_bytes((m.bit_length() + 7) // 8, "big")
    digest = blake2b(raw, digest_size=32, person=b"shmcancel-int" if n >= 0
                     else b"shmcancel-neg").hexdigest()
    return (f"int:{'-' if n < 0 else ''}0x{raw[:_LEAD_HEX // 2].hex()}..."
            f"({m.bit_length()} bits)#{digest}")


def key(request_id: object) -> str | None:
    """The row key text of a valid request id, or ``None`` when it is ``None`` or invalid.

    Never raises.
    """
    if type(request_id) is int:  # exact types first: the common case, no isinstance walks
        if _INT_LO < request_id < _INT_HI:
            return repr(request_id)  # an exact int: its own repr, no slot lookup
        return _long_int_key(request_id)
    if type(request_id) is str:
        s = request_id
        if s.isascii():  # one byte per character
            return s if len(s) <= MAX_ID_BYTES else None
    elif isinstance(request_id, str):
        s = str.__str__(request_id)  # a str subclass keys as the plain text
    elif isinstance(request_id, bool):
        return None
    elif isinstance(request_id, int):
        n = int.__int__(request_id)  # the value, whatever the subclass overrides
        return int.__repr__(n) if _INT_LO < n < _INT_HI else _long_int_key(n)
    else:
        return None
    if len(s) > MAX_ID_BYTES:
        # at least one byte per character: longer than 256 characters cannot fit
        return None
    try:
        n = len(s.encode("utf-8"))
    except UnicodeEncodeError:
        return None
    return s if n <= MAX_ID_BYTES else None


def require_key(request_id: object) -> str:
    """Like :func:`key`, but raise :class:`InvalidRequestId` for anything but a valid id.

    ``None`` is not handled here: callers treat it as a no-op before asking.
    """
    if type(request_id) is int and _INT_LO < request_id < _INT_HI:  # key()'s first case
        return repr(request_id)
    k = key(request_id)
    if k is None:
        raise InvalidRequestId(
            "request id must be an int (not bool) or a str of at most "
            f"{MAX_ID_BYTES} UTF-8 bytes, got {_describe(request_id)}"
        )
    return k


def require_row_key(text: object) -> str:
    """``text`` when it is the row key of some valid id (what :func:`key` returns: a valid
    ``str`` id's own text, or a long int's key), else raise :class:`InvalidRequestId`. For keys
    handed back by a store or another host, which :func:`require_key` would refuse for a long
    int (its key is longer than any valid ``str`` id)."""
    if type(text) is str:
        if key(text) == text:
            return text
        if len(text) <= MAX_KEY_BYTES and _LONG_INT_KEY.fullmatch(text):
            return text
    raise InvalidRequestId(f"not the row key of a valid request id: {_describe(text)}")


def _describe(v: object) -> str:
    if isinstance(v, str):
        try:
            return f"a str of {len(v.encode('utf-8'))} bytes"
        except UnicodeEncodeError as e:  # a lone surrogate: no UTF-8 at all, whatever its size
            return f"a str that is not valid UTF-8 (a lone surrogate at index {e.start})"
    return type(v).__name__
