"""The byte layout of one table's region of the shared segment, its sizes, and the packers.

A table lives in one region of the segment (the registry hands out 4096-aligned regions). All
integers are little-endian; every offset below is a multiple of 8, so every u64 is aligned and a
u64 store through a ``memoryview.cast("Q")`` is one machine store (never seen torn)::

    offset  size                      content
    0       64                        header
              0   8s  magic  b"SHMTBL\\x00\\x03"
              8   u32 capacity          (rows the table holds)
              12  u32 record_size       (bytes per large record, header included, multiple of 8)
              16  u32 nslots            (index slots, power of two >= 2 x capacity, >= 16)
              20  u32 nbuckets          (nslots / 16)
              24  u64 rows              (row count; derivable: fsck recounts it)
              32  u64 free_top          (record numbers on the small class's free stack)
              40  u64 stamp             (last record stamp handed out)
              48  u32 small_size        (bytes per small record; == record_size: one class)
              52  u32 large_count       (L: rows larger than a small record the table holds)
              56  u64 large_top         (record numbers on the large class's free stack)
    64      8 x nbuckets (pad to 64)  bucket versions: u64 seqlock per bucket of 16 index slots;
                                      odd while a writer changes a slot of the bucket
    V       16 x nslots               index: per slot u64 hash (SipHash-2-4 of the packed key,
                                      never 0; 0 = empty slot) then u64 record number
    I       small_size x (capacity+1) small class: records 0 .. capacity
    J       record_size x nlarge      large class: records capacity+1 .. capacity+nlarge, where
                                      nlarge = L + 1 (0 for a table of one class)
              each record: 0 u32 crc32 of the klen + vlen payload bytes, seeded with
                      (stamp ^ klen << 16 ^ vlen ^ 0x5EED5EED) mod 2**32 (so it covers the header)
              4   u32 klen, 8 u32 vlen, 12 u32 word (the row's counter, outside the crc:
                      stored in place under the lock, one aligned u32 store; 0 unless set)
              16  u64 stamp (table-wide increasing counter: the newest of two rows wins in fsck)
              24  klen bytes msgpack key, then vlen bytes msgpack value, then zeros
    H       4 x (capacity+1+nlarge)   free stacks (pad to 8): u32 record numbers; the small
                                      class's at 0 .. capacity (top at free_top - 1), the large
                                      class's after it (top at capacity + large_top)

Size classes: a row whose packed key + value fit a small record (``small_size - 24`` bytes)
takes a small record, a larger one (up to ``record_size - 24``) a large record. Record number
``r`` encodes its class: ``r <= capacity`` is small, at ``heap + r * small_size``; above, large,
at ``large_base + r * record_size`` (one comparison).

The guarantee: the table holds ``capacity`` rows, up to ``L`` of them larger than a small
record. Each class keeps one record more than it guarantees (``capacity + 1`` small, ``L + 1``
large): a set update writes a fresh record before it lets go of the old one, and the spare
guarantees that a full table (or a full large class) can still update its rows. A write that
would make an (L+1)-th large row (a new row, or a small row growing) finds the large class
exhausted: ``LargeRowsFull`` (a ``TableFull``), nothing written; what the caller does then is
its table's policy (see ``registry.py``). A table of one class (``small_size == record_size``,
``L == 0``, ``nlarge == 0``) has one heap and one free stack; its class fields say so.

Backing on demand: the large records' pages (``lazy_span``) are not allocated when the segment
is created. A writer backs them (``posix_fallocate`` on the segment, ``TableBase._back_to``) in
chunks, before its first store into a large record it popped, so a /dev/shm filled since is
``ShmFull`` (a ``LargeRowsFull``) there, nothing written, never SIGBUS. The free stacks pop low
numbers first (here and in fsck's rebuild), so the large records ever used are the lowest:
what is backed follows the peak of large rows held. Only referenced records are read, and
those were backed.
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

import msgpack

MAGIC = b"SHMTBL\x00\x03"
HEADER_SIZE = 64
RECORD_HEADER = 24  # bytes of record header before the key
BUCKET_SLOTS = 16  # index slots per seqlock bucket

_HDR = struct.Struct("<8sIIII")  # magic, capacity, record_size, nslots, nbuckets
_CLS = struct.Struct("<II")  # at _CLS_OFF: small_size, large_count
_CLS_OFF = 48
_REC = struct.Struct("<IIIIQ")  # crc, klen, vlen, word, stamp
_WORD = 12  # byte offset of the word in a record
_LENS = struct.Struct("<II")  # klen, vlen
_SEED = 0x5EED5EED  # crc seed: (stamp ^ klen << 16 ^ vlen ^ _SEED) & _M32
_M32 = 0xFFFF_FFFF
_M64 = 0xFFFF_FFFF_FFFF_FFFF  # bucket versions wrap here (garbage only: 2**64 writes never come)
# u64 word numbers in the header
_ROWS, _TOP, _STAMP, _CLASSES, _LTOP = 3, 4, 5, 6, 7
_STAMP_MAX = 1 << 62  # a stamp counter above this is garbage (2**62 writes never happen)

_unpackb = msgpack.unpackb

# One Packer per process: ``msgpack.packb`` builds a Packer per call (4x slower). Packer.pack
# holds the GIL from start to end (no Python code runs for the types msgpack packs natively, and
# it resets its buffer on error), so threads of one process cannot interleave inside it.
_pack = msgpack.Packer(use_bin_type=True).pack


def _unpack(b: bytes) -> Any:
    return _unpackb(b, raw=False, use_list=False, strict_map_key=False)


def _round8(n: int) -> int:
    return (n + 7) & ~7


def _round64(n: int) -> int:
    return (n + 63) & ~63


class Geometry(NamedTuple):
    """Where everything of a table's region lies (byte offsets from the region's start)."""

    nslots: int
    nbuckets: int
    idx_off: int  # the index
    heap_off: int  # the small class's records
    large_off: int  # the large class's records
    free_off: int  # the free stacks
    size: int  # the region, a multiple of 64
    small_size: int  # bytes per small record (== record_size for a table of one class)
    large_count: int  # L: large rows guaranteed (0 for one class)
    nlarge: int  # large records: L + 1, or 0


def _geometry(capacity: int, record_size: int, small_size: int = 0,
              large_count: int = 0) -> Geometry:
    """The geometry of a table; ``small_size`` 0 (or ``record_size``) means one class."""
    if not isinstance(capacity, int) or not 1 <= capacity <= 0xFFFF_FFFE:
        raise ValueError(f"table capacity must be an int in 1..2**32-2, got {capacity!r}")
    if not isinstance(record_size, int) or record_size < RECORD_HEADER + 2 or record_size % 8:
        raise ValueError(
            f"record_size must be a multiple of 8 and >= {RECORD_HEADER + 8}, got {record_size!r}")
    if small_size in (0, record_size):
        if large_count != 0:
            raise ValueError(f"a table of one record size has no large class, got "
                             f"large_count={large_count!r}")
        small_size, nlarge = record_size, 0
    else:
        if (not isinstance(small_size, int) or small_size % 8
                or not RECORD_HEADER + 8 <= small_size < record_size):
            raise ValueError(f"small_size must be a multiple of 8 in {RECORD_HEADER + 8}.."
                             f"record_size ({record_size}), got {small_size!r}")
        if not isinstance(large_count, int) or not 1 <= large_count <= capacity:
            raise ValueError(f"large_count must be an int in 1..capacity ({capacity}), got "
                             f"{large_count!r}")
        nlarge = large_count + 1
    nslots = BUCKET_SLOTS
    while nslots < 2 * capacity:
        nslots *= 2
    nbuckets = nslots // BUCKET_SLOTS
    idx_off = HEADER_SIZE + _round64(8 * nbuckets)
    heap_off = idx_off + 16 * nslots
    large_off = heap_off + small_size * (capacity + 1)
    free_off = large_off + record_size * nlarge
    size = _round64(free_off + _round8(4 * (capacity + 1 + nlarge)))
    return Geometry(nslots, nbuckets, idx_off, heap_off, large_off, free_off, size, small_size,
                    large_count, nlarge)


def region_size(capacity: int, record_size: int, small_size: int = 0,
                large_count: int = 0) -> int:
    """Bytes a table of ``capacity`` rows needs (a multiple of 64): records of ``record_size``
    bytes, or with ``small_size`` records of that size plus ``large_count`` + 1 of
    ``record_size``."""
    return _geometry(capacity, record_size, small_size, large_count).size


def record_size_for(max_key: int, max_value: int) -> int:
    """The record size holding a packed key of ``max_key`` and a packed value of
    ``max_value`` bytes."""
    return _round8(RECORD_HEADER + max_key + max_value)


def lazy_span(capacity: int, record_size: int, small_size: int = 0,
              large_count: int = 0) -> tuple[int, int]:
    """(offset, bytes) of the large class's records in the region: the span whose pages are
    backed on demand (``TableBase._back_to``), (0, 0) for a table of one class."""
    g = _geometry(capacity, record_size, small_size, large_count)
    return (g.large_off, g.free_off - g.large_off) if g.nlarge else (0, 0)


def format_region(buf: memoryview, capacity: int, record_size: int, small_size: int = 0,
                  large_count: int = 0) -> None:
    """Write an empty table into ``buf`` (at least ``region_size`` bytes; zero-filled here,
    which also touches every page) except the large records (``lazy_span``): a record is read
    only once written, and a hole of a fresh tmpfs file reads as zeros anyway."""
    g = _geometry(capacity, record_size, small_size, large_count)
    size = g.size
    if len(buf) < size:
        raise ValueError(f"region of {len(buf)} bytes is smaller than the table's {size}")
    chunk = bytes(min(size, 1 << 20))
    lazy_off, lazy_n = lazy_span(capacity, record_size, small_size, large_count)
    for lo, hi in ((0, lazy_off or size), (lazy_off + lazy_n, size) if lazy_n else (0, 0)):
        for off in range(lo, hi, len(chunk)):
            n = min(len(chunk), hi - off)
            buf[off:off + n] = chunk[:n]
    _HDR.pack_into(buf, 0, MAGIC, capacity, record_size, g.nslots, g.nbuckets)
    _CLS.pack_into(buf, _CLS_OFF, g.small_size, g.large_count)
    nrec = capacity + 1 + g.nlarge
    free = buf[g.free_off:g.free_off + 4 * nrec].cast("I")
    try:
        for i in range(capacity + 1):  # pops 0, 1, 2, ...
            free[i] = capacity - i
        for i in range(g.nlarge):  # pops capacity + 1, capacity + 2, ...
            free[capacity + 1 + i] = nrec - 1 - i
    finally:
        free.release()
    struct.pack_into("<QQQ", buf, 24, 0, capacity + 1, 0)
    struct.pack_into("<Q", buf, 56, g.nlarge)
