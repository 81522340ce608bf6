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
              0   u32 crc32 of bytes [4, 24 + klen + vlen) of the record
              4   u32 klen, 8 u32 vlen, 12 u32 reserved (0)
              16  u64 stamp (table-wide increasing counter: the newest of two rows wins in fsck)
              24  klen bytes msgpack key, then vlen bytes msgpack value
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
"""

from __future__ import annotations

import hashlib
import os
import struct
import zlib
from collections.abc import Callable
from typing import Any, Literal, Protocol

import msgpack

from .exceptions import RegistryIncompatible, RowTooLarge, TableFull

__all__ = ["Kind", "Lock", "PreparedKey", "Table", "Watch"]

Kind = Literal["set", "bag"]

MAGIC = b"SHMTBL\x00\x01"
HEADER_SIZE = 64
RECORD_HEADER = 24  # bytes of record header before the key
BUCKET_SLOTS = 16  # index slots per seqlock bucket
READ_RETRIES = 64  # optimistic attempts before a reader falls back to the lock
_SPIN_BEFORE_YIELD = 4

_HDR = struct.Struct("<8sIIII")  # magic, capacity, record_size, nslots, nbuckets
_REC = struct.Struct("<IIIIQ")  # crc, klen, vlen, reserved, stamp
_REC_TAIL = struct.Struct("<IIIQ")  # the part after the crc (what the crc covers, with payload)
_CRC = struct.Struct("<I")
# u64 word numbers in the header
_ROWS, _TOP, _STAMP = 3, 4, 5

_packb = msgpack.packb
_unpackb = msgpack.unpackb
_blake2b = hashlib.blake2b
_crc32 = zlib.crc32
_from_bytes = int.from_bytes


def _pack(x: Any) -> bytes:
    return _packb(x, use_bin_type=True)


def _unpack(b: bytes) -> Any:
    return _unpackb(b, raw=False, use_list=False, strict_map_key=False)


def _round8(n: int) -> int:
    return (n + 7) & ~7


def _round64(n: int) -> int:
    return (n + 63) & ~63


def _geometry(capacity: int, record_size: int) -> tuple[int, int, int, int, int, int]:
    """(nslots, nbuckets, versions offset... ) -> nslots, nbuckets, idx_off, heap_off, free_off,
    total size."""
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

    def __enter__(self) -> object: ...
    def __exit__(self, *exc: object) -> None: ...


class PreparedKey:
    """A key with its msgpack bytes, keyed hash and home slot computed once (for one table).

    ``b`` is the home slot's bucket and ``j`` the home slot's word in the index (``2 * home``);
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
        self.b = home // BUCKET_SLOTS

    def __repr__(self) -> str:
        return f"PreparedKey({self.key!r}, home={self.home})"


class Watch:
    """A cached lookup of one prepared key: ``member()``/``values()`` re-read the table only
    when a bucket version seen last time has moved.

    Valid because records are immutable while referenced and every change of a slot moves its
    bucket's version: unchanged versions of every bucket the probe read mean an unchanged answer.
    """

    __slots__ = ("_b", "_member", "_pk", "_seen", "_t", "_v", "_values", "_ver")

    def __init__(self, table: Table, pk: PreparedKey) -> None:
        self._t = table
        self._pk = pk
        self._ver = table._ver
        self._b = pk.b
        self._v = -1  # never equal to a version: the first call reads
        self._seen: tuple[tuple[int, int], ...] = ()
        self._member = False
        self._values: tuple[Any, ...] = ()

    @property
    def key(self) -> PreparedKey:
        return self._pk

    def member(self) -> bool:
        """True while the key has a row. Costs one version load when nothing moved."""
        if self._ver[self._b] == self._v:
            return self._member
        return self._refresh()._member

    def values(self) -> tuple[Any, ...]:
        """The key's values (one for a set, any number for a bag), cached like ``member``."""
        if self._ver[self._b] == self._v:
            return self._values
        return self._refresh()._values

    def _refresh(self) -> Watch:
        ver = self._ver
        seen = self._seen
        if seen:
            for b, v in seen:
                if ver[b] != v:
                    break
            else:
                return self
        vals, seen = self._t._read(self._pk, True)
        self._values = tuple(vals)
        self._member = bool(vals)
        self._seen = seen
        if len(seen) == 1:
            self._b, self._v = seen[0]
        else:  # the probe spans several buckets (or no valid versions): slow path checks all
            self._b, self._v = self._pk.b, -1
        return self


class Table:
    """One hash table of kind ``set`` (one row per key; insert replaces) or ``bag`` (several rows
    per key; inserting an identical (key, value) again is a no-op).

    Keys and values are anything msgpack packs; they come back as msgpack unpacks them
    (arrays as tuples). Keys are compared by their packed bytes (so ``1``, ``1.0`` and ``True``
    are three keys). Every public operation accepts a key or a :class:`PreparedKey`.

    Writes take ``lock`` (reentrant: hold it around several operations to compose them
    atomically); reads never do, except as a fallback after ``READ_RETRIES`` torn attempts.
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
        """The record size holding a packed key of ``max_key`` and a value of ``max_value``
        bytes."""
        return _round8(RECORD_HEADER + max_key + max_value)

    @staticmethod
    def format(buf: memoryview, capacity: int, record_size: int) -> None:
        """Write an empty table into ``buf`` (at least ``region_size`` bytes; zero-filled here)."""
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
            for i in range(capacity + 1):  # pop order 0, 1, 2, ...
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
        magic, cap, rs, ns, nb = _HDR.unpack_from(buf, 0)
        if (magic, cap, rs, ns, nb) != (MAGIC, capacity, record_size, nslots, nbuckets):
            raise RegistryIncompatible(
                f"table {name!r}: header {(magic, cap, rs, ns, nb)!r} does not match the layout "
                f"{(MAGIC, capacity, record_size, nslots, nbuckets)!r}")
        self.name = name
        self.kind: Kind = kind
        self.capacity = capacity
        self.record_size = record_size
        self.nslots = nslots
        self._set = kind == "set"
        self._hash_key = bytes(hash_key)
        self._lock = lock
        self._mask = nslots - 1
        self._wmask = 2 * nslots - 1  # index words
        self._nwords = 2 * nslots
        self._payload = record_size - RECORD_HEADER
        self._heap = heap_off
        self._buf = buf[:size]
        self._hq = self._buf[0:HEADER_SIZE].cast("Q")
        self._ver = self._buf[HEADER_SIZE:HEADER_SIZE + 8 * nbuckets].cast("Q")
        self._idx = self._buf[idx_off:heap_off].cast("Q")
        self._free = self._buf[free_off:free_off + 4 * (capacity + 1)].cast("I")

    def close(self) -> None:
        """Release the memoryviews on the segment (so the mapping can be closed)."""
        for name in ("_hq", "_ver", "_idx", "_free", "_buf"):
            mv = getattr(self, name, None)
            if mv is not None:
                mv.release()

    def __repr__(self) -> str:
        return f"<Table {self.name!r} {self.kind} capacity={self.capacity}>"

    # ---------------------------------------------------------------- keys
    def _hash(self, kbytes: bytes) -> int:
        h = _from_bytes(_blake2b(kbytes, key=self._hash_key, digest_size=8).digest(), "little")
        return h or 1

    def prepare(self, key: Any) -> PreparedKey:
        """Pack and hash ``key`` once; pass the result to any operation of this table."""
        if key.__class__ is PreparedKey:
            if key.t is self:
                return key
            key = key.key
        kbytes = _pack(key)
        h = self._hash(kbytes)
        return PreparedKey(self, key, kbytes, h, h & self._mask)

    def _pk(self, key: Any) -> PreparedKey:
        if key.__class__ is PreparedKey and key.t is self:
            return key
        return self.prepare(key)

    # ---------------------------------------------------------------- records
    def _record(self, r: int) -> tuple[bytes, bytes, int] | None:
        """(kbytes, vbytes, stamp) of record ``r``, or None when it fails validation."""
        if r > self.capacity:
            return None
        buf = self._buf
        off = self._heap + r * self.record_size
        n = sum(_REC.unpack_from(buf, off)[1:3])
        if n > self._payload:
            return None
        raw = buf[off:off + RECORD_HEADER + n].tobytes()
        crc, kl, vl, _, stamp = _REC.unpack_from(raw)
        if kl + vl != n or _crc32(memoryview(raw)[4:]) != crc:
            return None
        return raw[RECORD_HEADER:RECORD_HEADER + kl], raw[RECORD_HEADER + kl:], stamp

    def _check_size(self, kbytes: bytes, vbytes: bytes) -> None:
        if len(kbytes) + len(vbytes) > self._payload:
            raise RowTooLarge(
                f"table {self.name!r}: row of {len(kbytes)}+{len(vbytes)} packed bytes exceeds "
                f"the record payload of {self._payload} bytes")

    # ---------------------------------------------------------------- lock-free reads
    def _read(self, pk: PreparedKey, decode: bool) -> tuple[list[Any], tuple[tuple[int, int], ...]]:
        """Values (decoded, or raw bytes) of ``pk``'s rows and the (bucket, version) pairs the
        probe validated. Never torn; falls back to the lock after READ_RETRIES attempts."""
        ver = self._ver
        idx = self._idx
        wmask = self._wmask
        h = pk.hash
        kb = pk.kbytes
        for attempt in range(READ_RETRIES):
            if attempt >= _SPIN_BEFORE_YIELD:
                os.sched_yield()
            j = pk.j
            b = j >> 5
            v = ver[b]
            if v & 1:
                continue
            seen = [(b, v)]
            out: list[Any] = []
            torn = False
            for _ in range(self.nslots):
                sh = idx[j]
                if sh == 0:
                    break
                if sh == h:
                    rec = self._record(idx[j + 1])
                    if rec is None:
                        torn = True
                        break
                    if rec[0] == kb:
                        out.append(rec[1])
                j = (j + 2) & wmask
                if not j & 31:
                    b = j >> 5
                    v = ver[b]
                    if v & 1:
                        torn = True
                        break
                    seen.append((b, v))
            else:
                torn = True  # no empty slot seen: impossible unless torn
            if torn:
                continue
            for b, v in seen:
                if ver[b] != v:
                    break
            else:
                if decode:
                    try:
                        out = [_unpack(x) for x in out]
                    except Exception:  # crc-valid but undecodable: treat as torn
                        continue
                return out, tuple(seen)
        with self._lock:
            return self._read_locked(pk, decode)

    def _read_locked(self, pk: PreparedKey, decode: bool
                     ) -> tuple[list[Any], tuple[tuple[int, int], ...]]:
        out = [e[3] for e in self._find(pk)]
        if decode:
            out = [_unpack(x) for x in out]
        ver = self._ver
        b = pk.b
        seen = [(b, ver[b])]
        j = pk.j
        while self._idx[j]:
            j = (j + 2) & self._wmask
            if not j & 31:
                seen.append((j >> 5, ver[j >> 5]))
        if any(v & 1 for _, v in seen):
            seen = []  # not cacheable
        return out, tuple(seen)

    def member(self, key: Any) -> bool:
        """True if ``key`` has a row. A miss on an empty home slot costs three loads."""
        if key.__class__ is not PreparedKey or key.t is not self:
            key = self.prepare(key)
        ver = self._ver
        b = key.b
        v = ver[b]
        if self._idx[key.j] == 0 and ver[b] == v and not v & 1:
            return False
        return bool(self._read(key, False)[0])

    def lookup(self, key: Any) -> list[Any]:
        """The values of ``key``'s rows: ``[]``, ``[value]`` for a set, any number for a bag."""
        if key.__class__ is not PreparedKey or key.t is not self:
            key = self.prepare(key)
        ver = self._ver
        b = key.b
        v = ver[b]
        if self._idx[key.j] == 0 and ver[b] == v and not v & 1:
            return []
        return self._read(key, True)[0]

    def get(self, key: Any, default: Any = None) -> Any:
        """The value of ``key`` (for a bag: one of its values), or ``default``."""
        vals = self.lookup(key)
        return vals[0] if vals else default

    def count(self) -> int:
        """Number of rows (the header counter: exact whenever no writer is mid-operation)."""
        return self._hq[_ROWS]

    def watch(self, key: Any) -> Watch:
        """A cached poll of ``key`` (see :class:`Watch`)."""
        return Watch(self, self._pk(key))

    def _entries(self) -> list[tuple[int, int, bytes, bytes, int]]:
        """Every (slot, record, kbytes, vbytes, stamp) with a valid record, read without
        version checks (the caller validates or holds the lock)."""
        words = self._idx.tolist()
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
        """A consistent copy of all valid rows: optimistic (every version unchanged and even
        around the read), else under the lock."""
        ver = self._ver
        for attempt in range(READ_RETRIES // 4):
            if attempt >= _SPIN_BEFORE_YIELD:
                os.sched_yield()
            v0 = ver.tobytes()
            if any(v & 1 for v in ver.tolist()):
                continue
            ents = self._entries()
            if ver.tobytes() == v0 and all(e[4] >= 0 for e in ents):
                return ents
        with self._lock:
            return [e for e in self._entries() if e[4] >= 0]

    def scan(self, pred: Callable[[Any, Any], bool] | None = None) -> list[tuple[Any, Any]]:
        """Every (key, value) row for which ``pred(key, value)`` is true (all when None), from
        one consistent snapshot, in index order."""
        out = []
        for _, _, kb, vb, _ in self._snapshot():
            k, v = _unpack(kb), _unpack(vb)
            if pred is None or pred(k, v):
                out.append((k, v))
        return out

    def _index_words(self) -> list[int]:
        """The index as a list of u64 words, consistent (optimistic, else under the lock)."""
        ver = self._ver
        for _ in range(READ_RETRIES // 4):
            v0 = ver.tobytes()
            words = self._idx.tolist()
            if ver.tobytes() == v0 and not any(v & 1 for v in ver.tolist()):
                return words
            os.sched_yield()
        with self._lock:
            return self._idx.tolist()

    def stats(self) -> dict[str, Any]:
        """rows, capacity, nslots, load (rows / nslots), probe-length histogram
        {distance from home: entries}, max_probe (from one consistent snapshot)."""
        hist: dict[int, int] = {}
        n = 0
        mask = self._mask
        words = self._index_words()
        for j in range(0, self._nwords, 2):
            h = words[j]
            if h:
                d = ((j >> 1) - (h & mask)) & mask
                hist[d] = hist.get(d, 0) + 1
                n += 1
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
        """(slot, record, kbytes, vbytes) of ``pk``'s rows; caller holds the lock."""
        idx = self._idx
        h = pk.hash
        kb = pk.kbytes
        j = pk.j
        out = []
        for _ in range(self.nslots):
            sh = idx[j]
            if sh == 0:
                break
            if sh == h:
                r = idx[j + 1]
                rec = self._record(r)
                if rec is not None and rec[0] == kb:
                    out.append((j >> 1, r, rec[0], rec[1]))
            j = (j + 2) & self._wmask
        return out

    def _write_record(self, kbytes: bytes, vbytes: bytes) -> int:
        """Fill the record on top of the free stack, then pop it. Returns its number."""
        hq = self._hq
        top = hq[_TOP]
        r = self._free[top - 1] if 0 < top <= self.capacity + 1 else self.capacity + 1
        if r > self.capacity:  # free stack damaged: rebuild it and retry
            self.fsck()
            top = hq[_TOP]
            if top == 0:
                raise TableFull(f"table {self.name!r} has no free record")
            r = self._free[top - 1]
        stamp = hq[_STAMP] + 1
        hq[_STAMP] = stamp
        tail = _REC_TAIL.pack(len(kbytes), len(vbytes), 0, stamp) + kbytes + vbytes
        off = self._heap + r * self.record_size
        self._buf[off:off + RECORD_HEADER + len(kbytes) + len(vbytes)] = (
            _CRC.pack(_crc32(tail)) + tail)
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
        while idx[j]:
            j = (j + 2) & self._wmask
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
        while True:
            j = (j + 1) & mask
            hj = idx[2 * j]
            if hj == 0:
                break
            k = hj & mask
            # the entry at j stays if its home lies cyclically in (i, j]
            if (i < k <= j) if i <= j else (i < k or k <= j):
                continue
            bj = j >> 4
            if bj not in marked:
                ver[bj] += 1
                marked.append(bj)
            idx[2 * i + 1] = idx[2 * j + 1]
            idx[2 * i] = hj
            i = j
        idx[2 * i] = 0
        idx[2 * i + 1] = 0
        for b in marked:
            ver[b] += 1
        self._hq[_ROWS] -= 1
        self._free_record(r)

    def _locate(self, h: int, r: int) -> int:
        """The slot holding (hash ``h``, record ``r``); caller holds the lock. -1 if none."""
        idx = self._idx
        j = 2 * (h & self._mask)
        for _ in range(self.nslots):
            sh = idx[j]
            if sh == 0:
                return -1
            if sh == h and idx[j + 1] == r:
                return j >> 1
            j = (j + 2) & self._wmask
        return -1

    def insert(self, key: Any, value: Any) -> None:
        """Set: insert or replace ``key``'s row. Bag: add the object unless an identical one is
        there. Raises RowTooLarge (nothing written, no lock taken) or TableFull."""
        pk = self._pk(key)
        vb = _pack(value)
        self._check_size(pk.kbytes, vb)
        lock = self._lock
        with lock:
            found = self._find(pk)
            if found and self._set:
                s, old, _, oldvb = found[0]
                if oldvb == vb:
                    return
                lock.dirty = True
                new = self._write_record(pk.kbytes, vb)
                b = s >> 4
                self._ver[b] += 1
                self._idx[2 * s + 1] = new  # the commit: one aligned store
                self._ver[b] += 1
                self._free_record(old)
                lock.dirty = False
                return
            for e in found:
                if e[3] == vb:
                    return
            self._insert_new(pk, vb)

    def _insert_new(self, pk: PreparedKey, vb: bytes) -> None:
        if self._hq[_ROWS] >= self.capacity:
            raise TableFull(f"table {self.name!r} is full ({self.capacity} rows)")
        lock = self._lock
        lock.dirty = True
        r = self._write_record(pk.kbytes, vb)
        self._publish(pk, r)
        lock.dirty = False

    def insert_new(self, key: Any, value: Any) -> bool:
        """Insert only if ``key`` has no row; False (nothing written) if it has one."""
        pk = self._pk(key)
        vb = _pack(value)
        self._check_size(pk.kbytes, vb)
        with self._lock:
            if self._find(pk):
                return False
            self._insert_new(pk, vb)
            return True

    def delete(self, key: Any) -> int:
        """Remove every row of ``key``; returns how many."""
        pk = self._pk(key)
        lock = self._lock
        n = 0
        with lock:
            while True:
                found = self._find(pk)
                if not found:
                    return n
                lock.dirty = True
                self._delete_slot(found[0][0])
                lock.dirty = False
                n += 1

    def delete_object(self, key: Any, value: Any) -> bool:
        """Remove exactly one row equal to (key, value); False if there is none."""
        pk = self._pk(key)
        vb = _pack(value)
        lock = self._lock
        with lock:
            for s, _, _, v in self._find(pk):
                if v == vb:
                    lock.dirty = True
                    self._delete_slot(s)
                    lock.dirty = False
                    return True
            return False

    def delete_where(self, pred: Callable[[Any, Any], bool]) -> int:
        """Remove every row for which ``pred(key, value)`` is true; returns how many. ``pred``
        runs on all rows before anything is removed (if it raises, nothing is)."""
        lock = self._lock
        with lock:
            doomed = []
            for s, r, kb, vb, stamp in self._entries():
                if stamp >= 0 and pred(_unpack(kb), _unpack(vb)):
                    doomed.append((self._idx[2 * s], r))
            n = 0
            for h, r in doomed:
                s = self._locate(h, r)
                if s >= 0:
                    lock.dirty = True
                    self._delete_slot(s)
                    lock.dirty = False
                    n += 1
            return n

    # ---------------------------------------------------------------- recovery
    def fsck(self) -> dict[str, int]:
        """Check and repair the table; the caller holds the lock. Returns counts of repairs
        (all zero for a healthy table, which it leaves untouched).

        Drops index entries whose record number is out of range, whose record fails its
        length/crc check, or whose key does not hash to the entry; drops all but one of entries
        sharing a record; for a set keeps only the newest (highest stamp) row of a key; moves
        entries back so that no empty slot lies between an entry's home and the entry; rebuilds
        the free stack from the records referenced; recounts the rows; makes every bucket
        version even. Every step leaves a state that fsck handles, so a killed fsck is finished
        by the next one.
        """
        rep = {"odd_versions": 0, "bad_entries": 0, "duplicate_entries": 0,
               "stale_rows": 0, "moved": 0, "free_stack": 0, "rows": 0}
        idx = self._idx
        ver = self._ver
        mask = self._mask
        nslots = self.nslots
        words = idx.tolist()
        drop: list[int] = []
        by_rec: dict[int, int] = {}
        by_key: dict[bytes, tuple[int, int]] = {}
        for s in range(nslots):
            h = words[2 * s]
            if not h:
                continue
            r = words[2 * s + 1]
            rec = self._record(r)
            if rec is None or self._hash(rec[0]) != h:
                drop.append(s)
                rep["bad_entries"] += 1
                continue
            if r in by_rec:
                drop.append(s)
                rep["duplicate_entries"] += 1
                continue
            by_rec[r] = s
            if self._set:
                prev = by_key.get(rec[0])
                if prev is not None:
                    rep["stale_rows"] += 1
                    if prev[0] >= rec[2]:
                        drop.append(s)
                        del by_rec[r]
                        continue
                    drop.append(prev[1])
                    del by_rec[words[2 * prev[1] + 1]]
                by_key[rec[0]] = (rec[2], s)
        for s in drop:
            words[2 * s] = words[2 * s + 1] = 0
        moves = _reachability_moves(words, mask)
        odd = [b for b, v in enumerate(ver.tolist()) if v & 1]
        changing = bool(drop or moves)
        if changing:
            for b in range(len(ver)):
                if not ver[b] & 1:
                    ver[b] += 1
            for s in drop:
                idx[2 * s] = 0
                idx[2 * s + 1] = 0
            for src, dst in moves:
                idx[2 * dst + 1] = idx[2 * src + 1]
                idx[2 * dst] = idx[2 * src]
                idx[2 * src] = 0
                idx[2 * src + 1] = 0
            rep["moved"] = len(moves)
        # free stack: exactly the unreferenced records
        referenced = set(by_rec)
        nfree = self.capacity + 1 - len(referenced)
        hq = self._hq
        top = hq[_TOP]
        stack = self._free.tolist()
        if top != nfree or set(stack[:top]) | referenced != set(range(self.capacity + 1)):
            free = [r for r in range(self.capacity, -1, -1) if r not in referenced]
            for i, r in enumerate(free):
                self._free[i] = r
            hq[_TOP] = nfree
            rep["free_stack"] = 1
        if hq[_ROWS] != len(referenced):
            hq[_ROWS] = len(referenced)
            rep["rows"] = 1
        if changing:
            for b in range(len(ver)):
                if ver[b] & 1:
                    ver[b] += 1
        else:
            for b in odd:
                ver[b] += 1
        rep["odd_versions"] = len(odd)
        return rep


def _reachability_moves(words: list[int], mask: int) -> list[tuple[int, int]]:
    """Moves (src slot, dst slot) that leave no empty slot between any entry's home and the
    entry, applied to ``words`` (the index as a list of u64 words) as they are computed.

    One pass in probe order starting after an empty slot: each entry goes to the first empty
    slot between its home and itself. Entries already passed stay reachable (a move only empties
    the slot it leaves, which lies after them), so one pass suffices.
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
        k = h & mask
        e = k
        while e != s and words[2 * e]:
            e = (e + 1) & mask
        if e != s:
            words[2 * e], words[2 * e + 1] = h, words[2 * s + 1]
            words[2 * s] = words[2 * s + 1] = 0
            moves.append((s, e))
    return moves
