"""A live process that holds a registry's lock and is stopped (SIGSTOP) holding it: what makes
a write wait ``lock_timeout`` (contract §4.3's stalled holder)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator

from helpers.gunicorn_harness import wait_until
from helpers.procs import Chan, Child, proc_state
from shmcancel.shm.registry import Registry

STOP_WAIT = 10.0  # seconds the holder may take to be seen stopped


def lock_holder(chan: Chan, name: str) -> None:
    """Take the registry lock, say so, and stop (SIGSTOP) holding it; once continued, release
    it and exit."""
    reg = Registry.attach(name)
    with reg.lock:
        chan.send("held")
        os.kill(os.getpid(), signal.SIGSTOP)
    chan.send("released")
    assert chan.recv() == "exit"


@contextlib.contextmanager
def stalled_lock(spawn: Callable[..., Child], name: str) -> Iterator[Child]:
    """A live process holding the registry lock, stopped; continued (and so releasing the lock)
    when the block ends, and in any case continued and killed by the spawn fixture."""
    holder = spawn(lock_holder, name)
    try:
        assert holder.recv() == "held"
        wait_until(lambda: proc_state(holder.pid) == "T", time.monotonic() + STOP_WAIT,
                   what="the lock holder to stop")
        yield holder
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(holder.pid, signal.SIGCONT)
    assert holder.recv() == "released"
    holder.send("exit")
    assert holder.wait() == 0
