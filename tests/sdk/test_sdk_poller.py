"""The poller of shmcancel.sdk's running calls looks at their handles on the worker's event loop:
every look must be a lock-free read, never the janitor's sweep (which takes the registry lock
and reads every row: ~100 ms over a full table, every request of the worker stalled behind it)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from shmcancel import Cancellation, telemetry
from shmcancel.cancel.handle import RequestHandle
from shmcancel.cancel.policy import CLEANUP_EVENT
from shmcancel.sdk._calls import POLL_INTERVAL, Call, _Poller

SCOPE = "ip:127.0.0.1"


def test_the_poller_never_runs_the_janitors_sweep_on_the_event_loop(
        registry, monkeypatch: pytest.MonkeyPatch) -> None:
    reg = registry(janitor_interval=0.05)
    c = Cancellation(reg)
    swept: list[bool] = []  # per sweep: whether it ran on a running event loop
    hid = f"poller-test-{id(swept)}"
    telemetry.attach(hid, CLEANUP_EVENT, lambda *a: swept.append(_on_a_loop()))
    looks: list[tuple[str, bool]] = []  # per look at a handle: (how, on the event loop)
    for name in ("peek", "cancelled"):
        real = getattr(RequestHandle, name)

        def counted(self: RequestHandle, _real: Any = real, _name: str = name) -> bool:
            looks.append((_name, _on_a_loop()))
            return bool(_real(self))
        monkeypatch.setattr(RequestHandle, name, counted)
    h = c.begin(1, SCOPE)  # (the SDK begins a call in a worker thread)

    async def run_a_call() -> Call:
        p = _Poller(asyncio.get_running_loop())
        call = Call(h)
        p.add(call)
        try:  # each sweep is due again within janitor_interval: plenty of chances to run one
            await asyncio.sleep(40 * 16 * POLL_INTERVAL)
            assert call in p.calls and not call.cancel_scope.cancel_called  # still running
            # (off the loop: a cancel's own janitor turn may sweep, and is not the poller's)
            assert await asyncio.to_thread(c.cancel_if_in_flight, 1, "stop", SCOPE)
            end = time.monotonic() + 5
            while call in p.calls:  # the poller's next look stops it
                assert time.monotonic() < end, "the poller never stopped the cancelled call"
                await asyncio.sleep(POLL_INTERVAL)
            return call
        finally:
            p.calls.clear()

    try:
        call = asyncio.run(run_a_call())
        assert call.cancel_scope.cancel_called
        on_loop = [how for how, loop in looks if loop]
        assert on_loop.count("peek") > 32, looks[:40]  # the poller looked, on the loop
        assert "cancelled" not in on_loop, "cancelled() (which may sweep) ran on the loop"
        assert True not in swept, "a sweep ran on the event loop"
        monkeypatch.undo()
        c.tick()  # a sweep due runs where ticks may block, and is seen
        assert swept == [*swept[:-1], False]
    finally:
        telemetry.detach(hid)
        h.end()


def _on_a_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
