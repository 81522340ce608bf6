"""Registry: the segment + lock + four tables, sized from worst-case rows; header counters; the
janitor claim; recovery repairing the tables."""

from __future__ import annotations

import dataclasses
import os
import select
import signal
import sys
from collections.abc import Callable

import msgpack
import pytest
from helpers import procs
from helpers.names import leftovers
from helpers.opcodes import at_bytecode
from helpers.procs import child, reap, recv, stuck_mid_write
from helpers.table_rig import healthy, python_writes

import shmcancel
from shmcancel.cancel import tables as ct
from shmcancel.cancel.ids import MAX_KEY_BYTES
from shmcancel.config import Config
from shmcancel.exceptions import (
    InvalidRegistryName,
    RegistryIncompatible,
    RegistryNotFound,
    RowTooLarge,
    ShmCancelError,
)
from shmcancel.mcp import session_tables as st
from shmcancel.shm import procinfo, registry, schema
from shmcancel.shm.names import lock_path, segment_path, sem_path
from shmcancel.shm.registry import Registry, record_sizes
from shmcancel.shm.segment import OFF_EVICTIONS, OFF_SWEEPS

pytestmark = pytest.mark.timeout(30)

SMALL = Config(max_rows=100, capacity=200, in_flight_capacity=64, session_capacity=32,
               lock_timeout=5)


def test_roundtrip(shm_name: str) -> None:
    reg = Registry.create(shm_name, SMALL)
    try:
        assert registry.current() is reg
        assert reg.name == shm_name and reg.config == SMALL
        assert reg.creator == procinfo.me()
        assert len(reg.hash_key) == 16
        assert reg.last_sweep == reg.created_at
        reg.table("cancellations").insert(("global", "1"), ("why", 1.5))
        reg.table("in_flight").insert(("global", "1"), (1, 2, 3, 4))
        reg.table("sessions").insert("s1", {"v": 1})
        reg.table("scope_counts").insert(b"\x01" * 16, 1)
        with Registry.attach(shm_name) as other:
            assert registry.current() is other
            assert other.config == SMALL
            assert other.hash_key == reg.hash_key and other.created_at == reg.created_at
            assert other.table("cancellations").get(("global", "1")) == ("why", 1.5)
            assert other.table("in_flight").lookup(("global", "1")) == [(1, 2, 3, 4)]
            assert other.table("sessions").get("s1") == {"v": 1}
            assert other.table("scope_counts").get(b"\x01" * 16) == 1
            # cancellations holds max_rows rows (the cap evicts first), scope_counts a
            # quarter more (counts left at 0)
            assert other.table("cancellations").capacity == 100
            assert other.table("scope_counts").capacity == 125
            assert {t.capacity for t in other.tables.values()} == {100, 125, 64, 32}
        assert other.closed and registry.current() is reg  # the one still open
        other.close()  # idempotent
    finally:
        reg.close()
        reg.close()
        reg.unlink()
        reg.unlink()  # idempotent
    assert leftovers(shm_name) == []
    with pytest.raises(RegistryNotFound, match=f"no registry named {shm_name}"):
        Registry.attach(shm_name)


def test_close_unmaps(shm_name: str) -> None:
    reg = Registry.create(shm_name, SMALL)
    seg = reg._seg
    reg.close()
    assert seg.closed and reg.closed
    reg.unlink()


def test_invalid_names_and_config() -> None:
    for bad in ("", "a/b", "x" * 65, "ü"):
        with pytest.raises(InvalidRegistryName):
            Registry.create(bad)
        with pytest.raises(InvalidRegistryName):
            Registry.attach(bad)
    with pytest.raises(TypeError):
        Registry.create("fine", {"capacity": 5})  # type: ignore[arg-type]


def test_exports() -> None:
    assert shmcancel.Registry is Registry


def test_worst_case_rows_fit(shm_name: str) -> None:
    def size(x: object) -> int:
        return len(msgpack.packb(x, use_bin_type=True))

    scope = "é" * 256  # 512 UTF-8 bytes
    rid = "r" * MAX_KEY_BYTES  # the longest key text of an id (a long int's bound)
    reason = "é" * 400  # 800 UTF-8 bytes
    key = (scope, rid)
    cases = {
        "cancellations": (key, (reason, 1e300), ct.KEY_REQUEST, ct.VAL_CANCEL),
        "in_flight": (key, (2**22 - 1, 2**42 - 1, 2**64 - 1, -(2**63)),
                      ct.KEY_REQUEST, ct.VAL_OWNER),
        "sessions": ("s" * 128, (b"x" * 508,), st.KEY_SESSION, st.SESSION_VALUE_MAX),
        "scope_counts": (b"\xff" * 16, None, ct.KEY_SCOPE_COUNT, ct.VAL_SCOPE_COUNT),
        # sessions_per_client (32 by default) minted ids
        "session_clients": (b"\xff" * 16, ("s" * st.MINTED_ID_LEN,) * 32,
                            st.KEY_CLIENT, st.val_session_clients(SMALL)),
        "session_calls": ("s" * 128, (2**22 - 1, 2**42 - 1, 2**64 - 1, -(2**63)),
                          st.KEY_SESSION, st.VAL_CALL),
    }
    assert cases.keys() == {d.name for d in ct.TABLES + st.TABLES}
    sizes = record_sizes()
    assert sizes == {"cancellations": 1680, "in_flight": 904, "sessions": 672,
                     "scope_counts": 48, "session_clients": 1136, "session_calls": 192}
    assert SMALL.sessions_per_client == 32
    assert record_sizes(Config(session_capacity=8))["session_clients"] == 320  # 24+18+3+8x34
    with Registry.create(shm_name, SMALL) as reg:
        for name, (k, v, kmax, vmax) in cases.items():
            assert size(k) == kmax, name  # the arithmetic is the worst case, exactly
            assert size(v) <= vmax, name
            assert size(k) + size(v) + 24 <= sizes[name]
            t = reg.tables[name]
            assert t.record_size == sizes[name]
            t.insert(k, v)
            assert t.lookup(k) == [v]
        assert size((b"x" * 508,)) == st.SESSION_VALUE_MAX
        with pytest.raises(RowTooLarge):
            reg.table("cancellations").insert(("s" * 2000, "1"), (None, 1.0))
        reg.unlink()


def _creator(name: str) -> Callable[[int], None]:
    """A child's body: create registry ``name``, say b"c", then wait to be killed."""
    def creator(w: int) -> None:
        Registry.create(name, SMALL)
        os.write(w, b"c")
        select.select([], [], [], 60)
    return creator


def test_create_over_live_and_dead_creator(shm_name: str) -> None:
    pid, r = child(_creator(shm_name))
    try:
        assert recv(r) == b"c"
        with pytest.raises(RegistryIncompatible, match=f"in use by live pid {pid}"):
            Registry.create(shm_name, SMALL)
        old = Registry.attach(shm_name)
    finally:
        reap(pid)
        os.close(r)
    try:
        new = Registry.create(shm_name, Config(max_rows=300, capacity=300, lock_timeout=5))
        assert new.config.capacity == 300 and new.creator == procinfo.me()
        old.unlink()  # the stale registry's unlink must not remove its replacement
        assert os.path.exists(segment_path(shm_name)) and os.path.exists(sem_path(shm_name))
        assert os.path.exists(lock_path(shm_name))
        with Registry.attach(shm_name) as again:
            assert again.config.capacity == 300
        new.close()
        new.unlink()
        assert leftovers(shm_name) == []
    finally:
        old.close()


def rival_create(name: str) -> str:
    """What another process's ``Registry.create(name)`` says: its RegistryIncompatible's
    message, or ``"replaced"`` when it replaced the registry."""

    def rival(w: int) -> None:
        try:
            Registry.create(name, SMALL)
            os.write(w, b"replaced")
        except RegistryIncompatible as e:
            os.write(w, str(e).encode())

    rpid, rr = child(rival)
    try:
        return recv(rr).decode()
    finally:
        reap(rpid)
        os.close(rr)


def test_adopt_keeps_a_live_registry_from_being_replaced(shm_name: str) -> None:
    # The USR2 case: the creator hands the registry to a successor and exits.
    pid, r = child(_creator(shm_name))
    try:
        assert recv(r) == b"c"
        successor = Registry.attach(shm_name)
        assert successor.creator[0] == pid
        successor.adopt()
        assert successor.creator == procinfo.me()
    finally:
        reap(pid)
        os.close(r)
    try:
        successor.table("cancellations").insert(("global", "1"), (None, 1.0))
        assert rival_create(shm_name).startswith(
            f"registry {shm_name} is in use by live pid {os.getpid()}, its creator")
        assert successor.table("cancellations").get(("global", "1")) == (None, 1.0)
        with Registry.attach(shm_name, readonly=True) as ro, pytest.raises(
                ShmCancelError, match="read-only"):
            ro.adopt()
    finally:
        successor.close()
        successor.unlink()


def test_adoptions_that_died_never_forget_the_live_owner(shm_name: str) -> None:
    """Two USR2 upgrades in a row that adopt and die (failed boots, rollbacks), the old master
    serving throughout: the registry still belongs to it. A third upgrade may join it, and no
    other process may replace it as stale (the second adoption used to keep the first, dead
    successor beside it, and the old master was forgotten)."""
    owner = Registry.create(shm_name, SMALL)
    try:
        for _ in range(2):
            def successor() -> None:
                with Registry.attach(shm_name) as reg:
                    reg.adopt()
            assert procs.wait_exit(procs.fork(successor), 10) == 0
        with Registry.attach(shm_name, readonly=True) as ro:
            assert ro.belongs_to(*procinfo.me())
            assert ro.creator == procinfo.me()  # the effective owner: the live one
        assert rival_create(shm_name).startswith(
            f"registry {shm_name} is in use by live pid {os.getpid()}, its creator")
    finally:
        owner.close()
        owner.unlink()


def test_incompatible_table_layout(shm_name: str) -> None:
    import struct

    Registry.create(shm_name, SMALL).close()
    with open(segment_path(shm_name), "r+b") as f:  # table 1 ("in_flight") claims to be a set
        f.seek(520 + 64 + 56)  # descriptor 1's kind byte
        f.write(struct.pack("<B", 1))
    with pytest.raises(RegistryIncompatible, match="table in_flight"):
        Registry.attach(shm_name)


@pytest.mark.parametrize("readonly", [False, True])
def test_a_garbled_record_size_is_refused_as_incompatible(shm_name: str, readonly: bool) -> None:
    """contract §2: a segment whose table descriptor names a record size no table can have (not
    a multiple of 8: a garbled header) is ``RegistryIncompatible``, not a ``ValueError`` from
    the table geometry (shmtool printed that one's traceback)."""
    import struct

    Registry.create(shm_name, SMALL).close()
    with open(segment_path(shm_name), "r+b") as f:
        f.seek(520 + 52)  # descriptor 0's record size (u32)
        (size,) = struct.unpack("<I", f.read(4))
        f.seek(520 + 52)
        f.write(struct.pack("<I", size + 3))
    with pytest.raises(RegistryIncompatible, match="table cancellations"):
        Registry.attach(shm_name, readonly=readonly)


def test_readonly(shm_name: str) -> None:
    with Registry.create(shm_name, SMALL) as reg:
        reg.table("cancellations").insert(("global", "7"), (None, 2.0))
        gen = reg.lock.generation
        with Registry.attach(shm_name, readonly=True) as ro:
            assert ro.readonly
            assert ro.table("cancellations").get(("global", "7")) == (None, 2.0)
            assert ro.table("cancellations").scan() == [(("global", "7"), (None, 2.0))]
            with pytest.raises(ShmCancelError, match="read-only"), ro.lock:
                pass
            with pytest.raises((ShmCancelError, TypeError)):
                ro.table("cancellations").insert(("global", "8"), (None, 1.0))
            assert not ro.claim_sweep(reg.created_at + 1e6, 1.0)
            info = ro.info()
            # read from the semaphore's file (a read-only attach opens no semaphore)
            assert info["semaphore_value"] == 1 and info["lock_generation"] == gen
        assert reg.lock.generation == gen and reg.table("cancellations").count() == 1
        reg.unlink()


def test_a_readonly_scan_of_a_torn_index_lists_each_key_once_with_its_latest_write(
        shm_name: str) -> None:
    """A read-only attachment has no lock to fall back to when the index keeps moving (writers
    at work, or one that died mid-write leaving a version odd): it reads the index as it is,
    then the records. A slot copied before an overwrite still names the key's old record
    (intact until reused): ``shmtool dump`` listed the key twice, with two ``cancelled_at``
    (6 runs in 150 beside two busy writers). Staged here for certain: a version left odd and
    such a stale entry. Each key comes once, its latest write; a stale entry whose record
    another key took since (its hash not the slot's) is not that key's row either."""
    with Registry.create(shm_name, SMALL) as reg:
        t = reg.table("cancellations")
        a, b = ("global", "7"), ("global", "8")
        t.insert(a, ("old", 1.0))
        with reg.lock:
            (_, r_old, *_), = t._find(t.prepare(a))
        t.insert(a, ("new", 2.0))  # a new record; the old one freed, intact
        h = t.prepare(a).hash
        free = [s for s in range(t.nslots) if not t._idx[2 * s]]
        t._idx[2 * free[0] + 1] = r_old  # the stale entry a torn copy sees: (A's hash, old)
        t._idx[2 * free[0]] = h
        t._ver[0] += 1  # a writer died mid-write: no consistent copy, no lock to wait for
        try:
            with Registry.attach(shm_name, readonly=True) as ro:
                assert ro.table("cancellations").scan() == [(a, ("new", 2.0))]
            t.insert(b, ("b", 3.0))  # takes the freed record: the stale entry names B's now
            with reg.lock:
                (_, r_b, *_), = t._find(t.prepare(b))
            assert r_b == r_old
            with Registry.attach(shm_name, readonly=True) as ro:
                assert sorted(ro.table("cancellations").scan()) == [
                    (a, ("new", 2.0)), (b, ("b", 3.0))]
        finally:
            t._ver[0] += 1
            t._idx[2 * free[0]] = 0
            t._idx[2 * free[0] + 1] = 0
        reg.unlink()


def test_counters_and_info(shm_name: str) -> None:
    with Registry.create(shm_name, SMALL) as reg:
        assert reg.evictions == 0 and reg.recoveries == 0
        reg.add_evictions(3)
        with reg.lock:
            reg.add_evictions(2)  # reentrant
        assert reg.evictions == 5
        info = reg.info()
        assert info["name"] == shm_name and info["evictions"] == 5
        assert info["creator_pid"] == os.getpid() and info["creator_alive"]
        assert info["config"] == dataclasses.asdict(SMALL)
        assert info["semaphore_value"] == 1 and info["lock_owner_pid"] is None
        assert [t["name"] for t in info["tables"]] == [d.name for d in schema.declared()]
        assert info["total_size"] == os.stat(segment_path(shm_name)).st_size
        reg.unlink()


def test_claim_sweep(shm_name: str) -> None:
    with Registry.create(shm_name, SMALL) as reg:
        t0, iv = reg.created_at, 60.0
        assert not reg.claim_sweep(t0, iv)
        assert not reg.claim_sweep(t0 + iv - 0.001, iv)  # first sweep: one interval after creation
        assert reg.claim_sweep(t0 + iv, iv)
        assert not reg.claim_sweep(t0 + iv, iv)
        assert not reg.claim_sweep(t0 + 2 * iv - 1, iv)
        assert reg.claim_sweep(t0 + 2 * iv + 5, iv)
        assert reg.last_sweep == t0 + 2 * iv + 5
        assert reg.info()["sweeps"] == 2 and reg.info()["last_sweeper_pid"] == os.getpid()
        reg.unlink()


def test_garbage_over_the_sweep_and_eviction_counters_wraps_them(shm_name: str) -> None:
    """All ones over the sweep and eviction counters (garbage): a sweep is still claimed and
    evictions still counted, each counter wrapping (a ValueError of the store before)."""
    with Registry.create(shm_name, SMALL) as reg:
        reg._seg.set_u64(OFF_SWEEPS, 2**64 - 1)
        reg._seg.set_u64(OFF_EVICTIONS, 2**64 - 1)
        assert reg.claim_sweep(reg.created_at + 60.0, 60.0)
        reg.add_evictions(2)
        assert (reg.info()["sweeps"], reg.evictions) == (0, 1)
        reg.unlink()


def test_claim_sweep_one_winner_across_processes(shm_name: str) -> None:
    with Registry.create(shm_name, SMALL) as reg:
        now = reg.created_at + 61.0

        def contender(w: int) -> None:
            os.write(w, b"1" if reg.claim_sweep(now, 60.0) else b"0")

        kids = [child(contender) for _ in range(6)]
        try:
            results = [recv(r) for _, r in kids]
        finally:
            for pid, r in kids:
                reap(pid)
                os.close(r)
        assert sorted(results) == [b"0"] * 5 + [b"1"]
        reg.unlink()


def test_dead_writer_recovered_and_tables_repaired(shm_name: str) -> None:
    """A writer SIGKILLed mid-mutation (lock held, a bucket version left odd): the next writer
    recovers the lock, fsck restores the table, committed rows survive."""
    reg = Registry.create(shm_name, SMALL)
    events: list[dict] = []
    shmcancel.telemetry.attach("t-reg", ("shmcancel", "lock", "recovered"),
                               lambda e, m, md, c: events.append(dict(md)))

    for i in range(20):
        reg.table("cancellations").insert(("global", str(i)), (None, float(i)))
    pid, r = child(stuck_mid_write(reg))
    try:
        assert recv(r) == b"mid"
        os.kill(pid, signal.SIGKILL)
        reg.table("cancellations").insert(("global", "new"), ("after", 99.0))
        assert events == [{"dead_pid": pid}]
        assert reg.recoveries == 1
        assert all(v % 2 == 0 for v in reg.table("cancellations")._ver)
        assert reg.table("cancellations").count() == 21
        assert reg.table("cancellations").get(("global", "7")) == (None, 7.0)
        assert all(all(v == 0 for v in rep.values()) for rep in reg.fsck().values())
    finally:
        shmcancel.telemetry.detach("t-reg")
        reap(pid)
        os.close(r)
        reg.close()
        reg.unlink()


class _Interrupt(Exception):
    pass


@pytest.mark.parametrize("op", ["insert", "delete"])
def test_a_registry_write_interrupted_mid_mutation_is_repaired_before_the_lock_goes(
        shm_name: str, op: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tables mark a mutation in progress on the registry lock's own ``dirty`` (through
    ``lock.flags``): an exception raised at any bytecode between a write's first and last
    store is repaired (fsck) before the lock is released, so the next reader finds the row
    wholly there or wholly gone and a clean table. The Python path's bytecodes
    (python_writes)."""
    python_writes(monkeypatch)
    reg = Registry.create(shm_name, Config(max_rows=100, in_flight_capacity=64))
    try:
        t = reg.table(ct.CANCELLATIONS)
        lock = reg.lock

        def run(k: int) -> int:
            """The write, raising at the k-th opcode run while dirty (0: count them)."""

            def interrupt() -> None:
                raise _Interrupt

            key = ("ip:x", "7")
            if op == "delete":
                t.insert(key, ("r", 1.0))
            seen = at_bytecode(lock, k, interrupt)
            try:
                if op == "insert":
                    t.insert(key, ("r", 1.0))
                else:
                    t.delete(key)
            finally:
                sys.settrace(None)
            return seen[0]

        n = run(0)
        assert n > 5, "the write never set the lock's dirty: a crash in it would go unrepaired"
        t.delete(("ip:x", "7"))
        for k in sorted({1, 2, n // 2, n - 1, n}):
            with pytest.raises(_Interrupt):
                run(k)
            assert not lock.held_by_me() and lock.owner() is None  # released
            healthy(t)
            assert t.get(("ip:x", "7")) in (None, ("r", 1.0))  # wholly there or wholly gone
            t.delete(("ip:x", "7"))
            healthy(t)
    finally:
        reg.close()
        reg.unlink()


NOBODY = 65534


@pytest.mark.parametrize("umask", [0o277, 0o477])
def test_a_umask_taking_the_owners_own_bits_still_makes_a_usable_registry(
        shm_name: str, umask: int) -> None:
    """Every name is mode 0600 whatever the umask (names.py): ``umask 277`` typed for 027 (or
    one taking the owner's read bit) must not leave a semaphore or lock file its owner cannot
    open again. It did: create opened the new semaphore O_RDWR to fchmod it (EACCES on the
    0400 file), then the lock file (created 0400), and refused the registry as a squatter's.
    Root ignores file modes: run as root, the child becomes uid 65534 first."""
    def body() -> None:
        if os.geteuid() == 0:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
        os.umask(umask)
        reg = Registry.create(shm_name, SMALL)
        try:
            other = Registry.attach(shm_name)  # a worker's attach: semaphore and lock file
            with other.lock:
                pass
            other.close()
        finally:
            reg.close()
        for path in (segment_path(shm_name), sem_path(shm_name), lock_path(shm_name)):
            assert os.stat(path).st_mode & 0o777 == 0o600, path

    pid = procs.fork(body)
    status = procs.wait_exit(pid, 20)
    assert status is not None, "the child hung"
    assert os.waitstatus_to_exitcode(status) == 0
