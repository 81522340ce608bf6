"""The tables a registry holds, as the layers above declare them.

This layer knows no table by name: the layer that owns a table declares it (a
:class:`TableDecl`) when it is imported, with :func:`declare`. ``Registry.create`` lays out every
table declared in this process (in declaration order) and ``Registry.attach`` expects exactly
those, by name; both take an explicit ``tables=`` instead. ``import shmcancel`` imports the
declaring modules (``shmcancel.cancel.tables``, ``shmcancel.mcp.session_tables``), so every
process that can reach a registry has the full set.

Sizes are ints or functions of the registry's :class:`~shmcancel.config.Config` (resolved at
create and at attach). Worst-case msgpack sizes (bytes) for declaring ``max_key``/``max_value``:
:func:`packed_str`, :func:`packed_bin`, ``PACKED_INT``/``PACKED_FLOAT`` (9), ``PACKED_NIL`` (1),
an array of at most 15 items: 1 byte plus its items.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from ..config import Config

__all__ = [
    "EVERY_ROW",
    "KINDS",
    "NAME_MAX",
    "PACKED_FLOAT",
    "PACKED_INT",
    "PACKED_NIL",
    "Size",
    "TableDecl",
    "declare",
    "declared",
    "packed_bin",
    "packed_str",
]

NAME_MAX = 32  # bytes of a table name (the segment header's name field)
_NAME_RE = re.compile(r"[a-z][a-z0-9_]{0,31}")
KINDS = ("set", "bag")  # set: one row per key; bag: several rows per key

PACKED_INT = 9  # uint64 / int64
PACKED_FLOAT = 9  # float64
PACKED_NIL = 1

Size = int | Callable[[Config], int]


def packed_str(n: int) -> int:
    """Most bytes msgpack packs a str of ``n`` UTF-8 bytes into."""
    return n + (1 if n <= 31 else 2 if n <= 255 else 3 if n <= 65535 else 5)


def packed_bin(n: int) -> int:
    """Most bytes msgpack packs ``n`` bytes (``bytes``) into."""
    return n + (2 if n <= 255 else 3 if n <= 65535 else 5)


EVERY_ROW = 2**32 - 1
"""A ``large_count`` past any capacity: every row of the table may be large."""


@dataclass(frozen=True, slots=True)
class TableDecl:
    """One table a registry holds. ``name``: ``[a-z][a-z0-9_]{0,31}``, unique in the registry;
    ``kind``: ``set`` or ``bag``; ``capacity``: rows; ``max_key``/``max_value``: the largest
    packed key and value a row holds, in bytes (a larger row is ``RowTooLarge``). Each size is
    an int or a function of the registry's Config. ``small_size`` (bytes per record, header
    included; 0: one class) and ``large_count`` (rows larger than a small record the table
    holds, at most ``capacity``): records in two size classes (``shm/layout.py``).
    ``lanes`` (bags only): the table also has per-process lanes, rows a process writes without
    the lock (``shm/lanes.py``; ``Registry.lanes[name]``), which its layer reads beside it."""

    name: str
    kind: str
    capacity: Size
    max_key: Size
    max_value: Size
    small_size: int = 0
    large_count: int = 0
    lanes: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME_RE.fullmatch(self.name):
            raise ValueError(f"table name must match [a-z][a-z0-9_]{{0,31}}, got {self.name!r}")
        if self.kind not in KINDS:
            raise ValueError(f"table {self.name}: kind must be 'set' or 'bag', got {self.kind!r}")
        for f in ("small_size", "large_count"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"table {self.name}: {f} must be an int >= 0, got {v!r}")
        if self.lanes is not False and (self.lanes is not True or self.kind != "bag"):
            raise ValueError(f"table {self.name}: lanes must be a bool, True for a bag only")

    def size(self, field: str, config: Config) -> int:
        """``capacity``, ``max_key`` or ``max_value`` resolved for ``config`` (a positive int,
        else ValueError)."""
        v = getattr(self, field)
        n = v if isinstance(v, int) else v(config)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"table {self.name}: {field} must be a positive int, got {n!r}")
        return n


_declared: dict[str, TableDecl] = {}


def declare(*decls: TableDecl) -> None:
    """Add tables every registry of this process holds. Declaring a name again with an equal
    declaration changes nothing; with a different one, ValueError."""
    for d in decls:
        old = _declared.get(d.name)
        if old is not None and old != d:
            raise ValueError(f"table {d.name} is already declared differently: {old}")
        _declared[d.name] = d


def declared() -> tuple[TableDecl, ...]:
    """Every table declared in this process, in declaration order."""
    return tuple(_declared.values())
