"""Bulk deletes by an index rewrite (``shm/rewrite.py``) against a plain-dict model, over a real
POSIX shared-memory segment (``Rig``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from helpers.table_rig import Rig, healthy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shmcancel.exceptions import TableFull
from shmcancel.shm import sweep
from shmcancel.shm.table import Table

CAPACITY = 48
LARGE = 12  # rows whose value needs a large record
SPEC = [("set", CAPACITY, 128, 48, LARGE), ("bag", CAPACITY, 128, 48, LARGE)]


@pytest.fixture
def rig(shm_name: str) -> Iterator[Rig]:
    r = Rig(shm_name, SPEC)  # type: ignore[arg-type]
    try:
        yield r
    finally:
        r.close()


VALUE = st.one_of(st.integers(0, 9), st.text("z", min_size=40, max_size=60))  # small or large


def _fill(t: Table, rows: dict[int, object]) -> None:
    for k, v in rows.items():
        t.insert(k, v)
        t.set_word(k, k + 7) if t.kind == "set" else None


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(rows=st.dictionaries(st.integers(0, 200), VALUE, max_size=CAPACITY),
       drop=st.sets(st.integers(0, 200)), i=st.sampled_from([0, 1]))
def test_a_rewrite_deletes_exactly_the_dropped_rows(rig: Rig, rows: dict[int, object],
                                                   drop: set[int], i: int) -> None:
    """The rows left are the model's less the dropped ones, words kept; the free stacks and
    row counter are exact: the table fills to its capacity again, and not one row more."""
    large = [k for k, v in rows.items() if isinstance(v, str)]
    for k in large[LARGE:]:
        del rows[k]
    t = rig.reset(i)
    _fill(t, rows)
    hashes = {t.prepare(k).hash for k in drop}
    copy = t.copy_index()
    assert copy is not None
    plan = copy.without(lambda h, r: h in hashes)
    if not drop & rows.keys():
        assert plan is None
        return
    assert plan is not None and plan.rows == len(drop & rows.keys())
    with rig.lock:
        assert plan.current()
        plan.store()
    left = {k: v for k, v in rows.items() if k not in drop}
    assert sorted(t.scan(), key=repr) == sorted(left.items(), key=repr)
    assert t.count() == len(left)
    for k in rows:
        assert t.member(k) == (k in left)
        if t.kind == "set" and k in left:
            assert t.word(k) == k + 7
    healthy(t)
    n = len(left)
    while n < CAPACITY:
        t.insert(1000 + n, "v")
        n += 1
    with pytest.raises(TableFull):
        t.insert(5000, "v")
    healthy(t)


def test_a_rewrite_is_current_until_the_index_moves(rig: Rig) -> None:
    """A word stored in place leaves the copy current (it is not the index); an insert or a
    delete moves a version and makes every rewrite from an older copy stale."""
    t = rig.tables[0]
    _fill(t, {k: k for k in range(10)})
    gone = t.prepare(3).hash

    def plan() -> object:
        copy = t.copy_index()
        assert copy is not None
        p = copy.without(lambda h, r: h == gone)
        assert p is not None
        return p

    p = plan()
    t.set_word(4, 99)
    with rig.lock:
        assert p.current()  # type: ignore[attr-defined]
    t.insert(11, 11)
    with rig.lock:
        assert not p.current()  # type: ignore[attr-defined]
    p = plan()
    t.delete(5)
    with rig.lock:
        assert not p.current()  # type: ignore[attr-defined]
    assert t.member(3) and t.word(4) == 99


def test_a_copy_finds_a_rows_word_and_words_load_together(rig: Rig) -> None:
    t = rig.tables[0]
    _fill(t, {k: "x" * (50 if k % 3 else 1) for k in range(12)})  # both record classes
    copy = t.copy_index()
    assert copy is not None
    refs = []
    for k in range(12):
        hit = copy.find(t.prepare(k))
        assert hit is not None and hit[0] == t.prepare(k).hash
        assert t.load_word(hit[2]) == k + 7
        refs.append(hit[2])
    assert copy.find(t.prepare(99)) is None
    assert t.load_words(refs)() == tuple(k + 7 for k in range(12))
    assert t.load_words(refs[5:6])() == (12,)
    with rig.lock:
        t.store_word(refs[5], 1)
    assert t.load_words(refs[4:7])() == (11, 1, 13)


def test_sweep_delete_runs_on_chunk_in_each_chunks_hold(rig: Rig,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """``on_chunk`` alone: rows go chunk by chunk (no bulk rewrite), each chunk's callback in
    its own hold. With ``prepare``: one rewrite, ``prepare`` lock-free, its companion asked and
    stored in the rewrite's hold; a companion that stays stale sends the rows chunk by chunk."""
    monkeypatch.setattr(sweep, "SWEEP_BULK", 4)
    lock = rig.lock
    t = rig.tables[0]
    _fill(t, {k: k for k in range(45)})
    rows = sorted(t.sweep_rows(), key=lambda row: row[2])
    seen: list[object] = []

    def on_chunk(chunk: list[tuple[object, object]]) -> None:
        assert lock.held_by_me() and not any(t.member(k) for k, _ in chunk)
        seen.extend(k for k, _ in chunk)

    assert t.sweep_delete(rows[:15], on_chunk=on_chunk) == 15
    assert sorted(seen) == list(range(15))  # type: ignore[type-var]
    events: list[tuple[str, bool, int]] = []

    class Companion:
        def __init__(self, fresh: bool) -> None:
            self.fresh = fresh

        def current(self) -> bool:
            events.append(("current", lock.held_by_me(), t.count()))
            return self.fresh

        def store(self) -> None:
            events.append(("store", lock.held_by_me(), t.count()))

    def prepare(deleted: list[tuple[object, object]]) -> Companion:
        events.append(("prepare", lock.held_by_me(), len(deleted)))
        return Companion(fresh=len(events) > 1)

    assert t.sweep_delete(rows[15:30], on_chunk=on_chunk, prepare=prepare) == 15
    assert events == [("prepare", False, 15), ("current", True, 30),  # stale: planned again
                      ("prepare", False, 15), ("current", True, 30), ("store", True, 15)]
    assert len(seen) == 15
    events.clear()
    assert t.sweep_delete(rows[30:], on_chunk=on_chunk,
                          prepare=lambda d: Companion(fresh=False)) == 15
    assert sorted(seen) == list(range(15)) + list(range(30, 45))  # type: ignore[type-var]
    assert t.count() == 0
    healthy(t)
