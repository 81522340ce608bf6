"""The poller of shmcancel.sdk's running calls looks at their handles on the worker's event loop:
every look must be a lock-free read, never the janitor's sweep (which takes the registry lock
and reads every row: ~100 ms over a full table, every request of the worker stalled behind it)."""

from __future__ import annotations

import asyncio
import time

from shmcancel import Cancellation, telemetry
from shmcancel.cancel.policy import CLEANUP_EVENT
from shmcancel.sdk._calls import POLL_INTERVAL, Call, _Poller


def test_the_poller_never_runs_the_janitors_sweep_on_the_event_loop(registry) -> None:
    reg = registry(janitor_interval=0.05)
    c = Cancellation(reg)
    swept: list[bool] = []  # per sweep: whether it ran on a running event loop
    hid = f"poller-test-{id(swept)}"
    telemetry.attach(hid, CLEANUP_EVENT, lambda *a: swept.append(_on_a_loop()))
    h = c.begin(1, "ip:127.0.0.1")  # (the SDK begins a call in a worker thread)

    async def run_a_call() -> int:
        p = _Poller(asyncio.get_running_loop())
        p.add(Call(h))
        looks = 0
        try:  # each sweep is due again within janitor_interval: plenty of chances to run one
            end = time.monotonic() + 40 * 16 * POLL_INTERVAL
            while time.monotonic() < end:
                await asyncio.sleep(POLL_INTERVAL)
                looks += 1
            assert p.calls and not h.peek()  # still running: the poller kept looking
            return looks
        finally:
            p.calls.clear()

    try:
        assert asyncio.run(run_a_call()) > 32
        assert True not in swept, "a sweep ran on the event loop"
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
