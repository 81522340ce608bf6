"""MCP sessions (2025-era wire) kept in the registry's shared tables, so a session minted by one
worker is accepted by every other, bounded per client so that no client can log others out.

Tables (declared in :mod:`shmcancel.mcp.session_tables`):

- ``sessions``: ``session_id -> (created, last_seen, protocol_version, client)`` — wall-clock
  seconds (the ``clock``, default :func:`time.time`, shared by every process), the version
  ``initialize`` negotiated, and the 16-byte keyed digest of the minting client's scope (the
  top bit of its first byte set exactly for a principal's: a request without a principal is
  kept out of a principal's sessions);
- ``session_clients``: ``client -> (session_id, ...)``, the client's sessions in minting order,
  at most ``config.sessions_per_client``;
- ``session_calls`` (bag): ``session_id -> (pid, start, thread_ident, token)``, one row per
  ``tools/call`` running in the session (:meth:`SessionStore.begin_call` / ``end_call``), in the
  process's lane when it has room (written without the lock), else in the table.

Policy (contract §6.1):

- Ids are ``secrets.token_urlsafe(24)``: 192 random bits, 32 visible-ASCII characters, as the
  2025-11-25 transport asks (globally unique, cryptographically secure, 0x21–0x7E only).
- The *client* is the caller's scope at ``initialize``: ``principal:<id>`` when authenticated,
  else ``ip:<address bucket>`` (IPv6 by /64). Minting counts against it alone: a client holding
  ``sessions_per_client`` sessions (or minting into a full table) gives up its own least
  recently seen session that has no call in flight. It never displaces another client's
  session: when it has none to give up, :class:`SessionsFull` is raised (the transport answers
  its ``initialize`` with the JSON-RPC error -32000 and ``Retry-After``).
- A mint reads one client row; one that must give up a session of its own also reads that
  client's session rows (at most ``sessions_per_client``, lock-free) to find the least recently
  seen; under the lock it re-checks only what it decided on. Nothing scans the table at mint:
  the cost is the same at any fill.
- A session expires once it has not been seen for ``config.session_ttl`` seconds and has no call
  in flight. :meth:`get` treats an expired row as absent; :meth:`sweep` removes expired rows a
  bounded piece of the table at a time, run on the back of this store's own calls at most every
  :data:`SWEEP_EVERY` seconds per process. A session last seen more than a touch interval
  ahead of the clock was seen before it stepped back: the sweep stamps it now (else it would
  outlive its ttl by the step, and a table full of departed clients' sessions refuse new ones).
- ``last_seen`` is refreshed at most once per :data:`TOUCH_INTERVAL` (or ``ttl / 10`` when
  shorter), also at the start and end of a call: a busy session costs a shared write per
  interval. A ``tools/call``'s row takes no lock while its process's lane has room. A session
  therefore expires between ``ttl - interval`` and ``ttl`` idle seconds after it was last seen.
- A session is given up (a mint's victim) or expired only under the lock inside the call lanes'
  seal, after a check that no call of a live process runs in it; a call publishes its row, then
  checks the seal and the session (``shm/lanes.py``): it never runs in a session so removed.

Crash safety: every step writes the row that only makes things stricter first. A mint deletes
its victim, then rewrites the client row (listing the new id), then inserts the session; a delete
removes the session, then unlists it. A writer killed in between leaves a listed id without a
session row (a *phantom*), which the next mint of that client or the sweep drops; never a session
its client does not count.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import math
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..exceptions import LockTimeout, RegistryClosed, ShmCancelError, TableFull
from ..shm import procinfo
from ..shm.base import PreparedKey, ShmFull
from ..shm.lanes import fence
from ..shm.reader import Watch
from .principal import of_principal
from .session_tables import SESSION_CALLS, SESSION_CLIENTS, SESSIONS
from .wire import valid_session_id

__all__ = ["RETRY_AFTER", "SWEEP_EVERY", "TOUCH_INTERVAL", "Call", "Session", "SessionStore",
           "SessionsFull"]

log = logging.getLogger("shmcancel.sessions")

TOUCH_INTERVAL = 1.0  # seconds
SWEEP_EVERY = 0.5  # seconds between two sweep pieces of one process
SWEEP_SLOTS = 256  # index slots of the sessions table per sweep piece (~128 rows read)
SWEEP_CLIENT_SLOTS = 16  # index slots of session_clients per piece (each row: its ids read)
RETRY_AFTER = 10  # seconds a refused initialize is told to wait (HTTP Retry-After)
BUCKET = 16  # index slots per seqlock bucket: the unit of a sweep piece
_PLAN_TRIES = 4  # lock-free plans re-checked under the lock before planning under it
_OWED_MAX = 4096  # call ends kept for a retry after a lock timeout
_KEYS_MAX = 1024  # session ids whose prepared keys and watch a process keeps (then starts over)
_NUM = (int, float)
_PRINCIPAL_BIT = 0x80  # in a client digest's first byte: minted for a principal

_tokens = itertools.count(1)


class SessionsFull(TableFull):
    """No session can be minted for this client now: the table is full of other clients'
    sessions, or every session of its own has a call in flight. Nothing was written; retry
    after ``retry_after`` seconds."""

    retry_after = RETRY_AFTER


@dataclass(frozen=True, slots=True)
class Session:
    id: str
    created: float
    last_seen: float
    protocol_version: str
    client: bytes = b""


@dataclass(frozen=True, slots=True)
class Call:
    """A ``tools/call`` running in a session (from :meth:`SessionStore.begin_call`)."""

    session_id: str
    owner: tuple[int, int, int, int] | None  # None: not recorded (session_calls was full)
    seen: float = -math.inf  # the session's last_seen at the call's begin, as it left it
    receipt: tuple[int, int] | None = None  # its row's (Table.add), to remove it without a read
    way: int = -1  # its row's way in this process's lane (Lanes.add), -1: none


_Row = tuple[float, float, str, bytes]


def _row(value: Any) -> _Row | None:
    """A stored value as ``(created, last_seen, version, client)``, or ``None``."""
    if type(value) is tuple and len(value) == 4:
        created, seen, version, client = value
        if (type(created) in _NUM and type(seen) in _NUM and type(version) is str
                and type(client) is bytes):
            return float(created), float(seen), version, client
    return None


def _owner(value: Any) -> tuple[int, int, int, int] | None:
    if type(value) is tuple and len(value) == 4 and all(type(v) is int for v in value):
        return value
    return None


@dataclass(slots=True)
class _Plan:
    """What a mint will do, decided from lock-free reads and re-checked under the lock."""

    listed: Any  # the client row as read (None: absent)
    keep: tuple[str, ...]  # listed ids that stay (live sessions of this client), oldest first
    victim: str | None  # the session given up, or None
    victim_value: Any
    dropped: frozenset[str] = frozenset()  # listed ids taken for phantoms (no session row)


class SessionStore:
    """Sessions over one registry (its tables ``sessions``, ``session_clients`` and
    ``session_calls``, ``reg.lock``, ``reg.config``): the shared-memory
    :class:`~shmcancel.mcp.session_storage.SessionStorage`. Thread-safe; one per process."""

    def __init__(self, reg: Any, clock: Callable[[], float] = time.time, *,
                 alive: Callable[[int, int], bool] = procinfo.alive) -> None:
        self._reg = reg
        self._lock = reg.lock
        self._table = reg.table(SESSIONS)
        self._clients = reg.table(SESSION_CLIENTS)
        self._calls = reg.table(SESSION_CALLS)
        self._lanes = reg.lanes[SESSION_CALLS]
        self._hash_key = bytes(reg.hash_key)
        self._clock = clock
        self._alive = alive
        cfg = reg.config
        self.ttl: float = float(cfg.session_ttl)
        self.capacity: int = int(cfg.session_capacity)
        self.per_client: int = int(cfg.sessions_per_client)
        self._touch_every = min(TOUCH_INTERVAL, self.ttl / 10)
        self._owed: list[Call] = []
        self._owed_lock = threading.Lock()
        self._cursor = 0
        self._client_cursor = 0
        self._next_sweep = -math.inf  # time.monotonic()
        self._full_logged = False
        # session id -> (its key prepared for sessions, for session_calls, a watch of its row):
        # a session's requests land on the same workers again and again
        self._keys: dict[str, tuple[PreparedKey, PreparedKey, Watch]] = {}

    def client_digest(self, client: str) -> bytes:
        """The 16-byte keyed digest a client scope is counted under. The top bit of its first
        byte is set exactly for a principal's scope (``principal:<id>``): a session remembers
        whether it was minted for one (:meth:`minted_for_principal`)."""
        d = bytearray(hashlib.blake2b(client.encode("utf-8", "surrogatepass"),
                                      key=self._hash_key, digest_size=16).digest())
        if of_principal(client):
            d[0] |= _PRINCIPAL_BIT
        else:
            d[0] &= ~_PRINCIPAL_BIT & 0xFF
        return bytes(d)

    @staticmethod
    def minted_for_principal(session: Session) -> bool:
        """Whether ``session`` was minted for a principal (not for an address bucket)."""
        c = session.client
        return type(c) is bytes and len(c) > 0 and bool(c[0] & _PRINCIPAL_BIT)

    # ------------------------------------------------------------------ mint

    def create(self, protocol_version: str, client: str = "global", *,
               session_id: str | None = None) -> Session:
        """Mint and store a new session for ``client`` (its scope: ``principal:<id>`` or
        ``ip:<bucket>``). Gives up the client's own least recently seen idle session when it
        holds ``sessions_per_client`` or the table is full; raises :class:`SessionsFull` when
        it has none to give up. Costs the same at any fill of the table. ``session_id``: store
        under this id (a session another host minted, adopted here) instead of minting one."""
        self._tick()
        now = self._clock()
        digest = self.client_digest(client)
        sid = session_id if session_id is not None and valid_session_id(session_id) \
            else secrets.token_urlsafe(24)
        value = (now, now, protocol_version, digest)
        for attempt in range(_PLAN_TRIES + 1):
            last = attempt == _PLAN_TRIES
            plan = None if last else self._plan(digest, now)
            with self._lock, self._lanes.seal():  # a victim is given up only while idle
                if session_id is not None and (r := _row(self._table.get(sid))) is not None:
                    # adopted meanwhile by another request of it here: nothing to mint, and
                    # nothing of the client's to give up for it
                    return Session(sid, *r)
                if plan is None:
                    plan = self._plan(digest, now)  # under the lock: exact
                elif not self._current(plan, digest):
                    continue
                self._commit(plan, digest, sid, value)
                break
        return Session(sid, now, now, protocol_version, digest)

    def _plan(self, digest: bytes, now: float) -> _Plan:
        listed = self._clients.get(digest)
        ids = listed if type(listed) is tuple else ()
        if (len(ids) < self.per_client and self._table.count() < self.capacity
                and all(type(s) is str for s in ids)):
            return _Plan(listed, ids, None, None)  # room: one row read, whatever the fill
        # At its bound, or the table is full: give up the client's own least recently seen
        # session without a call in flight, dropping phantoms met on the way. Ids are listed in
        # minting order and a session is seen no earlier than it was created, so the walk stops
        # at the first one created after the best candidate was last seen: every later one was
        # seen later still. A flood of fresh sessions is decided after two rows.
        ids = tuple(s for s in ids[:self.per_client + 1] if type(s) is str)  # longer: damage
        dropped: set[str] = set()
        if ids and _row(self._table.get(ids[-1])) is None:  # where an interrupted mint leaves one
            dropped.add(ids[-1])
        victim, victim_value, best = None, None, math.inf
        for sid in ids:
            v = self._table.get(sid)
            r = _row(v)
            if r is None or r[3] != digest:
                dropped.add(sid)
                continue
            if r[0] >= best:
                break
            if r[1] < best and not self._busy(sid):
                victim, victim_value, best = sid, v, r[1]
        keep = tuple(s for s in ids if s not in dropped)
        gone = frozenset(dropped)
        if len(keep) < self.per_client and self._table.count() < self.capacity:
            return _Plan(listed, keep, None, None, gone)
        if victim is not None:
            return _Plan(listed, tuple(s for s in keep if s != victim), victim, victim_value,
                         gone)
        if len(keep) < self.per_client:
            raise SessionsFull(
                f"sessions table is full ({self.capacity} sessions of other clients); "
                f"retry in {RETRY_AFTER}s")
        raise SessionsFull(
            f"this client holds {len(keep)} sessions (sessions_per_client), each with a call "
            f"in flight; retry in {RETRY_AFTER}s")

    def _current(self, plan: _Plan, digest: bytes) -> bool:
        """Under the lock: is ``plan`` still what it would decide?"""
        if self._clients.get(digest) != plan.listed:
            return False
        # A phantom seen lock-free may be the id of a mint that was committing then (its client
        # row is written before its session row): dropping it would leave that live session
        # counted against nobody, past the client's bound.
        for sid in plan.dropped:
            r = _row(self._table.get(sid))
            if r is not None and r[3] == digest:
                return False
        if plan.victim is None:
            return self._table.count() < self.capacity
        return self._table.get(plan.victim) == plan.victim_value and not self._busy(plan.victim)

    def _commit(self, plan: _Plan, digest: bytes, sid: str, value: Any) -> None:
        """Under the lock. Victim first, then the client row, then the session (see the module
        docstring: an interruption leaves at worst a phantom id)."""
        if plan.victim is not None:
            self._table.delete_object(plan.victim, plan.victim_value)
            self._calls.delete(plan.victim)  # rows of dead owners only (it was not busy)
        try:
            self._clients.insert(digest, (*plan.keep, sid))
        except ShmFull as e:  # /dev/shm filled since the registry was created
            raise SessionsFull(f"{e}; retry in {RETRY_AFTER}s") from None
        except TableFull:  # a new client, and every client row is taken (by phantoms)
            raise SessionsFull(
                f"session_clients table is full; retry in {RETRY_AFTER}s") from None
        if not self._table.insert_new(sid, value):  # 192 random bits collide: never
            raise ShmCancelError("session id collision")

    # ------------------------------------------------------------------ calls

    def _keys_of(self, session_id: str) -> tuple[PreparedKey, PreparedKey, Watch]:
        """``session_id``'s prepared keys (``sessions``, ``session_calls``) and a watch of its
        session row, made once per process (while at most ``_KEYS_MAX`` ids are kept)."""
        got = self._keys.get(session_id)
        if got is None:
            if len(self._keys) >= _KEYS_MAX:
                self._keys.clear()
            pk = self._table.prepare(session_id)
            got = self._keys[session_id] = (pk, self._calls.prepare(pk), self._table.watch(pk))
        return got

    def _session_row(self, watch: Watch) -> Any:
        """The session row's value through its watch (decoded once while it is unchanged)."""
        vals = watch.values()
        return vals[0] if vals else None

    def _busy(self, session_id: str) -> bool:
        """True while a call of a live process runs in the session (lock-free; a miss costs
        one probe of the table and of the lanes, a hit a /proc read per owner). Under the lock
        inside the lanes' seal: exact."""
        ck = self._calls.prepare(session_id)
        owners: list[Any] = self._lanes.owners(ck)
        if self._calls.member(ck):
            owners += map(_owner, self._calls.lookup(ck))
        return any(o is not None and self._alive(o[0], o[1]) for o in owners)

    def begin_call(self, session: Session) -> Call | None:
        """Record a ``tools/call`` running in ``session`` (so it is never given up or expired
        meanwhile) and touch it. ``None`` when the session is gone (evicted, expired or deleted
        since it was read): the caller answers 404. In the common case (a lane with room, no
        touch due) no lock is taken. A full ``session_calls`` table (dead owners removed first)
        leaves the call unrecorded, logged once."""
        self._settle()
        me = procinfo.me()
        owner = (me[0], me[1], threading.get_ident(), next(_tokens))
        keys = self._keys_of(session.id)
        _, ck, watch = keys
        lanes = self._lanes
        way = lanes.add(ck, owner[2], owner[3])
        if way is None:
            return self._begin_locked(session, keys, owner, -1)
        try:
            fence()  # the row is visible before the seal and the session are read (lanes.py)
            if not lanes.sealed():
                r = _row(self._session_row(watch))
                if r is None:  # removed before the seal was read: really gone
                    lanes.remove(way, owner[3])
                    return None
                if self._clock() - r[1] < self._touch_every:
                    return Call(session.id, owner, r[1], None, way)
            return self._begin_locked(session, keys, owner, way)
        except BaseException:
            lanes.remove(way, owner[3])
            raise

    def _begin_locked(self, session: Session, keys: tuple[PreparedKey, PreparedKey, Watch],
                      owner: tuple[int, int, int, int], way: int) -> Call | None:
        """:meth:`begin_call` under the lock (``keys``: the session's, from :meth:`_keys_of`):
        the call's row in the table (``way`` -1) or already in the lane, the session read
        again, touched when due."""
        now = self._clock()
        pk, ck, watch = keys
        rec: tuple[int, int, int, int] | None = owner
        receipt = None
        with self._lock:
            if self._lanes.sealed():
                self._lanes.unseal()  # its sealer died inside: this process holds the lock
            r = _row(self._session_row(watch))
            if r is None:
                if way >= 0:
                    self._lanes.remove(way, owner[3])
                return None
            if way < 0:
                try:  # the token makes the row unlike any other: add() reads no rows first
                    receipt = self._calls.add(ck, owner)
                except TableFull:
                    if self._reap_calls():
                        receipt = self._calls.add(ck, owner)
                    else:
                        rec = None
                        if not self._full_logged:
                            self._full_logged = True
                            log.warning("session_calls table is full: calls run unrecorded "
                                        "(their sessions may be displaced by their client)")
            seen = r[1]
            if now - seen >= self._touch_every:
                self._table.insert(pk, (r[0], now, r[2], r[3]))
                seen = now
        return Call(session.id, rec, seen, receipt, way)

    def end_call(self, call: Call) -> None:
        """The call ended: touch the session, then drop its row. Never raises: when the lock
        cannot be had in time, the end is owed and run later by this process (the next call of
        any method here), the row kept until then (its session still counts as in use); past
        ``_OWED_MAX`` owed ends a lane row goes at once, untouched."""
        if call.owner is None:
            return
        try:
            self._end(call)
        except LockTimeout:
            with self._owed_lock:
                owed = len(self._owed) < _OWED_MAX
                if owed:
                    self._owed.append(call)
            if not owed and call.way >= 0:  # no room to owe it: the row goes, untouched
                self._lanes.remove(call.way, call.owner[3])
            log.warning("session call end deferred: registry lock timeout")
        except ShmCancelError:
            log.warning("session call end failed", exc_info=True)

    def _end(self, call: Call) -> None:
        # The touch is coalesced as touch() does: a call shorter than the touch interval since
        # the session was last seen leaves last_seen as is (the session then expires at most
        # one interval early, never late); a longer call refreshes it.
        # ``call.seen`` is a lower bound of last_seen (only ever raised), so a call shorter than
        # the interval does not even read the session row.
        # Invariant: the row goes only once the touch is done (in the same lock hold). A call
        # can outlast the ttl, leaving last_seen stale: from its row's removal until the touch,
        # a sweep or a get would find the session idle and long unseen and expire it, right
        # after a call in it succeeded. So a lane row due a touch is removed under the lock,
        # after the touch; a lock timeout leaves it in the lane (the end is owed, and the
        # session counts as in use until it runs), as a table row stays in the table.
        now = self._clock()
        lane = call.way >= 0
        if lane and now - call.seen < self._touch_every:  # last_seen is fresh: no touch due
            self._lanes.remove(call.way, call.owner[3])  # type: ignore[index]  # (again: no-op)
            return
        if self._lock.still_stalled():
            # A wait of this process ran out moments ago and the hold goes on: owed at once
            # (end_call) rather than hold the call's answer back another lock_timeout.
            raise LockTimeout("the registry lock's holder outlasted lock_timeout lately")
        pk, ck, watch = self._keys_of(call.session_id)
        with self._lock:
            try:
                if not lane:
                    self._calls.remove(ck, call.receipt, call.owner)
                if now - call.seen < self._touch_every:
                    return
                r = _row(self._session_row(watch))
                if r is not None and now - r[1] >= self._touch_every:
                    self._table.insert(pk, (r[0], now, r[2], r[3]))
            finally:
                if lane:  # after the touch, even a failed one: never a row left behind
                    self._lanes.remove(call.way, call.owner[3])  # type: ignore[index]

    def _settle(self) -> None:
        """Retry the call ends a lock timeout deferred (bounded; stops at the next timeout;
        skipped while the lock is stalled: a request waits for its own write only)."""
        if not self._owed or self._lock.stalled():
            return
        with self._owed_lock:
            owed, self._owed = self._owed, []
        for i, call in enumerate(owed):
            try:
                self._end(call)
            except LockTimeout:
                with self._owed_lock:
                    self._owed[:0] = owed[i:]
                return
            except ShmCancelError:
                log.warning("session call end failed", exc_info=True)

    def _reap_calls(self) -> int:
        """Remove ``session_calls`` rows of dead owners (a scan: only when the table is full)."""
        rows = self._calls.scan()
        owners = {(o[0], o[1]) for o in map(_owner, (v for _, v in rows)) if o is not None}
        dead = {o for o in owners if not self._alive(*o)}

        def gone(_k: Any, v: Any) -> bool:
            o = _owner(v)
            return o is None or (o[0], o[1]) in dead

        return self._calls.delete_where(gone)

    # ------------------------------------------------------------------ lookups

    def get(self, session_id: str | None) -> Session | None:
        """The live session ``session_id`` names, or ``None`` (malformed, unknown, expired).
        Lock-free unless it finds an expired row, which it removes, or its read keeps meeting
        a write in progress (then it reads under the lock). Raises
        :class:`~shmcancel.LockTimeout` when that lock is held past ``lock_timeout`` (a live
        writer stalled mid-write: the session may well exist, so not ``None``, which a client
        is told as 404, its session gone) and :class:`~shmcancel.RegistryClosed`."""
        if not valid_session_id(session_id):
            return None
        self._tick()
        try:
            v = self._session_row(self._keys_of(session_id)[2])  # type: ignore[arg-type]
        except (LockTimeout, RegistryClosed):
            raise
        except ShmCancelError:
            return None
        r = _row(v)
        if r is None:
            return None
        if self._clock() - r[1] > self.ttl and not self._busy(session_id):  # type: ignore[arg-type]
            if self._expire(session_id, v, r):
                return None
            # Refused under the lock: a call runs in it now, or it was touched (a call's end)
            # or replaced meanwhile. What is there now is the answer.
            r = _row(self._session_row(self._keys_of(session_id)[2]))  # type: ignore[arg-type]
            if r is None:
                return None
        return Session(session_id, r[0], r[1], r[2], r[3])  # type: ignore[arg-type]

    def touch(self, session: Session) -> None:
        """Record that ``session`` was seen now (a shared write at most once per interval)."""
        now = self._clock()
        if now - session.last_seen < self._touch_every:
            return
        with self._lock:
            r = _row(self._table.get(session.id))
            if r is None or r[1] >= now:  # deleted meanwhile (never resurrect), or fresher
                return
            self._table.insert(session.id, (r[0], now, r[2], r[3]))

    def delete(self, session_id: str) -> bool:
        """End a session. True when it existed."""
        if not valid_session_id(session_id):
            return False
        with self._lock:
            v = self._table.get(session_id)
            if v is None or not self._table.delete(session_id):
                return False
            r = _row(v)
            if r is not None:
                self._unlist(r[3], session_id)
            return True

    def _unlist(self, digest: bytes, session_id: str) -> None:
        """Under the lock: drop ``session_id`` from its client's row."""
        listed = self._clients.get(digest)
        if type(listed) is not tuple or session_id not in listed:
            return
        rest = tuple(s for s in listed if s != session_id)
        if rest:
            self._clients.insert(digest, rest)
        else:
            self._clients.delete(digest)

    def _expire(self, session_id: Any, value: Any, r: _Row | None) -> int:
        """Remove the row ``(session_id, value)`` if unchanged (a touch meanwhile keeps it) and
        no call runs in it."""
        with self._lock, self._lanes.seal():
            if r is not None and self._busy(session_id):
                return 0
            if not self._table.delete_object(session_id, value):
                return 0
            if r is not None:
                self._unlist(r[3], session_id)
            return 1

    def count(self) -> int:
        return self._table.count()

    def client_sessions(self, client: str) -> tuple[str, ...]:
        """The ids listed for ``client``, oldest first (phantoms included)."""
        listed = self._clients.get(self.client_digest(client))
        return listed if type(listed) is tuple else ()

    # ------------------------------------------------------------------ expiry

    def sweep(self, slots: int = SWEEP_SLOTS, client_slots: int = SWEEP_CLIENT_SLOTS) -> int:
        """Remove expired sessions (idle longer than ``ttl`` with no call in flight) and
        malformed rows among the next ``slots`` index slots of the sessions table, and phantom
        ids among the next ``client_slots`` of ``session_clients``; the lock is held per
        removed row only. Returns the sessions removed. Successive calls walk the tables
        cyclically (pieces rounded up to whole buckets of 16 slots), so ``nslots / slots``
        calls cover the sessions table."""
        self._settle()
        removed = self._sweep_sessions(slots)
        self._sweep_clients(client_slots)
        return removed

    def sweep_all(self) -> int:
        """:meth:`sweep` over the whole of both tables, piece by piece."""
        n = 0
        for _ in range(-(-self._table.nslots // SWEEP_SLOTS)):
            n += self._sweep_sessions(SWEEP_SLOTS)
        for _ in range(-(-self._clients.nslots // SWEEP_SLOTS)):
            self._sweep_clients(SWEEP_SLOTS)
        return n

    def _sweep_sessions(self, slots: int) -> int:
        # Downwards: a removal shifts later entries back into the piece just read, never into
        # one still to read, so a pass misses no row (but at its start, across the table's end).
        nslots = self._table.nslots
        slots = max(BUCKET, min(nslots, -(-slots // BUCKET) * BUCKET))
        self._cursor = (self._cursor - slots) % nslots
        rows, _ = self._table.scan_slots(self._cursor, slots)
        now = self._clock()
        removed = 0
        for sid, v in rows:
            r = _row(v)
            if r is None or (now - r[1] > self.ttl and not self._busy(sid)):
                removed += self._expire(sid, v, r)
            elif r[1] - now > self._touch_every:  # seen "later": the clock stepped back since
                self._restamp(sid, v, r)
        return removed

    def _restamp(self, session_id: str, value: Any, r: _Row) -> None:
        """Stamp now on a session last seen more than a touch interval ahead of now (before
        the clock stepped back; as ``registry.sweep_due`` treats the janitor's last sweep), if
        its row is unchanged: it then expires one ttl from here, not one ttl past the step
        (which no touch would move either: a touch never writes an older time). The clock is
        read again under the lock: a touch made during the scan is not taken for a step. Not
        while a call runs in it (decided inside the seal, as an expiry): that call's end, which
        remembers the time it began at, would not touch it, and a call longer than the ttl
        would leave it expired; once idle, the next sweep stamps it."""
        with self._lock, self._lanes.seal():
            now = self._clock()
            if (r[1] - now > self._touch_every and self._table.get(session_id) == value
                    and not self._busy(session_id)):
                self._table.insert(session_id, (min(r[0], now), now, r[2], r[3]))

    def _sweep_clients(self, slots: int) -> None:
        crows, self._client_cursor = self._clients.scan_slots(self._client_cursor, slots)
        for digest, listed in crows:
            ids = listed if type(listed) is tuple else ()
            if len(ids) > self.per_client or any(
                    type(s) is not str or (r := _row(self._table.get(s))) is None
                    or r[3] != digest for s in ids):
                self._prune(digest, listed)

    def _prune(self, digest: Any, listed: Any) -> None:
        """Drop the ids of ``digest``'s row that have no session of that client."""
        with self._lock:
            if self._clients.get(digest) != listed:
                return  # changed meanwhile: the next pass looks again
            ids = listed if type(listed) is tuple else ()
            keep = tuple(s for s in ids[:self.per_client] if type(s) is str
                         and (r := _row(self._table.get(s))) is not None and r[3] == digest)
            if keep:
                self._clients.insert(digest, keep)
            else:
                self._clients.delete(digest)

    def _tick(self) -> None:
        """One sweep piece when this process's next one is due (a clock read otherwise)."""
        t = time.monotonic()
        if t < self._next_sweep or self._lock.stalled():  # a sweep can wait for the lock
            return
        self._next_sweep = t + SWEEP_EVERY
        try:
            self.sweep()
        except Exception as e:  # a lock timeout, damage fsck will repair: never fail the request
            log.warning("session sweep failed: %s", e, exc_info=not isinstance(e, LockTimeout))
