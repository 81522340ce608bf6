"""Cancellation rows, in-flight owners and sessions in Redis, with contract §4's rules run in Lua.

Every multi-key rule (quota, global-cap eviction in contract §4.4 order, in-flight gating, TTL
expiry, the end of a request) is one Lua script (``*.lua`` beside this module, each prefixed
with ``common.lua``), loaded once per connection pool and called by SHA; a ``NOSCRIPT`` answer
(Redis restarted or flushed its script cache) loads it again and retries once. No rule is ever a
read-then-write from the client.

Keys (``prefix`` default ``"shmcancel:"``; see ``common.lua`` for the full table) are named by
SHA-1 of the scope and request id, so client-chosen text never shapes a key, and every per-scope
key is hash-tagged ``{sha1(scope)}``: on Redis Cluster one scope's rows, quota and in-flight
owners live in one slot. The global cap needs ``{g}:all`` and the rows it evicts in one script:
it is exact on a single Redis (or Valkey) server; on a cluster the cancel script would touch
several slots, which Cluster refuses, so run the cross-host layer on one primary (with replicas
for failover) — the load is a few small writes per tool call.

Times: ``cancelled_at`` is the policy clock's float seconds, stored unrounded (a Redis score is
a double, written with 17 significant digits). Leases and deadlines are Redis-side milliseconds
of the *client's* wall clock: hosts are assumed NTP-synchronised to well under a lease.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import struct
import sys
import time
from collections.abc import Sequence
from importlib import resources
from typing import Any

import msgpack

from ..config import Config

__all__ = ["BOX_MAX", "GONE_TTL", "Damaged", "RedisStore", "wrong_type"]

_SCRIPTS = ("cancel", "clear", "track", "untrack", "renew", "expire", "session",
            "session_delete", "claim", "keep", "stopped", "take", "session_mend")
#: Milliseconds Redis may be restoring after a loss (:meth:`RedisStore.set_restoring`) at the
#: bridge's defaults: a lease (10 s), a renewal period (1 s) and a retry (0.5 s).
RESTORING_MS = 11_500
_EXPIRE_LIMIT = 500  # rows per expire call: bounds the time one script holds Redis
#: Items a worker's box keeps, the newest (``common.lua``'s ``BOX_MAX``): a box its worker does
#: not read (its registry lock stalled) grew with every cancellation repeated for one call.
BOX_MAX = 4096
#: Seconds a deleted session (or one its client's bound gave up) is remembered (at most its
#: TTL): a holder that had not heard of its end (its renewal raced it, or Redis had lost the
#: session with its holders' boxes and the holder stores it again after the outage) is refused
#: its store and ends its copy.
GONE_TTL = 300.0
#: Milliseconds a box stays in the live index (``{g}:live``) after its last renewal
#: (``common.lua``'s ``LIVE_KEPT_MS``): older ones are not told, and are pruned.
LIVE_KEPT_MS = 600_000


def _b(s: str) -> bytes:
    return s.encode("utf-8", "surrogatepass")


def _sha(s: str) -> str:
    return hashlib.sha1(_b(s)).hexdigest()


def encode_reason(reason: str | None) -> bytes:
    return b"" if reason is None else b"=" + _b(reason)


def decode_reason(raw: bytes) -> str | None:
    return None if not raw else raw[1:].decode("utf-8", "surrogatepass")


def wrong_type(e: BaseException) -> bool:
    """Redis answered ``WRONGTYPE``: a key of ours holds what another client wrote."""
    from redis.exceptions import ResponseError
    return isinstance(e, ResponseError) and str(e).startswith("WRONGTYPE")


def _or_empty(fn: Any, *a: Any, empty: Any) -> Any:
    """``fn(*a)``, or ``empty`` when Redis answered ``WRONGTYPE``: a key of ours another client
    wrote over holds nothing of ours (the next script touching it deletes it: ``mend``)."""
    from redis.exceptions import ResponseError
    try:
        return fn(*a)
    except ResponseError as e:
        if not wrong_type(e):
            raise
        return empty


class Damaged:
    """A session's copy in Redis that no host can adopt (another client wrote over it: another
    type, or bytes that are not ``[version, client]``); ``seen``: what was read (None for
    another type), for :meth:`RedisStore.mend_session`."""

    __slots__ = ("seen",)

    def __init__(self, seen: bytes | None) -> None:
        self.seen = seen


def _ordered(x: float) -> int:
    """An int that orders finite floats as they compare (-0.0 just below 0.0)."""
    (i,) = struct.unpack("<q", struct.pack("<d", x))
    return i if i >= 0 else -(i & 0x7FFF_FFFF_FFFF_FFFF) - 1


def _unordered(i: int) -> float:
    bits = i if i >= 0 else (-(i + 1)) | -0x8000_0000_0000_0000
    return float(struct.unpack("<d", struct.pack("<q", bits))[0])


def last_expired(now: float, ttl: float) -> float | None:
    """The greatest finite ``at`` with ``now - at > ttl`` as floats compare (contract §4.6's
    formula: every row at or below it is older than ``ttl``, since ``now - at`` never grows
    with ``at``), ``math.inf`` when every finite one is; None when none is."""
    def old(at: float) -> bool:
        return now - at > ttl

    lo, hi = _ordered(-sys.float_info.max), _ordered(sys.float_info.max)
    if not old(_unordered(lo)):
        return None
    if old(_unordered(hi)):
        return math.inf
    while hi - lo > 1:  # old(lo) and not old(hi)
        mid = (lo + hi) // 2
        if old(_unordered(mid)):
            lo = mid
        else:
            hi = mid
    return _unordered(lo)


class RedisStore:
    """The Redis side of the cross-host layer over one ``redis.Redis`` client (its socket
    timeouts bound every call). Thread-safe as the client is. ``config`` supplies the limits
    (``max_rows``, ``capacity``, ``max_rows_per_scope``, ``ttl``, sessions)."""

    def __init__(self, client: Any, config: Config, *, prefix: str = "shmcancel:") -> None:
        if not isinstance(prefix, str) or "{" in prefix or "}" in prefix:
            raise ValueError(f"prefix must be a str without braces, got {prefix!r}")
        self.client = client
        self.config = config
        self.prefix = prefix
        self._all = _b(prefix + "{g}:all")
        self._scopes = _b(prefix + "{g}:scopes")
        self._pend = _b(prefix + "{g}:pend")
        self._stopped = _b(prefix + "{g}:stopped")
        self._live = _b(prefix + "{g}:live")
        self._restoring = _b(prefix + "{g}:restoring")
        common = resources.files(__package__).joinpath("common.lua").read_text()
        self._src = {n: common + resources.files(__package__).joinpath(f"{n}.lua").read_text()
                     for n in _SCRIPTS}
        self._sha = {n: hashlib.sha1(src.encode()).hexdigest() for n, src in self._src.items()}
        cap = config.capacity if config.max_rows is None else config.max_rows
        self.cap = int(cap or 10_000)
        self.batch = max(1, self.cap // 20)
        self.quota = -1 if config.max_rows_per_scope is None else int(config.max_rows_per_scope)
        #: Pending cancellations a scope keeps, at most (``cancel``).
        self.pending_max = self.quota if self.quota >= 0 else 256
        #: Pending cancellations all scopes keep, at most: the row cap (a client opens scopes).
        self.pending_cap = self.cap

    # ------------------------------------------------------------------ plumbing

    def call(self, name: str, keys: list[bytes], args: list[Any]) -> Any:
        """Run script ``name`` by SHA; load it on ``NOSCRIPT`` and retry once."""
        from redis.exceptions import NoScriptError
        try:
            return self.client.evalsha(self._sha[name], len(keys), *keys, *args)
        except NoScriptError:
            self.client.script_load(self._src[name])
            return self.client.evalsha(self._sha[name], len(keys), *keys, *args)

    def _skeys(self, scope: str) -> tuple[bytes, bytes]:
        base = f"{self.prefix}{{{_sha(scope)}}}:"
        return _b(base + "c"), _b(base + "t")

    def ifs_key(self, scope: str) -> bytes:
        """The set of request ids in flight in ``scope`` (on any host; pruned as they end)."""
        return _b(f"{self.prefix}{{{_sha(scope)}}}:ifs")

    def pc_key(self, scope: str) -> bytes:
        """The scope's pending cancellations (``cancel.lua``, ``track.lua``)."""
        return _b(f"{self.prefix}{{{_sha(scope)}}}:pc")

    def if_key(self, scope: str, rid: str) -> bytes:
        return _b(f"{self.prefix}{{{_sha(scope)}}}:if:{_sha(rid)}")

    def _row_keys(self, scope: str) -> list[bytes]:
        c, t = self._skeys(scope)
        return [c, t, self._all, self._scopes]

    # ------------------------------------------------------------------ cancellation rows

    def cancel(self, scope: str, rid: str, reason: str | None, at: float, *, gate: bool,
               now_ms: int, box_lease_ms: int, limits: tuple[int, int, int] | None = None,
               pending_ms: int = 0, spare: bool = False) -> tuple[int, int]:
        """Record a cancellation (contract §4.3 order: quota, then cap eviction, then insert).
        Returns ``(status, evicted)``: status 0 not in flight (gated), -1 quota refused, 1
        inserted, 2 overwritten. Gated: the cancellation goes to each running worker's box; with
        ``pending_ms``, one that finds nothing in flight waits that long (milliseconds; at most
        :attr:`pending_max` per scope and :attr:`pending_cap` in all) for a row of a request
        started by ``at`` that its host adds back (:meth:`track`). ``limits``: ``(quota (-1:
        none), cap, batch)``, default this store's. ``spare``: the eviction takes ``scope``'s
        own rows last (a session's ``DELETE``)."""
        quota, cap, batch = limits if limits is not None else (self.quota, self.cap, self.batch)
        keys = [*self._row_keys(scope), self.if_key(scope, rid), self.pc_key(scope), self._pend]
        r = self.call("cancel", keys, [self.prefix, _b(scope), _b(rid), encode_reason(reason),
                                       repr(float(at)), quota, cap, batch,
                                       "1" if gate else "0", now_ms, box_lease_ms,
                                       max(0, int(pending_ms)), self.pending_max,
                                       self.pending_cap, "1" if spare else "0"])
        return int(r[0]), int(r[1]) if len(r) > 1 else 0

    def get(self, scope: str, rid: str) -> tuple[str | None, float] | None:
        c, t = self._skeys(scope)
        p = self.client.pipeline(transaction=False)
        p.hget(c, _b(rid))
        p.zscore(t, _b(rid))
        raw, at = p.execute(raise_on_error=False)
        for got in (raw, at):
            if isinstance(got, Exception) and not wrong_type(got):
                raise got
        if raw is None or at is None or isinstance(raw, Exception) or isinstance(at, Exception):
            return None
        return decode_reason(raw), float(at)

    def clear(self, scope: str, rid: str, before: float | None = None) -> bool:
        return bool(self.call("clear", self._row_keys(scope),
                              [self.prefix, _b(scope), _b(rid),
                               "" if before is None else repr(float(before))]))

    def rows(self) -> int:
        return int(_or_empty(self.client.zcard, self._all, empty=0))

    def scope_rows(self, scope: str) -> int:
        return int(_or_empty(self.client.hlen, self._skeys(scope)[0], empty=0))

    def cancellations(self) -> list[tuple[str, str, str | None, float]]:
        """Every row ``(scope, rid, reason, at)`` (a scan: for tests and tools)."""
        out = []
        for m, at in _or_empty(
                lambda: self.client.zrange(self._all, 0, -1, withscores=True), empty=[]):
            n, _, rest = bytes(m).partition(b":")
            if not n.isdigit() or int(n) > len(rest):
                continue  # not a row's member (written by another client)
            scope = rest[:int(n)].decode("utf-8", "surrogatepass")
            rid = rest[int(n):].decode("utf-8", "surrogatepass")
            got = self.get(scope, rid)
            out.append((scope, rid, None if got is None else got[0], float(at)))
        return out

    def expire(self, now: float, ttl: float) -> int:
        """Remove rows with ``now - cancelled_at > ttl`` (that float comparison, as contract
        §4.6 and the shared-memory table make it: ``cancelled_at < now - ttl`` rounds otherwise),
        in bounded script calls."""
        last = last_expired(now, ttl)
        if last is None:
            return 0
        total = 0
        for _ in range(10_000):
            n, looked = self.call("expire", [self._all, self._scopes],
                                  [self.prefix, "+inf" if last == math.inf else repr(last),
                                   _EXPIRE_LIMIT])
            total += int(n)
            if int(looked) < _EXPIRE_LIMIT:  # members naming no row count too: see expire.lua
                break
        return total

    def exists(self, scope: str, rid: str) -> bool:
        return bool(_or_empty(self.client.hexists, self._skeys(scope)[0], _b(rid), empty=0))

    def claim_sweep(self, now: float, interval: float) -> bool:
        """True for one caller per ``interval`` seconds across every host (the first claim one
        interval after the first call)."""
        return bool(self.call("claim", [_b(self.prefix + "{g}:sweep")],
                              [repr(float(now)), repr(float(interval))]))

    # ------------------------------------------------------------------ in-flight owners

    def track(self, scope: str, rid: str, owner: bytes, *, deadline_ms: int, now_ms: int,
              started_at: float) -> bool:
        """Add ``owner``'s row of a request started at ``started_at`` (the policy clock's
        seconds; a row added back keeps its request's start). True when a pending cancellation
        sent since then was recorded and delivered to the owner's box."""
        return int(self.call("track", [self.if_key(scope, rid), *self._row_keys(scope),
                                       self.ifs_key(scope), self.pc_key(scope), self._pend],
                             [self.prefix, _b(scope), _b(rid), owner, deadline_ms, now_ms,
                              repr(float(started_at)), self.quota, self.cap,
                              self.batch])) == 2

    def untrack(self, scope: str, rid: str, owner: bytes, *, now_ms: int,
                before: float | None = None) -> bool:
        return bool(self.call("untrack", [self.if_key(scope, rid), *self._row_keys(scope),
                                          self.ifs_key(scope)],
                              [self.prefix, _b(scope), _b(rid), owner, now_ms,
                               "" if before is None else repr(float(before))]))

    def in_flight_ids(self, scope: str) -> list[str]:
        """Request ids that were in flight in ``scope`` (a snapshot; may hold ids whose lease
        just ran out: callers gate each one again). A member that is not such text (another
        client's write) names no request: skipped, never raised (a session's ``DELETE`` reads
        this)."""
        out = []
        for m in _or_empty(self.client.smembers, self.ifs_key(scope), empty=set()):
            try:
                out.append(bytes(m).decode("utf-8", "surrogatepass"))
            except UnicodeDecodeError:
                continue
        return out

    def in_flight(self, scope: str, rid: str, *, now_ms: int) -> bool:
        return bool(_or_empty(self.client.zcount, self.if_key(scope, rid), now_ms, "+inf",
                              empty=0))

    def renew(self, entries: list[tuple[bytes, bytes]], deadline_ms: int, *,
              now_ms: int) -> list[int]:
        """Extend the leases of ``(if_key, owner)`` entries; the 0-based indexes missing, or
        whose lease ran out before ``now_ms`` (to add again with :meth:`track`)."""
        if not entries:
            return []
        r = self.call("renew", [k for k, _ in entries],
                      [deadline_ms, now_ms, *(o for _, o in entries)])
        return [int(i) - 1 for i in r]

    # ------------------------------------------------------------------ boxes

    def box_key(self, box: str) -> bytes:
        return _b(f"{self.prefix}box:{box}")

    def take(self, box: bytes, taken: bytes, lease_ms: int) -> bytes | None:
        """Move the oldest item of ``box`` to ``taken`` (leased ``lease_ms``); None when empty."""
        got: bytes | None = self.call("take", [box, taken], [lease_ms])
        return got

    def alive_key(self, box: str) -> bytes:
        """A key ``box``'s reader keeps set (a lease's TTL): found missing while Redis answers,
        Redis lost data meanwhile (``FLUSHALL``, an eviction, a restart between two looks)."""
        return _b(f"{self.prefix}alive:{box}")

    def taken_key(self, box: str) -> bytes:
        """The list of items moved out of ``box`` by its reader and not yet applied (see
        ``bridge.py``: a reply lost to a timeout leaves the item there, not nowhere)."""
        return _b(f"{self.prefix}taken:{box}")

    @staticmethod
    def decode_box_item(raw: bytes) -> (tuple[str, str, str | None, float | None]
                                        | tuple[str, str] | str | None):
        """``(scope, rid, reason, at)`` of a cancellation (``at``: its ``cancelled_at``; None
        from a writer that sent none, or not a finite number), the id of a deleted session (a
        str), ``("store", sid)`` for a session whose copy in Redis was lost to another client's
        write (:meth:`mend_session`: its holder stores it again), or None when malformed."""
        try:
            v = msgpack.unpackb(raw, raw=True)
            # only byte strings: bytes(n) of an int would allocate n bytes (a hostile writer)
            if type(v) is not list or not all(type(x) is bytes for x in v):
                return None
            if len(v) == 2 and v[0] == b"d":
                return v[1].decode("ascii")
            if len(v) == 2 and v[0] == b"p":
                return "store", v[1].decode("ascii")
            scope, rid, reason, *rest = v
            at: float | None = None
            if len(rest) == 1 and len(rest[0]) <= 32:
                at = float(rest[0])
                if at - at:  # NaN or an infinity
                    at = None
            elif rest:
                return None
            return (scope.decode("utf-8", "surrogatepass"), rid.decode("utf-8", "surrogatepass"),
                    decode_reason(reason), at)
        except Exception:
            return None

    # ------------------------------------------------------------------ sessions

    def _sess_key(self, sid: str) -> bytes:
        return _b(f"{self.prefix}sess:{sid}")

    def _client_key(self, client: str) -> bytes:
        """The set of a client's sessions (``session.lua``'s per-client bound)."""
        return _b(f"{self.prefix}{{cl:{_sha(client)}}}:s")

    def put_session(self, sid: str, version: str, client: str, *, now_ms: int,
                    box: str, box_lease_ms: int, seen_ms: int | None = None,
                    alive: bytes | None = None, restoring_ms: int = RESTORING_MS,
                    others: Sequence[tuple[str, int]] = ()) -> list[str] | None:
        """Store (or refresh) a session that worker ``box`` holds locally (it is told when
        another host deletes it). None when it was deleted within :data:`GONE_TTL` seconds
        (not stored: the caller's copy is of a session ended elsewhere); else the ids of the
        client's sessions given up for its ``sessions_per_client`` bound (its oldest without a
        call in flight), ended as by :meth:`delete_session`: every holder's box but ``box`` told
        (``box_lease_ms``: a box's lease), a later store of one refused. The caller ends its
        host's copies of those. The client's sessions are ordered by their last use (ms), here
        ``seen_ms`` (``now_ms`` when None), never moved back. None is given up while Redis may
        be restoring (:meth:`set_restoring`), which this store starts for ``restoring_ms`` when
        ``alive`` (the storing worker's :meth:`alive_key`, once its bridge set it) is gone.
        ``others``: ``(sid, last use in ms)`` of the client's other sessions the caller holds
        (at most ``sessions_per_client`` are sent), moved on to that use before any is given
        up: a use moves a session's place only at its renewals (at most every
        :data:`~shmcancel.redis.bridge.KEEP_EVERY` seconds per process), which the caller's
        own table knows better."""
        cl = self._client_key(client)
        per_client = int(self.config.sessions_per_client or 32)
        value = msgpack.packb([version, client])
        key = self._sess_key(sid)
        got = self.call("session",
                        [key, cl, key + b":boxes", key + b":gone", self._stopped,
                         b"" if alive is None else alive, self._restoring],
                        [self.prefix, _b(sid), value, int(self.config.session_ttl * 1000),
                         per_client, now_ms, _b(box), box_lease_ms, self._gone_ms(),
                         now_ms if seen_ms is None else seen_ms, restoring_ms,
                         *itertools.chain.from_iterable(
                             (_b(o), int(ms)) for o, ms in others[:per_client])])
        if not isinstance(got, list):
            return None
        return [bytes(old).decode("utf-8", "surrogatepass") for old in got[1:]]

    def set_restoring(self, ms: int) -> None:
        """Redis lost data: for ``ms`` milliseconds no session store gives up any of a client's
        sessions for its bound (``session.lua``): the workers store their in-flight rows and
        sessions again each on its own schedule, a busy session's perhaps before its row."""
        self.client.set(self._restoring, b"1", px=ms)

    def get_session(self, sid: str) -> tuple[str, str] | None:
        """``(version, client)`` of a stored session; None when there is none (a key of
        another type, another client's, holds none either)."""
        got = self.get_session_and_alive(sid, None)[0]
        return None if isinstance(got, Damaged) else got

    def get_session_and_alive(self, sid: str, alive: bytes | None
                              ) -> tuple[tuple[str, str] | Damaged | None, bool, bool]:
        """:meth:`get_session` (but :class:`Damaged` for a copy no host can adopt), whether
        the key ``alive`` (an :meth:`alive_key`) exists (``True`` when ``alive`` is None), and
        whether the session's damaged copy was deleted lately and its holders may not have
        stored it again yet (:meth:`mend_session`), all read in one round trip."""
        from redis.exceptions import ResponseError
        key = self._sess_key(sid)
        p = self.client.pipeline(transaction=False)
        p.get(key)
        p.exists(key + b":mending")
        if alive is not None:
            p.exists(alive)
        got = p.execute(raise_on_error=False)
        raw, mending = got[0], got[1]
        if isinstance(mending, Exception):
            if not wrong_type(mending):
                raise mending
            mending = 0  # another client's key there: nothing of ours (mend_session mends it)
        there = alive is None or got[2] == 1
        if alive is not None and isinstance(got[2], Exception):
            raise got[2]
        mend = mending == 1
        if isinstance(raw, ResponseError) and wrong_type(raw):
            return Damaged(None), there, mend
        if isinstance(raw, Exception):
            raise raw
        if raw is None:
            return None, there, mend
        try:
            version, client = msgpack.unpackb(raw)
        except Exception:
            return Damaged(raw), there, mend
        if type(version) is not str or type(client) is not str:
            return Damaged(raw), there, mend
        return (version, client), there, mend

    def mend_session(self, sid: str, seen: bytes | None, *, box_lease_ms: int) -> int:
        """Delete a session's copy no host can adopt (:class:`Damaged`; ``seen`` as read) and
        tell every holder's box to store the session again (:meth:`decode_box_item`'s
        ``("store", sid)``), every live box's (:meth:`set_alive`) when no holder is left to
        tell; :meth:`get_session_and_alive` says it is mending for ``box_lease_ms`` after. How
        many were told, -1 when the copy changed since it was read."""
        key = self._sess_key(sid)
        return int(self.call("session_mend",
                             [key, key + b":boxes", self._stopped, self._live,
                              key + b":mending"],
                             [self.prefix, msgpack.packb([b"p", _b(sid)]), box_lease_ms,
                              b"" if seen is None else b"=" + seen, int(time.time() * 1000)]))

    def set_alive(self, box: str, lease_ms: int) -> bool:
        """Set ``box``'s :meth:`alive_key` for ``lease_ms``, and its host's (``alive-host:``,
        for a box of the ``<host>:<pid>:<tag>`` form; for :data:`LIVE_KEPT_MS`: a host that
        went quiet a while still holds its copies), and list the box among the live
        ones (``{g}:live``, which :meth:`mend_session` tells when a session's holders are
        unknown; boxes not renewed for :data:`LIVE_KEPT_MS` leave it here, so that recycled
        workers' boxes do not pile up); whether the alive key existed before. A live index
        another client wrote over is left to the mend script (its entries here are then
        skipped, not an error)."""
        now_ms = int(time.time() * 1000)
        p = self.client.pipeline(transaction=False)
        p.exists(self.alive_key(box))
        p.set(self.alive_key(box), b"1", px=lease_ms)
        if box.count(":") >= 2:  # its host lives (common.lua's set_holder keeps its last box)
            p.set(_b(f"{self.prefix}alive-host:{box.rsplit(':', 2)[0]}"), b"1",
                  px=max(lease_ms, LIVE_KEPT_MS))
        p.zadd(self._live, {_b(box): now_ms})
        p.zremrangebyscore(self._live, "-inf", f"({now_ms - LIVE_KEPT_MS}")
        p.pexpire(self._live, LIVE_KEPT_MS)
        existed, done, *_ = p.execute(raise_on_error=False)
        for got in (existed, done):
            if isinstance(got, Exception):
                raise got
        return bool(existed)

    def touch_session(self, sid: str, client: str | None = None, *, box: str,
                      now_ms: int | None = None) -> int:
        """Renew the session's lifetime, and its holders' boxes' with it (a ``DELETE`` tells
        them: the set must live as long as the session), and its ``client``'s set of sessions
        when given (the per-client bound counts the sessions in use; the session's place in
        its order moves on to ``now_ms``, ms, now when None: a use), listing worker ``box``
        among its holders (the worker that adopted this host's copy may be gone). 1 when
        renewed, 0 when Redis holds no copy, -1 when it was deleted within :data:`GONE_TTL`
        seconds (the caller's copy is of a session ended elsewhere)."""
        key = self._sess_key(sid)
        return int(self.call("keep", [key, key + b":boxes", key + b":gone",
                                      b"" if client is None else self._client_key(client),
                                      self._stopped],
                             [int(self.config.session_ttl * 1000), _b(box),
                              int(time.time() * 1000) if now_ms is None else now_ms, _b(sid),
                              self.prefix]))

    def delete_session(self, sid: str, *, own_box: str, box_lease_ms: int) -> int:
        """Forget a session and tell every other worker box holding it, and for a host whose
        listed holders all stopped (:meth:`box_stopped`) or lost their alive key (killed
        outright) one live box of it (:meth:`set_alive`) as well; how many were told."""
        key = self._sess_key(sid)
        return int(self.call("session_delete",
                             [key, key + b":boxes", key + b":gone", self._stopped],
                             [self.prefix, msgpack.packb([b"d", _b(sid)]), box_lease_ms,
                              _b(own_box), self._gone_ms()]))

    def _gone_ms(self) -> int:
        """Milliseconds an ended session is remembered (:data:`GONE_TTL`, at most its TTL)."""
        return int(min(self.config.session_ttl, GONE_TTL) * 1000)

    def box_stopped(self, box: str) -> None:
        """Worker ``box``'s bridge stopped: nobody reads that box again. It leaves the holders
        of every session at the session's next renewal or store (each listed every worker that
        ever served it, recycled ones too, until the session ended), unless it is its host's
        one box listed while that host lives (``common.lua``'s ``set_holder``), and a
        ``DELETE`` skips it (telling a live box of its host instead when no holder there was
        told).
        The mark is kept a session TTL and a minute: a session still listing the box has been
        renewed since, and a mark forgotten only keeps a box listed, as before the marks."""
        keep_ms = int((self.config.session_ttl + 60) * 1000)
        self.call("stopped", [self._stopped], [_b(box), keep_ms])
