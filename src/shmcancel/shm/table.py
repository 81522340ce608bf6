"""Fixed-capacity open-addressed hash tables over a region of the shared segment, ETS-like.

:class:`Table` composes its parts, one module each: ``layout`` (the byte layout, sizes, packers),
``base`` (views, keys, records, the locked probe), ``reader`` (lock-free reads, :class:`Watch`),
``writer`` (locked writes and their invariants), ``rewrite`` (bulk deletes by an index
rewrite), ``sweep`` (deletes in short holds) and ``fsck`` (check, repair, stats). The
memory-ordering assumption is stated in ``reader``.
"""

from __future__ import annotations

from .base import (
    Kind,
    LargeRowsFull,
    Lock,
    PreparedKey,
    RegionHeaderDamaged,
    ShmFull,
    TableCorrupted,
)
from .layout import _geometry as _geometry  # re-exported: the tests import it from here
from .layout import _unpack as _unpack  # re-exported: cancel.shm_storage imports it from here
from .reader import Reads, Watch
from .sweep import Sweeps

__all__ = ["Kind", "LargeRowsFull", "Lock", "PreparedKey", "RegionHeaderDamaged", "ShmFull",
           "Table", "TableCorrupted", "Watch"]


class Table(Sweeps, Reads):
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
