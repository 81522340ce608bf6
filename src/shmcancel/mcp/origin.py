"""The ``Origin`` check of the MCP transport: its defence against DNS rebinding (contract §6.0).

A browser page on ``http://evil.example`` whose name an attacker re-points at ``127.0.0.1`` can
POST to a server on loopback; the browser still sends ``Origin: http://evil.example``, so a server
that accepts only the origins it expects refuses the request (403). A request without ``Origin``
does not come from a browser page and passes.

An origin is compared as ``(scheme, host, port)`` after strict parsing of its serialised form
(RFC 6454 §6.2, as browsers send it): scheme and host are case-insensitive, an omitted port is
the scheme's default (``http`` 80, ``https`` 443), one trailing ``/`` is tolerated, IPv6
literals are bracketed and compared in canonical form (``[0:0::1]`` is ``[::1]``). Anything else
does not parse and is refused: a path, query, fragment or user-info, an empty or non-numeric
port, an unbracketed IPv6 literal, several origins in one header, ``null`` (what a sandboxed
frame or a ``file:`` page sends, which any page can produce). A host is matched whole, so
``http://localhost.evil.example`` is not ``localhost``.

:class:`OriginPolicy` holds the allowed patterns. A pattern is an origin, or an origin whose
port is ``*`` (any port, the scheme's default included): the default,
:data:`LOCALHOST_ORIGINS`, is ``http``/``https`` on ``localhost``, ``127.0.0.1`` and ``[::1]``,
any port. The policy ``"*"`` (:data:`ANY_ORIGIN`) allows every origin: the explicit opt-out for
deployments whose proxy checks ``Origin`` itself.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["ANY_ORIGIN", "LOCALHOST_ORIGINS", "Origin", "OriginPolicy", "parse_origin"]

#: ``allowed_origins`` value that turns the check off.
ANY_ORIGIN = "*"

#: What a server allows by default: loopback pages, any port.
LOCALHOST_ORIGINS: tuple[str, ...] = (
    "http://localhost:*", "https://localhost:*",
    "http://127.0.0.1:*", "https://127.0.0.1:*",
    "http://[::1]:*", "https://[::1]:*",
)

#: Longest ``Origin`` value parsed; longer ones are refused unread.
MAX_ORIGIN = 2048

_DEFAULT_PORTS = {"http": 80, "https": 443}
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*")
_LABEL = re.compile(r"(?!-)[A-Za-z0-9\-]{1,63}(?<!-)")
_PORT = re.compile(r"0|[1-9][0-9]{0,4}")
_IPV4 = re.compile(r"(0|[1-9][0-9]{0,2})(\.(0|[1-9][0-9]{0,2})){3}")


@dataclass(frozen=True, slots=True)
class Origin:
    """A parsed origin: lower-case ``scheme`` and ``host`` (an IPv6 literal in brackets, in
    canonical form), and ``port`` (the scheme's default filled in; ``None`` when the scheme has
    none and the origin named none)."""

    scheme: str
    host: str
    port: int | None


def _host(text: str) -> str | None:
    if text.startswith("["):
        if not text.endswith("]"):
            return None
        try:
            return f"[{ipaddress.IPv6Address(text[1:-1]).compressed}]"
        except ValueError:  # includes zone ids ("%eth0"), which browsers never send
            return None
    if _IPV4.fullmatch(text):
        return text if all(int(p) <= 255 for p in text.split(".")) else None
    labels = text.split(".")
    if len(text) > 253 or not all(_LABEL.fullmatch(label) for label in labels):
        return None
    if labels[-1].isdigit():  # "1.2.3" or "127.1": a numeric form browsers would canonicalise
        return None
    return text.lower()


def parse_origin(value: str, *, wildcard_port: bool = False) -> tuple[Origin, bool] | None:
    """Parse a serialised origin; ``None`` when it is not one.

    Returns the origin and whether its port was ``*`` (only accepted with ``wildcard_port``,
    for patterns).
    """
    if not isinstance(value, str) or len(value) > MAX_ORIGIN:
        return None
    scheme, sep, rest = value.partition("://")
    if not sep or not _SCHEME.fullmatch(scheme):
        return None
    if rest.endswith("/"):
        rest = rest[:-1]
    if not rest or any(c in rest for c in "/?#@\\ \t,") or not rest.isascii() \
            or not rest.isprintable():
        return None
    if rest.startswith("["):
        close = rest.find("]") + 1
        if close == 0:
            return None
    else:
        close = rest.find(":") if ":" in rest else len(rest)
    host_text, after = rest[:close], rest[close:]
    port_part: str | None = None
    if after:
        if not after.startswith(":"):
            return None
        port_part = after[1:]
    host = _host(host_text)
    if host is None:
        return None
    scheme = scheme.lower()
    default = _DEFAULT_PORTS.get(scheme)
    if port_part is None:
        return Origin(scheme, host, default), False
    if port_part == "*" and wildcard_port:
        return Origin(scheme, host, None), True
    if not _PORT.fullmatch(port_part) or int(port_part) > 65535:
        return None
    return Origin(scheme, host, int(port_part)), False


class OriginPolicy:
    """Which ``Origin`` header values a server accepts.

    ``allowed``: ``None`` for :data:`LOCALHOST_ORIGINS`; :data:`ANY_ORIGIN` (``"*"``) to accept
    every origin (the check is done elsewhere, e.g. in a proxy); else an iterable of origin
    patterns (``"https://app.example.com"``, ``"http://localhost:*"``), the complete list: add
    :data:`LOCALHOST_ORIGINS` to keep the defaults. An empty list refuses every browser
    request. Raises ``ValueError``/``TypeError`` for a pattern that is not an origin (with a
    path, ``null``, a bare string other than ``"*"``), so a typo fails at start-up, not as
    403s.
    """

    __slots__ = ("_any_port", "_exact", "allow_all", "patterns")

    def __init__(self, allowed: Iterable[str] | str | None = None) -> None:
        self.allow_all = allowed == ANY_ORIGIN
        self._exact: frozenset[Origin] = frozenset()
        self._any_port: frozenset[tuple[str, str]] = frozenset()
        self.patterns: tuple[str, ...] = ()
        if self.allow_all:
            return
        if allowed is None:
            allowed = LOCALHOST_ORIGINS
        elif isinstance(allowed, str | bytes):
            raise TypeError(f'allowed_origins must be a list of origins or "*", got {allowed!r}')
        exact: set[Origin] = set()
        any_port: set[tuple[str, str]] = set()
        patterns: list[str] = []
        for pattern in allowed:
            if not isinstance(pattern, str):
                raise TypeError(f"allowed_origins: {pattern!r} is not a str")
            if pattern == ANY_ORIGIN:
                raise ValueError('allowed_origins: "*" cannot be mixed with origins; pass '
                                 'allowed_origins="*" to turn the Origin check off')
            parsed = parse_origin(pattern, wildcard_port=True)
            if parsed is None:
                raise ValueError(f"allowed_origins: {pattern!r} is not an origin "
                                 '("scheme://host" or "scheme://host:port", port may be "*"; '
                                 '"null" cannot be allowed)')
            origin, wildcard = parsed
            if wildcard:
                any_port.add((origin.scheme, origin.host))
            else:
                exact.add(origin)
            patterns.append(pattern)
        self._exact = frozenset(exact)
        self._any_port = frozenset(any_port)
        self.patterns = tuple(patterns)

    def allows(self, header: str | None) -> bool:
        """Whether a request with this ``Origin`` header (``None`` when absent) may pass."""
        if header is None or self.allow_all:
            return True
        parsed = parse_origin(header)
        if parsed is None:
            return False
        origin = parsed[0]
        return origin in self._exact or (origin.scheme, origin.host) in self._any_port

    def __repr__(self) -> str:
        return "OriginPolicy('*')" if self.allow_all else f"OriginPolicy({list(self.patterns)!r})"
