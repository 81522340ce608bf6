"""Refused bodies on a real gunicorn, ``sync`` and ``gthread``. A body cut off at ``body_timeout``
(408) ends its connection after the reply: where a next request would start on it is unknown.
Before, a ``gthread`` worker kept the connection (the reply said ``keep-alive``) and ran whatever
came next on it as a request, the refused body's own rest included (request smuggling, behind a
proxy that streams bodies and reuses connections). A body refused before it was read (413 from
its declared length, 415, 403, 405) is read and discarded within a quarter of a second (up to
64 KiB past the limit), and the connection kept; one that does not arrive by then ends its
connection too, and nothing gunicorn read ahead on it runs: left to gunicorn, a worker drained
such a body before the connection's next request (or its end), with a deadline it looked at
only between 1 KiB reads, so a client trickling such bodies held every thread."""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
import threading
import time

import gunicorn
import pytest
from helpers.gunicorn_harness import Gunicorn
from helpers.mcp_client import modern_call_bytes, tag

from shmcancel.mcp.body import DRAIN_OVER

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
    """Its declared length is over the limit (by less than what is drained), and its tail is a
    whole request: it is read and discarded as the body it is. On ``gthread`` the connection
    then serves a real next request (a ``sync`` worker may close it after any reply)."""
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



def _refused_head(kind: str) -> bytes:
    """The head of a request refused before its body is read: 413 (a declared length over the
    limit), 415 (a Content-Type), 403 (an Origin), 405 (a method); its body (within the
    limit but for the 413) is for the client to trickle."""
    head, _, _ = _echo("x", 1).partition(b"\r\n\r\n")
    declared = head.split(b"Content-Length: ")[1].split(b"\r\n")[0]
    length = b"2000000" if kind == "413" else b"%d" % (MAX_BODY - 500)
    head = head.replace(b"Content-Length: " + declared, b"Content-Length: " + length)
    if kind == "415":
        head = head.replace(b"Content-Type: application/json", b"Content-Type: text/plain")
    elif kind == "403":
        head += b"\r\nOrigin: http://evil.example"
    elif kind == "405":
        head = b"PUT" + head[len(b"POST"):]
    return head + b"\r\n\r\n"


@pytest.mark.parametrize("kind", ["413", "415", "403", "405"])
def test_clients_trickling_refused_bodies_hold_no_thread(server: Gunicorn, kind: str) -> None:
    """More connections than the worker has threads, each sending a request refused before its
    body is read, then trickling the body a byte every 0.2 s: each gets its refusal and its
    connection ends, and a request on a new connection is served meanwhile. Before, a
    ``gthread`` worker answered the refusals and then drained each body for as long as it
    trickled (gunicorn's drain deadline is looked at between 1 KiB reads): the server served
    nothing more until the clients let go."""
    conns = [socket.create_connection(("127.0.0.1", server.port), timeout=10)
             for _ in range(4)]  # the worker has 2 threads
    stop = threading.Event()

    def trickle(s: socket.socket) -> None:
        end = time.monotonic() + 20.0
        while not stop.is_set() and time.monotonic() < end:
            try:
                s.sendall(b" ")
            except OSError:
                return  # the server ended the connection
            stop.wait(0.2)

    trickling = []
    try:
        for s in conns:
            s.sendall(_refused_head(kind))
            t = threading.Thread(target=trickle, args=(s,), daemon=True)
            t.start()
            trickling.append(t)
        for s in conns:
            status, _ = _response_head(s, 10.0)
            assert status.split(b" ")[1] == kind.encode(), status
        t0 = time.monotonic()
        for s in conns:
            _rest_of_connection(s, ENDED_WITHIN + 2.0)
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(_echo("served", 2))
            status, _ = _response_head(s, 5.0)
            assert status.split(b" ")[1] == b"200", status
        assert time.monotonic() - t0 < 10.0
    finally:
        stop.set()
        for t in trickling:
            t.join(5)
        for s in conns:
            s.close()


@pytest.mark.parametrize("kind", ["415", "403", "405"])
def test_a_refused_request_whose_body_is_all_there_keeps_its_connection(
        server: Gunicorn, kind: str) -> None:
    """A client's refused request, its body sent whole (the common case): answered, and on
    ``gthread`` its connection serves the next request (a reviewer's ``http.client`` got
    ``RemoteDisconnected`` there, the reply having said keep-alive). A ``sync`` worker may
    close the connection after any reply (gunicorn 23 does)."""
    head = _refused_head(kind)
    declared = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(head + b" " * declared)
        status, out = _response_head(s, 10.0)
        assert status.split(b" ")[1] == kind.encode(), status
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            s.sendall(_echo("next on the connection", 3))
        s.settimeout(10.0)
        with contextlib.suppress(ConnectionResetError):
            while b"next on the connection" not in out and (chunk := s.recv(65536)):
                out += chunk
    if server.worker_class == "gthread":
        assert b"next on the connection" in out, out[:800]


def _chunk(b: bytes) -> bytes:
    return b"%x\r\n" % len(b) + b + b"\r\n"


def _refused_then(kind: str) -> bytes:
    """A refused request, its body whole, as a client pipelining sends it: 413 by a declared
    length over the limit (within what is drained), 415 with a chunked body over the limit,
    415 within it, 400 for a malformed chunk."""
    head, _, _ = _echo("x", 1).partition(b"\r\n\r\n")
    declared = head.split(b"Content-Length: ")[1].split(b"\r\n")[0]
    if kind == "413":
        return head.replace(b"Content-Length: " + declared,
                            b"Content-Length: %d" % (MAX_BODY + 1)) + b"\r\n\r\n" + b"x" * (
                                MAX_BODY + 1)
    head = head.replace(b"Content-Length: " + declared, b"Transfer-Encoding: chunked")
    if kind == "400":
        return head + b"\r\n\r\nzz\r\nnot a chunk\r\n"
    if kind == "413 chunks":  # past what is drained, in chunks gunicorn's parser reads ahead of
        return head + b"\r\n\r\n" + _chunk(b"x" * 100) * (
            (2 * MAX_BODY + DRAIN_OVER) // 100 + 20) + b"0\r\n\r\n"
    head = head.replace(b"Content-Type: application/json", b"Content-Type: text/plain")
    size = MAX_BODY + 1 if kind == "415 over" else 100
    return head + b"\r\n\r\n" + _chunk(b"x" * size) + b"0\r\n\r\n"


@pytest.mark.parametrize("kind", ["413", "413 chunks", "415 over", "415", "400"])
def test_a_request_pipelined_after_a_refused_one_runs_only_if_answered(
        server: Gunicorn, kind: str) -> None:
    """A client sends a refused request and a next one in one write. The next one is served
    (a body that could be drained: the connection is kept), or it never runs: a reviewer's
    ``gthread`` worker ran it from its read-ahead buffer on a connection the refusal had ended,
    and its reply went nowhere, so a client would retry a call that had run (and, after a
    chunked body too long to drain, from what gunicorn's chunk parser had read ahead)."""
    smuggled, t = _smuggled()
    pid = server.worker_pids()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(_refused_then(kind) + smuggled)
        status, rest = _response_head(s, 10.0)
        ends = kind in ("400", "413 chunks")
        out, _ = _rest_of_connection(s, 10.0) if ends or server.worker_class == "sync" \
            else (b"", 0.0)
        out = rest + out
        if server.worker_class == "gthread" and not ends:
            s.settimeout(10.0)
            while b'"id":666' not in out and (chunk := s.recv(65536)):
                out += chunk
    assert status.split(b" ")[1] == kind[:3].encode(), status
    time.sleep(0.5)  # a tool that ran would have left its file by now (it starts at once)
    ran = os.path.exists(os.path.join(server.outdir, f"{t}.started"))
    answered = b'"id":666' in out
    assert ran == answered, (ran, out[-600:])
    if server.worker_class == "gthread" and gunicorn.version_info >= (27,):
        # (gunicorn 23's gthread leaves a request it read ahead until the client sends more)
        assert answered is not ends, out[-600:]
    assert server.worker_pids() == pid
