"""Run a real gunicorn for a test, and never leave a process behind.

``Gunicorn(target, registry_name=...)`` starts ``gunicorn`` from the repository root on a free
loopback port, with ``SHMCANCEL_REGISTRY=registry_name`` in its environment and its log in a
temporary file, and waits (polling, with a deadline) until the port accepts and the expected
workers exist. Leaving the ``with`` block (or ``stop()``) sends SIGTERM to every master it knows
of (the original one and any started by ``upgrade()``), waits with a deadline, SIGKILLs what is
left (masters and workers, by pid), then unlinks the registry's names.

The port is chosen by gunicorn itself (``-b 127.0.0.1:0``) and read back from its
"Listening at" log line, so two harnesses never race for a port.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import gunicorn

from .names import unlink_registry_names

REPO_ROOT = Path(__file__).resolve().parents[2]
# (more binds in extra_args: "Listening at: http://127.0.0.1:P,http://[::]:Q (pid)")
_LISTENING = re.compile(r"Listening at: http://127\.0\.0\.1:(\d+)(?:,\S+)? \((\d+)\)")
# gunicorn >= 25.1 starts a control-socket thread at a path shared by every instance; older
# versions reject the flag, so it is added only where it exists.
_HAS_CONTROL_SOCKET = tuple(int(p) for p in gunicorn.__version__.split(".")[:2]) >= (25, 1)


def gunicorn_command() -> list[str]:
    """How to start gunicorn with this interpreter.

    The console script beside ``sys.executable`` is preferred: a ``USR2`` upgrade re-executes
    ``sys.executable`` with ``sys.argv``, which under ``python -m gunicorn`` runs
    ``gunicorn/__main__.py`` as a script (gunicorn's package directory first on ``sys.path``)
    rather than the way the first master was started. ``-m`` is the fallback.
    """
    script = Path(sys.executable).parent / "gunicorn"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "gunicorn"]


def _stat(pid: int) -> tuple[str, int] | None:
    """``(state, ppid)`` of a process from ``/proc/<pid>/stat``; ``None`` when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2 :].split()
    return fields[0].decode(), int(fields[1])


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")


_SIGCHLD_BIT = 1 << (signal.SIGCHLD - 1)


def _signals_reset(pid: int) -> bool:
    """Whether worker ``pid`` has run gunicorn's ``Worker.init_signals`` (or is gone). Until then
    it runs the master's handlers inherited over fork, and a SIGTERM its master forwards is
    queued in the worker's copy of the master's signal queue and lost (the master then waits
    out its graceful timeout). ``init_signals`` resets SIGCHLD, which the master catches, to the
    default: that is what is read here (``SigCgt`` of ``/proc/<pid>/status``)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return True
    return not caught & _SIGCHLD_BIT


def children(pid: int) -> list[int]:
    """Live (non-zombie) children of ``pid``, from ``/proc``."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        st = _stat(int(entry))
        if st is not None and st[1] == pid and st[0] not in ("Z", "X"):
            out.append(int(entry))
    return sorted(out)


def _is_exec_master(pid: int, parent: int) -> bool:
    """True when ``pid`` is a master re-executed by ``parent`` on ``USR2`` (its environment at
    exec carries ``GUNICORN_PID=<parent>``), as opposed to a forked worker."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
    except OSError:
        return False
    return f"GUNICORN_PID={parent}".encode() in env


def booted(pid: int) -> bool:
    """Whether worker ``pid`` is alive and has booted as far as gunicorn's ``init_signals`` (see
    :func:`_signals_reset`; a worker gone or exiting has not)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        state, caught = fields["State"].split()[0], int(fields["SigCgt"].split()[0], 16)
    except (OSError, KeyError, ValueError, IndexError):
        return False
    return state not in ("Z", "X") and not caught & _SIGCHLD_BIT


def upgraded_masters(pid: int) -> list[int]:
    """Live masters re-executed by master ``pid`` on ``USR2``."""
    return [p for p in children(pid) if _is_exec_master(p, pid)]


def wait_until(predicate, deadline: float, interval: float = 0.02, what: str = "condition"):
    """Poll ``predicate()`` until it returns something truthy (returned) or ``time.monotonic()``
    passes ``deadline`` (``AssertionError``)."""
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(interval)


MADE_DIRS: set[str] = set()  # each Gunicorn's temporary directory until its cleanup()


class Gunicorn:
    """A gunicorn master and its workers, started on ``__enter__`` and stopped on ``__exit__``.

    ``target`` is a WSGI app path (``"tests.apps.hooks_app:app"``); with ``config`` the given
    ``gunicorn.conf.py`` is loaded too (a ``target`` overrides its ``wsgi_app``; ``None`` keeps
    it).
    ``timeout`` is this harness's deadline, in seconds, for start-up and for stopping (gunicorn's
    own worker ``--timeout`` can go in ``extra_args``).
    """

    def __init__(self, target: str | None, *, registry_name: str, config: str | None = None,
                 workers: int = 3, worker_class: str = "sync", threads: int = 1,
                 env: dict | None = None, extra_args: Sequence[str] = (),
                 timeout: float = 30.0, wait_booted: bool = True) -> None:
        self.target = target
        self.wait_booted = wait_booted  # start() waits for the workers to be booted (see below)
        self.registry_name = registry_name
        self.config = config
        self.workers = workers
        self.worker_class = worker_class
        self.threads = threads
        self.env = dict(env or {})
        self.extra_args = list(extra_args)
        self.timeout = timeout
        self.port = 0
        self.pid = 0
        self.url = ""
        self.masters: list[int] = []  # every master started so far, the current one last
        self._proc: subprocess.Popen | None = None
        self._tmpdir = tempfile.mkdtemp(prefix="shmcancel-gunicorn-")
        MADE_DIRS.add(self._tmpdir)
        self.log_path = os.path.join(self._tmpdir, "gunicorn.log")
        self._kept_log: str | None = None  # the log of a start that failed (its dir is gone)

    # -- introspection -------------------------------------------------------------------

    def log(self) -> str:
        """The whole log so far (stdout and stderr of every master and worker)."""
        if self._kept_log is not None:
            return self._kept_log
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def worker_pids(self, master: int | None = None) -> list[int]:
        """Live worker processes of ``master`` (default: the current master), from ``/proc``;
        a master re-executed by ``USR2`` is not counted as a worker."""
        m = self.pid if master is None else master
        return [p for p in children(m) if not _is_exec_master(p, m)]

    def wait_workers(self, n: int, deadline: float, master: int | None = None) -> list[int]:
        """Wait until exactly ``n`` workers are alive and have their own signal handlers (a
        signal sent to the master just after is then forwarded to workers that act on it);
        return their pids."""
        m = self.pid if master is None else master

        def ready() -> list[int] | None:
            self._check_master(m)
            pids = self.worker_pids(m)
            return pids if len(pids) == n and all(_signals_reset(p) for p in pids) else None

        try:
            return wait_until(ready, deadline, what=f"{n} workers of master {m}")
        except AssertionError as e:
            raise AssertionError(f"{e}; workers now {self.worker_pids(m)}\n{self.log_tail()}") \
                from None

    def _check_master(self, pid: int) -> None:
        if not alive(pid):
            raise AssertionError(f"gunicorn master {pid} exited:\n{self.log_tail()}")

    # -- life cycle ----------------------------------------------------------------------

    def command(self) -> list[str]:
        cmd = [*gunicorn_command()]
        if self.config is not None:
            cmd += ["-c", self.config]
        cmd += ["-b", "127.0.0.1:0", "-w", str(self.workers), "-k", self.worker_class,
                "--threads", str(self.threads), "--log-level", "info",
                "--error-logfile", "-"]
        if _HAS_CONTROL_SOCKET:
            cmd.append("--no-control-socket")
        cmd += self.extra_args
        return cmd if self.target is None else [*cmd, self.target]

    def start(self) -> Gunicorn:
        env = dict(os.environ)
        env["SHMCANCEL_REGISTRY"] = self.registry_name  # ``env`` may override it (even to "")
        env.update(self.env)
        env["PYTHONUNBUFFERED"] = "1"
        deadline = time.monotonic() + self.timeout
        with open(self.log_path, "ab") as logf:
            self._proc = subprocess.Popen(
                self.command(), cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL,
                stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
        self.pid = self._proc.pid
        self.masters.append(self.pid)
        try:
            m = wait_until(self._listening, deadline, what="gunicorn to listen")
            self.port = int(m.group(1))
            self.url = f"http://127.0.0.1:{self.port}/mcp"
            wait_until(self._accepts, deadline, what="the port to accept")
            if self.wait_booted:
                self.wait_workers(self.workers, deadline)
        except BaseException as e:
            self.stop()
            # ``with`` runs no __exit__ when __enter__ raises: keep the log in memory (a test
            # may read it), remove the directory now
            self._kept_log = self.log()
            self.cleanup()
            if isinstance(e, AssertionError):
                raise AssertionError(f"gunicorn failed to start: {e}\n{self.log_tail()}") \
                    from None
            raise
        return self

    def _exited(self) -> None:
        if self._proc is not None and self._proc.poll() is not None:
            raise AssertionError(f"gunicorn exited with {self._proc.returncode}:\n"
                                 f"{self.log_tail()}")

    def _listening(self) -> re.Match[str] | None:
        self._exited()
        return _LISTENING.search(self.log())

    def _accepts(self) -> bool:
        self._exited()
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1.0):
                return True
        except OSError:
            return False

    def signal(self, sig: int, pid: int | None = None) -> None:
        """Send ``sig`` to the current master (or ``pid``)."""
        os.kill(self.pid if pid is None else pid, sig)

    def upgrade(self, deadline: float) -> int:
        """``USR2`` the current master; wait until the re-executed master listens and has its
        workers; make it the current master (``self.pid``) and return its pid. The old master
        keeps running (its pid stays in ``self.masters``)."""
        old = self.pid
        self.signal(signal.SIGUSR2)

        def new_master() -> int | None:
            self._check_master(old)
            found = [p for p in children(old) if _is_exec_master(p, old)]
            return found[0] if found else None

        new = wait_until(new_master, deadline, what="the USR2 master")
        self.masters.append(new)
        self.pid = new
        wait_until(lambda: re.search(rf"Listening at: \S+ \({new}\)", self.log()), deadline,
                   what="the USR2 master to listen")
        self.wait_workers(self.workers, deadline, master=new)
        return new

    def stop(self) -> None:
        """TERM every known master, wait, KILL what is left (masters and workers), unlink."""
        try:
            tree = self._tree()
            for pid in self.masters:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + self.timeout
            while time.monotonic() < deadline:
                self._reap()
                tree |= self._tree()
                if not any(alive(p) for p in tree):
                    break
                time.sleep(0.02)
            # Orphans too: workers of a master a test killed are no longer under any master.
            tree |= self._tree() | self._strays()
            for pid in tree:
                if alive(pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            if self._proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._proc.wait(timeout=5)
        finally:
            unlink_registry_names(self.registry_name)

    def _strays(self) -> set[int]:
        """Live processes started with this instance's ``SHMCANCEL_REGISTRY`` (every process the
        harness starts inherits it; the registry name is unique to the test)."""
        return carrying(self.registry_name)

    def _tree(self) -> set[int]:
        """Every live process under the known masters (masters included)."""
        seen: set[int] = set()
        todo = [p for p in self.masters if alive(p)]
        while todo:
            p = todo.pop()
            if p in seen:
                continue
            seen.add(p)
            todo.extend(children(p))
        return seen

    def _reap(self) -> None:
        if self._proc is not None:
            self._proc.poll()

    def cleanup(self) -> None:
        shutil.rmtree(self._tmpdir, ignore_errors=True)
        MADE_DIRS.discard(self._tmpdir)

    def __enter__(self) -> Gunicorn:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        finally:
            self.cleanup()


def carrying(registry: str, *, prefix: bool = False) -> set[int]:
    """Live processes (this one aside) whose environment has ``SHMCANCEL_REGISTRY=registry``, or
    a value starting with ``registry`` when ``prefix``."""
    mark = f"SHMCANCEL_REGISTRY={registry}".encode()
    out = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if any(v == mark or (prefix and v.startswith(mark)) for v in env) and alive(int(entry)):
            out.add(int(entry))
    return out
