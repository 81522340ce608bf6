"""Writers killed (SIGKILL) or interrupted (a signal handler raising SystemExit) at random moments
leave tables that the next lock holder recovers: acknowledged ops present, the op in flight
applied or absent, nothing torn, a second fsck clean. The harness is tools/crash_loop.py.

Random kills rarely land between two particular stores, so two tests aim: one SIGKILLs a
writer at every bytecode of its mutation (chosen by an opcode tracer in the child; the kill
itself is a real SIGKILL of a real process), one kills writers of 256 KiB rows often enough that
kills land inside the record memcpy."""

from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
from helpers.gunicorn_harness import REPO_ROOT
from helpers.opcodes import at_bytecode
from helpers.procs import wait_exit
from helpers.table_rig import (
    Rig,
    fills_to_capacity,
    healthy,
    killed_holding,
    python_writes,
    same_home_keys,
)
from helpers.tools import load_tool

from shmcancel.shm.table import LargeRowsFull, Table

crash_loop = load_tool("crash_loop")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


# Runs tools/crash_loop.py's rounds and prints them as JSON (argv: tools dir, name, rounds,
# mode, seed); an AssertionError of a round leaves the interpreter with its message.
_APART = """
import dataclasses, json, sys
sys.path.insert(0, sys.argv[1])
import crash_loop
res = crash_loop.run(sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5]))
print(json.dumps([dataclasses.asdict(r) for r in res]))
"""


def run_apart(name: str, rounds: int, mode: str, seed: int) -> list[Any]:
    """:func:`crash_loop.run` in a fresh interpreter, so that its writers fork from a small
    process. Forked from pytest's late in a full run (340 MB resident), a writer spent its
    life in copy-on-write faults (per writer: 5 200 minor faults and 19 ms of system time,
    against 700 and 2 ms from a fresh interpreter), so the parent's kills landed at faults,
    outside the mutations the loop is there to interrupt: none inside one in 1 150 rounds."""
    proc = subprocess.run([sys.executable, "-c", _APART, str(REPO_ROOT / "tools"), name,
                           str(rounds), mode, str(seed)],
                          capture_output=True, text=True, timeout=100)
    if proc.returncode:  # keep the seed: the run is replayable
        raise AssertionError(f"seed {seed}: {proc.stderr[-3000:]}")
    return [crash_loop.RoundResult(**r) for r in json.loads(proc.stdout)]


@pytest.mark.parametrize("mode,rounds", [("kill", 250), ("exit", 150)])
def test_interrupted_writers_always_recover(shm_name, mode: str, rounds: int) -> None:
    seed = random.randrange(1 << 30)
    res = run_apart(shm_name, rounds, mode, seed)
    assert len(res) == rounds
    assert all(r.recovery < 1.0 for r in res)
    interrupted = [r for r in res if r.outcome != "done"]
    assert len(interrupted) >= rounds // 2, "the writers were rarely interrupted mid-run"
    if mode == "kill":
        held = [r for r in res if r.held]
        assert held, "no writer died holding the lock: the recovery path was not exercised"
        assert max(r.recovery for r in held) < 1.0
        # Coverage: only 1-3 % of random kills land between two stores of a mutation, so go on
        # in batches until one has (the kill-at-every-bytecode tests below cover it exactly).
        extra, deadline = 0, time.monotonic() + 60
        while not any(r.midwrite for r in res) and time.monotonic() < deadline:
            extra += 1
            res += run_apart(shm_name, 50, mode, seed + extra)
        assert any(r.midwrite for r in res), (
            f"seed {seed}: no kill landed inside a mutation in {len(res)} rounds")


# ------------------------------------------------------------------ kill at every bytecode

def rows(t: Table) -> list[tuple[bytes, bytes, int | None]]:
    """Every row, with its key's word (bag rows keep word 0)."""
    return sorted((msgpack.packb(k), msgpack.packb(v), t.word(k)) for k, v in t.scan())


def kill_at_bytecode(lock: Any, k: int, every: bool = False) -> list[int]:
    """SIGKILL this process at the k-th opcode of a table write (:func:`at_bytecode`)."""
    return at_bytecode(lock, k, lambda: os.kill(os.getpid(), signal.SIGKILL), every)


def _a_stale_record_of_k(t: Table) -> None:
    # Record 0 keeps a freed but intact row of "k" (what an empty slot's record number names);
    # the new row goes to record 1. A slot given its hash before its record number would, if
    # the writer died in between, resurrect the deleted row.
    t.insert("k", "old")
    t.insert("z", "z")
    t.delete_object("k", "old")
    t.delete("z")


def _bag_insert_over_a_stale_record(t: Table) -> Callable[[], object]:
    _a_stale_record_of_k(t)
    return lambda: t.insert("k", "new")


def _bag_add_over_a_stale_record(t: Table) -> Callable[[], object]:
    _a_stale_record_of_k(t)  # add() (no read of the key's rows first) publishes as insert does
    return lambda: t.add("k", "new")


def _bag_remove_by_receipt_shifting_across_buckets(t: Table) -> Callable[[], object]:
    keys = same_home_keys(t, 4, home=14)  # slots 14..17: the shift crosses into bucket 1
    receipts = [t.add(k, i) for i, k in enumerate(keys)]
    return lambda: t.remove(keys[0], receipts[0])


def _set_update(t: Table) -> Callable[[], object]:
    keys = same_home_keys(t, 3, home=15)
    for k in keys:
        t.insert(k, 1)
    return lambda: t.insert(keys[1], "x" * 20)


def _set_delete_shifting_across_buckets(t: Table) -> Callable[[], object]:
    keys = same_home_keys(t, 5, home=14)  # slots 14..18: the shift crosses into bucket 1
    for k in keys:
        t.insert(k, k)
    return lambda: t.delete(keys[0])


def _set_insert_into_a_chain(t: Table) -> Callable[[], object]:
    keys = same_home_keys(t, 4, home=15)
    for k in keys[:3]:
        t.insert(k, k)
    return lambda: t.insert(keys[3], "new")


# Scenarios on a table of two size classes (16 rows, small records of 64 bytes, 3 large rows):
# rows moving between the classes, a large update with the large class full (the spare), a
# large delete, a large bag insert.
CLASSED = (16, 256, 64, 3)
BIG = "y" * 100  # a value only a large record holds


def _set_classes_small_to_large(t: Table) -> Callable[[], object]:
    keys = same_home_keys(t, 3, home=15)
    for k in keys:
        t.insert(k, 1)
    return lambda: t.insert(keys[1], BIG)


def _set_classes_large_to_small(t: Table) -> Callable[[], object]:
    keys = same_home_keys(t, 3, home=15)
    for k in keys:
        t.insert(k, BIG)
    return lambda: t.insert(keys[1], 2)


def _set_classes_large_update_on_the_spare(t: Table) -> Callable[[], object]:
    keys = same_home_keys(t, 3, home=15)
    for k in keys:  # the large class is full: the update takes its spare
        t.insert(k, BIG)
    return lambda: t.insert(keys[2], BIG + "z")


def _set_classes_delete_large(t: Table) -> Callable[[], object]:
    keys = same_home_keys(t, 3, home=15)  # slots 15..17: the shift crosses into bucket 1
    for k in keys:
        t.insert(k, BIG + k)
    return lambda: t.delete(keys[0])


def _bag_classes_insert_large(t: Table) -> Callable[[], object]:
    t.insert("k", BIG)
    t.insert("k", 1)
    return lambda: t.insert("k", BIG + "new")


# A row's word is stored in place (one u32 store outside the crc, no dirty flag): these trace
# every opcode run under the lock, not only those between a dirty flag's set and clear.
def _set_word_in_a_chain(t: Table) -> Callable[[], object]:
    keys = same_home_keys(t, 3, home=15)
    for i, k in enumerate(keys):
        t.insert_new(k, None, i + 1)
    return lambda: t.set_word(keys[1], 0xFFFF_FFFF)


def _store_word_by_ref_in_a_chain(t: Table) -> Callable[[], object]:
    keys = same_home_keys(t, 3, home=15)
    for i, k in enumerate(keys):
        t.insert_new(k, None, i + 1)

    def op() -> None:
        with t._lock:  # one probe for the ref, then its load and its store, in one hold
            ref = t.word_ref(keys[1])
            t.store_word(ref, t.load_word(ref) + 0xFFFF_0000)
    return op


def _set_update_keeps_the_word(t: Table) -> Callable[[], object]:
    keys = same_home_keys(t, 2, home=15)
    for k in keys:
        t.insert_new(k, 1, 5)
    return lambda: t.insert(keys[1], "x" * 20)


def _set_insert_new_with_a_word(t: Table) -> Callable[[], object]:
    keys = same_home_keys(t, 3, home=15)
    for k in keys[:2]:
        t.insert_new(k, None, 1)
    return lambda: t.insert_new(keys[2], None, 9)


WORD_SCENARIOS = {"set_word_in_a_chain", "store_word_by_ref_in_a_chain",
                  "set_update_keeps_the_word", "set_insert_new_with_a_word"}

KILL_SCENARIOS = {f.__name__[1:]: f for f in (
    _set_word_in_a_chain, _store_word_by_ref_in_a_chain, _set_update_keeps_the_word,
    _set_insert_new_with_a_word,
    _bag_insert_over_a_stale_record, _bag_add_over_a_stale_record,
    _bag_remove_by_receipt_shifting_across_buckets, _set_update,
    _set_delete_shifting_across_buckets, _set_insert_into_a_chain, _set_classes_small_to_large,
    _set_classes_large_to_small,
    _set_classes_large_update_on_the_spare, _set_classes_delete_large,
    _bag_classes_insert_large)}


@pytest.mark.parametrize("scenario", sorted(KILL_SCENARIOS))
def test_writer_killed_at_every_bytecode_of_a_mutation(shm_name, scenario: str,
                                                      monkeypatch) -> None:
    """For every bytecode k between a mutation's first and last store: fork, SIGKILL the
    child at bytecode k, repair (fsck), and require exactly the state before or after the
    op, a clean second fsck, and every record still usable. Catches a wrong store order
    (hash before record number, record written after publishing) and fsck steps skipped.
    The Python path's bytecodes (python_writes; test_cwrite.py kills a writer after each
    store of the C paths)."""
    python_writes(monkeypatch)
    kind = "bag" if scenario.startswith("bag") else "set"
    classed = "classes" in scenario
    rig = Rig(shm_name, [(kind, *CLASSED) if classed else (kind, 16, 64)])
    try:
        t = rig.reset(0)
        op = KILL_SCENARIOS[scenario](t)
        before = rows(t)
        every = scenario in WORD_SCENARIOS
        seen = kill_at_bytecode(rig.lock, 0, every)
        try:
            op()
        finally:
            sys.settrace(None)
        after, n = rows(t), seen[0]
        assert n >= 20 and before != after, (n, before, after)
        for k in range(1, n + 1):
            t = rig.reset(0)
            op = KILL_SCENARIOS[scenario](t)

            def killed_at(k: int = k, op: Callable[[], object] = op) -> None:
                kill_at_bytecode(rig.lock, k, every)
                op()

            killed_holding(rig, killed_at)
            with rig.lock:
                t.fsck()
                got = rows(t)
                assert got in (before, after), f"killed at bytecode {k}/{n}: {got}"
                healthy(t)
                if classed:  # no large record leaked: the class holds exactly L large rows
                    held = sum(1 for _, v in t.scan() if str(v).startswith(BIG))
                    n = 0
                    with pytest.raises(LargeRowsFull):
                        for n in range(t.large_count + 1):
                            t.insert(("big", n), BIG)
                    assert n == t.large_count - held
                fills_to_capacity(t)  # no record leaked
                if kind == "set":
                    t.insert(("fill", 0), "updated")  # a full set updates with the spare record
                healthy(t)
    finally:
        sys.settrace(None)
        rig.close()


def _kill_child_at(rig: Rig, body: Callable[[int], Any], moment: Callable[[], Any],
                   what: str) -> None:
    """Fork a child that runs ``body(w)`` (writing a byte to ``w`` once it is under way), wait
    for that byte (``what`` names it), then ``moment()``, and SIGKILL the child by pid."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            os.close(r)
            rig.lock.after_fork_child()
            body(w)
        finally:
            os._exit(1)
    os.close(w)
    try:
        assert select.select([r], [], [], 10)[0], what
        moment()
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(r)


# ------------------------------------------------------------------ kill inside the memcpy

BIG_RS = 256 * 1024
BIG_ROUNDS = 300  # a set update that wrote its row in place loses it in ~5 % of the kills


def _big(n: int) -> bytes:
    return bytes([n % 251]) * n


def test_killed_set_updates_of_large_rows_never_lose_the_row(shm_name) -> None:
    """A child rewrites one key of a set with 256 KiB values; the parent SIGKILLs it at a
    random moment, repairs, and requires the key's row to be one complete value. The kill lands
    inside the record memcpy in a few % of the rounds: harmless when the update writes a fresh
    record and swaps, fatal (the row fails its crc and fsck drops it) when it overwrites the
    referenced record in place."""
    rig = Rig(shm_name, [("set", 2, BIG_RS)])
    t = rig.tables[0]
    sizes = (BIG_RS - 100, BIG_RS // 2)
    t.insert("k", _big(sizes[0]))
    rng = random.Random()
    lost = []

    def writer(w: int) -> None:
        vals = [_big(sizes[0] - i) for i in range(3)] + [_big(sizes[1])]
        i = 0
        while True:
            t.insert("k", vals[i % 4])
            i += 1
            if i == 1:
                os.write(w, b".")

    try:
        for rnd in range(BIG_ROUNDS):
            _kill_child_at(rig, writer,
                           lambda: select.select([], [], [], rng.uniform(0, 0.003)),  # any moment
                           "the writer did not start")
            if rig.lock.sem.value == 0:  # died holding the lock: take its unit over
                rig.lock.sem.release()
            with rig.lock:
                t.fsck()
                got = t.lookup("k")
                if len(got) != 1 or got[0] != _big(len(got[0])):
                    lost.append(rnd)
                    t.insert("k", _big(sizes[0]))
                healthy(t)
        assert not lost, f"row lost or torn after {len(lost)} of {BIG_ROUNDS} kills"
    finally:
        rig.close()


# ------------------------------------------------------------------ kill inside a bulk rewrite

REWRITE_CAPACITY = 100_000  # a 4 MiB index: its store takes ~0.1 ms, a kill lands inside often
REWRITE_KILLS_INSIDE = 8  # rounds go on until this many kills landed inside the store


def test_a_bulk_rewrite_killed_inside_its_index_store_loses_no_row(shm_name) -> None:
    """A child stores a bulk rewrite (``shm/rewrite.py``) deleting one row; the parent SIGKILLs
    it at a random moment, repairs, and requires every other row present and the dropped one
    present or gone. The rows are a cluster of keys homed in the index's last slots that wraps
    around to its first ones, the dropped one first: the rewrite moves the others. A kill
    inside one copy of the whole index (glibc's memcpy stores in no fixed order; here it
    stores the first and last vectors last) left some of them in neither their old slot nor
    their new one: lost. A rewrite stores only the buckets it touches, so a row homed in every
    bucket is dropped too: the store is one copy of the whole index again."""
    rig = Rig(shm_name, [("set", REWRITE_CAPACITY, 64)])
    t = rig.tables[0]
    n = t.nslots
    cluster: list[str] = []  # 40 keys homed in the last 16 slots: they wrap to slots 0..23
    fillers: dict[int, str] = {}  # bucket -> a key homed there
    i = 0
    while len(cluster) < 40 or len(fillers) < t._nbuckets - 1:  # the last: the cluster
        k = f"w{i}"
        i += 1
        pk = t.prepare(k)
        if pk.home >= n - 16 and len(cluster) < 40:
            cluster.append(k)
        elif pk.home < n - 16 and pk.home % 16 < 8:
            fillers.setdefault(pk.b, k)
    for k in cluster + list(fillers.values()):
        t.insert(k, k)
    image = bytes(rig.region(0))
    dropped = {t.prepare(k).hash for k in [cluster[0], *fillers.values()]}
    rng = random.Random()
    inside, lost, rnd = 0, [], 0
    deadline = time.monotonic() + 60

    def store(w: int) -> None:
        copy = t.copy_index()
        assert copy is not None
        plan = copy.without(lambda h, r: h in dropped)
        assert plan is not None and plan.parts[0][1] >= t._nbuckets - 1
        with rig.lock:
            os.write(w, b".")
            plan.store()
        time.sleep(10)

    def moment() -> None:  # a random moment (no sleep's granularity)
        end = time.perf_counter() + rng.uniform(0, 0.0003)
        while time.perf_counter() < end:
            pass

    try:
        while inside < REWRITE_KILLS_INSIDE and time.monotonic() < deadline:
            rnd += 1
            t.close()
            rig.region(0)[:] = image
            t = rig.tables[0] = rig.open(0)
            _kill_child_at(rig, store, moment, "the child did not start its store")
            if rig.lock.sem.value == 0:  # died holding the lock, inside the store: take over
                inside += 1
                rig.lock.sem.release()
            with rig.lock:
                t.fsck()
                missing = [k for k in cluster[1:] if t.lookup(k) != [k]]
                if missing:
                    lost.append((rnd, len(missing)))
                    continue
                assert t.count() == len(cluster) - 1 + sum(
                    t.member(k) for k in [cluster[0], *fillers.values()])
                healthy(t)
        assert inside, f"no kill of {rnd} landed inside the rewrite's store"
        assert not lost, f"rows lost after {len(lost)} of {inside} kills inside the store: {lost}"
    finally:
        rig.close()


def test_a_bulk_rewrite_killed_between_two_of_its_moves_loses_no_row(shm_name) -> None:
    """An entry the rewrite moves twice (into the first empty slot, then back where an entry
    moved out from: the pass starts after that empty slot and reaches it last) must be in some
    slot between the two moves. The moves stored the index's final words at each destination,
    so the first move of such an entry stored an empty slot and cleared the entry's: a writer
    SIGKILLed between the two lost the row (fsck finds it in no slot). The writer is killed at
    every bytecode of the store in turn."""
    rig = Rig(shm_name, [("set", 64, 64)])
    t = rig.tables[0]
    n = t.nslots

    def homed(home: int, count: int, skip: int) -> list[str]:
        out, i = [], skip
        while len(out) < count:
            k = f"m{i}"
            i += 1
            if t.prepare(k).home == home:
                out.append(k)
        return out

    p, q, r, x = homed(n - 4, 4, 0)  # slots n-4 .. n-1
    z, y = homed(n - 1, 2, 0)  # wrap to slots 0 and 1
    dropped = {t.prepare(q).hash, t.prepare(z).hash}
    kept = [p, r, x, y]
    k, completed = 0, False
    try:
        while not completed:
            k += 1
            assert k < 5000, "the store never ran to its end"  # a few hundred bytecodes
            t = rig.reset(0)
            for key in (p, q, r, x, z, y):
                t.insert(key, key)
            pid = os.fork()
            if pid == 0:  # pragma: no cover - child
                try:
                    rig.lock.after_fork_child()
                    copy = t.copy_index()
                    assert copy is not None
                    plan = copy.without(lambda h, r: h in dropped)
                    assert plan is not None
                    with rig.lock:
                        kill_at_bytecode(rig.lock, k)
                        plan.store()
                        sys.settrace(None)
                    os._exit(0)
                finally:
                    os._exit(1)
            status = wait_exit(pid, 30)
            assert status is not None, "the child neither finished nor was killed"
            if os.WIFEXITED(status):
                assert os.WEXITSTATUS(status) == 0
                completed = True
            else:
                assert os.WTERMSIG(status) == signal.SIGKILL
                rig.lock.sem.release()  # died holding the lock: take over
            with rig.lock:
                t.fsck()
                missing = [key for key in kept if t.lookup(key) != [key]]
                assert not missing, f"killed at bytecode {k} of the store: lost {missing}"
                assert t.count() == len(kept) + t.member(q) + t.member(z)
                healthy(t)
        assert k > 20, "the store was not interrupted"
    finally:
        rig.close()
