"""Bulk deletes by an index rewrite (``shm/rewrite.py``) against a plain-dict model, over a real
POSIX shared-memory segment (``Rig``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from helpers.table_rig import Rig, healthy, same_home_keys
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


def _fills_to_capacity(t: Table, n: int) -> None:
    """``t`` holding ``n`` rows takes rows up to its capacity, and not one more: the free
    stacks and the row counter a rewrite left are exact."""
    while n < CAPACITY:
        t.insert(1000 + n, "v")
        n += 1
    with pytest.raises(TableFull):
        t.insert(5000, "v")
    healthy(t)


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
    _fills_to_capacity(t, len(left))


def test_a_rewrite_is_current_until_its_buckets_move(rig: Rig) -> None:
    """A plan touches the buckets from its cluster's first slot to the empty slot ending it.
    A word stored in place, or an insert or delete in another bucket, leaves it current; an
    insert at the slot ending the cluster (which lengthens it) or a delete inside it makes it
    stale."""
    t = rig.tables[0]
    assert t.nslots >= 4 * 16  # buckets 0, 1 for the cluster, 3 for the others
    a, b, c = same_home_keys(t, 3, 14)  # slots 14, 15, 16: a cluster over buckets 0 and 1
    far, = same_home_keys(t, 1, 50)  # bucket 3
    for k in (a, b, c, far):
        t.insert(k, k)
    gone = t.prepare(b).hash

    def plan() -> object:
        p = t.copy_index().without(lambda h, r: h == gone)
        assert p is not None and p.rows == 1 and p.buckets == 2  # type: ignore[attr-defined]
        return p

    p = plan()
    t.set_word(a, 99)
    near, = same_home_keys(t, 1, 52)  # bucket 3 as well
    t.insert(near, near)
    t.delete(far)
    with rig.lock:
        assert p.current()  # type: ignore[attr-defined]
    late, = same_home_keys(t, 1, 16)  # probes 16 and lands on 17, the cluster's end
    t.insert(late, late)
    with rig.lock:
        assert not p.current()  # type: ignore[attr-defined]
    t.delete(late)
    p = plan()
    t.delete(c)
    with rig.lock:
        assert not p.current()  # type: ignore[attr-defined]
    p = plan()
    with rig.lock:
        assert p.current()  # type: ignore[attr-defined]
        p.store()  # type: ignore[attr-defined]
    assert t.member(a) and t.word(a) == 99 and not t.member(b)
    assert t.lookup(late) == [] and t.lookup(near) == [near] and t.count() == 2
    healthy(t)


def test_a_copy_finds_a_rows_word_and_words_load_together(rig: Rig) -> None:
    t = rig.tables[0]
    _fill(t, {k: "x" * (50 if k % 3 else 1) for k in range(12)})  # both record classes
    copy = t.copy_index()
    refs = []
    for k in range(12):
        got = copy.find(t.prepare(k))
        assert got is not None
        hit, pins = got
        assert hit is not None and hit[0] == t.prepare(k).hash
        assert t.load_word(hit[2]) == k + 7
        assert pins and all(t._ver[b] == v for b, v in pins)
        refs.append(hit[2])
    got = copy.find(t.prepare(99))
    assert got is not None and got[0] is None and got[1]
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


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(rows=st.dictionaries(st.integers(0, 200), VALUE, min_size=1, max_size=CAPACITY - 8),
       doomed=st.sets(st.integers(0, 200)), group=st.integers(1, 16),
       meddle=st.lists(st.tuples(st.booleans(), st.integers(0, 300)), max_size=12),
       i=st.sampled_from([0, 1]))
def test_windowed_bulk_deletes_against_writers_between_plan_and_hold(
        rig: Rig, monkeypatch: pytest.MonkeyPatch, rows: dict[int, object], doomed: set[int],
        group: int, meddle: list[tuple[bool, int]], i: int) -> None:
    """A sweep's bulk rewrites go window by window (``SWEEP_BATCH`` rows each, then
    ``SWEEP_GROUP`` for what writers made them leave), each planned
    lock-free. Between every plan and its hold (in ``prepare``, which runs there) another
    writer inserts and deletes rows that are not doomed: a plan whose buckets it touched is
    made again without them, and whatever is left goes row by row. In the end exactly the
    doomed rows are gone, every other row (the writer's too) is there with its word, and the
    table is sound and fills to its capacity again."""
    monkeypatch.setattr(sweep, "SWEEP_BULK", 1)
    monkeypatch.setattr(sweep, "SWEEP_BATCH", 2 * group)
    monkeypatch.setattr(sweep, "SWEEP_GROUP", group)
    large = [k for k, v in rows.items() if isinstance(v, str)]
    for k in large[LARGE - 2:]:
        del rows[k]
    t = rig.reset(i)
    _fill(t, rows)
    model = dict(rows)
    doomed &= rows.keys()
    ops = iter(meddle)

    def prepare(deleted: list[tuple[object, object]]) -> object:
        assert not rig.lock.held_by_me()
        for add, k in ops:  # one write per plan, while there are any
            if add and k not in model and len(model) < CAPACITY - 1:
                t.insert(k, 1)
                t.set_word(k, k + 7) if t.kind == "set" else None
                model[k] = 1
            elif not add and k in model and k not in doomed:
                t.delete(k)
                del model[k]
            break
        return _Fresh()

    prows = {t.prepare(k).kbytes for k in doomed}
    chosen = [row for row in t.sweep_rows() if row[2] in prows]
    assert len(chosen) == len(doomed)
    assert t.sweep_delete(chosen, prepare=prepare) == len(doomed)
    left = {k: v for k, v in model.items() if k not in doomed}
    assert sorted(t.scan(), key=repr) == sorted(left.items(), key=repr)
    assert t.count() == len(left)
    if t.kind == "set":
        assert all(t.word(k) == k + 7 for k in left)
    healthy(t)
    _fills_to_capacity(t, len(left))


class _Fresh:
    def current(self) -> bool:
        return True

    def store(self) -> None:
        pass
