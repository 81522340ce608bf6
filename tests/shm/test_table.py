"""The table engine against a plain-dict model, over a real posix_ipc segment.

The tables live in a ``Rig`` (tests/helpers/table_rig.py, shared with test_table_procs.py and
test_crash.py): a real POSIX shared-memory segment with a minimal lock over a real semaphore.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import pytest
from helpers.table_rig import HASH_KEY, Rig, healthy, same_home_keys
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from shmcancel.exceptions import RowTooLarge, TableFull
from shmcancel.shm.hashing import siphash, table_key
from shmcancel.shm.layout import _TOP
from shmcancel.shm.table import PreparedKey, Table

# ------------------------------------------------------------------------ model-based

KEYS = [f"k{i}" for i in range(24)] + [("s", 1), ("s", "1"), 1, 1.0, True, b"k1"]
SMALL_VALUES = st.one_of(st.integers(-3, 3), st.text("ab", max_size=6),
                         st.tuples(st.integers(0, 2), st.text("xy", max_size=3)))
VALUES = st.one_of(SMALL_VALUES, st.text("z", min_size=60, max_size=90))  # some too large
RECORD_SIZE = 96  # payload 72 bytes: the long texts do not fit


def packed(x: Any) -> bytes:
    import msgpack
    return msgpack.packb(x, use_bin_type=True)


class TableMachine(RuleBasedStateMachine):
    """A set or bag table against a model: dict packed-key -> list of packed values."""

    rig: Rig
    kind: str
    capacity: int

    def __init__(self) -> None:
        super().__init__()
        self.model: dict[bytes, list[bytes]] = {}
        self.words: dict[bytes, int] = {}  # a set's rows' words (absent: 0)
        self.keys: dict[bytes, Any] = {}
        self.receipts: list[tuple[Any, bytes, tuple[int, int]]] = []  # (key, value, receipt)
        self.kept: dict[bytes, Any] = {}  # prepared keys that live across rules
        self.tokens = 0
        self.t = self.rig.reset(0)
        self.watches = [(k, self.t.watch(k)) for k in KEYS[:3]]

    def rows(self) -> int:
        return sum(len(v) for v in self.model.values())

    def region_bytes(self) -> bytes:
        return self.rig.region(0).tobytes()

    def _too_large(self, k: Any, v: Any) -> bool:
        return len(packed(k)) + len(packed(v)) > RECORD_SIZE - Table.RECORD_HEADER

    @initialize()
    def start(self) -> None:
        healthy(self.t)

    @rule(k=st.sampled_from(KEYS), v=VALUES, prepared=st.booleans(), held=st.booleans())
    def insert(self, k: Any, v: Any, prepared: bool, held: bool) -> None:
        """``held``: through insert_held, inside a lock hold of the test's own."""
        kb, vb = packed(k), packed(v)
        key = self.t.prepare(k) if prepared else k

        def insert() -> None:
            if held:
                with self.rig.lock:
                    self.t.insert_held(key, v)
            else:
                self.t.insert(key, v)

        if self._too_large(k, v):
            before, acq = self.region_bytes(), self.rig.lock.acquisitions
            with pytest.raises(RowTooLarge):
                insert()
            assert self.region_bytes() == before
            assert self.rig.lock.acquisitions == acq + held  # insert takes no lock for it
            return
        vals = self.model.get(kb, [])
        if self.kind == "set" and vals:
            insert()
            self.model[kb] = [vb]
        elif self.kind == "bag" and vb in vals:
            insert()
        elif self.rows() >= self.capacity:
            with pytest.raises(TableFull):
                insert()
        else:
            insert()
            self.model.setdefault(kb, []).append(vb)
            self.keys[kb] = k
            self.words.pop(kb, None)  # a fresh row's word is 0

    @rule(k=st.sampled_from(KEYS), v=VALUES)
    def add_held(self, k: Any, v: Any) -> None:
        """A cancel's write of a key it found without a row, inside its hold."""
        kb, vb = packed(k), packed(v)
        with self.rig.lock:
            if self.t.member(k):
                return
            key = self.t.prepare(k)
            if self._too_large(k, v):
                before = self.region_bytes()
                with pytest.raises(RowTooLarge):
                    self.t.add_held(key, v)
                assert self.region_bytes() == before
            elif self.rows() >= self.capacity:
                with pytest.raises(TableFull):
                    self.t.add_held(key, v)
            else:
                self.t.add_held(key, v)
                self.model[kb] = [vb]
                self.keys[kb] = k
                self.words.pop(kb, None)

    @rule(k=st.sampled_from(KEYS), v=SMALL_VALUES, w=st.sampled_from((0, 1, 7, 2**32 - 1)))
    def insert_new(self, k: Any, v: Any, w: int) -> None:
        kb = packed(k)
        if kb in self.model:
            assert self.t.insert_new(k, v, w) is False
        elif self.rows() >= self.capacity:
            with pytest.raises(TableFull):
                self.t.insert_new(k, v, w)
        else:
            assert self.t.insert_new(k, v, w) is True
            self.model[kb] = [packed(v)]
            self.keys[kb] = k
            self.words[kb] = w

    @rule(k=st.sampled_from(KEYS), w=st.integers(0, 2**32 - 1))
    def set_word(self, k: Any, w: int) -> None:
        """Sets: the word changes in place; a bag's row is only ever set by insert_new here."""
        if self.kind != "set":
            return
        kb = packed(k)
        assert self.t.set_word(k, w) is (kb in self.model)
        if kb in self.model:
            self.words[kb] = w

    @rule(k=st.sampled_from(KEYS[:4]), w=st.integers(0, 2**32 - 1), kept=st.booleans(),
          at=st.booleans())
    def store_word_at_ref(self, k: Any, w: int, kept: bool, at: bool) -> None:
        """The one-probe path (read, then change, under one hold): the ref reads the word
        set_word would change, and a store through it is that change. ``kept``: through a
        prepared key kept across rules, whose cached ref must follow every insert, delete and
        move of the rows around it. ``at``: the ref and the word read by ``word_at``."""
        if self.kind != "set":
            return
        kb = packed(k)
        key = self.kept.setdefault(kb, self.t.prepare(k)) if kept else k
        with self.rig.lock:
            if at:
                ref, word = self.t.word_at(key)
                assert (ref, word) == ((-1, 0) if ref < 0 else (ref, self.t.load_word(ref)))
            else:
                ref = self.t.word_ref(key)
            assert (ref >= 0) is (kb in self.model)
            if ref >= 0:
                assert self.t.load_word(ref) == self.words.get(kb, 0)
                self.t.store_word(ref, w)
                self.words[kb] = w
        if ref < 0 and self.rows() < self.capacity:  # as a count row is made at its first use
            self.insert_new(k, None, w)

    @rule(k=st.sampled_from(KEYS[:4]))
    def word_through_kept_key(self, k: Any) -> None:
        """The lock-free word read through a prepared key kept across rules: after its first
        read it reads the word at the place it found (a set's), and must notice every insert,
        delete and move of the rows around it."""
        kb = packed(k)
        key = self.kept.setdefault(kb, self.t.prepare(k))
        want = self.words.get(kb, 0) if kb in self.model else None
        if self.kind == "set" or want is None:
            assert self.t.word(key) == want
        if self.kind == "set" and want is not None:
            assert key.wref is not None

    @rule(k=st.sampled_from(KEYS), prepared=st.booleans())
    def lookup(self, k: Any, prepared: bool) -> None:
        key = self.t.prepare(k) if prepared else k
        got = self.t.lookup(key)
        want = self.model.get(packed(k), [])
        assert sorted(packed(x) for x in got) == sorted(want)
        assert self.t.member(key) is bool(want)
        assert (self.t.get(key, "<none>") == "<none>") is (not want)

    @rule(k=st.sampled_from(KEYS))
    def delete(self, k: Any) -> None:
        assert self.t.delete(k) == len(self.model.pop(packed(k), []))
        self.words.pop(packed(k), None)

    @rule(k=st.sampled_from(KEYS), v=SMALL_VALUES)
    def delete_object(self, k: Any, v: Any) -> None:
        kb, vb = packed(k), packed(v)
        vals = self.model.get(kb, [])
        present = vb in vals
        assert self.t.delete_object(k, v) is present
        if present:
            vals.remove(vb)
            if not vals:
                del self.model[kb]
                self.words.pop(kb, None)

    @rule(k=st.sampled_from(KEYS))
    def add(self, k: Any) -> None:
        """Bags: a row distinct from every other (a fresh token), by receipt."""
        if self.kind != "bag":
            return
        self.tokens += 1
        v = ("token", self.tokens)
        if self.rows() >= self.capacity:
            with pytest.raises(TableFull):
                self.t.add(k, v)
            return
        receipt = self.t.add(k, v)
        kb = packed(k)
        self.model.setdefault(kb, []).append(packed(v))
        self.keys[kb] = k
        self.receipts.append((k, packed(v), receipt))

    @rule(i=st.integers(0, 7))
    def remove(self, i: int) -> None:
        """A receipt removes its own row while it is there, and nothing once it went (deleted
        by another rule, its record maybe reused since)."""
        if not self.receipts:
            return
        k, vb, receipt = self.receipts.pop(i % len(self.receipts))
        vals = self.model.get(packed(k), [])
        present = vb in vals
        assert self.t.remove(k, receipt) is present
        if present:
            vals.remove(vb)
            if not vals:
                del self.model[packed(k)]

    @rule(m=st.integers(2, 3), r=st.integers(0, 2))
    def delete_where(self, m: int, r: int) -> None:
        def pred(k: Any, v: Any) -> bool:
            return len(packed(k)) % m == r

        n = 0
        for kb in list(self.model):
            if len(kb) % m == r:
                n += len(self.model.pop(kb))
                self.words.pop(kb, None)
        assert self.t.delete_where(pred) == n

    @rule(k=st.sampled_from(KEYS[:3]))
    def watch_fresh(self, k: Any) -> None:
        w = self.t.watch(k)
        assert w.member() is (packed(k) in self.model)

    @invariant()
    def counts_and_scan(self) -> None:
        assert self.t.count() == self.rows()
        got = Counter((packed(k), packed(v)) for k, v in self.t.scan())
        want = Counter((kb, vb) for kb, vals in self.model.items() for vb in vals)
        assert got == want
        for k, w in self.watches:
            want_vals = sorted(self.model.get(packed(k), []))
            assert w.member() is bool(want_vals)
            assert sorted(packed(x) for x in w.values()) == want_vals

    @invariant()
    def words_match(self) -> None:
        if self.kind != "set":
            return
        for k in KEYS:
            kb = packed(k)
            assert self.t.word(k) == (self.words.get(kb, 0) if kb in self.model else None), k

    @invariant()
    def absent_only_where_the_model_has_no_row(self) -> None:
        """``absent`` (by the hash alone) is never True for a key with a row, and is True for
        a key without one whose home slot is empty."""
        for k in KEYS:
            pk = self.t.prepare(k)
            there = packed(k) in self.model
            if self.t.absent(pk.hash):
                assert not there, k
            elif not self.t._idx[pk.j]:
                assert there, k

    @invariant()
    def fsck_noop_and_stats(self) -> None:
        healthy(self.t)
        s = self.t.stats()
        assert s["rows"] == self.rows() == sum(s["probe_histogram"].values())
        assert s["max_probe"] == max(s["probe_histogram"], default=0)


@pytest.mark.parametrize("kind,capacity", [("set", 8), ("set", 20), ("bag", 8), ("bag", 20)])
def test_model(rig_factory, kind: str, capacity: int) -> None:
    rig = rig_factory([(kind, capacity, RECORD_SIZE)])

    class M(TableMachine):
        pass

    M.rig, M.kind, M.capacity = rig, kind, capacity
    run_state_machine_as_test(M, settings=settings(
        max_examples=40, stateful_step_count=60, deadline=None,
        suppress_health_check=list(HealthCheck)))


# ------------------------------------------------------------------------ targeted cases


def test_the_index_hash_is_siphash_2_4_keyed_by_the_segment_key(rig_factory) -> None:
    """SipHash-2-4 (its reference vector) of the packed key, under a 16-byte key derived from
    the table's hash key alone, pinned by known answers: every process attaching a segment must
    compute exactly these (a change to the hash or its key's derivation is a new layout,
    ``LAYOUT_VERSION``). Another hash key sends the same keys to other homes (a client who does
    not know the segment's random key cannot aim ids at one bucket)."""
    assert siphash(bytes(range(16)), bytes(range(15))) == 0xA129CA6149BE45E5
    assert table_key(HASH_KEY) == bytes.fromhex("12a071105404a9e43bfd89c36d8da301")
    assert table_key(b"k") == bytes.fromhex("9d680d17fde1aeda85a24b32329e97d4")
    rig = rig_factory([("set", 1024, 64)])
    t = rig.tables[0]
    assert t.prepare(("ip:1", "n:0")).hash == 0x1830AA3A52A30CAE
    keys = [("ip:1", f"n:{i}") for i in range(64)]
    for k in keys:
        assert t.prepare(k).hash == (siphash(table_key(HASH_KEY), packed(k)) or 1)
    other = Table("t0", rig.region(0), kind="set", capacity=1024, record_size=64,
                  hash_key=HASH_KEY[::-1], lock=rig.lock)
    try:
        moved = sum(t.prepare(k).home != other.prepare(k).home for k in keys)
    finally:
        other.close()
    assert moved >= 60  # 2048 slots: a key keeps its home by chance 1 time in 2048


@pytest.mark.parametrize("hash_key", [b"k", bytes(range(16)), bytes(range(64))])
def test_a_hash_key_of_any_allowed_length_keys_the_index(rig_factory, hash_key) -> None:
    """A table's hash key is 1..64 bytes; SipHash takes exactly 16, derived from it: rows
    written and found under each length, the table sound."""
    rig = rig_factory([("set", 64, 64)])
    rig.tables[0].close()
    t = rig.tables[0] = Table("t0", rig.region(0), kind="set", capacity=64, record_size=64,
                              hash_key=hash_key, lock=rig.lock)
    rig.lock.tables = rig.tables
    for i in range(40):
        t.insert(("s", str(i)), i)
    assert all(t.lookup(("s", str(i))) == [i] for i in range(40))
    assert t.lookup(("s", "40")) == []
    healthy(t)


@pytest.mark.parametrize("order", [(0, 1, 2, 3, 4), (2, 0, 4, 1, 3), (4, 3, 2, 1, 0)])
def test_colliding_keys_delete_by_backward_shift(rig_factory, order) -> None:
    rig = rig_factory([("set", 64, 64)])
    t = rig.tables[0]
    last = t.nslots - 1  # a chain that wraps around the end of the index
    keys = same_home_keys(t, 5, home=last)
    others = same_home_keys(t, 3, home=0)  # homes inside the wrapped chain
    for k in keys + others:
        t.insert(k, k.upper())
    assert t.stats()["max_probe"] >= 5
    alive = set(keys + others)
    for i in order:
        assert t.delete(keys[i]) == 1
        alive.discard(keys[i])
        for k in keys + others:
            assert t.lookup(k) == ([k.upper()] if k in alive else [])
        healthy(t)
    assert t.count() == len(others)


def test_set_full_table_can_still_update(rig_factory) -> None:
    rig = rig_factory([("set", 4, 64)])
    t = rig.tables[0]
    for i in range(4):
        t.insert(i, "v")
    with pytest.raises(TableFull):
        t.insert(9, "v")
    for n in range(10):
        t.insert(2, "w" * n)  # uses the spare record, frees the old one
    assert t.lookup(2) == ["w" * 9] and t.count() == 4
    healthy(t)


def test_row_too_large_writes_nothing(rig_factory) -> None:
    rig = rig_factory([("bag", 4, 64)])
    t = rig.tables[0]
    t.insert("a", 1)
    before, acq = rig.region(0).tobytes(), rig.lock.acquisitions
    for k, v in [("a", "x" * 40), ("b" * 40, 1), ("a", {"r": "y" * 40})]:
        with pytest.raises(RowTooLarge):
            t.insert(k, v)
        with pytest.raises(RowTooLarge):
            t.insert_new(k, v)
    assert rig.region(0).tobytes() == before and rig.lock.acquisitions == acq


def test_watch_sees_every_write(rig_factory) -> None:
    rig = rig_factory([("bag", 32, 64)])
    t = rig.tables[0]
    colliding = same_home_keys(t, 20)
    w = t.watch(colliding[-1])  # probe chain spans buckets once the chain is long
    assert w.member() is False and w.values() == ()
    for k in colliding[:-1]:
        t.insert(k, 0)
        assert w.member() is False
    t.insert(colliding[-1], 1)
    assert w.member() is True and w.values() == (1,)
    t.insert(colliding[-1], 2)
    assert sorted(w.values()) == [1, 2]
    for k in colliding[:-1]:
        t.delete(k)  # shifts the watched rows back across buckets
        assert sorted(w.values()) == [1, 2]
    assert t.delete_object(colliding[-1], 1)
    assert w.values() == (2,)
    t.delete(colliding[-1])
    assert w.member() is False and w.values() == ()


def _two_bucket_key(t: Table) -> tuple[str, str]:
    """(k, x): two keys homed in the last slot of one bucket, so that with ``x`` in the table
    and the next slot empty, a probe of ``k`` reads that bucket and the next."""
    by_home: dict[int, list[str]] = {}
    for i in range(100_000):
        k = f"key{i}"
        pk = t.prepare(k)
        if pk.j & 31 == 30:
            got = by_home.setdefault(pk.j, [])
            got.append(k)
            if len(got) == 2:
                return got[0], got[1]
    raise AssertionError("no two keys homed in a bucket's last slot")


@pytest.mark.parametrize("change", ["next bucket", "home bucket"])
def test_a_watch_whose_probe_spans_two_buckets_polls_without_its_lock(rig_factory,
                                                                      change: str) -> None:
    """A key homed in a bucket's last slot, that slot taken by another key: its probe reads two
    buckets. Its watch polls them both without taking its lock (it was the slow path on every
    poll: the lock and a loop, ~7x the one-bucket poll), and still sees a change in either: the
    key written into the next bucket, or into its home slot once freed there."""
    rig = rig_factory([("set", 64, 64)])
    t = rig.tables[0]
    k, x = _two_bucket_key(t)
    t.insert(x, 0)
    w = t.watch(k)
    assert w.member() is False
    assert len(w._seen) == 2  # the case under test: a probe over two buckets
    lk = w._lk
    assert lk.acquire(blocking=False)  # a poll that took the lock would replace it (timeout)
    try:
        for _ in range(3):
            assert w.member() is False
        assert w._lk is lk
    finally:
        lk.release()
    if change == "next bucket":
        t.insert(k, 1)  # lands in the next bucket: only its version moves
    else:
        t.delete(x)  # frees the home slot: only the home bucket's version moves
        assert w.member() is False
        t.insert(k, 1)
    assert w.member() is True
    t.delete(k)
    assert w.member() is False
    healthy(t)


def _stale_watch(rig_factory: Any) -> tuple[Table, Any]:
    """A table and a watch of ``k`` that read no row, ``k`` inserted since: its next poll
    refreshes."""
    t = rig_factory([("set", 8, 64)]).tables[0]
    w = t.watch("k")
    assert w.member() is False
    t.insert("k", 1)
    return t, w


def test_two_threads_refreshing_one_watch_never_interleave(rig_factory, monkeypatch) -> None:
    """A watch is shared by threads: while one thread's refresh is inside its read, another
    thread's refresh of the same watch waits for it (else it could leave its member flag beside
    the other's version). The first read is held until the second thread is seen waiting."""
    import threading
    import time

    from shmcancel.shm import reader

    t, w = _stale_watch(rig_factory)  # the version moved: both threads refresh
    monkeypatch.setattr(reader, "_REFRESH_WAIT", 10.0)
    events: list[str] = []
    entered, go = threading.Event(), threading.Event()
    real = type(t)._read

    def read(self: Any, pk: Any) -> Any:
        first = not entered.is_set()
        events.append("start A" if first else "start B")
        if first:
            entered.set()
            assert go.wait(10)
        out = real(self, pk)
        events.append("end A" if first else "end B")
        return out

    monkeypatch.setattr(type(t), "_read", read)
    a = threading.Thread(target=w.member)
    a.start()
    assert entered.wait(10)
    got: list[bool] = []
    b = threading.Thread(target=lambda: got.append(w.member()))
    b.start()
    try:
        deadline = time.monotonic() + 0.2  # B must not reach its read while A is in its own
        while time.monotonic() < deadline:
            assert "start B" not in events
            time.sleep(0.005)
    finally:
        go.set()
    a.join(10)
    b.join(10)
    assert not a.is_alive() and not b.is_alive()
    assert events[:2] == ["start A", "end A"] and got == [True]


def test_a_refresh_that_outwaits_a_slow_one_stores_nothing(rig_factory, monkeypatch) -> None:
    """A refresh stuck in its read (it fell back to the registry lock behind a writer stalled
    mid-write) holds the watch's lock past ``_REFRESH_WAIT``. Another thread's refresh then
    answers from a read of its own, right, and stores nothing: two refreshes storing at once
    could leave one's member flag beside the other's version (a cancellation seen as absent
    until the bucket moved again). It used to take a new lock and store beside the first."""
    import threading

    from shmcancel.shm import reader

    t, w = _stale_watch(rig_factory)
    monkeypatch.setattr(reader, "_REFRESH_WAIT", 0.05)
    inside, go = threading.Event(), threading.Event()
    real = type(t)._read

    def read(self: Any, pk: Any) -> Any:
        if threading.current_thread() is slow:
            inside.set()
            assert go.wait(10)
        return real(self, pk)

    monkeypatch.setattr(type(t), "_read", read)
    slow = threading.Thread(target=w.member)
    slow.start()
    try:
        assert inside.wait(10)
        before = (w._lk, w._raw, w._v, w._seen, w._member)
        assert w.member() is True and w.values() == (1,)
        assert (w._lk, w._raw, w._v, w._seen, w._member) == before  # the lock: by identity
    finally:
        go.set()
        slow.join(10)
    assert not slow.is_alive()
    assert w.member() is True and w._member is True
    t.delete("k")
    assert w.member() is False


def test_a_fork_child_takes_a_new_watch_lock_at_once(rig_factory, monkeypatch) -> None:
    """A thread of the parent holds a watch's lock when the process forks: in the child that
    thread does not exist, and the lock stays held. The child's first refresh takes a new lock
    at once (it waited ``_REFRESH_WAIT`` first, on every watch a fork caught so)."""
    from helpers.procs import child, reap, recv, wait_exit

    from shmcancel.shm import reader

    _, w = _stale_watch(rig_factory)
    monkeypatch.setattr(reader, "_REFRESH_WAIT", 30.0)
    assert w._lk.acquire()  # as a thread inside a refresh at the fork

    def body(out: int) -> None:
        os.write(out, b"%d" % (w.member() is True and w._member is True))

    pid, r = child(body)
    try:
        assert recv(r, 10) == b"1"
        assert wait_exit(pid, 10) == 0
        pid = -1
    finally:
        os.close(r)
        if pid > 0:
            reap(pid)
        w._lk.release()


def test_values_decoded_from_a_row_replaced_meanwhile_are_not_kept(rig_factory,
                                                                   monkeypatch) -> None:
    """A thread decoding a watch's values when another thread's refresh replaces them (a GIL
    switch inside the decode) stored the old values beside the new version: every later poll
    answered the old values until the bucket moved again. The switch is made to happen there
    (the second thread runs to the end inside the first one's decode)."""
    import threading

    from shmcancel.shm import reader

    rig = rig_factory([("set", 8, 64)])
    t = rig.tables[0]
    t.insert("k", "a")
    w = t.watch("k")
    assert w.member()
    real = reader._unpack
    seen: list[tuple[Any, ...]] = []
    switched: list[bool] = []

    def other() -> None:
        t.insert("k", "b")
        seen.append(w.values())

    def unpack(b: bytes) -> Any:
        if not switched:  # once: the other thread's own decode goes straight through
            switched.append(True)
            th = threading.Thread(target=other)
            th.start()
            th.join(10)
            assert not th.is_alive()
        return real(b)

    monkeypatch.setattr(reader, "_unpack", unpack)
    assert w.values() == ("a",)  # this thread's answer: the row as it was when it read it
    monkeypatch.setattr(reader, "_unpack", real)
    assert seen == [("b",)]
    assert w.values() == ("b",) and t.lookup("k") == ["b"]


def test_prepared_key_of_another_table_is_reprepared(rig_factory) -> None:
    rig = rig_factory([("set", 8, 64), ("set", 100, 64)])
    a, b = rig.tables
    b.insert("k", 1)
    pa = a.prepare("k")
    assert isinstance(pa, PreparedKey) and a.prepare(pa) is pa
    assert b.lookup(pa) == [1] and b.member(pa) and a.lookup(pa) == []


def test_keys_compare_by_packed_bytes(rig_factory) -> None:
    rig = rig_factory([("set", 8, 64)])
    t = rig.tables[0]
    for k in (1, 1.0, True, "1", b"1", (1,), [1]):
        t.insert(k, repr(k))
    assert t.count() == 6  # (1,) and [1] pack alike
    assert t.lookup((1,)) == ["[1]"] and t.lookup(True) == ["True"]
    assert dict(t.scan())[(1,)] == "[1]"  # arrays come back as tuples


def test_fsck_repairs_hand_made_damage(rig_factory) -> None:
    rig = rig_factory([("set", 16, 64)])
    t = rig.tables[0]
    for i in range(10):
        t.insert(i, i)
    idx, ver = t._idx, t._ver
    words = idx.tolist()
    used = [s for s in range(t.nslots) if words[2 * s]]
    free_slots = [s for s in range(t.nslots) if not words[2 * s]]
    # an entry pointing out of range, a duplicate entry, a hash that does not match its key,
    # an odd version, a wrong row count and a damaged free stack
    idx[2 * free_slots[0] + 1] = 999
    idx[2 * free_slots[0]] = 12345
    s1 = free_slots[1]
    idx[2 * s1 + 1] = words[2 * used[0] + 1]
    idx[2 * s1] = words[2 * used[0]]
    ver[1] += 1
    t._hq[3] = 77
    t._free[0] = 3
    rep = t.fsck()
    assert rep["bad_entries"] >= 1 and rep["odd_versions"] == 1 and rep["rows"] == 1
    assert rep["free_stack"] == 1
    healthy(t)
    assert sorted(k for k, _ in t.scan()) == list(range(10))
    for i in range(10, 16):  # the free stack works: every remaining record is usable
        t.insert(i, i)
    with pytest.raises(TableFull):
        t.insert(99, 0)
    healthy(t)


def test_fsck_set_keeps_newest_duplicate_key(rig_factory) -> None:
    rig = rig_factory([("set", 16, 64)])
    t = rig.tables[0]
    t.insert("k", "old")
    with rig.lock:  # a second row of the same key, as a bug or crash could leave
        r = t._write_record(t.prepare("k").kbytes, packed("new"))
        t._publish(t.prepare("k"), r)
        rig.lock.dirty = False  # the write completed (else the release repairs it at once)
    rep = t.fsck()
    assert rep["stale_rows"] == 1
    assert t.lookup("k") == ["new"] and t.count() == 1
    healthy(t)


def test_stats(rig_factory) -> None:
    rig = rig_factory([("bag", 100, 64)])
    t = rig.tables[0]
    for i in range(100):
        t.insert(i % 37, i)
    s = t.stats()
    assert s["rows"] == 100 == sum(s["probe_histogram"].values())
    assert s["capacity"] == 100 and s["nslots"] == 256 and s["load"] == 100 / 256
    assert s["max_probe"] == max(s["probe_histogram"])


def test_layout_sizes_and_header_check(rig_factory) -> None:
    assert Table.region_size(10_000, 1024) % 64 == 0
    rig = rig_factory([("set", 8, 64)])
    from shmcancel.exceptions import RegistryIncompatible
    with pytest.raises(RegistryIncompatible):
        Table("x", rig.region(0), kind="set", capacity=9, record_size=64,
              hash_key=HASH_KEY, lock=rig.lock)
    with pytest.raises(ValueError):
        Table.region_size(8, 30)


def test_reader_validates_records_and_falls_back_to_the_lock(rig_factory) -> None:
    """A referenced record failing its crc is never decoded: the reader reads under the lock,
    where it is corruption: fsck (run by the reader) drops it. An odd version (a writer killed
    mid-mutation) sends readers to the lock, which answers correctly."""
    rig = rig_factory([("set", 8, 64)])
    t = rig.tables[0]
    t.insert("a", "va")
    t.insert("b", "vb")
    pa = t.prepare("a")
    r = t._find(pa)[0][1]
    off = t._heap + r * t.record_size + Table.RECORD_HEADER + 2
    region = rig.region(0)
    region[off] ^= 0xFF  # a byte of the value: the crc no longer matches
    acq = rig.lock.acquisitions
    assert t.lookup(pa) == [] and t.get("b") == "vb"
    assert rig.lock.acquisitions == acq + 1  # the fallback took the lock once
    with rig.lock:  # already repaired by the reader
        assert t.fsck() == dict.fromkeys(t.fsck(), 0)
    healthy(t)
    assert t.lookup("a") == [] and t.count() == 1

    pb = t.prepare("b")
    t._ver[pb.b] += 1  # odd: as a killed writer leaves it
    w = t.watch(pb)
    acq = rig.lock.acquisitions
    assert t.lookup(pb) == ["vb"] and t.member(pb) and w.values() == ("vb",)
    assert rig.lock.acquisitions > acq
    with rig.lock:
        assert t.fsck()["odd_versions"] == 1
    assert w.values() == ("vb",)
    acq = rig.lock.acquisitions
    assert w.member() and t.lookup(pb) == ["vb"]
    assert rig.lock.acquisitions == acq  # healthy again: no lock


def test_record_with_torn_header_is_rejected(rig_factory) -> None:
    rig = rig_factory([("bag", 8, 64)])
    t = rig.tables[0]
    t.insert("k", "value")
    r = t._find(t.prepare("k"))[0][1]
    base = t._offset(r)
    region = rig.region(0)
    good = region[base:base + t.record_size].tobytes()
    for field_off in (4, 8, 16):  # klen, vlen, stamp: each is covered by the crc seed
        region[base + field_off] ^= 1
        assert t._record(r) is None
        region[base:base + t.record_size] = good
    assert t._record(r) is not None
    region[base + 4:base + 8] = (10_000).to_bytes(4, "little")  # klen beyond the record
    assert t._record(r) is None
    region[base:base + t.record_size] = good
    region[base:base + t.record_size] = bytes(t.record_size)  # all zero: invalid too
    assert t._record(r) is None


def test_every_read_path_takes_the_lock_on_an_odd_version(rig_factory) -> None:
    """An odd bucket version (a writer mid-mutation, or killed there) is never trusted: each
    lock-free path (probe, miss path with an empty or occupied home slot, watch, scan, stats)
    retries and then answers from under the lock."""
    rig = rig_factory([("set", 8, 64)])
    t = rig.tables[0]
    for i in range(5):
        t.insert(i, f"v{i}")
    homes = {t.prepare(i).home for i in range(5)}
    gap = next(k for k in (f"m{i}" for i in range(10_000)) if t.prepare(k).home not in homes)
    busy = next(k for k in (f"m{i}" for i in range(10_000)) if t.prepare(k).home in homes)
    w = t.watch(3)
    assert w.values() == ("v3",)
    t._ver[0] += 1  # the only bucket (16 slots): odd, as a killed writer leaves it
    reads = [
        ("lookup", lambda: t.lookup(3), ["v3"]),
        ("member", lambda: t.member(3), True),
        ("miss, empty home", lambda: t.member(gap), False),
        ("miss, empty home (lookup)", lambda: t.lookup(gap), []),
        ("miss, occupied home", lambda: t.member(busy), False),
        ("miss, occupied home (lookup)", lambda: t.lookup(busy), []),
        ("watch", lambda: t.watch(3).values(), ("v3",)),
        ("scan", lambda: sorted(t.scan()), [(i, f"v{i}") for i in range(5)]),
        ("stats", lambda: t.stats()["rows"], 5),
    ]
    for what, read, want in reads:
        acq = rig.lock.acquisitions
        assert read() == want, what
        assert rig.lock.acquisitions == acq + 1, f"{what}: answered without the lock"
    with rig.lock:
        assert t.fsck()["odd_versions"] == 1
    acq = rig.lock.acquisitions
    for what, read, want in reads:
        assert read() == want, what
    assert rig.lock.acquisitions == acq  # even again: every path is lock-free


def test_bag_rows_by_receipt(rig_factory) -> None:
    """add() returns a receipt; remove() takes exactly that row, and nothing once the row is
    gone, even when its record holds another row of the same key since (the stamp differs)."""
    rig = rig_factory([("bag", 16, 64)])
    t = rig.tables[0]
    a = t.add("k", ("a", 1))
    b = t.add("k", ("b", 2))
    assert sorted(t.lookup("k")) == [("a", 1), ("b", 2)]
    assert t.remove("k", a) is True
    assert t.lookup("k") == [("b", 2)]
    assert t.remove("k", a) is False  # gone already
    assert t.delete_object("k", ("b", 2))
    c = t.add("k", ("c", 3))  # reuses b's record (the free stack is LIFO), with a new stamp
    assert c[0] == b[0] and c[1] != b[1]
    assert t.remove("k", b) is False and t.lookup("k") == [("c", 3)]
    assert t.remove("other", c) is False  # another key's probe does not hold that record
    assert t.remove("k", c) is True and t.count() == 0
    healthy(t)


def test_add_is_for_bags(rig_factory) -> None:
    rig = rig_factory([("set", 16, 64)])
    with pytest.raises(TypeError):
        rig.tables[0].add("k", 1)
    assert rig.tables[0].count() == 0


def test_remove_falls_back_to_the_value_when_given(rig_factory) -> None:
    """With a value, a receipt that no longer names the row (or none at all) removes one row
    equal to the value instead, in the same lock hold; without one it removes nothing."""
    rig = rig_factory([("bag", 16, 64)])
    t = rig.tables[0]
    a = t.add("k", ("a", 1))
    t.delete_object("k", ("a", 1))
    t.insert("k", ("a", 1))  # the same row again, written by value: a's receipt is stale
    t.insert("k", ("b", 2))
    assert t.remove("k", a) is False and t.count() == 2
    assert t.remove("k", a, ("a", 1)) is True and t.lookup("k") == [("b", 2)]
    assert t.remove("k", None, ("b", 2)) is True and t.count() == 0
    assert t.remove("k", None, ("b", 2)) is False
    healthy(t)


def test_words_change_in_place_and_survive_updates_and_fsck(rig_factory) -> None:
    """A word is stored into the row's own record: no record is taken, no version moves, the
    crc still validates; a value update carries the word to the new record; fsck keeps it."""
    rig = rig_factory([("set", 16, 64)])
    t = rig.tables[0]
    assert t.insert_new("k", None, 7) is True and t.word("k") == 7
    assert t.insert_new("k", None, 9) is False and t.word("k") == 7
    t.insert("fresh", 1)
    assert t.word("fresh") == 0 and t.word("absent") is None
    free_top, versions = t._hq[_TOP], t._ver.tolist()
    assert t.set_word("k", 2**32 - 1) is True and t.word("k") == 2**32 - 1
    assert t._hq[_TOP] == free_top and t._ver.tolist() == versions  # in place, nothing moved
    assert t.lookup("k") == [None]  # the record still validates
    t.insert("k", "a new value")  # a fresh record: the word goes with the row
    assert t.word("k") == 2**32 - 1 and t.lookup("k") == ["a new value"]
    t._ver[t.prepare("k").b] += 1  # damage: an odd version, which fsck repairs
    with rig.lock:
        t.fsck()
    assert t.word("k") == 2**32 - 1
    assert t.set_word("absent", 1) is False and t.word("absent") is None
    with rig.lock:  # by reference: one probe, then loads and stores of that word alone
        ref = t.word_ref("k")
        assert t.word_ref("absent") == -1 and t.load_word(ref) == 2**32 - 1
        assert t.word_at("k") == (ref, 2**32 - 1) and t.word_at("absent") == (-1, 0)
        versions = t._ver.tolist()
        t.store_word(ref, 5)
        assert t._ver.tolist() == versions and t.load_word(ref) == 5
    assert t.word("k") == 5 and t.lookup("k") == ["a new value"]
    t.delete("k")
    assert t.word("k") is None and t.insert_new("k", None) and t.word("k") == 0
    healthy(t)


def _chain_of_three(rig_factory) -> tuple[Any, Any, list[Any]]:
    """A set of 64 slots holding three keys of home slot 14 (in slots 14, 15, 16: the chain
    crosses a bucket), with words 1, 2, 3."""
    rig = rig_factory([("set", 16, 64)])
    t = rig.tables[0]
    keys = same_home_keys(t, 3, home=14)
    for i, k in enumerate(keys):
        t.insert_new(k, None, i + 1)
    return rig, t, keys


def test_a_kept_word_ref_follows_the_row(rig_factory) -> None:
    """A prepared key's cached word reference is used only while its slot is unchanged: after
    the row is deleted, moved by a backward shift, given a fresh record by an update, or its
    bucket rewritten by fsck, the next word_ref probes again and finds the row where it is."""
    rig, t, (a, _, c) = _chain_of_three(rig_factory)
    pc = t.prepare(c)

    def word(pk: Any) -> int:
        with rig.lock:
            ref = t.word_ref(pk)
            return -1 if ref < 0 else t.load_word(ref)

    assert word(pc) == 3 and pc.wref is not None
    t.set_word(c, 30)  # in place: the kept ref stays right
    assert word(pc) == 30
    t.delete(a)  # c moves back from slot 16 to 15
    assert t.word(c) == 30 and word(pc) == 30
    t.insert(c, "updated")  # a fresh record, the word carried over
    assert word(pc) == 30
    with rig.lock:
        t.store_word(t.word_ref(pc), 31)
    assert t.word(c) == 31 and t.lookup(c) == ["updated"]
    t._ver[pc.b] += 1  # an odd version, as a killed writer leaves it: fsck makes it even
    with rig.lock:
        t.fsck()
    assert word(pc) == 31
    t.delete(c)
    assert word(pc) == -1
    t.insert_new(b"other", None, 5)
    t.insert_new(c, None, 6)
    assert word(pc) == 6 and t.word(b"other") == 5
    healthy(t)


def test_a_lock_free_word_read_keeps_its_place_and_follows_the_row(rig_factory) -> None:
    """``word`` through a prepared key: the probe that finds a set's row keeps the word's place
    (no lock taken), later reads load it there while its slot's bucket version holds, and a
    delete, a move by a backward shift, an update's fresh record or a record reused by another
    row sends the read back to a probe that finds the row where it is, or none."""
    rig, t, (a, _, c) = _chain_of_three(rig_factory)
    pc = t.prepare(c)

    def word(pk: Any) -> int | None:
        acq = rig.lock.acquisitions
        got = t.word(pk)
        assert rig.lock.acquisitions == acq, "a word read took the lock"
        return got

    assert word(pc) == 3 and pc.wref is not None
    kept = pc.wref
    t.set_word(c, 30)  # in place: no version moves, the kept place reads the new word
    assert word(pc) == 30 and pc.wref == kept
    t.delete(a)  # c moves back from slot 16 to 15
    assert word(pc) == 30 and pc.wref != kept
    t.insert(c, "updated")  # a fresh record, the word carried over
    assert word(pc) == 30
    t.set_word(c, 31)
    assert word(pc) == 31 and t.lookup(c) == ["updated"]
    t.delete(c)
    assert word(pc) is None
    t.insert_new(b"other", None, 5)  # may take c's old record: the old place reads 5 now
    assert word(pc) is None
    t.insert_new(c, None, 6)
    assert word(pc) == 6 and t.word(b"other") == 5
    healthy(t)


def test_a_bags_word_ref_is_found_each_time(rig_factory) -> None:
    """Only a set's key keeps its word reference; a bag's word_ref probes every time and
    finds the first row of the key's probe."""
    rig = rig_factory([("bag", 16, 64)])
    t = rig.tables[0]
    t.insert_new("k", "first", 1)
    t.insert("k", "second")
    pk = t.prepare("k")
    with rig.lock:
        ref = t.word_ref(pk)
        assert ref >= 0 and t.load_word(ref) == 1 and pk.wref is None
    healthy(t)


@pytest.mark.parametrize("word", [-1, 2**32, 1.0, True, "1", None])
def test_a_bad_word_is_refused_before_any_store(rig_factory, word: Any) -> None:
    rig = rig_factory([("set", 8, 64)])
    t = rig.tables[0]
    t.insert_new("k", None, 3)
    before, acq = rig.region(0).tobytes(), rig.lock.acquisitions
    with pytest.raises(ValueError, match="word"):
        t.insert_new("new", None, word)
    with pytest.raises(ValueError, match="word"):
        t.set_word("k", word)
    assert rig.region(0).tobytes() == before and rig.lock.acquisitions == acq
    with rig.lock, pytest.raises(ValueError, match="word"):
        t.store_word(t.word_ref("k"), word)
    assert rig.region(0).tobytes() == before


def test_store_word_blames_the_word_only_when_the_word_is_wrong(rig_factory) -> None:
    """store_word lets the u32 view refuse an out-of-range word; the view also refuses when it
    is released (a closed table), and that ValueError is not about the word: a valid word
    must not be reported as out of range (the store itself fails as every write of a closed
    table does, with the view's own message)."""
    rig = rig_factory([("set", 8, 64)])
    t = rig.tables[0]
    t.insert_new("k", None, 3)
    with rig.lock:
        ref = t.word_ref("k")
    t.close()
    with pytest.raises(ValueError) as exc:
        t.store_word(ref, 5)
    assert "released" in str(exc.value) and "got 5" not in str(exc.value)
    with pytest.raises(ValueError, match="word"):
        t.store_word(ref, 2**32)  # an out-of-range word is still named as such
