"""A command run with a /dev/shm of its own, a tmpfs of a few MiB, so that a test can fill it
for real (the host's /dev/shm is shared with everything else on the machine).

``unshare --mount`` gives the command a private mount namespace, in which a new tmpfs is mounted
over /dev/shm; everything the command creates there is gone when its last process exits.
Needs root (CAP_SYS_ADMIN) and ``unshare``: :func:`unavailable` says why not, for a skip.
Another process reaches that /dev/shm as ``/proc/PID/root/dev/shm``.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess

_MOUNT = ('mount -t tmpfs -o size="$SMALL_SHM_SIZE",mode=1777 shmcancel-test /dev/shm '
          '&& exec "$@"')


def command(size: str, argv: list[str]) -> list[str]:
    """``argv`` run with a /dev/shm of ``size`` (tmpfs syntax: "16m") of its own."""
    return ["env", f"SMALL_SHM_SIZE={size}", "unshare", "--mount", "--propagation", "private",
            "sh", "-c", _MOUNT, "sh", *argv]


MAX_FILL = 64 << 20  # bytes: fill() refuses a /dev/shm larger than this


def fill(directory: str) -> int:
    """Fill the tmpfs at ``directory`` (a small /dev/shm of :func:`command`'s, from inside, or
    as ``/proc/PID/root/dev/shm``) with the file ``filler`` until no byte more fits; the fd of
    the file (close it and unlink ``directory/filler`` to make the room again). Refuses (an
    AssertionError, nothing written) a file system larger than ``MAX_FILL``: the host's own
    /dev/shm, should the namespace not be what it seems, is never filled."""
    v = os.statvfs(directory)
    assert v.f_blocks * v.f_frsize <= MAX_FILL, (
        f"{directory} is {v.f_blocks * v.f_frsize} bytes, not a small test /dev/shm")
    fd = os.open(os.path.join(directory, "filler"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    written = 0
    for chunk in (bytes(1 << 16), bytes(4096)):
        while written < MAX_FILL:
            try:
                written += os.write(fd, chunk)
            except OSError:
                break
    return fd


@functools.cache
def unavailable() -> str | None:
    """Why :func:`command` cannot run here, or None."""
    if shutil.which("unshare") is None:
        return "no unshare(1)"
    if os.geteuid() != 0:
        return "mounting a tmpfs in a mount namespace needs root"
    probe = subprocess.run(command("1m", ["true"]), capture_output=True, text=True, timeout=30)
    if probe.returncode:
        return f"unshare --mount failed here: {probe.stderr.strip()[:200]}"
    return None
