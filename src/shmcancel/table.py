"""INTERFACE STUB (filled in by the table work; keep the public names and signatures).

Fixed-capacity open-addressed hash tables over a region of the shared segment, ETS-like.

Layout decision (the full byte layout belongs in this docstring once written):
- a small table header (row count, free-record stack top, ...),
- per-bucket u64 seqlock versions (bucket = 16 index slots),
- a compact index of ``nslots`` 16-byte slots (nonzero keyed u64 hash + record number; 0 = empty),
  ``nslots`` = power of two >= 2 x capacity, linear probing, backward-shift deletion,
- a heap of ``capacity`` fixed-size records (len, crc32, key length, msgpack key + value),
- a stack of free record numbers.
Updates of an existing set key write a fresh record and swap the index slot's record number in
one store, so a crash never loses the committed row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, Protocol

Kind = Literal["set", "bag"]


class Lock(Protocol):
    """What a table needs of the registry lock (see ``lock.RegistryLock``)."""

    dirty: bool

    def __enter__(self) -> object: ...
    def __exit__(self, *exc: object) -> None: ...


class PreparedKey:
    """A key with its msgpack bytes, keyed hash and home slot computed once."""

    __slots__ = ("hash", "home", "kbytes", "key")


class Watch:
    """A cached lookup of one prepared key: ``member()``/``values()`` re-read the table only
    when a bucket version seen last time has moved."""

    def member(self) -> bool:
        raise NotImplementedError

    def values(self) -> tuple[Any, ...]:
        raise NotImplementedError


class Table:
    @staticmethod
    def region_size(capacity: int, record_size: int) -> int:
        raise NotImplementedError

    @staticmethod
    def format(buf: memoryview, capacity: int, record_size: int) -> None:
        raise NotImplementedError

    def __init__(self, name: str, buf: memoryview, *, kind: Kind, capacity: int,
                 record_size: int, hash_key: bytes, lock: Lock) -> None:
        raise NotImplementedError

    def prepare(self, key: Any) -> PreparedKey: ...
    def lookup(self, key: Any) -> list[Any]: ...
    def get(self, key: Any, default: Any = None) -> Any: ...
    def member(self, key: Any) -> bool: ...
    def count(self) -> int: ...
    def scan(self, pred: Callable[[Any, Any], bool] | None = None) -> list[tuple[Any, Any]]: ...
    def watch(self, key: Any) -> Watch: ...
    def insert(self, key: Any, value: Any) -> None: ...
    def insert_new(self, key: Any, value: Any) -> bool: ...
    def delete(self, key: Any) -> int: ...
    def delete_object(self, key: Any, value: Any) -> bool: ...
    def delete_where(self, pred: Callable[[Any, Any], bool]) -> int: ...
    def fsck(self) -> dict[str, int]: ...
    def stats(self) -> dict[str, Any]: ...
