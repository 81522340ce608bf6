"""The moves that keep every entry of a linear-probing index reachable after entries are dropped
(``fsck.reachability_moves``: fsck's repairs, a sweep's bulk rewrite). One pass in probe order
was taken to be enough; a probe cluster that wraps past the last slot broke that: a kept row
became invisible to every lookup (a reviewer found it; about 0.9 % of random drops)."""

from __future__ import annotations

from typing import Any

from helpers.table_rig import Rig, healthy, index_reachable, same_home_keys, words_reachable
from hypothesis import example, given, settings
from hypothesis import strategies as st

from shmcancel.shm.fsck import reachability_moves
from shmcancel.shm.sweep import SWEEP_BULK


def _index(nslots: int, homes: list[int]) -> list[int]:
    """A valid index: entries with these homes (hash = ``(i + 1) * nslots + home``, record
    ``i + 1``) inserted in order by linear probing."""
    words = [0] * (2 * nslots)
    for i, home in enumerate(homes):
        j = home
        while words[2 * j]:
            j = (j + 1) % nslots
        words[2 * j], words[2 * j + 1] = (i + 1) * nslots + home, i + 1
    return words


@st.composite
def dropped_index(draw: Any) -> tuple[int, list[int], list[int]]:
    """(nslots, a valid index at most half full, the same with some entries dropped)."""
    nslots = draw(st.sampled_from([8, 16, 32, 64]))
    # homes crowd the end of the index as often as anywhere: clusters that wrap
    home = st.one_of(st.integers(0, nslots - 1), st.sampled_from([nslots - 2, nslots - 1, 0]))
    homes = draw(st.lists(home, min_size=1, max_size=nslots // 2))
    words = _index(nslots, homes)
    used = [s for s in range(nslots) if words[2 * s]]
    gone = draw(st.sets(st.sampled_from(used)))
    dropped = list(words)
    for s in gone:
        dropped[2 * s] = dropped[2 * s + 1] = 0
    return nslots, words, dropped


@settings(max_examples=2000, deadline=None)
@given(dropped_index())
@example((16, _index(16, [14, 14, 0, 15, 15]),  # the reviewer's case: 14 and 0 dropped
          [0, 0, 4 * 16 + 15, 4, 5 * 16 + 15, 5] + [0] * 24 + [2 * 16 + 14, 2]))
def test_every_kept_entry_is_reachable_after_the_moves(case: tuple[int, list[int], list[int]]
                                                       ) -> None:
    nslots, _, dropped = case
    mask = nslots - 1
    words = list(dropped)
    moves = reachability_moves(words, mask)
    assert words_reachable(words, mask)
    assert sorted(zip(words[::2], words[1::2], strict=True)) == sorted(
        zip(dropped[::2], dropped[1::2], strict=True))  # the same entries, none lost or doubled
    replay = list(dropped)  # what fsck and a rewrite store: the moves, in order
    for src, dst, h, r in moves:
        assert replay[2 * src:2 * src + 2] == [h, r]
        replay[2 * dst:2 * dst + 2] = [h, r]
        replay[2 * src:2 * src + 2] = [0, 0]
    assert replay == words
    assert reachability_moves(list(words), mask) == []


def _wrapped_cluster(rig: Rig) -> tuple[Any, list[str], list[str]]:
    """A set table holding one cluster over the end of its index: a@n-2 (home n-2), b@n-1
    (home n-2), z@0 (home 0), p@1 and q@2 (home n-1); returns (table, [a, z], [b, p, q])."""
    t = rig.tables[0]
    n = t.nslots
    a, b = same_home_keys(t, 2, n - 2)
    (z,) = same_home_keys(t, 1, 0)
    p, q = same_home_keys(t, 2, n - 1)
    for k in (a, b, z, p, q):
        t.insert(k, 1)
    words = t._idx.tolist()
    assert [words[2 * s] & (n - 1) for s in (n - 2, n - 1, 0, 1, 2)] == [n - 2, n - 2, 0,
                                                                       n - 1, n - 1]
    return t, [a, z], [b, p, q]


def test_fsck_dropping_entries_of_a_wrapped_cluster_keeps_the_rest_reachable(
        rig_factory) -> None:
    rig = rig_factory([("set", 16, 64)])
    t, drop, keep = _wrapped_cluster(rig)
    for k in drop:  # their records fail their check: fsck drops the two entries
        pk = t.prepare(k)
        s = next(s for s in range(t.nslots) if t._idx[2 * s] == pk.hash)
        off = t._offset(t._idx[2 * s + 1])
        t._buf[off + t.RECORD_HEADER] ^= 0xFF
    with rig.lock:
        assert t.fsck()["bad_entries"] == 2
    assert index_reachable(t)
    for k in keep:
        assert t.lookup(k) == [1], k
    healthy(t)


def test_a_bulk_sweep_around_a_wrapped_cluster_keeps_the_rest_reachable(rig_factory) -> None:
    rig = rig_factory([("set", 2 * SWEEP_BULK, 64)])
    t, drop, keep = _wrapped_cluster(rig)
    fillers = [f"f{i}" for i in range(SWEEP_BULK)]  # enough rows for the bulk rewrite
    for k in fillers:
        t.insert(k, 2)
    kept = {t.prepare(k).kbytes for k in keep}
    doomed = [row for row in t.sweep_rows() if row[2] not in kept]
    assert len(doomed) == SWEEP_BULK + len(drop)
    assert t.sweep_delete(doomed) == len(doomed)
    assert index_reachable(t)
    for k in keep:
        assert t.lookup(k) == [1], k
    assert t.count() == len(keep)
    healthy(t)
