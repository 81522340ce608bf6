"""Request-id validation (contract §4.1).

A valid request id is an ``int`` that is not a ``bool``, or a ``str`` of at most
:data:`MAX_ID_BYTES` UTF-8 bytes. Rows are keyed by ``str(id)``, so ``42`` and ``"42"`` name the
same request (JSON-RPC clients may send either). ``None`` means "no request" everywhere.

Two extra refusals keep every key storable, and are documented rather than surprising:

- an ``int`` whose decimal form is longer than :data:`MAX_ID_BYTES` digits (JSON can carry one,
  no client uses one) is invalid like an over-long ``str``;
- a ``str`` that is not encodable as UTF-8 (a lone surrogate, e.g. from ``"\\ud800"`` in JSON)
  is invalid: it could not be written to the table.

Subclasses are reduced to the base type's text (an ``IntEnum`` member keys as its number).
"""

from __future__ import annotations

from ..exceptions import InvalidRequestId

__all__ = ["MAX_ID_BYTES", "key", "require_key"]

MAX_ID_BYTES = 256
_INT_LO = -(10 ** (MAX_ID_BYTES - 1))  # exclusive bounds of ints of at most 256 characters
_INT_HI = 10**MAX_ID_BYTES


def key(request_id: object) -> str | None:
    """The row key text of a valid request id, or ``None`` when it is ``None`` or invalid.

    Never raises.
    """
    if type(request_id) is int:  # exact types first: the common case, no isinstance walks
        return int.__repr__(request_id) if _INT_LO < request_id < _INT_HI else None
    if type(request_id) is str:
        s = request_id
        if s.isascii():  # one byte per character
            return s if len(s) <= MAX_ID_BYTES else None
    elif isinstance(request_id, str):
        s = str.__str__(request_id)  # a str subclass keys as the plain text
    elif isinstance(request_id, bool):
        return None
    elif isinstance(request_id, int):
        return int.__repr__(request_id) if _INT_LO < request_id < _INT_HI else None
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
    k = key(request_id)
    if k is None:
        raise InvalidRequestId(
            "request id must be an int (not bool) or a str of at most "
            f"{MAX_ID_BYTES} UTF-8 bytes, got {_describe(request_id)}"
        )
    return k


def _describe(v: object) -> str:
    if isinstance(v, str):
        return f"a str of {len(v.encode('utf-8', 'surrogatepass'))} bytes"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"an int of {len(int.__repr__(int(v)))} digits"
    return type(v).__name__
