"""The shared segment of one registry: its binary layout; create, attach, validate.

Its names in /dev/shm, and how each is opened safely: ``names.py``.

Binary layout (little-endian; every field 8-aligned; sizes in bytes)::

    offset  type    field
    0       8s      magic b"shmcancl"      (stable across layout versions, like creator)
    8       u64     layout version (LAYOUT_VERSION)
    16      u64     header size (4096)
    24      u64     total size of the segment, header included (== file size)
    32      u64     creator: procinfo.pack_owner(pid, start) of the creating process
    40      f64     created_at (time.time() at creation)
    48      16s     hash key (os.urandom(16)) for the tables' keyed hashing
    64      u64     inode of the semaphore file created with this segment
    72      u64     the creator an adoption replaced (OFF_PREV_CREATOR; 0: none)
    80      u64     the creator's pid namespace (procinfo.pid_namespace(); 0: unknown)
    88      u64     the last process to begin its exit as an owner (OFF_EXITING; 0: none)
    256     u64     lock owner: pack_owner of the holder, 0 = none          (see lock.py)
    264     u64     lock generation: +1 on every acquire and every recovery
    320     u64     recoveries (dead holders' units taken over)
    328     u64     evictions (rows removed by the global cap)
    384     f64     janitor: last_sweep (starts at created_at)
    392     u64     janitor: sweeps claimed
    400     u64     janitor: pack_owner of the process that claimed the last sweep
    448     u64     lanes: offset of the lanes region (``lanes.py``), after the tables; 0 = none
    456     u64     lanes: size of that region
    512     u64     table count n (at most MAX_TABLES)
    520     64 x n  table descriptors: 32s name (ASCII, NUL-padded), u64 offset, u64 region
                    size, u32 capacity, u32 record size, u8 kind (1 set, 2 bag), 7 pad
    2048    u64     config length m (at most CONFIG_MAX)
    2056    m       config: opaque bytes of the layer above (the registry's Config.pack())
    4096            table regions, each at a 4096-aligned offset, in descriptor order, then
                    the lanes region (4096-aligned): one lane set per table declared with lanes,
                    in the order of their names

Unlisted bytes are zero. Which tables a segment holds is declared above this layer
(``shm/schema.py``); the header records each one's name, so an attacher matches them by name.

A segment is built under a temporary name and ``link``-ed into place only once complete, so an
attacher never sees a half-written one; the semaphore is created first, so a visible segment
always has its semaphore (the header records which one, by inode).
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import re
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import posix_ipc

from ..exceptions import (
    RegistryIncompatible,
    RegistryNotFound,
    SegmentTooLarge,
    ShmCancelError,
)
from . import procinfo
from .names import (
    MODE,
    SHM_DIR,
    check_entry,
    check_name,
    check_stat,
    close_with,
    drop_lockfile,
    flock_bounded,
    kept_by,
    not_ours,
    open_entry,
    open_on,
    segment_path,
    sem_path,
    shm_name,
    tmp_path,
    unlink_quiet,
)

__all__ = [
    "HEADER_SIZE",
    "LAYOUT_VERSION",
    "MAGIC",
    "ForeignPidNamespace",
    "Segment",
    "TableDesc",
    "TableSpec",
    "check_semaphore",
    "creator_of",
    "foreign_error",
    "peek_semaphore",
]

MAGIC = b"shmcancl"
LAYOUT_VERSION = 9  # 2: sessions_per_client in the config; session_clients, session_calls
# 3: table names in the descriptors; the config as an opaque length-prefixed blob; tables of
#    two record size classes (their geometry in each table's own region header)
# 4: the lanes region (per-process rows written without the lock)
# 5: a record's reserved u32 is its row's word, stored in place (scope counts live there)
# 6: a scope count may stay at 0 in its row; scope_counts holds a quarter more rows for them
# 7: a lane set per table declared with lanes (session_calls too), each with a seal word and
#    the index of its table's descriptor
# 8: the lock's dead-holder recovery flocks the segment's own file, not the lock file: a
#    process of layout 7 recovering beside one of 8 (a USR2 upgrade's old and new workers)
#    would take its flock on another file, and both could take the same dead holder's unit
# 9: the index hash is SipHash-2-4 (was keyed blake2b): a process of 8 would find no row
HEADER_SIZE = 4096
PAGE = 4096
SEM_MIN_SIZE = 32  # sizeof(sem_t) on Linux; a shorter file would SIGBUS inside sem_wait

# --- header offsets (bytes) -------------------------------------------------------------------
_HEAD = struct.Struct("<8sQQQQd16sQ")  # at 0: magic .. semaphore inode (72 bytes)
OFF_CREATOR = 32
# The creator an adoption replaced (a USR2 upgrade's old master; 0: none). The registry counts as
# in use while either process lives: after a rollback the new master is gone and the old one
# serves on. In bytes 72..79, zero in every segment formatted before it was used.
OFF_PREV_CREATOR = 72
# The creator's pid namespace: pids and start times in the header and the tables mean nothing in
# another, where every process of this one looks gone, so no process there may judge liveness
# (recover the lock, reap rows, replace the registry). Zero in segments formatted before it.
OFF_PID_NS = 80
# The last owner (a gunicorn master) to begin its exit (``Registry.begin_exit``): of two masters
# of a USR2 upgrade stopped at once, each sees the other alive; the later one to mark itself
# here finds the earlier mark and unlinks. Zero in segments formatted before it was used.
OFF_EXITING = 88
OFF_LOCK_OWNER = 256
OFF_LOCK_GENERATION = 264
OFF_RECOVERIES = 320
OFF_EVICTIONS = 328
OFF_LAST_SWEEP = 384
OFF_SWEEPS = 392
OFF_LAST_SWEEPER = 400
OFF_LANES = 448
OFF_LANES_SIZE = 456
OFF_TABLE_COUNT = 512
OFF_TABLES = 520
_DESC = struct.Struct("<32sQQIIB7x")
OFF_CONFIG = 2048
MAX_TABLES = (OFF_CONFIG - OFF_TABLES) // _DESC.size  # 23
CONFIG_MAX = HEADER_SIZE - OFF_CONFIG - 8  # bytes of config
CREATE_TIMEOUT = 10.0  # seconds create waits for another creation, by default
_TABLE_NAME = re.compile(rb"[a-z][a-z0-9_]{0,31}")

KINDS = {"set": 1, "bag": 2}
_KIND_NAMES = {v: k for k, v in KINDS.items()}


class TableSpec(NamedTuple):
    """What ``create`` is asked to lay out for one table."""

    name: str
    kind: str
    capacity: int
    record_size: int
    region_size: int
    small_size: int = 0  # bytes per small record; 0: one class of record_size (shm/layout.py)
    large_count: int = 0  # rows larger than a small record the table holds (0: one class)
    lazy: tuple[int, int] = (0, 0)  # (offset, bytes) in the region backed on demand, not at create


class TableDesc(NamedTuple):
    """One table's descriptor as recorded in the header."""

    name: str
    kind: str
    capacity: int
    record_size: int
    offset: int
    region_size: int


def _align(n: int, a: int = PAGE) -> int:
    return (n + a - 1) // a * a


class Segment:
    """A mapped registry segment (and, unless read-only, its semaphore).

    ``buf`` covers the whole segment; ``words`` is the header as u64s (index = offset // 8), the
    view through which the lock makes its single aligned stores. Every view handed out by
    :meth:`region` is tracked and released by :meth:`close` (an exported view makes
    ``mmap.close()`` fail).
    """

    def __init__(self, name: str, mm: mmap.mmap, *, readonly: bool, ino: int,
                 sem: posix_ipc.Semaphore | None, fd: int = -1) -> None:
        self.name = name
        self._fd = fd  # kept open (unless read-only) for back(); closed by close()
        # An inode number is unique within its file system only: the fd's file is this
        # segment's when both its device and inode are (see _ours).
        self._dev = os.fstat(fd).st_dev if fd >= 0 else -1
        self._fd_closer = close_with(self, fd) if fd >= 0 else None  # also when collected
        self.readonly = readonly
        self.ino = ino
        self.sem = sem
        # Parse through struct first, make views last.
        (_magic, self.version, _hs, self.total_size, self.creator_word, self.created_at,
         self.hash_key, self.sem_ino) = _HEAD.unpack_from(mm, 0)
        (self.pid_ns,) = struct.unpack_from("<Q", mm, OFF_PID_NS)
        (m,) = struct.unpack_from("<Q", mm, OFF_CONFIG)
        self.config: bytes = mm[OFF_CONFIG + 8:OFF_CONFIG + 8 + min(m, CONFIG_MAX)]
        (n,) = struct.unpack_from("<Q", mm, OFF_TABLE_COUNT)
        descs = []
        for i in range(min(n, MAX_TABLES)):
            tname, off, size, cap, rs, kind = _DESC.unpack_from(mm, OFF_TABLES + i * _DESC.size)
            descs.append(TableDesc(tname.rstrip(b"\0").decode("ascii", "replace"),
                                   _KIND_NAMES.get(kind, "?"), cap, rs, off, size))
        self.tables: tuple[TableDesc, ...] = tuple(descs)
        self._mm: mmap.mmap | None = mm
        self.buf = memoryview(mm)
        self.words = self.buf[:HEADER_SIZE].cast("Q")
        self.floats = self.buf[:HEADER_SIZE].cast("d")
        self._views: list[memoryview] = []

    # --- header access ---
    @property
    def creator(self) -> tuple[int, int] | None:
        """The creating (or adopting, ``Registry.adopt``) process, read live from the header;
        when it is gone and the creator its adoption replaced lives, that one (see
        :func:`effective_creator`)."""
        w = self.words
        return effective_creator(w[OFF_CREATOR >> 3], w[OFF_PREV_CREATOR >> 3])

    def u64(self, off: int) -> int:
        return self.words[off >> 3]

    def set_u64(self, off: int, value: int) -> None:
        self.words[off >> 3] = value

    def f64(self, off: int) -> float:
        return self.floats[off >> 3]

    def set_f64(self, off: int, value: float) -> None:
        self.floats[off >> 3] = value

    def region(self, i: int) -> memoryview:
        """A view of table ``i``'s region (released by :meth:`close`)."""
        d = self.tables[i]
        v = self.buf[d.offset:d.offset + d.region_size]
        self._views.append(v)
        return v

    @property
    def lanes_region(self) -> tuple[Any, int, memoryview] | None:
        """``(mapping, offset, view)`` of the lanes region (the view released by
        :meth:`close`), or ``None`` when the segment has none."""
        off, size = self.words[OFF_LANES >> 3], self.words[OFF_LANES_SIZE >> 3]
        if not size:
            return None
        v = self.buf[off:off + size]
        self._views.append(v)
        return self._mm, off, v

    def back(self, offset: int, size: int) -> None:
        """Allocate the segment's pages in ``offset .. offset + size`` (bytes) if they are not
        yet: a span created unbacked (``TableSpec.lazy``) is backed here before it is written.
        A no-op where backed already. OSError (ENOSPC) when /dev/shm cannot hold them."""
        os.posix_fallocate(self._file(), offset, size)

    def _file(self) -> int:
        """The kept fd, checked to still be this segment's file (a process may have closed
        every fd, ``closerange`` in a daemonizing child, and the number now be another file's,
        which a fallocate would grow); else the segment's path opened again if it still names
        this segment. OSError (EBADF) when neither holds."""
        fd = self._fd
        if fd >= 0 and kept_by(fd, self._fd_closer):  # not taken by another attachment's
            with contextlib.suppress(OSError):
                if self._ours(fd):
                    return fd
        if self.readonly:
            raise OSError(errno.EBADF, "a read-only attachment backs no page")
        try:
            fd = open_entry("segment", segment_path(self.name), os.O_RDWR)
        except (OSError, ShmCancelError) as e:
            raise OSError(errno.EBADF, f"the segment's file is gone ({e})") from None
        if not self._ours(fd):  # the name holds a newer registry now
            os.close(fd)
            raise OSError(errno.EBADF, "the segment's file was closed, and its name unlinked")
        if self._fd_closer is not None:
            self._fd_closer.detach()  # the old number is not ours any more: never closed
        self._fd, self._fd_closer = fd, close_with(self, fd)
        return fd

    def short_by(self) -> int:
        """How many bytes of the segment its file lacks now (0: intact, or not known: a
        read-only attachment keeps no fd). A file truncated behind the server's back (an
        operator's ``truncate``) makes every touch of a page past its end a SIGBUS."""
        try:
            return max(0, self.total_size - os.fstat(self._file()).st_size)
        except OSError:
            return 0

    def reopen(self) -> int:
        """A new read-only open file description of this segment's file (so an ``flock`` on it
        is the caller's own), opened through the kept fd: the segment's own file even when its
        name was unlinked or now names another. OSError when it cannot be had (see ``_file``)."""
        return os.open(f"/proc/self/fd/{self._file()}", os.O_RDONLY | os.O_CLOEXEC)

    def _ours(self, fd: int) -> bool:
        """Whether ``fd`` is open on this segment's file (OSError when it is not open)."""
        return open_on(fd, self._dev, self.ino)

    @property
    def closed(self) -> bool:
        return self._mm is None

    def close(self) -> None:
        """Release every view and unmap. Idempotent. Views derived by others from
        :meth:`region` must have been released first, else the mapping is left to the GC."""
        mm, self._mm = self._mm, None
        if mm is None:
            return
        views: list[memoryview[Any]] = [*self._views, self.words, self.floats, self.buf]
        for v in views:
            v.release()
        self._views.clear()
        # A view someone else derived may still be alive: then it is unmapped when collected.
        with contextlib.suppress(BufferError):
            mm.close()
        if self.sem is not None:
            self.sem.close()
        self._fd = -1
        if self._fd_closer is not None:
            self._fd_closer()  # closes the fd if the number is still the segment's file

    # --- create ---
    @classmethod
    def create(cls, name: str, config: bytes, tables: Sequence[TableSpec], *,
               init: Callable[[Segment], None] | None = None,
               timeout: float = CREATE_TIMEOUT, lanes_size: int = 0) -> Segment:
        """Create the segment and its semaphore, replacing a stale registry of the same name.

        ``config``: at most ``CONFIG_MAX`` bytes kept for the layer above (:attr:`config`).
        ``init(segment)`` runs before the segment becomes visible (format the tables there).
        ``timeout``: seconds to wait for another process creating ``name``.
        ``lanes_size``: bytes of the lanes region after the tables (0: none).
        Raises :class:`RegistryIncompatible` when a live process created ``name``,
        :class:`SegmentTooLarge` when /dev/shm cannot hold it.
        """
        check_name(name)
        if len(tables) > MAX_TABLES:
            raise ValueError(f"at most {MAX_TABLES} tables")
        if len(config) > CONFIG_MAX:
            raise ValueError(f"config of {len(config)} bytes: at most {CONFIG_MAX}")
        # Layout first: nothing is touched for an impossible request.
        descs: list[TableDesc] = []
        lazy: list[tuple[int, int]] = []  # absolute spans backed on demand
        off = HEADER_SIZE
        for t in tables:
            if t.kind not in KINDS:
                raise ValueError(f"table kind must be 'set' or 'bag', got {t.kind!r}")
            if not _TABLE_NAME.fullmatch(t.name.encode("ascii", "replace")):
                raise ValueError(f"table name must match [a-z][a-z0-9_]{{0,31}}, got {t.name!r}")
            if any(d.name == t.name for d in descs):
                raise ValueError(f"table {t.name} twice")
            descs.append(TableDesc(t.name, t.kind, t.capacity, t.record_size, off,
                                   t.region_size))
            lo, n = t.lazy
            if n and not (lo >= 0 and lo + n <= t.region_size):
                raise ValueError(f"table {t.name}: lazy span {t.lazy} outside its region")
            lazy.append((off + lo, n))
            off = _align(off + t.region_size)
        lanes_off = off if lanes_size else 0
        total = _align(off + lanes_size)

        lockfd = flock_bounded(name, timeout)
        made: list[Callable[[], None]] = []
        try:
            _clear_stale(name)
            _check_space(name, total)
            try:
                sem = posix_ipc.Semaphore(shm_name(name), posix_ipc.O_CREX, mode=MODE,
                                          initial_value=1)
            except posix_ipc.ExistentialError:
                raise not_ours("semaphore", sem_path(name),
                               "appeared while creating the registry") from None
            made.append(lambda: unlink_quiet(os.unlink, sem_path(name)))
            made.append(sem.close)
            # The mode given to sem_open is filtered by umask, which may have taken the owner's
            # own bits (umask 277 for 027 leaves 0400): opened for neither reading nor writing,
            # and chmod-ed through its /proc link (fchmod refuses such a descriptor).
            fd = open_entry("semaphore", sem_path(name), os.O_PATH)
            try:
                os.chmod(f"/proc/self/fd/{fd}", MODE)
                sem_ino = os.fstat(fd).st_ino
            finally:
                os.close(fd)
            tmp = tmp_path(name)
            try:
                fd = open_entry("temporary segment", tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL)
            except FileExistsError:
                raise not_ours("temporary segment", tmp,
                               "appeared while creating the registry") from None
            made.append(lambda: unlink_quiet(os.unlink, tmp))
            try:
                os.fchmod(fd, MODE)
                os.ftruncate(fd, total)
                try:
                    # Back every page now but the lazy spans' (backed by their writers, see
                    # back()): a full /dev/shm fails here or there, never as SIGBUS later.
                    for lo, n in backed_spans(total, lazy):
                        os.posix_fallocate(fd, lo, n)
                except OSError as e:
                    if e.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                        raise _too_large(name, total) from e
                    raise
                ino = os.fstat(fd).st_ino
                mm = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            except BaseException:
                os.close(fd)
                raise
            made.append(mm.close)
            made.append(lambda: os.close(fd))  # until the segment owns it (popped below)
            created_at = time.time()
            struct.pack_into("<Q", mm, OFF_CONFIG, len(config))
            mm[OFF_CONFIG + 8:OFF_CONFIG + 8 + len(config)] = config
            struct.pack_into("<Q", mm, OFF_TABLE_COUNT, len(descs))
            for i, d in enumerate(descs):
                _DESC.pack_into(mm, OFF_TABLES + i * _DESC.size, d.name.encode("ascii"),
                                d.offset, d.region_size, d.capacity, d.record_size,
                                KINDS[d.kind])
            struct.pack_into("<d", mm, OFF_LAST_SWEEP, created_at)
            struct.pack_into("<QQ", mm, OFF_LANES, lanes_off, lanes_size)
            struct.pack_into("<Q", mm, OFF_PID_NS, procinfo.pid_namespace())
            _HEAD.pack_into(mm, 0, b"\0" * 8, LAYOUT_VERSION, HEADER_SIZE, total,
                            procinfo.pack_owner(*procinfo.me()), created_at, os.urandom(16),
                            sem_ino)
            mm[0:8] = MAGIC  # complete: magic last
            seg = cls(name, mm, readonly=False, ino=ino, sem=sem, fd=fd)
            made[-2:] = [seg.close]  # closes fd and mapping
            if init is not None:
                init(seg)
            try:
                os.link(tmp, segment_path(name))  # publish atomically; never follows a link
            except FileExistsError:
                raise RegistryIncompatible(
                    f"registry {name}: {segment_path(name)} appeared while creating it "
                    "(created outside shmcancel's lock?)") from None
            unlink_quiet(os.unlink, tmp)
            return seg
        except BaseException as e:
            for undo in reversed(made):
                with contextlib.suppress(Exception):  # best effort
                    undo()
            _drop_lockfile(name, lockfd)
            if isinstance(e, OSError | posix_ipc.Error):
                raise RegistryIncompatible(
                    f"registry {name}: creating it in {SHM_DIR} failed: {_describe(e)}") from e
            raise
        finally:
            os.close(lockfd)  # drops the flock

    # --- attach ---
    @classmethod
    def attach(cls, name: str, *, readonly: bool = False) -> Segment:
        """Map an existing segment after validating it; read-only mode takes no semaphore and
        never writes (for inspection)."""
        check_name(name)
        path = segment_path(name)
        try:
            fd = open_entry("segment", path, os.O_RDONLY if readonly else os.O_RDWR)
        except FileNotFoundError:
            raise RegistryNotFound(f"no registry named {name} ({path})") from None
        try:
            st = os.fstat(fd)
            check_stat("segment", path, st)
            size = st.st_size
            if size < HEADER_SIZE:
                raise RegistryIncompatible(
                    f"registry {name}: {path} is truncated ({size} bytes, smaller than its "
                    f"{HEADER_SIZE}-byte header)")
            head = os.pread(fd, _HEAD.size, 0)
            magic, version, hsize, total = struct.unpack_from("<8sQQQ", head)
            if magic != MAGIC:
                raise RegistryIncompatible(
                    f"registry {name}: {path} is not a shmcancel segment (magic {magic!r})")
            if version != LAYOUT_VERSION:
                raise RegistryIncompatible(
                    f"registry {name}: {path} has layout version {version}, this shmcancel "
                    f"speaks {LAYOUT_VERSION}")
            if hsize != HEADER_SIZE:
                raise RegistryIncompatible(
                    f"registry {name}: header size {hsize}, expected {HEADER_SIZE}")
            if total != size:
                raise RegistryIncompatible(
                    f"registry {name}: header says {total} bytes but {path} has {size}")
            if readonly:
                mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
            else:
                mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        if readonly:  # never writes, so never backs a page: no file kept
            os.close(fd)
            fd = -1
        sem = None
        try:
            _validate_header(name, mm, size)
            seg = cls(name, mm, readonly=readonly, ino=st.st_ino, sem=None, fd=fd)
        except BaseException:
            mm.close()
            if fd >= 0:
                os.close(fd)
            raise
        if readonly:
            return seg
        if procinfo.foreign(seg.pid_ns):
            seg.close()
            raise foreign_error(name, seg.pid_ns)
        try:
            sem = _open_semaphore(name, seg.sem_ino)
        except BaseException:
            seg.close()
            raise
        seg.sem = sem
        return seg


def backed_spans(total: int, lazy: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """(offset, bytes) spans of a segment of ``total`` bytes backed at create: all of it but
    the whole pages inside each of the ``lazy`` (offset, bytes) spans (sorted, disjoint)."""
    out, at = [], 0
    for lo, n in sorted(lazy):
        a, b = _align(lo), (lo + n) // PAGE * PAGE
        if b > a:
            if a > at:
                out.append((at, a - at))
            at = b
    if total > at:
        out.append((at, total - at))
    return out


def _validate_header(name: str, mm: mmap.mmap, size: int) -> None:
    """The config length and the table descriptors are within bounds (what the tables and the
    config contain is for the layers above to check)."""
    (m,) = struct.unpack_from("<Q", mm, OFF_CONFIG)
    if m > CONFIG_MAX:
        raise RegistryIncompatible(
            f"registry {name}: header says its config is {m} bytes (at most {CONFIG_MAX}): "
            "corrupt")
    (n,) = struct.unpack_from("<Q", mm, OFF_TABLE_COUNT)
    if n > MAX_TABLES:
        raise RegistryIncompatible(f"registry {name}: header names {n} tables")
    end = HEADER_SIZE
    for i in range(n):
        tname, off, rsize, _cap, _rs, kind = _DESC.unpack_from(mm, OFF_TABLES + i * _DESC.size)
        if (kind not in _KIND_NAMES or off % PAGE or off < end or off + rsize > size
                or not _TABLE_NAME.fullmatch(tname.rstrip(b"\0"))):
            raise RegistryIncompatible(
                f"registry {name}: table descriptor {i} is out of bounds or corrupt")
        end = off + rsize
    loff, lsize = struct.unpack_from("<QQ", mm, OFF_LANES)
    if lsize and (loff % PAGE or loff < end or loff + lsize > size):
        raise RegistryIncompatible(f"registry {name}: the lanes region is out of bounds")


def check_semaphore(name: str, expected_ino: int) -> os.stat_result:
    """The semaphore entry of registry ``name`` as an attach needs it (``lstat`` only: never
    opened, followed or blocked on): present, a regular file of ours, mode 0600, large enough,
    the inode ``expected_ino`` the segment header records. Else :class:`RegistryIncompatible`
    naming the path. (``shmtool list`` asks this of a registry it reads.)"""
    path = sem_path(name)
    st = check_entry("semaphore", path)
    if st is None:
        raise _missing_semaphore(name, path)
    check_stat("semaphore", path, st)
    if st.st_size < SEM_MIN_SIZE:
        raise RegistryIncompatible(
            f"registry {name}: semaphore file {path} is {st.st_size} bytes (corrupt)")
    if st.st_ino != expected_ino:
        raise _replaced_semaphore(name, path)
    return st


def peek_semaphore(name: str, expected_ino: int) -> int | None:
    """The value of registry ``name``'s semaphore read from its file, without opening it as a
    semaphore (what a read-only attach has none of): glibc's ``sem_t`` keeps the value in the
    low 32 bits of its first (little-endian) word on 64-bit Linux. ``None`` when the entry is
    not the registry's semaphore (see :func:`check_semaphore`) or cannot be read."""
    path = sem_path(name)
    try:
        check_semaphore(name, expected_ino)
        fd = open_entry("semaphore", path, os.O_RDONLY | os.O_NONBLOCK)
    except (ShmCancelError, OSError):
        return None
    try:
        if os.fstat(fd).st_ino != expected_ino:
            return None
        data = os.pread(fd, 4, 0)
    except OSError:
        return None
    finally:
        os.close(fd)
    return int.from_bytes(data, "little") if len(data) == 4 else None


def _missing_semaphore(name: str, path: str) -> RegistryIncompatible:
    return RegistryIncompatible(
        f"registry {name}: segment exists but its semaphore {path} is missing")


def _replaced_semaphore(name: str, path: str) -> RegistryIncompatible:
    return RegistryIncompatible(
        f"registry {name}: semaphore {path} is not the one created with the segment "
        "(replaced or recreated)")


def _open_semaphore(name: str, expected_ino: int) -> posix_ipc.Semaphore:
    path = sem_path(name)
    # sem_open opens the file itself (O_NOFOLLOW, but blocking): check the entry first, and its
    # inode afterwards (only its owner could have swapped a file of ours in between).
    check_semaphore(name, expected_ino)
    try:
        sem = posix_ipc.Semaphore(shm_name(name))
    except posix_ipc.ExistentialError:
        raise _missing_semaphore(name, path) from None
    except posix_ipc.Error as e:
        raise RegistryIncompatible(f"registry {name}: cannot open semaphore {path}: {e}") from None
    try:
        same = os.lstat(path).st_ino == expected_ino
    except FileNotFoundError:  # unlinked since it was opened (a registry being removed)
        sem.close()
        raise _missing_semaphore(name, path) from None
    if not same:
        sem.close()
        raise _replaced_semaphore(name, path)
    return sem


def effective_creator(creator: int, previous: int) -> tuple[int, int] | None:
    """The process a registry belongs to, from its two header words: the recorded creator
    while it lives, else the creator its adoption replaced if that one lives, else the
    recorded (dead) creator; None when none is recorded."""
    c = procinfo.unpack_owner(creator)
    if c is not None and procinfo.alive(*c):
        return c
    p = procinfo.unpack_owner(previous)
    if p is not None and procinfo.alive(*p):
        return p
    return c


class ForeignPidNamespace(RegistryIncompatible):
    """The registry was created in another pid namespace than this process's (see
    :data:`OFF_PID_NS`): whether its processes live cannot be judged from here."""


def foreign_error(name: str, pid_ns: int) -> ForeignPidNamespace:
    return ForeignPidNamespace(
        f"registry {name} was created in another pid namespace (pid:[{pid_ns}]; this process "
        f"is in pid:[{procinfo.pid_namespace()}]), where its processes cannot be told alive or "
        "gone: use it from a process of that namespace (a container sharing /dev/shm must "
        "share the server's pids too, e.g. docker --pid=container:...)")


def creator_of(name: str, *, any_owner: bool = False) -> tuple[int, int] | None:
    """The creator of registry ``name`` (pid, start time) as :func:`effective_creator` reads
    its segment header; ``None`` if the segment holds no complete shmcancel header. Never
    blocks and never follows a link: ``FileNotFoundError`` when there is no segment,
    :class:`RegistryIncompatible` when the entry is not a regular file owned by us
    (``any_owner``: or by anyone, if readable), :class:`ForeignPidNamespace` when it was
    created in another pid namespace."""
    fd = open_entry("segment", segment_path(check_name(name)), os.O_RDONLY,
                    any_owner=any_owner)
    try:
        head = os.pread(fd, OFF_PID_NS + 8, 0)
    finally:
        os.close(fd)
    if len(head) < OFF_PID_NS + 8 or head[:8] != MAGIC:
        return None
    (pid_ns,) = struct.unpack_from("<Q", head, OFF_PID_NS)
    if procinfo.foreign(pid_ns):
        raise foreign_error(name, pid_ns)
    (creator,) = struct.unpack_from("<Q", head, OFF_CREATOR)
    (previous,) = struct.unpack_from("<Q", head, OFF_PREV_CREATOR)
    return effective_creator(creator, previous)


def _clear_stale(name: str) -> None:
    """Under the creation flock: refuse a live creator's segment and any entry of the name that
    is not a regular file of ours; remove a dead creator's segment (or garbage, or a semaphore
    or temporary left without a live creation)."""
    check_entry("temporary segment", tmp_path(name))
    check_entry("semaphore", sem_path(name))
    try:
        owner = creator_of(name)
    except FileNotFoundError:
        pass
    else:
        if owner is not None and procinfo.alive(*owner):
            raise RegistryIncompatible(
                f"registry {name} is in use by live pid {owner[0]}, its creator: stop that "
                "server first, or give this one another registry name (under gunicorn: "
                "SHMCANCEL_REGISTRY)")
    # Stale (creator gone), truncated or garbage: replace.
    for path in (segment_path(name), sem_path(name), tmp_path(name)):
        unlink_quiet(os.unlink, path)


def _drop_lockfile(name: str, lockfd: int) -> None:
    """After a failed create, under its flock: remove the lock file it created, unless a
    segment of ours (a registry others may be attached to) is at the name."""
    with contextlib.suppress(ShmCancelError, OSError):
        if check_entry("segment", segment_path(name)) is not None:
            return
    drop_lockfile(name, lockfd)


def _describe(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        where = f"{e.filename}: " if e.filename else ""
        return f"{where}{e.strerror}"
    return str(e) or type(e).__name__


def _too_large(name: str, total: int) -> SegmentTooLarge:
    try:
        vfs = os.statvfs(SHM_DIR)
        free = vfs.f_bavail * vfs.f_frsize
    except OSError:  # pragma: no cover
        free = -1
    return SegmentTooLarge(
        f"registry {name} needs {total} bytes ({total / 2**20:.1f} MiB) of {SHM_DIR} but only "
        f"{free} bytes ({free / 2**20:.1f} MiB) are free: lower the capacities in Config or "
        f"enlarge {SHM_DIR} (e.g. docker --shm-size)")


def _check_space(name: str, total: int) -> None:
    """Refuse up front what cannot fit, rather than fill /dev/shm for a moment and fail."""
    try:
        vfs = os.statvfs(SHM_DIR)
    except OSError:  # pragma: no cover
        return
    if total > vfs.f_bavail * vfs.f_frsize:
        raise _too_large(name, total)
