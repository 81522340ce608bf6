"""Black-box conformance with docs/contract.md, clause by clause, as an outside tester would
check it.

Only the names the contract gives are used: ``import shmcancel`` and its public API, the example
server run unmodified under a real gunicorn (``examples/gunicorn/gunicorn.conf.py``, one per
module), and the ``shmtool`` console script in a real subprocess. Every test is named for its
clause. Waits poll with deadlines; processes are stopped by pid (the harness) in ``finally``.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

import httpx
import pytest
from helpers.clock import Clock
from helpers.gunicorn_harness import Gunicorn, wait_until
from helpers.mcp_client import ACCEPT, LEGACY, MODERN, meta

import shmcancel
from shmcancel import errors, principal, telemetry

CONF = "examples/gunicorn/gunicorn.conf.py"
META = meta("conformance")
DEADLINE = 10.0  # seconds any single wait may take before the test fails


# ------------------------------------------------------------------------------ helpers


@pytest.fixture
def reg(shm_name: str) -> Iterator[shmcancel.Registry]:
    r = shmcancel.Registry.create(shm_name, config=shmcancel.Config())
    try:
        yield r
    finally:
        r.close()
        r.unlink()


def make(name: str, **config: Any) -> shmcancel.Registry:
    return shmcancel.Registry.create(name, config=shmcancel.Config(**config))


def deadline() -> float:
    return time.monotonic() + DEADLINE


# ------------------------------------------------------------------------------ §2 Registry


def test_s2_every_documented_error_derives_from_ShmCancelError() -> None:
    for n in ("RegistryNotFound", "RegistryIncompatible", "TableFull", "InvalidRequestId",
              "CancellationLimitReached"):
        assert issubclass(getattr(shmcancel, n), shmcancel.ShmCancelError), n


def test_s2_attach_reads_the_config_from_the_segment(shm_name: str) -> None:
    r = make(shm_name, max_rows=40, max_rows_per_scope=7, ttl=12.5)
    try:
        a = shmcancel.Registry.attach(shm_name)
        try:
            assert (a.config.max_rows, a.config.max_rows_per_scope, a.config.ttl) == (40, 7, 12.5)
        finally:
            a.close()
    finally:
        r.close()
        r.unlink()
    with pytest.raises(shmcancel.RegistryNotFound):
        shmcancel.Registry.attach(shm_name)


def test_s2_config_ttl_zero_is_a_valid_strict_ttl(shm_name: str) -> None:
    """``ttl``: a row older than this (strictly) is removed; 0 is a meaningful value."""
    r = make(shm_name, ttl=0)
    try:
        clock = Clock(50.0)
        c = shmcancel.Cancellation(r, clock=clock)
        c.cancel(1)
        assert c.cleanup() == 0  # age 0 is not > 0
        clock.t += 0.001
        assert c.cleanup() == 1
    finally:
        r.close()
        r.unlink()


# ------------------------------------------------------------------------------ §3 Scope


@pytest.mark.parametrize("p, stored", [
    ("alice", "alice"),
    (42, "42"),
    (True, None),
    (False, None),
    (None, None),
    ({"id": "x", "role": "admin"}, "x"),
    ({"id": None, "sub": "s"}, "s"),
    ({"sub": 8}, "8"),
    ({"id": 7}, "7"),
    ({"id": {"id": {"sub": 3}}}, "3"),
    ({"id": None}, None),
    (1.5, None),
])
def test_s3_principal_put_normalises(p: object, stored: str | None) -> None:
    env: dict[str, Any] = {"REMOTE_ADDR": "203.0.113.9"}
    principal.put(env, p)
    assert env["shmcancel.principal"]["id"] == stored
    assert principal.id(env) == stored
    expected = f"principal:{stored}" if stored is not None else "ip:203.0.113.9"
    assert shmcancel.Cancellation.scope(env) == expected


def test_s3_principal_id_ignores_non_str_ids_set_without_put() -> None:
    for bad in (123, {"id": "x"}, ["x"]):
        env = {"shmcancel.principal": {"id": bad}, "REMOTE_ADDR": "198.51.100.1"}
        assert principal.id(env) is None
        assert shmcancel.Cancellation.scope(env) == "ip:198.51.100.1"


@pytest.mark.parametrize("addr, bucket", [
    ("203.0.113.9", "203.0.113.9"),
    ("::ffff:203.0.113.9", "203.0.113.9"),
    ("2001:db8:1:2:3:4:5:6", "2001:db8:1:2::/64"),
    ("2001:0db8:0001:0002:ffff::1", "2001:db8:1:2::/64"),
    ("2001:db8::1", "2001:db8::/64"),
    ("not an address", "unknown"),
    ("", "unknown"),
    (None, "unknown"),
])
def test_s3_client_bucket(addr: str | None, bucket: str) -> None:
    env = {} if addr is None else {"REMOTE_ADDR": addr}
    assert principal.client_bucket(env) == bucket


def test_s3_scope_order_and_namespaces() -> None:
    scope = shmcancel.Cancellation.scope
    both = principal.put({"shmcancel.session_id": "S", "REMOTE_ADDR": "203.0.113.9"}, "P")
    assert scope(both) == "session:S"
    assert scope({**both, "shmcancel.session_id": ""}) == "principal:P"
    assert scope(None) == "global"
    assert scope(principal.put({}, "203.0.113.9")) != scope({"REMOTE_ADDR": "203.0.113.9"})


def test_s3_long_ids_become_a_digest_keeping_the_prefix() -> None:
    scope = shmcancel.Cancellation.scope
    fits = scope({"shmcancel.session_id": "a" * (512 - len("session:"))})
    assert len(fits.encode()) == 512 and fits.endswith("a")
    long1 = scope({"shmcancel.session_id": "a" * 505})
    long2 = scope({"shmcancel.session_id": "a" * 506})
    assert long1.startswith("session:") and long2.startswith("session:")
    assert long1 != long2 and len(long1) == len(long2) and len(long1.encode()) <= 512
    p = scope(principal.put({}, "é" * 300))
    assert p.startswith("principal:") and len(p.encode()) <= 512


# ------------------------------------------------------------------------------ §4 API


def test_s4_signatures_positional_and_keyword(reg: shmcancel.Registry) -> None:
    c = shmcancel.Cancellation(reg, clock=time.time)
    c.cancel(1, "why", "s")
    assert c.cancelled(1, "s") and c.reason(1, "s") == "why"
    c.cancel(request_id=2, reason="k", scope="s")
    assert c.cancelled(conn_or_request_id=2, scope="s") and c.reason(request_id=2, scope="s") == "k"
    c.cancel(3)  # scope defaults to "global"
    assert c.cancelled(3) and c.cancelled(3, "global") and c.reason(3) is None
    c.clear(3, "global")
    assert not c.cancelled(3)
    c.clear(request_id=2, scope="s")
    assert not c.cancelled(2, "s")
    c.track(9, "s")
    assert c.in_flight(9, "s") and c.in_flight(request_id=9, scope="s")
    c.untrack(request_id=9, scope="s")
    assert not c.in_flight(9, "s")
    assert c.cleanup() == 0 and c.cleanup(None) == 0 and c.cleanup(ttl=None) == 0
    assert c.scope({"shmcancel.session_id": "x"}) == "session:x"


def test_s4_1_ids_of_256_bytes_are_valid_257_are_not(reg: shmcancel.Registry) -> None:
    c = shmcancel.Cancellation(reg)
    for ok in ("x" * 256, "é" * 128, "€" * 85 + "x"):
        c.cancel(ok, None, "s")
        assert c.cancelled(ok, "s")
    before = reg_rows(c)
    for bad in ("x" * 257, "é" * 128 + "x", 1.0, True, False, [1], {"a": 1}):
        with pytest.raises(shmcancel.InvalidRequestId):
            c.cancel(bad, None, "s")
        assert not c.cancelled(bad, "s") and c.reason(bad, "s") is None
        assert not c.in_flight(bad, "s")
        c.track(bad, "s")  # ignored: no row, no exception
        assert c.clear(bad, "s") is None
    assert json.loads(run_shmtool("dump", reg.name, "--json").stdout)["in_flight"] == []
    for bad in ("x" * 257, 1.0, True, [1]):
        c.untrack(bad, "s")  # ignored too
    assert reg_rows(c) == before
    c.cancel(None)
    assert not c.cancelled(None) and c.reason(None) is None
    c.cancel(42, None, "s")
    assert c.cancelled("42", "s")


def reg_rows(c: shmcancel.Cancellation) -> int:
    return len(_dump_rows(c))


def _dump_rows(c: shmcancel.Cancellation) -> list[Any]:
    return [k for k, _ in c.registry.table("cancellations").scan()]  # type: ignore[union-attr]


def test_s4_2_reasons_are_clamped_stripped_and_cut(reg: shmcancel.Registry) -> None:
    # Through the public API: the stored reason is what reason() returns.
    stripped = [*range(0x00, 0x20), *range(0x7F, 0xA0), 0x061C, *range(0x200B, 0x2010),
                *range(0x2028, 0x202F), 0x2060, *range(0x2066, 0x206A), 0xFEFF]
    kept = [0x20, 0xA0, 0x061B, 0x200A, 0x2010, 0x2027, 0x202F, 0x205F, 0x2061, 0x206A, 0xFEFE]
    cases: list[tuple[object, str | None]] = [
        (None, None),
        ("a" + "".join(map(chr, stripped)) + "b", "ab"),
        ("".join(map(chr, kept)), "".join(map(chr, kept))),
        (12, "12"),
        (b"x", "b'x'"),
        ("\t" * 800 + "hello", ""),            # clamp to 800 bytes first, then strip
        ("\t" * 10 + "x" * 300, "x" * 200),    # strip, then cut to 200 characters
        ("a" * 799 + "é", "a" * 200),          # no broken character at the 800-byte clamp
        ("€" * 300, "€" * 200),
    ]
    c = shmcancel.Cancellation(reg)
    for i, (given, stored) in enumerate(cases):
        c.cancel(i, given, "s")
        assert c.reason(i, "s") == stored, given


def test_s4_3_cancel_of_an_existing_key_overwrites_and_counts_once(shm_name: str) -> None:
    r = make(shm_name, max_rows=4, max_rows_per_scope=2)
    try:
        clock = Clock(1_000.0)
        c = shmcancel.Cancellation(r, clock=clock)
        c.cancel(1, "a", "s")
        c.cancel(2, "b", "s")
        clock.t += 1.5
        c.cancel(2, "again", "s")  # at quota: an overwrite passes, runs neither check
        assert c.reason(2, "s") == "again"
        with pytest.raises(shmcancel.CancellationLimitReached):
            c.cancel(3, None, "s")
        c.cancel(1, None, "t")
        c.cancel(2, None, "t")  # table at max_rows=4
        c.cancel(2, "over", "t")  # existing key at the cap: no eviction
        assert len(_dump_rows(c)) == 4
        assert all(c.cancelled(i, s) for i in (1, 2) for s in ("s", "t"))
    finally:
        r.close()
        r.unlink()


def test_s4_3_cancelled_at_is_the_clock_value_unrounded(reg: shmcancel.Registry,
                                                        shm_name: str) -> None:
    c = shmcancel.Cancellation(reg, clock=lambda: 1234.5678901234567)
    c.cancel(1, None, "s")
    out = run_shmtool("dump", shm_name, "--json")
    assert out.returncode == 0
    (row,) = json.loads(out.stdout)["cancellations"]
    assert row["cancelled_at"] == 1234.5678901234567


def test_s4_3_cancelled_conn_without_a_handle_uses_the_attached_registry(
        reg: shmcancel.Registry) -> None:
    c = shmcancel.Cancellation(reg)
    conn = {"shmcancel.request_id": 7, "shmcancel.session_id": "abc"}
    assert not shmcancel.cancelled(conn) and not c.cancelled(conn)
    c.cancel(7, scope="session:abc")
    assert shmcancel.cancelled(conn) and c.cancelled(conn)
    assert shmcancel.cancelled({**conn, "shmcancel.request_id": "7"})
    assert not shmcancel.cancelled({"shmcancel.session_id": "abc"})  # no request id
    assert not shmcancel.cancelled({**conn, "shmcancel.session_id": "other"})
    assert not shmcancel.cancelled(None) and not shmcancel.cancelled({})


def test_s4_6_cancelled_conn_keeps_working_when_another_attachment_closes(
        reg: shmcancel.Registry, shm_name: str) -> None:
    """``shmcancel.cancelled(conn)`` uses "the process's attached registry": closing a second
    attachment (a simulated other process, say) leaves the first one in use."""
    other = shmcancel.Registry.attach(shm_name)
    try:
        shmcancel.Cancellation(other).cancel(7, scope="session:abc")
    finally:
        other.close()
    conn = {"shmcancel.request_id": 7, "shmcancel.session_id": "abc"}
    assert shmcancel.cancelled(conn)
    reg.close()
    assert not shmcancel.cancelled(conn)  # no registry left: False, never raises


def _eviction_expected(rows: list[tuple[str, str, float]], batch: int) -> set[tuple[str, str]]:
    size = Counter(s for s, _, _ in rows)
    ranked = sorted(rows, key=lambda r: (-size[r[0]], r[2], r[0], r[1]))
    return {(s, i) for s, i, _ in ranked[:batch]}


@pytest.mark.parametrize("max_rows, capacity", [(40, None), (None, 60)])
def test_s4_4_eviction_batch_and_order(shm_name: str, max_rows: int | None,
                                       capacity: int | None) -> None:
    kw: dict[str, Any] = {"max_rows": max_rows, "max_rows_per_scope": None}
    if capacity is not None:
        kw["capacity"] = capacity
    r = make(shm_name, **kw)
    try:
        cap = max_rows if max_rows is not None else capacity
        assert cap is not None
        batch = max(1, cap // 20)
        clock = Clock(1_000.0)
        c = shmcancel.Cancellation(r, clock=clock)
        rows = []
        sizes = {"big": cap // 2, "mid": cap // 4}
        sizes["small"] = cap - sizes["big"] - sizes["mid"]
        order = [s for s, n in sizes.items() for _ in range(n)]
        order = order[1::2] + order[::2]  # interleave ages across scopes
        for i, s in enumerate(order):
            clock.t += 0.0001 * ((i * 7919) % 13 + 1)  # sub-millisecond differences matter
            c.cancel(i, None, s)
            rows.append((s, str(i), clock.t))
        assert len(_dump_rows(c)) == cap
        clock.t += 1
        c.cancel("new", None, "small")
        left = {(s, i) for s, i in _dump_rows(c)}
        gone = {(s, i) for s, i, _ in rows} - left
        assert gone == _eviction_expected(rows, batch)
        assert len(left) == cap - batch + 1
    finally:
        r.close()
        r.unlink()


def track_in_a_process_that_exits(name: str, request_ids: Iterable[int], scope: str) -> None:
    """A forked process attaches ``name``, tracks ``request_ids`` in ``scope`` and exits
    (reaped): the in-flight rows it leaves have a dead owner."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            child = shmcancel.Cancellation(shmcancel.Registry.attach(name))
            for i in request_ids:
                child.track(i, scope)
            os.write(wfd, b"x")
        finally:
            os._exit(0)
    os.close(wfd)
    assert os.read(rfd, 1) == b"x"
    os.close(rfd)
    os.waitpid(pid, 0)


def test_s4_5_track_raises_TableFull_when_live_owners_hold_every_row(shm_name: str) -> None:
    r = make(shm_name, in_flight_capacity=4)
    try:
        c = shmcancel.Cancellation(r)
        for i in range(4):
            c.track(i, "s")
        with pytest.raises(shmcancel.TableFull):
            c.track(99, "s")
        # Rows of a dead owner make room.
        for i in range(4):
            c.untrack(i, "s")
        track_in_a_process_that_exits(shm_name, range(4), "dead")
        c.track(99, "s")
        assert c.in_flight(99, "s") and not c.in_flight(0, "dead")
    finally:
        r.close()
        r.unlink()


def test_s4_5_namesakes_each_hold_a_row(reg: shmcancel.Registry) -> None:
    c = shmcancel.Cancellation(reg)
    c.track(5, "x")
    t = threading.Thread(target=c.track, args=(5, "x"))
    t.start()
    t.join()
    c.untrack(5, "x")
    assert c.in_flight(5, "x")


def test_s4_6_cleanup_is_strict_and_returns_the_cancellation_rows_removed(
        shm_name: str) -> None:
    r = make(shm_name, ttl=10)
    try:
        clock = Clock(0.0)
        c = shmcancel.Cancellation(r, clock=clock)
        c.cancel(1)
        c.cancel(2, None, "s")
        c.track(3, "s")  # a live owner's in-flight row is not counted nor removed
        clock.t = 10.0
        assert c.cleanup() == 0
        clock.t = 10.0001
        assert c.cleanup() == 2
        c.cancel(4)
        clock.t = 15.0
        assert c.cleanup(ttl=5.0) == 0 and c.cleanup(4.9) == 1
        assert c.in_flight(3, "s")
    finally:
        r.close()
        r.unlink()


def test_s4_6_janitor_sweeps_while_the_registry_is_only_read(shm_name: str) -> None:
    """The janitor needs no help from the user: a process that only reads (``reason``,
    ``in_flight``) still gets expired rows and dead owners' rows swept, from one
    ``janitor_interval`` after creation."""
    r = make(shm_name, janitor_interval=0.3, ttl=1)
    try:
        old = shmcancel.Cancellation(r, clock=lambda: time.time() - 100)
        old.cancel(9, "expired", "s")
        track_in_a_process_that_exits(shm_name, [5], "dead")
        c = shmcancel.Cancellation(r)
        assert c.reason(9, "s") == "expired" and c.in_flight(5, "dead")  # no sweep before
        wait_until(lambda: c.reason(9, "s") is None, deadline(), what="reason() to sweep")
        assert not c.in_flight(5, "dead")
    finally:
        r.close()
        r.unlink()


def test_s4_6_janitor_sweeps_when_only_in_flight_is_polled(shm_name: str) -> None:
    r = make(shm_name, janitor_interval=0.3, ttl=1)
    try:
        track_in_a_process_that_exits(shm_name, [5], "dead")
        assert r.table("in_flight").count() == 1  # (read without a janitor's turn)
        c = shmcancel.Cancellation(r)
        wait_until(lambda: not c.in_flight(5, "dead"), deadline(),
                   what="in_flight() to sweep a dead owner's row")
    finally:
        r.close()
        r.unlink()


def test_s4_7_telemetry_events(reg: shmcancel.Registry) -> None:
    seen: list[tuple[Any, ...]] = []

    def h(event: Any, measurements: Any, metadata: Any, config: Any) -> None:
        seen.append((event, dict(measurements), dict(metadata), config))

    telemetry.attach("conf-c", ("shmcancel", "request", "cancelled"), h, {"k": 1})
    telemetry.attach("conf-u", ("shmcancel", "cancellation", "cleanup"), h)
    try:
        c = shmcancel.Cancellation(reg)
        c.cancel(5, "why", "s")
        c.cleanup()
        ev, m, md, cfg = seen[0]
        assert tuple(ev) == ("shmcancel", "request", "cancelled") and m == {"count": 1}
        assert {k: md[k] for k in ("request_id", "scope", "reason")} == \
            {"request_id": "5", "scope": "s", "reason": "why"}
        assert cfg == {"k": 1}
        ev, m, md, cfg = seen[1]
        assert tuple(ev) == ("shmcancel", "cancellation", "cleanup")
        assert m == {"removed": 0, "in_flight_removed": 0} and md == {} and cfg is None
        # a raising handler is detached and never propagates; attach replaces; detach no-op
        telemetry.attach("conf-c", ("shmcancel", "request", "cancelled"),
                         lambda *a: 1 / 0)
        c.cancel(6, None, "s")
        n = len(seen)
        c.cancel(7, None, "s")
        assert len(seen) == n
        telemetry.detach("conf-never-attached")
    finally:
        telemetry.detach("conf-c")
        telemetry.detach("conf-u")


def test_s5_error_codes() -> None:
    assert (errors.PARSE_ERROR, errors.INVALID_REQUEST, errors.METHOD_NOT_FOUND,
            errors.INVALID_PARAMS, errors.INTERNAL_ERROR, errors.SERVER_ERROR,
            errors.REQUEST_CANCELLED, errors.HEADER_MISMATCH,
            errors.UNSUPPORTED_PROTOCOL_VERSION) == (
        -32700, -32600, -32601, -32602, -32603, -32000, -32800, -32020, -32022)
    assert errors.request_cancelled() == -32800


# ------------------------------------------------------------------------------ §7 shmtool


def run_shmtool(*args: str) -> subprocess.CompletedProcess[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "shmtool")
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "shmcancel.shmtool"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=30)


def test_s7_shmtool_commands(reg: shmcancel.Registry, shm_name: str) -> None:
    c = shmcancel.Cancellation(reg)
    c.cancel(1, "why", "s")
    c.track(2, "s")
    assert shm_name in run_shmtool("list").stdout
    out = run_shmtool("dump", shm_name, "--json")
    assert out.returncode == 0
    d = json.loads(out.stdout)
    (can,) = d["cancellations"]
    assert {k: can[k] for k in ("scope", "request_id", "reason")} == \
        {"scope": "s", "request_id": "1", "reason": "why"}
    assert isinstance(can["cancelled_at"], float)
    (fl,) = d["in_flight"]
    assert {k: fl[k] for k in ("scope", "request_id", "pid", "alive")} == \
        {"scope": "s", "request_id": "2", "pid": os.getpid(), "alive": True}
    human = run_shmtool("dump", shm_name)
    assert human.returncode == 0
    lines = human.stdout.splitlines()
    assert any(line.startswith("s ") and "why" in line for line in lines), human.stdout
    assert any(line.startswith("s ") and str(os.getpid()) in line and "alive" in line
               for line in lines), human.stdout
    stats = run_shmtool("stats", shm_name)
    assert stats.returncode == 0 and "TABLE" in stats.stdout
    rows = json.loads(run_shmtool("stats", shm_name, "--json").stdout)["rows"]
    assert (rows["cancellations"], rows["in_flight"]) == (1, 1)
    cleaned = run_shmtool("cleanup", shm_name)
    assert cleaned.returncode == 0
    assert cleaned.stdout.strip() == "removed 0 cancellation rows, 0 in-flight rows"
    assert c.cancelled(1, "s") and c.in_flight(2, "s")  # not expired, still running
    refused = run_shmtool("unlink", shm_name)  # revised §7: its creator (this process) lives
    assert refused.returncode == 1 and f"pid {os.getpid()}" in refused.stderr
    assert run_shmtool("unlink", shm_name, "--force").returncode == 0
    with pytest.raises(shmcancel.RegistryNotFound):
        shmcancel.Registry.attach(shm_name)


@pytest.mark.parametrize("args", [("dump",), ("dump", "--json"), ("stats",),
                                  ("stats", "--json"), ("cleanup",), ("unlink",)])
def test_s7_shmtool_missing_registry_is_one_line_exit_1(shm_name: str,
                                                        args: tuple[str, ...]) -> None:
    out = run_shmtool(args[0], shm_name, *args[1:])
    assert out.returncode == 1
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
    assert out.stdout == ""


# ------------------------------------------------------------------------------ §6, §8 HTTP


@pytest.fixture(scope="module")
def example(module_shm_name: str) -> Iterator[Gunicorn]:
    with Gunicorn(None, registry_name=module_shm_name, config=CONF, workers=2) as g:
        yield g


@pytest.fixture(scope="module")
def watch(example: Gunicorn, module_shm_name: str) -> Iterator[shmcancel.Cancellation]:
    """The example's registry as any process sees it through the public API."""
    r = shmcancel.Registry.attach(module_shm_name)
    try:
        yield shmcancel.Cancellation(r)
    finally:
        r.close()


def legacy_session(g: Gunicorn) -> dict[str, str]:
    r = httpx.post(g.url, headers={"Accept": ACCEPT}, timeout=10, json={
        "jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {"protocolVersion": LEGACY, "capabilities": {},
                   "clientInfo": {"name": "conformance", "version": "1"}}})
    assert r.status_code == 200 and r.json()["result"]["protocolVersion"] == LEGACY
    sid = r.headers["Mcp-Session-Id"]
    assert len(sid) >= 22  # >= 128 random bits, base64url
    return {"Accept": ACCEPT, "Mcp-Session-Id": sid, "MCP-Protocol-Version": LEGACY}


def call(id: Any, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": id, "method": "tools/call",
            "params": {"name": name, "arguments": arguments}}


def cancel_note(params: Any = "absent") -> dict[str, Any]:
    msg: dict[str, Any] = {"jsonrpc": "2.0", "method": "notifications/cancelled"}
    if params != "absent":
        msg["params"] = params
    return msg


class Background:
    """A POST running in a thread (its own connection, as a separate client would be)."""

    def __init__(self, url: str, headers: dict[str, str], body: dict[str, Any]) -> None:
        self.response: httpx.Response | None = None
        self.t = threading.Thread(target=self._run, args=(url, headers, body), daemon=True)
        self.t.start()

    def _run(self, url: str, headers: dict[str, str], body: dict[str, Any]) -> None:
        with httpx.Client(timeout=60) as c:
            self.response = c.post(url, headers=headers, json=body)

    def result(self) -> httpx.Response:
        self.t.join(DEADLINE)
        assert self.response is not None, "the call did not finish"
        return self.response


@pytest.mark.integration
def test_s8_echo_returns_the_text(example: Gunicorn) -> None:
    h = legacy_session(example)
    r = httpx.post(example.url, headers=h, json=call(1, "echo", {"text": "héllo"}), timeout=10)
    assert r.status_code == 200
    assert r.json()["result"]["content"][0] == {"type": "text", "text": "héllo"}


@pytest.mark.integration
@pytest.mark.parametrize("params, status, code", [
    ("absent", 202, None),
    ({}, 202, None),
    ({"requestId": None}, 202, None),
    ({"requestId": 12345}, 202, None),      # not in flight: nothing recorded
    ({"requestId": 1.5}, 400, errors.INVALID_PARAMS),
    ({"requestId": True}, 400, errors.INVALID_PARAMS),
    ({"requestId": "x" * 257}, 400, errors.INVALID_PARAMS),
    ({"requestId": [1]}, 400, errors.INVALID_PARAMS),
    ([1], 400, errors.INVALID_PARAMS),
    (5, 400, errors.INVALID_PARAMS),
    ("x", 400, errors.INVALID_PARAMS),
])
def test_s6_1_notifications_cancelled_table(example: Gunicorn, watch: shmcancel.Cancellation,
                                            params: Any, status: int, code: int | None) -> None:
    h = legacy_session(example)
    r = httpx.post(example.url, headers=h, json=cancel_note(params), timeout=10)
    assert r.status_code == status
    if code is not None:
        assert r.json()["error"]["code"] == code and r.json()["id"] is None
    scope = "session:" + h["Mcp-Session-Id"]
    assert not watch.cancelled(12345, scope)


@pytest.mark.integration
@pytest.mark.parametrize("reason, stored", [("stop", "stop"), (5, "5"), (None, None)])
def test_s6_1_notifications_cancelled_in_flight_cancels_with_minus_32800(
        example: Gunicorn, watch: shmcancel.Cancellation, reason: Any,
        stored: str | None) -> None:
    """In flight in the caller's scope → ``cancel`` → 202 (a non-string reason is made text,
    §4.2); the waiting ``tools/call`` ends with -32800."""
    h = legacy_session(example)
    scope = "session:" + h["Mcp-Session-Id"]
    bg = Background(example.url, h, call(77, "sleep", {"seconds": 30}))
    try:
        wait_until(lambda: watch.in_flight(77, scope), deadline(), what="the sleep in flight")
        params: dict[str, Any] = {"requestId": 77}
        if reason is not None:
            params["reason"] = reason
        r = httpx.post(example.url, headers=h, json=cancel_note(params), timeout=10)
        assert (r.status_code, r.content) == (202, b"")
        res = bg.result()
        assert res.status_code == 200
        err = res.json()["error"]
        assert (err["code"], res.json()["id"]) == (errors.REQUEST_CANCELLED, 77)
        assert (err.get("data") or {}).get("reason") == stored
        wait_until(lambda: not watch.in_flight(77, scope), deadline(), what="untrack")
        assert not watch.cancelled(77, scope)  # cleared afterwards
    finally:
        end_session(example, h)  # never leave a sleep holding a worker of the module's server


def end_session(g: Gunicorn, h: dict[str, str]) -> None:
    """DELETE the session (cancelling whatever still runs in it); errors are ignored."""
    with contextlib.suppress(httpx.HTTPError):
        httpx.delete(g.url, headers=h, timeout=10)


@pytest.mark.integration
def test_s6_1_bad_input_statuses(example: Gunicorn) -> None:
    h = legacy_session(example)
    js = {**h, "Content-Type": "application/json"}
    r = httpx.post(example.url, headers=js, content=b"{not json", timeout=10)
    assert (r.status_code, r.json()["error"]["code"]) == (400, errors.PARSE_ERROR)
    r = httpx.post(example.url, headers=js, content=b"[" + b" " * (8 << 20) + b"]", timeout=30)
    assert r.status_code == 413
    r = httpx.post(example.url, headers={**h, "Mcp-Session-Id": "no-such-session"},
                   json={"jsonrpc": "2.0", "id": 1, "method": "ping"}, timeout=10)
    assert r.status_code == 404
    r = httpx.get(example.url, headers=h, timeout=10)
    assert r.status_code == 405
    r = httpx.post(example.url, headers=h, json={"jsonrpc": "2.0", "id": 2, "method": "ping"},
                   timeout=10)
    assert (r.status_code, r.json()["result"]) == (200, {})
    r = httpx.post(example.url, headers=h, timeout=10,
                   json={"jsonrpc": "2.0", "method": "notifications/initialized"})
    assert r.status_code == 202


@pytest.mark.integration
def test_s6_1_delete_ends_the_session_and_cancels_its_calls(
        example: Gunicorn, watch: shmcancel.Cancellation) -> None:
    h = legacy_session(example)
    scope = "session:" + h["Mcp-Session-Id"]
    bg = Background(example.url, h, call("d1", "sleep", {"seconds": 30}))
    try:
        wait_until(lambda: watch.in_flight("d1", scope), deadline(), what="the sleep in flight")
        r = httpx.delete(example.url, headers=h, timeout=10)
        assert (r.status_code, r.content) == (204, b"")
    finally:
        end_session(example, h)
    res = bg.result()
    assert res.json()["error"]["code"] == errors.REQUEST_CANCELLED
    r = httpx.post(example.url, headers=h, json={"jsonrpc": "2.0", "id": 2, "method": "ping"},
                   timeout=10)
    assert r.status_code == 404


def modern(g: Gunicorn, method: str, params: dict[str, Any] | None = None, *,
           headers: dict[str, str | None] | None = None, id: Any = 1) -> httpx.Response:
    p = {**(params or {}), "_meta": META}
    h: dict[str, str | None] = {"Accept": ACCEPT, "MCP-Protocol-Version": MODERN,
                                "Mcp-Method": method, **(headers or {})}
    return httpx.post(g.url, headers={k: v for k, v in h.items() if v is not None},
                      json={"jsonrpc": "2.0", "id": id, "method": method, "params": p},
                      timeout=10)


@pytest.mark.integration
def test_s6_2_server_discover_and_result_shapes(example: Gunicorn) -> None:
    r = modern(example, "server/discover")
    assert r.status_code == 200
    res = r.json()["result"]
    assert MODERN in res["supportedVersions"]
    assert res["serverInfo"]["name"] and "version" in res["serverInfo"]
    assert isinstance(res["capabilities"], dict) and "tools" in res["capabilities"]
    for result in (res, modern(example, "tools/list").json()["result"]):
        assert result["resultType"] == "complete"
        assert isinstance(result["ttlMs"], int) and result["ttlMs"] >= 0
        assert result["cacheScope"] in ("public", "private")
    r = modern(example, "tools/call", {"name": "echo", "arguments": {"text": "yo"}},
               headers={"Mcp-Name": "echo", "Mcp-Session-Id": "ignored-by-this-wire"})
    assert r.status_code == 200 and "Mcp-Session-Id" not in r.headers
    assert r.json()["result"]["resultType"] == "complete"
    assert r.json()["result"]["content"][0]["text"] == "yo"


@pytest.mark.integration
@pytest.mark.parametrize("method, params, headers", [
    ("tools/list", {}, {"Mcp-Method": None}),
    ("tools/list", {}, {"Mcp-Method": "tools/call"}),
    ("tools/call", {"name": "echo", "arguments": {"text": "a"}}, {}),
    ("tools/call", {"name": "echo", "arguments": {"text": "a"}}, {"Mcp-Name": "sleep"}),
])
def test_s6_2_header_mismatch_is_400_minus_32020(example: Gunicorn, method: str,
                                                 params: dict, headers: dict) -> None:
    r = modern(example, method, params, headers=headers)
    assert (r.status_code, r.json()["error"]["code"]) == (400, errors.HEADER_MISMATCH)


@pytest.mark.integration
def test_s6_2_unsupported_version_and_unknown_method_and_bodiless(example: Gunicorn) -> None:
    r = httpx.post(example.url, timeout=10, headers={
        "Accept": ACCEPT, "MCP-Protocol-Version": "2099-01-01", "Mcp-Method": "tools/list"},
        json={"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {
            "_meta": {**META, "io.modelcontextprotocol/protocolVersion": "2099-01-01"}}})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == errors.UNSUPPORTED_PROTOCOL_VERSION
    assert MODERN in err["data"]["supported"] and err["data"]["requested"] == "2099-01-01"
    r = modern(example, "no/such/method")
    assert (r.status_code, r.json()["error"]["code"]) == (404, errors.METHOD_NOT_FOUND)
    for send in (httpx.get, httpx.delete):
        r = send(example.url, headers={"MCP-Protocol-Version": MODERN}, timeout=10)
        assert r.status_code == 405


@pytest.mark.integration
def test_s8_sleep_ends_with_minus_32800_when_cancelled_and_stops_when_its_client_leaves(
        example: Gunicorn, watch: shmcancel.Cancellation) -> None:
    """§8: a ``sleep`` cancelled while its client waits answers -32800 (2026-07-28 wire; the
    cancellation recorded by another process through the shared registry). §6.2/§6.3: closing
    the stream cancels the call; nothing stays in the tables."""
    scope = "ip:127.0.0.1"
    h = {"Accept": ACCEPT, "MCP-Protocol-Version": MODERN, "Mcp-Method": "tools/call",
         "Mcp-Name": "sleep"}
    bg = Background(example.url, h, {"jsonrpc": "2.0", "id": "kept", "method": "tools/call",
                                     "params": {"name": "sleep", "arguments": {"seconds": 30},
                                                "_meta": META}})
    try:
        wait_until(lambda: watch.in_flight("kept", scope), deadline(), what="in flight")
        watch.cancel("kept", "stop", scope)
        res = bg.result()
    finally:  # never leave a sleep holding a worker of the module's server
        if watch.in_flight("kept", scope):
            watch.cancel("kept", None, scope)
    assert res.status_code == 200
    assert (res.json()["id"], res.json()["error"]["code"]) == ("kept", errors.REQUEST_CANCELLED)
    wait_until(lambda: not watch.in_flight("kept", scope), deadline(), what="untrack")
    assert not watch.cancelled("kept", scope)  # cleared afterwards

    body = json.dumps({"jsonrpc": "2.0", "id": "gone", "method": "tools/call",
                       "params": {"name": "sleep", "arguments": {"seconds": 30},
                                  "_meta": META}}).encode()
    s = socket.create_connection(("127.0.0.1", example.port))
    try:
        s.sendall(b"POST /mcp HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                  b"Accept: application/json\r\nMCP-Protocol-Version: 2026-07-28\r\n"
                  b"Mcp-Method: tools/call\r\nMcp-Name: sleep\r\n"
                  + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        scope = "ip:127.0.0.1"
        wait_until(lambda: watch.in_flight("gone", scope), deadline(), what="in flight")
    finally:
        s.close()
    wait_until(lambda: not watch.in_flight("gone", scope), deadline(),
               what="the abandoned call to stop")
    assert not watch.cancelled("gone", scope)
