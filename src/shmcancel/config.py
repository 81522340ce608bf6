"""Registry configuration. Stored in the segment header (:meth:`Config.pack`, opaque to the
shared-memory layer), so every attached process agrees."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any

import msgpack

DEFAULT_SESSIONS_PER_CLIENT = 32
_MAX_CAPACITY = 10_000_000  # rows of one table
MAX_SESSIONS_PER_CLIENT = 1024  # the per-client row lists them all: its record grows with this


def _default_in_flight_capacity() -> int:
    # gunicorn's usual ceiling is (2 x cores + 1) workers; give each up to 32 threads, twice over.
    return max(1024, (2 * (os.cpu_count() or 1) + 1) * 32 * 2)


@dataclass(frozen=True, slots=True)
class Config:
    """Sizes and timings of one registry. Times are in seconds.

    ``max_rows``: cap on cancellation rows (``None``: up to ``capacity``); reaching it evicts.
    ``capacity``: physical cancellation rows; ``None`` means ``max(10_000, max_rows)``.
    ``max_rows_per_scope``: per-scope quota (``None`` disables); the only bound that rejects.
    ``ttl``: cleanup removes cancellation rows strictly older than this (``0`` allowed).
    ``janitor_interval``: period of the automatic sweep.
    ``in_flight_capacity``: in-flight rows (one per running request).
    ``stream_cancel_timeout``: grace a disconnected request's tool gets before it is stopped.
    ``session_capacity`` / ``session_ttl``: MCP sessions kept, and their idle lifetime.
    ``lock_timeout``: longest wait for the registry lock held by a live process.
    ``sessions_per_client``: sessions one client (principal, else address; IPv6 by /64) holds at
    once; minting one more replaces that client's own least recently seen idle session.
    ``None`` means ``min(32, session_capacity)``; at most 1024 and ``session_capacity``.
    ``preallocate``: allocate every page of the segment at ``create``, the worst-case records
    too, rather than those as rows need them: a /dev/shm filled by others since can then never
    refuse a row (no ``ShmFull``), at the price of the whole file in memory from the start
    (31.2 MiB with the defaults against 7.2; ``tools/footprint.py``).
    """

    max_rows: int | None = 10_000
    capacity: int | None = None
    max_rows_per_scope: int | None = 256
    ttl: float = 300.0
    janitor_interval: float = 60.0
    in_flight_capacity: int = field(default_factory=_default_in_flight_capacity)
    stream_cancel_timeout: float = 5.0
    session_capacity: int = 4096
    session_ttl: float = 3600.0
    lock_timeout: float = 10.0
    sessions_per_client: int | None = None
    preallocate: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):  # a number subclass is judged and kept by its own value
            v = getattr(self, f.name)
            if type(v) not in (int, float, bool) and isinstance(v, int | float):
                # its comparisons, __index__, __int__ or __float__ could say anything
                object.__setattr__(self, f.name, int.__index__(v) if isinstance(v, int)
                                   else float.__float__(v))
        if type(self.preallocate) is not bool:
            raise ValueError(f"Config.preallocate must be True or False, got "
                             f"{self.preallocate!r}")
        for name in ("max_rows", "max_rows_per_scope"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v < 1):
                raise ValueError(f"Config.{name} must be a positive int or None, got {v!r}")
            if v is not None and v > _MAX_CAPACITY:  # more than a table holds; and the header
                raise ValueError(  # stores it as msgpack, whose ints end at 2**64
                    f"Config.{name} must be at most {_MAX_CAPACITY} (the largest capacity), "
                    f"got {v!r}")
        if self.capacity is None:
            object.__setattr__(self, "capacity", max(10_000, self.max_rows or 0))
        for name in ("capacity", "in_flight_capacity", "session_capacity"):
            v = getattr(self, name)
            if not _is_int(v) or not 1 <= v <= _MAX_CAPACITY:
                raise ValueError(f"Config.{name} must be an int in 1..{_MAX_CAPACITY}, got {v!r}")
        if self.max_rows is not None and self.max_rows > self.capacity:  # type: ignore[operator]
            raise ValueError(
                f"Config.max_rows ({self.max_rows}) exceeds capacity ({self.capacity})"
            )
        if self.sessions_per_client is None:
            object.__setattr__(self, "sessions_per_client",
                               min(DEFAULT_SESSIONS_PER_CLIENT, self.session_capacity))
        v = self.sessions_per_client
        top = min(MAX_SESSIONS_PER_CLIENT, self.session_capacity)
        if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= top:
            raise ValueError(
                "Config.sessions_per_client must be an int in 1..min(1024, session_capacity) "
                f"or None, got {v!r}")
        for name in ("ttl", "janitor_interval", "stream_cancel_timeout", "session_ttl",
                     "lock_timeout"):
            v = getattr(self, name)
            # ttl may be 0: every row older than now (strictly) goes at the next sweep
            low_ok = name == "ttl" and v == 0
            if isinstance(v, bool) or not isinstance(v, int | float) or not (
                    0 < v < 1e9 or low_ok):
                zero = "(or 0) " if name == "ttl" else ""
                raise ValueError(f"Config.{name} must be a number of seconds above 0 {zero}and "
                                 f"below 1e9 (31 years), got {v!r}")
            object.__setattr__(self, name, float(v))

    def pack(self) -> bytes:
        """This config as a registry header stores it: msgpack of ``{field: value}``."""
        return msgpack.packb({f.name: getattr(self, f.name) for f in fields(self)})

    @classmethod
    def unpack(cls, blob: bytes) -> Config:
        """The config :meth:`pack` made ``blob`` from. ``ValueError`` (never another error) for
        anything else: not msgpack, not a map of exactly Config's fields, or values Config
        refuses."""
        try:
            d: Any = msgpack.unpackb(blob, raw=False, strict_map_key=True, use_list=False)
        except Exception as e:  # msgpack raises several types for garbage
            raise ValueError(f"not a packed Config ({type(e).__name__}: {e})") from None
        if type(d) is not dict:
            raise ValueError(f"not a packed Config (a {type(d).__name__}, not a map)")
        names = {f.name for f in fields(cls)}
        if d.keys() != names:
            missing = sorted(names - d.keys())
            unknown = ", ".join(sorted(repr(k) for k in d.keys() - names))  # str or bytes
            raise ValueError(f"Config fields missing {missing}, unknown [{unknown}]")
        try:
            return cls(**d)
        except ValueError:
            raise
        except Exception as e:  # pragma: no cover - __post_init__ raises ValueError
            raise ValueError(f"invalid Config: {e}") from None

    @property
    def effective_max_rows(self) -> int:
        """The row count at which an insert evicts: ``max_rows``, else ``capacity``."""
        return self.max_rows if self.max_rows is not None else self.capacity  # type: ignore[return-value]


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
