"""A registry: one shared segment, its lock, and the tables the layers above declare.

Which tables a registry holds is not this layer's business: the layers above declare theirs
(:mod:`shmcancel.shm.schema`; the cancellation layer's in ``shmcancel/cancel/tables.py``, the MCP
sessions' in ``shmcancel/mcp/session_tables.py``) and :meth:`Registry.create` lays out every one
declared in this process, sized for its :class:`~shmcancel.config.Config`. :meth:`Registry.attach`
refuses a registry whose tables (by name, kind and size) are not exactly those. Tables are
reached by name: ``reg.table("in_flight")``.

The config is stored in the header as ``Config.pack()`` bytes and checked by ``Config.unpack`` at
attach. A row larger than its table's record raises ``RowTooLarge``.

Size classes (``layout.py``): a table declared with a small record size keeps one small record
per row it holds and ``large_count`` worst-case records, so every valid row fits as long as at
most ``large_count`` rows are larger than a small record. When a write would make one more, the
table raises ``LargeRowsFull`` (a ``TableFull``) before writing anything, and the table's owner
does what a full table does there (the declaring modules say what).
"""

from __future__ import annotations

import dataclasses
import fcntl
import logging
import os
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from ..config import Config
from ..exceptions import RegistryClosed, RegistryIncompatible, ShmCancelError
from . import procinfo
from .lanes import Lanes
from .lanes import format_region as lanes_format
from .lanes import region_size as lanes_size
from .lanes import region_table as lanes_table
from .layout import _M64, lazy_span
from .lock import RegistryLock
from .names import (
    check_name,
    lock_path,
    open_entry,
    segment_path,
    sem_path,
    unlink_names,
    unlink_quiet,
)
from .schema import TableDecl, declared
from .segment import (
    LAYOUT_VERSION,
    OFF_CREATOR,
    OFF_EVICTIONS,
    OFF_EXITING,
    OFF_LAST_SWEEP,
    OFF_LAST_SWEEPER,
    OFF_LOCK_GENERATION,
    OFF_LOCK_OWNER,
    OFF_PREV_CREATOR,
    OFF_RECOVERIES,
    OFF_SWEEPS,
    Segment,
    TableSpec,
    check_semaphore,
    effective_creator,
    peek_semaphore,
)
from .table import RegionHeaderDamaged, Table

__all__ = ["Registry", "add_repairs", "current", "lane_tables", "record_sizes", "replaced_error",
           "sweep_due",
           "table_specs", "unlink"]

log = logging.getLogger("shmcancel.registry")

ATTACH_CHECK_LOCK_TIMEOUT = 1.0  # seconds the attach-time check waits for the lock, at most


def sweep_due(last: float, now: float, interval: float) -> bool:
    """Whether a sweep is due at ``now`` after one at ``last`` (both ``time.time()``): an
    ``interval`` has passed, or the last sweep lies more than an interval ahead (the clock
    stepped back since; a smaller step delays the next sweep by less than an interval, and a
    claim whose ``now`` was read just before another's store is not taken for one)."""
    return now - last >= interval or last - now > interval


def add_repairs(into: dict[str, Counter[str]], repairs: Mapping[str, Mapping[str, int]]
                ) -> None:
    """Add each table's repair counts in ``repairs`` (:meth:`Registry.fsck`'s or
    :meth:`Registry.check`'s) to its counts in ``into``; a table that repaired nothing is left
    out."""
    for table, counts in repairs.items():
        if any(counts.values()):
            into.setdefault(table, Counter()).update(counts)


def _decls(tables: Iterable[TableDecl] | None) -> tuple[TableDecl, ...]:
    """``tables``, or every table declared in this process; ValueError on a repeated name."""
    decls = declared() if tables is None else tuple(tables)
    names = [d.name for d in decls]
    if len(set(names)) != len(names):
        raise ValueError(f"a table name repeats in {names}")
    return decls


def _lane_tables(decls: Sequence[TableDecl]) -> list[str]:
    """The tables with lanes, in the order of their lane sets in the lanes region (by name)."""
    return sorted(d.name for d in decls if d.lanes)


def lane_tables(tables: Iterable[TableDecl] | None = None) -> list[str]:
    """The tables (``tables``, default the declared ones) that have a lane set each, in the
    order of their sets in the segment's lanes region."""
    return _lane_tables(_decls(tables))


def record_sizes(config: Config | None = None,
                 tables: Iterable[TableDecl] | None = None) -> dict[str, int]:
    """Record size of each table (for ``config``, default ``Config()``; ``tables``, default the
    declared ones): what ``Table`` needs for the worst-case key + value."""
    cfg = Config() if config is None else config
    return {d.name: Table.record_size_for(d.size("max_key", cfg), d.size("max_value", cfg))
            for d in _decls(tables)}


def _specs(config: Config, decls: Sequence[TableDecl]) -> list[TableSpec]:
    """What each declared table is laid out as for ``config``: its declared classes, one class
    where the small record would not be smaller than the worst case, at most ``capacity`` large
    rows."""
    sizes = record_sizes(config, decls)
    out = []
    for d in decls:
        cap = d.size("capacity", config)
        rs = sizes[d.name]
        small, large = (d.small_size, min(d.large_count, cap)) if 0 < d.small_size < rs else (0, 0)
        lazy = (0, 0) if config.preallocate else lazy_span(cap, rs, small, large)
        out.append(TableSpec(d.name, d.kind, cap, rs, Table.region_size(cap, rs, small, large),
                             small, large, lazy))
    return out


def _backer(seg: Segment, base: int) -> Callable[[int, int], None]:
    """``Table``'s ``back``: allocate ``n`` bytes at ``off`` in the region at ``base``."""
    def back(off: int, n: int) -> None:
        seg.back(base + off, n)
    return back


def table_specs(config: Config | None = None,
                tables: Iterable[TableDecl] | None = None) -> list[TableSpec]:
    """How each table (``tables``, default the declared ones) is laid out for ``config``
    (default ``Config()``): rows, record sizes, large rows, region bytes."""
    return _specs(Config() if config is None else config, _decls(tables))


_current: Registry | None = None
# Every registry created or attached here, oldest first (weakly: an unreferenced one may go).
_opened: list[weakref.ref[Registry]] = []


def current() -> Registry | None:
    """The registry this process most recently created or attached and has not closed (when
    that one is closed, the most recent other one still open)."""
    return _current


def _forget(reg: Registry) -> None:
    """``reg`` is closed: drop it, and make the most recent registry still open current."""
    global _current
    _opened[:] = [w for w in _opened if (r := w()) is not None and r is not reg and not r.closed]
    if _current is reg or (_current is not None and _current.closed):
        _current = _opened[-1]() if _opened else None


def unlink(name: str) -> list[str]:
    """Remove whatever exists of registry ``name``'s segment, semaphore, lock file and creation
    temporaries (missing ones are fine); the paths removed. Attached processes keep their
    mapping until they close it. One :class:`ShmCancelError` naming a path that could not be
    removed (another user's, say)."""
    return unlink_names(name)


def _unlink_own(name: str, ino: int, sem_ino: int) -> None:
    """Remove ``name``'s segment and semaphore if they are still the inodes ``ino`` and
    ``sem_ino`` (never a newer registry's), then its lock file if no segment is left and
    nobody holds it (:func:`_unlink_unheld_lockfile`)."""
    def at(path: str) -> int | None:
        try:
            return os.lstat(path).st_ino
        except FileNotFoundError:
            return None

    try:
        if at(segment_path(name)) == ino:
            unlink_quiet(os.unlink, segment_path(name))
        if at(sem_path(name)) == sem_ino:
            unlink_quiet(os.unlink, sem_path(name))
        if at(segment_path(name)) is None:
            _unlink_unheld_lockfile(name)
    except OSError as e:
        raise ShmCancelError(f"registry {name}: cannot remove {e.filename}: {e.strerror}") \
            from None


def _unlink_unheld_lockfile(name: str) -> None:
    """Remove ``name``'s lock file unless a process holds its flock: a creation, or ``shmtool
    unlink`` / ``cleanup --stale`` removing the registry. Removed from under its holder, the
    next creator would make another lock file and create the registry beside the holder, and
    shmtool then remove that live registry's entries. The holder removes it or uses it. An
    entry there that is not a regular file of ours is removed as before (no creator uses it)."""
    path = lock_path(name)
    try:
        fd = open_entry("lock file", path, os.O_RDONLY)
    except FileNotFoundError:
        return
    except ShmCancelError:
        unlink_quiet(os.unlink, path)
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return  # held: its holder's
        if os.lstat(path).st_ino == os.fstat(fd).st_ino:
            unlink_quiet(os.unlink, path)
    except FileNotFoundError:
        pass
    finally:
        os.close(fd)


def replaced_error(name: str, creator: tuple[int, int] | None,
                   meant: str = "the registry this process was started on"
                   ) -> RegistryIncompatible:
    """One line: the segment now at ``name``, created by ``creator``, is another registry than
    ``meant`` (that one was unlinked under its live server, the name created again since)."""
    by = f"pid {creator[0]}" if creator is not None else "another process"
    return RegistryIncompatible(
        f"registry {name} was unlinked and created again by {by}: {segment_path(name)} is not "
        f"{meant} (unlinked under a live server, e.g. `shmtool unlink --force`); refusing to "
        "join another server's registry")


class _ReadOnlyLock:
    """The lock of a read-only registry: entering it is an error (readers never need it, a
    read-only attachment must never block on or change the segment)."""

    dirty = False
    readonly = True  # readers fall back to a best-effort unlocked read, never to this lock

    def __init__(self, seg: Segment) -> None:
        self.name = seg.name
        self._seg = seg
        self._w = seg.words

    def __enter__(self) -> object:
        if self._seg.closed:
            raise RegistryClosed.of(self.name)
        raise ShmCancelError(f"registry {self.name} is attached read-only: cannot take its lock")

    def __exit__(self, *exc: object) -> None:  # pragma: no cover - __enter__ always raises
        return None

    def stalled(self) -> bool:
        return False  # never waited for

    def _word(self, off: int) -> int:
        if self._seg.closed:
            raise RegistryClosed.of(self.name)
        return self._w[off >> 3]

    def owner(self) -> tuple[int, int] | None:
        return procinfo.unpack_owner(self._word(OFF_LOCK_OWNER))

    @property
    def generation(self) -> int:
        return self._word(OFF_LOCK_GENERATION)

    @property
    def recoveries(self) -> int:
        return self._word(OFF_RECOVERIES)

    def held_by_me(self) -> bool:
        return False

    def idle_generation(self) -> int | None:
        return None

    def recover_from(self, pid: int) -> bool:
        return False

    def exclusive(self, fn: Callable[[], object]) -> None:
        fn()  # no hold to wait for: a read-only attachment never takes the lock

    def close(self) -> None:
        pass


class Registry:
    """A created or attached registry. Use :meth:`create` / :meth:`attach`, not the constructor.

    ``close()`` unmaps (idempotent); ``unlink()`` removes the names (idempotent; only this
    registry's own segment and semaphore, never a newer one created under the same name).
    After ``close()`` whatever reads or writes the segment, here or through its tables, lanes
    and lock, raises :class:`~shmcancel.RegistryClosed`; what this object knows without the
    segment (``name``, ``config``, ``identity``, ``closed``, ``at_name()``, ``unlink()``) still
    answers. ``unlink()`` closes nothing: attached processes, this one included, keep using
    the segment until they close it.
    """

    def __init__(self, seg: Segment, decls: Sequence[TableDecl], *,
                 repair: bool = False) -> None:
        global _current
        self._seg = seg
        self._name = seg.name
        self._ino = seg.ino
        self._sem_ino = seg.sem_ino
        self._closed = False
        self._tables: dict[str, Table] = {}
        # the lanes of each table declared with them (TableDecl.lanes), by table name
        self.lanes: dict[str, Lanes] = {}
        # what the lock's repairs (a dead holder's recovery, an interrupted write's) repaired
        # since :meth:`repair` last asked, by table: ``_recovery_fsck``
        self._lock_repairs: dict[str, Counter[str]] = {}
        #: of :meth:`repair`'s last answer, the tables (and counts) the lock's recovery of a
        #: dead holder repaired as it took the lock (``shmtool fsck`` says so)
        self.recovery_repairs: dict[str, Counter[str]] = {}
        #: the repair counts of the tables :meth:`attach`'s own check repaired (empty: none)
        self.attach_repairs: dict[str, dict[str, int]] = {}
        try:
            try:
                self._config = Config.unpack(seg.config)
            except ValueError as e:
                raise RegistryIncompatible(
                    f"registry {self._name}: invalid config in header: {e}") from None
            self._check_tables(decls)
            self.lock: RegistryLock | _ReadOnlyLock = (
                _ReadOnlyLock(seg) if seg.readonly else
                RegistryLock(seg, repair=self._recovery_fsck,
                             timeout=self._config.lock_timeout))
            specs = {sp.name: sp for sp in _specs(self._config, decls)}
            for i, desc in enumerate(seg.tables):
                sp = specs[desc.name]
                try:
                    self._tables[desc.name] = Table(
                        desc.name, seg.region(i), kind=desc.kind,  # type: ignore[arg-type]
                        capacity=desc.capacity, record_size=desc.record_size,
                        hash_key=seg.hash_key, lock=self.lock,
                        small_size=sp.small_size, large_count=sp.large_count,
                        back=(None if seg.readonly or self._config.preallocate
                              else _backer(seg, desc.offset)),
                        damaged_ok=repair)
                except RegionHeaderDamaged as e:
                    raise RegionHeaderDamaged(
                        f"registry {self._name}: {e}: run `shmtool fsck {self._name}` to "
                        "rebuild it", e.table) from None
            names = _lane_tables(decls)
            region = seg.lanes_region
            size = lanes_size()
            if (0 if region is None else len(region[2])) != size * len(names):
                raise RegistryIncompatible(
                    f"registry {self._name}: the segment's lanes region is not one lane set "
                    f"for each of {', '.join(names) or 'no tables'}")
            # Each set names the descriptor of its table: declarations giving the lanes to
            # other tables (as many of them) must not read one table's rows as another's.
            index = {d.name: i for i, d in enumerate(seg.tables)}
            for i, t in enumerate(names):
                mm, off, view = region  # type: ignore[misc]
                v = view[i * size:(i + 1) * size]
                self.lanes[t] = Lanes(mm, off + i * size, v, self.lock)  # closed on a raise
                bound = lanes_table(v)
                if bound != index[t]:
                    owner = seg.tables[bound].name if 0 <= bound < len(seg.tables) else "none"
                    raise RegistryIncompatible(
                        f"registry {self._name}: lane set {i} is table {owner}'s, expected "
                        f"{t}'s (created by another version of the code?)")
        except BaseException:
            self._close_parts()
            raise
        _current = self
        _opened[:] = [w for w in _opened if w() is not None]
        _opened.append(weakref.ref(self))

    def _check_tables(self, decls: Sequence[TableDecl]) -> None:
        """The segment holds exactly the tables ``decls`` declares (by name, in any order),
        each of the declared kind and capacity, with records at least as large as declared."""
        seg = self._seg
        have = [d.name for d in seg.tables]
        want = {s.name: s for s in _specs(self._config, decls)}
        if sorted(have) != sorted(want):
            raise RegistryIncompatible(
                f"registry {self._name}: holds tables {', '.join(have) or 'none'}; expected "
                f"{', '.join(want) or 'none'} (created by another version of the code?)")
        for d in seg.tables:
            s = want[d.name]
            try:
                size: int | None = Table.region_size(d.capacity, d.record_size, s.small_size,
                                                     s.large_count)
            except ValueError:  # a record size no table can have (a garbled descriptor)
                size = None
            if (d.kind != s.kind or d.capacity != s.capacity or d.record_size < s.record_size
                    or d.region_size != size):
                raise RegistryIncompatible(
                    f"registry {self._name}: table {d.name} is {d.kind}/{d.capacity} rows/"
                    f"{d.record_size}-byte records/{d.region_size} bytes; expected {s.kind}/"
                    f"{s.capacity}/>={s.record_size}/{s.region_size}")

    # --- lifecycle ---
    @classmethod
    def create(cls, name: str, config: Config | None = None, *,
               tables: Iterable[TableDecl] | None = None) -> Registry:
        """Create registry ``name`` (replacing a stale one whose creator is gone), holding
        ``tables`` (default: every table declared in this process)."""
        check_name(name)
        config = Config() if config is None else config
        if not isinstance(config, Config):
            raise TypeError(f"config must be a shmcancel.Config, got {type(config).__name__}")
        decls = _decls(tables)
        specs = _specs(config, decls)

        def init(seg: Segment) -> None:
            for i, s in enumerate(specs):
                region = seg.region(i)
                Table.format(region, s.capacity, s.record_size, s.small_size, s.large_count)
            lanes = seg.lanes_region
            size = lanes_size()
            index = {s.name: i for i, s in enumerate(specs)}  # descriptors are in spec order
            for i, t in enumerate(lane_names):
                assert lanes is not None
                with lanes[2][i * size:(i + 1) * size] as v:
                    lanes_format(v, index[t])

        lane_names = _lane_tables(decls)
        seg = Segment.create(name, config.pack(), specs, init=init, timeout=config.lock_timeout,
                             lanes_size=lanes_size() * len(lane_names))
        try:
            return cls(seg, decls)
        except BaseException:
            # Nobody else can have attached to what this process just made and failed to open.
            _unlink_own(name, seg.ino, seg.sem_ino)
            raise

    @classmethod
    def attach(cls, name: str, *, readonly: bool = False,
               tables: Iterable[TableDecl] | None = None,
               expect: tuple[int, bytes] | None = None, repair: bool = False) -> Registry:
        """Attach to registry ``name``; its config is read from the segment header. It must
        hold exactly ``tables`` (default: every table declared in this process), else
        :class:`RegistryIncompatible`. ``readonly``: map it read-only, take no lock (for
        inspection). A writable attachment checks the tables' header counters first
        (:meth:`check`). ``expect``: the :attr:`identity` of the registry the caller means
        (a gunicorn worker: its master's); a registry created again at the name since (the
        one meant was unlinked) is refused with :class:`RegistryIncompatible` before anything
        in it is read beyond its header or written. ``repair`` (writable only): accept tables
        whose region header is damaged (else :class:`RegionHeaderDamaged`) and skip the check
        on attach, for the caller to :meth:`repair` at once (``shmtool fsck``)."""
        if repair and readonly:
            raise ValueError("a read-only attachment repairs nothing")
        decls = _decls(tables)
        seg = Segment.attach(name, readonly=readonly)
        if expect is not None and (seg.ino, seg.hash_key) != tuple(expect):
            err = replaced_error(name, seg.creator)
            seg.close()
            raise err
        reg = cls(seg, decls, repair=repair)
        if repair:
            return reg
        try:
            reg._check_on_attach()
        except BaseException:
            reg.close()
            raise
        return reg

    def _check_on_attach(self) -> None:
        """:meth:`check` (not deep), never failing the attach and waiting at most
        ATTACH_CHECK_LOCK_TIMEOUT for the lock (it takes it only to repair): a lock held longer
        (or any other error of ours) leaves the counters to the janitor's next sweep. What it
        repaired goes to :attr:`attach_repairs` (``shmtool cleanup`` prints it)."""
        if not self.readonly:
            def check() -> None:
                self.attach_repairs = self.check(deep=False)
            self._briefly(check, "counter check on attach skipped")

    def _briefly(self, fn: Callable[[], object], failed: str) -> None:
        """``fn()`` under a lock timeout of at most ATTACH_CHECK_LOCK_TIMEOUT (for work that may
        be left to others); a ShmCancelError it raises is logged as ``failed``, not raised."""
        lock = self.lock
        if not isinstance(lock, RegistryLock):
            return
        saved = lock.timeout
        lock.timeout = min(saved, ATTACH_CHECK_LOCK_TIMEOUT)
        try:
            fn()
        except ShmCancelError as e:
            log.warning("registry %s: %s: %s", self._name, failed, e)
        finally:
            lock.timeout = saved

    def _close_parts(self) -> None:
        for t in self._tables.values():
            t.close()
        for lanes in self.lanes.values():
            lanes.close()
        lock = getattr(self, "lock", None)
        if lock is not None:
            lock.close()
        self._seg.close()

    def _check_open(self) -> None:
        """Raise :class:`RegistryClosed` when this registry was closed (for the methods that
        read the header: none of them is on a request's path)."""
        if self._closed:
            raise RegistryClosed.of(self._name)

    def close(self) -> None:
        """Unmap the segment and close the semaphore and file descriptors. Idempotent. What used the
        registry since raises :class:`RegistryClosed` (see the class docstring).

        A hold of the lock by another thread of this process (a janitor's sweep, a request
        of a threaded worker) is never cut short: ``close()`` first waits for it to end, up to
        the registry's ``lock_timeout`` (its holder's release still uses the mapping and the
        semaphore; closed under it, the lock stayed taken for every process as long as this
        one lived). Once the close runs no new hold begins in this process; threads that then
        take the lock get :class:`RegistryClosed`. If the hold is still running at the
        deadline, :class:`~shmcancel.LockTimeout` is raised and nothing is closed: the
        registry stays open and usable, and ``close()`` may be called again. Called by a thread
        inside its own hold of the lock (``with reg.lock: reg.close()``), it raises
        :class:`~shmcancel.ShmCancelError` at once and closes nothing. Holds through another
        attachment of the same registry in this process count too (they share the lock's
        per-process state)."""
        if not self._closed:
            self.lock.exclusive(self._close_now)

    def _close_now(self) -> None:
        """:meth:`close`, with no hold of this process running (``RegistryLock.exclusive``)."""
        if self._closed:  # another thread closed it while this one waited
            return
        self._closed = True
        try:
            _forget(self)
            for lanes in self.lanes.values():
                # Briefly: a lane left claimed is freed by whoever needs it once this process
                # exits. The lock is taken reentrantly: exclusive() holds the thread lock.
                self._briefly(lanes.release, "releasing this process's lane")
        finally:  # closed, whatever a signal handler raised meanwhile
            self._close_parts()

    def unlink(self) -> None:
        """Remove this registry's names from /dev/shm. Idempotent."""
        _unlink_own(self._name, self._ino, self._sem_ino)

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("read-only" if self.readonly else "attached")
        return f"<Registry {self._name} {state}>"

    # --- properties ---
    @property
    def name(self) -> str:
        return self._name

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def readonly(self) -> bool:
        return self._seg.readonly

    @property
    def config(self) -> Config:
        return self._config

    @property
    def hash_key(self) -> bytes:
        return self._seg.hash_key

    @property
    def created_at(self) -> float:
        return self._seg.created_at

    @property
    def foreign(self) -> bool:
        """Created in another pid namespace than this process's (only a read-only attach gets
        one): no pid read from it can be told alive or gone here."""
        return procinfo.foreign(self._seg.pid_ns)

    def alive(self, pid: int, start: int) -> bool | None:
        """:func:`procinfo.alive` of a process recorded in this registry; ``None`` (unknown)
        when the registry is :attr:`foreign`."""
        return None if self.foreign else procinfo.alive(pid, start)

    @property
    def creator(self) -> tuple[int, int]:
        self._check_open()
        c = self._seg.creator
        assert c is not None
        return c

    @property
    def identity(self) -> tuple[int, bytes]:
        """What tells this registry from another created later under the same name (after
        this one was unlinked): its segment's inode and the random hash key of its header.
        Pass it to :meth:`attach` as ``expect``."""
        return self._ino, self._seg.hash_key

    def short_by(self) -> int:
        """How many bytes of the segment its file lacks now: 0 while intact (or not known, on a
        read-only attachment). Not 0 after a ``truncate`` behind the server's back, when every
        touch of a page past the file's end is a SIGBUS: a process that must survive such a
        registry (gunicorn's master) asks before it touches the mapping."""
        return self._seg.short_by()

    def at_name(self) -> bool:
        """True while this registry's segment is the one at its name (not unlinked, nor
        replaced by a registry created again under the name)."""
        try:
            return os.lstat(segment_path(self._name)).st_ino == self._ino
        except OSError:
            return False

    def belongs_to(self, pid: int, start: int | None) -> bool:
        """True when the header records process ``(pid, start)`` as this registry's creator,
        or as the creator an adoption replaced (:meth:`adopt`): a registry that process made
        or took over, not one created again under the name by another process. ``start``
        ``None``: a process that has exited (its start time can no longer be read), matched
        by its pid alone."""
        self._check_open()
        words = (self._seg.u64(OFF_CREATOR), self._seg.u64(OFF_PREV_CREATOR))
        if start is not None:
            return procinfo.pack_owner(pid, start) in words
        return any((o := procinfo.unpack_owner(w)) is not None and o[0] == pid for w in words)

    def adopt(self) -> None:
        """Record the calling process as the registry's creator.

        ``create`` replaces a registry only when its creator is gone; a process that takes over
        a live registry from its creator (the new master of a gunicorn ``USR2`` upgrade, or the
        old one when the upgrade failed) adopts it so that the registry is not taken for stale
        once the recorded creator has exited. The process the registry belongs to until now is
        kept beside it: the registry stays in use while that one lives (a rolled-back upgrade:
        the new master gone, the old one serving). That is the recorded creator while it lives,
        else the one kept beside it if that one lives (after an upgrade that adopted and died,
        the old master is still the owner: a second upgrade must not forget it). Two aligned
        8-byte stores: no lock, so a gunicorn master never waits on a worker that holds it.
        """
        self._check_open()
        if self.readonly:
            raise ShmCancelError(f"registry {self.name} is attached read-only: cannot adopt")
        me = procinfo.pack_owner(*procinfo.me())
        creator, previous = self._seg.u64(OFF_CREATOR), self._seg.u64(OFF_PREV_CREATOR)
        owner = effective_creator(creator, previous)
        replaced = creator if owner is None else procinfo.pack_owner(*owner)
        if replaced != me:
            # first: a crash between the two stores leaves the old creator recorded, still valid
            self._seg.set_u64(OFF_PREV_CREATOR, replaced)
        self._seg.set_u64(OFF_CREATOR, me)

    def begin_exit(self) -> tuple[int, int] | None:
        """Record the calling process as the last owner to begin its exit, under the lock, and
        return the one recorded before it if that process still lives (pid, start time), else
        None. Of two owners that leave the registry to each other (the masters of a gunicorn
        ``USR2`` upgrade, stopped together: each sees the other alive), the later to call
        learns that the other has begun its exit too, and is the one to unlink. LockTimeout
        when a live holder keeps the lock past its timeout (nothing recorded)."""
        self._check_open()
        if self.readonly:
            raise ShmCancelError(f"registry {self.name} is attached read-only: cannot mark an "
                                 "exit")
        me = procinfo.me()
        with self.lock:
            before = procinfo.unpack_owner(self._seg.u64(OFF_EXITING))
            self._seg.set_u64(OFF_EXITING, procinfo.pack_owner(*me))
        if before is None or before == me or not procinfo.alive(*before):
            return None
        return before

    def table(self, name: str) -> Table:
        """The table called ``name`` (KeyError naming the tables there are, if none)."""
        self._check_open()
        try:
            return self._tables[name]
        except KeyError:
            raise KeyError(f"registry {self._name} has no table {name!r} (it has "
                           f"{', '.join(self._tables) or 'none'})") from None

    @property
    def tables(self) -> dict[str, Table]:
        """Every table, by name, in segment order."""
        self._check_open()
        return dict(self._tables)

    # --- header counters ---
    @property
    def recoveries(self) -> int:
        self._check_open()
        return self._seg.u64(OFF_RECOVERIES)

    @property
    def evictions(self) -> int:
        self._check_open()
        return self._seg.u64(OFF_EVICTIONS)

    def add_evictions(self, n: int, base: int | None = None) -> None:
        """Count ``n`` evicted rows (takes the lock; reentrant inside a held one): the counter
        becomes ``base + n``, ``base`` being the counter as the caller read it in the same hold
        (so that a store run again after an exception cut it short counts once), by default
        its value now."""
        self._check_open()
        with self.lock:
            self._seg.set_u64(OFF_EVICTIONS,
                              ((self._seg.u64(OFF_EVICTIONS) if base is None else base) + n) & _M64)

    @property
    def last_sweep(self) -> float:
        self._check_open()
        return self._seg.f64(OFF_LAST_SWEEP)

    def claim_sweep(self, now: float, interval: float) -> bool:
        """True for exactly one caller per ``interval`` seconds (``now`` on ``time.time()``'s
        scale): that caller sweeps. The first claim succeeds one interval after creation.
        Costs one load when it is not time yet. A last sweep more than an interval ahead of
        ``now`` is due too: the clock stepped back (NTP, a restored VM), and waiting for it to
        catch up would stop the sweeps for as long as the step (:func:`sweep_due`)."""
        self._check_open()
        seg = self._seg
        if seg.readonly or not sweep_due(seg.f64(OFF_LAST_SWEEP), now, interval):
            return False
        with self.lock:
            if not sweep_due(seg.f64(OFF_LAST_SWEEP), now, interval):
                return False
            seg.set_f64(OFF_LAST_SWEEP, now)
            seg.set_u64(OFF_SWEEPS, (seg.u64(OFF_SWEEPS) + 1) & _M64)
            seg.set_u64(OFF_LAST_SWEEPER, procinfo.pack_owner(*procinfo.me()))
            return True

    # --- repair and stats ---
    def check(self, deep: bool = True) -> dict[str, dict[str, int]]:
        """Check every table's header counters (row count, free-stack top, stamp) and free
        stack for plausibility against its index (``deep``: also every row's record and hash,
        see ``Table.check``), and repair (fsck, logged once per process and table) the tables
        where they are not: what the janitor's sweep calls (deep) and ``Registry.attach`` (not
        deep). Lock-free while all is plausible. Returns the repair counts of the tables
        repaired (empty: nothing was wrong). A read-only registry: {}."""
        self._check_open()
        if self.readonly:
            return {}
        out = {}
        for n, t in self._tables.items():
            rep = t.check(deep)
            if rep is not None:
                out[n] = rep
        return out

    def fsck(self) -> dict[str, dict[str, int]]:
        """Check and repair every table (the caller holds the lock): the lock's repair callback.
        Returns each table's repair counts (all zero when nothing was wrong)."""
        self._check_open()
        return {n: t.fsck() for n, t in self._tables.items()}

    def _recovery_fsck(self) -> None:
        """The lock's repair callback: :meth:`fsck`, its counts kept for :meth:`repair`."""
        add_repairs(self._lock_repairs, self.fsck())

    def repair(self) -> dict[str, Counter[str]]:
        """Take the lock and :meth:`fsck` every table (``shmtool fsck``); a kill in between
        leaves the repair to the lock's recovery (``dirty`` is set throughout). Returns the
        repair counts of the tables repaired (empty: nothing was wrong), including what the
        lock's recovery of a dead holder repaired as this call took the lock (a killed
        ``fsck``'s, say: that fsck then finds it done); those are also in
        :attr:`recovery_repairs`."""
        self._check_open()
        if self.readonly:
            raise ValueError("a read-only attachment repairs nothing")
        lock = self.lock
        self._lock_repairs = {}
        with lock:
            recovered, self._lock_repairs = self._lock_repairs, {}
            lock.dirty = True
            rep = self.fsck()
            lock.dirty = False
        self.recovery_repairs = recovered
        out: dict[str, Counter[str]] = {}
        add_repairs(out, recovered)
        add_repairs(out, rep)
        return out

    def attach_problems(self) -> dict[str, str]:
        """Why a writable :meth:`attach` would refuse this registry's semaphore now, by path
        (empty: it would not): missing, replaced, a FIFO, a link or another user's. The lock
        file is not one: only creators and ``shmtool unlink``/``cleanup`` open it (the lock's
        recovery flocks the segment's own file). ``lstat`` only: never opens, follows or
        blocks on it (for a read-only attachment: ``shmtool list``)."""
        out = {}
        try:
            check_semaphore(self._name, self._sem_ino)
        except RegistryIncompatible as e:
            out[sem_path(self._name)] = str(e)
        return out

    def _allocated(self) -> int | None:
        """Bytes of the segment /dev/shm has allocated (its large records' pages come as rows
        need them, ``shm/layout.py``); None when its name no longer holds this segment."""
        try:
            st = os.stat(segment_path(self._name))
        except OSError:
            return None
        return st.st_blocks * 512 if st.st_ino == self._seg.ino else None

    def info(self) -> dict[str, Any]:
        """The header, for ``shmtool stats``."""
        self._check_open()
        seg = self._seg
        creator = seg.creator
        owner = self.lock.owner()
        sweeper = procinfo.unpack_owner(seg.u64(OFF_LAST_SWEEPER))
        sem_value = None
        if seg.sem is not None:
            try:
                sem_value = seg.sem.value
            except Exception:  # pragma: no cover
                sem_value = None
        else:  # read-only (shmtool): from the file, so a unit taken unrecorded shows
            sem_value = peek_semaphore(self._name, seg.sem_ino)
        return {
            "name": self._name,
            "path": segment_path(self._name),
            "layout_version": LAYOUT_VERSION,
            "total_size": seg.total_size,
            "allocated": self._allocated(),
            "created_at": seg.created_at,
            "creator_pid": creator[0] if creator else None,
            "creator_alive": self.alive(*creator) if creator else False,
            "config": dataclasses.asdict(self._config),
            "lock_owner_pid": owner[0] if owner else None,
            "lock_owner_alive": self.alive(*owner) if owner else False,
            "lock_generation": seg.u64(OFF_LOCK_GENERATION),
            "semaphore_value": sem_value,
            "recoveries": self.recoveries,
            "evictions": self.evictions,
            "last_sweep": self.last_sweep,
            "sweeps": seg.u64(OFF_SWEEPS),
            "last_sweeper_pid": sweeper[0] if sweeper else None,
            "tables": [
                {"name": d.name, "kind": d.kind, "capacity": d.capacity,
                 "record_size": d.record_size, "small_size": t.small_size,
                 "large_count": t.large_count, "offset": d.offset, "region_size": d.region_size}
                for d, t in zip(seg.tables, self._tables.values(), strict=True)
            ],
        }
