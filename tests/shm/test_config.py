"""Config: contract §2 defaults and the validation that keeps a bad config out of the header."""

from __future__ import annotations

import pytest

from shmcancel import Config


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
