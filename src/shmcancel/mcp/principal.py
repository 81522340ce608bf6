'''Who is calling: the authenticated principal and the client's address bucket (contract §3).

A cancellation row is keyed ``(scope, request_id)``. The scope names the caller, most specific
first (see :func:`scope`): ``"session:<id>"``, ``"principal:<id>"``, ``"ip:<bucket>"``, or
``"global"`` when there is no WSGI environ at all. The prefixes keep the namespaces apart: a
principal whose id is ``"203.0.113.9"`` shares neither rows nor quota with the anonymous client at
``203.0.113.9``.

Functions here read and write only these environ keys:

- ``"shmcancel.principal"``: a dict with at least ``"id"``, written by :func:`put` (by your auth
  middleware, before the MCP application runs);
- ``"shmcancel.session_id"``: the MCP session, written by the transport once it validated it;
- ``"REMOTE_ADDR"``: the client address, written by the server.

None of them raises on odd input: a malformed principal or address falls back to the next scope.

Scopes are at most :data:`MAX_SCOPE_BYTES` UTF-8 bytes. A longer session or principal id (or one
that UTF-8 cannot encode) is replaced by a fixed-length digest of it, keeping the
``"session:"``/``"principal:"`` prefix: ``"principal:~sha256:<64 hex digits>"``. It is never
truncated, which would merge distinct callers. An id that itself begins with ``"~sha256:"`` is
digested too, whatever its length, so that it never passes for the long id whose digest it spells.

Behind a reverse proxy
----------------------
Every client behind a proxy arrives from the proxy's address and so shares one ``ip:`` bucket
(and one quota). Authenticated callers are unaffected (their scope is their principal); for
anonymous callers, rewrite ``REMOTE_ADDR`` from the header **your own** proxy sets, and only when
the request really came from that proxy (anyone can send an ``X-Forwarded-For`` header)::

    import ipaddress

    class TrustedProxy:
        """WSGI middleware: take the client address from X-Forwarded-For when the direct peer
        is one of our proxies. With N proxies in a chain, trust the N-th entry from the right.
        "unix" in proxies: the peer on gunicorn's unix socket (REMOTE_ADDR "") is a proxy."""

        def __init__(self, app, proxies=("127.0.0.1/32",), hops=1):
            if hops < 1:  # hops=0 would take the leftmost entry: the client's own invention
                raise ValueError("hops counts the proxies in front of the app: at least 1")
            self.app = app
            self.unix = "unix" in proxies
            self.proxies = [ipaddress.ip_network(p) for p in proxies if p != "unix"]
            self.hops = hops

        def trusted(self, addr):
            if addr == "":
                return self.unix
            try:
                peer = ipaddress.ip_address(addr)
            except ValueError:
                return False
            if peer.version == 6 and peer.ipv4_mapped is not None:
                peer = peer.ipv4_mapped  # an IPv4 proxy seen on a dual-stack ("[::]") bind
            return any(peer in net for net in self.proxies)

        def __call__(self, environ, start_response):
            if self.trusted(environ.get("REMOTE_ADDR", "")):
                chain = [a.strip() for a in environ.get("HTTP_X_FORWARDED_FOR", "").split(",")]
                chain = [a for a in chain if a]
                if len(chain) >= self.hops:
                    environ["REMOTE_ADDR"] = chain[-self.hops]
            return self.app(environ, start_response)

    application = TrustedProxy(mcp_app, proxies=["10.0.0.0/8"])

(gunicorn's own ``forwarded_allow_ips`` setting only affects ``wsgi.url_scheme``; it does not
rewrite ``REMOTE_ADDR``.) On a dual-stack bind (``-b [::]:8000``) an IPv4 peer's ``REMOTE_ADDR``
is IPv4-mapped (``::ffff:10.1.2.3``): the middleware compares its IPv4 address with ``proxies``,
as :func:`client_bucket` buckets it. Behind a proxy that connects to a unix socket
(``-b unix:/run/app.sock``, nginx's ``proxy_pass http://unix:...``) gunicorn's ``REMOTE_ADDR``
is ``""``, no address to check: every anonymous client is ``ip:unknown`` until you trust that
peer with ``proxies=["unix"]`` (only what the socket file's permissions admit can connect). A
value the middleware writes that is not an address becomes the ``"unknown"`` bucket.
'''

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, MutableMapping
from typing import Any

__all__ = [
    "MAX_SCOPE_BYTES",
    "PRINCIPAL_KEY",
    "REMOTE_ADDR_KEY",
    "SESSION_KEY",
    "client_bucket",
    "id",
    "normalize",
    "put",
    "scope",
]

PRINCIPAL_KEY = "shmcancel.principal"
SESSION_KEY = "shmcancel.session_id"
REMOTE_ADDR_KEY = "REMOTE_ADDR"
MAX_SCOPE_BYTES = 512
UNKNOWN = "unknown"
GLOBAL = "global"
PRINCIPAL_PREFIX = "principal:"  # of a principal's scope (the others: "session:", "ip:")

_MAX_DEPTH = 8  # how deep {"id": {"id": ...}} nesting is followed by normalize()


def normalize(p: object, _depth: int = 0) -> str | None:
    """The principal id ``p`` stands for: a ``str`` is itself; an ``int`` (not ``bool``) its
    decimal text; a mapping its ``"id"`` when not ``None``, else its ``"sub"``, each normalised by
    these same rules; anything else (``None``, ``True``, ``False``, floats, lists) no id."""
    if isinstance(p, str):
        return str.__str__(p)
    if isinstance(p, bool):
        return None
    if isinstance(p, int):
        try:
            # the value, whatever a subclass's __int__ says or raises (as ids.key reads ids)
            return int.__repr__(int.__int__(p))
        except ValueError:  # more digits than sys.get_int_max_str_digits()
            return None
    if isinstance(p, Mapping) and _depth < _MAX_DEPTH:
        try:
            v = p.get("id")
            if v is None:
                v = p.get("sub")
        except Exception:
            return None
        return normalize(v, _depth + 1)
    return None


def put(environ: MutableMapping[str, Any], p: object) -> MutableMapping[str, Any]:
    """Record the authenticated principal ``p`` in ``environ`` and return ``environ``.

    Stores ``{"id": normalize(p), ...}`` under ``"shmcancel.principal"``: for a mapping, a copy of
    it with ``"id"`` replaced by the normalised id (other claims kept); otherwise just the id.
    """
    if isinstance(p, Mapping):
        try:
            stored = dict(p)
        except Exception:
            stored = {}
    else:
        stored = {}
    stored["id"] = normalize(p)
    environ[PRINCIPAL_KEY] = stored
    return environ


def id(environ: object) -> str | None:
    """The stored principal id when it is a ``str``; otherwise (no principal, a principal dict
    stored without :func:`put` whose id is ``123`` or a dict, a non-mapping environ) ``None``."""
    try:
        if type(environ) is not dict and not isinstance(environ, Mapping):
            return None
        p = environ.get(PRINCIPAL_KEY)
        if p is None or (type(p) is not dict and not isinstance(p, Mapping)):
            return None
        v = p.get("id")
    except Exception:
        return None
    return str.__str__(v) if isinstance(v, str) else None


def client_bucket(environ: object) -> str:
    """The client's address bucket from ``REMOTE_ADDR``.

    IPv4 → the dotted address (``"203.0.113.9"``); IPv4-mapped IPv6 (``"::ffff:203.0.113.9"``)
    → the IPv4 address; any other IPv6 → its /64 in compressed form (``"2001:db8:1:2::/64"``),
    because a host is routinely handed a whole /64 and could rotate addresses to multiply its
    quota; missing or malformed → ``"unknown"``.
    """
    try:
        if type(environ) is not dict and not isinstance(environ, Mapping):
            return UNKNOWN
        addr = environ.get(REMOTE_ADDR_KEY)
    except Exception:
        return UNKNOWN
    if not isinstance(addr, str):
        return UNKNOWN
    addr = str.__str__(addr)  # a str subclass is its text (its own __hash__ is not called)
    b = _buckets.get(addr)
    if b is None:
        b = _bucket(addr)
        if len(_buckets) >= _BUCKET_CACHE:
            _buckets.clear()
        _buckets[addr] = b
    return b


# address -> bucket: parsing costs microseconds and a poll without a handle needs the scope.
_buckets: dict[str, str] = {}
_ip_scopes: dict[str, str] = {}  # address -> "ip:" + its bucket
_BUCKET_CACHE = 4096


def _bucket(addr: str) -> str:
    if not addr or len(addr) > 100:
        return UNKNOWN
    if addr.startswith("[") and addr.endswith("]"):
        addr = addr[1:-1]
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        return UNKNOWN
    if ip.version == 4:
        return str(ip)
    mapped = ip.ipv4_mapped
    if mapped is not None:
        return str(mapped)
    packed = int(ip) >> 64 << 64
    return str(ipaddress.IPv6Network((packed, 64)))


_DIGEST_TAG = "~sha256:"


def _prefixed(prefix: str, ident: str) -> str:
    """``prefix + ident``, or ``prefix + "~sha256:" + digest`` when that would exceed
    :data:`MAX_SCOPE_BYTES` bytes, is not encodable, or ``ident`` itself begins with
    ``"~sha256:"``: kept as itself, such an id would be the scope of the long id whose digest
    it spells. So an id kept whole never begins with the tag, and a digest scope is only ever
    a digest: distinct ids get distinct scopes."""
    s = prefix + ident
    try:
        if len(s.encode("utf-8")) <= MAX_SCOPE_BYTES and not ident.startswith(_DIGEST_TAG):
            return s
        raw = ident.encode("utf-8")
    except UnicodeEncodeError:
        raw = ident.encode("utf-8", "surrogatepass")
    import hashlib  # here: hashlib loads OpenSSL's libcrypto, and only a long name needs it

    return prefix + _DIGEST_TAG + hashlib.sha256(raw).hexdigest()


def of_principal(scope: str) -> bool:
    """Whether ``scope`` (as :func:`scope` gives it) is a principal's."""
    return scope.startswith(PRINCIPAL_PREFIX)


def scope(environ: object) -> str:
    """The caller's scope: session, then principal, then address bucket; ``"global"`` when
    ``environ`` is not a mapping (contract §3). Never raises."""
    if type(environ) is dict:
        try:
            # a key of the dict that is a str subclass whose == raises makes these raise: then
            # the keys are read below, one by one, each that cannot be read counting as absent
            plain = SESSION_KEY not in environ and PRINCIPAL_KEY not in environ
            addr = environ.get(REMOTE_ADDR_KEY) if plain else None
        except Exception:
            addr = None
        if type(addr) is str:
            # the common anonymous poll: the address bucket's scope, cached per address
            sc = _ip_scopes.get(addr)
            if sc is None:
                sc = "ip:" + client_bucket(environ)
                if len(_ip_scopes) >= _BUCKET_CACHE:
                    _ip_scopes.clear()
                _ip_scopes[addr] = sc
            return sc
    if type(environ) is not dict and not isinstance(environ, Mapping):
        return GLOBAL
    try:
        sid = environ.get(SESSION_KEY)
    except Exception:
        sid = None
    # the type first: the truth of a value that is not a str may raise (a numpy array's does)
    if isinstance(sid, str) and str.__len__(sid):
        return _prefixed("session:", str.__str__(sid))
    pid = id(environ)
    if pid is not None:
        return _prefixed(PRINCIPAL_PREFIX, pid)
    return "ip:" + client_bucket(environ)
