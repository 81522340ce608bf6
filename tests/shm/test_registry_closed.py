"""A registry closed in this process (``Registry.close()``): whatever reads or writes its
segment, through the registry, its tables, lanes, lock or a watch made before the close, raises
``RegistryClosed`` (a ``ShmCancelError`` naming the registry and saying it is closed), never the
raw error of a released view or a closed semaphore; what the object knows without the segment
still answers. ``unlink()`` closes nothing. Real segments in /dev/shm throughout."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

import shmcancel
from shmcancel import Config, RegistryClosed, ShmCancelError
from shmcancel.shm.registry import Registry

SMALL = Config(capacity=400, max_rows=200, in_flight_capacity=64, session_capacity=16)
KEY = ("s", "1")

# Every entry point that touches the segment, as ``name: call(registry)``.
OPS: dict[str, Callable[[Registry], Any]] = {
    # the registry: its header, its checks, its tables
    "info": lambda r: r.info(),
    "check": lambda r: r.check(),
    "fsck": lambda r: r.fsck(),
    "recoveries": lambda r: r.recoveries,
    "evictions": lambda r: r.evictions,
    "add_evictions": lambda r: r.add_evictions(1),
    "last_sweep": lambda r: r.last_sweep,
    "claim_sweep": lambda r: r.claim_sweep(1e12, 1.0),
    "creator": lambda r: r.creator,
    "belongs_to": lambda r: r.belongs_to(1, 1),
    "adopt": lambda r: r.adopt(),
    "table()": lambda r: r.table("cancellations"),
    "tables": lambda r: r.tables,
    # the lock
    "lock.__enter__": lambda r: r.lock.__enter__(),
    "lock.owner": lambda r: r.lock.owner(),
    "lock.generation": lambda r: r.lock.generation,
    "lock.recoveries": lambda r: r.lock.recoveries,
    "lock.idle_generation": lambda r: r.lock.idle_generation(),
    # the lanes (shmtool stats reads them)
    "lanes.rows": lambda r: r.lanes["in_flight"].rows(),
    "lanes.lane_owners": lambda r: r.lanes["in_flight"].lane_owners(),
    "lanes.own_rows": lambda r: r.lanes["in_flight"].own_rows(),
    "lanes.reap": lambda r: r.lanes["in_flight"].reap(),
    "lanes.sealed": lambda r: r.lanes["in_flight"].sealed(),
}

# A table's operations, as ``name: call(table)`` (the table taken before the close).
TABLE_OPS: dict[str, Callable[[Any], Any]] = {
    "count": lambda t: t.count(),
    "member": lambda t: t.member(KEY),
    "get": lambda t: t.get(KEY),
    "lookup": lambda t: t.lookup(KEY),
    "word": lambda t: t.word(KEY),
    "watch": lambda t: t.watch(KEY),
    "scan": lambda t: t.scan(),
    "scan_slots": lambda t: t.scan_slots(0, 16),
    "large_rows": lambda t: t.large_rows(),
    "sweep_rows": lambda t: t.sweep_rows(),
    "stats": lambda t: t.stats(),
    "check": lambda t: t.check(deep=True),
    "copy_index": lambda t: t.copy_index(),
    "insert": lambda t: t.insert(KEY, (None, 1.0)),
    "delete": lambda t: t.delete(KEY),
    "delete_where": lambda t: t.delete_where(lambda k, v: True),
}


def _closed_error(excinfo: pytest.ExceptionInfo[BaseException], name: str) -> None:
    e = excinfo.value
    assert type(e) is RegistryClosed
    assert isinstance(e, ShmCancelError) and isinstance(e, ValueError)
    assert f"registry {name} is closed" in str(e), str(e)
    # the raw error it replaces (if any) stays out of the traceback
    assert e.__cause__ is None and (e.__context__ is None or e.__suppress_context__)


@pytest.fixture
def closed(registry) -> Registry:
    """A registry with a row in each kind of table, closed (the fixture unlinks it)."""
    reg = registry()
    reg.table("cancellations").insert(KEY, ("why", 1.0))
    reg.table("in_flight").insert(KEY, (1, 2, 3, 0))
    reg.close()
    return reg


@pytest.mark.parametrize("op", OPS)
def test_a_closed_registry_raises_registry_closed(closed: Registry, op: str) -> None:
    with pytest.raises(RegistryClosed) as excinfo:
        OPS[op](closed)
    _closed_error(excinfo, closed.name)


@pytest.mark.parametrize("op", TABLE_OPS)
def test_a_table_of_a_closed_registry_raises_registry_closed(registry, op: str) -> None:
    reg = registry()
    t = reg.table("cancellations")
    t.insert(KEY, ("why", 1.0))
    reg.close()
    with pytest.raises(RegistryClosed) as excinfo:
        TABLE_OPS[op](t)
    _closed_error(excinfo, reg.name)


@pytest.mark.parametrize("cached", [False, True])
def test_a_watch_made_before_the_close_raises_registry_closed(registry, cached: bool) -> None:
    """A watch keeps the table's version view: its hot path (one load) meets the released view
    and translates it."""
    reg = registry()
    t = reg.table("cancellations")
    w = t.watch(KEY)
    if cached:
        assert w.member() is False  # now answered by the cached version check
    reg.close()
    for call in (w.member, w.values):
        with pytest.raises(RegistryClosed) as excinfo:
            call()
        _closed_error(excinfo, reg.name)


def test_a_read_only_attachment_closed_raises_registry_closed(registry) -> None:
    reg = registry()
    ro = Registry.attach(reg.name, readonly=True)
    t = ro.table("cancellations")
    ro.close()
    for call in (t.count, t.scan, lambda: t.get(KEY), ro.info, ro.lock.owner,
                 lambda: ro.lock.generation, ro.lock.__enter__):
        with pytest.raises(RegistryClosed) as excinfo:
            call()
        _closed_error(excinfo, reg.name)


def test_what_needs_no_segment_still_answers_after_close(registry) -> None:
    reg = registry()
    ident, cfg = reg.identity, reg.config
    reg.close()
    assert reg.closed and reg.name and reg.config == cfg and reg.identity == ident
    assert reg.readonly is False and reg.hash_key == ident[1]
    assert reg.at_name() is True and reg.attach_problems() == {}
    assert repr(reg) == f"<Registry {reg.name} closed>"
    assert repr(reg.lock) == f"<RegistryLock {reg.name} closed>"
    reg.close()  # idempotent
    reg.unlink()
    assert reg.at_name() is False


def test_closing_one_attachment_leaves_another_of_this_process_working(registry) -> None:
    reg = registry()
    other = Registry.attach(reg.name)
    t, t2 = reg.table("cancellations"), other.table("cancellations")
    other.close()
    t.insert(KEY, ("why", 1.0))
    assert t.get(KEY) == ("why", 1.0) and t.count() == 1
    with pytest.raises(RegistryClosed):
        t2.count()


def test_a_write_through_a_closed_attachment_inside_another_ones_hold(registry) -> None:
    """Two attachments of one registry in one process share the lock's per-process state: a
    thread holding it through the open one re-enters it through the closed one without
    touching the semaphore; the write itself then meets the released views."""
    reg = registry()
    other = Registry.attach(reg.name)
    t2 = other.table("cancellations")
    other.close()
    with reg.lock, pytest.raises(RegistryClosed) as excinfo:
        t2.insert(KEY, (None, 1.0))
    _closed_error(excinfo, reg.name)
    assert reg.table("cancellations").count() == 0
    assert reg.lock.owner() is None  # released: the write left nothing held


def test_unlink_does_not_close(registry) -> None:
    """``Registry.unlink()`` removes the names only: this process (like every attached one)
    keeps its mapping, reads and writes work until it closes it (contract §2, shmtool
    ``unlink``)."""
    reg = registry()
    t = reg.table("cancellations")
    reg.unlink()
    assert not reg.closed and not reg.at_name()
    t.insert(KEY, ("why", 1.0))
    assert t.get(KEY) == ("why", 1.0)
    assert reg.info()["name"] == reg.name and reg.check() == {}
    reg.close()
    with pytest.raises(RegistryClosed):
        t.count()


def test_registry_closed_is_exported() -> None:
    assert shmcancel.RegistryClosed is RegistryClosed
    assert "RegistryClosed" in shmcancel.__all__
