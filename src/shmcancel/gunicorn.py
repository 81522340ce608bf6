"""gunicorn server hooks: the master owns the registry, workers attach, the master cleans up after
dead workers (contract §6.4).

Use in a ``gunicorn.conf.py``::

    from shmcancel.gunicorn import child_exit, on_exit, post_fork, when_ready  # noqa: F401

    import shmcancel, shmcancel.gunicorn
    shmcancel.gunicorn.configure(config=shmcancel.Config(ttl=120))   # optional

A hook of your own with the same name must call ours. gunicorn reads only the settings it knows
from a config file, hence :func:`configure`; the hooks keep their state in this module, which
survives the re-reading of the file on ``HUP``.

- ``when_ready`` (master): creates the registry (name: :func:`registry_name`), or under a ``USR2``
  upgrade attaches to the old master's (only if its header records that master as creator or
  adopter) and adopts it. Any failure stops gunicorn with one line.
  Starts no thread: the master forks.
- ``post_fork`` (worker): keeps a stop signal that arrives while the worker boots
  (:func:`_keep_stop_signals`), attaches to its master's registry (the very one: by name, then
  checked against the identity the master remembered; a registry unlinked under the master and
  created again under the name by another process is refused, and the worker does not boot),
  starts the worker's :class:`~shmcancel.cancel.janitor.Janitor`.
- ``child_exit`` (master): recovers the lock from the dead worker, removes its in-flight rows,
  with SIGCHLD blocked (the hook runs inside the SIGCHLD handler on gunicorn ≤ 24); gives up after
  ``LOCK_BUSY_WAIT`` when a live worker holds the lock. Never raises into gunicorn.
- ``on_exit`` (master): unlinks the registry unless another master (``USR2``) still uses it
  and has not begun its own exit (both stopped at once: the later one unlinks);
  only its own segment and semaphore (by inode), never a registry created again under the name.

The traps behind each of these: docs/design.md, "gunicorn traps".
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import logging
import os
import re
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import posix_ipc

from .cancel.janitor import Janitor
from .cancel.policy import Cancellation
from .config import Config
from .exceptions import LockTimeout, RegistryNotFound, ShmCancelError
from .shm import procinfo
from .shm.lock import RegistryLock
from .shm.registry import Registry, replaced_error

__all__ = ["child_exit", "configure", "on_exit", "post_fork", "registry", "registry_name",
           "when_ready"]

ENV_NAME = "SHMCANCEL_REGISTRY"
ENV_REDIS_URL = "SHMCANCEL_REDIS_URL"  # set: each worker starts a cross-host bridge (redis/)
# A master's registry name, in the environment its USR2 re-exec gets (put there by when_ready):
# the new master reads the config again, and a name derived from an edited one (another
# proc_name) would be another registry, splitting the server in two.
ENV_UPGRADED_FROM = "SHMCANCEL_GUNICORN_REGISTRY"
LOCK_BUSY_WAIT = 0.1  # seconds child_exit waits for a live lock holder before deferring
# The master's own wait for the registry lock (workers keep Config.lock_timeout): long enough to
# recover a dead holder (0.1-0.3 s), short enough never to stall the master on a live one.
MASTER_LOCK_TIMEOUT = 1.0
_log = logging.getLogger("shmcancel.gunicorn")


@dataclass
class _State:
    config: Config | None = None
    name: str | None = None  # from configure()
    registry: Registry | None = None  # the Registry this process uses (created, or attached)
    registry_name: str | None = None
    # The master's registry's identity (Registry.identity), inherited by its workers over fork:
    # a worker attaches by name and must find that very registry there, not one created again
    # under the name by another process after the master's was unlinked.
    identity: tuple[int, bytes] | None = None
    owner_pid: int = 0  # the process that set `registry` (a forked worker sees its master's)
    cancellation: Any = None  # the master's Cancellation over `registry`, for child_exit
    deferred: bool = False  # child_exit skipped a reap (lock busy): the next one reaps all
    janitor: Any = None  # a worker's Janitor thread (never the master's)
    # A worker's own gunicorn Worker: mcp/stop.py reads its graceful_timeout, threads and open
    # connections when a stuck tool's worker is to retire
    worker: Any = None


_state = _State()


def configure(config: Config | None = None, *, name: str | None = None) -> None:
    """Set the :class:`~shmcancel.Config` a new registry is created with, and optionally its name
    (``SHMCANCEL_REGISTRY`` still wins). Call it from ``gunicorn.conf.py``. It affects only a
    registry not created yet: after a ``HUP`` reload or under a ``USR2`` upgrade, the live
    registry keeps the config it was created with (every attached process reads it from the
    segment's header)."""
    if config is not None and not isinstance(config, Config):
        raise TypeError(f"config must be a shmcancel.Config, got {type(config).__name__}")
    _state.config = config
    _state.name = name


def registry() -> Registry | None:
    """The registry this process set up through these hooks (``None`` before)."""
    return _state.registry if _state.owner_pid == os.getpid() else None


def registry_name(server: Any) -> str:
    """The registry name for a gunicorn arbiter: ``SHMCANCEL_REGISTRY``, else the name given to
    :func:`configure`, else ``"gunicorn-<proc_name>-<digest>"`` where the digest covers
    ``proc_name`` and the bound addresses (``server.LISTENERS``; the configured ``bind`` before
    they exist). A ``USR2`` master takes its old master's name, whatever the config it read
    again says now: the upgrade joins the live registry."""
    upgraded_from = (os.environ.get(ENV_UPGRADED_FROM)
                     if int(getattr(server, "master_pid", 0) or 0) else None)
    explicit = upgraded_from or os.environ.get(ENV_NAME) or _state.name
    if explicit:
        return explicit
    proc = str(server.cfg.proc_name or "gunicorn")
    addrs = sorted(str(lnr) for lnr in getattr(server, "LISTENERS", ()) or ())
    if not addrs:
        addrs = sorted(str(a) for a in server.cfg.address)
    digest = hashlib.blake2b("\0".join([proc, *addrs]).encode(), digest_size=5).hexdigest()
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", proc).strip("_.-")[:32] or "app"
    return f"gunicorn-{slug}-{digest}"


@contextlib.contextmanager
def _sigchld_blocked() -> Iterator[None]:
    """Hold SIGCHLD back (it stays pending) while the master works on the registry.

    ``pthread_sigmask`` runs any Python handler already tripped before it returns, so nothing
    of SIGCHLD runs inside the block; the pending signal is handled when the mask is restored.
    A handler can raise from that call (gunicorn <= 24 raises ``HaltServer`` from its SIGCHLD
    handler) after the mask changed: the mask is then restored before the exception goes on.
    """
    old = signal.pthread_sigmask(signal.SIG_BLOCK, ())  # changes nothing: reads the mask
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _running(pid: int) -> bool:
    """True while ``pid`` is a live process (a zombie is not)."""
    if pid <= 0:
        return False
    try:
        start = procinfo.start_time(pid)
    except OSError:  # cannot tell (out of descriptors): running, as alive() answers then
        return True
    return start is not None and procinfo.alive(pid, start)


def _one_line(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        return f"{e.filename}: {e.strerror}" if e.filename else e.strerror
    return " ".join(str(e).split()) or type(e).__name__


def _logger(server: Any) -> Any:
    return getattr(server, "log", None) or _log


# --- hooks ---------------------------------------------------------------------------------


def when_ready(server: Any) -> None:
    """Master: create the registry (or, under a ``USR2`` upgrade, attach to the live one)."""
    if registry() is not None:
        return
    if os.environ.get(ENV_REDIS_URL):
        try:  # else every worker would fail to boot on it, with a traceback each
            import redis  # noqa: F401
        except ImportError as e:
            raise RuntimeError(f"shmcancel: {ENV_REDIS_URL} is set but the redis package "
                               f"cannot be imported ({e}): pip install 'shmcancel[redis]'") \
                from None
    name = registry_name(server)
    log = _logger(server)
    with _sigchld_blocked():
        try:
            reg = None
            parent = int(getattr(server, "master_pid", 0) or 0)
            if parent:  # a USR2 upgrade: the old master may have exited already
                try:
                    reg = _attach_parents(name, parent)
                except RegistryNotFound:
                    reg = None
                if reg is not None:
                    reg.adopt()  # so that the registry outlives the old master's record
                    log.info("shmcancel: attached to registry %r of master %s (USR2 upgrade)",
                             name, parent)
            if reg is None:
                reg = Registry.create(name, config=_state.config)
                log.info("shmcancel: created registry %r", name)
        except (ShmCancelError, OSError, posix_ipc.Error) as e:
            # gunicorn prints a RuntimeError from the arbiter as one line and exits 1. Our
            # errors name the path and what to do; anything else still gets one line.
            raise RuntimeError(f"shmcancel: registry {name}: {_one_line(e)}"
                               if not isinstance(e, ShmCancelError)
                               else f"shmcancel: {_one_line(e)}") from e
    if isinstance(reg.lock, RegistryLock):
        reg.lock.timeout = min(reg.lock.timeout, MASTER_LOCK_TIMEOUT)
    _state.registry, _state.registry_name, _state.owner_pid = reg, name, os.getpid()
    _pass_name_to_upgrades(server, name)
    _state.identity = reg.identity
    atexit.register(_exit_fallback, server, os.getpid())


def _exit_fallback(server: Any, master: int) -> None:
    """At the master's interpreter exit: :func:`on_exit`, when gunicorn never called it. Its
    arbiter skips the hook when it ends by an exception: an error in its main loop (a hook's,
    say) exits -1 without it, and several workers failing to boot together raise ``HaltServer``
    a second time inside ``halt()``, before the hook. The registry would stay in ``/dev/shm``.
    A no-op once ``on_exit`` ran, and in every other process (workers inherit the registration
    over fork, and their registry is their own attachment: only the master unlinks)."""
    if os.getpid() == master and registry() is not None:
        on_exit(server)


def _pass_name_to_upgrades(server: Any, name: str) -> None:
    """Make ``name`` the registry name of this master's ``USR2`` upgrades (:func:`registry_name`).
    gunicorn re-executes with ``cfg.env_orig``, the environment read when the config was loaded
    (at start, again at each ``HUP``): both it and ``os.environ`` get it."""
    os.environ[ENV_UPGRADED_FROM] = name
    env = getattr(getattr(server, "cfg", None), "env_orig", None)
    if isinstance(env, dict):
        env[ENV_UPGRADED_FROM] = name


def _attach_parents(name: str, parent: int) -> Registry | None:
    """A ``USR2`` master: attach to the registry of the old master ``parent``. The one now at the
    name must be the one ``parent`` created or adopted: when that was unlinked and another
    process created a registry of the name since, RegistryIncompatible (never adopt another
    server's registry). The check reads the header read-only, before anything is written.
    The old master may have exited already (stopped before this one was ready: it left the
    registry to it): then the registry it recorded (by pid) is joined all the same, and
    ``None`` means the name holds no registry of its, to create as a fresh start would."""
    start = procinfo.start_time(parent)  # None: the old master has exited
    with Registry.attach(name, readonly=True) as ro:
        # Matched by pid alone: recorded with another start time than the pid's process now,
        # the old master has exited and its pid was reused, joined as when it is free.
        if not ro.belongs_to(parent, None):
            if start is None:
                return None
            raise replaced_error(name, ro.creator,
                                 f"the registry of master {parent} this USR2 upgrade comes from")
        ident = ro.identity
    return Registry.attach(name, expect=ident)


def post_fork(server: Any, worker: Any) -> None:
    """Worker: attach to the master's registry (sets ``shmcancel.shm.registry.current()``)."""
    _keep_stop_signals(worker)
    _state.worker = worker
    name = _state.registry_name
    if name is None:
        raise RuntimeError("shmcancel: the master made no registry; add shmcancel.gunicorn's "
                           "when_ready hook to the gunicorn config")
    inherited, _state.registry, _state.cancellation = _state.registry, None, None
    if inherited is not None:
        inherited.close()  # the master's mapping, as copied by fork: this process's to drop
    # The master's registry, not whatever is at the name now: when it was unlinked under the
    # live master (`shmtool unlink --force`) this fails to boot, with RegistryNotFound if the
    # name is free, with RegistryIncompatible if another process has created a registry of the
    # name since (joining it would split the server in two, and its sessions would land in the
    # other server's tables).
    _state.registry = Registry.attach(name, expect=_state.identity)
    _state.owner_pid = os.getpid()
    # Sweeps go on while the server is idle; the master never gets a thread (it forks).
    _state.janitor = Janitor(Cancellation(_state.registry))
    _state.janitor.start()
    url = os.environ.get(ENV_REDIS_URL)
    if url:  # the worker's bridge thread; the master never starts one (it forks)
        from .redis import start_from_env
        start_from_env(_state.registry, url)


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT)


def _keep_stop_signals(worker: Any) -> None:
    """Until the worker installs its own handlers, make a stop signal stop it once booted.

    gunicorn installs a worker's handlers (``init_signals``) only after ``post_fork`` and its
    own set-up; until then the worker runs the master's handlers, inherited by ``fork``, which
    merely queue the signal in the worker's copy of the arbiter, where nothing reads it. A
    ``SIGTERM`` from the master in that window (it stops right after spawning, say) is lost:
    the worker boots and serves on, and the stopping master waits ``graceful_timeout`` before
    it kills it. Attaching to the registry and starting the janitor widen that window from
    microseconds to milliseconds, so the worker gets handlers that do what gunicorn's would do
    to a worker not serving yet: ``worker.alive = False``, which gunicorn's ``init_signals``
    leaves as it is and every worker's run loop checks first.
    """

    def stop(signum: int, frame: Any) -> None:
        worker.alive = False

    for s in _STOP_SIGNALS:
        signal.signal(s, stop)


def child_exit(server: Any, worker: Any) -> None:
    """Master: a worker is gone; take over the lock if it held it, drop its in-flight rows and
    free its lanes (of every table: ``_reap``)."""
    reg = registry()
    if reg is None:
        return
    pid = int(worker.pid)
    log = _logger(server)
    if _truncated(reg, log):
        return
    try:
        with _sigchld_blocked():
            recovered = reg.lock.recover_from(pid)
            if _lock_busy(reg):
                # A live worker holds the lock (stopped, or very slow): do not let it stall the
                # master. The rows are removed at the next worker exit or by the janitor.
                _state.deferred = True
                log.warning("shmcancel: registry lock busy; in-flight rows of worker %s left "
                            "for later", pid)
                removed = 0
            else:
                removed = _reap(reg, None if _state.deferred else pid)
                _state.deferred = False
            readopted = _readopt(reg)
    except LockTimeout:
        # A live worker took the lock between _lock_busy and the reap: leave the rows for later.
        _state.deferred = True
        log.warning("shmcancel: registry lock busy; in-flight rows of worker %s left for later",
                    pid)
        return
    except Exception:
        log.exception("shmcancel: cleaning up after worker %s failed", pid)
        return
    if readopted:
        log.info("shmcancel: registry %r adopted again (its recorded master has exited)",
                 _state.registry_name)
    if recovered:
        log.warning("shmcancel: worker %s died holding the registry lock; recovered it", pid)
    if removed:
        log.info("shmcancel: worker %s exited with %d request(s) in flight; rows removed",
                 pid, removed)


def _lock_busy(reg: Any, wait: float = LOCK_BUSY_WAIT) -> bool:
    """True when a live process holds the registry lock for longer than ``wait`` seconds
    (holders normally keep it for microseconds)."""
    deadline = time.monotonic() + wait
    while True:
        owner = reg.lock.owner()
        if owner is None or not procinfo.alive(*owner):
            return False
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.005)


def _readopt(reg: Any) -> bool:
    """Record this master as the registry's creator again if the recorded one is dead: after a
    failed ``USR2`` upgrade (the new master adopted the registry, then died; gunicorn reaps it
    without a hook) the registry would otherwise look stale to any later ``create``."""
    c = reg.creator
    if c[0] == os.getpid() or procinfo.alive(*c):
        return False
    reg.adopt()
    return True


def _reap(reg: Any, pid: int | None) -> int:
    """Remove the in-flight rows of ``pid`` (every dead owner's when ``None``) if its process is
    gone (a live reuse of the pid keeps its rows), and free its lanes of every table (a 2025-wire
    call's session row too: else its lane stays claimed until another process needs one).
    Returns the in-flight rows removed."""
    if _state.cancellation is None or _state.cancellation.registry is not reg:
        _state.cancellation = Cancellation(reg)
    removed = _state.cancellation.reap(pid)
    for lanes in reg.lanes.values():
        lanes.reap(pid)
    return removed


def _truncated(reg: Any, log: Any) -> bool:
    """Whether the registry's file was truncated under the server (logged): then the master
    touches none of its mapping, whose pages past the file's end would kill it with SIGBUS
    (its workers die of it already, and a worker started now fails to attach: gunicorn stops,
    with the error in its log)."""
    short = reg.short_by()
    if short:
        log.error("shmcancel: registry %r: its file in /dev/shm was truncated under the server "
                  "(%d bytes short): the server cannot go on with it; restart it",
                  _state.registry_name, short)
    return bool(short)


def on_exit(server: Any) -> None:
    """Master: unlink the registry unless another master (a ``USR2`` peer) still uses it."""
    reg = registry()
    if reg is None:
        return
    log = _logger(server)
    peers = [p for p in (int(getattr(server, "reexec_pid", 0) or 0),
                         int(getattr(server, "master_pid", 0) or 0)) if _running(p)]
    if _truncated(reg, log):  # its names only (no lock, no close: both touch the mapping)
        if not peers:
            with contextlib.suppress(Exception):
                reg.unlink()
        _state.registry = None
        return
    try:
        with _sigchld_blocked():
            if peers:  # a peer stopped at the same time leaves it to us too: the later unlinks
                try:
                    leaving = reg.begin_exit()
                except LockTimeout:
                    leaving = None
                # looked at again: a peer that marked its exit and is gone by now marked it
                # before ours, and so left the registry to us
                peers = [p for p in peers
                         if (leaving is None or p != leaving[0]) and _running(p)]
            if peers:
                log.info("shmcancel: registry %r left to master %s", _state.registry_name,
                         peers[0])
            else:
                # Only this registry's own inodes go: when it was unlinked under this master,
                # a registry created again under the name since is another server's.
                mine = reg.at_name()
                reg.unlink()
                if mine:
                    log.info("shmcancel: registry %r unlinked", _state.registry_name)
                else:
                    log.info("shmcancel: registry %r was unlinked already; any registry of "
                             "that name now is another's, left alone", _state.registry_name)
            reg.close()
    except Exception:
        log.exception("shmcancel: closing registry %r failed", _state.registry_name)
    finally:
        _state.registry = None
