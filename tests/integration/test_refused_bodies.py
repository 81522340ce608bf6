"""Refused bodies on a real gunicorn, ``sync`` and ``gthread``. A body cut off at ``body_timeout``
(408) ends its connection after the reply: where a next request would start on it is unknown.
Before, a ``gthread`` worker kept the connection (the reply said ``keep-alive``) and ran whatever
came next on it as a request, the refused body's own rest included (request smuggling, behind a
proxy that streams bodies and reuses connections). A body over the limit (413, from its
declared length) is left to gunicorn, which knows where it ends: its rest is never a request, and
a ``gthread`` connection serves the next request after it."""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
import time

import pytest
from helpers.gunicorn_harness import Gunicorn
from helpers.mcp_client import modern_call_bytes, tag

pytestmark = pytest.mark.integration

APP = "tests.apps.transport_app:app"
CONF = "tests/apps/transport_conf.py"
BODY_TIMEOUT = 1.0  # seconds, the server's body_timeout here
MAX_BODY = 2000  # bytes, the server's max_body_bytes here
ENDED_WITHIN = 3.0  # seconds from the refusal to the connection's end (a linger of 1 s)


def _echo(text: str, rid: int) -> bytes:
    return modern_call_bytes("echo", {"text": text}, rid, client="refused")


def _smuggled() -> tuple[bytes, str]:
    """A request whose tool, if it ever runs, leaves ``<tag>.started`` in the app's directory
    (whether or not its answer could be written), and that tag."""
    t = tag()
    return modern_call_bytes("sleep", {"seconds": 0, "tag": t}, 666, client="refused"), t


def _response_head(s: socket.socket, within: float) -> tuple[bytes, bytes]:
    """The first response's status line and whatever came after its head."""
    s.settimeout(within)
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(65536)
        assert chunk, buf
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    return head.split(b"\r\n")[0], rest


def _rest_of_connection(s: socket.socket, within: float) -> tuple[bytes, float]:
    """Everything read until the connection ends (EOF or reset), and when it ended (monotonic);
    fails if it has not ended ``within`` seconds."""
    s.settimeout(within)
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        pytest.fail(f"the connection was still open {within} s on; read: {out[:300]!r}")
    return out, time.monotonic()


@pytest.fixture(params=["sync", "gthread"])
def server(request, shm_name: str):
    """The test app on one worker of each class; its tools' files go to ``server.outdir``."""
    with tempfile.TemporaryDirectory(prefix="shmcancel-refused-") as d, \
            Gunicorn(APP, registry_name=shm_name, config=CONF, workers=1,
                     worker_class=request.param, threads=2,
                     env={"SHMCANCEL_TEST_DIR": d,
                          "SHMCANCEL_TEST_BODY_TIMEOUT": str(BODY_TIMEOUT),
                          "SHMCANCEL_TEST_MAX_BODY": str(MAX_BODY)}) as g:
        g.outdir = d  # type: ignore[attr-defined]
        yield g


def _served_after(server: Gunicorn, pid: list[int], smuggled_tag: str) -> None:
    """The worker is the same, serves a new connection, and logged no error; the smuggled
    request's tool never ran (its answer may not have been writable: run all the same)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(_echo("next", 2))
        status, _ = _response_head(s, 10.0)
        assert status.split(b" ")[1] == b"200", status
    assert server.worker_pids() == pid
    log = server.log()
    assert "Traceback" not in log and "[ERROR]" not in log, log[-3000:]
    assert not os.path.exists(os.path.join(server.outdir, f"{smuggled_tag}.started"))


def test_nothing_after_a_body_cut_off_at_its_deadline_is_run_as_a_request(
        server: Gunicorn) -> None:
    head, _, body = _echo("x" * 50, 1).partition(b"\r\n\r\n")
    pid = server.worker_pids()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(head + b"\r\n\r\n" + body[:10])  # part of the body, then a stall
        status, _ = _response_head(s, 10 * BODY_TIMEOUT)
        refused_at = time.monotonic()
        assert status.split(b" ")[1] == b"408", status
        # the client (or a proxy relaying it) goes on: the body's rest, as a request (unless
        # the connection has ended already)
        smuggled, t = _smuggled()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            s.sendall(smuggled)
        rest, ended_at = _rest_of_connection(s, 10.0)
    assert b"HTTP/1.1" not in rest, rest[:500]
    assert ended_at - refused_at < ENDED_WITHIN, ended_at - refused_at
    _served_after(server, pid, t)


def test_the_rest_of_a_body_over_the_limit_is_no_request(server: Gunicorn) -> None:
    """Its declared length is over the limit, and its tail is a whole request: gunicorn
    drains it as the body it is. On ``gthread`` the connection then serves a real next
    request (``sync`` closes every connection after its reply)."""
    smuggled, t = _smuggled()
    head, _, _ = _echo("x", 1).partition(b"\r\n\r\n")
    pad = b" " * (MAX_BODY + 100)
    declared = head.split(b"Content-Length: ")[1].split(b"\r\n")[0]
    head = head.replace(b"Content-Length: " + declared,
                        b"Content-Length: %d" % (len(pad) + len(smuggled)))
    pid = server.worker_pids()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(head + b"\r\n\r\n" + pad + smuggled)
        status, rest = _response_head(s, 10.0)
        assert status.split(b" ")[1] == b"413", status
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            s.sendall(_echo("next on the connection", 3))
        s.settimeout(10.0)
        out = rest
        with contextlib.suppress(ConnectionResetError):
            while b"next on the connection" not in out and (chunk := s.recv(65536)):
                out += chunk
    assert b'"id":666' not in out, out[:800]
    if server.worker_class == "gthread":
        assert b"next on the connection" in out, out[:800]
    _served_after(server, pid, t)
