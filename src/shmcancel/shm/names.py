"""A registry's names in /dev/shm, and opening them safely (squatters, links, FIFOs).

Names derived from a registry NAME (``[A-Za-z0-9_.-]{1,64}``), all mode 0600, owner-only:

- segment: POSIX shm ``/shmcancel.NAME`` (file ``/dev/shm/shmcancel.NAME``);
- semaphore: POSIX named semaphore ``/shmcancel.NAME`` (``/dev/shm/sem.shmcancel.NAME``), value 1;
- lock file: ``/dev/shm/shmcancel-lock.NAME``, only ever ``flock``-ed: it serialises creators
  (and ``shmtool unlink``/``cleanup --stale`` with them), and the kernel drops an ``flock`` when
  its holder dies. The lock's recovery flocks the segment's own file instead (``shm/lock.py``).

/dev/shm is world-writable: anyone can put a FIFO, a symbolic link or a file of their own under
these names. Every entry is opened ``O_NOFOLLOW | O_NONBLOCK`` (never follows a link, never blocks
on a FIFO) and ``fstat``-checked to be a regular file owned by the effective uid before it is used
(the semaphore, which ``sem_open`` opens itself, is ``lstat``-checked first and its inode compared
after); anything else is a :class:`RegistryIncompatible` naming the path, never a hang.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import stat
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import posix_ipc

from ..exceptions import InvalidRegistryName, RegistryIncompatible, ShmCancelError

__all__ = ["MODE", "SHM_DIR", "NotOurs", "check_entry", "check_name", "check_stat", "describe",
           "drop_lockfile", "flock_bounded", "lock_path", "name_paths", "not_ours", "open_entry",
           "open_lockfile", "registry_owner", "segment_path", "sem_path", "shm_name", "split_paths",
           "stat_problem", "tmp_path", "unlink_names", "unlink_quiet"]

SHM_DIR = "/dev/shm"
MODE = 0o600

_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")


# --- names ------------------------------------------------------------------------------------

def check_name(name: object) -> str:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise InvalidRegistryName(
            f"registry name must match [A-Za-z0-9_.-]{{1,64}}, got {name!r}")
    return name


def shm_name(name: str) -> str:
    return "/shmcancel." + name


def segment_path(name: str) -> str:
    return f"{SHM_DIR}/shmcancel.{name}"


def sem_path(name: str) -> str:
    return f"{SHM_DIR}/sem.shmcancel.{name}"


def lock_path(name: str) -> str:
    return f"{SHM_DIR}/shmcancel-lock.{name}"


def _tmp_shm_name(name: str) -> str:
    # '~' is outside the registry name alphabet: no registry can collide with a creation in flight.
    return f"/shmcancel.{name}~creating"


def tmp_path(name: str) -> str:
    return SHM_DIR + _tmp_shm_name(name)


_SAFE = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _problem(st: os.stat_result, any_owner: bool = False) -> str | None:
    """Why an entry of /dev/shm is not one shmcancel may use, or ``None`` if it is
    (``any_owner``: a regular file of another user will do, to be read only)."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if stat.S_ISFIFO(st.st_mode):
        return "is a FIFO"
    if stat.S_ISDIR(st.st_mode):
        return "is a directory"
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid != os.geteuid() and not any_owner:
        return f"belongs to uid {st.st_uid}, not to us (uid {os.geteuid()})"
    return None


def stat_problem(st: os.stat_result) -> str | None:
    """Why an entry with this ``lstat`` is not one shmcancel may use (a symbolic link, a FIFO,
    not a regular file, another user's), or ``None``."""
    return _problem(st)


def describe(st: os.stat_result) -> str:
    """What an entry with this ``lstat`` is, for a message: "a FIFO", "a regular file", ..."""
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link"
    if stat.S_ISFIFO(st.st_mode):
        return "a FIFO"
    if stat.S_ISREG(st.st_mode):
        return "a regular file"
    if stat.S_ISDIR(st.st_mode):
        return "a directory"
    return "not a regular file"


class NotOurs(RegistryIncompatible):
    """An entry of /dev/shm that shmcancel will not use; ``problem`` says what it is without
    the advice to remove it (not the advice to give when its registry is a live server's)."""

    def __init__(self, problem: str) -> None:
        super().__init__(f"{problem}: not using it; remove it (as its owner or root) or choose "
                         "another registry name")
        self.problem = problem


def not_ours(what: str, path: str, problem: str) -> NotOurs:
    """The one-line error for an entry of /dev/shm that shmcancel will not use."""
    return NotOurs(f"{what} {path} {problem}")


def _os_problem(e: OSError, path: str) -> str:
    """Why opening ``path`` failed with ``e``, in the words of :func:`_problem` where its
    ``lstat`` says (``ENXIO`` is both a FIFO without a reader and a Unix socket)."""
    if e.errno in (errno.ELOOP, errno.ENXIO):
        with contextlib.suppress(OSError):
            problem = _problem(os.lstat(path))
            if problem is not None:
                return problem
    if e.errno == errno.ELOOP:
        return "is a symbolic link"
    if e.errno == errno.ENXIO:
        return "is not a regular file"
    return f"cannot be opened ({e.strerror})"


def check_entry(what: str, path: str) -> os.stat_result | None:
    """``lstat`` ``path``: ``None`` if absent; its stat if it is a regular file of ours; else
    :class:`RegistryIncompatible`."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise not_ours(what, path, _os_problem(e, path)) from None
    problem = _problem(st)
    if problem is not None:
        raise not_ours(what, path, problem)
    return st


def open_entry(what: str, path: str, flags: int, mode: int = MODE, *,
               any_owner: bool = False) -> int:
    """Open ``path`` without following a symbolic link or blocking on a FIFO, and return the fd
    only if it is a regular file owned by us (else :class:`RegistryIncompatible`, fd closed).
    ``FileNotFoundError`` (and ``FileExistsError`` under ``O_EXCL``) pass through."""
    try:
        fd = os.open(path, flags | _SAFE, mode)
    except (FileNotFoundError, FileExistsError):
        raise
    except OSError as e:
        raise not_ours(what, path, _os_problem(e, path)) from None
    try:
        problem = _problem(os.fstat(fd), any_owner)
    except BaseException:
        os.close(fd)
        raise
    if problem is not None:
        os.close(fd)
        raise not_ours(what, path, problem)
    return fd


def open_on(fd: int, dev: int, ino: int) -> bool:
    """Whether ``fd`` is open on the file (``dev``, ``ino``): an inode number is unique within
    its file system only, and a number the process reused (after a ``closerange``) may be
    another file's. OSError when ``fd`` is not open."""
    st = os.fstat(fd)
    return st.st_ino == ino and st.st_dev == dev


def close_if_same(fd: int, dev: int, ino: int) -> None:
    """Close ``fd`` if it is still open on the file (``dev``, ``ino``) it was opened on
    (:func:`open_on`): another file's number is never closed here."""
    with contextlib.suppress(OSError):
        if open_on(fd, dev, ino):
            os.close(fd)


# The closer (close_with's) of the object that last took each fd number of this process to
# keep: a number's device and inode tell another file from a segment's, but not one of this
# process's descriptions of a segment's file from another (two attachments of one registry,
# each with its lock's fd: after a closerange one reopens onto a number another still counts as
# its own). fd -> (token, closer); the token is the closer's, which cannot name itself.
_keepers: dict[int, tuple[object, weakref.finalize[Any, Any]]] = {}


def close_with(owner: object, fd: int) -> weakref.finalize[Any, Any]:
    """Close ``fd`` (see :func:`close_if_same`) when ``owner`` is garbage collected unclosed;
    the owner's own close calls the returned finalizer (or ``detach()``-es it). Not at
    interpreter exit: the owner may still be in use then (an ``atexit`` handler, a daemon
    thread), and the OS closes the process's fds anyway. The owner keeps the number until
    another ``close_with`` takes it (:func:`kept_by`): then it is never closed here."""
    st = os.fstat(fd)
    token = object()
    fin = weakref.finalize(owner, _close_kept, fd, st.st_dev, st.st_ino, token)
    fin.atexit = False
    _keepers[fd] = (token, fin)
    return fin


def kept_by(fd: int, closer: object) -> bool:
    """Whether ``closer`` (:func:`close_with`'s) is still the keeper of the number ``fd``: once
    the number was closed behind its owner's back and taken by another object of this process
    (open on the same file, maybe), it is that one's."""
    k = _keepers.get(fd)
    return k is not None and k[1] is closer


def _close_kept(fd: int, dev: int, ino: int, token: object) -> None:
    k = _keepers.get(fd)
    if k is not None and k[0] is token:
        del _keepers[fd]
        close_if_same(fd, dev, ino)


def open_lockfile(name: str) -> int:
    """Open (creating if needed) the registry's lock file; a new open file description, so the
    ``flock`` on it is this process's own. Read-only (an ``flock`` needs no more), and made mode
    0600 when it is not: the mode given to ``open`` is filtered by umask, and one that takes
    the owner's write bit (277 for 027) would leave a file no later ``O_RDWR`` could open."""
    fd = open_entry("lock file", lock_path(name), os.O_RDONLY | os.O_CREAT)
    try:
        if stat.S_IMODE(os.fstat(fd).st_mode) != MODE:
            os.fchmod(fd, MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def drop_lockfile(name: str, fd: int) -> None:
    """Under the flock held on ``fd``: remove ``name``'s lock file if its path still names the
    file open at ``fd`` (a creator waiting on it then finds the path changed and retries on a
    new one, see :func:`flock_bounded`); best effort, never raises."""
    with contextlib.suppress(OSError):
        if os.lstat(lock_path(name)).st_ino == os.fstat(fd).st_ino:
            os.unlink(lock_path(name))


def flock_bounded(name: str, timeout: float) -> int:
    """An fd of the lock file, exclusively flock-ed; waits at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        fd = open_lockfile(name)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise RegistryIncompatible(
                            f"registry {name}: lock file {lock_path(name)} stayed locked for "
                            f"{timeout:.1f}s (another process is creating it)"
                        ) from None
                    time.sleep(0.005)
            # The file may have been unlinked (Registry.unlink) and recreated while we waited:
            # only a lock on the inode currently at the path serialises anything.
            try:
                same = os.lstat(lock_path(name)).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def unlink_quiet(fn: Callable[[str], None], arg: str) -> None:
    with contextlib.suppress(posix_ipc.ExistentialError, FileNotFoundError):
        fn(arg)


def name_paths(name: str) -> list[str]:
    """Every path in /dev/shm that belongs to registry ``name`` and exists: segment, semaphore,
    lock file and temporaries of a creation (``shmcancel.NAME~...``)."""
    check_name(name)
    paths = [segment_path(name), sem_path(name), lock_path(name)]
    tmp_prefix = f"shmcancel.{name}~"
    with contextlib.suppress(OSError):  # /dev/shm unreadable: the fixed names still go
        paths += [f"{SHM_DIR}/{f}" for f in sorted(os.listdir(SHM_DIR))
                  if f.startswith(tmp_prefix)]
    return [p for p in paths if os.path.lexists(p)]


def registry_owner(name: str) -> int:
    """The uid whose registry ``name`` is: the owner of its segment if that is a regular file,
    else the current user (no segment, or a squatter's link or FIFO in its place)."""
    try:
        st = os.lstat(segment_path(check_name(name)))
    except OSError:
        return os.geteuid()
    return st.st_uid if stat.S_ISREG(st.st_mode) else os.geteuid()


def split_paths(name: str) -> tuple[list[str], list[tuple[str, os.stat_result]]]:
    """:func:`name_paths` split into the registry's own entries (its owner's, see
    :func:`registry_owner`, and the caller's own) and other users' entries, each with its
    ``lstat``. Those are not part of the registry (another user's FIFO under
    ``shmcancel.NAME~x``, say): tools report them and leave them alone, and they must not block
    removing the registry."""
    owners = {registry_owner(name), os.geteuid()}
    own: list[str] = []
    others: list[tuple[str, os.stat_result]] = []
    for path in name_paths(name):
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        except OSError:
            own.append(path)  # whoever uses it gets the error naming it
            continue
        if st.st_uid in owners:
            own.append(path)
        else:
            others.append((path, st))
    return own, others


def unlink_names(name: str, paths: Iterable[str] | None = None) -> list[str]:
    """Remove whatever exists of ``name``'s segment, semaphore, lock file and temporaries (the
    entries themselves: a symbolic link is removed, never followed; an empty directory too,
    never one with entries), or only those of ``paths`` (the own entries :func:`split_paths`
    gives); the paths removed. Raises one :class:`ShmCancelError` naming the first path that
    could not be removed and what to do about it, after trying them all."""
    removed, failed = [], []
    for path in name_paths(name) if paths is None else paths:
        try:
            try:
                os.unlink(path)
            except IsADirectoryError:  # a squatter's directory: only an empty one goes
                os.rmdir(path)
            removed.append(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            failed.append((path, e))
    if failed:
        path, err = failed[0]
        try:
            uid = os.lstat(path).st_uid
        except OSError:
            uid = None
        if err.errno == errno.ENOTEMPTY:
            advice = f"a directory with entries; look inside, then remove it: rm -r {path}"
        elif uid is not None and uid != os.geteuid():
            advice = f"it belongs to uid {uid}; remove it as its owner or root"
        else:
            advice = f"check {os.path.dirname(path)}'s permissions and mounts"
        raise ShmCancelError(f"cannot remove {path}: {err.strerror} ({advice})")
    return removed


def check_stat(what: str, path: str, st: os.stat_result) -> None:
    if st.st_uid != os.geteuid():
        raise RegistryIncompatible(
            f"{what} {path} belongs to uid {st.st_uid}, not to us (uid {os.geteuid()})")
    if stat.S_IMODE(st.st_mode) != MODE:
        raise RegistryIncompatible(
            f"{what} {path} has mode {stat.S_IMODE(st.st_mode):o}, expected {MODE:o}")


