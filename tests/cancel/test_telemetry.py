"""contract §4.7: telemetry attach/detach semantics and the events the cancellation layer emits
(metadata checked against a real registry)."""

from __future__ import annotations

import logging

import pytest

from shmcancel import telemetry

EV = ("shmcancel", "test", "event")


@pytest.fixture(autouse=True)
def _clean_handlers():
    before = set(telemetry.list_handlers())
    yield
    for hid in set(telemetry.list_handlers()) - before:
        telemetry.detach(hid)


def test_attach_execute_detach():
    seen = []
    telemetry.attach("t1", EV, lambda *a: seen.append(a), config={"c": 1})
    telemetry.execute(EV, {"count": 1}, {"k": "v"})
    assert seen == [(EV, {"count": 1}, {"k": "v"}, {"c": 1})]
    telemetry.execute(("shmcancel", "other"), {}, {})
    assert len(seen) == 1
    telemetry.detach("t1")
    telemetry.execute(EV, {}, {})
    assert len(seen) == 1


def test_attach_with_existing_id_replaces():
    seen = []
    telemetry.attach("t1", EV, lambda *a: seen.append("first"))
    telemetry.attach("t1", EV, lambda *a: seen.append("second"))
    telemetry.execute(EV, {}, {})
    assert seen == ["second"]
    assert telemetry.list_handlers(EV).count("t1") == 1


def test_listening_follows_attach_and_detach():
    base = bool(telemetry.list_handlers())  # handlers other tests' modules may have left
    telemetry.attach("t1", EV, lambda *a: None)
    assert telemetry.listening() is True
    telemetry.detach("t1")
    assert telemetry.listening() is base


def test_detach_unknown_is_a_noop():
    telemetry.detach("never-attached")


def test_raising_handler_is_detached_and_logged(caplog):
    seen = []

    def bad(*a):
        raise RuntimeError("handler bug")

    telemetry.attach("bad", EV, bad)
    telemetry.attach("good", EV, lambda *a: seen.append(1))
    with caplog.at_level(logging.ERROR, logger="shmcancel.telemetry"):
        telemetry.execute(EV, {}, {})  # does not raise
    assert "bad" not in telemetry.list_handlers()
    assert seen == [1]
    assert any("handler bug" in (r.exc_text or "") or r.exc_info for r in caplog.records)
    telemetry.execute(EV, {}, {})
    assert seen == [1, 1]


def test_attach_rejects_non_callable():
    with pytest.raises(TypeError):
        telemetry.attach("x", EV, "not callable")  # type: ignore[arg-type]


@pytest.mark.parametrize(("handler_id", "event"), [
    ("x", "shmcancel"), ("x", ("shmcancel", 5)), ("x", None), (5, ("shmcancel",))])
def test_attach_rejects_an_event_or_id_that_could_never_be_meant(handler_id, event):
    """A str event was taken apart into its characters (``('s', 'h', ...)``): a handler that
    never fired, silently."""
    with pytest.raises(TypeError):
        telemetry.attach(handler_id, event, lambda *a: None)
    assert handler_id not in telemetry.list_handlers()


def test_a_fork_child_emits_when_a_parent_thread_held_the_lock_at_the_fork(registry, spawn):
    """A thread of the parent (a worker's janitor emitting its cleanup event) inside
    ``execute`` when the process forks must not leave the child's telemetry lock taken: the
    child's first cancel with a handler attached would wait for it forever."""
    import threading

    from shmcancel import Cancellation
    from shmcancel.shm.registry import Registry

    reg = registry()
    telemetry.attach("fork-child", ("shmcancel", "request", "cancelled"), lambda *a: None)
    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        with telemetry._lock:  # what execute/attach/detach hold, for an instant each
            held.set()
            release.wait(10)

    t = threading.Thread(target=holder)
    t.start()
    try:
        assert held.wait(10)

        def child(chan) -> None:
            c = Cancellation(Registry.attach(reg.name))
            c.cancel(1, "in the child", "s")
            chan.send("cancelled")

        kid = spawn(child)
    finally:
        release.set()
        t.join(10)
    assert kid.recv(5) == "cancelled"
    assert kid.wait() == 0


# --- a handler's BaseException ----------------------------------------------------------------
# KeyboardInterrupt or SystemExit from a signal that arrives while a handler runs, or a
# framework's own BaseException, is not the handler's fault: it propagates out of the library
# call that emitted the event, and the handler stays attached. The library emits only once the
# shared state the event reports is complete and the lock released, so the tables are consistent
# whatever propagates.

RECOVERED = ("shmcancel", "lock", "recovered")
CANCELLED = ("shmcancel", "request", "cancelled")
CLEANUP = ("shmcancel", "cancellation", "cleanup")
S = "session:s"


class _Stop(BaseException):
    """A framework's own BaseException (not an Exception), e.g. gevent's Timeout."""


BASE_EXCEPTIONS = [SystemExit, KeyboardInterrupt, _Stop]


def _raising(exc: type[BaseException]):
    def handler(*a) -> None:
        raise exc("from a telemetry handler")
    return handler


def _die_holding_the_lock(chan, name: str) -> None:
    from shmcancel.shm.registry import Registry

    Registry.attach(name).lock.__enter__()
    chan.send("held")
    chan.recv(60)  # SIGKILLed here, the lock held


def _kill_a_holder(spawn, reg) -> int:
    """A process that took ``reg``'s lock and was SIGKILLed (reaped) holding it: the next
    acquire recovers the lock. Its pid."""
    kid = spawn(_die_holding_the_lock, reg.name)
    assert kid.recv() == "held"
    kid.kill()
    return kid.pid


def _consistent(reg, scopes=(S, "ip:1")) -> None:
    """Every table sound (fsck repairs nothing), the scope counts equal the rows (of every
    scope with rows, and of ``scopes``: 0 without), the lock free."""
    from collections import Counter

    from helpers.table_rig import healthy

    from shmcancel.cancel.shm_storage import ShmBackend

    with reg.lock:
        for t in reg.tables.values():
            healthy(t)
    rows = Counter(k[0] for k, _ in reg.table("cancellations").scan())
    backend = ShmBackend(reg)
    assert {s: backend.scope_rows(s) for s in {*rows, *scopes}} == {
        s: rows.get(s, 0) for s in {*rows, *scopes}}
    assert reg.lock.owner() is None and not reg.lock.held_by_me()


@pytest.mark.parametrize("exc", BASE_EXCEPTIONS)
def test_a_base_exception_from_a_handler_propagates_and_the_handler_stays(exc):
    seen = []
    telemetry.attach("stop", EV, _raising(exc))
    telemetry.attach("after", EV, lambda *a: seen.append(1))
    with pytest.raises(exc):
        telemetry.execute(EV, {}, {})
    assert telemetry.list_handlers(EV) == ["stop", "after"]
    assert seen == []  # the handlers after it are not called for that event


def test_lock_recovered_is_emitted_once_the_recovering_hold_is_released(registry, spawn):
    """The recovery happens as a write takes the lock; its event comes when that write's hold
    is released: the handler runs outside the lock and sees the write done."""
    from shmcancel import Cancellation

    reg = registry()
    c = Cancellation(reg)
    seen = []
    telemetry.attach("recovered", RECOVERED, lambda e, m, md, cfg: seen.append(
        (md["dead_pid"], reg.lock.held_by_me(), reg.lock.owner(), c.cancelled(1, S))))
    pid = _kill_a_holder(spawn, reg)
    c.cancel(1, "why", S)
    assert seen == [(pid, False, None, True)]
    assert reg.recoveries == 1


def test_lock_recovered_is_not_emitted_by_another_thread_under_the_recovering_hold(registry,
                                                                                 spawn):
    """The recovering hold's event is that hold's to emit: another thread of the process
    finishing its own release (past its post, before it looks at the queue) while this one
    recovers must not emit it under this one's hold, before its write is done. The other
    thread is held at that line by a trace hook while the lock is recovered."""
    import inspect
    import sys
    import threading

    from shmcancel import Cancellation
    from shmcancel.shm.lock import RegistryLock

    reg = registry()
    c = Cancellation(reg)
    seen = []
    telemetry.attach("recovered", RECOVERED, lambda e, m, md, cfg: seen.append(
        (threading.current_thread().name, reg.lock.owner(), c.cancelled(1, S))))
    lines, first = inspect.getsourcelines(RegistryLock.__exit__)
    at = first + next(i for i, ln in enumerate(lines) if "if st.recovered" in ln)
    paused, go = threading.Event(), threading.Event()

    def trace(frame, event, arg):
        if frame.f_code is RegistryLock.__exit__.__code__:
            def local(frame, event, arg):
                if event == "line" and frame.f_lineno == at and not paused.is_set():
                    paused.set()
                    go.wait(10)
                return local
            return local
        return None

    def other() -> None:
        sys.settrace(trace)
        try:
            with reg.lock:
                pass
        finally:
            sys.settrace(None)

    t = threading.Thread(target=other, name="other")
    t.start()
    try:
        assert paused.wait(10)  # released, about to look at the queue
        pid = _kill_a_holder(spawn, reg)
        with reg.lock:  # recovers
            go.set()
            t.join(10)
            assert seen == [], "emitted by another thread while the recovering hold runs"
            c.cancel(1, "why", S)
        assert seen == [("MainThread", None, True)]
        assert reg.recoveries == 1 and pid
    finally:
        go.set()
        t.join(10)


@pytest.mark.parametrize("exc", BASE_EXCEPTIONS)
def test_a_base_exception_at_lock_recovery_leaves_a_request_end_complete(registry, spawn, exc):
    """A request's end is two writes (its in-flight row, then the key's cancellation row): the
    clear's hold recovers the lock from a dead holder, and what the recovered handler raises
    comes after the clear, not between the two."""
    from shmcancel import Cancellation

    reg = registry()
    c = Cancellation(reg)
    h = c.begin(1, S)
    c.cancel(1, "why", S)
    telemetry.attach("recovered", RECOVERED, _raising(exc))
    _kill_a_holder(spawn, reg)
    with pytest.raises(exc):
        h.end()
    assert not c.in_flight(1, S)
    assert reg.table("cancellations").count() == 0, "the end's clear was cut off"
    assert reg.recoveries == 1 and "recovered" in telemetry.list_handlers(RECOVERED)
    _consistent(reg)


@pytest.mark.parametrize("exc", BASE_EXCEPTIONS)
def test_a_base_exception_from_a_cancelled_handler_leaves_the_whole_scope_cancelled(registry,
                                                                                   exc):
    """``cancel_scope`` (a session's DELETE) writes every row of the scope before the first
    event: a handler's BaseException cannot leave the rest of the session's calls running."""
    from shmcancel import Cancellation

    reg = registry()
    c = Cancellation(reg)
    handles = [c.begin(i, S) for i in range(3)]
    telemetry.attach("cancelled", CANCELLED, _raising(exc))
    with pytest.raises(exc):
        c.cancel_scope(S, "session deleted")
    assert [h.cancelled() for h in handles] == [True, True, True]
    assert reg.table("cancellations").count() == 3
    _consistent(reg)
    telemetry.detach("cancelled")
    for h in handles:
        h.end()
    assert reg.table("cancellations").count() == 0
    _consistent(reg)


@pytest.mark.parametrize("event", ["cancelled", "cleanup"])
def test_a_base_exception_from_a_handler_comes_after_the_write_it_reports(registry, event):
    """A cancel's event comes after its row, cleanup's after the sweep."""
    from helpers.clock import Clock

    from shmcancel import Cancellation

    clock = Clock()
    reg = registry(ttl=1.0)
    c = Cancellation(reg, clock=clock)
    for i in range(5):
        c.cancel(i, "old", "ip:1")
    clock.tick(10.0)
    telemetry.attach("stop", CANCELLED if event == "cancelled" else CLEANUP,
                     _raising(SystemExit))
    with pytest.raises(SystemExit):
        if event == "cancelled":
            c.cancel("new", "why", S)
        else:
            c.cleanup()
    if event == "cancelled":
        assert c.reason("new", S) == "why" and reg.table("cancellations").count() == 6
    else:
        assert reg.table("cancellations").count() == 0
    _consistent(reg)
