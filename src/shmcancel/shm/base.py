"""What every part of a table shares: the memoryviews over its region (layout in ``layout.py``),
keys prepared once (packed, hashed, home slot), record decoding, and the probe under the lock.

Probing is linear from the home slot ``hash & (nslots - 1)``; deletion shifts the following
entries back (no tombstones), so an entry is always reachable: no empty slot lies between its
home and its slot. The load stays <= 50 % by construction (nslots >= 2 x capacity).

Garbage in the segment (a stray write, another process scribbling over it) never makes a loop
spin: every probe, backward shift and scan is bounded by ``nslots``, every record number by
the records of its size class. Under the lock, a probe that meets no empty slot or a referenced
record failing validation is corruption, never a race: :class:`TableCorrupted`.
"""

from __future__ import annotations

import errno
import struct
import zlib
from collections.abc import Callable
from typing import Any, Literal, Protocol

from ..exceptions import (
    RegistryClosed,
    RegistryIncompatible,
    RowTooLarge,
    ShmCancelError,
    TableFull,
)
from . import layout
from .hashing import siphash, table_key
from .layout import (
    _CLS,
    _CLS_OFF,
    _HDR,
    _M32,
    _SEED,
    HEADER_SIZE,
    MAGIC,
    RECORD_HEADER,
    _geometry,
    _pack,
)

Kind = Literal["set", "bag"]

READ_RETRIES = 64  # optimistic attempts before a reader falls back to the lock
BACK_CHUNK = 1 << 16  # bytes of large records backed at once (layout.py: backing on demand)
_SPIN_BEFORE_YIELD = 4

_siphash = siphash
_crc32 = zlib.crc32
_new = object.__new__


class TableCorrupted(ShmCancelError):
    """The table's bytes are inconsistent in a way no interrupted writer leaves (garbage in the
    segment), and still were right after ``fsck`` repaired them. Raised only after one repair
    and one retry of the operation; nothing was half-written (the repair ran)."""


class RegionHeaderDamaged(RegistryIncompatible):
    """A table's region header (``layout.py``: magic, capacity, record size, index and class
    geometry) disagrees with what the segment header's descriptor and the schema define:
    garbage over it. A new attachment refuses the segment until ``fsck`` (``shmtool fsck``, or
    an attached process's ``Registry.check``) rewrites it; processes attached already go on
    with the geometry they checked. ``table``: the damaged table's name."""

    def __init__(self, message: str, table: str = "") -> None:
        super().__init__(message)
        self.table = table


class LargeRowsFull(TableFull):
    """The table holds its ``large_count`` rows larger than a small record already (see
    ``layout.py``): a new large row (or a row growing past a small record) is refused, nothing
    written. The table's other rows and updates of its large rows are unaffected."""


class ShmFull(LargeRowsFull):
    """/dev/shm has no room left for the pages of the large record a write needs (filled since
    the registry was created, whose check saw room for every page): nothing written; the same
    write succeeds once room is made. Its table's other rows, and rows that fit a small or an
    already backed record, are unaffected."""


class Lock(Protocol):
    """What a table needs of the registry lock (see ``lock.RegistryLock``): a reentrant
    inter-process lock whose ``__exit__`` repairs the tables (``fsck``) if ``dirty`` is still
    True, i.e. the holder was interrupted between its first and last store. A lock may also
    have ``flags``, an object whose plain attribute ``dirty`` is the lock's own (the writers
    set it there: an attribute store, where ``dirty`` itself may be a property)."""

    dirty: bool

    def held_by_me(self) -> bool: ...
    def __enter__(self) -> object: ...
    def __exit__(self, et: object, ev: object, tb: object) -> None: ...


class PreparedKey:
    """A key with its msgpack bytes, keyed hash and home slot computed once (for one table).

    ``j`` is the home slot's first word in the index (``2 * home``) and ``b`` its bucket;
    ``t`` is the table it was prepared for (a key prepared for another table is re-prepared);
    ``wref`` is the table's ``(bucket, version, ref)`` of its row's word last found (see
    ``Writes.word_ref``, ``Reads.word``; a set's only), or None.
    """

    __slots__ = ("b", "hash", "j", "kbytes", "key", "t", "wref")

    def __init__(self, t: TableBase, key: Any, kbytes: bytes, h: int, home: int) -> None:
        self.t = t
        self.key = key
        self.kbytes = kbytes
        self.hash = h
        self.j = 2 * home
        self.b = home >> 4
        self.wref: tuple[int, int, int] | None = None

    @property
    def home(self) -> int:
        return self.j >> 1

    def __repr__(self) -> str:
        return f"PreparedKey({self.key!r}, home={self.home})"


_HEADER_FIELDS = ("magic", "capacity", "record_size", "nslots", "nbuckets", "small_size",
                  "large_count")


def _header_damage(buf: memoryview, want: tuple[Any, ...]) -> str | None:
    """Which geometry fields of the region header in ``buf`` differ from ``want`` (the fields
    of ``_HDR`` then ``_CLS``), as "field got (expected want)", or None when none does."""
    got = _HDR.unpack_from(buf, 0) + _CLS.unpack_from(buf, _CLS_OFF)
    bad = [f"{f} {g!r} (expected {w!r})" for f, g, w in zip(_HEADER_FIELDS, got, want,
                                                              strict=True) if g != w]
    return ", ".join(bad) or None


class TableBase:
    """A table's geometry and views on its region, its keys and records (see the module
    docstring); the parts of :class:`~shmcancel.shm.table.Table` build on it."""

    RECORD_HEADER = RECORD_HEADER

    _closed = False  # close() ran: the views are released (the registry was closed)

    region_size = staticmethod(layout.region_size)
    record_size_for = staticmethod(layout.record_size_for)
    format = staticmethod(layout.format_region)

    def __init__(self, name: str, buf: memoryview, *, kind: Kind, capacity: int,
                 record_size: int, hash_key: bytes, lock: Lock, small_size: int = 0,
                 large_count: int = 0,
                 back: Callable[[int, int], None] | None = None,
                 damaged_ok: bool = False) -> None:
        if kind not in ("set", "bag"):
            raise ValueError(f"table kind must be 'set' or 'bag', got {kind!r}")
        if not isinstance(hash_key, bytes | bytearray) or not 1 <= len(hash_key) <= 64:
            raise ValueError("hash_key must be 1..64 bytes")
        g = _geometry(capacity, record_size, small_size, large_count)
        nslots, nbuckets, size = g.nslots, g.nbuckets, g.size
        if len(buf) < size:
            raise RegistryIncompatible(
                f"table {name!r}: region of {len(buf)} bytes, layout needs {size}")
        # the region header's geometry fields, as they must read (_header_damage)
        self._header_want = (MAGIC, capacity, record_size, nslots, nbuckets, g.small_size,
                             large_count)
        damage = _header_damage(buf, self._header_want)
        if damage is not None and not damaged_ok:
            raise RegionHeaderDamaged(f"table {name!r}: region header damaged ({damage}): it "
                                      "does not match the layout", name)
        self.name = name
        self.kind: Kind = kind
        self.capacity = capacity
        self.record_size = record_size
        self.small_size = g.small_size  # == record_size: one class
        self.large_count = large_count  # L: large rows the table holds (0: one class)
        self._nlarge = g.nlarge  # large records: L + 1 (one spare), or 0
        self._nrec = capacity + 1 + g.nlarge  # records of both classes
        self.nslots = nslots
        self._nbuckets = nbuckets
        self._set = kind == "set"
        self._hash_key = bytes(hash_key)
        self._sip_key = table_key(self._hash_key)
        self._lock = lock
        self._flags: Any = getattr(lock, "flags", lock)  # where writers set ``dirty``
        # A read-only attachment's lock cannot be taken: readers fall back to a best-effort
        # unlocked read where they would take it (reader.py, fsck.py).
        self._lockless = bool(getattr(lock, "readonly", False))
        self._mask = nslots - 1
        self._wmask = 2 * nslots - 1  # over index words
        self._nwords = 2 * nslots
        self._payload = record_size - RECORD_HEADER  # of a large record (the largest row)
        self._spayload = g.small_size - RECORD_HEADER  # of a small record
        self._rs = struct.Struct(f"<IIIIQ{self._payload}s")  # a whole record, zero padded
        self._rss = struct.Struct(f"<IIIIQ{self._spayload}s")  # a whole small record
        self._heap = g.heap_off
        # what _cwrite.add_small needs of the geometry, as one tuple (see writer.py)
        self._geo = (g.heap_off, g.small_size, self._spayload, capacity, HEADER_SIZE, g.idx_off,
                     g.free_off, nslots)
        # record r > capacity lies at _lbase + r * record_size (so r = capacity + 1 is first)
        self._lbase = g.large_off - (capacity + 1) * record_size
        self._buf = buf[:size]
        self._hq = self._buf[0:HEADER_SIZE].cast("Q")
        self._ver = self._buf[HEADER_SIZE:HEADER_SIZE + 8 * nbuckets].cast("Q")
        self._idx = self._buf[g.idx_off:g.heap_off].cast("Q")
        self._free = self._buf[g.free_off:g.free_off + 4 * self._nrec].cast("I")
        self._u32 = self._buf.cast("I")  # the region as u32 words: a record's word in place
        # back(offset, bytes) allocates the region's pages in that span (layout.py: "Backing on
        # demand"), raising OSError when it cannot; None: the whole region is backed already.
        # Every large record numbered <= _backed is known backed (in this process: a record
        # another process backed is backed again here, a no-op).
        self._back = back
        self._backed = capacity if back is not None else self._nrec
        self._logged_pid = 0  # the process that logged this table's corruption (log once)

    def close(self) -> None:
        """Release the memoryviews on the segment (so that the mapping can be closed). Every
        use of the table since raises :class:`~shmcancel.RegistryClosed`."""
        self._closed = True
        for name in ("_hq", "_ver", "_idx", "_free", "_u32", "_buf"):
            mv = getattr(self, name, None)
            if mv is not None:
                mv.release()

    def _if_closed(self) -> None:
        """In an ``except`` clause: raise :class:`~shmcancel.RegistryClosed` in place of the
        error being handled when this table is closed (a released view raised it: ValueError),
        else return, and the caller re-raises it. The public operations translate there
        rather than test ``_closed`` first: an ``except`` costs nothing until something is
        raised, so an open table's reads pay nothing for it."""
        if self._closed:
            raise RegistryClosed.of(getattr(self._lock, "name", "?"),
                                    f"table {self.name!r}") from None

    def _check_open(self) -> None:
        """:meth:`_if_closed` up front, for the operations that are on no request's path
        (scans, stats, checks) or would not touch a view before answering."""
        if self._closed:
            self._if_closed()

    def __repr__(self) -> str:
        return f"<Table {self.name!r} {self.kind} capacity={self.capacity}>"

    # ---------------------------------------------------------------- keys
    def _hash(self, kbytes: bytes) -> int:
        # prepare() has this line inlined (every new request id): the two must give the same
        # hash, or fsck rejects rows
        return _siphash(self._sip_key, kbytes) or 1

    def prepare(self, key: Any) -> PreparedKey:
        """Pack and hash ``key`` once; pass the result to any operation of this table."""
        h = 0  # no key hashes to 0
        if key.__class__ is PreparedKey:
            if key.t is self:
                return key
            if key.t._hash_key == self._hash_key:  # same bytes, same keyed hash: new home only
                kbytes, h = key.kbytes, key.hash
            key = key.key
        if not h:
            kbytes = _pack(key)
            h = _siphash(self._sip_key, kbytes) or 1  # _hash, inlined: every new request id
        # PreparedKey(self, key, kbytes, h, h & self._mask), without a Python __init__ frame
        pk = _new(PreparedKey)
        pk.t = self
        pk.key = key
        pk.kbytes = kbytes
        pk.hash = h
        pk.j = 2 * (h & self._mask)
        pk.b = (h & self._mask) >> 4
        pk.wref = None
        return pk

    # ---------------------------------------------------------------- records
    def _offset(self, r: int) -> int:
        """Byte offset of record ``r`` in the region, -1 for a number of no record."""
        if r <= self.capacity:
            return self._heap + r * self.small_size
        if r < self._nrec:
            return self._lbase + r * self.record_size
        return -1

    def _record(self, r: int) -> tuple[bytes, bytes, int, int] | None:
        """(kbytes, vbytes, stamp, word) of record ``r``, or None when it fails validation."""
        if r <= self.capacity:  # the class is the range: one comparison for a small record
            crc, kl, vl, w, stamp, body = self._rss.unpack_from(
                self._buf, self._heap + r * self.small_size)
            n = kl + vl
            if n > self._spayload:
                return None
        elif r < self._nrec:
            crc, kl, vl, w, stamp, body = self._rs.unpack_from(
                self._buf, self._lbase + r * self.record_size)
            n = kl + vl
            if n > self._payload:
                return None
        else:
            return None
        body = body[:n]
        if _crc32(body, (stamp ^ kl << 16 ^ vl ^ _SEED) & _M32) != crc:
            return None
        return body[:kl], body[kl:], stamp, w

    def _back_to(self, r: int) -> None:
        """Back the large records after ``_backed`` up to ``r`` and at least a chunk of
        ``BACK_CHUNK`` bytes beyond it (up to ``r`` only when the chunk does not fit); under the
        lock, before any store. ShmFull when /dev/shm cannot hold them (nothing written)."""
        lo = self._backed + 1
        hi = min(self._nrec - 1, max(r, lo + BACK_CHUNK // self.record_size))
        off = self._lbase + lo * self.record_size
        back = self._back
        assert back is not None
        try:
            try:
                back(off, (hi + 1 - lo) * self.record_size)
            except OSError:
                if hi == r:
                    raise
                # The chunk past r may need pages /dev/shm no longer has where r does not
                # (another process backed it): back up to r only.
                hi = r
                back(off, (hi + 1 - lo) * self.record_size)
        except OSError as e:
            why = ("/dev/shm has no room left" if e.errno in (errno.ENOSPC, errno.ENOMEM)
                   else "cannot allocate the pages")
            raise ShmFull(
                f"table {self.name!r}: {why} to back its large records {lo}..{hi} "
                f"({e.strerror or e}): the row was not written") from None
        self._backed = hi

    def _check_size(self, kbytes: bytes, vbytes: bytes) -> None:
        if len(kbytes) + len(vbytes) > self._payload:
            raise RowTooLarge(
                f"table {self.name!r}: row of {len(kbytes)}+{len(vbytes)} packed bytes exceeds "
                f"the record payload of {self._payload} bytes")

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

    def _find(self, pk: PreparedKey) -> list[tuple[int, int, bytes, bytes, int, int]]:
        """(slot, record, kbytes, vbytes, stamp, word) of ``pk``'s rows; the caller holds the
        lock. Raises
        TableCorrupted when the probe meets no empty slot or a record failing validation (under
        the lock neither is a race)."""
        idx = self._idx
        j = pk.j
        if not idx[j]:  # an empty home slot: no row (the probe would stop there)
            return []
        wmask = self._wmask
        h = pk.hash
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
                    out.append((j >> 1, r, *rec))
            j = (j + 2) & wmask
        else:
            raise TableCorrupted(f"table {self.name!r}: a probe met no empty slot")
        return out

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
