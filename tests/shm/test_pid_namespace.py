"""A registry seen from another pid namespace (a container sharing /dev/shm but not the server's
pids): every pid in it names no process there, so every process of the registry looked gone.
``shmtool cleanup --stale`` removed the live registry, ``cleanup`` reaped its running calls (then
uncancellable) and freed their lanes, an attach would have recovered a live holder's lock. Now
such a registry is read-only there: ``list`` says ``foreign``, ``dump``/``stats`` work with
liveness unknown, and everything that would judge liveness refuses. Real namespaces
(``unshare -p -f --mount-proc``, root), real processes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from shmcancel import Cancellation

pytestmark = pytest.mark.skipif(
    shutil.which("unshare") is None or os.geteuid() != 0
    or subprocess.run(["unshare", "-p", "-f", "--mount-proc", "true"],
                      capture_output=True, timeout=30).returncode != 0,
    reason="needs root and unshare(1) that can make a pid namespace")


def elsewhere(*argv: str) -> subprocess.CompletedProcess[str]:
    """``argv`` run in a new pid namespace (its own /proc)."""
    return subprocess.run(["unshare", "-p", "-f", "--mount-proc", *argv], capture_output=True,
                          text=True, timeout=60)


def shmtool(*args: str) -> subprocess.CompletedProcess[str]:
    return elsewhere(sys.executable, "-m", "shmcancel.shmtool", *args)


def test_a_registry_of_another_pid_namespace_is_read_only_there(registry) -> None:
    reg = registry()
    c = Cancellation(reg)
    h = c.begin(1, "s")  # a call running here, in a lane of this process
    try:
        seg = f"/dev/shm/shmcancel.{reg.name}"
        before = os.stat(seg).st_ino

        out = shmtool("list", "--json")
        assert out.returncode == 0, out.stderr
        row = next(r for r in json.loads(out.stdout)["registries"] if r["name"] == reg.name)
        assert row["state"] == "foreign" and row["creator_alive"] is None, row

        out = shmtool("dump", reg.name, "--json")
        assert out.returncode == 0, out.stderr
        flights = json.loads(out.stdout)["in_flight"]
        assert [(f["request_id"], f["pid"], f["alive"]) for f in flights] == \
            [("1", os.getpid(), None)]
        out = shmtool("stats", reg.name)
        assert out.returncode == 0 and "unknown: another pid namespace" in out.stdout, out

        for args in (["cleanup", reg.name], ["cleanup", "--stale", reg.name],
                     ["unlink", reg.name]):
            out = shmtool(*args)
            assert out.returncode == 1, (args, out.stdout, out.stderr)
            assert "another pid namespace" in out.stderr, (args, out.stderr)
            assert "Traceback" not in out.stderr

        for code in (f"from shmcancel import Registry; Registry.attach({reg.name!r})",
                     f"from shmcancel import Registry, Config; "
                     f"Registry.create({reg.name!r}, Config())"):
            out = elsewhere(sys.executable, "-c", code)
            assert out.returncode == 1 and "another pid namespace" in out.stderr, out.stderr

        assert os.stat(seg).st_ino == before  # not replaced, not unlinked
        assert c.in_flight(1, "s")  # not reaped
        assert c.cancel_if_in_flight(1, "still cancellable", "s") and h.cancelled()
    finally:
        h.end()


def test_unlink_force_still_removes_it(registry) -> None:
    """The operator's override: ``--force`` judges nothing."""
    reg = registry()
    out = shmtool("unlink", reg.name, "--force")
    assert out.returncode == 0, out.stderr
    assert not os.path.exists(f"/dev/shm/shmcancel.{reg.name}")
