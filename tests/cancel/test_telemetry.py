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
