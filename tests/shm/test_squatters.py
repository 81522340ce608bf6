"""Entries of /dev/shm that are not ours (contract §7; docs/design.md, "Hardening edges"): /dev/shm
is world-writable, so any local user can put a FIFO, a symbolic link or a file of their own under a
registry's segment, semaphore, lock file or temporary name. Nothing may hang on, follow or trust
such an entry: create and attach raise one clear error naming the path, shmtool reports it in one
line and goes on, a gunicorn master exits with one line in its log. Every process that could hang on
the bug runs as a subprocess (or forked child) with a deadline.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import posix_ipc
import pytest
from helpers.gunicorn_harness import Gunicorn
from helpers.procs import fork, shmtool_cli, wait_exit

from shmcancel import Config, shmtool
from shmcancel.exceptions import ShmCancelError
from shmcancel.shm.registry import Registry

SHM = "/dev/shm"
NOBODY = 65534
SMALL = Config(capacity=200, max_rows=100, max_rows_per_scope=50, in_flight_capacity=32,
               session_capacity=8)
DEADLINE = 20.0  # seconds; a hang on the bug ends here


def paths(name: str) -> dict[str, str]:
    return {"segment": f"{SHM}/shmcancel.{name}", "semaphore": f"{SHM}/sem.shmcancel.{name}",
            "lock": f"{SHM}/shmcancel-lock.{name}", "temp": f"{SHM}/shmcancel.{name}~creating"}


@pytest.fixture
def squat(shm_name, tmp_path) -> Iterator[Callable[[str, str], str]]:
    """``squat(kind, which)`` puts a ``fifo``, ``symlink``, ``dir`` (empty), ``full-dir`` (a file
    in it) or ``foreign`` (uid 65534) entry at
    ``which`` of ``paths(shm_name)``; returns the path. Removed afterwards (the temporary name
    too, which the shm_name fixture does not know)."""
    made: list[str] = []
    target = tmp_path / "target"
    target.write_bytes(b"not yours")

    def make(kind: str, which: str) -> str:
        path = paths(shm_name)[which]
        if kind == "fifo":
            os.mkfifo(path, 0o600)
        elif kind == "socket":
            with socket.socket(socket.AF_UNIX) as sock:
                sock.bind(path)
        elif kind in ("dir", "full-dir"):
            os.mkdir(path, 0o700)
            if kind == "full-dir":
                (open(os.path.join(path, "inside"), "wb")).close()
        elif kind == "symlink":
            os.symlink(target, path)
        else:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.write(fd, b"\0" * 4096)
            os.fchown(fd, NOBODY, NOBODY)
            os.close(fd)
        made.append(path)
        return path

    try:
        yield make
    finally:
        for path in made:  # a directory left (the fixture shm_name removes files only)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(paths(shm_name)["temp"])
        assert target.read_bytes() == b"not yours", "a symlink was followed and written through"


def run_py(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=DEADLINE)


CREATE = """
import sys
from shmcancel import Config
from shmcancel.exceptions import ShmCancelError
from shmcancel.shm.registry import Registry
try:
    Registry.create(sys.argv[1], Config(capacity=200, max_rows=100, max_rows_per_scope=50,
                                        in_flight_capacity=32, session_capacity=8))
except ShmCancelError as e:
    print(e)
    sys.exit(3)
"""

ATTACH = """
import sys
from shmcancel.exceptions import ShmCancelError
from shmcancel.shm.registry import Registry
try:
    Registry.attach(sys.argv[1], readonly=sys.argv[2] == "ro")
except ShmCancelError as e:
    print(e)
    sys.exit(3)
"""


def one_line(p: subprocess.CompletedProcess | tuple[int, str, str], path: str) -> str:
    err = p.stderr if isinstance(p, subprocess.CompletedProcess) else p[2]
    assert "Traceback" not in err, err
    assert len(err.splitlines()) == 1, err
    assert path in err, err
    return err


CASES = [("fifo", "segment"), ("fifo", "lock"), ("fifo", "temp"), ("symlink", "segment"),
         ("symlink", "lock"), ("symlink", "semaphore"), ("foreign", "segment"),
         ("foreign", "semaphore"), ("foreign", "lock"), ("foreign", "temp")]


@pytest.mark.parametrize(("kind", "which"), CASES)
def test_create_refuses_a_squatted_entry(shm_name, squat, kind, which):
    path = squat(kind, which)
    before = os.lstat(path)
    p = run_py(CREATE, shm_name)
    assert p.returncode == 3, (p.stdout, p.stderr)
    assert path in p.stdout and len(p.stdout.splitlines()) == 1, p.stdout
    after = os.lstat(path)
    assert (after.st_ino, after.st_mode, after.st_uid) == \
        (before.st_ino, before.st_mode, before.st_uid), "the squatter's entry was replaced"
    left = {w for w, q in paths(shm_name).items() if os.path.lexists(q)}
    assert left == {which}, f"a failed create left {left - {which}}"


@pytest.mark.parametrize(("kind", "mode"), [("fifo", "ro"), ("fifo", "rw"), ("symlink", "ro"),
                                            ("foreign", "rw")])
def test_attach_refuses_a_squatted_segment(shm_name, squat, kind, mode):
    path = squat(kind, "segment")
    p = run_py(ATTACH, shm_name, mode)
    assert p.returncode == 3, (p.stdout, p.stderr)
    assert path in p.stdout and len(p.stdout.splitlines()) == 1, p.stdout


def test_a_unix_socket_squatting_a_segment_is_not_called_a_fifo(shm_name, squat):
    """Defect: opening a Unix socket fails with ENXIO, as a FIFO without a reader does, and
    attach, create and ``shmtool dump`` all called the socket "a FIFO"."""
    path = squat("socket", "segment")
    for p in (run_py(ATTACH, shm_name, "ro"), run_py(CREATE, shm_name)):
        assert p.returncode == 3, (p.stdout, p.stderr)
        assert f"{path} is not a regular file" in p.stdout, p.stdout
        assert "FIFO" not in p.stdout and len(p.stdout.splitlines()) == 1, p.stdout
    p = shmtool_cli("dump", shm_name)
    assert p.returncode == 1 and f"{path} is not a regular file" in p.stderr, p
    assert "FIFO" not in p.stderr, p


def test_attach_refuses_a_replaced_semaphore(shm_name, squat):
    reg = Registry.create(shm_name, SMALL)
    try:
        os.unlink(paths(shm_name)["semaphore"])
        path = squat("symlink", "semaphore")
        p = run_py(ATTACH, shm_name, "rw")
        assert p.returncode == 3, (p.stdout, p.stderr)
        assert path in p.stdout, p.stdout
    finally:
        reg.close()


@pytest.mark.parametrize("kind", ["fifo", "symlink", "foreign"])
def test_shmtool_reports_a_squatted_segment_and_goes_on(shm_name, shm_names, squat, kind):
    path = squat(kind, "segment")
    other = shm_name + "-ok"
    shm_names.append(other)
    reg = Registry.create(other, SMALL)
    try:
        p = shmtool_cli("list", "--json")
        assert p.returncode == 0, p.stderr
        rows = {r["name"]: r for r in json.loads(p.stdout)["registries"]}
        assert rows[other]["state"] == "alive", "the listing went on past the squatter"
        assert path in rows[shm_name]["error"], rows[shm_name]
        human = shmtool_cli("list")
        assert human.returncode == 0 and path in human.stdout, human
        for args in (("dump", shm_name), ("dump", shm_name, "--json"), ("stats", shm_name),
                     ("cleanup", shm_name)):
            p = shmtool_cli(*args)
            assert p.returncode == 1 and p.stdout == "", (args, p)
            one_line(p, path)
    finally:
        reg.close()
        reg.unlink()


# --- another user ----------------------------------------------------------------------------


def as_nobody(fn: Callable[[], int]) -> tuple[int, str, str]:
    """Run ``fn()`` in a forked child as uid/gid 65534; its exit status, stdout and stderr.
    (This interpreter lives where uid 65534 cannot exec it: fork, not a new process.)"""
    out, err = os.pipe(), os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        rc = 99
        try:
            os.dup2(out[1], 1)
            os.dup2(err[1], 2)
            for fd, attr in ((1, "stdout"), (2, "stderr")):
                raw = os.fdopen(fd, "wb", 0, closefd=False)
                setattr(sys, attr, io.TextIOWrapper(raw, write_through=True))
            signal.alarm(int(DEADLINE))
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            rc = fn()
        except BaseException:
            import traceback
            traceback.print_exc()
        finally:
            os._exit(rc)
    os.close(out[1])
    os.close(err[1])
    deadline = time.monotonic() + DEADLINE + 5
    try:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            assert time.monotonic() < deadline, "the child as uid 65534 hung"
            time.sleep(0.01)
        with os.fdopen(out[0]) as o, os.fdopen(err[0]) as e:
            return os.waitstatus_to_exitcode(status), o.read(), e.read()
    finally:
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def test_shmtool_unlink_by_another_user_is_one_line(shm_name):
    reg = Registry.create(shm_name, SMALL)
    reg.close()
    rc, out, err = as_nobody(lambda: shmtool.main(["unlink", shm_name, "--force"]))
    assert rc == 1, (out, err)
    one_line((rc, out, err), paths(shm_name)["segment"])
    assert "uid 0" in err, err
    assert os.path.exists(paths(shm_name)["segment"]), "another user removed our segment"


@pytest.mark.parametrize("which", ["semaphore", "temp", "lock"])
def test_create_by_another_user_over_our_entry_is_one_line(shm_name, squat, which):
    """Our (root's) entry at a name uid 65534 then creates: the kernel refuses it the unlink
    (sticky /dev/shm); that must be one clear error, never posix_ipc's or OSError's traceback."""
    path = paths(shm_name)[which]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, b"\0" * 64)
    os.close(fd)

    def create() -> int:
        try:
            Registry.create(shm_name, SMALL)
        except ShmCancelError as e:
            print(e, file=sys.stderr)
            return 3
        return 0

    rc, out, err = as_nobody(create)
    assert rc == 3, (out, err)
    one_line((rc, out, err), path)
    assert os.stat(path).st_uid == 0


# --- a real gunicorn master over a squatted name --------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize(("kind", "which"), [("fifo", "segment"), ("symlink", "segment"),
                                             ("symlink", "lock"), ("foreign", "semaphore")])
def test_gunicorn_over_a_squatted_name_exits_with_one_line(shm_name, squat, kind, which):
    path = squat(kind, which)
    g = Gunicorn("tests.apps.hooks_app:app", registry_name=shm_name,
                 config="examples/gunicorn/gunicorn.conf.py", workers=1, timeout=15)
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match="gunicorn failed to start"), g:
        pass
    assert time.monotonic() - t0 < 15
    log = g.log()
    assert "Traceback" not in log, log
    errors = [line for line in log.splitlines() if line.startswith("Error: shmcancel:")]
    assert len(errors) == 1 and path in errors[0], log


@contextlib.contextmanager
def live_registry_of_nobody(shm_name: str) -> Iterator[int]:
    """A child process running as ``nobody`` creates registry ``shm_name`` and lives on (its
    creator, alive) for the block; yields its pid, then kills and reaps it."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            Registry.create(shm_name, SMALL)
            os.write(w, b"x")
            time.sleep(DEADLINE)
        finally:
            os._exit(0)
    try:
        os.close(w)
        assert os.read(r, 1) == b"x"
        yield pid
    finally:
        os.close(r)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_unlink_refuses_another_users_live_registry(shm_name):
    """Root running ``shmtool unlink`` on a live server of another user: refused too (the
    segment is not ours to use, but its header still names a live creator)."""
    with live_registry_of_nobody(shm_name) as pid:
        assert os.stat(paths(shm_name)["segment"]).st_uid == NOBODY
        p = shmtool_cli("unlink", shm_name)
        assert p.returncode == 1, p
        assert f"pid {pid}" in one_line(p, shm_name)
        assert os.path.exists(paths(shm_name)["segment"])
    p = shmtool_cli("unlink", shm_name)  # its creator is gone now
    assert p.returncode == 0, p
    assert not any(os.path.lexists(q) for q in paths(shm_name).values())


def test_list_never_advises_removing_another_users_live_registry(shm_name):
    """Root's ``list`` read another user's registry as unusable (not a file of root's) and gave
    the squatter advice, "remove it (as its owner or root)", for a live server's registry; its
    creator was not even read. Now it names the live creator and gives no such advice."""
    with live_registry_of_nobody(shm_name) as pid:
        p = shmtool_cli("list", "--json")
        assert p.returncode == 0, p
        row = next(r for r in json.loads(p.stdout)["registries"] if r["name"] == shm_name)
        assert (row["creator_pid"], row["creator_alive"]) == (pid, True), row
        assert "remove it" not in row["error"] and f"pid {pid}, is alive" in row["error"], row
    p = shmtool_cli("list", "--json")  # its creator is gone now: stale, removable
    row = next(r for r in json.loads(p.stdout)["registries"] if r["name"] == shm_name)
    assert (row["creator_alive"], row["state"]) == (False, "stale"), row


@pytest.mark.parametrize("command", ["unlink", "cleanup --stale"])
@pytest.mark.parametrize("mode", [0o000, 0o200])
def test_a_live_registry_whose_segment_its_user_cannot_read_is_not_removed(shm_name, command,
                                                                            mode):
    """§7: ``unlink`` refuses while the registry's creator is alive. A user's (not root's) live
    registry whose segment has lost its owner's read permission (a careless ``chmod``): its
    header, where the creator is recorded, could not be read, and that was taken for "no live
    creator": ``unlink`` without ``--force`` and ``cleanup --stale`` removed the live server's
    registry. A creator that cannot be read is not a dead one."""
    with live_registry_of_nobody(shm_name):
        os.chmod(paths(shm_name)["segment"], mode)
        rc, out, err = as_nobody(lambda: shmtool.main([*command.split(), shm_name]))
        assert rc == 1, (out, err)
        one_line((rc, out, err), paths(shm_name)["segment"])
        assert all(os.path.exists(paths(shm_name)[w]) for w in ("segment", "semaphore", "lock")), \
            f"{command} removed a live registry: {out}"
        if command == "unlink":
            rc, out, err = as_nobody(lambda: shmtool.main(["unlink", shm_name, "--force"]))
            assert rc == 0, (out, err)
            assert not os.path.exists(paths(shm_name)["segment"])


# --- what `list` says about a registry's other entries, and whether the commands agree --------


def list_row(name: str) -> tuple[dict, str]:
    """``name``'s row of ``shmtool list --json`` and its one line of ``shmtool list``."""
    p = shmtool_cli("list", "--json")
    assert p.returncode == 0 and "Traceback" not in p.stderr, p
    row = {r["name"]: r for r in json.loads(p.stdout)["registries"]}[name]
    human = shmtool_cli("list")
    assert human.returncode == 0, human
    lines = [x for x in human.stdout.splitlines() if x.split()[:1] == [name]]
    assert len(lines) == 1, human.stdout
    return row, lines[0]


def stale_registry(name: str) -> None:
    """Registry ``name`` created by a child that then exits without unlinking it (reaped)."""
    pid = fork(lambda: Registry.create(name, SMALL))
    status = wait_exit(pid, DEADLINE)
    assert status is not None and os.waitstatus_to_exitcode(status) == 0, status


@pytest.mark.parametrize("kind", ["missing", "fifo", "symlink", "foreign"])
def test_list_does_not_call_a_registry_alive_that_workers_cannot_attach(shm_name, squat, kind):
    """Defect: a live registry whose semaphore was missing, a FIFO, a symbolic link or another
    user's file was listed as ``alive`` without a note, though every worker's attach and
    ``shmtool cleanup`` refuse it."""
    reg = Registry.create(shm_name, SMALL)
    try:
        path = paths(shm_name)["semaphore"]
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        if kind != "missing":
            squat(kind, "semaphore")
        row, line = list_row(shm_name)
        assert row["state"] == "unusable" and row["creator_alive"] is True, row
        assert path in row["error"], row
        assert path in line and "unusable" in line.split(), line
        attach = run_py(ATTACH, shm_name, "rw")  # what list says: a worker cannot attach
        assert attach.returncode == 3 and path in attach.stdout, attach
        p = shmtool_cli("cleanup", shm_name)
        assert p.returncode == 1, p
        one_line(p, path)
    finally:
        reg.close()


@pytest.mark.parametrize("kind", ["missing", "fifo", "symlink", "foreign"])
def test_a_live_registrys_lock_file_squatted_or_gone_stops_no_worker(shm_name, squat, kind):
    """A worker never opens the lock file (only creators and ``unlink``/``cleanup --stale``
    do; the lock's recovery flocks the segment's own file): a live registry whose lock file was
    removed or replaced by a FIFO, a symbolic link or another user's file is still attached,
    locked and swept, and ``list`` calls it ``alive``, naming a squatted entry in its note."""
    reg = Registry.create(shm_name, SMALL)
    try:
        path = paths(shm_name)["lock"]
        os.unlink(path)
        if kind != "missing":
            squat(kind, "lock")
        row, _ = list_row(shm_name)
        assert row["state"] == "alive" and row["creator_alive"] is True, row
        if kind != "missing":
            assert path in (row["error"] or ""), row
        attach = run_py(ATTACH, shm_name, "rw")
        assert attach.returncode == 0, attach
        p = shmtool_cli("cleanup", shm_name)
        assert p.returncode == 0 and "Traceback" not in p.stderr, p
        assert os.path.lexists(path) is (kind != "missing"), "a lock file was made or removed"
    finally:
        reg.close()


def test_list_advice_for_a_stale_registry_with_a_fifo_of_ours_agrees_with_the_commands(
        shm_name, squat):
    """A stale registry with a FIFO of ours among its entries: ``cleanup --stale`` will not
    touch it (exit 1), so ``list`` must not advise it; ``unlink`` (which it advises) removes it."""
    stale_registry(shm_name)
    fifo = squat("fifo", "temp")
    row, line = list_row(shm_name)
    assert row["state"] == "stale", row
    assert fifo in row["error"] and "cleanup --stale" not in row["error"], row
    assert f"shmtool unlink {shm_name}" in row["error"], row
    assert fifo in line, line
    p = shmtool_cli("cleanup", "--stale", shm_name)
    assert p.returncode == 1, p
    one_line(p, fifo)
    p = shmtool_cli("unlink", shm_name)
    assert p.returncode == 0 and p.stderr == "", p
    assert not any(os.path.lexists(q) for q in paths(shm_name).values())


@pytest.mark.parametrize("which", ["semaphore", "lock", "temp"])
def test_a_directory_of_ours_under_a_stale_registrys_name_goes_as_list_advises(
        shm_name, squat, which):
    """A directory of ours at one of a stale registry's names: ``list`` advised ``shmtool
    unlink``, which unlinked the rest and then failed on it with "Is a directory (it belongs to
    uid 0; remove it as its owner or root)", said to uid 0. An empty one now goes with the
    rest; one with entries is left, with one line saying how to remove it."""
    stale_registry(shm_name)
    with contextlib.suppress(FileNotFoundError):  # the stale registry's own entry, replaced
        os.unlink(paths(shm_name)[which])
    path = squat("dir", which)
    row, line = list_row(shm_name)
    assert row["state"] == "stale" and f"{path} is a directory" in row["error"], row
    assert path in line, line
    assert f"shmtool unlink {shm_name} removes it" in row["error"], row
    p = shmtool_cli("unlink", shm_name)
    assert p.returncode == 0 and p.stderr == "", p
    assert not any(os.path.lexists(q) for q in paths(shm_name).values())
    stale_registry(shm_name)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(paths(shm_name)[which])
    path = squat("full-dir", which)
    p = shmtool_cli("unlink", shm_name)
    assert p.returncode == 1, p
    err = one_line(p, path)
    assert err.endswith(f"cannot remove {path}: Directory not empty (a directory with "
                        f"entries; look inside, then remove it: rm -r {path})\n"), err
    assert os.path.exists(os.path.join(path, "inside"))  # never removed for us
    assert [q for q in paths(shm_name).values() if os.path.lexists(q)] == [path]


def test_list_advises_removing_a_stale_registry_of_another_layout(shm_name):
    """A stale registry of another layout version (an older shmcancel's, its server gone) was
    listed ``stale`` with no word of what removes it; ``cleanup --stale`` does."""
    stale_registry(shm_name)
    with open(paths(shm_name)["segment"], "r+b") as f:
        f.seek(8)  # the layout version (u64), after the magic
        f.write((7).to_bytes(8, "little"))
    row, _ = list_row(shm_name)
    assert row["state"] == "stale", row
    # the command for this registry alone (--stale without a NAME removes every stale one)
    assert row["error"].endswith(f": shmtool cleanup --stale {shm_name} removes it"), row
    p = shmtool_cli("cleanup", "--stale", shm_name)
    assert p.returncode == 0, p
    assert not any(os.path.lexists(q) for q in paths(shm_name).values())


@pytest.fixture
def foreign_fifo(shm_name) -> Iterator[str]:
    """A FIFO of uid 65534 at ``/dev/shm/shmcancel.NAME~zz``: another user squatting the
    registry's temporary pattern. Removed afterwards."""
    if os.geteuid() != 0:
        pytest.skip("making another user's entry needs root")
    path = f"{SHM}/shmcancel.{shm_name}~zz"
    os.mkfifo(path, 0o600)
    try:
        os.lchown(path, NOBODY, NOBODY)
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


@pytest.mark.parametrize("command", ["cleanup --stale", "unlink"])
def test_another_users_entry_neither_blocks_nor_fails_removing_our_stale_registry(
        shm_name, foreign_fifo, command):
    """Defect: another user's FIFO matching ``shmcancel.NAME~*`` was counted as part of our
    registry NAME: ``cleanup --stale NAME`` skipped it forever (exit 1) while ``list`` advised
    it, and ``unlink NAME`` exited 1. It is reported in one line and otherwise left alone."""
    stale_registry(shm_name)
    before = os.lstat(foreign_fifo)
    row, line = list_row(shm_name)
    assert row["state"] == "stale", row
    assert f"shmtool cleanup --stale {shm_name} removes it" in row["error"], row
    assert foreign_fifo in row["error"] and foreign_fifo in line, row  # reported, one line
    p = shmtool_cli(*command.split(), shm_name)
    assert p.returncode == 0, p
    one_line(p, foreign_fifo)
    assert p.stdout.startswith((f"removed stale registry {shm_name} ", f"unlinked {shm_name} ")), p
    ours = [q for w, q in paths(shm_name).items() if os.path.lexists(q)]
    assert ours == [], f"left of ours: {ours}"
    after = os.lstat(foreign_fifo)  # untouched: neither removed nor replaced
    assert (after.st_ino, after.st_uid, after.st_mode) == \
        (before.st_ino, before.st_uid, before.st_mode)
    # Now only the other user's entry is left under the name: list advises nothing that fails.
    row, line = list_row(shm_name)
    assert foreign_fifo in row["error"] and "cleanup --stale" not in row["error"], row
    p = shmtool_cli("cleanup", "--stale", shm_name)
    assert p.returncode == 0, p
    assert os.path.lexists(foreign_fifo)


def test_another_users_entry_does_not_make_our_live_registry_unusable(shm_name, foreign_fifo):
    """Another user's ``shmcancel.NAME~zz`` takes nothing from a live registry (workers attach):
    ``list`` says so, alive, and reports the entry on the same line."""
    reg = Registry.create(shm_name, SMALL)
    try:
        row, line = list_row(shm_name)
        assert row["state"] == "alive", row
        assert foreign_fifo in row["error"] and foreign_fifo in line, row
        run_py(ATTACH, shm_name, "rw").check_returncode()
    finally:
        reg.close()


@pytest.mark.parametrize("whose", ["squatter", "stale registry"])
def test_unlink_of_another_users_registry_leaves_no_lock_file_of_its_own(shm_name, squat, whose):
    """Defect: root's ``shmtool unlink NAME`` on another user's registry without a lock file (a
    stale one whose lock file is gone, or another user's file squatting the segment name, which
    ``list`` says to remove as root) created a lock file of its own to serialise with creators,
    then reported that fresh file as another user's entry ("belongs to uid 0 ... left alone")
    and left it behind: ``list`` showed a leftover registry afterwards. A creator of another
    user would refuse a lock file of ours anyway: nothing is locked, nothing is made."""
    if os.geteuid() != 0:
        pytest.skip("making another user's entry needs root")
    if whose == "squatter":
        squat("foreign", "segment")
    else:
        pid = fork(lambda: (os.setgroups([]), os.setgid(NOBODY), os.setuid(NOBODY),
                            Registry.create(shm_name, SMALL)))
        status = wait_exit(pid, DEADLINE)
        assert status is not None and os.waitstatus_to_exitcode(status) == 0, status
        assert os.stat(paths(shm_name)["segment"]).st_uid == NOBODY
        os.unlink(paths(shm_name)["lock"])
    p = shmtool_cli("unlink", shm_name)
    assert p.returncode == 0, p
    assert p.stderr == "", p
    left = [q for q in paths(shm_name).values() if os.path.lexists(q)]
    assert left == [], f"left behind: {left}"


def test_unlink_of_a_squatted_segment_removes_our_own_entries_too(shm_name, squat):
    """Defect: root's ``shmtool unlink NAME`` where another user's file squats the segment name
    and the semaphore is root's own (a creation the squatter beat): the squatter's segment went
    (root removes it, as ``list`` advises), but root's own semaphore was "another user's entry"
    ("belongs to uid 0 ... left alone", from uid 0), judged against the segment's owner, and
    stayed behind. The caller's own entries are the registry's too."""
    if os.geteuid() != 0:
        pytest.skip("making another user's entry needs root")
    squat("foreign", "segment")
    sem = posix_ipc.Semaphore(f"/shmcancel.{shm_name}", posix_ipc.O_CREX, 0o600, 1)
    sem.close()
    assert os.stat(paths(shm_name)["semaphore"]).st_uid == 0
    p = shmtool_cli("unlink", shm_name)
    assert p.returncode == 0, p
    assert p.stderr == "", p
    assert not [q for q in paths(shm_name).values() if os.path.lexists(q)]


# A name another user can give an entry under a registry's temporary pattern: a line break that
# forges a row of its own, and terminal escapes (clear the screen, set the window title).
FORGED = "~\nprod  1.2 MiB  1.0 MiB  1  alive\x1b[2J\x1b]0;pwned\x07"


@pytest.mark.parametrize("command", ["list", "cleanup --stale", "unlink"])
def test_another_users_entry_with_a_hostile_name_is_reported_in_one_escaped_line(shm_name,
                                                                                  command):
    """Defect: another user's file ``shmcancel.NAME~<line break, escapes>`` was printed as its
    name was: ``list``, ``cleanup --stale`` and ``unlink`` reported it over two lines (a forged
    row of ``list``'s table) and sent its escape sequences to the operator's terminal. It is
    reported in one line, its control characters escaped, and left alone."""
    if os.geteuid() != 0:
        pytest.skip("making another user's entry needs root")
    stale_registry(shm_name)
    path = f"{SHM}/shmcancel.{shm_name}{FORGED}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchown(fd, NOBODY, NOBODY)
        os.close(fd)
        p = shmtool_cli(*command.split(), *([] if command == "list" else [shm_name]))
        assert p.returncode == 0, p
        out = p.stdout + p.stderr
        assert "\x1b" not in out and "\x07" not in out, out
        lines = [x for x in out.splitlines()  # this test's, not a concurrent test's entries
                 if shm_name in x and ("prod" in x or "65534" in x)]
        assert len(lines) == 1 and "belongs to uid 65534" in lines[0], out
        assert "~\\nprod" in lines[0], lines
        assert os.path.lexists(path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
