"""Per-process rows of a bag: one lane per process, written without the registry lock.

A lane belongs to one process (its owner word); only that process writes it, and its threads
never contend for a way: each takes a free way from a per-bucket list and gives it back once
its row is gone (``list.pop``/``append`` and ``dict.pop`` are atomic under the GIL), so a write
takes no lock at all. Any process reads every lane lock-free. A row is a key's
keyed hash and packed bytes (a :class:`~shmcancel.shm.base.PreparedKey`'s) with two u64s
``(thread, token)``; its owner is the lane's. A key whose row finds no room (no lane, its
bucket's ways taken, a key longer than ``KEY_MAX``) goes to the shared table instead: the
caller's choice, this module only says ``None``.

Binary layout of the region (little-endian u64s unless noted; sizes in bytes)::

    offset  size             content
    0       32               LANES, BUCKETS, WAYS, BODY (the geometry; checked on attach)
    32      8                high water: lanes [0, hw) were ever claimed (readers scan those)
    40      8                seal: nonzero while a writer under the lock decides from the lanes
    48      8                table: 1 + the index of the segment's table descriptor whose lane
                             set this is (written once at creation; 0: none, refused on attach)
    64      8 x LANES        owners: procinfo.pack_owner of the lane's process, 0 = free
    H       8 x B x LANES x W  hashes [bucket][lane][way]: the row's keyed hash, 0 = empty way
    D       BODY x same      bodies, same order: u64 thread, u64 token, u16 klen, key bytes

A row is published by writing its body, then its hash (the store that makes it visible); removed
by zeroing its hash. Readers rely on x86-64 TSO like the tables' (``reader.py``): a reader that
loads a hash sees the body written before it; a body read while its way is being reused for
another key fails the key compare, which is the answer after the removal that preceded the
reuse. A cached "absent" is valid while its bucket's hash words in every lane, read before the
scan, are unchanged: a key is present exactly while one of them holds its hash (a snapshot
that held it is not cached: the row the scan missed could come back in the same way).

A lane is claimed, and a dead owner's lane cleared and freed, under the registry lock.

A writer that removes shared state only while no row of some key is in a lane (a session given
up only while no call runs in it) does so under the lock inside :meth:`Lanes.seal`: seal word
set, full barrier, lanes read, state removed, seal cleared. A row's writer publishes it, then
:func:`fence`, then reads the seal, then the state. Seal clear: either the sealer's lane read
comes after the publication (it sees the row and keeps the state) or its removal is already
visible (stores in order). Seal set: the writer takes the lock and reads the state again. A
sealer that died inside leaves the seal set: the next row writer to find it set clears it
under the lock (:meth:`Lanes.unseal`), and the next sealer's own seal ends it; other holders of
the lock leave it.
"""

from __future__ import annotations

import os
import struct
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ..exceptions import RegistryClosed, RegistryIncompatible
from . import procinfo
from .base import Lock, PreparedKey

__all__ = ["BODY", "BUCKETS", "KEY_MAX", "LANES", "WAYS", "LaneWatch", "Lanes", "region_size"]

LANES = 32  # processes with a lane; more write to the shared table
BUCKETS = 32
WAYS = 4  # rows per bucket of a lane: BUCKETS * WAYS = 128 rows per process
BODY = 112
_BODY_HEAD = struct.Struct("<QQH")
KEY_MAX = BODY - _BODY_HEAD.size  # 94 packed bytes: a [40-char scope, 36-char id] key is 79
_BODY = struct.Struct(f"<QQH{KEY_MAX}s")  # the whole body in one store call (zero-padded)
_GEOMETRY = struct.Struct("<QQQQ")
_HW = 32
_SEAL = 40
_TABLE = 48
_OWNERS = 64
_H = _OWNERS + 8 * LANES
_D = _H + 8 * BUCKETS * LANES * WAYS
_END = _D + BODY * BUCKETS * LANES * WAYS
_BUCKET_WORDS = LANES * WAYS  # hash words of one bucket, all lanes
_HQ = _H >> 3  # the hash words' first index in the region's u64s
_OQ = _OWNERS >> 3
_HWQ = _HW >> 3
_SQ = _SEAL >> 3
_CLAIM_RETRY = 1.0  # seconds between claims after none was free
_MAX_ORPHANS = 4096  # orphaned keys kept for the table's owner (more: theirs go at their ttl)
_fences = [threading.Lock() for _ in range(4)]


def fence() -> None:
    """A full memory barrier: a successful non-blocking acquire and its release are locked
    instructions (``sem_trywait``'s compare-and-swap, ``sem_post``'s add), which x86-64 orders
    with every load and store around them (a failed try need not be one: then the next lock).
    Never blocks: with all 4 taken (threads between the two calls, or locks left taken for good
    by an exception, a signal handler's, raised between them) a fresh lock's acquire is the
    barrier."""
    for lk in _fences:
        if lk.acquire(False):
            lk.release()
            return
    threading.Lock().acquire()


def region_size() -> int:
    return _END


def format_region(buf: memoryview, table: int) -> None:
    """Write the geometry of an all-zero region (no lane claimed), the lane set of the table
    whose descriptor is ``table`` (its index in the segment header)."""
    _GEOMETRY.pack_into(buf, 0, LANES, BUCKETS, WAYS, BODY)
    struct.pack_into("<Q", buf, _TABLE, table + 1)


def region_table(buf: memoryview) -> int:
    """The index of the table descriptor whose lane set the region ``buf`` is; -1 when it
    names none (a region formatted before lane sets were bound to their tables)."""
    return int(struct.unpack_from("<Q", buf, _TABLE)[0]) - 1


def _bucket(h: int) -> int:
    return (h >> 32) & (BUCKETS - 1)  # the tables' homes use the low bits


_open: weakref.WeakSet[Lanes] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    _fences[:] = [threading.Lock() for _ in range(4)]  # a parent thread was inside fence()?
    for lanes in list(_open):  # the parent's lane is the parent's: the child claims its own
        lanes._forget()


os.register_at_fork(after_in_child=_after_fork_in_child)


class Lanes:
    """The lanes of one mapped region: lock-free reads of every lane, and this process's own
    lane (claimed on its first :meth:`add`; a fork child claims its own)."""

    def __init__(self, mm: Any, offset: int, buf: memoryview, lock: Lock,
                 alive: Callable[[int, int], bool] = procinfo.alive) -> None:
        if len(buf) < _END or _GEOMETRY.unpack_from(buf, 0) != (LANES, BUCKETS, WAYS, BODY):
            raise RegistryIncompatible("the segment's lanes have another geometry")
        self._mm = mm  # the mapping: mm.find scans hash words without copying them
        self._base = offset
        self._buf = buf
        self._q = buf.cast("Q")
        self._lock = lock  # the registry lock: claims and clearing others' lanes
        self._alive = alive
        self._lane = -1  # this process's lane, -1 until claimed (and in a fork child)
        self._retry_at = 0.0
        self._free: list[list[int]] = []  # per bucket: this lane's ways without a row
        self._held: dict[int, int] = {}  # token -> way of this process's rows
        # The key bytes of the rows cleared from dead owners' lanes (a claim, a reap), for the
        # table's owner to act on (the in-flight store clears their cancellations); None: not
        # kept
        self.orphans: list[bytes] | None = None
        _open.add(self)

    def _forget(self) -> None:
        self._lane = -1
        self._retry_at = 0.0
        self._free = []
        self._held = {}

    _closed = False  # close() ran: the views are released (the registry was closed)

    def close(self) -> None:
        """Release the views (the registry is being closed): every use since raises
        :class:`~shmcancel.RegistryClosed`."""
        self._closed = True
        self._q.release()
        self._buf.release()

    def _if_closed(self) -> None:
        """In an ``except`` clause: raise :class:`~shmcancel.RegistryClosed` in place of the
        error being handled (a released view's ValueError) when these lanes are closed, else
        return for the caller to re-raise it (the tables' ``_if_closed``, for the lanes)."""
        if self._closed:
            raise RegistryClosed.of(getattr(self._lock, "name", "?"), "its lanes") from None

    # ------------------------------------------------------------------ reads (lock-free)
    def _hits(self, pk: PreparedKey, first: bool = False) -> list[int]:
        """Ways (indices into the hash words) holding ``pk``'s rows: hash and key bytes equal
        (``first``: the first one found only). A list, not a generator: a membership test is
        on every cancellation's path, several times."""
        h = pk.hash
        hb = h.to_bytes(8, "little")
        base = self._base
        start = base + _H + 8 * _BUCKET_WORDS * ((h >> 32) & (BUCKETS - 1))  # _bucket, _ways
        end = start + 8 * WAYS * min(self._q[_HWQ], LANES)
        find = self._mm.find
        out: list[int] = []
        i = find(hb, start, end)
        while i >= 0:
            if not (i - start) & 7:
                w = (i - base - _H) >> 3
                off = _D + BODY * w
                kl = _BODY_HEAD.unpack_from(self._buf, off)[2]
                if kl == len(pk.kbytes) and self._buf[off + _BODY_HEAD.size:
                                                      off + _BODY_HEAD.size + kl] == pk.kbytes:
                    out.append(w)
                    if first:
                        break
            i = find(hb, i + 1, end)
        return out

    def member(self, pk: PreparedKey) -> bool:
        try:
            return bool(self._hits(pk, True))
        except Exception:
            self._if_closed()
            raise

    def owners(self, pk: PreparedKey) -> list[tuple[int, int, int, int]]:
        """``(pid, start, thread, token)`` of ``pk``'s rows (the lane's owner first)."""
        try:
            out = []
            q = self._q
            h = pk.hash
            for w in self._hits(pk):
                lane = (w // WAYS) % LANES
                owner = procinfo.unpack_owner(q[_OQ + lane])
                # The row found may be a dead owner's whose lane was claimed since: the claim
                # clears the lane before it writes the owner word, so a hash still there after
                # the owner word was read is that owner's row (or its own again, same key).
                if owner is not None and q[_HQ + w] == h:
                    tid, token, _ = _BODY_HEAD.unpack_from(self._buf, _D + BODY * w)
                    out.append((*owner, tid, token))
            return out
        except Exception:
            self._if_closed()
            raise

    def _body(self, w: int) -> tuple[int, int, bytes]:
        """``(thread, token, key bytes)`` of way ``w``'s body."""
        tid, token, kl = _BODY_HEAD.unpack_from(self._buf, _D + BODY * w)
        k0 = _D + BODY * w + _BODY_HEAD.size
        return tid, token, bytes(self._buf[k0:k0 + min(kl, KEY_MAX)])

    def rows(self) -> list[tuple[bytes, tuple[int, int, int, int]]]:
        """Every row: ``(key bytes, (pid, start, thread, token))``, a lock-free snapshot."""
        try:
            q = self._q
            out = []
            for lane, owner in self.lane_owners():
                got = []
                for b in range(BUCKETS):
                    w0 = (b * LANES + lane) * WAYS
                    for w in range(w0, w0 + WAYS):
                        if q[_HQ + w]:
                            tid, token, kb = self._body(w)
                            got.append((kb, (*owner, tid, token)))
                # A lane released or reaped and claimed again while it was read holds another
                # process's rows: left out (they were not there when its owner was read).
                if procinfo.unpack_owner(q[_OQ + lane]) == owner:
                    out += got
            return out
        except Exception:
            self._if_closed()
            raise

    def lane_owners(self) -> list[tuple[int, tuple[int, int]]]:
        """``(lane, (pid, start))`` of every claimed lane."""
        try:
            q = self._q
            return [(i, o) for i in range(min(q[_HWQ], LANES))
                    if (o := procinfo.unpack_owner(q[_OQ + i])) is not None]
        except Exception:
            self._if_closed()
            raise

    def sealed(self) -> bool:
        """True while a writer under the registry lock decides from the lanes (see the module
        docstring): a row's writer then takes the lock before trusting what it read."""
        try:
            return self._q[_SQ] != 0
        except Exception:
            self._if_closed()
            raise

    @contextmanager
    def seal(self) -> Iterator[None]:
        """Under the registry lock: decide from the lanes, and write the decision, sealed."""
        q = self._q
        q[_SQ] = 1
        fence()  # the seal is visible before any lane is read
        try:
            yield
        finally:
            q[_SQ] = 0

    def unseal(self) -> None:
        """Under the registry lock: clear a seal its writer left (it died inside :meth:`seal`)."""
        self._q[_SQ] = 0

    # ------------------------------------------------------------------ this process's lane
    def add(self, pk: PreparedKey, tid: int, token: int) -> int | None:
        """Publish the row ``(pk, tid, token)`` in this process's lane; its way (the receipt
        :meth:`remove` takes), or ``None`` when it has no room there (then nothing written).
        ``token`` is unique to the row (the caller's), never reused."""
        try:
            kb = pk.kbytes
            if self._lane < 0 and self._own() < 0:
                return None
            if len(kb) > KEY_MAX:
                return None
            h = pk.hash
            try:
                w = self._free[(h >> 32) & (BUCKETS - 1)].pop()  # _bucket(h), inlined: the hot path
            except IndexError:  # this bucket's ways are taken
                return None
            self._held[token] = w
            _BODY.pack_into(self._buf, _D + BODY * w, tid, token, len(kb), kb)
            q = self._q
            q[_HQ + w] = h  # visible from here
            if self._lane < 0:
                # The lane was released meanwhile (another thread closing the registry): its
                # clear may have come before this store, which would stay in a lane nobody
                # owns, in flight for good. Taken back, unless the way is another row's by now.
                if q[_HQ + w] == h:
                    q[_HQ + w] = 0
                self._held.pop(token, None)
                return None
            return w
        except Exception:
            self._if_closed()
            raise

    def remove(self, w: int, token: int) -> bool:
        """Remove this process's row ``token`` at way ``w``; False when it is not there (removed
        already, or a fork child's copy of the parent's receipt). Then a full barrier: the
        caller's next load is ordered after the removal (contract §4.3's race at the end)."""
        try:
            held = self._held
            got = held.pop(token, None)  # one caller wins it
            if got != w:
                if got is not None:
                    held[token] = got
                return False
            self._q[_HQ + w] = 0
            self._free[w // (LANES * WAYS)].append(w)  # after the hash: the way is empty now
            fence()
            return True
        except BaseException as e:
            if isinstance(e, Exception):
                self._if_closed()  # raises RegistryClosed when that is why
            if token not in self._held and self._q[_HQ + w] and self._body(w)[1] == token:
                # cut short (a signal handler's exception) with its row still there: listed
                # again, for this process's reap of ended rows (else in flight for good)
                self._held[token] = w
            raise

    def own_rows(self) -> list[tuple[int, bytes, int, int]]:
        """``(way, key bytes, thread, token)`` of this process's rows (a snapshot)."""
        if self._closed:  # the close gave the lane up: nothing held, but nothing to read either
            self._if_closed()
        out = []
        for token, w in list(self._held.items()):
            tid, tok, kb = self._body(w)
            if tok == token and self._q[_HQ + w]:
                out.append((w, kb, tid, token))
        return out

    def _own(self) -> int:
        """This process's lane, claimed under the registry lock now (a free lane, else a dead
        owner's, cleared first); -1 when every lane has a live owner (tried again after
        ``_CLAIM_RETRY`` seconds)."""
        if self._lane >= 0:
            return self._lane
        now = time.monotonic()
        if now < self._retry_at:
            return -1
        me = procinfo.pack_owner(*procinfo.me())
        q = self._q
        with self._lock:
            if self._lane >= 0:  # another thread of this process claimed it meanwhile
                return self._lane
            for i in range(LANES):
                word = q[_OQ + i]
                owner = procinfo.unpack_owner(word)
                if owner is None or not self._alive(*owner):
                    if owner is None:
                        self._clear(i)
                    else:
                        self._clear_dead(i)
                    self._free = [list(range((b * LANES + i) * WAYS, (b * LANES + i + 1) * WAYS))
                                  for b in range(BUCKETS)]
                    self._held = {}
                    q[_OQ + i] = me
                    if q[_HWQ] <= i:
                        q[_HWQ] = i + 1
                    self._lane = i
                    return i
        self._retry_at = now + _CLAIM_RETRY
        return -1

    def _clear(self, lane: int) -> int:
        """Under the registry lock, of a lane no live process writes: zero its rows."""
        q = self._q
        n = 0
        for w in self._ways(lane):
            q[_HQ + w] = 0
            n += 1
        return n

    def _clear_dead(self, lane: int) -> int:
        """:meth:`_clear` of a dead owner's lane, its rows' keys kept in :attr:`orphans` (when
        kept, up to :data:`_MAX_ORPHANS`): a claim's and a reap's alike."""
        if self.orphans is not None and len(self.orphans) < _MAX_ORPHANS:
            self.orphans += [self._body(w)[2] for w in self._ways(lane)]
        return self._clear(lane)

    def _ways(self, lane: int) -> list[int]:
        """The ways of ``lane`` that hold a row."""
        q = self._q
        return [w for b in range(BUCKETS)
                for w in range((b * LANES + lane) * WAYS, (b * LANES + lane + 1) * WAYS)
                if q[_HQ + w]]

    def reap(self, pid: int | None = None) -> int:
        """Clear and free the lanes of dead owners (of ``pid`` only, when given); returns the
        rows removed. Liveness is read before the lock, checked again under it."""
        try:
            dead = [(i, o) for i, o in self.lane_owners()
                    if (pid is None or o[0] == pid) and not self._alive(*o)]
            if not dead:
                return 0
            n = 0
            q = self._q
            with self._lock:
                for i, o in dead:
                    if procinfo.unpack_owner(q[_OQ + i]) == o:
                        n += self._clear_dead(i)
                        q[_OQ + i] = 0
            return n
        except Exception:
            self._if_closed()
            raise

    def release(self) -> None:
        """Give up this process's lane (its rows go): for a registry being closed."""
        if self._lane < 0:
            return
        lane, self._lane = self._lane, -1
        self._free = []
        self._held = {}
        me = procinfo.pack_owner(*procinfo.me())
        q = self._q
        with self._lock:
            if q[_OQ + lane] == me:
                self._clear(lane)
                q[_OQ + lane] = 0


class LaneWatch:
    """A cached ``member()`` of a key over a table's :class:`~shmcancel.shm.reader.Watch` and
    the lanes. Present in a lane: one load, that way's hash word still the key's (a way reused
    by another key of the same 64-bit keyed hash would pass: never seen, not worth a compare).
    Present in the table: the table watch's own check. Absent: the table watch unchanged and
    the key's bucket's hash words in every lane, read before the scan, unchanged."""

    __slots__ = ("_a", "_b", "_h", "_lanes", "_mm", "_pk", "_q", "_snap", "_w", "_way")

    def __init__(self, w: Any, lanes: Lanes, pk: PreparedKey) -> None:
        self._w = w
        self._lanes = lanes
        self._pk = pk
        self._h = pk.hash
        self._q = lanes._q
        self._mm = lanes._mm
        self._a = lanes._base + _H + 8 * _BUCKET_WORDS * _bucket(pk.hash)
        self._b = self._a + 8 * _BUCKET_WORDS
        self._snap = b""  # never a slice of the bucket's words: the first call reads
        self._way = -1  # the hash word of the lane row last found, else -1

    def member(self) -> bool:
        try:
            way = self._way
            if way >= 0:
                if self._q[way] == self._h:
                    return True
            else:
                w = self._w
                if w._ver[w._b] == w._v:
                    if w._member:
                        return True
                    if self._mm[self._a:self._b] == self._snap:
                        return False
            return self._refresh()
        except Exception:
            self._lanes._if_closed()
            raise

    def _refresh(self) -> bool:
        snap = self._mm[self._a:self._b]  # before the scan: see the module docstring
        self._way = -1
        self._snap = b""
        if self._w.member():
            return True
        for way in self._lanes._hits(self._pk, True):
            self._way = _HQ + way
            return True
        # A snapshot that held the key's hash saw a row the scan then missed (removed in
        # between): the same row back in the same way would match it again. Not cached.
        hb = self._h.to_bytes(8, "little")
        i = snap.find(hb)
        while i >= 0:
            if not i & 7:
                return False
            i = snap.find(hb, i + 1)
        self._snap = snap
        return False
