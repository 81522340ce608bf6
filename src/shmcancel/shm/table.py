"""Fixed-capacity open-addressed hash tables over a region of the shared segment, ETS-like.

A table lives in one region of the segment (the registry hands out 4096-aligned regions). All
integers are little-endian; every offset below is a multiple of 8, so every u64 is aligned and a
u64 store through a ``memoryview.cast("Q")`` is one machine store (never seen torn)::

    offset  size                      content
    0       64                        header
              0   8s  magic  b"SHMTBL\\x00\\x01"
              8   u32 capacity          (rows the table holds)
              12  u32 record_size       (bytes per record, header included, multiple of 8)
              16  u32 nslots            (index slots, power of two >= 2 x capacity, >= 16)
              20  u32 nbuckets          (nslots / 16)
              24  u64 rows              (row count; derivable: fsck recounts it)
              32  u64 free_top          (number of record numbers on the free stack)
              40  u64 stamp             (last record stamp handed out)
              48  16 bytes reserved (0)
    64      8 x nbuckets (pad to 64)  bucket versions: u64 seqlock per bucket of 16 index slots;
                                      odd while a writer changes a slot of the bucket
    V       16 x nslots               index: per slot u64 hash (keyed blake2b of the packed key,
                                      never 0; 0 = empty slot) then u64 record number
    I       record_size x (capacity+1)  heap of records:
              0   u32 crc32 of the klen + vlen payload bytes, seeded with
                      (stamp ^ klen << 16 ^ vlen ^ 0x5EED5EED) mod 2**32 (so it covers the header)
              4   u32 klen, 8 u32 vlen, 12 u32 reserved (0)
              16  u64 stamp (table-wide increasing counter: the newest of two rows wins in fsck)
              24  klen bytes msgpack key, then vlen bytes msgpack value, then zeros
    H       4 x (capacity+1) (pad to 8)  free stack: u32 record numbers, the top at free_top - 1

There is one record more than ``capacity``: a set update writes a fresh record before it lets go
of the old one, and the spare guarantees that a full table can still update its rows.

Probing is linear from the home slot ``hash & (nslots - 1)``; deletion shifts the following
entries back (no tombstones), so an entry is always reachable: no empty slot lies between its
home and its slot. The load stays <= 50 % by construction (nslots >= 2 x capacity).

Invariants a writer (holding the registry lock) keeps, so that a writer killed at any bytecode
leaves a table ``fsck`` restores:

- a record is written only while it is unreferenced (taken from the free stack), and the index
  references it only once it is complete; a referenced record is never written;
- a new row is published by writing the slot's record number, then its hash (the hash makes the
  slot non-empty); a set update swaps the record number (one store) and frees the old record after;
- every bucket whose slots a writer touches is made odd before the first store and even after the
  last (a backward shift marks every bucket it moves slots in); a record is freed only after the
  index stopped referencing it, so its reuse is covered by the version bump that unreferenced it;
- ``lock.dirty`` is True from just before the first store to just after the last.

Readers take no lock: they read a bucket's version before its slots, re-check every version they
read at the end, and validate record lengths and crc before decoding. After a bounded number of
retries (a writer killed mid-mutation leaves a bucket odd until fsck runs) they read under the lock.

Garbage in the segment (a stray write, another process scribbling over it) never makes a loop
spin: every probe, backward shift and scan is bounded by ``nslots``, every record number by
``capacity``. Under the lock, a probe that meets no empty slot or a referenced record failing
validation is corruption, never a race: the operation repairs the table with ``fsck``, logs once
(per process and table) and retries once; still corrupt, it raises :class:`TableCorrupted`. A
lock-free reader that meets the same with unmoved versions goes straight to the lock. The header
counters obey ``rows + free_top == capacity + 1`` whenever no writer is mid-operation;
:meth:`Table.check` tests that and more (the janitor and ``Registry.attach`` call it) and recounts.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import time
import zlib
from array import array
from collections.abc import Callable
from typing import Any, Literal, Protocol, TypeVar

import msgpack

from ..exceptions import RegistryIncompatible, RowTooLarge, ShmCancelError, TableFull

__all__ = ["Kind", "Lock", "PreparedKey", "Table", "TableCorrupted", "Watch"]

log = logging.getLogger("shmcancel.table")
_T = TypeVar("_T")

Kind = Literal["set", "bag"]

MAGIC = b"SHMTBL\x00\x01"
HEADER_SIZE = 64
RECORD_HEADER = 24  # bytes of record header before the key
BUCKET_SLOTS = 16  # index slots per seqlock bucket
READ_RETRIES = 64  # optimistic attempts before a reader falls back to the lock
_SPIN_BEFORE_YIELD = 4
SWEEP_HOLD = 0.0003  # seconds a sweep chunk holds the lock for (then it lets writers in)
SWEEP_BULK = 256  # rows from which a sweep tries one bulk rewrite of the index first

_HDR = struct.Struct("<8sIIII")  # magic, capacity, record_size, nslots, nbuckets
_REC = struct.Struct("<IIIIQ")  # crc, klen, vlen, reserved, stamp
_LENS = struct.Struct("<II")  # klen, vlen
_SEED = 0x5EED5EED
_M32 = 0xFFFF_FFFF
# u64 word numbers in the header
_ROWS, _TOP, _STAMP = 3, 4, 5
_STAMP_MAX = 1 << 62  # a stamp counter above this is garbage (2**62 writes never happen)

_unpackb = msgpack.unpackb
_blake2b = hashlib.blake2b
_crc32 = zlib.crc32
_from_bytes = int.from_bytes


# One Packer per process: ``msgpack.packb`` builds a Packer per call (4x slower). Packer.pack
# holds the GIL from start to end (no Python code runs for the types msgpack packs natively, and
# it resets its buffer on error), so threads of one process cannot interleave inside it.
_pack = msgpack.Packer(use_bin_type=True).pack


class TableCorrupted(ShmCancelError):
    """The table's bytes are inconsistent in a way no interrupted writer leaves (garbage in the
    segment), and still were right after ``fsck`` repaired them. Raised only after one repair
    and one retry of the operation; nothing was half-written (the repair ran)."""


def _unpack(b: bytes) -> Any:
    return _unpackb(b, raw=False, use_list=False, strict_map_key=False)


def _round8(n: int) -> int:
    return (n + 7) & ~7


def _round64(n: int) -> int:
    return (n + 63) & ~63


def _geometry(capacity: int, record_size: int) -> tuple[int, int, int, int, int, int]:
    """(nslots, nbuckets, index offset, heap offset, free-stack offset, region size)."""
    if not isinstance(capacity, int) or not 1 <= capacity <= 0xFFFF_FFFE:
        raise ValueError(f"table capacity must be an int in 1..2**32-2, got {capacity!r}")
    if not isinstance(record_size, int) or record_size < RECORD_HEADER + 2 or record_size % 8:
        raise ValueError(
            f"record_size must be a multiple of 8 and >= {RECORD_HEADER + 8}, got {record_size!r}")
    nslots = BUCKET_SLOTS
    while nslots < 2 * capacity:
        nslots *= 2
    nbuckets = nslots // BUCKET_SLOTS
    idx_off = HEADER_SIZE + _round64(8 * nbuckets)
    heap_off = idx_off + 16 * nslots
    free_off = heap_off + record_size * (capacity + 1)
    size = _round64(free_off + _round8(4 * (capacity + 1)))
    return nslots, nbuckets, idx_off, heap_off, free_off, size


class Lock(Protocol):
    """What a table needs of the registry lock (see ``lock.RegistryLock``): a reentrant
    inter-process lock whose ``__exit__`` repairs the tables (``fsck``) if ``dirty`` is still
    True, i.e. the holder was interrupted between its first and last store."""

    dirty: bool

    def held_by_me(self) -> bool: ...
    def __enter__(self) -> object: ...
    def __exit__(self, et: object, ev: object, tb: object) -> None: ...


class PreparedKey:
    """A key with its msgpack bytes, keyed hash and home slot computed once (for one table).

    ``j`` is the home slot's first word in the index (``2 * home``) and ``b`` its bucket;
    ``t`` is the table it was prepared for (a key prepared for another table is re-prepared).
    """

    __slots__ = ("b", "hash", "home", "j", "kbytes", "key", "t")

    def __init__(self, t: Table, key: Any, kbytes: bytes, h: int, home: int) -> None:
        self.t = t
        self.key = key
        self.kbytes = kbytes
        self.hash = h
        self.home = home
        self.j = 2 * home
        self.b = home >> 4

    def __repr__(self) -> str:
        return f"PreparedKey({self.key!r}, home={self.home})"


class Watch:
    """A cached lookup of one prepared key: ``member()``/``values()`` re-read the table only
    when a bucket version seen last time has moved.

    Valid because a referenced record is never written and every change of a slot moves its
    bucket's version: unchanged versions of every bucket the last probe read mean an unchanged
    answer. When that probe spanned several buckets ``_v`` is -1 (never a version) and the
    slow path compares them all.
    """

    __slots__ = ("_b", "_member", "_pk", "_raw", "_seen", "_t", "_v", "_values", "_ver")

    def __init__(self, table: Table, pk: PreparedKey) -> None:
        self._t = table
        self._pk = pk
        self._ver = table._ver
        self._b = pk.b
        self._v = -1  # never equal to a version: the first call reads
        self._seen: tuple[tuple[int, int], ...] = ()
        self._member = False
        self._raw: tuple[bytes, ...] = ()
        self._values: tuple[Any, ...] | None = ()

    @property
    def key(self) -> PreparedKey:
        return self._pk

    def member(self) -> bool:
        """True while the key has a row. One version load when nothing moved."""
        if self._ver[self._b] == self._v:
            return self._member
        return self._refresh()

    def values(self) -> tuple[Any, ...]:
        """The key's values (at most one for a set), cached like ``member``."""
        if self._ver[self._b] != self._v:
            self._refresh()
        vals = self._values
        if vals is None:
            vals = self._values = tuple(_unpack(x) for x in self._raw)
        return vals

    def _refresh(self) -> bool:
        ver = self._ver
        seen = self._seen
        if seen:
            for b, v in seen:
                if ver[b] != v:
                    break
            else:
                return self._member
        rows, seen = self._t._read(self._pk)
        self._raw = raw = tuple(rows)
        self._values = None
        self._member = m = bool(raw)
        self._seen = seen
        if len(seen) == 1:
            self._b, self._v = seen[0]
        else:
            self._b, self._v = self._pk.b, -1
        return m


class Table:
    """One hash table of kind ``set`` (one row per key; insert replaces) or ``bag`` (several rows
    per key; inserting an identical (key, value) again is a no-op).

    Keys and values are anything msgpack packs; they come back as msgpack unpacks them
    (arrays as tuples). Keys are compared by their packed bytes (so ``1``, ``1.0`` and ``True``
    are three keys). Every operation accepts a key or a :class:`PreparedKey` (prepare keys you
    use more than once: packing and hashing cost more than the lookup itself).

    Writes take ``lock`` (reentrant: hold it around several operations to compose them
    atomically; the same methods then simply run under the held lock). Reads never take it,
    except after ``READ_RETRIES`` attempts that met a writer (or a bucket a killed writer left
    odd, which the lock's recovery repairs).
    """

    RECORD_HEADER = RECORD_HEADER

    # ---------------------------------------------------------------- layout
    @staticmethod
    def region_size(capacity: int, record_size: int) -> int:
        """Bytes a table of ``capacity`` rows of ``record_size``-byte records needs (a multiple
        of 64)."""
        return _geometry(capacity, record_size)[5]

    @staticmethod
    def record_size_for(max_key: int, max_value: int) -> int:
        """The record size holding a packed key of ``max_key`` and a packed value of
        ``max_value`` bytes."""
        return _round8(RECORD_HEADER + max_key + max_value)

    @staticmethod
    def format(buf: memoryview, capacity: int, record_size: int) -> None:
        """Write an empty table into ``buf`` (at least ``region_size`` bytes; zero-filled here,
        which also touches every page)."""
        nslots, nbuckets, _, _, free_off, size = _geometry(capacity, record_size)
        if len(buf) < size:
            raise ValueError(f"region of {len(buf)} bytes is smaller than the table's {size}")
        chunk = bytes(min(size, 1 << 20))
        for off in range(0, size, len(chunk)):
            n = min(len(chunk), size - off)
            buf[off:off + n] = chunk[:n]
        _HDR.pack_into(buf, 0, MAGIC, capacity, record_size, nslots, nbuckets)
        free = buf[free_off:free_off + 4 * (capacity + 1)].cast("I")
        try:
            for i in range(capacity + 1):  # pops 0, 1, 2, ...
                free[i] = capacity - i
        finally:
            free.release()
        struct.pack_into("<QQQ", buf, 24, 0, capacity + 1, 0)

    def __init__(self, name: str, buf: memoryview, *, kind: Kind, capacity: int,
                 record_size: int, hash_key: bytes, lock: Lock) -> None:
        if kind not in ("set", "bag"):
            raise ValueError(f"table kind must be 'set' or 'bag', got {kind!r}")
        if not isinstance(hash_key, bytes | bytearray) or not 1 <= len(hash_key) <= 64:
            raise ValueError("hash_key must be 1..64 bytes")
        nslots, nbuckets, idx_off, heap_off, free_off, size = _geometry(capacity, record_size)
        if len(buf) < size:
            raise RegistryIncompatible(
                f"table {name!r}: region of {len(buf)} bytes, layout needs {size}")
        header = _HDR.unpack_from(buf, 0)
        if header != (MAGIC, capacity, record_size, nslots, nbuckets):
            raise RegistryIncompatible(
                f"table {name!r}: header {header!r} does not match the layout "
                f"{(MAGIC, capacity, record_size, nslots, nbuckets)!r}")
        self.name = name
        self.kind: Kind = kind
        self.capacity = capacity
        self.record_size = record_size
        self.nslots = nslots
        self._set = kind == "set"
        self._h0 = _blake2b(key=bytes(hash_key), digest_size=8)
        self._lock = lock
        self._mask = nslots - 1
        self._wmask = 2 * nslots - 1  # over index words
        self._nwords = 2 * nslots
        self._payload = record_size - RECORD_HEADER
        self._rs = struct.Struct(f"<IIIIQ{self._payload}s")  # a whole record, zero padded
        self._heap = heap_off
        self._buf = buf[:size]
        self._hq = self._buf[0:HEADER_SIZE].cast("Q")
        self._ver = self._buf[HEADER_SIZE:HEADER_SIZE + 8 * nbuckets].cast("Q")
        self._idx = self._buf[idx_off:heap_off].cast("Q")
        self._free = self._buf[free_off:free_off + 4 * (capacity + 1)].cast("I")
        self._logged_pid = 0  # the process that logged this table's corruption (log once)

    def close(self) -> None:
        """Release the memoryviews on the segment (so that the mapping can be closed)."""
        for name in ("_hq", "_ver", "_idx", "_free", "_buf"):
            mv = getattr(self, name, None)
            if mv is not None:
                mv.release()

    def __repr__(self) -> str:
        return f"<Table {self.name!r} {self.kind} capacity={self.capacity}>"

    # ---------------------------------------------------------------- keys
    def _hash(self, kbytes: bytes) -> int:
        h = self._h0.copy()  # keyed blake2b: copying the keyed state skips the key block
        h.update(kbytes)
        return _from_bytes(h.digest(), "little") or 1

    def prepare(self, key: Any) -> PreparedKey:
        """Pack and hash ``key`` once; pass the result to any operation of this table."""
        if key.__class__ is PreparedKey:
            if key.t is self:
                return key
            key = key.key
        kbytes = _pack(key)
        h = self._hash(kbytes)
        return PreparedKey(self, key, kbytes, h, h & self._mask)

    # ---------------------------------------------------------------- records
    def _record(self, r: int) -> tuple[bytes, bytes, int] | None:
        """(kbytes, vbytes, stamp) of record ``r``, or None when it fails validation."""
        if r > self.capacity:
            return None
        off = self._heap + r * self.record_size
        crc, kl, vl, _, stamp, body = self._rs.unpack_from(self._buf, off)
        n = kl + vl
        if n > self._payload:
            return None
        body = body[:n]
        if _crc32(body, (stamp ^ kl << 16 ^ vl ^ _SEED) & _M32) != crc:
            return None
        return body[:kl], body[kl:], stamp

    def _check_size(self, kbytes: bytes, vbytes: bytes) -> None:
        if len(kbytes) + len(vbytes) > self._payload:
            raise RowTooLarge(
                f"table {self.name!r}: row of {len(kbytes)}+{len(vbytes)} packed bytes exceeds "
                f"the record payload of {self._payload} bytes")

    # ---------------------------------------------------------------- lock-free reads
    # Memory ordering: the seqlock relies on x86-64 (TSO): a writer's plain stores (version odd,
    # slots, version even) become visible in program order, and a reader's loads (version, slots,
    # version again) are not reordered with older loads; every u64 goes through a 'Q' memoryview
    # as one aligned 8-byte move, never torn, and CPython cannot reorder the separate C calls.
    # A weakly ordered CPU (ARM, POWER) would need fences around these stores and loads.

    def _probe(self, pk: PreparedKey) -> tuple[list[bytes], list[tuple[int, int]]] | None:
        """One optimistic probe: (raw values, [(bucket, version) read]) or None when it met a
        writer (odd or moved version) or a record failing validation."""
        ver = self._ver
        idx = self._idx
        wmask = self._wmask
        h = pk.hash
        j = pk.j
        b = pk.b
        v = ver[b]
        if v & 1:
            return None
        seen = [(b, v)]
        out: list[bytes] = []
        for _ in range(self.nslots):
            sh = idx[j]
            if not sh:
                break
            if sh == h:
                rec = self._record(idx[j + 1])
                if rec is None:
                    self._unless_corrupt(seen, "a referenced record fails validation")
                    return None
                if rec[0] == pk.kbytes:
                    out.append(rec[1])
                    if self._set:  # a set holds one row per key: the probe can stop here
                        break
            j = (j + 2) & wmask
            if not j & 31:  # the next slot opens a new bucket
                b = j >> 5
                v = ver[b]
                if v & 1:
                    return None
                seen.append((b, v))
        else:
            self._unless_corrupt(seen, "a probe met no empty slot")
            return None
        for b, v in seen:
            if ver[b] != v:
                return None
        return out, seen

    def _unless_corrupt(self, seen: list[tuple[int, int]], what: str) -> None:
        """Return (the caller retries) if a version in ``seen`` moved: the probe raced a writer.
        Else the bytes themselves are wrong: raise TableCorrupted (the reader goes to the lock)."""
        ver = self._ver
        for b, v in seen:
            if ver[b] != v:
                return None
        raise TableCorrupted(f"table {self.name!r}: {what}")

    def _read(self, pk: PreparedKey) -> tuple[list[bytes], tuple[tuple[int, int], ...]]:
        """Raw values of ``pk``'s rows and the (bucket, version) pairs that validated them; never
        torn. Falls back to reading under the lock after READ_RETRIES attempts, or at once when
        a probe meets corruption (which is repaired there)."""
        for attempt in range(READ_RETRIES):
            try:
                got = self._probe(pk)
            except TableCorrupted:
                break
            if got is not None:
                return got[0], tuple(got[1])
            if attempt >= _SPIN_BEFORE_YIELD:
                os.sched_yield()  # let a preempted writer finish
        with self._lock:
            try:
                out = [e[3] for e in self._find(pk)]
            except TableCorrupted as err:
                self._repair(str(err))
                out = [e[3] for e in self._find(pk)]
            try:
                got = self._probe(pk)  # under the lock no writer moves a version
            except TableCorrupted:  # pragma: no cover - _find just found the probe sound
                got = None
            seen = tuple(got[1]) if got is not None else ()
            return out, seen

    def member(self, key: Any) -> bool:
        """True if ``key`` has a row. A miss costs a version load, the hashes of the probed slots
        of the home bucket, and the version again."""
        try:
            if key.t is not self:  # prepared for another table
                key = self.prepare(key)
        except AttributeError:  # a plain key (no msgpack-able value has an attribute "t")
            key = self.prepare(key)
        ver = self._ver
        b = key.b
        v = ver[b]
        j = key.j
        idx = self._idx
        sh = idx[j]
        if not sh:  # empty home slot
            if ver[b] == v & -2:  # unchanged and even (versions only grow)
                return False
        else:  # hashes only, within the home bucket
            h = key.hash
            while sh != h:
                j += 2
                if not j & 31:
                    break
                sh = idx[j]
                if not sh:
                    if ver[b] == v & -2:
                        return False
                    break
        return bool(self._read(key)[0])

    def lookup(self, key: Any) -> list[Any]:
        """The values of ``key``'s rows: ``[]``, ``[value]`` for a set, any number for a bag."""
        try:
            if key.t is not self:  # prepared for another table
                key = self.prepare(key)
        except AttributeError:  # a plain key (no msgpack-able value has an attribute "t")
            key = self.prepare(key)
        ver = self._ver
        b = key.b
        v = ver[b]
        j = key.j
        idx = self._idx
        sh = idx[j]
        if not sh:  # empty home slot
            if ver[b] == v & -2:  # unchanged and even (versions only grow)
                return []
        else:  # hashes only, within the home bucket
            h = key.hash
            while sh != h:
                j += 2
                if not j & 31:
                    break
                sh = idx[j]
                if not sh:
                    if ver[b] == v & -2:
                        return []
                    break
        return [_unpack(x) for x in self._read(key)[0]]

    def get(self, key: Any, default: Any = None) -> Any:
        """The value of ``key`` (for a bag: one of its values), or ``default``."""
        vals = self.lookup(key)
        return vals[0] if vals else default

    def count(self) -> int:
        """Number of rows (the header counter: exact whenever no writer is mid-operation).
        A counter at or above capacity that disagrees with the free stack (garbage, or a writer
        mid-operation) is not trusted: the count then comes from the index (still lock-free)."""
        n = self._hq[_ROWS]
        if n >= self.capacity and n + self._hq[_TOP] != self.capacity + 1:
            return min(self.nslots - self._idx.tolist()[::2].count(0), self.capacity)
        return n

    def watch(self, key: Any) -> Watch:
        """A cached poll of ``key`` (see :class:`Watch`)."""
        return Watch(self, self.prepare(key))

    def _entries(self, words: list[int]) -> list[tuple[int, int, bytes, bytes, int]]:
        """(slot, record, kbytes, vbytes, stamp) of every entry of ``words`` (the index as a
        list); stamp is -1 (and the bytes empty) where the record fails validation."""
        out = []
        rec = self._record
        for j in range(0, self._nwords, 2):
            if words[j]:
                r = rec(words[j + 1])
                if r is not None:
                    out.append((j >> 1, words[j + 1], r[0], r[1], r[2]))
                else:
                    out.append((j >> 1, words[j + 1], b"", b"", -1))
        return out

    def _snapshot(self) -> list[tuple[int, int, bytes, bytes, int]]:
        """A consistent copy of every row: optimistic (all versions even and unchanged around
        the copy), else under the lock. A copy with unmoved versions in which an entry fails
        validation or shares its record with another is corrupt: it is repaired under the lock
        (so no row is ever returned twice)."""
        ver = self._ver
        for attempt in range(READ_RETRIES // 4):
            if attempt >= _SPIN_BEFORE_YIELD:
                os.sched_yield()
            v0 = ver.tolist()
            if any(v & 1 for v in v0):
                continue
            ents = self._entries(self._idx.tolist())
            if ver.tolist() != v0:
                continue
            if _sound(ents):
                return ents
            break
        with self._lock:
            ents = self._entries(self._idx.tolist())
            if not _sound(ents):  # under the lock: corruption, not a race
                self._repair(f"table {self.name!r}: an index entry references a record failing "
                             "validation or referenced twice")
                ents = self._entries(self._idx.tolist())
            return [e for e in ents if e[4] >= 0]

    def scan(self, pred: Callable[[Any, Any], bool] | None = None) -> list[tuple[Any, Any]]:
        """Every (key, value) for which ``pred(key, value)`` is true (all rows when None), from
        one consistent snapshot, in index order."""
        out = []
        for _, _, kb, vb, _ in self._snapshot():
            k, v = _unpack(kb), _unpack(vb)
            if pred is None or pred(k, v):
                out.append((k, v))
        return out

    def scan_slots(self, start: int, count: int) -> tuple[list[tuple[Any, Any]], int]:
        """The (key, value) rows whose entries lie in index slots ``start .. start + count - 1``
        (cyclically), and the slot to continue from: a bounded piece of a full scan, for sweeps
        that must not hold the lock for a whole table. ``start`` is rounded down and ``count``
        up to whole buckets; ``count`` is capped at ``nslots``. Consistent within the piece
        (optimistic, else under the lock); a row a backward shift moves across the piece's edge
        between two calls may be missed by that pass."""
        nb = self.nslots // BUCKET_SLOTS
        b0 = (start % self.nslots) // BUCKET_SLOTS
        n = min(nb, max(1, -(-count // BUCKET_SLOTS)))
        buckets = [(b0 + i) % nb for i in range(n)]
        ver = self._ver
        idx = self._idx
        rec = self._record

        def read(strict: bool) -> list[tuple[bytes, bytes]] | None:
            out = []
            for b in buckets:
                j = 2 * BUCKET_SLOTS * b
                for w in range(j, j + 2 * BUCKET_SLOTS, 2):
                    if idx[w]:
                        r = rec(idx[w + 1])
                        if r is not None:
                            out.append((r[0], r[1]))
                        elif strict:  # torn by a writer, or damage fsck will drop
                            return None
            return out

        got = None
        for attempt in range(READ_RETRIES // 4):
            if attempt >= _SPIN_BEFORE_YIELD:
                os.sched_yield()
            v0 = [ver[b] for b in buckets]
            if any(v & 1 for v in v0):
                continue
            got = read(True)
            if got is not None and [ver[b] for b in buckets] == v0:
                break
            got = None
        if got is None:
            with self._lock:
                got = read(False) or []
        nxt = ((b0 + n) % nb) * BUCKET_SLOTS
        return [(_unpack(kb), _unpack(vb)) for kb, vb in got], nxt

    def _index_words(self) -> list[int]:
        """The index as a list of u64 words, consistent (optimistic, else under the lock)."""
        ver = self._ver
        for _ in range(READ_RETRIES // 4):
            v0 = ver.tolist()
            words = self._idx.tolist()
            if not any(v & 1 for v in v0) and ver.tolist() == v0:
                return words
            os.sched_yield()
        with self._lock:
            return self._idx.tolist()

    def stats(self) -> dict[str, Any]:
        """``rows``, ``capacity``, ``nslots``, ``load`` (rows / nslots), ``probe_histogram``
        {distance from home slot: entries}, ``max_probe``; from one consistent index read."""
        hist: dict[int, int] = {}
        mask = self._mask
        words = self._index_words()
        for j in range(0, self._nwords, 2):
            h = words[j]
            if h:
                d = ((j >> 1) - (h & mask)) & mask
                hist[d] = hist.get(d, 0) + 1
        n = sum(hist.values())
        return {
            "rows": n,
            "capacity": self.capacity,
            "nslots": self.nslots,
            "load": n / self.nslots,
            "probe_histogram": dict(sorted(hist.items())),
            "max_probe": max(hist, default=0),
        }

    # ---------------------------------------------------------------- writes (hold the lock)
    def _find(self, pk: PreparedKey) -> list[tuple[int, int, bytes, bytes]]:
        """(slot, record, kbytes, vbytes) of ``pk``'s rows; the caller holds the lock. Raises
        TableCorrupted when the probe meets no empty slot or a record failing validation (under
        the lock neither is a race)."""
        idx = self._idx
        wmask = self._wmask
        h = pk.hash
        j = pk.j
        out = []
        for _ in range(self.nslots):
            sh = idx[j]
            if not sh:
                break
            if sh == h:
                r = idx[j + 1]
                rec = self._record(r)
                if rec is None:
                    raise TableCorrupted(
                        f"table {self.name!r}: a referenced record fails validation")
                if rec[0] == pk.kbytes:
                    out.append((j >> 1, r, rec[0], rec[1]))
            j = (j + 2) & wmask
        else:
            raise TableCorrupted(f"table {self.name!r}: a probe met no empty slot")
        return out

    def _write_record(self, kbytes: bytes, vbytes: bytes) -> int:
        """Fill the record on top of the free stack (it is unreferenced), then pop it."""
        hq = self._hq
        top = hq[_TOP]
        r = self._free[top - 1] if 0 < top <= self.capacity + 1 else self.capacity + 1
        if r > self.capacity:  # the free stack is damaged: rebuild it and retry
            self._repair(f"table {self.name!r}: free-stack top {top} or record {r} out of range")
            self._lock.dirty = True  # the caller's write goes on
            top = hq[_TOP]
            if top == 0:
                raise TableFull(f"table {self.name!r} has no free record")
            r = self._free[top - 1]
        stamp = hq[_STAMP] + 1
        if stamp >= _STAMP_MAX:  # checked before the first store
            raise TableCorrupted(f"table {self.name!r}: stamp counter {stamp - 1} is garbage")
        hq[_STAMP] = stamp
        kl = len(kbytes)
        vl = len(vbytes)
        body = kbytes + vbytes
        self._rs.pack_into(self._buf, self._heap + r * self.record_size,
                           _crc32(body, (stamp ^ kl << 16 ^ vl ^ _SEED) & _M32),
                           kl, vl, 0, stamp, body)
        hq[_TOP] = top - 1
        return r

    def _free_record(self, r: int) -> None:
        hq = self._hq
        top = hq[_TOP]
        if top <= self.capacity:  # else the stack is damaged; fsck rebuilds it
            self._free[top] = r
            hq[_TOP] = top + 1

    def _publish(self, pk: PreparedKey, r: int) -> None:
        """Put record ``r`` in the first empty slot of ``pk``'s probe: record number, then
        hash (the store that makes the row visible)."""
        idx = self._idx
        ver = self._ver
        j = pk.j
        for _ in range(self.nslots):
            if not idx[j]:
                break
            j = (j + 2) & self._wmask
        else:  # before any store: fsck returns the popped record to the free stack
            raise TableCorrupted(f"table {self.name!r}: a probe met no empty slot")
        b = j >> 5
        ver[b] += 1
        idx[j + 1] = r
        idx[j] = pk.hash
        ver[b] += 1
        self._hq[_ROWS] += 1

    def _delete_slot(self, s: int) -> None:
        """Remove the entry in slot ``s`` by backward shift, then free its record."""
        idx = self._idx
        ver = self._ver
        mask = self._mask
        r = idx[2 * s + 1]
        marked = [s >> 4]
        ver[s >> 4] += 1
        i = j = s
        for _ in range(self.nslots):
            j = (j + 1) & mask
            hj = idx[2 * j]
            if not hj:
                break
            k = hj & mask
            # the entry at j stays if its home lies cyclically in (i, j]
            if (i < k <= j) if i <= j else (i < k or k <= j):
                continue
            bj = j >> 4
            if bj not in marked:
                ver[bj] += 1
                marked.append(bj)
            idx[2 * i + 1] = idx[2 * j + 1]  # a half-copied slot fails fsck's hash check
            idx[2 * i] = hj  # now a duplicate of slot j: fsck keeps one
            i = j
        else:  # mid-shift, marked buckets odd: the state of a killed writer, which fsck repairs
            raise TableCorrupted(f"table {self.name!r}: a backward shift met no empty slot")
        idx[2 * i] = 0
        idx[2 * i + 1] = 0
        for b in marked:
            ver[b] += 1
        hq = self._hq
        rows = hq[_ROWS]
        if rows:  # else the counter is garbage (check() recounts it); never store -1
            hq[_ROWS] = rows - 1
        self._free_record(r)

    def _locate(self, h: int, r: int) -> int:
        """The slot holding (hash ``h``, record ``r``), or -1; the caller holds the lock."""
        idx = self._idx
        j = 2 * (h & self._mask)
        for _ in range(self.nslots):
            sh = idx[j]
            if not sh:
                return -1
            if sh == h and idx[j + 1] == r:
                return j >> 1
            j = (j + 2) & self._wmask
        return -1

    def insert(self, key: Any, value: Any) -> None:
        """Set: insert or replace ``key``'s row. Bag: add the object unless an identical one is
        there. Raises RowTooLarge (before taking the lock or writing) or TableFull (or
        TableCorrupted: see the module docstring)."""
        if key.__class__ is not PreparedKey or key.t is not self:
            key = self.prepare(key)
        vb = _pack(value)
        if len(key.kbytes) + len(vb) > self._payload:
            self._check_size(key.kbytes, vb)
        return self._write(self._insert, key, vb)

    def _write(self, op: Callable[..., _T], *args: Any) -> _T:
        """``op(*args)`` under the lock; corruption it meets is repaired (fsck) and ``op`` tried
        once more, whose :class:`TableCorrupted` then propagates."""
        with self._lock:
            try:
                return op(*args)
            except TableCorrupted as e:
                self._repair(str(e))
            return op(*args)

    def _insert(self, key: PreparedKey, vb: bytes) -> None:
        lock = self._lock
        found = self._find(key)
        if found and self._set:
            s, old, _, oldvb = found[0]
            if oldvb == vb:
                return
            lock.dirty = True
            new = self._write_record(key.kbytes, vb)
            b = s >> 4
            ver = self._ver
            ver[b] += 1
            self._idx[2 * s + 1] = new  # the commit: one aligned store
            ver[b] += 1
            self._free_record(old)
            lock.dirty = False
            return
        for e in found:
            if e[3] == vb:
                return
        if self._hq[_ROWS] >= self.capacity:
            self._full()
        lock.dirty = True
        self._publish(key, self._write_record(key.kbytes, vb))
        lock.dirty = False

    def _full(self) -> None:
        """The row counter says full: raise TableFull, unless the counters are implausible
        (garbage): then recount them (fsck) and return if that made room. O(1) when they are
        plausible; the caller holds the lock."""
        hq = self._hq
        rows = hq[_ROWS]
        if rows > self.capacity or rows + hq[_TOP] != self.capacity + 1:
            self._repair(f"table {self.name!r}: row count {rows} and free-stack top {hq[_TOP]} "
                         f"do not add up to {self.capacity + 1} records")
            if hq[_ROWS] < self.capacity:
                return
        raise TableFull(f"table {self.name!r} is full ({self.capacity} rows)")

    def insert_new(self, key: Any, value: Any) -> bool:
        """Insert only if ``key`` has no row; False (nothing written) if it has one."""
        if key.__class__ is not PreparedKey or key.t is not self:
            key = self.prepare(key)
        vb = _pack(value)
        self._check_size(key.kbytes, vb)
        return self._write(self._insert_new, key, vb)

    def _insert_new(self, key: PreparedKey, vb: bytes) -> bool:
        lock = self._lock
        if self._find(key):
            return False
        if self._hq[_ROWS] >= self.capacity:
            self._full()
        lock.dirty = True
        self._publish(key, self._write_record(key.kbytes, vb))
        lock.dirty = False
        return True

    def delete(self, key: Any) -> int:
        """Remove every row of ``key``; returns how many."""
        if key.__class__ is not PreparedKey or key.t is not self:
            key = self.prepare(key)
        return self._write(self._delete, key)

    def _delete(self, key: PreparedKey) -> int:
        lock = self._lock
        found = self._find(key)
        if found:
            lock.dirty = True
            # from the far end: a backward shift moves only entries after the hole, never
            # the ones found before it (the cluster cannot wrap: load <= 50 %)
            for s, _, _, _ in reversed(found):
                self._delete_slot(s)
            lock.dirty = False
        return len(found)

    def delete_object(self, key: Any, value: Any) -> bool:
        """Remove exactly one row equal to (key, value); False if there is none."""
        if key.__class__ is not PreparedKey or key.t is not self:
            key = self.prepare(key)
        vb = _pack(value)
        return self._write(self._delete_object, key, vb)

    def _delete_object(self, key: PreparedKey, vb: bytes) -> bool:
        lock = self._lock
        for s, _, _, v in self._find(key):
            if v == vb:
                lock.dirty = True
                self._delete_slot(s)
                lock.dirty = False
                return True
        return False

    # ---------------------------------------------------------------- sweeps (short holds)
    def sweep_rows(self) -> list[tuple[int, int, bytes, bytes]]:
        """``(hash, record, kbytes, vbytes)`` of every row, without holding the lock for more
        than one copy of the index: the index is copied consistently (optimistic; else under
        the lock, one list copy), then each referenced record is read lock-free and kept only
        if it validates (length, crc) and its key still hashes to its entry. A row a writer
        changed after the index copy is missing or shows its newer content: callers re-validate
        under the lock (:meth:`sweep_delete`) before acting on a row."""
        ver = self._ver
        words = None
        for attempt in range(READ_RETRIES // 4):
            if attempt >= _SPIN_BEFORE_YIELD:
                os.sched_yield()
            v0 = ver.tolist()
            if any(v & 1 for v in v0):
                continue
            w = self._idx.tolist()
            if ver.tolist() == v0:
                words = w
                break
        if words is None:
            with self._lock:
                words = self._idx.tolist()
        out = []
        rec = self._record
        hash_ = self._hash
        for j in range(0, self._nwords, 2):
            h = words[j]
            if h:
                r = words[j + 1]
                got = rec(r)
                if got is not None and hash_(got[0]) == h:
                    out.append((h, r, got[0], got[1]))
        return out

    def sweep_delete(self, rows: list[tuple[int, int, bytes, bytes]],
                     pred: Callable[[Any, Any], bool] | None = None,
                     on_chunk: Callable[[list[tuple[Any, Any]]], None] | None = None,
                     hold: float = SWEEP_HOLD) -> int:
        """Delete ``rows`` (as :meth:`sweep_rows` gives them) in order, in chunks that each
        hold the lock for about ``hold`` seconds (at least one row per chunk). Under the lock
        each row is re-validated: it is deleted only if its entry still references the same
        record holding the same bytes and, when given, ``pred(key, value)`` is still true; a
        row gone or changed meanwhile is left alone. ``on_chunk(deleted)`` runs under the same
        hold, after the chunk's deletions, with the (key, value) pairs deleted. Returns the
        rows deleted. When the caller already holds the lock everything runs in its hold."""
        lock = self._lock
        if pred is None and len(rows) >= SWEEP_BULK:
            bulk = self._bulk_delete(rows)
            if bulk is not None:
                if on_chunk is not None:  # in key order: a slice sees few distinct keys
                    bulk.sort(key=lambda kv: _pack(kv[0]))
                    for c in range(0, len(bulk), 2 * SWEEP_BULK):
                        with lock:
                            on_chunk(bulk[c:c + 2 * SWEEP_BULK])
                return len(bulk)
        n = 0
        i = 0
        total = len(rows)
        clock = time.perf_counter
        buf, heap, rsize = self._buf, self._heap, self.record_size
        while i < total:
            with lock:
                t_end = clock() + hold
                gone: list[tuple[Any, Any]] = []
                while i < total:
                    h, r, kb, vb = rows[i]
                    i += 1
                    s = self._locate(h, r)
                    if s < 0:
                        continue
                    # the same bytes as read lock-free (a referenced record is never written
                    # in place, so equal lengths and body mean the same row)
                    off = heap + r * rsize
                    body = kb + vb
                    if (_LENS.unpack_from(buf, off + 4) != (len(kb), len(vb))
                            or buf[off + RECORD_HEADER:off + RECORD_HEADER + len(body)] != body):
                        continue
                    k, v = _unpack(kb), _unpack(vb)
                    if pred is not None and not pred(k, v):
                        continue
                    lock.dirty = True
                    try:
                        self._delete_slot(s)
                    except TableCorrupted as e:
                        self._repair(str(e))
                        continue
                    lock.dirty = False
                    gone.append((k, v))
                    if clock() >= t_end:
                        break
                if gone and on_chunk is not None:
                    on_chunk(gone)
                n += len(gone)
        return n

    def _bulk_delete(self, rows: list[tuple[int, int, bytes, bytes]],
                     tries: int = 3) -> list[tuple[Any, Any]] | None:
        """Delete those of ``rows`` still present unchanged in one short hold: the new index
        (every other entry re-inserted from its home slot, so no probe crosses an empty slot)
        and free stack are computed lock-free from a consistent copy, then stored under the lock
        with two slice copies, if no bucket version moved since the copy (no writer touched the
        index, so no referenced record changed either). Returns the (key, value) pairs deleted,
        or None when writers kept moving the index (``tries`` times) or the counters are
        implausible: the caller falls back to deleting row by row."""
        ver, idx, mask = self._ver, self._idx, self._mask
        want = {(h, r): kb + vb for h, r, kb, vb in rows}
        buf, heap, rsize = self._buf, self._heap, self.record_size
        for attempt in range(tries):
            if attempt:
                os.sched_yield()
            v0 = ver.tolist()
            if any(v & 1 for v in v0):
                continue
            words = idx.tolist()
            top = self._hq[_TOP]
            freed: list[int] = []
            gone = []
            new = [0] * self._nwords
            for j in range(0, self._nwords, 2):
                h = words[j]
                if not h:
                    continue
                r = words[j + 1]
                body = want.get((h, r))
                if body is not None:
                    off = heap + r * rsize
                    kl, vl = _LENS.unpack_from(buf, off + 4)
                    if kl + vl == len(body) and \
                            buf[off + RECORD_HEADER:off + RECORD_HEADER + len(body)] == body:
                        freed.append(r)
                        gone.append((body[:kl], body[kl:]))
                        continue
                k = 2 * (h & mask)
                for _ in range(self.nslots):
                    if not new[k]:
                        break
                    k = (k + 2) & self._wmask
                new[k] = h
                new[k + 1] = r
            if ver.tolist() != v0:
                continue
            if not gone:
                return []
            if top + len(freed) > self.capacity + 1:
                return None
            nidx = array("Q", new)
            nfree = array("I", freed)
            odd = array("Q", [v + 1 for v in v0])
            even = array("Q", [v + 2 for v in v0])
            lock = self._lock
            with lock:
                if ver.tolist() != v0 or self._hq[_TOP] != top:
                    continue
                hq = self._hq
                rows_now = hq[_ROWS]
                lock.dirty = True
                ver[:] = odd
                idx[:] = nidx
                ver[:] = even
                self._free[top:top + len(freed)] = nfree
                hq[_TOP] = top + len(freed)
                hq[_ROWS] = max(0, rows_now - len(freed))
                lock.dirty = False
            return [(_unpack(kb), _unpack(vb)) for kb, vb in gone]
        return None

    def delete_where(self, pred: Callable[[Any, Any], bool]) -> int:
        """Remove every row for which ``pred(key, value)`` is true; returns how many. ``pred``
        sees every row before anything is removed (if it raises, nothing is). Unless the
        caller holds the lock, the rows are chosen lock-free and deleted in short holds
        (:meth:`sweep_delete`), where ``pred`` is asked again for each row."""
        lock = self._lock
        if not lock.held_by_me():
            chosen = [row for row in self.sweep_rows()
                      if pred(_unpack(row[2]), _unpack(row[3]))]
            return self.sweep_delete(chosen, pred) if chosen else 0
        with lock:
            words = self._idx.tolist()
            doomed = [(words[2 * s], r) for s, r, kb, vb, stamp in self._entries(words)
                      if stamp >= 0 and pred(_unpack(kb), _unpack(vb))]
            n = 0
            for h, r in doomed:
                s = self._locate(h, r)
                if s >= 0:
                    lock.dirty = True
                    try:
                        self._delete_slot(s)
                    except TableCorrupted as e:  # the rest is found again after the repair
                        self._repair(str(e))
                        continue
                    lock.dirty = False
                    n += 1
            return n

    # ---------------------------------------------------------------- corruption
    def _repair(self, why: str) -> dict[str, int]:
        """Repair the table with fsck (the caller holds the lock) after finding ``why``; log it
        once per process and table. ``lock.dirty`` stays True throughout, so a repair cut short
        is finished by the lock's own."""
        lock = self._lock
        lock.dirty = True
        rep = self.fsck()
        lock.dirty = False
        pid = os.getpid()
        if self._logged_pid != pid:
            self._logged_pid = pid
            log.error("corrupted shared memory: %s; repaired with fsck: %s (logged once per "
                      "process and table)", why,
                      {k: v for k, v in rep.items() if v} or "nothing to repair")
        return rep

    def _implausible(self, locked: bool, deep: bool) -> str | None:
        """What is wrong with the header counters or the free stack, or None. Lock-free (not
        ``locked``) a writer mid-operation can make a healthy table look wrong: confirm under
        the lock. O(nslots + capacity) list work; ``deep`` also validates every referenced
        record and its hash, keys' uniqueness (set) and reachability: what fsck would repair."""
        hq = self._hq
        rows, top, stamp = hq[_ROWS], hq[_TOP], hq[_STAMP]
        nrec = self.capacity + 1
        if rows > self.capacity or top > nrec or rows + top != nrec:
            return f"row count {rows} and free-stack top {top} do not add up to {nrec} records"
        if stamp >= _STAMP_MAX:
            return f"stamp counter {stamp}"
        words = self._idx.tolist()
        refs = [r for h, r in zip(words[::2], words[1::2], strict=True) if h]
        if len(refs) != rows:
            return f"row count {rows}, index entries {len(refs)}"
        held = set(self._free.tolist()[:top])
        held.update(refs)
        if len(held) != nrec or max(held) >= nrec:
            return "free stack and index do not hold each record exactly once"
        if locked and any(v & 1 for v in self._ver.tolist()):
            return "a bucket version is odd with no writer running"
        if deep:
            hash_ = self._hash
            keys = set()
            for s, _, kb, _, stamp in self._entries(words):
                if stamp < 0 or hash_(kb) != words[2 * s]:
                    return f"the entry in slot {s} does not match its record"
                keys.add(kb)
            if self._set and len(keys) != rows:
                return "a key has two rows"
            if _reachability_moves(list(words), self._mask):
                return "an entry lies beyond an empty slot of its probe"
        return None

    def check(self, deep: bool = False) -> dict[str, int] | None:
        """Check the header counters (rows, free-stack top, stamp) and the free stack for
        plausibility against the index; when they are wrong, repair (fsck: recounts them) and
        log once. Returns fsck's repair counts, or None when all was plausible. Lock-free when
        it is, else under the lock. Only ``deep`` decodes records (about 3 us a row): it
        finds whatever fsck would repair, e.g. garbage over the hash of an entry, which no
        counter shows and no lookup meets. Without it, a corrupted record is repaired by the
        first operation that reads it."""
        if self._implausible(False, deep) is None:
            return None
        os.sched_yield()  # a writer mid-operation looks implausible: look again before locking
        if self._implausible(False, deep) is None:
            return None
        with self._lock:
            if self._lock.dirty:  # called from inside a write of this thread: not now
                return None
            why = self._implausible(True, deep)
            return None if why is None else self._repair(f"table {self.name!r}: {why}")

    # ---------------------------------------------------------------- recovery
    def fsck(self) -> dict[str, int]:
        """Check and repair the table; the caller holds the lock. Returns counts of repairs,
        all zero for a healthy table (which it leaves untouched: no version moves).

        Drops index entries whose record number is out of range, whose record fails its
        length/crc check, or whose key does not hash to the entry; keeps one of entries sharing
        a record; for a set keeps only the newest (highest stamp) row of a key; moves entries
        back so that no empty slot lies between an entry's home and the entry; rebuilds the
        free stack from the records referenced; recounts the rows; makes every bucket version
        even. Every step leaves a state fsck handles, so a killed fsck is finished by the next.
        """
        rep = {"odd_versions": 0, "bad_entries": 0, "duplicate_entries": 0,
               "stale_rows": 0, "moved": 0, "free_stack": 0, "rows": 0}
        idx = self._idx
        ver = self._ver
        words = idx.tolist()
        drop: list[int] = []
        by_rec: dict[int, int] = {}
        by_key: dict[bytes, tuple[int, int]] = {}
        newest = 0
        for s, r, kb, _, stamp in self._entries(words):
            if stamp < 0 or self._hash(kb) != words[2 * s]:
                drop.append(s)
                rep["bad_entries"] += 1
                continue
            newest = max(newest, stamp)
            if r in by_rec:
                drop.append(s)
                rep["duplicate_entries"] += 1
                continue
            by_rec[r] = s
            if self._set:
                prev = by_key.get(kb)
                if prev is not None:
                    rep["stale_rows"] += 1
                    if prev[0] >= stamp:
                        drop.append(s)
                        del by_rec[r]
                        continue
                    drop.append(prev[1])
                    del by_rec[words[2 * prev[1] + 1]]
                by_key[kb] = (stamp, s)
        for s in drop:
            words[2 * s] = words[2 * s + 1] = 0
        moves = _reachability_moves(words, self._mask)
        versions = ver.tolist()
        odd = [b for b, v in enumerate(versions) if v & 1]
        rep["odd_versions"] = len(odd)
        rep["moved"] = len(moves)
        if drop or moves:
            for b, v in enumerate(versions):  # readers retry (or wait on our lock) meanwhile
                if not v & 1:
                    ver[b] = v + 1
            for s in drop:
                idx[2 * s] = 0
                idx[2 * s + 1] = 0
            for src, dst in moves:
                idx[2 * dst + 1] = idx[2 * src + 1]
                idx[2 * dst] = idx[2 * src]  # a duplicate until the next store: fsck keeps one
                idx[2 * src] = 0
                idx[2 * src + 1] = 0
            odd = list(range(len(versions)))
        hq = self._hq
        nrec = self.capacity + 1
        nfree = nrec - len(by_rec)
        top = hq[_TOP]
        if top != nfree or set(self._free.tolist()[:top]) | by_rec.keys() != set(range(nrec)):
            free = self._free
            for i, r in enumerate(r for r in range(nrec - 1, -1, -1) if r not in by_rec):
                free[i] = r
            hq[_TOP] = nfree
            rep["free_stack"] = 1
        if hq[_ROWS] != len(by_rec):
            hq[_ROWS] = len(by_rec)
            rep["rows"] = 1
        if hq[_STAMP] < newest or hq[_STAMP] >= _STAMP_MAX:
            hq[_STAMP] = newest
        for b in odd:
            v = ver[b]
            if v & 1:
                ver[b] = v + 1
        return rep


def _sound(ents: list[tuple[int, int, bytes, bytes, int]]) -> bool:
    """Every entry of ``ents`` (see ``Table._entries``) valid, no record referenced twice."""
    return all(e[4] >= 0 for e in ents) and len({e[1] for e in ents}) == len(ents)


def _reachability_moves(words: list[int], mask: int) -> list[tuple[int, int]]:
    """Moves (src slot, dst slot) that leave no empty slot between any entry's home and the
    entry, applied to ``words`` (the index as a list of u64 words) as they are computed.

    One pass in probe order, starting after an empty slot: each entry goes to the first empty
    slot from its home on. Entries passed earlier stay reachable (a move empties only the slot
    it leaves, which lies after them), so one pass suffices.
    """
    nslots = mask + 1
    start = next((s for s in range(nslots) if not words[2 * s]), None)
    if start is None:
        return []
    moves = []
    for step in range(1, nslots + 1):
        s = (start + step) & mask
        h = words[2 * s]
        if not h:
            continue
        e = h & mask
        while e != s and words[2 * e]:
            e = (e + 1) & mask
        if e != s:
            words[2 * e], words[2 * e + 1] = h, words[2 * s + 1]
            words[2 * s] = words[2 * s + 1] = 0
            moves.append((s, e))
    return moves
