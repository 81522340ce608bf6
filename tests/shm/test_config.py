"""Config: contract §2 defaults and the validation that keeps a bad config out of the header."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from shmcancel import Config
from shmcancel.shm.segment import CONFIG_MAX


def test_spec_defaults() -> None:
    c = Config()
    assert (c.max_rows, c.capacity, c.max_rows_per_scope) == (10_000, 10_000, 256)
    assert (c.ttl, c.janitor_interval, c.stream_cancel_timeout) == (300.0, 60.0, 5.0)
    assert c.in_flight_capacity >= 1024
    assert c.effective_max_rows == 10_000


@pytest.mark.parametrize(
    ("kwargs", "capacity", "effective"),
    [
        ({"max_rows": 20_000}, 20_000, 20_000),  # capacity follows a larger max_rows
        ({"max_rows": 100}, 10_000, 100),
        ({"max_rows": None}, 10_000, 10_000),  # no cap below the physical capacity
        ({"max_rows": None, "capacity": 50}, 50, 50),
        ({"max_rows": 10, "capacity": 50}, 50, 10),
    ],
)
def test_capacity_follows_max_rows(kwargs: dict, capacity: int, effective: int) -> None:
    c = Config(**kwargs)
    assert c.capacity == capacity
    assert c.effective_max_rows == effective


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_rows": 0},
        {"max_rows": -1},
        {"max_rows": 1.5},
        {"max_rows": True},
        {"max_rows_per_scope": 0},
        {"max_rows_per_scope": 10_000_001},
        {"max_rows_per_scope": 2**64},  # was accepted, then Registry.create: OverflowError
        {"max_rows": 10**30},
        {"max_rows": 100, "capacity": 50},
        {"capacity": 0},
        {"in_flight_capacity": 0},
        {"session_capacity": "10"},
        {"janitor_interval": 0},
        {"ttl": -5},
        {"ttl": "300"},
        {"ttl": float("nan")},
        {"janitor_interval": True},
        {"stream_cancel_timeout": float("inf")},
        {"lock_timeout": 0},
        {"preallocate": 1},
        {"preallocate": None},
    ],
)
def test_rejects_bad_values_with_a_clear_error(kwargs: dict) -> None:
    field = next(iter(kwargs))
    with pytest.raises(ValueError, match=f"Config.({field}|max_rows)"):
        Config(**kwargs)


def test_times_are_floats_and_config_is_frozen() -> None:
    c = Config(ttl=5, janitor_interval=1)
    assert isinstance(c.ttl, float) and isinstance(c.janitor_interval, float)
    with pytest.raises(AttributeError):
        c.ttl = 1.0  # type: ignore[misc]


# A value other than the default for every field (and None where a field allows it).
EVERY_FIELD = {"max_rows": 1234, "capacity": 4321, "max_rows_per_scope": 7, "ttl": 0.1 + 0.2,
               "janitor_interval": 12.5, "in_flight_capacity": 999, "stream_cancel_timeout": 2.25,
               "session_capacity": 77, "session_ttl": 1e-3, "lock_timeout": 3.0,
               "sessions_per_client": 5, "preallocate": True}


def test_pack_roundtrips_every_field() -> None:
    assert EVERY_FIELD.keys() == {f.name for f in dataclasses.fields(Config)}
    c = Config(**EVERY_FIELD)
    assert all(getattr(c, k) != getattr(Config(), k) for k in EVERY_FIELD)
    back = Config.unpack(c.pack())
    assert back == c
    for k in EVERY_FIELD:  # exact values of the same types (floats bit for bit)
        assert type(getattr(back, k)) is type(getattr(c, k)) and getattr(back, k) == EVERY_FIELD[k]
    for c in (Config(), Config(max_rows=None, max_rows_per_scope=None)):
        assert Config.unpack(c.pack()) == c
    assert len(Config(**{**EVERY_FIELD, "capacity": 10_000_000}).pack()) <= CONFIG_MAX


@pytest.mark.parametrize("blob", [
    b"", b"\xc1", b"\x91" * 5000, b"\x81\x01\x02", msgpack.packb({b"ttl": 1.0}),
    msgpack.packb(None), msgpack.packb({"ttl": 1.0}), Config().pack()[:-1],
    Config().pack() + b"\x00",
])
def test_unpack_refuses_anything_pack_did_not_make(blob: bytes) -> None:
    with pytest.raises(ValueError, match="Config"):
        Config.unpack(blob)


@pytest.mark.parametrize("name", ["ttl", "janitor_interval", "stream_cancel_timeout",
                                  "session_ttl", "lock_timeout"])
def test_a_time_past_the_bound_is_refused_naming_the_bound(name: str) -> None:
    """Times are bounded above (1e9 s) as well as below: the message says both bounds."""
    with pytest.raises(ValueError, match=rf"Config\.{name} .*above 0 .*below 1e9"):
        Config(**{name: 1e9})
    assert getattr(Config(**{name: 1e9 - 1}), name) == 1e9 - 1


class _Always(int):
    """An int whose comparisons and conversions lie: every bound check passes."""

    def __lt__(self, other: object) -> bool:
        return False

    def __gt__(self, other: object) -> bool:
        return False

    def __le__(self, other: object) -> bool:
        return True

    def __ge__(self, other: object) -> bool:
        return True

    def __index__(self) -> int:
        return 5

    def __int__(self) -> int:
        return 5

    def __float__(self) -> float:
        return 5.0

    __hash__ = int.__hash__


class _NanFloat(float):
    def __float__(self) -> float:
        return float("nan")


@pytest.mark.parametrize("kwargs", [
    {"max_rows": _Always(-5)},
    {"max_rows": None, "capacity": _Always(0)},
    {"in_flight_capacity": _Always(0)},
    {"session_capacity": _Always(10**12)},
    {"max_rows_per_scope": _Always(0)},
    {"sessions_per_client": _Always(-1)},
    {"ttl": _Always(-1)},
    {"lock_timeout": _Always(0)},
])
def test_an_int_subclass_lying_in_its_comparisons_is_judged_by_its_value(kwargs: dict) -> None:
    """Checked by what it holds at construction (not later, as Registry.create's "needs 7 TB
    of /dev/shm" or "table scope_counts: capacity must be a positive int, got -4")."""
    field = next(iter(kw for kw in kwargs if kwargs[kw] is not None))
    with pytest.raises(ValueError, match=f"Config.{field}"):
        Config(**kwargs)


def test_number_subclasses_are_stored_as_their_plain_values() -> None:
    c = Config(max_rows=_Always(50), capacity=_Always(60), in_flight_capacity=_Always(7),
               session_capacity=_Always(9), max_rows_per_scope=_Always(3),
               sessions_per_client=_Always(2), ttl=_NanFloat(5.0), janitor_interval=_Always(2))
    assert (c.max_rows, c.capacity, c.in_flight_capacity, c.session_capacity,
            c.max_rows_per_scope, c.sessions_per_client) == (50, 60, 7, 9, 3, 2)
    assert all(type(getattr(c, f.name)) is int for f in dataclasses.fields(Config)
               if f.name in ("max_rows", "capacity", "in_flight_capacity", "session_capacity",
                             "max_rows_per_scope", "sessions_per_client"))
    assert c.ttl == 5.0 and type(c.ttl) is float  # its value, not what __float__ says (NaN)
    assert c.janitor_interval == 2.0
    assert Config.unpack(c.pack()) == c


def test_a_max_rows_past_the_largest_capacity_is_refused_naming_max_rows() -> None:
    with pytest.raises(ValueError, match=r"Config\.max_rows .*10000000"):
        Config(max_rows=10_000_001)
    assert Config(max_rows=10_000_000).capacity == 10_000_000
