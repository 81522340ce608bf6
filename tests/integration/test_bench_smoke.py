"""``tools/bench.py`` (issue #9's report) runs to the end and prints its sections, a row per
alternative, and each target's verdict; it leaves nothing of its own in ``/dev/shm``. A functional
check only: no figure is asserted (the report is where the targets are checked)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.gunicorn_harness import REPO_ROOT
from helpers.procs import communicate
from helpers.tools import load_tool

from shmcancel.shm.registry import Registry

BENCH = REPO_ROOT / "tools" / "bench.py"
BURST = REPO_ROOT / "tools" / "bench_burst.py"
ALTERNATIVES = ("shmcancel", "redis GET flag", "Manager dict", "sqlite WAL")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def run_bench(*args: str, env: dict[str, str] | None = None,
              script: Path = BENCH) -> tuple[int, str, int]:
    """``(exit code, stdout + stderr, pid)`` of one run, killed past its deadline."""
    proc = subprocess.Popen([sys.executable, str(script), *args], cwd=REPO_ROOT, env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    out, _, overran = communicate(proc, 420)
    if overran:
        pytest.fail(f"{script.name} did not finish in 420 s:\n{out[-3000:]}")
    return proc.returncode, out, proc.pid


def sections(out: str) -> dict[str, str]:
    """The text under each ``== name`` heading."""
    parts = re.split(r"^== (\w+)", out, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def leftovers(pid: int) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if "bench" in n and f"-{pid}-" in n]


def test_quick_report_prints_every_section_and_alternative() -> None:
    rc, out, pid = run_bench("--quick", "--only", "poll,write,footprint")
    assert rc == 0, out[-3000:]
    got = sections(out)
    assert {"poll", "write", "footprint", "targets"} <= got.keys(), out
    assert "scaling" not in got and "e2e" not in got, "--only ran a section it was not given"
    redis_there = shutil.which("redis-server") is not None
    for name in ("poll", "write", "footprint"):
        for alt in ALTERNATIVES:
            assert alt in got[name], f"no {alt!r} line in section {name}:\n{got[name]}"
        skipped = "redis GET flag: skipped: no redis-server" in got[name]
        assert skipped != redis_there, got[name]
    assert "floor" in got["poll"] and "x floor" in got["write"]
    # every issue #9 target it measured has a verdict
    verdicts = [line for line in got["targets"].splitlines()
                if line.strip().startswith(("met", "MISSED"))]
    assert any("begin + end" in v for v in verdicts), got["targets"]
    assert any("c.cancelled(id, scope)" in v for v in verdicts), got["targets"]
    assert any("default segment" in v for v in verdicts), got["targets"]
    assert leftovers(pid) == []


def test_without_redis_server_the_redis_rows_say_skipped(tmp_path: Path) -> None:
    # An empty PATH: no redis-server to be found (the script runs by absolute paths otherwise).
    env = {**os.environ, "PATH": str(tmp_path)}
    rc, out, pid = run_bench("--quick", "--only", "poll", env=env)
    assert rc == 0, out[-3000:]
    poll = sections(out)["poll"]
    assert "redis GET flag: skipped: no redis-server" in poll, poll
    for alt in ("shmcancel", "Manager dict", "sqlite WAL"):
        assert alt in poll
    assert leftovers(pid) == []


def test_burst_bench_cancels_every_call_and_prints_what_the_burst_cost() -> None:
    """Both wires, a small burst: every call cancelled (none lost), latencies and the CPU the
    bursts cost (the bound they set on this machine's cores) printed for every mode, the bare
    gunicorn's included, and on the legacy wire the bare burst (held calls released by a
    datagram each). Fewer calls than a worker's threads: else one worker may run them all and
    queue the notifications behind them (gthread accepts past its threads)."""
    rc, out, pid = run_bench("--calls", "3", "--rounds", "1", "--seq", "2", "--workers", "2",
                             "--threads", "4", "--wire", "both", script=BURST)
    assert rc == 0, out[-3000:]
    assert "lost" not in out, out
    for wire in ("legacy", "modern"):
        block = out.split(f"{wire} (", 1)[1].split("target burst", 1)[0]
        modes = ("sequential", "burst", "floor", "bare") + (("bare burst",) if wire == "legacy"
                                                            else ())
        for mode in modes:
            assert re.search(rf"^  {mode} +n= +\d+ +p50", block, re.M), block
            cpu = re.search(rf"^  {mode} +workers +([\d.]+) +this client +([\d.]+) +-> at "
                            r"least +([\d.]+) ms", block, re.M)
            assert cpu is not None, block
            assert float(cpu[1]) > 0, f"the workers did no work in {mode}?\n{block}"
    assert leftovers(pid) == []


def test_burst_bench_measures_the_modern_wire_with_every_thread_taken() -> None:
    """On the 2026-07-28 wire a close cancels, seen by the worker's watcher thread: a worker
    whose threads all run calls still cancels them, so such a round is measured, not skipped
    as on the legacy wire (there a notification would wait for a thread). With one thread a
    worker, every round has such a worker: skipping them measured nothing (exit 1)."""
    rc, out, pid = run_bench("--calls", "1", "--rounds", "1", "--seq", "2", "--workers", "2",
                             "--threads", "1", "--wire", "modern", script=BURST)
    assert rc == 0, out[-3000:]
    assert re.search(r"^  burst +n= +1 +p50", out, re.M), out
    assert leftovers(pid) == []


def test_burst_bench_by_thread_names_each_kind_of_thread() -> None:
    """``--by-thread`` names the gunicorns' threads by role and splits the workers' CPU a burst
    by them: request threads (``pool``), main threads, and our watcher threads (``disconnect``),
    which the bare app has none of."""
    rc, out, pid = run_bench("--calls", "3", "--rounds", "1", "--seq", "1", "--workers", "2",
                             "--threads", "4", "--wire", "legacy", "--by-thread", script=BURST)
    assert rc == 0, out[-3000:]
    block = out.split("by thread (--by-thread", 1)[1].split("target burst", 1)[0]
    lines = {m[1]: m[2] for m in re.finditer(r"^  (burst|bare burst|floor) +(.*)$", block, re.M)}
    cpu = {mode: dict(re.findall(r"([\w-]+) ([\d.]+)", text)) for mode, text in lines.items()}
    assert float(cpu["burst"]["pool"]) > 0 and "main" in cpu["burst"], block
    assert "disconnect" in cpu["burst"] and "disconnect" not in cpu["bare burst"], block
    assert leftovers(pid) == []


def test_burst_bench_counts_the_workers_calls_by_kind_of_code() -> None:
    """``--count-calls`` counts the interpreter calls the workers make per cancelled call while
    each burst runs (switched on and off in every worker, acknowledged): our code's calls in
    the burst, none in the bare app's, and gunicorn's in both; with ``--by-thread`` beside it
    (both go to the gunicorns through one ``sitecustomize``)."""
    rc, out, pid = run_bench("--calls", "3", "--rounds", "1", "--seq", "1", "--workers", "2",
                             "--threads", "4", "--wire", "legacy", "--by-thread",
                             "--count-calls", script=BURST)
    assert rc == 0, out[-3000:]
    assert "by thread (--by-thread" in out, out[-3000:]
    block = out.split("(--count-calls", 1)[1].split("target burst", 1)[0]
    lines = {m[1]: m[2] for m in re.finditer(r"^  (burst|bare burst|floor|bare) +(total .*)$",
                                             block, re.M)}
    calls = {mode: {k: float(v) for k, v in re.findall(r"(total|\w+) +([\d.]+) ?", text)}
             for mode, text in lines.items()}
    # under a loaded machine a span may go uncounted (a worker acknowledging late) or a round
    # unmeasured (every try skipped): the report then says so for that mode
    missing = {m for m in ("burst", "floor", "bare", "bare burst") if re.search(
        rf"^  {m} +(not counted|no samples)", out, re.M)}
    assert "burst" not in missing, out[-3000:]
    assert set(calls) == {"burst", "floor", "bare", "bare burst"} - missing, block
    assert calls["burst"]["shmcancel"] > 0, block
    assert calls["burst"]["total"] >= calls["burst"]["shmcancel"] + calls["burst"]["gunicorn"]
    if "bare burst" not in missing:
        assert calls["bare burst"]["shmcancel"] == 0, block
        assert calls["burst"]["gunicorn"] > 0 and calls["bare burst"]["gunicorn"] > 0, block
        assert re.search(r"^  burst / bare burst: [\d.]+x the calls$", block, re.M), block
    assert leftovers(pid) == []


def test_burst_bench_check_fails_a_missed_target() -> None:
    """``--check`` turns a missed target into exit 1 (a target no burst can meet here)."""
    rc, out, pid = run_bench("--calls", "2", "--rounds", "1", "--seq", "1", "--workers", "2",
                             "--threads", "4", "--wire", "legacy", "--target-ms", "0.0001",
                             "--check", script=BURST)
    assert rc == 1, out[-3000:]
    assert "target burst p99 <= 0.0001 ms: MISSED" in out, out[-3000:]
    assert leftovers(pid) == []


def test_saturated_worker_runs_its_trials_and_leaves_nothing() -> None:
    """tools/saturated_worker.py (README, Limits): a short run ends every trial (each cancel
    answered, the other call ended by its closed connection) and prints its summary."""
    rc, out, pid = run_bench("--trials", "3", "--sleep", "1", "--worker-connections", "2",
                             script=REPO_ROOT / "tools" / "saturated_worker.py")
    assert rc == 0, out[-3000:]
    assert re.search(r"^gthread 2x2, worker_connections 2, 3 trials of two 1 s calls: both on "
                     r"one worker \d times; cancel latency p50 [\d.]+ ms", out, re.M), out
    assert leftovers(pid) == []


def _readme_tools() -> list[str]:
    """Every ``tools/<script>.py`` a README in the repository tells a newcomer to run."""
    found: set[str] = set()
    for readme in [REPO_ROOT / "README.md", *sorted(REPO_ROOT.glob("examples/*/README.md"))]:
        found.update(re.findall(r"\.venv/bin/python (tools/\w+\.py)", readme.read_text()))
    return sorted(found)


def test_the_readmes_name_the_benches() -> None:
    assert {"tools/bench.py", "tools/bench_sdk.py", "tools/bench_redis.py",
            "tools/bench_table.py"} <= set(_readme_tools())


@pytest.mark.parametrize("script", _readme_tools())
def test_every_script_a_readme_names_starts(script: str) -> None:
    """Each imports what it needs and parses its arguments (one broke by importing a test
    helper from a path it did not put on ``sys.path``)."""
    rc, out, _ = run_bench("--help", script=REPO_ROOT / script)
    assert rc == 0 and "usage:" in out and "Traceback" not in out, out[-3000:]


def test_sdk_bench_cancels_across_workers_and_compares_throughput() -> None:
    """A small run of tools/bench_sdk.py: its cancels find the call in flight (its row may be
    in a process's lane, not the table: the run once timed out on that) and land -32800."""
    rc, out, pid = run_bench("--cancels", "2", "--seconds", "0.5", "--rounds", "1",
                             "--hop-calls", "4", script=REPO_ROOT / "tools" / "bench_sdk.py")
    assert rc == 0, out[-3000:]
    for tool in ("sleep", "sleep_sync"):
        assert re.search(rf"^cancel {tool} +n=2 p50=", out, re.M), out
    assert "echo throughput" in out and leftovers(pid) == []


def test_bad_only_is_a_one_line_usage_error() -> None:
    rc, out, _ = run_bench("--only", "poll,nonsense")
    assert rc == 2
    assert "--only takes sections of" in out and "Traceback" not in out


@pytest.mark.parametrize("per_conn,connections", [(None, 1), (3, 4)])
def test_the_load_generator_reconnects_every_per_conn_requests(per_conn: int | None,
                                                               connections: int) -> None:
    """One client, 10 requests to a keep-alive server on loopback: on one connection, or on a
    new one every ``per_conn`` requests (how bench.py spreads gthread load over workers)."""
    import asyncio

    from helpers.tools import load_tool

    benchlib = load_tool("_benchlib")
    body = b'{"jsonrpc":"2.0","id":1,"result":{}}'
    reply = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    conns = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conns.append(writer)
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                writer.write(reply)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def main() -> tuple[int, int, float]:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            return await benchlib.load(port, b"GET / HTTP/1.1\r\n\r\n", 5.0, 1, 10,
                                       per_conn=per_conn)

    ok, bad, _ = asyncio.run(main())
    assert (ok, bad) == (10, 0)
    assert len(conns) == connections  # with per_conn=3: 3 + 3 + 3 + 1 requests


def test_cancel_and_table_benches_have_their_writers_write() -> None:
    """tools/bench_cancel.py's and tools/bench_table.py's "with writers" columns are measured
    with every writer writing (each checks its writers' own counts and exits 1 with
    ``INVALID`` otherwise: bench_cancel's writer once failed on its scope's quota within 0.1 s
    and its column had no writer); every target gets a verdict."""
    rc, out, pid = run_bench("--batches", "10", "--batch", "200", "--writers", "2",
                             script=REPO_ROOT / "tools" / "bench_cancel.py")
    assert rc == 0 and "INVALID" not in out, out[-3000:]
    assert re.search(r"^writers: 2 processes, [\d.]+k .*\(0 failed\)$", out, re.M), out
    assert "begin + end, 4 threads vs 1 thread" in out and leftovers(pid) == []
    rc, out, pid = run_bench("--batches", "3",
                             script=REPO_ROOT / "tools" / "bench_table.py")
    assert rc == 0 and "INVALID" not in out, out[-3000:]
    assert re.search(r"writer: ~\d+k insert\+delete pairs/s", out), out
    assert re.search(r"^overall: ", out, re.M) and leftovers(pid) == []


def test_cancel_bench_ends_its_writers_between_pairs(shm_name: str) -> None:
    """bench_cancel's writer processes end between two write pairs, never killed inside one:
    a writer SIGKILLed with the registry lock held left the bench a dead holder to recover
    (and a "took over the lock" warning in most runs)."""
    bench = load_tool("bench_cancel")
    reg = Registry.create(shm_name)
    try:
        for _ in range(3):
            with bench._writers(shm_name, 4) as (_counters, pids):
                assert len(pids) == 4
            assert not [p for p in pids if os.path.exists(f"/proc/{p}")]
            with reg.lock:  # a dead holder would be recovered, and counted, here
                pass
            assert reg.recoveries == 0
    finally:
        reg.close()
        reg.unlink()


@pytest.mark.parametrize("mode", ["", "--chunks", "--writer"])
def test_sweeps_bench_gives_each_target_a_verdict(mode: str) -> None:
    rc, out, pid = run_bench("--rows", "400", "--reps", "1", "--seconds", "0.2",
                             *([mode] if mode else []),
                             script=REPO_ROOT / "tools" / "bench_sweeps.py")
    assert rc == 0, out[-3000:]
    tail = {"": "", "--chunks": r" \(row by row: .*\)", "--writer": r" \(beside a writer\)"}[mode]
    verdicts = re.findall(rf"^  target .*<= 1 ms (met|MISSED), .* ms <= 10 ms (?:met|MISSED)"
                          rf"{tail}$", out, re.M)
    assert len(verdicts) == 6, out  # three operations over two shapes of table
    assert "a scope per row" in out and "60 scopes" in out, out
    if mode == "--writer":
        m = re.search(r"the writer: ([\d,]+) cancel \+ clear pairs/s; the rewrites deleted "
                      r"(\d+) rows, left (\d+)", out)
        assert m and int(m[1].replace(",", "")) > 0 and int(m[2]) > 0, out
    assert leftovers(pid) == []
