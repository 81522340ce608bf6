"""The byte layout of one table's region of the shared segment, its sizes, and the packers.

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
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack

MAGIC = b"SHMTBL\x00\x01"
HEADER_SIZE = 64
RECORD_HEADER = 24  # bytes of record header before the key
BUCKET_SLOTS = 16  # index slots per seqlock bucket

_HDR = struct.Struct("<8sIIII")  # magic, capacity, record_size, nslots, nbuckets
_REC = struct.Struct("<IIIIQ")  # crc, klen, vlen, reserved, stamp
_LENS = struct.Struct("<II")  # klen, vlen
_SEED = 0x5EED5EED  # crc seed: (stamp ^ klen << 16 ^ vlen ^ _SEED) & _M32
_M32 = 0xFFFF_FFFF
# u64 word numbers in the header
_ROWS, _TOP, _STAMP = 3, 4, 5
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


def region_size(capacity: int, record_size: int) -> int:
    """Bytes a table of ``capacity`` rows of ``record_size``-byte records needs (a multiple
    of 64)."""
    return _geometry(capacity, record_size)[5]


def record_size_for(max_key: int, max_value: int) -> int:
    """The record size holding a packed key of ``max_key`` and a packed value of
    ``max_value`` bytes."""
    return _round8(RECORD_HEADER + max_key + max_value)


def format_region(buf: memoryview, capacity: int, record_size: int) -> None:
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
