"""Drive the example with the official SDK client: list the tools, echo, then start a 30-second
``sleep_sync`` and abandon it after one second (on the 2025-11-25 wire the client posts
``notifications/cancelled``; on 2026-07-28 it closes the call's connection).

    .venv/bin/python examples/sdk/client.py [URL] [--mode legacy|2026-07-28]
"""

from __future__ import annotations

import argparse
import time

import anyio
from mcp import Client


async def main(url: str, mode: str) -> None:
    async with Client(url, mode=mode) as c:
        print("protocol", c.protocol_version)
        print("tools", sorted(t.name for t in (await c.list_tools()).tools))
        r = await c.call_tool("echo", {"text": "hello"})
        print("echo ->", r.content[0].text)
        started = time.monotonic()
        with anyio.move_on_after(1.0):
            await c.call_tool("sleep_sync", {"seconds": 30})
        print(f"sleep_sync abandoned after {time.monotonic() - started:.2f} s")
        await anyio.sleep(0.5)  # let the server's -32800 answer land before the client closes


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("url", nargs="?", default="http://127.0.0.1:8001/mcp")
    ap.add_argument("--mode", default="legacy", choices=["legacy", "2026-07-28"])
    a = ap.parse_args()
    anyio.run(main, a.url, a.mode)
