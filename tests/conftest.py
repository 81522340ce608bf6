"""Shared fixtures. Every shared-memory name a test uses comes from ``shm_name`` so that it is
unique per test and unlinked afterwards, pass or fail. ``registry`` makes registries on it;
``spawn`` forks children that talk over a channel. Helpers that are not fixtures are in
tests/helpers/."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import gunicorn_harness
from helpers.names import SHM_DIR, TEST_PREFIX, fresh_registry_name, unlink_registry_names
from helpers.procs import Chan, Child, fork
from helpers.redis_server import running as running_redis
from helpers.redis_server import unique_prefix
from helpers.rings import set_rings_only

from shmcancel import Config
from shmcancel.shm.registry import Registry


@pytest.fixture
def shm_name() -> Iterator[str]:
    """A registry name unique to this test; everything under it is unlinked afterwards."""
    with fresh_registry_name() as name:
        yield name


@pytest.fixture(scope="module")
def module_shm_name() -> Iterator[str]:
    """Like ``shm_name``, for a module-scoped resource (a gunicorn serving a whole module)."""
    with fresh_registry_name() as name:
        yield name


@pytest.fixture
def shm_names() -> Iterator[list[str]]:
    """A list to which a test appends extra registry names it makes; all unlinked afterwards."""
    names: list[str] = []
    try:
        yield names
    finally:
        for name in names:
            unlink_registry_names(name)


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A fresh directory right under the system's temporary directory, removed afterwards: short
    enough for an SDK worker's socket directory (pytest's ``tmp_path`` under pytest-xdist is
    not: a unix socket's path holds 107 bytes)."""
    d = tempfile.mkdtemp(prefix="sc-")
    try:
        yield Path(d)
    finally:
        shutil.rmtree(d, ignore_errors=True)


_SDK_SOCKETS: list[str] = []  # the socket directory this run made for SDK servers


def pytest_configure(config: pytest.Config) -> None:
    """SDK servers the tests start put their workers' sockets (one subdirectory per registry)
    in a directory of this run's, removed at its end, not in the user's shared default."""
    if "SHMCANCEL_SDK_SOCKET_DIR" not in os.environ:
        d = tempfile.mkdtemp(prefix="shmcancel-sdk-tests-")
        _SDK_SOCKETS.append(d)
        os.environ["SHMCANCEL_SDK_SOCKET_DIR"] = d


def _left_behind() -> list[str]:
    """What this process's tests left: gunicorn temporary directories, files of its registry
    names in /dev/shm; each removed, and said in a line."""
    said = []
    dirs = sorted(d for d in gunicorn_harness.MADE_DIRS if os.path.exists(d))
    if dirs:
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
        said.append(f"shmcancel tests left {len(dirs)} gunicorn directories: {dirs[:5]}")
    try:
        left = [f for f in os.listdir(SHM_DIR) if TEST_PREFIX in f]
    except OSError:
        left = []
    if left:
        for f in left:
            name = f.split(TEST_PREFIX, 1)[1]
            unlink_registry_names(TEST_PREFIX + name)
        said.append(f"shmcancel tests left {len(left)} file(s) in {SHM_DIR}: {sorted(left)[:10]}")
    return said


_WORKERS_LEFT: list[str] = []  # under pytest-xdist: what the workers' tests left


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    """pytest-xdist, in the controller: a worker's report of what its tests left (a worker's own
    exit status does not reach the run's)."""
    _WORKERS_LEFT.extend(getattr(node, "workeroutput", {}).get("shmcancel_left", ()))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail loudly if this run left anything of its own in /dev/shm, or a gunicorn's
    temporary directory in /tmp; remove this run's SDK socket directory. Each process checks
    (and cleans) its own registry names; a pytest-xdist worker hands its findings to the
    controller, which fails the run."""
    for d in _SDK_SOCKETS:
        shutil.rmtree(d, ignore_errors=True)
    said = _left_behind()
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["shmcancel_left"] = said
        return
    said += _WORKERS_LEFT
    for line in said:
        print(f"\n{line}")
    if said:
        session.exitstatus = 1


@pytest.fixture
def spawn() -> Iterator[Callable[..., Child]]:
    """spawn(fn, *args) forks a child running fn(chan, *args); killed by pid at teardown."""
    children: list[Child] = []

    def _spawn(fn: Callable[..., None], *args: Any) -> Child:
        parent_end, child_end = socket.socketpair()

        def run() -> None:
            parent_end.close()
            fn(Chan(child_end), *args)
        pid = fork(run)
        child_end.close()
        child = Child(pid, Chan(parent_end))
        children.append(child)
        return child

    try:
        yield _spawn
    finally:
        for child in children:
            child.kill()
            child.chan.sock.close()


@pytest.fixture
def registry(shm_name):
    """registry(**config) -> a Registry created on ``shm_name`` (a small config by default);
    closed and unlinked afterwards."""
    made = []

    def _make(**cfg: Any) -> Registry:
        kw = {"capacity": 400, "max_rows": 200, "in_flight_capacity": 64, "session_capacity": 16}
        kw.update(cfg)
        reg = Registry.create(shm_name, Config(**kw))
        made.append(reg)
        return reg

    try:
        yield _make
    finally:
        for reg in made:
            reg.close()
            reg.unlink()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[object]:
    """A real redis-server for the whole run (loopback, free port, no persistence), stopped
    by pid at the end; tests keep apart by key prefix (``redis_prefix``)."""
    with running_redis() as srv:
        yield srv


@pytest.fixture
def redis_prefix() -> str:
    """A key prefix unique to this test."""
    return unique_prefix()


@pytest.fixture
def rings_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """No look at the waits of :mod:`shmcancel.mcp.wake` but a ring's (``helpers.rings``):
    what wakes a wait in the test is a ring or a wake, so a missing ring shows."""
    set_rings_only(monkeypatch.setattr)
