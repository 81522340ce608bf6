"""Helpers shared by the end-to-end benchmarks (``tools/bench_watch.py --http``,
``tools/bench.py``): the example app under a gunicorn of its own on loopback, ``tools/call echo``
requests of either MCP wire, and an asyncio load generator. Imported with ``tools/`` on
``sys.path`` (a script's own directory is, when it runs).

Every server started here is stopped by its pid in :meth:`GunicornServer.close` (call it in a
``finally``), and its registry segment is unlinked there even when gunicorn's ``on_exit`` hook did
not run. Every wait has a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class GunicornServer:
    """The app ``app`` (``"module:attr"``, found on ``pythonpath`` then the example's directory)
    under gunicorn with the example's config, ``workers`` workers of ``kind`` (``gthread``:
    ``threads`` each), on a free loopback port, with ``env`` added to the environment and a
    registry of its own (``SHMCANCEL_REGISTRY``), ``extra_args`` added to gunicorn's command line.
    Output goes to ``<pythonpath>/<label>.log``.
    ``src``: serve that ``src`` directory instead of the installed package. Stopped (SIGTERM, then
    SIGKILL after ``30`` s) by :meth:`close`."""

    def __init__(self, pythonpath: str, kind: str, app: str, env: dict[str, str], label: str,
                 src: str | None = None, workers: int = 4, threads: int = 4,
                 registry_prefix: str = "bench", extra_args: Sequence[str] = ()) -> None:
        self.port = free_port()
        self.kind = kind
        self.registry = f"{registry_prefix}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        full_env = {**os.environ, "SHMCANCEL_REGISTRY": self.registry, **env}
        if src:  # first on the path, before what PYTHONPATH held (a bench's own additions)
            full_env["PYTHONPATH"] = os.pathsep.join(
                p for p in (os.path.abspath(src), os.environ.get("PYTHONPATH")) if p)
        gunicorn = Path(sys.executable).parent / "gunicorn"
        self.log = os.path.join(pythonpath, f"{label}.log")
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [str(gunicorn), "-c", str(ROOT / "examples/gunicorn/gunicorn.conf.py"),
                 "-b", f"127.0.0.1:{self.port}", "-w", str(workers), "-k", kind, "--threads",
                 str(threads) if kind == "gthread" else "1",
                 "--pythonpath", f"{pythonpath},{ROOT / 'examples/gunicorn'}", *extra_args, app],
                env=full_env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        try:
            while True:
                try:
                    with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                        break
                except OSError:
                    if time.monotonic() > deadline or self.proc.poll() is not None:
                        raise SystemExit(f"gunicorn did not start; see {self.log}") from None
                    time.sleep(0.05)
        except BaseException:  # also Ctrl-C while it starts: the caller never gets self
            self.close()
            raise

    def worker_pids(self) -> list[str]:
        """The master's children now (``/proc``), as text; none once it is gone."""
        try:
            return Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        except OSError:
            return []

    def worker_cpu(self) -> float:
        """CPU seconds (user + system, all threads, live or ended) of the workers now."""
        total = 0
        for pid in self.worker_pids():
            try:
                stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += int(stat[11]) + int(stat[12])
        return total / os.sysconf("SC_CLK_TCK")

    def worker_run_ns(self, by_name: dict[str, int] | None = None) -> int:
        """Nanoseconds the workers' live threads have run on a CPU (``/proc/<pid>/task/*/
        schedstat``): finer than :meth:`worker_cpu`'s clock ticks, for spans of milliseconds,
        but a thread that ended within the span loses its time (gunicorn's threads live as
        long as their worker). ``by_name``: also summed there by thread name (``comm``; a
        worker's main thread as ``"main"``)."""
        total = 0
        for pid in self.worker_pids():
            with contextlib.suppress(OSError):
                for task in os.listdir(f"/proc/{pid}/task"):
                    with contextlib.suppress(OSError, ValueError, IndexError):
                        ns = int(Path(f"/proc/{pid}/task/{task}/schedstat").read_text().split()[0])
                        total += ns
                        if by_name is not None:
                            name = "main" if task == pid else \
                                Path(f"/proc/{pid}/task/{task}/comm").read_text().strip()
                            by_name[name] = by_name.get(name, 0) + ns
        return total

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        if os.path.exists(f"/dev/shm/shmcancel.{self.registry}"):  # on_exit did not run
            from shmcancel import Registry, ShmCancelError

            with contextlib.suppress(ShmCancelError, OSError):
                Registry.attach(self.registry).unlink()


def post_request(port: int, body: dict[str, Any], headers: dict[str, str]) -> bytes:
    """One ``POST /mcp`` HTTP/1.1 request, as bytes."""
    raw = json.dumps(body).encode()
    head = ["POST /mcp HTTP/1.1", f"Host: 127.0.0.1:{port}", "Content-Type: application/json",
            "Accept: application/json, text/event-stream", f"Content-Length: {len(raw)}",
            *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + raw


def response_body(data: bytes) -> bytes | None:
    """The body of the one HTTP response in ``data`` once it is complete, else ``None``."""
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        return None
    length = 0
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length":
            length = int(v)
    return body[:length] if len(body) >= length else None


def session(port: int) -> str:
    """A new session's id (``initialize`` on the 2025-era wire)."""
    init = {"jsonrpc": "2.0", "id": 0, "method": "initialize",
            "params": {"protocolVersion": "2025-11-25", "capabilities": {},
                       "clientInfo": {"name": "bench", "version": "1"}}}
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(post_request(port, init, {}))
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    return next(line.split(b":", 1)[1].strip().decode()
                for line in data.split(b"\r\n\r\n")[0].split(b"\r\n")
                if line.lower().startswith(b"mcp-session-id:"))


def call_request(port: int, wire: str, name: str, arguments: dict[str, Any], rid: int = 1,
                 sid: str | None = None) -> bytes:
    """A ``tools/call`` of tool ``name`` on ``wire``: ``legacy`` in session ``sid`` (a new one,
    :func:`session`, when ``None``); ``modern``: stateless, the 2026-07-28 ``_meta`` and
    headers."""
    params: dict[str, Any] = {"name": name, "arguments": arguments}
    body = {"jsonrpc": "2.0", "id": rid, "method": "tools/call", "params": params}
    if wire == "modern":
        params["_meta"] = {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
                           "io.modelcontextprotocol/clientInfo": {"name": "bench", "version": "1"},
                           "io.modelcontextprotocol/clientCapabilities": {}}
        return post_request(port, body, {"MCP-Protocol-Version": "2026-07-28",
                                         "Mcp-Method": "tools/call", "Mcp-Name": name})
    return post_request(port, body, {"MCP-Protocol-Version": "2025-11-25",
                                     "Mcp-Session-Id": sid if sid is not None else session(port)})


def echo_request(port: int, wire: str) -> bytes:
    """A ``tools/call echo`` request on ``wire`` (see :func:`call_request`)."""
    return call_request(port, wire, "echo", {"text": "hello"})


async def load(port: int, req: bytes, seconds: float, conns: int, max_requests: int,
               latencies: list[float] | None = None,
               per_conn: int | None = None) -> tuple[int, int, float]:
    """``conns`` clients send ``req`` to ``port`` for ``seconds`` (at most ``max_requests`` in
    all), keep-alive while the server keeps the connection (and for ``per_conn`` requests at
    most, when given): ``(answered 200 with a result, other outcomes, elapsed seconds)``.
    ``latencies``: gets the seconds from sending each request to reading its whole answer, for
    the requests answered with a result (connecting not counted)."""
    ok = bad = started = 0
    t0 = time.monotonic()
    stop_at = t0 + seconds

    async def one_client() -> None:
        nonlocal ok, bad, started
        reader: asyncio.StreamReader | None = None
        writer: asyncio.StreamWriter | None = None
        on_conn = 0
        while time.monotonic() < stop_at and started < max_requests:
            started += 1
            on_conn += 1
            try:
                if writer is None:
                    reader, writer = await asyncio.wait_for(
                        asyncio.open_connection("127.0.0.1", port), 5)
                assert reader is not None and writer is not None
                sent = time.perf_counter()
                writer.write(req)
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
                length, close = 0, False
                for line in head.split(b"\r\n")[1:]:
                    k, _, v = line.partition(b":")
                    k = k.strip().lower()
                    if k == b"content-length":
                        length = int(v)
                    elif k == b"connection" and v.strip().lower() == b"close":
                        close = True
                body = await asyncio.wait_for(reader.readexactly(length), 10)
                if head.startswith(b"HTTP/1.1 200") and b'"result"' in body:
                    ok += 1
                    if latencies is not None:
                        latencies.append(time.perf_counter() - sent)
                else:
                    bad += 1
            except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError):
                bad += 1
                close = True
            if per_conn is not None and on_conn >= per_conn:
                close = True
            if close:
                on_conn = 0
            if close and writer is not None:
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
                reader = writer = None
        if writer is not None:
            writer.close()

    await asyncio.gather(*(one_client() for _ in range(conns)))
    return ok, bad, time.monotonic() - t0


_WRK_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0}


def _seconds(text: str) -> float:
    """A wrk duration (``"635.91us"``, ``"3.07ms"``, ``"1.00s"``, ``"1.02m"``) in seconds."""
    num = text.rstrip("usm")
    try:
        return float(num) * _WRK_UNITS[text[len(num):]]
    except (KeyError, ValueError):
        raise RuntimeError(f"cannot read wrk's duration {text!r}") from None


def wrk_load(wrk: str, port: int, req: bytes, seconds: float, conns: int,
             script_dir: str) -> dict[str, float]:
    """Load ``port`` with ``wrk`` sending ``req`` (a request made by :func:`post_request`) for
    ``seconds`` over ``conns`` connections (2 threads). Returns ``requests``, ``elapsed``
    (seconds), ``bad`` (non-2xx answers + socket errors) and the latency percentiles ``p50``,
    ``p75``, ``p90``, ``p99`` (seconds). wrk does not read bodies: check one answer first.
    Raises ``RuntimeError`` when wrk fails or its output cannot be read."""
    head, _, body = req.partition(b"\r\n\r\n")
    lines = ['wrk.method = "POST"', f"wrk.body = [==[{body.decode()}]==]"]
    for line in head.decode().split("\r\n")[1:]:
        k, _, v = line.partition(":")
        if k.lower() not in ("host", "content-length"):
            lines.append(f'wrk.headers["{k}"] = "{v.strip()}"')
    script = os.path.join(script_dir, f"wrk-{port}.lua")
    Path(script).write_text("\n".join(lines) + "\n")
    cmd = [wrk, "-t", "2", "-c", str(conns), "-d", f"{max(1, round(seconds))}s", "--latency",
           "--timeout", "10s", "-s", script, f"http://127.0.0.1:{port}/mcp"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60,
                             check=True).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(f"wrk failed: {e}") from None
    got: dict[str, float] = {"bad": 0.0}
    for raw in out.splitlines():
        parts = raw.split()
        if len(parts) == 2 and parts[0] in ("50%", "75%", "90%", "99%"):
            got[f"p{parts[0][:-1]}"] = _seconds(parts[1])
        elif len(parts) >= 4 and parts[1] == "requests" and parts[2] == "in":
            got["requests"] = float(parts[0])
            got["elapsed"] = _seconds(parts[3].rstrip(","))
        elif raw.strip().startswith("Non-2xx or 3xx responses:"):
            got["bad"] += float(parts[-1])
        elif raw.strip().startswith("Socket errors:"):
            got["bad"] += sum(int(x.rstrip(",")) for x in parts if x.rstrip(",").isdigit())
    if not {"requests", "elapsed", "p50", "p99"} <= got.keys():
        raise RuntimeError(f"cannot read wrk's output: {out[-500:]!r}")
    return got
