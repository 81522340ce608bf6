"""A real ``redis-server`` for the tests: started on a free loopback port with no persistence,
stopped by pid (also when the test fails). Never a mock."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """One ``redis-server`` process on ``127.0.0.1:port``; :meth:`kill` and :meth:`start` again
    on the same port (a restart loses everything: no persistence). ``own_session``: start it in a
    session of its own, so a Ctrl-C at the terminal reaches only its starter, which stops it.
    ``env``: variables added to its environment (a locale, say)."""

    def __init__(self, own_session: bool = False, env: dict[str, str] | None = None) -> None:
        self.own_session = own_session
        self.env = env
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (tools/test.sh installs it: "
                               "apt-get install redis-server)")
        self.binary = binary
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="shmcancel-redis-")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, deadline: float = 10.0) -> RedisServer:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.dir, "--protected-mode", "yes",
             "--daemonize", "no", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=self.own_session,
            env=None if self.env is None else {**os.environ, **self.env})
        end = time.monotonic() + deadline
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            with contextlib.suppress(OSError), \
                    socket.create_connection(("127.0.0.1", self.port), 0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return self
            time.sleep(0.02)
        raise RuntimeError("redis-server did not answer PING in time")

    def kill(self) -> None:
        """SIGKILL the server and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The server stopped (SIGSTOP: it answers nothing) for the block, resumed (SIGCONT)
        after, whatever the block raised."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def running() -> Iterator[RedisServer]:
    srv = RedisServer()
    try:
        yield srv.start()
    finally:
        srv.stop()


def unique_prefix() -> str:
    return f"t{uuid.uuid4().hex[:10]}:"
