"""Sanitising of cancellation reasons (contract §4.2).

A reason is client text shown to operators (``shmtool dump``) and handed to telemetry handlers,
so it is made inert and short, in exactly this order:

1. ``None`` stays ``None``; anything that is not a ``str`` becomes its ``repr``;
2. the text is clamped to :data:`MAX_REASON_BYTES` UTF-8 bytes, never leaving a broken character
   (lone surrogates, which UTF-8 cannot carry, first become U+FFFD);
3. the characters U+0000–U+001F, U+007F–U+009F, U+061C, U+200B–U+200F, U+2028–U+202E, U+2060,
   U+2066–U+2069 and U+FEFF are removed (C0/C1 controls including tab, CR and LF; bidi and
   zero-width marks that can disguise text);
4. the result is cut to at most :data:`MAX_REASON_CHARS` characters.
"""

from __future__ import annotations

import re

__all__ = ["MAX_REASON_BYTES", "MAX_REASON_CHARS", "STRIPPED", "sanitize"]

MAX_REASON_BYTES = 800
MAX_REASON_CHARS = 200

_RANGES = (
    (0x00, 0x1F), (0x7F, 0x9F), (0x061C, 0x061C), (0x200B, 0x200F), (0x2028, 0x202E),
    (0x2060, 0x2060), (0x2066, 0x2069), (0xFEFF, 0xFEFF),
)
#: Every code point step 3 removes.
STRIPPED: frozenset[int] = frozenset(c for lo, hi in _RANGES for c in range(lo, hi + 1))
_STRIP_TABLE = dict.fromkeys(STRIPPED)
_SURROGATE = re.compile("[\ud800-\udfff]")


def sanitize(reason: object) -> str | None:
    """The stored form of ``reason``. Never raises (a ``repr`` that raises is replaced by the
    type's default ``repr``)."""
    if reason is None:
        return None
    if type(reason) is str and reason.isascii() and reason.isprintable():
        # The common case, exactly what the steps below give: printable ASCII has no
        # surrogate, one byte per character, and none of the removed code points (the ASCII
        # ones, U+0000-U+001F and U+007F, are not printable).
        return reason[:MAX_REASON_CHARS]
    if isinstance(reason, str):
        text = str.__str__(reason)
    else:
        try:
            text = repr(reason)
            if not isinstance(text, str):
                raise TypeError
        except Exception:
            text = object.__repr__(reason)
    # A str holds at most 4 bytes per character: anything past 800 characters is past 800 bytes.
    text = text[:MAX_REASON_BYTES]
    text = _SURROGATE.sub("\ufffd", text)
    raw = text.encode("utf-8")
    if len(raw) > MAX_REASON_BYTES:
        text = raw[:MAX_REASON_BYTES].decode("utf-8", "ignore")
    return text.translate(_STRIP_TABLE)[:MAX_REASON_CHARS]
