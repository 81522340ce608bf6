"""Issue #7, defects 1 and 2 (contract §4.3 last two bullets, §4.6, §5's 503 rule).

1. A cancellation never outlives its request by accident: "in flight? then record" is one step,
   and a row older than the request that finds it is not that request's.
2. The end of a request is never lost to a live process stalling the registry lock: the request
   that meets the stall is answered 503 with ``Retry-After``; the end is owed and lands once the
   lock is free; ``cleanup`` removes the rows of requests that ended in a live process.

Real registries, real forked processes (a lock holder really SIGSTOPped), real gunicorn on
loopback. Every stopped process is continued and killed in a ``finally``.
"""

from __future__ import annotations

import contextlib
import enum
import json
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from helpers.gunicorn_harness import Gunicorn, wait_until
from helpers.mcp_client import ACCEPT, LEGACY, reply_of, tag, wait_file
from helpers.owed import as_if_a_janitor_listened
from helpers.procs import Chan
from helpers.rows import in_flight_count, scope_counts
from helpers.rows import in_flight_rows as _rows
from helpers.stalled_lock import stalled_lock
from helpers.wsgi import environ_for, run

import shmcancel.cancel.owed as owed_mod
import shmcancel.cancel.policy as cancellation_mod
from shmcancel import LockTimeout, errors
from shmcancel.cancel.janitor import Janitor
from shmcancel.cancellation import Cancellation
from shmcancel.server import McpServer
from shmcancel.shm.registry import Registry

TIMEOUT = 10.0
SCOPE_ENV = environ_for()  # the in-process client's address: its scope is ip:203.0.113.7
LEGACY_HEADERS = {"MCP-Protocol-Version": LEGACY}


def notification(rid: Any, reason: str = "test") -> dict[str, Any]:
    return {"jsonrpc": "2.0", "method": "notifications/cancelled",
            "params": {"requestId": rid, "reason": reason}}


def call(rid: Any, tool: str, args: dict[str, Any]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": rid, "method": "tools/call",
            "params": {"name": tool, "arguments": args}}


def wsgi_post(app: Any, obj: Any) -> Any:
    return run(app, environ_for("POST", json.dumps(obj).encode(), headers=LEGACY_HEADERS))


def echo_server(reg: Registry) -> McpServer:
    """An in-process stateless server over ``reg`` with one tool, ``echo``."""
    server = McpServer("race", "1", sessions=False, registry=reg)

    @server.tool("echo")
    def echo(conn: Any, params: dict[str, Any]) -> str:
        return str(params.get("text", ""))

    return server


# ------------------------------------------------------------------------------ child programs


def requester(chan: Chan, name: str, rid: Any, scope: str) -> None:
    """Begin a request; on "end" end it and say "ended"."""
    reg = Registry.attach(name)
    h = Cancellation(reg).begin(rid, scope)
    chan.send("began" if h.tracked else "untracked")
    assert chan.recv() == "end"
    h.end()
    chan.send("ended")
    assert chan.recv() == "exit"


# ------------------------------------------------------------------------------ defect 1


@pytest.mark.parametrize("entry", ["notification", "session delete"])
def test_a_cancel_racing_the_end_of_its_call_leaves_no_row(registry, spawn, monkeypatch,
                                                           entry: str) -> None:
    """Deterministic: the request's end (in a second process, through the real lock) is run at
    the moment the cancel has decided the request is in flight and is about to record. With the
    check and the insert in one lock hold the end waits for the insert and then clears it, or
    the check sees the request gone: either way no row survives."""
    reg = registry()
    c = Cancellation(reg)
    scope = c.scope(SCOPE_ENV)
    server = echo_server(reg)
    req = spawn(requester, reg.name, 7, scope)
    assert req.recv() == "began"
    real_sanitize = cancellation_mod.sanitize
    ran: list[bool] = []

    def end_the_request_here(reason: object) -> str | None:
        # what cancel() does between deciding and taking the lock: make the end happen now
        if not ran:
            ran.append(True)
            req.send("end")
            assert req.recv() == "ended"
        return real_sanitize(reason)

    monkeypatch.setattr(cancellation_mod, "sanitize", end_the_request_here)
    if entry == "notification":
        assert wsgi_post(server, notification(7)).status == 202
    else:
        server._process_state().cancellation.cancel_scope(scope, "session deleted")
    monkeypatch.undo()
    req.send("exit")
    assert req.wait() == 0
    assert ran, "the cancel never reached the point of recording"
    assert reg.table("cancellations").scan() == [] and scope_counts(reg) == {}
    assert sorted(_rows(reg)) == []
    with c.begin(7, scope) as h:  # the next call reusing the id does not start out cancelled
        assert h.cancelled() is False


def test_cancel_if_in_flight(registry) -> None:
    reg = registry()
    c = Cancellation(reg)
    assert c.cancel_if_in_flight(3, "r", "s") is False
    assert c.cancel_if_in_flight(None, "r", "s") is False
    assert reg.table("cancellations").scan() == []
    with c.begin(3, "s") as h:
        assert c.cancel_if_in_flight(3, "r", "t") is False  # another scope's request 3
        assert c.cancel_if_in_flight("3", "r", "s") is True
        assert h.cancelled() and h.reason() == "r"
    assert reg.table("cancellations").scan() == [] and sorted(_rows(reg)) == []


def test_a_cancel_for_a_request_not_in_flight_takes_no_lock(registry, spawn) -> None:
    """A flood of notifications for ids nobody runs must not queue behind the registry lock:
    with the lock held by a stopped process, they are still answered at once."""
    reg = registry(lock_timeout=0.3)
    c = Cancellation(reg)
    with stalled_lock(spawn, reg.name):
        for rid in range(1, 21):
            assert c.cancel_if_in_flight(rid, "flood", "ip:192.0.2.9") is False
    assert reg.table("cancellations").scan() == []


def test_a_row_older_than_the_request_is_not_its_own(registry) -> None:
    """A leftover row (here recorded directly, before the request began) neither pre-cancels a
    request reusing the id nor outlives that request (its first look leaves it: a namesake
    begun before it may still run, see test_cancellation_procs); a cancel recorded during the
    request still reaches it."""
    reg = registry()
    t = [1000.0]
    c = Cancellation(reg, clock=lambda: t[0])
    c.cancel(4, "old", "s")
    t[0] += 0.001
    with c.begin(4, "s") as h:
        assert h.cancelled() is False
        assert h.reason() is None
        t[0] += 0.001
        c.cancel(4, "new", "s")
        assert h.cancelled() is True and h.reason() == "new"
    assert reg.table("cancellations").scan() == []


def test_a_row_as_old_as_the_request_counts(registry) -> None:
    """The clock may not move between begin and a cancel (a coarse or injected clock): a row
    stamped at the request's own start is its own."""
    reg = registry()
    c = Cancellation(reg, clock=lambda: 5.0)
    with c.begin(1, "s") as h:
        c.cancel(1, "now", "s")
        assert h.cancelled() is True


@pytest.mark.parametrize("clock", [math.nan, math.inf, -math.inf, "raises"])
def test_a_request_begun_on_a_clock_that_is_no_time_is_served_untracked(registry,
                                                                       clock) -> None:
    """``began`` is what a leftover row is told apart by: a NaN made every row this request's
    (a comparison with NaN is false), an exception escaped ``begin``, which never raises. Now
    the request runs untracked with the clock's error (as for a store that fails): a
    leftover row does not cancel it, ``cancel_local`` still does, and its end is harmless."""
    reg = registry()
    c = Cancellation(reg)
    c.cancel(4, "a leftover", "s")

    def broken() -> float:
        if clock == "raises":
            raise OSError("no clock here")
        return clock

    h = Cancellation(reg, clock=broken).begin(4, "s")
    assert not h.tracked and h.error is not None and not c.in_flight(4, "s")
    assert h.cancelled() is False and h.reason() is None
    h.cancel_local("gone")
    assert h.cancelled() is True and h.reason() == "gone"
    h.end()
    assert c.reason(4, "s") == "a leftover"  # not its row: left alone


def test_a_request_begun_with_a_str_subclass_scope_sees_its_cancellation(registry) -> None:
    """A scope may be a ``str`` subclass (a ``StrEnum`` member): rows are keyed by its text.
    The handle read its row through the subclass, which the row check refused, so it never
    saw the cancellation ``c.cancelled`` saw."""
    class Scope(enum.StrEnum):
        S = "s"

    reg = registry()
    c = Cancellation(reg)
    with c.begin(7, Scope.S) as h:
        assert h.tracked and c.in_flight(7, "s")
        assert c.cancel_if_in_flight(7, "stop", Scope.S)
        assert h.cancelled() is True and h.reason() == "stop"
        assert type(h.scope) is str
    assert not c.in_flight(7, "s") and reg.table("cancellations").scan() == []


@pytest.mark.slow
@pytest.mark.integration
def test_gunicorn_cancels_racing_the_end_of_short_calls(shm_name: str, tmp_path) -> None:
    """End to end: two threads send notifications/cancelled for id N while tools/call echo N
    runs, round after round. After each round no cancellation row is left, and the next call
    reusing N is answered normally (not -32800)."""
    rounds = int(os.environ.get("SHMCANCEL_RACE_ROUNDS", "300"))
    env = {"SHMCANCEL_TEST_DIR": str(tmp_path)}
    with Gunicorn("tests.apps.transport_app:app", registry_name=shm_name,
                  config="tests/apps/transport_conf.py", env=env, workers=3,
                  worker_class="gthread", threads=4) as g:
        reg = Registry.attach(shm_name)
        try:
            client = httpx.Client(timeout=15)
            # one scope for every request: ip:127.0.0.1
            url = g.url.removesuffix("/mcp") + "/stateless"
            headers = {"Accept": ACCEPT, "Content-Type": "application/json",
                       "MCP-Protocol-Version": LEGACY}

            def post(obj: Any) -> httpx.Response:
                return client.post(url, content=json.dumps(obj).encode(), headers=headers)

            leftover = precancelled = 0
            statuses: list[int] = []
            for n in range(rounds):
                rid = n % 5
                done = threading.Event()

                def notify(rid: int = rid, done: threading.Event = done) -> None:
                    for _ in range(40):  # bounded; stops once the call answered
                        statuses.append(post(notification(rid)).status_code)
                        if done.is_set():
                            return

                notifiers = [threading.Thread(target=notify, daemon=True) for _ in range(2)]
                for t in notifiers:
                    t.start()
                reply_of(post(call(rid, "echo", {"text": "x"})))  # cancelled or not: either
                done.set()
                for t in notifiers:
                    t.join(TIMEOUT)
                    assert not t.is_alive()
                assert set(statuses) == {202}, statuses
                if reg.table("cancellations").count():
                    leftover += 1
                again = reply_of(post(call(rid, "echo", {"text": "again"})))
                if "error" in again:
                    assert again["error"]["code"] == errors.REQUEST_CANCELLED, again
                    precancelled += 1
                if leftover or precancelled:
                    break
            assert (leftover, precancelled) == (0, 0), (
                f"round {n + 1}: a row outlived its call ({leftover}); "
                f"the next call started cancelled ({precancelled})")
            assert reg.table("cancellations").count() == 0
            wait_until(lambda: in_flight_count(reg) == 0, time.monotonic() + TIMEOUT,
                       what="no request in flight")
        finally:
            reg.close()


# ------------------------------------------------------------------------------ defect 2


def forget_owed_ends() -> None:
    """For ``finally``: never leave an owed end of a closed registry to another test."""
    owed_mod.queue.clear()


def assert_503(r: Any) -> None:
    """contract §5: a lock held past lock_timeout by a live process is 503 with Retry-After and a
    JSON-RPC error body, never 500."""
    assert r.status == 503, r
    assert int(r.headers["retry-after"]) >= 1
    body = r.json
    assert body["jsonrpc"] == "2.0" and body["id"] is None
    assert body["error"]["code"] == errors.SERVER_ERROR, body


def test_a_stalled_lock_holder_costs_a_503_and_loses_no_end(registry, spawn,
                                                            monkeypatch) -> None:
    """A real lock holder, SIGSTOPped past lock_timeout. The requests that need the lock get 503;
    a call does not (its in-flight row is in this process's lane, claimed before the stall), and
    the in-flight rows of requests ending meanwhile go at once. The clears of two cancelled
    requests ending meanwhile are owed, not lost (the owed queue is cut to one here, so one is
    dropped). Once the holder is continued the owed clear lands; the dropped one's row is older
    than any later call with its id, which is not cancelled by it, and a notification for the
    ended id records nothing."""
    reg = registry(lock_timeout=0.3)
    c = Cancellation(reg)
    scope = c.scope(SCOPE_ENV)
    server = echo_server(reg)
    monkeypatch.setattr(owed_mod, "_OWED_MAX", 1)
    first, second = c.begin(1, scope), c.begin(2, scope)
    assert first.tracked and second.tracked
    c.cancel(1, "r", scope)
    c.cancel(2, "r", scope)
    try:
        # no lander: it could land second's clear, already taken to land before the drop
        with as_if_a_janitor_listened(), stalled_lock(spawn, reg.name):
            assert_503(wsgi_post(server, notification(1)))
            r = wsgi_post(server, call(3, "echo", {"text": "served"}))
            assert r.status == 200 and r.json["result"]["content"][0]["text"] == "served"
            with pytest.raises(LockTimeout):
                c.cancel(1, "r", scope)
            second.end()  # its clear is owed
            first.end()  # owed; the queue holds one, so second's clear is dropped
            assert sorted(_rows(reg)) == []  # the in-flight rows went without the lock
            assert sorted(k[1] for k, _ in reg.table("cancellations").scan()) == ["1", "2"]
            assert owed_mod.owed_ends() == 1
        with c.begin(3, scope):  # the next write lands what is owed: first's clear
            assert [k[1] for k, _ in reg.table("cancellations").scan()] == ["2"]
        assert owed_mod.owed_ends() == 0
        assert wsgi_post(server, notification(2)).status == 202  # not in flight: nothing new
        later = wsgi_post(server, call(2, "echo", {"text": "ok"}))
        assert later.json["result"]["isError"] is False  # the old row is not this call's
        assert later.json["result"]["content"][0]["text"] == "ok"
    finally:
        forget_owed_ends()


@pytest.mark.parametrize("poll", ["handle.cancelled", "c.cancelled", "c.in_flight", "c.reason"])
def test_a_poll_never_waits_for_a_stopped_lock_holder(registry, spawn, poll: str) -> None:
    """A poll is lock-free (contract §4.3), also when the janitor's turn rides on it: with the
    sweep due and a live holder stopped, the poll answers at once (the sweep skips its turn)
    instead of waiting ``lock_timeout`` to claim it."""
    reg = registry(lock_timeout=2.0, janitor_interval=0.05)
    c = Cancellation(reg)
    h = c.begin(5, "s")
    ask = {"handle.cancelled": h.cancelled, "c.cancelled": lambda: c.cancelled(5, "s"),
           "c.in_flight": lambda: c.in_flight(5, "s"), "c.reason": lambda: c.reason(5, "s")}[poll]
    try:
        ask()
        with stalled_lock(spawn, reg.name):
            t0 = time.monotonic()
            took = 0.0
            while time.monotonic() - t0 < 0.5:  # well past janitor_interval: the sweep is due
                took = max(took, _timed(ask))
            assert took < 0.5, took
    finally:
        h.end()


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.monotonic()
    fn()
    return time.monotonic() - t0


def test_owed_end_lands_on_the_next_write(registry, spawn) -> None:
    """Without a janitor (nor a lander: a listener stands in): the next write of the process
    that owes an end lands it."""
    reg = registry(lock_timeout=0.3)
    c = Cancellation(reg)
    h = c.begin(5, "s")
    c.cancel(5, "r", "s")  # so that its end must clear a row: under the lock
    try:
        with as_if_a_janitor_listened(), stalled_lock(spawn, reg.name):  # no lander
            h.end()
        assert sorted(_rows(reg)) == []  # the in-flight row went without the lock
        assert reg.table("cancellations").count() == 1 and owed_mod.owed_ends() == 1
        with c.begin(6, "s"):
            assert [k[1] for k, _ in sorted(_rows(reg))] == ["6"]
            assert reg.table("cancellations").count() == 0 and owed_mod.owed_ends() == 0
        assert sorted(_rows(reg)) == []
    finally:
        forget_owed_ends()


def test_the_janitor_thread_lands_an_owed_end(registry, spawn) -> None:
    """With no further call: the janitor thread, woken when the end became owed, lands it once
    the holder lets go (well before its janitor_interval of 60 s)."""
    reg = registry(lock_timeout=0.3, janitor_interval=60)
    janitor = Janitor(Cancellation(reg))
    janitor.start()
    try:
        h = Cancellation(reg).begin(8, "s")
        Cancellation(reg).cancel(8, "r", "s")  # so that its end must clear a row: under the lock
        with stalled_lock(spawn, reg.name):
            h.end()
            assert reg.table("cancellations").count() == 1 and owed_mod.owed_ends() == 1
        wait_until(lambda: reg.table("cancellations").count() == 0 and not owed_mod.owed_ends(),
                   time.monotonic() + TIMEOUT, what="the janitor to land the owed end")
    finally:
        janitor.stop()
        forget_owed_ends()


@pytest.mark.parametrize("landed_by", ["cleanup", "the next write"])
def test_a_plain_untrack_and_clear_meeting_a_stalled_lock_are_owed_not_lost(
        registry, spawn, landed_by: str) -> None:
    """contract §4.3 through the public API: the end of a request (``untrack``, then ``clear``)
    that meets a live lock holder stopped past ``lock_timeout`` is never lost. It used to raise
    ``LockTimeout`` and leave the row in flight for as long as the process lived (``cleanup``
    never removed it: its owner is alive). Now neither call raises; once the holder lets go the
    process finishes both (its ``cleanup``, or its next write), and nothing is left in flight
    or cancelled. (No lander: it would land them on its own schedule, and a ``cleanup`` that
    meets it mid-landing leaves them to it.)"""
    reg = registry(lock_timeout=0.3)
    c = Cancellation(reg)
    c.track(5, "s")
    c.cancel(5, "r", "s")
    try:
        with as_if_a_janitor_listened(), stalled_lock(spawn, reg.name):
            c.untrack(5, "s")
            c.clear(5, "s")
            assert c.in_flight(5, "s") and c.cancelled(5, "s")  # not yet: owed
            assert owed_mod.owed_ends() == 2
        if landed_by == "cleanup":
            assert c.cleanup() == 0  # no row expired: the owed clear removed it
        else:
            c.track(6, "s")
            c.untrack(6, "s")
        assert owed_mod.owed_ends() == 0
        assert not c.in_flight(5, "s") and not c.cancelled(5, "s")
        assert sorted(_rows(reg)) == [] and reg.table("cancellations").scan() == []
        assert scope_counts(reg) == {}
    finally:
        forget_owed_ends()


@pytest.mark.parametrize("owed", ["clear", "end"])
def test_an_owed_end_landing_late_leaves_a_cancellation_made_since(registry, spawn,
                                                                 owed: str) -> None:
    """A clear (or a request's end) that met a stalled lock lands later, as it would have
    then: the row from before it goes, a cancellation recorded since stays. It used to take
    whatever row was there: the cancel that landed it (its write settles what is owed) had
    its own row deleted in the same call, and returned as if recorded."""
    reg = registry(lock_timeout=0.3)
    c = Cancellation(reg)
    h = c.begin(5, "s") if owed == "end" else None
    c.cancel(5, "old", "s")
    try:
        with as_if_a_janitor_listened(), stalled_lock(spawn, reg.name):  # no lander
            if h is None:
                c.clear(5, "s")
            else:
                h.end()  # its untrack needs no lock (a lane row), its clear does
            assert owed_mod.owed_ends() == 1 and c.reason(5, "s") == "old"
            assert not c.in_flight(5, "s")
        c.cancel(5, "new", "s")  # lands the owed clear after its own write
        assert owed_mod.owed_ends() == 0
        assert c.cancelled(5, "s") and c.reason(5, "s") == "new"
        assert list(scope_counts(reg).values()) == [1]
        assert reg.table("cancellations").count() == 1
    finally:
        forget_owed_ends()


def test_an_owed_untrack_and_a_new_track_of_the_id_leave_one_row(registry, spawn) -> None:
    """The thread tracks the id again before its owed untrack lands: the new request has a row
    of its own (a row per ``track``, contract §4.5), and the owed untrack, landing after it,
    takes one of the two: the new request stays in flight until its own untrack."""
    reg = registry(lock_timeout=0.3)
    c = Cancellation(reg)
    c.track(7, "s")
    try:
        with as_if_a_janitor_listened(), stalled_lock(spawn, reg.name):  # no lander
            c.untrack(7, "s")
            assert owed_mod.owed_ends() == 1
        c.track(7, "s")
        assert owed_mod.owed_ends() == 0
        assert [k for k, _ in _rows(reg)] == [("s", "7")]
        assert c.in_flight(7, "s")
        c.untrack(7, "s")
        assert not c.in_flight(7, "s") and sorted(_rows(reg)) == []
    finally:
        forget_owed_ends()


def _sleep_started(post: Callable[[Any], Any], seconds: float,
                   tmp_path: Any) -> tuple[threading.Thread, list[Any]]:
    """A ``sleep`` call (id 7) posted on a thread of its own, once its tool has started: the
    thread and the list that receives what ``post`` returns."""
    t = tag()
    result: list[Any] = []
    running = threading.Thread(
        target=lambda: result.append(post(call(7, "sleep", {"seconds": seconds, "tag": t}))),
        daemon=True)
    running.start()
    wait_file(str(tmp_path / f"{t}.started"), time.monotonic() + TIMEOUT)
    return running, result


@pytest.mark.slow
@pytest.mark.integration
def test_gunicorn_with_a_stopped_lock_holder(shm_name: str, tmp_path, spawn) -> None:
    """End to end: a call runs; a local process takes the registry lock and is SIGSTOPped. A
    notification for the call is answered 503 with Retry-After; the call itself ends during the
    stall and still answers its result. After SIGCONT the worker lands the end by itself (its
    janitor thread, no further request), so no row is left and the id is not pre-cancelled."""
    env = {"SHMCANCEL_TEST_DIR": str(tmp_path), "SHMCANCEL_TEST_LOCK_TIMEOUT": "0.5"}
    with Gunicorn("tests.apps.transport_app:app", registry_name=shm_name,
                  config="tests/apps/transport_conf.py", env=env, workers=2,
                  worker_class="gthread", threads=4) as g:
        reg = Registry.attach(shm_name)
        try:
            url = g.url.removesuffix("/mcp") + "/stateless"
            headers = {"Accept": ACCEPT, "Content-Type": "application/json",
                       "MCP-Protocol-Version": LEGACY}

            def post(obj: Any) -> httpx.Response:
                return httpx.post(url, content=json.dumps(obj).encode(), headers=headers,
                                  timeout=15)

            running, result = _sleep_started(post, 2.5, tmp_path)
            with stalled_lock(spawn, shm_name):
                r = post(notification(7))
                assert r.status_code == 503, r.text
                assert int(r.headers["retry-after"]) >= 1
                assert r.json()["error"]["code"] == errors.SERVER_ERROR
                running.join(TIMEOUT)
                assert not running.is_alive()
                done = reply_of(result[0])
                assert done["result"]["content"][0]["text"] == "slept 2.5s", done
                # its in-flight row is in the worker's lane: gone without the lock
                assert sorted(_rows(reg)) == []
            try:
                wait_until(lambda: in_flight_count(reg) == 0, time.monotonic() + TIMEOUT,
                           what="the owed end to land")
            except AssertionError:
                raise AssertionError(g.log_tail()) from None
            assert post(notification(7)).status_code == 202
            assert reg.table("cancellations").count() == 0
            again = reply_of(post(call(7, "echo", {"text": "again"})))
            assert again["result"]["content"][0]["text"] == "again", again
            assert "Traceback" not in g.log()
        finally:
            reg.close()


@contextlib.contextmanager
def _one_session_server(shm_name: str, tmp_path: Any,
                        lock_timeout: float) -> Iterator[tuple[Gunicorn, dict[str, str]]]:
    """The transport app on one gthread worker with ``lock_timeout`` and sweeps due on every
    request; the headers of a session initialized on it."""
    env = {"SHMCANCEL_TEST_DIR": str(tmp_path),
           "SHMCANCEL_TEST_LOCK_TIMEOUT": str(lock_timeout),
           "SHMCANCEL_TEST_JANITOR_INTERVAL": "0.2"}  # sweeps due on every request
    with Gunicorn("tests.apps.transport_app:app", registry_name=shm_name,
                  config="tests/apps/transport_conf.py", env=env, workers=1,
                  worker_class="gthread", threads=4) as g:
        headers = {"Accept": ACCEPT, "Content-Type": "application/json"}
        init = {"jsonrpc": "2.0", "id": 0, "method": "initialize",
                "params": {"protocolVersion": LEGACY, "capabilities": {},
                           "clientInfo": {"name": "t", "version": "1"}}}
        r = httpx.post(g.url, json=init, headers=headers, timeout=15)
        headers |= {"Mcp-Session-Id": r.headers["mcp-session-id"],
                    "MCP-Protocol-Version": LEGACY}
        yield g, headers


@pytest.mark.slow
@pytest.mark.integration
def test_a_stopped_lock_holder_makes_each_request_wait_one_lock_timeout(shm_name: str, tmp_path,
                                                                        spawn) -> None:
    """A request under a stalled lock waits ``lock_timeout`` for its own write, then 503. It
    waited once more per piece of deferrable work on its way (the session sweep, the owed
    call ends, the janitor's claim): 20-30 s at the default 10 s. Those skip their turn now
    while this process has seen the lock time out within ``lock_timeout``."""
    lock_timeout = 1.0
    with _one_session_server(shm_name, tmp_path, lock_timeout) as (g, headers):

        def post(obj: Any) -> tuple[httpx.Response, float]:
            t0 = time.monotonic()
            r = httpx.post(g.url, content=json.dumps(obj).encode(), headers=headers,
                           timeout=30)
            return r, time.monotonic() - t0

        running, result = _sleep_started(post, 1.0, tmp_path)
        with stalled_lock(spawn, shm_name):
            running.join(TIMEOUT)  # it ends during the stall: its session call end is owed
            assert result and result[0][0].status_code == 200
            for msg in (notification(99), {"jsonrpc": "2.0", "id": 2, "method": "tools/list"},
                        call(8, "echo", {"text": "x"}), notification(98)):
                r, took = post(msg)
                assert r.status_code in (202, 503), r.text
                assert took < 1.8 * lock_timeout, (msg, r.status_code, took, g.log_tail())
        wait_until(lambda: "Traceback" not in g.log() or None, time.monotonic() + 1,
                   what="no traceback")


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("how", ["tools/call", "DELETE"])
def test_a_worker_that_never_saw_the_lock_stall_waits_one_lock_timeout_too(
        shm_name: str, tmp_path, spawn, how: str) -> None:
    """A worker's first request under a stopped holder, with its sweeps due (the process has not
    seen the lock time out yet, so nothing skips for that): it waits ``lock_timeout`` for its own
    write only, as nothing deferrable waits before that write."""
    lock_timeout = 1.0
    with _one_session_server(shm_name, tmp_path, lock_timeout) as (g, headers), \
            stalled_lock(spawn, shm_name):
        t0 = time.monotonic()
        if how == "DELETE":
            r = httpx.delete(g.url, headers=headers, timeout=30)
        else:
            r = httpx.post(g.url, json=call(8, "echo", {"text": "x"}), headers=headers,
                           timeout=30)
        took = time.monotonic() - t0
        assert r.status_code == 503, r.text
        assert took < 1.8 * lock_timeout, (took, g.log_tail())


def test_closing_a_registry_under_a_stalled_lock_does_not_wait_it_out(registry, spawn) -> None:
    """Registry.close() frees this process's lane under the lock but waits about a second at
    most, not lock_timeout: a stalled holder leaves the lane claimed (whoever needs it takes it
    once this process has exited)."""
    reg = registry(lock_timeout=10)
    mine = Registry.attach(reg.name)
    try:
        Cancellation(mine).begin(1, "s").end()  # claims this process's lane, through `mine`
        assert len(reg.lanes["in_flight"].lane_owners()) == 1
        with stalled_lock(spawn, reg.name):
            t0 = time.monotonic()
            mine.close()
            assert time.monotonic() - t0 < 5
            assert len(reg.lanes["in_flight"].lane_owners()) == 1  # left claimed
    finally:
        mine.close()


# ------------------------------------------------------------------------------ audit: namesakes


def ending_namesake(chan: Chan, name: str, rid: Any, scope: str) -> None:
    """Begin a request; on "end" remove its in-flight row, say "untracked" and wait for "go"
    before the rest of its end (the clear); on "poll" answer whether it is cancelled."""
    reg = Registry.attach(name)
    c = Cancellation(reg)
    h = c.begin(rid, scope)
    real_untrack = c._store.untrack

    def untrack(*a: Any, **kw: Any) -> Any:
        out = real_untrack(*a, **kw)
        chan.send("untracked")
        assert chan.recv() == "go"
        return out

    c._store.untrack = untrack  # type: ignore[method-assign]
    chan.send("began")
    while (msg := chan.recv()) != "exit":
        if msg == "end":
            h.end()
            chan.send("ended")
        elif msg == "poll":
            chan.send(h.cancelled())


def test_a_namesakes_end_keeps_a_cancel_recorded_for_the_request_still_running(registry,
                                                                               spawn) -> None:
    """Two clients behind one address run request 1 at once (one ``ip:`` scope, contract §6.3).
    A ``notifications/cancelled`` for 1 recorded while the first of them is ending (its row
    already gone, the other still in flight) is the running one's: the ending request's clear
    must not take it (as an owed end's ``Storage.end`` already decides), else the running
    request never sees a cancellation ``cancel_if_in_flight`` reported recorded."""
    reg = registry()
    c = Cancellation(reg)
    scope = "ip:203.0.113.9"
    ending = spawn(ending_namesake, reg.name, 1, scope)
    running = spawn(ending_namesake, reg.name, 1, scope)
    assert ending.recv() == "began" and running.recv() == "began"
    ending.send("end")
    assert ending.recv() == "untracked"
    assert c.in_flight(1, scope)  # the namesake runs on
    assert c.cancel_if_in_flight(1, "the running one", scope) is True
    ending.send("go")
    assert ending.recv() == "ended"
    running.send("poll")
    assert running.recv() is True, "a cancellation recorded for a running request was lost"
    running.send("end")
    assert running.recv() == "untracked"
    running.send("go")
    assert running.recv() == "ended"
    assert reg.table("cancellations").scan() == [] and scope_counts(reg) == {}  # none left
    assert sorted(_rows(reg)) == []
    for k in (ending, running):
        k.send("exit")
        assert k.wait() == 0


# ------------------------------------------------------------------------------ audit: stale rows


def clearer(chan: Chan, name: str, rid: Any, scope: str) -> None:
    """On "clear" clear ``(scope, rid)`` and say "cleared"."""
    c = Cancellation(Registry.attach(name))
    chan.send("ready")
    while (msg := chan.recv()) != "exit":
        assert msg == "clear"
        c.clear(rid, scope)
        chan.send("cleared")


def test_a_leftover_row_removed_during_a_poll_does_not_cancel_the_request(registry,
                                                                          spawn) -> None:
    """contract §4.3: a call reusing an id never starts out cancelled by a row older than it.
    The poll sees the row (a leftover), then reads it to compare its age; when another process
    removes it in between (a namesake's stale-row removal, its end, the janitor), the request
    must not latch a cancellation nobody recorded for it."""
    reg = registry()
    scope = "ip:203.0.113.9"
    Cancellation(reg, clock=lambda: 1.0).cancel(5, "long ago", scope)  # a leftover
    other = spawn(clearer, reg.name, 5, scope)
    assert other.recv() == "ready"
    c = Cancellation(reg)
    st_ = c._store
    real_get = st_.get
    removed: list[bool] = []

    def get(*a: Any) -> Any:
        if not removed:  # between the poll's sight of the row and its read of the row
            removed.append(True)
            other.send("clear")
            assert other.recv() == "cleared"
        return real_get(*a)

    st_.get = get  # type: ignore[method-assign]
    with c.begin(5, scope) as h:
        assert h.cancelled() is False
        assert removed, "the poll never read the row"
        assert h.cancelled() is False and h.reason() is None
    other.send("exit")
    assert other.wait() == 0
    assert reg.table("cancellations").scan() == []


def flickering_leftover(chan: Chan, name: str, page: Any, rid: Any, scope: str) -> None:
    """Until told to stop: record an old row for ``rid`` (clock 1.0) and clear it again."""
    old = Cancellation(Registry.attach(name), clock=lambda: 1.0)
    chan.send("ready")
    while not page[0]:
        old.cancel(rid, "long ago", scope)
        old.clear(rid, scope)
    chan.send("stopped")
    assert chan.recv() == "exit"


def test_requests_polling_beside_a_flickering_leftover_row_are_never_cancelled(registry,
                                                                               spawn) -> None:
    """The same without a hook: another process keeps recording and clearing a row stamped
    long before any of these requests; not one of them may read as cancelled."""
    import mmap

    reg = registry()
    scope = "ip:203.0.113.9"
    page = mmap.mmap(-1, mmap.PAGESIZE)
    other = spawn(flickering_leftover, reg.name, page, 6, scope)
    assert other.recv() == "ready"
    c = Cancellation(reg)
    cancelled = n = 0
    try:
        t_end = time.monotonic() + 1.5
        while time.monotonic() < t_end:
            with c.begin(6, scope) as h:
                cancelled += any(h.cancelled() for _ in range(10))
            n += 1
    finally:
        page[0] = 1
    assert other.recv() == "stopped"
    other.send("exit")
    assert other.wait() == 0
    page.close()
    assert n > 100 and cancelled == 0, f"{cancelled} of {n} requests read as cancelled"
