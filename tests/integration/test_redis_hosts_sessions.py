"""Two hosts sharing one real Redis: what a session's DELETE and a cross-host cancellation do to
the calls and copies on the *other* host (found by the Redis-layer audit). Real redis-server;
real gunicorn where the transport matters, two bridges over two registries in this process
where an interleaving must be forced."""

from __future__ import annotations

import time
from typing import Any

from helpers.background import Background
from helpers.mcp_client import tag, wait_file
from test_redis_hosts import Client, outdir, two_hosts

from shmcancel import errors

__all__ = ["outdir"]  # the module fixture, shared


def test_a_waiting_tool_is_woken_by_a_cancellation_sent_to_another_host(
        redis_server: Any, outdir: str, shm_name: str, shm_names: list[str]) -> None:
    """``wait_cancelled`` returns as soon as its call is cancelled (README): the worker that
    records a cancellation rings the doorbells. A cancellation (or a DELETE) sent to B reaches
    A's worker through its bridge, which recorded it in A's segment without ringing: the tool
    slept its whole 20 s."""
    with two_hosts(redis_server.url, outdir, shm_name, shm_names) as (a, b, _):
        c = Client(a.url)
        assert c.call(b.url, 0, "echo", {"text": "x"})["result"]  # adopted on B
        for how in ("notification", "delete"):
            t = tag()
            call = Background(lambda t=t: c.call(a.url, 1, "waiter", {"seconds": 20, "tag": t}))
            call.start()
            wait_file(f"{outdir}/{t}.started", time.monotonic() + 10)
            sent = time.monotonic()
            if how == "notification":
                assert c.cancel(b.url, 1).status_code == 202
            else:
                assert c.delete(b.url).status_code == 204
            reply = call.result(25)
            assert reply["error"]["code"] == errors.REQUEST_CANCELLED, (how, reply)
            assert call.done_at - sent < 5.0, how  # not the tool's 20 s
