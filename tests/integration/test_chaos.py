"""Chaos audit: real forked processes stopped at chosen points inside a write (each child blocks
on its channel inside a function patched in that child only), then the shared tables checked
against contract §4.3–§4.6. Every child is killed by pid at teardown (the ``spawn`` fixture)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any

import pytest
from helpers.procs import Chan

from shmcancel import CancellationLimitReached
from shmcancel.cancel import shm_storage
from shmcancel.cancel.eviction import choose
from shmcancel.cancel.uncount import Uncount
from shmcancel.cancellation import Cancellation
from shmcancel.shm.registry import Registry
from shmcancel.shm.sweep import Sweeps


class Clock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        self.t += 0.001
        return self.t


def rows_of(reg: Registry) -> list[tuple[str, str, float]]:
    return [(k[0], k[1], v[1]) for k, v in reg.table("cancellations").scan()]


def cancel_paused_before_evicting(chan: Chan, name: str, rid: str, scope: str, at: float) -> None:
    """Cancel ``rid``; when the insert has found the table at its cap (under the lock) and is
    about to evict outside it, say "at cap" and wait for "go"."""
    real = shm_storage.ShmBackend.evict
    paused: list[bool] = []

    def evict(self: Any, batch: int, *a: Any, **kw: Any) -> int:
        if not paused:
            paused.append(True)
            chan.send("at cap")
            assert chan.recv() == "go"
        return real(self, batch, *a, **kw)

    shm_storage.ShmBackend.evict = evict  # type: ignore[method-assign]  # this child only
    Cancellation(Registry.attach(name), clock=lambda: at).cancel(rid, None, scope)
    chan.send({"paused": bool(paused)})


@pytest.mark.parametrize("cap", [40, 5120])  # batch 2 (row by row), 256 (one bulk rewrite)
def test_two_inserts_meeting_the_cap_together_evict_one_batch(registry, spawn, cap) -> None:
    """Contract §4.4: an insert that finds the table at its cap removes one batch. Two inserts
    that find it at the cap at once are two inserts in some order: the first evicts a batch
    and inserts, the second then finds room (the batch is more than one row) and inserts. A
    second process that decided "at the cap" under the lock and evicts outside it after the
    first one's eviction and insert must not take a second batch of other callers' rows."""
    reg = registry(max_rows=cap, capacity=cap, max_rows_per_scope=None)
    batch = cap // 20
    clock = Clock()
    c = Cancellation(reg, clock=clock)
    for i in range(cap):
        c.cancel(i, None, f"ip:s{i % 4}")
    before = rows_of(reg)
    b = spawn(cancel_paused_before_evicting, reg.name, "b", "ip:b", clock.t + 10)
    assert b.recv() == "at cap"
    c.cancel("a", None, "ip:a")  # this process evicts the first batch and inserts
    b.send("go")
    assert b.recv() == {"paused": True}
    assert b.wait() == 0
    left = {(s, i) for s, i, _ in rows_of(reg)}
    victims = set(choose(before, batch))
    assert left == {(s, i) for s, i, _ in before} - victims | {("ip:a", "a"), ("ip:b", "b")}
    assert reg.evictions == batch
    assert reg.table("cancellations").count() == cap - batch + 2


def killed_after_the_rewrite(chan: Chan, name: str, at: float, op: str) -> None:
    """Run ``op`` ("evict": cancel a new row at the cap; "cleanup"); once its bulk rewrite of
    the index is over (its hold released), say "rewritten" and wait to be killed there."""
    real = Sweeps._bulk_delete

    def _bulk_delete(self: Any, *a: Any, **kw: Any) -> Any:
        got = real(self, *a, **kw)
        assert got, "no bulk rewrite"
        chan.send("rewritten")
        chan.recv(timeout=60)  # killed here
        return got

    Sweeps._bulk_delete = _bulk_delete  # type: ignore[method-assign]  # this child only
    c = Cancellation(Registry.attach(name), clock=lambda: at)
    c.cancel("new", None, "ip:new") if op == "evict" else c.cleanup()


def test_an_evicter_killed_before_the_counts_leaves_the_quota_whole(registry, spawn) -> None:
    """Contract §4.4: the per-scope check comes first, so a caller under its own quota is
    always served. An evicter SIGKILLed (gunicorn's timeout) right after the hold of its bulk
    rewrite (a batch of 256 or more), which removed the largest scope's oldest rows, did not
    hold the lock when it died, so no lock recovery marks the counts as suspect: the scope, now
    well under its quota, must still be served (not refused until the next cleanup)."""
    reg = registry(max_rows=5120, capacity=5120, max_rows_per_scope=1000)  # batch 256
    clock = Clock()
    c = Cancellation(reg, clock=clock)
    for i in range(1000):
        c.cancel(i, None, "ip:big")
    with pytest.raises(CancellationLimitReached):  # this process has its counts checked
        c.cancel("over", None, "ip:big")
    for i in range(4120):
        c.cancel(i, None, f"ip:s{i % 10}")
    k = spawn(killed_after_the_rewrite, reg.name, clock.t + 10, "evict")
    assert k.recv() == "rewritten"
    k.kill()
    big = sum(1 for s, _, _ in rows_of(reg) if s == "ip:big")
    assert big == 1000 - 256
    c.cancel("one more", None, "ip:big")  # 745 of 1000: under the quota
    assert c._store.scope_rows("ip:big") == big + 1


def expired_scope_at_its_quota(reg: Registry) -> tuple[Cancellation, Clock]:
    """Fill "ip:big" to its quota of 1000 rows (refused once: this process has its counts
    checked), then move the clock past their ttl."""
    clock = Clock()
    c = Cancellation(reg, clock=clock)
    for i in range(1000):
        c.cancel(i, None, "ip:big")
    with pytest.raises(CancellationLimitReached):
        c.cancel("over", None, "ip:big")
    clock.t += reg.config.ttl + 1
    return c, clock


def test_a_cleanup_killed_after_its_rewrite_leaves_the_quota_whole(registry, spawn) -> None:
    """Contract §4.4 and §4.6: a cleanup SIGKILLed right after the hold of its bulk rewrite
    (256 expired rows or more), which removed every row of a scope at its quota, held no lock
    when it died: the scope's count must already have fallen with its rows, or the scope stays
    refused with no row at all until the next cleanup."""
    reg = registry(max_rows=2000, capacity=2000, max_rows_per_scope=1000)
    c, clock = expired_scope_at_its_quota(reg)
    for i in range(300):
        c.cancel(i, None, f"ip:s{i}")  # young rows, a scope each: their counts stay
    k = spawn(killed_after_the_rewrite, reg.name, clock.t, "cleanup")
    assert k.recv() == "rewritten"
    k.kill()
    assert not any(s == "ip:big" for s, _, _ in rows_of(reg))
    c.cancel("one more", None, "ip:big")
    assert c._store.scope_rows("ip:big") == 1
    assert all(c._store.scope_rows(f"ip:s{i}") == 1 for i in range(300))


def cleanup_killed_between_its_rewrites(chan: Chan, name: str, at: float) -> None:
    """Run a cleanup; in the hold of its bulk rewrite, after the cancellations' index is stored
    and before the counts are, say "between" and wait to be killed there."""

    def store(self: Any) -> None:
        chan.send("between")
        chan.recv(timeout=60)  # killed here

    Uncount.store = store  # type: ignore[method-assign]  # this child only
    Cancellation(Registry.attach(name), clock=lambda: at).cleanup()


def test_a_cleanup_killed_between_its_rewrites_evicts_nothing_below_the_cap(registry,
                                                                             spawn) -> None:
    """Contract §4.4: only an insert that finds the table at its cap evicts. A cleanup SIGKILLed
    inside its hold between the cancellations' rewrite and the counts' (a scope per row, 600 of
    1000 expired) leaves 600 counts high whose rows are gone; scope_counts holds max_rows + a
    quarter, so new scopes fill it with the table at 650 rows of 1000. The lock was recovered:
    the counts are suspect and must be recounted, not a batch of other callers' rows evicted
    to make room for a count."""
    reg = registry(max_rows=1000, capacity=1000, max_rows_per_scope=None)
    clock = Clock()
    c = Cancellation(reg, clock=clock)
    for i in range(600):
        c.cancel(i, None, f"ip:old{i}")
    clock.t += reg.config.ttl + 1
    for i in range(400):
        c.cancel(i, None, f"ip:young{i}")
    k = spawn(cleanup_killed_between_its_rewrites, reg.name, clock.t)
    assert k.recv() == "between"
    k.kill()
    assert reg.table("cancellations").count() == 400
    for i in range(300):
        c.cancel(i, None, f"ip:new{i}")
    assert reg.evictions == 0
    assert reg.table("cancellations").count() == 700
    assert all(c._store.scope_rows(f"ip:new{i}") == 1 for i in range(300))


def cleanup_quit_between_its_rewrites(chan: Chan, name: str, at: float, thread: bool) -> None:
    """Run a cleanup whose process gets gunicorn's quit (a handler raising SystemExit) in the
    hold of its bulk rewrite, once the cancellations' index is stored, right before the
    counts are. ``thread``: with a second thread alive (a gunicorn worker has its janitor's),
    to which the kernel delivers the signal when this one blocks it."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if thread:
        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
    real = Uncount.store
    sent: list[bool] = []

    def store(self: Any) -> None:
        if not sent:  # one signal: the store run again to complete it gets none
            sent.append(True)
            chan.send("between")
            os.kill(os.getpid(), signal.SIGTERM)  # its handler runs at a bytecode check
            deadline = time.monotonic() + 2  # here, unless this thread holds it back
            while time.monotonic() < deadline:
                pass
        real(self)

    Uncount.store = store  # type: ignore[method-assign]  # this child only
    try:
        Cancellation(Registry.attach(name), clock=lambda: at).cleanup()
    except SystemExit:
        chan.send("quit")
        raise
    chan.send("cleanup returned")


@pytest.mark.parametrize("thread", [False, True])
def test_a_cleanup_quit_between_its_rewrites_leaves_the_quota_whole(registry, spawn,
                                                                    thread: bool) -> None:
    """Contract §4.4 (a caller under its quota is always served), design "A writer killed at
    any bytecode": gunicorn's signal handlers raise SystemExit anywhere. Raised in a cleanup's
    hold between the rewrite that removed every row of a scope at its quota and the store of
    its counts, the lock is released normally (no recovery marks the counts suspect), so the
    scope stayed refused with no row at all. The two stores are completed before the
    exception goes on (blocking signals in this thread does not stop Python's handler running
    in it when another thread takes the signal)."""
    reg = registry(max_rows=2000, capacity=2000, max_rows_per_scope=1000)
    c, clock = expired_scope_at_its_quota(reg)
    k = spawn(cleanup_quit_between_its_rewrites, reg.name, clock.t, thread)
    assert k.recv() == "between"  # the signal came between the two stores
    assert k.recv() == "quit"  # and its SystemExit went on out of the cleanup
    assert k.wait() != 0
    assert reg.table("cancellations").count() == 0
    c.cancel("one more", None, "ip:big")
    assert c._store.scope_rows("ip:big") == 1
