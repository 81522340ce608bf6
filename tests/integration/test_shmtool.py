"""contract §7: shmtool run as a subprocess against real registries."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import posix_ipc
import pytest
from helpers.background import lock_held
from helpers.procs import child, first_message, fork, reap, recv, stuck_mid_write, wait_exit
from helpers.procs import shmtool_cli as shmtool
from helpers.rows import in_flight_count
from helpers.stalled_lock import stalled_lock

from shmcancel import Config
from shmcancel.cancel.tables import SMALL_CANCELLATION
from shmcancel.cancellation import Cancellation
from shmcancel.exceptions import ShmCancelError
from shmcancel.shm.layout import _ROWS
from shmcancel.shm.registry import Registry
from shmcancel.shm.segment import OFF_LOCK_GENERATION

SMALL = Config(capacity=200, max_rows=100, max_rows_per_scope=50, in_flight_capacity=32,
               session_capacity=8)


@pytest.fixture
def reg(shm_name):
    r = Registry.create(shm_name, SMALL)
    try:
        yield r
    finally:
        r.close()
        r.unlink()


def _killed_after(fn: Callable[[], object]) -> int:
    """Run ``fn`` in a forked child, then SIGKILL the child once ``fn`` has returned; its pid."""
    def body(w: int) -> None:
        fn()
        os.write(w, b"x")
        time.sleep(60)

    pid, msg = first_message(body)
    assert msg == b"x"
    return pid


def _dead_row(reg: Registry, rid: str, scope: str) -> int:
    """A child tracks (scope, rid) and is SIGKILLed before untracking; its pid."""
    return _killed_after(lambda: Cancellation(Registry.attach(reg.name)).track(rid, scope))


def test_dump_json_matches_the_rows(reg):
    c = Cancellation(reg)
    c.cancel(42, "user pressed stop", "session:abc")
    c.cancel("x" * 256, None, "ip:2001:db8:1:2::/64")
    c.cancel(7, "é\u202eevil", "principal:alice")
    h = c.begin(5, "session:abc")
    dead_pid = _dead_row(reg, "6", "ip:192.0.2.1")
    expected = sorted(
        ({"scope": k[0], "request_id": k[1], "reason": v[0], "cancelled_at": v[1]}
         for k, v in reg.table("cancellations").scan()), key=lambda d: d["request_id"])
    p = shmtool("dump", reg.name, "--json")
    assert p.returncode == 0, p.stderr
    assert p.stderr == ""
    d = json.loads(p.stdout)
    assert sorted(d["cancellations"], key=lambda d: d["request_id"]) == expected
    assert {r["request_id"]: r["reason"] for r in d["cancellations"]} == {
        "42": "user pressed stop", "x" * 256: None, "7": "éevil"}
    flights = {(r["scope"], r["request_id"]): r for r in d["in_flight"]}
    assert set(flights) == {("session:abc", "5"), ("ip:192.0.2.1", "6")}
    assert flights[("session:abc", "5")]["pid"] == os.getpid()
    assert flights[("session:abc", "5")]["alive"] is True
    assert flights[("ip:192.0.2.1", "6")]["pid"] == dead_pid
    assert flights[("ip:192.0.2.1", "6")]["alive"] is False
    h.end()


def test_dump_human_form(reg):
    c = Cancellation(reg, clock=lambda: time.time() - 3.2)
    c.cancel(1, "because", "session:abc")
    c.track(2, "session:abc")
    p = shmtool("dump", reg.name)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    header = next(line for line in lines if line.startswith("SCOPE") and "REASON" in line)
    row = next(line for line in lines if "because" in line)
    assert row.index("because") == header.index("REASON")  # aligned columns
    assert "s ago" in row
    assert any(line.startswith("session:abc") and str(os.getpid()) in line and "alive" in line
               for line in lines)


def test_dump_never_locks_and_never_writes(reg):
    c = Cancellation(reg)
    c.cancel(1, "r", "s")
    c.track(2, "s")
    path = f"/dev/shm/shmcancel.{reg.name}"
    with lock_held(reg):
        with open(path, "rb") as f:
            before = f.read()
        started = time.monotonic()
        # each command, run while the lock is held, still reports the rows (not only exit 0)
        for args, says in (
            (("dump", reg.name, "--json"),
             lambda out: json.loads(out)["cancellations"][0]["reason"] == "r"),
            (("stats", reg.name, "--json"), lambda out: json.loads(out)["rows"]["in_flight"] == 1),
            (("dump", reg.name), lambda out: "1 cancellations, 1 in flight" in out),
            (("list",), lambda out: reg.name in out),
        ):
            p = shmtool(*args, timeout=20)
            assert p.returncode == 0, p.stderr
            assert says(p.stdout), (args, p.stdout)
        assert time.monotonic() - started < 15  # never waited out a lock timeout
        with open(path, "rb") as f:
            assert f.read() == before


def test_stats_json(reg):
    c = Cancellation(reg)
    for i in range(5):
        c.cancel(i, None, "ip:big")
    for i in range(2):
        c.cancel(i, "why" * 100 if i else None, "session:small")  # one row in a large record
    c.track(1, "ip:big")
    h = c.begin(9, "ip:big")  # a handle's row: in this process's lane
    p = shmtool("stats", reg.name, "--json")
    assert p.returncode == 0, p.stderr
    s = json.loads(p.stdout)
    assert (s["sweeps"], s["last_sweep"]) == (0, None)  # not the creation's stamp
    assert [(x["table"], x["pid"], x["alive"], x["rows"]) for x in s["lanes"]] \
        == [("in_flight", os.getpid(), True, 1)]
    d = json.loads(shmtool("dump", reg.name, "--json").stdout)
    assert sorted(r["request_id"] for r in d["in_flight"]) == ["1", "9"]
    text = shmtool("stats", reg.name).stdout
    assert f"lanes claimed (rows written without the lock): in_flight pid {os.getpid()}: 1" in text
    h.end()
    assert s["capacity"] == 200 and s["max_rows"] == 100 and s["max_rows_per_scope"] == 50
    assert s["rows"]["cancellations"] == 7 and s["rows"]["in_flight"] == 1
    assert s["top_scopes"][:2] == [{"scope": "ip:big", "rows": 5},
                                   {"scope": "session:small", "rows": 2}]
    assert sum(s["tables"]["cancellations"]["probe_histogram"].values()) == 7
    t = s["tables"]["cancellations"]
    assert (t["small_size"], t["record_size"], t["large_rows"]) == (SMALL_CANCELLATION, 1680, 1)
    assert 0 < t["large_count"] <= t["capacity"] == 100
    assert s["lock"]["owner_pid"] is None
    assert s["evictions"] == 0 and s["recoveries"] == 0
    assert s["creator_pid"] == os.getpid() and s["creator_alive"] is True
    st = os.stat(f"/dev/shm/shmcancel.{reg.name}")  # one large row: its pages were allocated
    assert s["size"] == st.st_size and s["allocated"] == st.st_blocks * 512 < st.st_size
    assert f"({s['allocated'] / 2**20:.1f} MiB allocated)" in text


def test_stats_shows_the_semaphore_taken_by_a_process_that_did_not_record_itself(reg):
    """A process stopped between its ``sem_wait`` and recording itself (or one that takes the
    semaphore raw) holds the lock with no owner word: every writer waits for it. ``stats``,
    which attaches read-only without the semaphore, said ``lock: free`` and
    ``semaphore_value: null``; it reads the value from the semaphore's file now."""
    def take(w: int) -> None:
        sem = posix_ipc.Semaphore(f"/shmcancel.{reg.name}")
        sem.acquire()
        os.write(w, b"x")
        time.sleep(60)

    _, msg = first_message(take)  # killed once it holds the unit: it never records itself
    assert msg == b"x"
    s = json.loads(shmtool("stats", reg.name, "--json").stdout)
    assert (s["lock"]["owner_pid"], s["lock"]["semaphore_value"]) == (None, 0), s["lock"]
    text = shmtool("stats", reg.name).stdout
    assert "lock: taken by a process that has not recorded itself (semaphore 0)" in text
    with reg.lock:  # the next writer recovers the dead holder's unit
        pass
    s = json.loads(shmtool("stats", reg.name, "--json").stdout)
    assert s["lock"]["semaphore_value"] == 1
    assert "lock: free" in shmtool("stats", reg.name).stdout


def test_stats_says_a_lock_holder_is_stopped(reg, spawn):
    """A holder stopped by SIGSTOP is alive, and every write waits ``lock_timeout`` behind it:
    ``stats`` says it is stopped and how to resume it, as a writer's ``LockTimeout`` does."""
    with stalled_lock(spawn, reg.name) as holder:
        s = json.loads(shmtool("stats", reg.name, "--json").stdout)["lock"]
        assert (s["owner_pid"], s["owner_alive"], s["owner_stopped"]) == (holder.pid, True, True)
        text = shmtool("stats", reg.name).stdout
        assert f"held by pid {holder.pid} (alive) but STOPPED" in text
        assert f"kill -CONT {holder.pid}" in text
    s = json.loads(shmtool("stats", reg.name, "--json").stdout)["lock"]
    assert (s["owner_pid"], s["owner_stopped"]) == (None, False)


def test_stats_counts_evictions(shm_name):
    reg = Registry.create(shm_name, Config(capacity=100, max_rows=20, max_rows_per_scope=None,
                                           in_flight_capacity=8, session_capacity=4))
    try:
        c = Cancellation(reg)
        for i in range(21):
            c.cancel(i, None, "s")
        s = json.loads(shmtool("stats", shm_name, "--json").stdout)
        assert s["evictions"] == 1 and s["rows"]["cancellations"] == 20
        human = shmtool("stats", shm_name)
        assert human.returncode == 0
        assert "evictions 1" in human.stdout and "TABLE" in human.stdout
        assert "probe lengths" in human.stdout
    finally:
        reg.close()
        reg.unlink()


def test_list_shows_the_registry(reg):
    p = shmtool("list", "--json")
    assert p.returncode == 0, p.stderr
    regs = {r["name"]: r for r in json.loads(p.stdout)["registries"]}
    mine = regs[reg.name]
    assert mine["creator_pid"] == os.getpid() and mine["creator_alive"] is True
    st = os.stat(f"/dev/shm/shmcancel.{reg.name}")
    assert (mine["size"], mine["allocated"]) == (st.st_size, st.st_blocks * 512)
    assert 0 < mine["allocated"] < mine["size"]  # the large records' pages come on demand
    assert not any(n.startswith(("lock.", "-lock")) for n in regs)
    human = shmtool("list")
    line = next(line for line in human.stdout.splitlines() if line.startswith(reg.name))
    assert str(os.getpid()) in line and "alive" in line


def test_list_excludes_lock_files(reg):
    Cancellation(reg).cancel(1, None, "s")  # takes the lock: the lock file exists
    assert os.path.exists(f"/dev/shm/shmcancel-lock.{reg.name}")
    names = [r["name"] for r in json.loads(shmtool("list", "--json").stdout)["registries"]]
    assert names.count(reg.name) == 1
    assert not any("lock" in n and reg.name in n for n in names)


def test_cleanup_prints_counts(reg):
    old = Cancellation(reg, clock=lambda: time.time() - 1000)
    for i in range(3):
        old.cancel(i, None, "s")
    Cancellation(reg).cancel(9, None, "s")
    _dead_row(reg, "4", "s")
    p = shmtool("cleanup", reg.name)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "removed 3 cancellation rows, 1 in-flight rows"
    assert reg.table("cancellations").count() == 1 and in_flight_count(reg) == 0
    p = shmtool("cleanup", reg.name, "--ttl", "0")
    assert p.stdout.strip() == "removed 1 cancellation rows, 0 in-flight rows"


def _damage_region_header(reg: Registry, table: str = "cancellations") -> None:
    """Garbage over ``table``'s region header, written through the segment's file."""
    off = next(t["offset"] for t in reg.info()["tables"] if t["name"] == table)
    fd = os.open(reg.info()["path"], os.O_RDWR)
    try:
        os.pwrite(fd, b"\xff" * 64, off)
    finally:
        os.close(fd)


def test_fsck_rebuilds_a_damaged_region_header(reg):
    """Garbage over a table's region header (written through the segment's file): a new
    attachment (``cleanup`` here) fails in one line naming the damage and ``shmtool fsck``;
    ``fsck`` rebuilds the header under the lock and says so; new attachments work again, rows
    intact."""
    Cancellation(reg).cancel("r1", None, "s")
    _damage_region_header(reg)
    p = shmtool("cleanup", reg.name)
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert "table 'cancellations': region header damaged (magic" in p.stderr
    assert f"run `shmtool fsck {reg.name}`" in p.stderr
    p = shmtool("fsck", reg.name)
    assert p.returncode == 0, p.stderr
    assert "table cancellations: repaired (" in p.stdout and "region_header 1" in p.stdout
    p = shmtool("fsck", reg.name)
    assert (p.returncode, p.stdout.strip()) == (0, f"registry {reg.name}: clean, nothing to "
                                                   "repair")
    p = shmtool("cleanup", reg.name)
    assert p.returncode == 0, p.stderr
    r2 = Registry.attach(reg.name)
    try:
        assert Cancellation(r2).cancelled("r1", "s")
    finally:
        r2.close()


def test_fsck_reports_what_the_recovery_of_a_killed_fsck_repaired(reg):
    """An fsck killed while it holds the lock, before it repaired a damaged region header:
    the next ``fsck`` takes the lock over from the dead holder, whose recovery runs the repair;
    it reports that repair (it said "clean, nothing to repair" before, its own fsck finding
    nothing left), and says the recovery did it."""
    Cancellation(reg).cancel("r1", None, "s")
    _damage_region_header(reg)

    def killed_holding() -> None:
        r = Registry.attach(reg.name, repair=True)
        r.lock.__enter__()
        os.kill(os.getpid(), signal.SIGKILL)

    pid = fork(killed_holding)
    try:
        assert os.waitstatus_to_exitcode(wait_exit(pid, 10)) == -signal.SIGKILL
    finally:
        reap(pid)
    p = shmtool("fsck", reg.name)
    assert p.returncode == 0, p.stderr
    line = next(x for x in p.stdout.splitlines() if x.startswith("table cancellations:"))
    assert "region_header 1" in line and "by the lock's recovery from a dead holder" in line
    assert "clean" not in p.stdout
    p = shmtool("fsck", reg.name)
    assert (p.returncode, p.stdout.strip()) == (0, f"registry {reg.name}: clean, nothing to "
                                                   "repair")
    assert json.loads(shmtool("dump", reg.name, "--json").stdout)["cancellations"][0][
        "request_id"] == "r1"


def test_garbage_over_the_lock_generation_word_fails_no_write_nor_command(reg):
    """All ones over the lock's generation word (segment header offset 264): cancel and clear
    still work, and ``fsck`` and ``cleanup`` exit 0 without a traceback (each locked write
    raised a raw ValueError before, and ``fsck`` died with one)."""
    def garble() -> None:
        fd = os.open(reg.info()["path"], os.O_RDWR)
        try:
            os.pwrite(fd, b"\xff" * 8, OFF_LOCK_GENERATION)
        finally:
            os.close(fd)

    garble()
    c = Cancellation(reg)
    c.cancel("r1", None, "s")
    assert c.cancelled("r1", "s")
    c.clear("r1", "s")
    assert not c.cancelled("r1", "s")
    for args, out in ((("fsck", reg.name), f"registry {reg.name}: clean, nothing to repair"),
                      (("cleanup", reg.name), "removed 0 cancellation rows, 0 in-flight rows")):
        garble()
        p = shmtool(*args)
        assert (p.returncode, p.stdout.strip(), p.stderr) == (0, out, ""), args


def test_dump_stats_and_cleanup_report_unreadable_entries(reg):
    """A row whose record is corrupted (a byte of its key flipped): ``dump`` lists its entry
    and ``stats`` counts it (exit 0, the other rows shown); ``cleanup`` drops it and says so;
    afterwards neither reports any."""
    c = Cancellation(reg)
    for i in range(3):
        c.cancel(f"r{i}", "why", "s")
    t = reg.table("cancellations")
    slot, rec = next((s, r) for s, r, _, _, _ in t._entries(t._idx.tolist()))
    t._buf[t._offset(rec) + t.RECORD_HEADER] ^= 0xFF
    p = shmtool("dump", reg.name, "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["unreadable"] == [{"table": "cancellations", "slot": slot, "record": rec}]
    assert len(d["cancellations"]) == 2
    p = shmtool("dump", reg.name)
    assert p.returncode == 0
    assert "2 cancellations, 0 in flight, 0 sessions, 1 UNREADABLE" in p.stdout
    assert any(line.split() == ["cancellations", str(slot), str(rec)]
               for line in p.stdout.splitlines())
    p = shmtool("stats", reg.name, "--json")
    assert p.returncode == 0, p.stderr
    s = json.loads(p.stdout)
    assert s["unreadable"]["cancellations"] == 1 and s["tables"]["cancellations"]["unreadable"] == 1
    assert sum(s["unreadable"].values()) == 1
    p = shmtool("stats", reg.name)
    assert p.returncode == 0 and "UNREADABLE entries" in p.stdout and "cancellations 1" in p.stdout
    p = shmtool("cleanup", reg.name)
    assert p.returncode == 0, p.stderr
    assert "table cancellations: dropped 1 unreadable entries" in p.stdout
    assert json.loads(shmtool("dump", reg.name, "--json").stdout)["unreadable"] == []
    s = json.loads(shmtool("stats", reg.name, "--json").stdout)
    assert s["unreadable"]["cancellations"] == 0 and s["rows"]["cancellations"] == 2
    assert "UNREADABLE" not in shmtool("stats", reg.name).stdout


def test_cleanup_prints_what_the_check_on_its_attach_repaired(reg):
    """Corrupted records and a row counter that does not add up: ``cleanup``'s attach checks
    the counters and repairs the table before its own check, which then finds nothing; it
    still prints what was repaired (only the removed rows before)."""
    c = Cancellation(reg)
    for i in range(5):
        c.cancel(f"r{i}", "why", "s")
    t = reg.table("cancellations")
    for _, rec, _, _, _ in t._entries(t._idx.tolist())[:2]:
        t._buf[t._offset(rec) + t.RECORD_HEADER] ^= 0xFF
    t._hq[_ROWS] = 4
    p = shmtool("cleanup", reg.name)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert len(lines) == 2 and lines[0] == "removed 0 cancellation rows, 0 in-flight rows", lines
    # which entries move up their probe chains once the two are dropped depends on where the
    # registry's random hash key put them: "moved N" may be among the repairs
    head, _, repairs = lines[1].partition(", repaired (")
    assert head == "table cancellations: dropped 2 unreadable entries", lines
    done = dict(kv.split(" ") for kv in repairs.removesuffix(")").split(", "))
    assert done.pop("free_stack") == "1" and done.pop("rows") == "1", lines
    assert set(done) <= {"moved"}, lines
    assert t.count() == 3


def _stale(name: str) -> int:
    """Registry ``name`` created by a child that is then SIGKILLed (a killed master); its pid."""
    return _killed_after(lambda: Registry.create(name, SMALL))


def _entries(name: str) -> list[str]:
    return sorted(f for f in os.listdir("/dev/shm") if f.endswith(name) or name + "~" in f)


def test_unlink(shm_name):
    _stale(shm_name)
    p = shmtool("unlink", shm_name)
    assert p.returncode == 0, p.stderr
    assert _entries(shm_name) == []
    p = shmtool("dump", shm_name)
    assert p.returncode == 1


def test_unlink_refuses_while_the_creator_lives(reg):
    """contract §7: unlinking under a live server makes its next worker fail to boot."""
    p = shmtool("unlink", reg.name)
    assert p.returncode == 1
    assert p.stderr.count("\n") == 1 and f"pid {os.getpid()}" in p.stderr, p.stderr
    assert "--force" in p.stderr
    Registry.attach(reg.name).close()  # still there: a new worker could attach
    p = shmtool("unlink", reg.name, "--force")
    assert p.returncode == 0, p.stderr
    assert _entries(reg.name) == []


def test_unlink_names_the_live_creator_while_the_creation_lock_is_held(reg):
    """contract §7: the refusal names the live process also while the registry's lock file is
    flock-ed (a lock recovery or a creation under way): it used to wait for that lock and then
    exit 1 with a message about the lock file, naming no process."""
    import fcntl

    fd = os.open(f"/dev/shm/shmcancel-lock.{reg.name}", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        p = shmtool("unlink", reg.name)
    finally:
        os.close(fd)
    assert p.returncode == 1, p
    assert p.stderr.count("\n") == 1 and f"pid {os.getpid()}" in p.stderr, p.stderr
    Registry.attach(reg.name).close()  # still there


def _create_then_unlink(chan, name: str) -> None:
    """A server's master: creates registry ``name``, and when told, unlinks it as ``on_exit``
    does."""
    reg = Registry.create(name, SMALL)
    chan.send("created")
    assert chan.recv() == "unlink"
    reg.close()
    reg.unlink()
    chan.send("unlinked")
    assert chan.recv() == "exit"


def _try_create(chan, name: str) -> None:
    """Another server's master starting with the same name (waiting 0.5 s for the creation
    lock); says whether it created the registry."""
    try:
        Registry.create(name, dataclasses.replace(SMALL, lock_timeout=0.5))
        chan.send("created")
    except ShmCancelError as e:
        chan.send(f"refused: {e}")
    assert chan.recv() == "exit"


def test_a_registry_unlinked_by_its_creator_leaves_the_creation_lock_to_its_holder(
        shm_name, spawn):
    """Defect: ``Registry.unlink`` (a master's ``on_exit``) removed the registry's lock file
    while another process held its flock (``shmtool unlink`` or ``cleanup --stale`` removing
    the registry, a creation): the next creator made a new lock file and created the registry
    beside the holder, and ``shmtool unlink`` (no ``--force``) then removed that live registry's
    entries, having found no segment at its check (contract §7: refused while the creator
    lives). The lock file is removed only when nobody holds it."""
    import fcntl

    a = spawn(_create_then_unlink, shm_name)
    assert a.recv() == "created"
    fd = os.open(f"/dev/shm/shmcancel-lock.{shm_name}", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # what shmtool unlink holds while it removes entries
        a.send("unlink")
        assert a.recv() == "unlinked"
        b = spawn(_try_create, shm_name)
        got = b.recv()
        assert got.startswith("refused: ") and "stayed locked" in got, got
        b.send("exit")
    finally:
        os.close(fd)
    a.send("exit")
    c = spawn(_try_create, shm_name)  # the lock free again: a server starts
    assert c.recv() == "created"
    p = shmtool("unlink", shm_name)
    assert p.returncode == 1 and f"pid {c.pid}" in p.stderr, p
    c.send("exit")


def test_unlink_removes_a_failed_creates_leftovers(shm_name):
    """A create that failed left a lock file (and a temporary) but no segment: unlink removes
    whatever of the name exists; and a failing create no longer leaves its lock file."""
    os.symlink("/dev/null", f"/dev/shm/shmcancel.{shm_name}")  # makes create fail
    with pytest.raises((ShmCancelError, OSError)):
        Registry.create(shm_name, SMALL)
    assert _entries(shm_name) == [f"shmcancel.{shm_name}"], "a failed create left entries"
    os.unlink(f"/dev/shm/shmcancel.{shm_name}")
    for f in (f"shmcancel-lock.{shm_name}", f"shmcancel.{shm_name}~creating"):
        os.close(os.open(f"/dev/shm/{f}", os.O_CREAT | os.O_WRONLY, 0o600))
    p = shmtool("list", "--json")
    row = {r["name"]: r for r in json.loads(p.stdout)["registries"]}[shm_name]
    assert row["state"] == "leftover", row
    p = shmtool("unlink", shm_name)
    assert p.returncode == 0, p.stderr
    assert _entries(shm_name) == []


def test_list_shows_a_killed_creators_registry_as_stale_and_cleanup_stale_removes_it(
        reg, shm_names):
    stale = reg.name + "-dead"
    shm_names.append(stale)
    pid = _stale(stale)
    p = shmtool("list", "--json")
    assert p.returncode == 0, p.stderr
    rows = {r["name"]: r for r in json.loads(p.stdout)["registries"]}
    assert rows[stale]["state"] == "stale" and rows[stale]["creator_alive"] is False
    assert rows[stale]["creator_pid"] == pid
    assert rows[reg.name]["state"] == "alive"
    line = next(x for x in shmtool("list").stdout.splitlines() if x.startswith(stale + " "))
    assert "stale" in line.split(), line
    # Named, so as not to sweep other test runs' registries; without names it sweeps them all.
    p = shmtool("cleanup", "--stale", stale, reg.name)
    assert p.returncode == 1, "a named live registry is refused"
    assert p.stdout.splitlines() == [f"removed stale registry {stale} (shmcancel.{stale}, "
                                     f"sem.shmcancel.{stale}, shmcancel-lock.{stale})"]
    assert p.stderr == f"shmtool: kept {reg.name}: its creator, pid {os.getpid()}, is alive\n"
    assert _entries(stale) == []
    Registry.attach(reg.name).close()  # the live one is untouched


def test_list_advises_fsck_for_a_damaged_region_header(reg, shm_names):
    """A table's damaged region header, in a live registry and in a stale one: ``list`` (and
    ``list --json``) gives a short note ending with the ``fsck`` that repairs it (the long
    field-by-field message was cut before its advice), and never advises ``cleanup --stale``
    (which would delete a repairable registry)."""
    stale = reg.name + "-dead"
    shm_names.append(stale)
    _stale(stale)
    dead = Registry.attach(stale, readonly=True)
    try:
        _damage_region_header(dead)
    finally:
        dead.close()
    _damage_region_header(reg)
    p = shmtool("list", "--json")
    assert p.returncode == 0, p.stderr
    rows = {r["name"]: r for r in json.loads(p.stdout)["registries"]}
    lines = shmtool("list").stdout.splitlines()
    for name, state in ((reg.name, "unusable"), (stale, "stale")):
        note = rows[name]["error"]
        assert rows[name]["state"] == state
        assert note.startswith("table 'cancellations': region header damaged"), note
        assert note.endswith(f": shmtool fsck {name} repairs it"), note
        assert "cleanup" not in note
        line = next(x for x in lines if x.startswith(name + " "))
        assert line.endswith(note) and state in line.split(), line
    p = shmtool("fsck", stale)
    assert p.returncode == 0 and "region_header 1" in p.stdout, p.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_stale_registry_of_another_user_is_advised_to_unlink_not_to_cleanup(shm_name):
    """``cleanup --stale`` leaves another user's segment alone, yet ``list`` advised it for
    such a stale registry (and the command then refused it): it advises ``unlink``, which its
    owner or root can run."""
    _stale(shm_name)
    os.chown(f"/dev/shm/shmcancel.{shm_name}", 65534, 65534)
    rows = {r["name"]: r for r in json.loads(shmtool("list", "--json").stdout)["registries"]}
    assert rows[shm_name]["state"] == "stale", rows[shm_name]
    error = rows[shm_name]["error"]
    assert f"shmtool unlink {shm_name}, run by its owner or root, removes it" in error, error
    assert "cleanup --stale" not in error
    p = shmtool("unlink", shm_name)
    assert p.returncode == 0, p.stderr
    assert _entries(shm_name) == []


def test_advice_names_shmtool_as_it_was_run(shm_name, tmp_path):
    """The README runs ``.venv/bin/shmtool`` without activating the venv: advice naming a bare
    ``shmtool`` was not a command that shell could run."""
    installed = os.path.join(os.path.dirname(sys.executable), "shmtool")
    if not os.path.exists(installed):
        pytest.skip("no shmtool script beside this interpreter")
    _stale(shm_name)
    spaced = tmp_path / "my tools"
    spaced.mkdir()
    for script, shown in ((installed, installed),
                          (str(spaced / "shmtool"), f"'{spaced}/shmtool'")):
        if script != installed:
            shutil.copy(installed, script)
        p = subprocess.run([script, "list"], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "PATH": "/usr/bin:/bin"})
        line = next(x for x in p.stdout.splitlines() if x.startswith(shm_name + " "))
        assert f"{shown} cleanup --stale {shm_name} removes it" in line, line
    # python -m, with no shmtool on PATH: the advice names this interpreter's -m
    p = subprocess.run([sys.executable, "-m", "shmcancel.shmtool", "list"], capture_output=True,
                       text=True, timeout=60, env={**os.environ, "PATH": "/usr/bin:/bin"})
    line = next(x for x in p.stdout.splitlines() if x.startswith(shm_name + " "))
    assert f"{sys.executable} -m shmcancel.shmtool cleanup --stale {shm_name} removes it" \
        in line, line
    assert shmtool("unlink", shm_name).returncode == 0


def test_a_registry_whose_creator_died_but_whose_users_live_is_orphaned_not_stale(shm_name):
    """A killed master's workers serve on (uvicorn workers for a minute or more): its registry
    was listed stale, and ``cleanup --stale`` advised and removed it from under them. It is
    listed orphaned, naming who uses it, and ``cleanup --stale`` keeps it (exit 1) until they
    are gone; ``unlink`` removes it."""
    _stale(shm_name)
    user = Registry.attach(shm_name)  # this process: a worker of the dead master
    try:
        rows = {r["name"]: r for r in json.loads(shmtool("list", "--json").stdout)["registries"]}
        assert rows[shm_name]["state"] == "orphaned", rows[shm_name]
        assert f"pid {os.getpid()}" in rows[shm_name]["error"], rows[shm_name]
        assert "cleanup --stale" not in rows[shm_name]["error"]
        p = shmtool("cleanup", "--stale", shm_name)
        assert p.returncode == 1 and p.stdout == "", p
        assert p.stderr == (f"shmtool: kept {shm_name}: its creator is gone, but pid "
                            f"{os.getpid()} still uses it (shmtool unlink {shm_name} removes it "
                            f"under them)\n"), p.stderr
        assert _entries(shm_name) != []
    finally:
        user.close()
    rows = {r["name"]: r for r in json.loads(shmtool("list", "--json").stdout)["registries"]}
    assert rows[shm_name]["state"] == "stale"
    p = shmtool("cleanup", "--stale", shm_name)
    assert p.returncode == 0 and p.stdout.startswith(f"removed stale registry {shm_name} "), p
    assert _entries(shm_name) == []


@pytest.mark.parametrize("lock_file", ["kept", "removed"])
def test_cleanup_stale_leaves_a_live_registry_as_it_found_it(reg, lock_file):
    """A live registry is kept, and its entries stay as they were: a lock file that was not
    there is not left behind by the flock ``--stale`` takes while it looks."""
    if lock_file == "removed":
        os.unlink(f"/dev/shm/shmcancel-lock.{reg.name}")
    before = _entries(reg.name)
    p = shmtool("cleanup", "--stale", reg.name)
    assert p.returncode == 1 and "is alive" in p.stderr, p
    assert _entries(reg.name) == before


@pytest.mark.parametrize("content", [b"", b"SHMTBL\x00\x03" + bytes(4088), os.urandom(4096)],
                         ids=["empty", "a bare table", "garbage"])
def test_cleanup_stale_keeps_a_segment_without_a_registry_header(shm_name, content):
    """Nothing says whether such a segment is in use (another program's file under our prefix,
    a bare table a test maps): ``--stale`` keeps it, says so, exits 1; ``unlink`` removes it."""
    path = f"/dev/shm/shmcancel.{shm_name}"
    with open(path, "xb") as f:
        f.write(content)
    p = shmtool("cleanup", "--stale", shm_name)
    assert p.returncode == 1, p
    assert p.stdout == "" and p.stderr.startswith(f"shmtool: skipped {shm_name}: its segment "
                                                  "has no shmcancel header"), p.stderr
    assert len(p.stderr.splitlines()) == 1
    with open(path, "rb") as f:
        assert f.read() == content
    # nothing made either: it left a lock file of its own behind (shmcancel-lock.NAME), which
    # `list` then showed and a test run's check of /dev/shm found as litter
    assert _entries(shm_name) == [f"shmcancel.{shm_name}"]
    p = shmtool("unlink", shm_name)
    assert p.returncode == 0, p.stderr
    assert _entries(shm_name) == []


@pytest.mark.parametrize(
    "args",
    [("dump", "{name}"), ("dump", "{name}", "--json"), ("stats", "{name}"),
     ("stats", "{name}", "--json"), ("cleanup", "{name}"), ("unlink", "{name}"),
     ("dump", "bad name!"), ("stats", "x" * 65)],
)
def test_errors_exit_1_with_one_line(shm_name, args):
    p = shmtool(*(a.format(name=shm_name) for a in args))
    assert p.returncode == 1
    assert p.stdout == ""
    assert len(p.stderr.splitlines()) == 1 and p.stderr.endswith("\n")
    assert p.stderr.startswith("shmtool: ") and "Traceback" not in p.stderr


def test_a_garbled_table_descriptor_is_one_line_never_a_traceback(shm_name):
    """A registry whose header names a record size no table can have (not a multiple of 8):
    dump, stats and cleanup exit 1 with one line, list shows it unusable, and none of them
    prints a traceback (the table geometry's ValueError escaped before)."""
    import struct

    Registry.create(shm_name, SMALL).close()
    with open(f"/dev/shm/shmcancel.{shm_name}", "r+b") as f:
        f.seek(520 + 52)  # table descriptor 0's record size (u32)
        (size,) = struct.unpack("<I", f.read(4))
        f.seek(520 + 52)
        f.write(struct.pack("<I", size + 3))
    for args in (("dump", shm_name), ("dump", shm_name, "--json"), ("stats", shm_name),
                 ("stats", shm_name, "--json"), ("cleanup", shm_name)):
        p = shmtool(*args)
        assert p.returncode == 1, (args, p)
        assert p.stdout == "" and len(p.stderr.splitlines()) == 1, (args, p.stderr)
        assert "Traceback" not in p.stderr and "cancellations" in p.stderr, (args, p.stderr)
    p = shmtool("list", "--json")
    assert p.returncode == 0 and "Traceback" not in p.stderr, p
    row = {r["name"]: r for r in json.loads(p.stdout)["registries"]}[shm_name]
    assert row["state"] != "alive" and "cancellations" in row["error"], row


def test_missing_registry_message_names_it(shm_name):
    p = shmtool("dump", shm_name)
    assert shm_name in p.stderr


@pytest.mark.parametrize("args", [(), ("bogus",), ("dump",), ("stats", "a", "b"),
                                  ("cleanup", "a", "--ttl", "x"), ("cleanup", "a", "--ttl", "-5"),
                                  ("cleanup", "a", "--ttl", "nan")])
def test_usage_errors_exit_2(args):
    p = shmtool(*args)
    assert p.returncode == 2
    assert "usage:" in p.stderr and "Traceback" not in p.stderr


def test_console_script(reg):
    """The installed ``shmtool`` script: on PATH, else beside this interpreter (a venv's bin)."""
    script = shutil.which("shmtool") or os.path.join(os.path.dirname(sys.executable), "shmtool")
    assert os.access(script, os.X_OK), f"console script not installed ({script})"
    Cancellation(reg).cancel(1, "via script", "s")
    p = subprocess.run([script, "dump", reg.name, "--json"], capture_output=True, text=True,
                       timeout=30)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["cancellations"][0]["reason"] == "via script"


@pytest.mark.integration
def test_unlink_under_a_running_gunicorn_is_refused_and_the_server_survives(shm_name):
    """Defect: unlink succeeded, the next replacement worker failed to attach and gunicorn
    halted. Refused now; a worker killed afterwards is replaced and serves."""
    from helpers.gunicorn_harness import Gunicorn

    with Gunicorn("tests.apps.hooks_app:app", registry_name=shm_name,
                  config="examples/gunicorn/gunicorn.conf.py", workers=1) as g:
        p = shmtool("unlink", shm_name)
        assert p.returncode == 1 and f"pid {g.pid}" in p.stderr, p.stderr
        assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr
        (worker,) = g.worker_pids()
        os.kill(worker, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while True:
            pids = g.worker_pids()
            if pids and worker not in pids:
                break
            assert time.monotonic() < deadline, g.log_tail()
            time.sleep(0.02)
        g.wait_workers(1, deadline)
        Registry.attach(shm_name, readonly=True).close()


def test_dump_and_stats_after_a_writer_died_mid_write(reg) -> None:
    """A writer SIGKILLed mid-write leaves its lock taken and a bucket version odd until the
    next writer recovers them. ``dump``/``stats`` never take the lock: they still answer (the
    rows that validate) and change nothing, instead of failing until some writer comes."""
    c = Cancellation(reg)
    for i in range(20):
        c.cancel(i, f"r{i}", "ip:x")

    pid, r = child(stuck_mid_write(reg))
    try:
        assert recv(r) == b"mid"
        os.kill(pid, signal.SIGKILL)
        reap(pid)
        with open(f"/dev/shm/shmcancel.{reg.name}", "rb") as f:
            before = f.read()
        p = shmtool("dump", reg.name, "--json")
        assert p.returncode == 0, p.stderr
        rows = json.loads(p.stdout)["cancellations"]
        assert {(x["request_id"], x["reason"]) for x in rows} == {
            (str(i), f"r{i}") for i in range(20)}
        s = shmtool("stats", reg.name, "--json")
        assert s.returncode == 0, s.stderr
        with open(f"/dev/shm/shmcancel.{reg.name}", "rb") as f:
            assert f.read() == before
    finally:
        reap(pid)
        os.close(r)


def test_dump_shows_each_row_once_after_a_writer_died_mid_shift(reg) -> None:
    """A writer killed in the middle of a backward shift leaves one index entry copied to a
    second slot and its bucket version odd. A read-only ``dump`` (no lock to repair under)
    shows that row once: neither twice nor dropped."""
    c = Cancellation(reg)
    for i in range(5):
        c.cancel(f"id{i}", "r", scope="s")
    t = reg.table("cancellations")
    with reg.lock:  # what the dead writer held; the copy it left, by hand
        reg.lock.dirty = True
        idx = t._idx
        j = next(k for k in range(0, t._nwords, 2) if idx[k])
        i = next(k for k in range(j + 2, t._nwords, 2) if not idx[k])
        idx[i + 1], idx[i] = idx[j + 1], idx[j]
        t._ver[j >> 5] += 1
        p = shmtool("dump", reg.name, "--json")
        t._ver[j >> 5] += 1
        idx[i], idx[i + 1] = 0, 0
        reg.lock.dirty = False
    assert p.returncode == 0, p.stderr
    assert sorted(x["request_id"] for x in json.loads(p.stdout)["cancellations"]) == [
        f"id{n}" for n in range(5)]


def _strict_json(text: str) -> object:
    """``json.loads`` refusing ``NaN``/``Infinity`` (Python's extensions, not JSON)."""
    def refuse(constant: str) -> object:
        raise ValueError(f"not JSON: {constant}")
    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_json_output_is_strict_json_with_a_non_finite_timestamp(reg, bad):
    """A row whose ``cancelled_at`` is not finite (an injected clock wrote it; written here
    through the table layer, which the API may refuse later): every ``--json`` output is still
    JSON, the timestamp ``null``, and the text dump says nothing like "nand ago"."""
    Cancellation(reg).cancel(1, "fine", "s")
    reg.table("cancellations").insert(("s", "2"), ("odd clock", bad))
    p = shmtool("dump", reg.name, "--json")
    assert p.returncode == 0, p.stderr
    rows = {r["request_id"]: r for r in _strict_json(p.stdout)["cancellations"]}
    assert rows["2"]["cancelled_at"] is None and rows["2"]["reason"] == "odd clock"
    assert isinstance(rows["1"]["cancelled_at"], float)
    for args in (("stats", reg.name, "--json"), ("list", "--json")):
        p = shmtool(*args)
        assert p.returncode == 0, p.stderr
        _strict_json(p.stdout)
    text = shmtool("dump", reg.name)
    assert text.returncode == 0, text.stderr
    row = next(line for line in text.stdout.splitlines() if "odd clock" in line)
    assert "nan" not in row.lower() and "inf" not in row.lower(), row


@pytest.mark.parametrize("at", [1e308, -1e308, 1e15])
def test_the_text_dump_of_a_far_off_timestamp_is_one_short_age(reg, at):
    """An injected clock's far-off stamp printed its age in full: a row "in 9999...9.0s" ~310
    characters wide. It is a short number of days, ahead or ago."""
    reg.table("cancellations").insert(("s", "far"), ("far clock", at))
    p = shmtool("dump", reg.name)
    assert p.returncode == 0, p.stderr
    row = next(line for line in p.stdout.splitlines() if "far clock" in line)
    assert len(row) < 120 and ("d ago" in row or "in " in row), row


@pytest.mark.parametrize("encoding", ["ascii", "latin-1"])
@pytest.mark.parametrize("command", ["dump", "stats"])
def test_text_output_survives_a_terminal_that_cannot_show_client_text(reg, encoding, command):
    """Defect: request ids, principal ids and reasons are client text; in a terminal whose
    encoding cannot show them (a Latin-1 or ASCII locale), ``dump`` and ``stats`` died with a
    UnicodeEncodeError traceback, so one client's request id made the tool unusable there.
    What cannot be shown is escaped; the row is still there."""
    c = Cancellation(reg)
    c.cancel("日本", "理由 €", "principal:ユーザー")
    c.cancel(1, "fine", "ip:192.0.2.1")
    env = dict(os.environ, PYTHONIOENCODING=encoding)
    p = subprocess.run([sys.executable, "-m", "shmcancel.shmtool", command, reg.name],
                       capture_output=True, env=env, timeout=30)
    assert p.returncode == 0, p.stderr.decode(errors="replace")
    assert p.stderr == b""
    out = p.stdout.decode(encoding)
    assert "\\u30e6\\u30fc\\u30b6\\u30fc" in out, out  # principal:ユーザー, escaped
    if command == "dump":
        assert "\\u65e5\\u672c" in out and "ip:192.0.2.1" in out, out
