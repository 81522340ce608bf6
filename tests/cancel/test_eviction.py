"""contract §4.4: the eviction order as a pure function (the table-backed runs are in
test_cancellation.py)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmcancel.cancel.eviction import batch_size, choose, rank


@pytest.mark.parametrize(
    ("max_rows", "capacity", "batch"),
    [(10_000, 10_000, 500), (100, 10_000, 5), (39, 10_000, 1), (19, 100, 1), (1, 100, 1),
     (None, 10_000, 500), (None, 100, 5), (None, 10, 1), (41, 41, 2)],
)
def test_batch_size(max_rows, capacity, batch):
    assert batch_size(max_rows, capacity) == batch


def rows_of(spec):
    """spec: {scope: [cancelled_at, ...]} -> rows with ids r0, r1, ... per scope."""
    return [(s, f"r{i}", t) for s, ts in spec.items() for i, t in enumerate(ts)]


def test_largest_scope_loses_its_oldest_first():
    rows = rows_of({"big": [5.0, 1.0, 3.0, 2.0, 4.0], "small": [0.1, 0.2]})
    assert choose(rows, 2) == [("big", "r1"), ("big", "r3")]


def test_spills_into_the_next_largest():
    rows = rows_of({"a": [3.0, 1.0, 2.0], "b": [0.5, 0.6], "c": [0.1]})
    assert choose(rows, 5) == [("a", "r1"), ("a", "r2"), ("a", "r0"), ("b", "r0"), ("b", "r1")]


def test_sizes_are_counted_before_any_row_goes():
    # a: 3 rows, b: 2 rows. Even once a is down to 1, the order does not re-rank.
    rows = rows_of({"a": [1.0, 2.0, 3.0], "b": [0.1, 0.2]})
    assert choose(rows, 4)[:3] == [("a", "r0"), ("a", "r1"), ("a", "r2")]


def test_equal_sizes_tie_and_age_decides():
    rows = rows_of({"a": [1.0, 4.0], "b": [2.0, 3.0]})
    assert choose(rows, 3) == [("a", "r0"), ("b", "r0"), ("b", "r1")]


def test_all_singletons_fall_back_to_age():
    rows = [(f"s{i}", "1", t) for i, t in enumerate([9.0, 3.0, 7.0, 1.0, 5.0])]
    assert choose(rows, 3) == [("s3", "1"), ("s1", "1"), ("s4", "1")]


def test_sub_millisecond_differences_count():
    rows = [("a", "1", 1000.0002), ("b", "1", 1000.0001), ("c", "1", 1000.0003)]
    assert choose(rows, 1) == [("b", "1")]


def test_exact_ties_break_by_scope_then_id():
    rows = [("b", "2", 1.0), ("b", "1", 1.0), ("a", "9", 1.0), ("a", "10", 1.0)]
    assert choose(rows, 4) == [("a", "10"), ("a", "9"), ("b", "1"), ("b", "2")]


def test_batch_always_full_or_everything():
    rows = rows_of({"a": [1.0], "b": [2.0], "c": [3.0]})
    assert len(choose(rows, 2)) == 2
    assert len(choose(rows, 3)) == 3
    assert sorted(choose(rows, 50)) == [("a", "r0"), ("b", "r0"), ("c", "r0")]
    assert choose([], 5) == []
    assert choose(rows, 0) == []


def test_victim_with_fewer_rows_goes_after_the_flooders():
    rng = random.Random(7)
    spec = {f"flood{i}": [rng.random() for _ in range(20)] for i in range(5)}
    spec["victim"] = [0.0, 0.001]  # older than anything the flooders hold
    rows = rows_of(spec)
    victims = choose(rows, 100)
    assert len(victims) == 100 and all(s.startswith("flood") for s, _ in victims)


@given(
    st.lists(
        st.tuples(st.sampled_from("abcde"), st.text(max_size=3), st.floats(0, 100)),
        unique_by=lambda r: (r[0], r[1]),
        max_size=40,
    ),
    st.integers(0, 50),
)
@settings(deadline=None)  # a loaded machine's pause is no failure of the order
def test_choose_is_the_prefix_of_the_full_rank(rows, batch):
    ranked = rank(rows)
    assert choose(rows, batch) == [(s, i) for s, i, _ in ranked[:batch]]
    # the rank is by (-scope size, age, scope, id)
    sizes = {s: sum(1 for r in rows if r[0] == s) for s, _, _ in rows}
    keys = [(-sizes[s], t, s, i) for s, i, t in ranked]
    assert keys == sorted(keys)
