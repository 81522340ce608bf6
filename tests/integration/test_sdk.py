"""The official MCP Python SDK client (``mcp`` 2.x, ``mcp.Client``) against the example server
(examples/gunicorn, its own gunicorn.conf.py, sync workers) on every wire the SDK speaks.

Cancellation is proven on the server side: the in-flight row of the abandoned ``sleep`` call is
watched through a read-only attachment of the registry (the example is run unmodified).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import AsyncIterator, Iterator

import anyio
import mcp
import pytest
from helpers.aio import until
from helpers.gunicorn_harness import Gunicorn
from helpers.rows import in_flight_rows
from mcp import Client
from mcp.shared.exceptions import MCPError

from shmcancel.shm.registry import Registry

pytestmark = pytest.mark.integration

CONF = "examples/gunicorn/gunicorn.conf.py"
MODES = ["legacy", "2026-07-28", "auto"]
SLEEP = 30.0  # what the abandoned call asks for
STOPPED_WITHIN = 2.0  # seconds from abandonment to the row's removal on the server


@pytest.fixture(scope="module")
def example(module_shm_name) -> Iterator[tuple[Gunicorn, Registry]]:
    with Gunicorn(None, registry_name=module_shm_name, config=CONF, workers=3) as g, \
            Registry.attach(module_shm_name, readonly=True) as reg:
        yield g, reg


# The SDK's own race (mcp 2.3.0): the server's reply to an abandoned call (-32800, or the
# result) can arrive after the client closed its read stream; the SDK's task that delivers it
# then raises one of these from the client's exit, inside an ExceptionGroup.
_EXIT_RACES = (anyio.ClosedResourceError, anyio.BrokenResourceError)
_SDK_DIR = os.path.dirname(os.path.abspath(mcp.__file__)) + os.sep


def _leaves(e: BaseException) -> Iterator[BaseException]:
    if isinstance(e, BaseExceptionGroup):
        for sub in e.exceptions:
            yield from _leaves(sub)
    else:
        yield e


def _raised_in_sdk(e: BaseException) -> bool:
    tb = e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.startswith(_SDK_DIR):
            return True
        tb = tb.tb_next
    return False


@contextlib.asynccontextmanager
async def client(url: str, mode: str, races: list[BaseException]) -> AsyncIterator[Client]:
    """``async with Client(url, mode=mode)``, tolerating the SDK's known race on leaving it: the
    ``_EXIT_RACES`` raised inside the SDK from the exit, after a body that completed, are
    appended to ``races`` (however deep in exception groups). Anything else raised by the exit,
    and everything raised by the body, goes on and fails the test."""
    completed = False
    try:
        async with Client(url, mode=mode) as c:
            yield c
            completed = True
    except* _EXIT_RACES as group:
        if not completed or not all(_raised_in_sdk(e) for e in _leaves(group)):
            raise
        races.append(group)


def rows(reg: Registry) -> list[tuple[str, str]]:
    return [k for k, _ in in_flight_rows(reg)]


@pytest.mark.parametrize("mode", MODES)
def test_initialize_list_echo(example, mode):
    g, _ = example

    async def main() -> str:
        async with Client(g.url, mode=mode) as c:
            tools = {t.name for t in (await c.list_tools()).tools}
            assert {"echo", "sleep"} <= tools
            r = await c.call_tool("echo", {"text": "héllo"})
            assert not r.is_error
            assert r.content[0].text == "héllo"
            return c.protocol_version

    version = anyio.run(main)
    # auto probes server/discover, which the example answers: it settles on the modern wire.
    expected = {"legacy": ("2025-11-25", "2025-06-18", "2025-03-26")}.get(mode, ("2026-07-28",))
    assert version in expected, version


@pytest.mark.parametrize("how", ["cancel", "timeout"])
@pytest.mark.parametrize("mode", MODES)
def test_abandoned_call_stops_on_the_server(example, mode, how):
    """The client abandons a 30 s ``sleep`` (anyio cancellation, or its read timeout) while the
    session stays open: the tool stops and its in-flight row goes well before 30 s."""
    g, reg = example
    assert rows(reg) == []
    races: list[BaseException] = []

    async def main() -> float:
        async with client(g.url, mode, races) as c:
            await c.list_tools()
            started = anyio.Event()

            async def watch() -> None:
                await until(lambda: rows(reg), 10, "the sleep call to be in flight")
                started.set()

            async with anyio.create_task_group() as tg:
                tg.start_soon(watch)
                if how == "cancel":
                    tg.start_soon(c.call_tool, "sleep", {"seconds": SLEEP})
                    await started.wait()
                    tg.cancel_scope.cancel()
                else:
                    with pytest.raises(MCPError):
                        await c.call_tool("sleep", {"seconds": SLEEP}, read_timeout_seconds=1.0)
                    assert started.is_set(), "the call timed out before it reached the server"
            abandoned = time.monotonic()
            gone = await until(lambda: not rows(reg), 10, "the tool to stop")
            return gone - abandoned

    took = anyio.run(main)
    print(f"\n{mode}/{how}: in-flight row gone {took * 1000:.0f} ms after abandonment"
          f"{'; the SDK raised on exit' if races else ''}")
    assert took < STOPPED_WITHIN, took


def test_legacy_cancel_and_delete_together(example):
    """Legacy: leaving the client right after abandoning a call sends the last
    ``notifications/cancelled`` and the session's ``DELETE`` at the same moment; whichever the
    server handles first, the tool stops. Several rounds, so both orders get their chance."""
    g, reg = example

    races: list[BaseException] = []

    async def round_() -> float:
        async with client(g.url, "legacy", races) as c, anyio.create_task_group() as tg:
            tg.start_soon(c.call_tool, "sleep", {"seconds": SLEEP})
            await until(lambda: rows(reg), 10, "the sleep call to be in flight")
            tg.cancel_scope.cancel()
        left = time.monotonic()
        gone = await until(lambda: not rows(reg), 10, "the tool to stop")
        return gone - left

    for _ in range(4):
        took = anyio.run(round_)
        assert took < STOPPED_WITHIN, took
    print(f"\nlegacy cancel + DELETE: 4 rounds, the SDK raised on exit in {len(races)}")


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("raised", [anyio.ClosedResourceError, anyio.BrokenResourceError,
                                    AssertionError])
def test_exit_allowance_is_only_for_the_sdk_exit_race(example, raised, grouped):
    """The allowance does not hide the same errors raised by the test's own code, in an
    exception group or not."""
    g, _ = example
    races: list[BaseException] = []

    async def main() -> None:
        async with client(g.url, "legacy", races) as c:
            await c.list_tools()
            e = raised("from the body")
            raise BaseExceptionGroup("body", [e]) if grouped else e

    with pytest.raises(BaseException) as e:
        anyio.run(main)
    assert [type(x) for x in _leaves(e.value)] == [raised]
    assert races == []
