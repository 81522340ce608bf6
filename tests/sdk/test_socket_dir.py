"""The SDK workers' socket directory (``shmcancel.sdk._routing.socket_dir``): a worker's socket
takes requests as any client (the forwarded client address is trusted), so the directory must be
a private directory of this user; another local user's squat is refused, never used."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from shmcancel.sdk import SocketDirTooLong, SocketDirUnsafe, _routing
from shmcancel.sdk._routing import Router, _checked, registry_dir, server_dir, socket_dir


@pytest.fixture
def use_dir(monkeypatch: pytest.MonkeyPatch):
    def _use(d: Path) -> None:
        monkeypatch.setenv("SHMCANCEL_SDK_SOCKET_DIR", str(d))

    return _use


def test_a_new_directory_is_made_private(short_tmp: Path, use_dir) -> None:
    d = short_tmp / "socks"
    use_dir(d)
    assert socket_dir() == str(d)
    assert stat.S_IMODE(os.lstat(d).st_mode) == 0o700


def test_an_open_directory_of_ours_is_closed(short_tmp: Path, use_dir) -> None:
    d = short_tmp / "open"
    d.mkdir()
    d.chmod(0o777)
    use_dir(d)
    assert socket_dir() == str(d)
    assert stat.S_IMODE(os.lstat(d).st_mode) == 0o700


def test_a_symlink_or_a_file_is_refused(short_tmp: Path, use_dir) -> None:
    real = short_tmp / "real"
    real.mkdir(mode=0o700)
    link = short_tmp / "link"
    link.symlink_to(real)
    use_dir(link)
    with pytest.raises(SocketDirUnsafe, match="symlink"):
        socket_dir()
    f = short_tmp / "file"
    f.write_text("")
    use_dir(f)
    with pytest.raises(SocketDirUnsafe, match="not a directory"):
        socket_dir()


@pytest.mark.skipif(os.geteuid() != 0, reason="making another user's directory needs root")
def test_another_users_directory_is_refused_and_left_alone(short_tmp: Path, use_dir) -> None:
    d = short_tmp / "squat"
    d.mkdir()
    d.chmod(0o777)
    os.chown(d, 65534, 65534)  # nobody
    use_dir(d)
    with pytest.raises(SocketDirUnsafe, match="owned by uid 65534"):
        socket_dir()
    assert stat.S_IMODE(os.lstat(d).st_mode) == 0o777 and os.listdir(d) == []


def test_a_registrys_subdirectory_fits_a_socket_path_and_is_private(short_tmp: Path,
                                                                     use_dir) -> None:
    """The longest registry name still leaves a worker's socket path under the 107 bytes a unix
    socket address holds (a path naming the registry did not: the worker failed to start), and
    the subdirectory is made 0700."""
    use_dir(short_tmp)
    d = registry_dir(socket_dir(), "n" * 64)
    longest_token = f"{2**32 - 1:x}x{'0' * 12}"
    added = len(os.path.join(d, f"{longest_token}.sock")) - len(str(short_tmp))
    default_base = f"/tmp/shmcancel-sdk-{2**32 - 1}"  # the longest default directory
    assert len(default_base) + added < 108, added
    assert stat.S_IMODE(os.lstat(d).st_mode) == 0o700


def test_a_directory_too_long_for_a_socket_path_is_refused_clearly(short_tmp: Path,
                                                                   use_dir) -> None:
    """One byte past SOCKET_DIR_MAX: SocketDirTooLong, naming the variable to set, and nothing
    made (not the bare ``OSError: AF_UNIX path too long`` of a worker's bind); at
    SOCKET_DIR_MAX the worker with the longest token binds."""
    longest_token = f"{2**32 - 1:x}x{'0' * 12}"
    at_most = short_tmp / ("d" * (_routing.SOCKET_DIR_MAX - len(str(short_tmp)) - 1))
    assert len(str(at_most)) == _routing.SOCKET_DIR_MAX
    too_long = Path(str(at_most) + "x")
    use_dir(too_long)
    with pytest.raises(SocketDirTooLong, match="SHMCANCEL_SDK_SOCKET_DIR") as e:
        _routing._bind(longest_token)
    assert str(too_long) in str(e.value)
    assert not too_long.exists()
    use_dir(at_most)
    sock, path = _routing._bind(longest_token)
    try:
        assert path.startswith(str(at_most) + "/") and stat.S_ISSOCK(os.lstat(path).st_mode)
    finally:
        sock.close()
        os.unlink(path)


def test_a_planted_subdirectory_is_refused(short_tmp: Path, use_dir) -> None:
    """A registry's subdirectory planted by someone else (a symlink, while the base was open to
    others) is refused, not bound into."""
    base = short_tmp / "socks"
    base.mkdir(mode=0o700)
    use_dir(base)
    elsewhere = short_tmp / "elsewhere"
    elsewhere.mkdir()
    name = "planted"
    real = Path(registry_dir(socket_dir(), name))
    real.rmdir()
    real.symlink_to(elsewhere)
    _checked.clear()  # a new process: checked afresh
    with pytest.raises(SocketDirUnsafe, match="symlink"):
        registry_dir(socket_dir(), name)


def test_the_refusal_is_a_public_shmcancel_error() -> None:
    from shmcancel import ShmCancelError

    assert issubclass(SocketDirUnsafe, ShmCancelError)
    assert issubclass(SocketDirTooLong, ShmCancelError) and issubclass(SocketDirTooLong,
                                                                      ValueError)


# Prints server_dir() of a process with no registry; with "child", its own child's.
_SERVER_DIR = """
import subprocess, sys
from shmcancel.sdk._routing import server_dir
if sys.argv[1] == "child":
    sys.stdout.write(subprocess.run([sys.executable, __file__, "self"], capture_output=True,
                                    text=True, timeout=60).stdout)
else:
    print(server_dir())
"""


def _server_dir_of(short_tmp: Path, how: str) -> str:
    script = short_tmp / "server_dir.py"
    script.write_text(_SERVER_DIR)
    env = {k: v for k, v in os.environ.items() if k != "SHMCANCEL_REGISTRY"}
    env["SHMCANCEL_SDK_SOCKET_DIR"] = str(short_tmp / "socks")
    out = subprocess.run([sys.executable, str(script), how], capture_output=True, text=True,
                         env=env, timeout=60)
    assert out.returncode == 0 and out.stdout.strip(), out.stderr[-2000:]
    return out.stdout.strip()


def test_servers_without_a_registry_share_a_directory_only_with_their_parents_processes(
        short_tmp: Path) -> None:
    """Without a registry the socket directory itself was every such server's: a session id
    minted by one server was forwarded to it by another of the same user. Now the processes of
    one parent (a server's workers) share one subdirectory, and another parent's (another
    server's) have another."""
    siblings = {_server_dir_of(short_tmp, "self") for _ in range(2)}
    assert len(siblings) == 1
    other = _server_dir_of(short_tmp, "child")  # a process of another parent
    assert other not in siblings
    for d in (*siblings, other):
        assert os.path.dirname(d) == str(short_tmp / "socks")
        assert stat.S_IMODE(os.lstat(d).st_mode) == 0o700


async def _answers_204(path: str) -> None:
    """A request on the socket at ``path`` is answered by ``_noop_app`` (204)."""
    reader, writer = await asyncio.open_unix_connection(path)
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    async with asyncio.timeout(10):
        assert (await reader.readline()).startswith(b"HTTP/1.1 204")
    writer.close()


async def _closed(r: Router) -> None:
    """Close ``r`` and wait for its socket servers to end."""
    r.close()
    async with asyncio.timeout(10):
        await asyncio.gather(*r._tasks)


async def _noop_app(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 204, "headers": []})
    await send({"type": "http.response.body", "body": b""})


def test_the_last_workers_close_removes_the_servers_directory(
        short_tmp: Path, use_dir) -> None:
    """Each server's directory is named by its registry, and CI's registries have random
    names: a directory left at every stop was one more empty directory per run, forever. The
    worker whose close leaves it empty removes it; one that leaves another's socket does not."""
    use_dir(short_tmp / "socks")

    async def main() -> None:
        first, last = Router(_noop_app), Router(_noop_app)
        await first.ensure()
        await last.ensure()
        tasks = [*first._tasks, *last._tasks]
        d = os.path.dirname(first.path)
        assert os.path.dirname(last.path) == d and d.startswith(str(short_tmp / "socks"))
        first.close()
        assert os.listdir(d) == [os.path.basename(last.path)]
        last.close()
        async with asyncio.timeout(10):
            await asyncio.gather(*tasks)
        assert not os.path.exists(d)
        assert os.listdir(short_tmp / "socks") == []

    asyncio.run(main())


def test_the_last_close_sweeps_the_sockets_of_killed_workers(short_tmp: Path, use_dir) -> None:
    """Workers SIGKILLed leave their sockets (a quick stop of uvicorn workers, which ignore
    SIGQUIT until gunicorn kills them; an upgrade's old workers killed after the new ones
    swept): the last worker to close found them, kept the directory, and it outlived the server
    (a reviewer's 3 of 3). The close removes dead workers' sockets, then the directory; a live
    worker's socket stays, and so does the directory."""
    use_dir(short_tmp / "socks")
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child: a worker that dies at once
        os._exit(0)
    os.waitpid(pid, 0)

    async def main() -> None:
        live, last = Router(_noop_app), Router(_noop_app)
        await live.ensure()
        await last.ensure()
        d = os.path.dirname(last.path)
        dead = os.path.join(d, f"{pid:x}x{'0' * 12}.sock")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.bind(dead)  # a killed worker's socket file, left behind
        await _closed(last)
        assert sorted(os.listdir(d)) == [os.path.basename(live.path)]  # live: kept
        await _closed(live)
        assert not os.path.exists(d)

    asyncio.run(main())


def test_a_worker_binds_when_its_checked_directory_was_removed_meanwhile(
        short_tmp: Path, use_dir) -> None:
    """During a HUP the old workers exit (the last one removing the emptied directory) while
    the new ones start: a new worker that checked the directory before that removal bound
    into nothing, and its socket server failed to start. It makes the directory again."""
    use_dir(short_tmp / "socks")
    d = server_dir()  # checked: this process will not look at it again
    os.rmdir(d)

    async def main() -> None:
        r = Router(_noop_app)
        await r.ensure()
        try:
            assert os.path.dirname(r.path) == d
            assert stat.S_ISSOCK(os.lstat(r.path).st_mode)
            assert stat.S_IMODE(os.lstat(d).st_mode) == 0o700
            await _answers_204(r.path)
        finally:
            await _closed(r)

    asyncio.run(main())


def test_a_worker_binds_when_the_directory_goes_between_its_making_and_its_check(
        short_tmp: Path, use_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same race one step earlier: the directory made, then removed by the last old
    worker's close before this worker's check of it. The check found nothing, and the
    FileNotFoundError stopped the worker's start (under gunicorn: the whole server, as a
    worker that failed to boot). Only this removal is injected: the rest is the real code."""
    use_dir(short_tmp / "socks")
    base = socket_dir()
    made: list[str] = []
    real_makedirs = os.makedirs

    def makedirs_then_a_close(d, *args, **kwargs):
        real_makedirs(d, *args, **kwargs)
        if os.path.dirname(d) == base and not made:
            made.append(d)
            os.rmdir(d)  # an exiting worker's close, which found the directory empty

    monkeypatch.setattr(os, "makedirs", makedirs_then_a_close)
    sock, path = _routing._bind("1x000000000001")
    try:
        assert made and os.path.dirname(path) == made[0]
        assert stat.S_ISSOCK(os.lstat(path).st_mode)
        assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.lstat(made[0]).st_mode) == 0o700
    finally:
        sock.close()


def test_a_retry_checks_the_base_directory_again(short_tmp: Path, use_dir) -> None:
    """Both directories removed after this process checked them (a tmp cleaner's rm -r): the
    bind's retry made the base again with the umask's mode (0755), never checked, as the
    server's own 0700 one under it was."""
    use_dir(short_tmp / "socks")
    base = socket_dir()
    d = server_dir()
    os.rmdir(d)
    os.rmdir(base)
    old = os.umask(0o022)
    try:
        sock, path = _routing._bind("1x000000000002")
    finally:
        os.umask(old)
    try:
        assert os.path.dirname(path) == d
        assert stat.S_IMODE(os.lstat(base).st_mode) == 0o700
        assert stat.S_IMODE(os.lstat(d).st_mode) == 0o700
    finally:
        sock.close()


def test_servers_replaced_by_binds_again_are_retired(short_tmp: Path, use_dir,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Each removal of a worker's socket makes its keeper bind a new one and serve it with a
    server of its own; the earlier ones, unreachable, stopped only at the worker's close and
    piled up (41 servers and tasks after 40 removals, each ticking 10 times a second). An
    earlier server serving no connection is stopped and forgotten at the keeper's next look."""
    use_dir(short_tmp / "socks")
    monkeypatch.setattr(_routing, "KEEP_BOUND_EVERY", 0.05)

    async def main() -> None:
        r = Router(_noop_app)
        await r.ensure()
        try:
            for _ in range(5):
                first = os.lstat(r.path).st_ino
                os.unlink(r.path)
                async with asyncio.timeout(10):
                    while not (os.path.exists(r.path) and os.lstat(r.path).st_ino != first):
                        await asyncio.sleep(0.01)
            async with asyncio.timeout(10):
                while len(r._servers) > 1 or len(r._tasks) > 1:
                    await asyncio.sleep(0.01)
            await _answers_204(r.path)  # the last one serves
        finally:
            await _closed(r)

    asyncio.run(main())


def test_a_trailing_slash_does_not_let_a_symlinked_directory_through(
        short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``dir/`` is lstat'ed through a symlink ``dir``: the directory passed the start's check,
    then every forward's check (of ``dir``) refused it, and the workers' sessions were 404 from
    the others. The setting is normalised: the symlink is refused at the start, as ``dir``."""
    real = short_tmp / "real"
    real.mkdir(mode=0o700)
    (short_tmp / "lnk").symlink_to(real)
    monkeypatch.setenv("SHMCANCEL_SDK_SOCKET_DIR", f"{short_tmp / 'lnk'}/")  # (a Path drops it)
    with pytest.raises(SocketDirUnsafe, match="symlink"):
        socket_dir()


def test_a_socket_directory_opened_to_reading_stays_reachable(short_tmp: Path, use_dir) -> None:
    """A deploy step's ``chmod 750`` of the base lets nobody else plant a socket there (no
    write bits): forwards go on (they answered 404 until the keeper took the bits back, and a
    404 ends a client's session). Write bits for others are refused."""
    use_dir(short_tmp / "socks")

    async def main() -> None:
        r = Router(_noop_app)
        await r.ensure()
        try:
            base = os.path.dirname(os.path.dirname(r.path))
            os.chmod(base, 0o750)
            assert Router.names_worker(r.token)
            os.chmod(base, 0o770)
            assert not Router.names_worker(r.token)
            os.chmod(base, 0o700)
            assert Router.names_worker(r.token)
        finally:
            await _closed(r)

    asyncio.run(main())
