"""Waking a tool that waits for its cancellation (:mod:`shmcancel.mcp.wake`), in one process over
a real registry: a ring reaches this process's own doorbell, the watcher thread wakes exactly the
cancelled waiters, and a stray datagram wakes nobody early."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from typing import Any

import pytest
from helpers.background import Background
from helpers.procs import Chan, first_message
from helpers.rings import set_rings_only

from shmcancel.cancel.policy import Cancellation
from shmcancel.mcp import disconnect, wake
from shmcancel.mcp.conn import HANDLE_KEY
from shmcancel.shm.registry import Registry

LONG = 20.0  # seconds a wait would last unwoken
BOUND = 1.0  # seconds within which a woken wait must return (generous)


@pytest.fixture
def minute_waits(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The waits' own looks and the watcher thread's idle wait a minute apart: what ends a wait
    in the test is the thread's looks (once poked) or a ring. Afterwards the thread turns once,
    so that its next idle wait is computed from the restored setting."""
    monkeypatch.setattr(wake, "_SLICE", 60.0)
    monkeypatch.setattr(disconnect, "IDLE_WAIT", 60.0)
    yield
    monkeypatch.undo()
    for name in list(wake._bells):
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX,
                                                         socket.SOCK_DGRAM) as s:
            s.sendto(b"", wake.doorbell_address(name, os.getpid()))


def _waiting(n: int, deadline: float) -> None:
    while wake.waiting() < n:
        assert time.monotonic() < deadline, "the wait did not start"
        time.sleep(0.005)


def _until_idle() -> None:
    """Until the watcher thread is idle (not armed): in its long wait, from which only a poke
    (or a ring) brings it back."""
    thread = disconnect.watcher_thread()
    deadline = time.monotonic() + 5
    while wake._armed:
        assert time.monotonic() < deadline and thread is not None and thread.is_alive()
        time.sleep(0.005)


def _ring_own_bell(reg: Registry) -> float:
    """A datagram to this process's doorbell for ``reg`` (a ring from elsewhere); when."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(b"", wake.doorbell_address(reg.name, os.getpid()))
    return time.monotonic()


def _long_wait(h: Any, n: int) -> Background:
    """A wait of ``LONG`` seconds on ``h``'s call, started; returns once ``n`` waits are on."""
    w = Background(lambda: wake.wait_cancelled({HANDLE_KEY: h}, LONG))
    w.start()
    _waiting(n, time.monotonic() + 5)
    return w


def _ends_cancelled_soon(w: Background, since: float) -> None:
    """``w``'s wait returned cancelled, within half a second of ``since`` (generous for a
    loaded machine, far under the minute-long slices these tests set)."""
    assert w.result(timeout=BOUND + 1) is True
    assert w.done_at - since < 0.5  # type: ignore[operator]


def _a_rung_cancellation_ends_a_wait(c: Cancellation, h: Any) -> None:
    """A wait on ``h``'s call (id 1 or 2, scope ``"s"``), its cancellation rung at this
    process's doorbell: the wait ends cancelled at once."""
    w = _long_wait(h, 1)
    assert c.cancel_if_in_flight(h.request_id, "stop", "s")
    _ends_cancelled_soon(w, _ring_own_bell(c.registry))


def _cancel_unrung(reg: Registry, rid: int) -> float:
    """Cancel ``rid`` in scope ``"s"`` through another attachment, without a transport: nobody
    rings. When it was recorded (monotonic seconds)."""
    other = Cancellation(Registry.attach(reg.name))
    try:
        assert other.cancel_if_in_flight(rid, "stop", "s")
    finally:
        other.registry.close()
    return time.monotonic()


def _end_the_watcher_loop() -> Any:
    """Close the watcher loop's epoll descriptor behind its back (a ``closerange``) and wait
    for its thread to end; the loop."""
    loop = disconnect.process_loop()
    assert loop is not None
    os.close(loop._ep.fileno())
    loop.thread.join(65)  # its wait ends within the idle wait (patched to a minute: at once,
    assert not loop.thread.is_alive()  # as it was polling every WAIT_POLL for the waits)
    return loop


def test_a_ring_wakes_a_cancelled_waiter_and_no_other(registry, rings_only) -> None:
    reg = registry()
    c = Cancellation(reg)
    h1, h2 = c.begin(1, "s"), c.begin(2, "s")
    try:
        began: list[float] = []

        def wait2() -> bool:
            began.append(time.monotonic())
            return wake.wait_cancelled({HANDLE_KEY: h2}, 0.5)

        w1 = Background(lambda: wake.wait_cancelled({HANDLE_KEY: h1}, LONG))
        w2 = Background(wait2)
        w1.start()
        w2.start()
        _waiting(2, time.monotonic() + 5)
        assert c.cancel_if_in_flight(1, "stop", "s")
        rang = time.monotonic()
        wake.ring(reg.name)
        assert w1.result(timeout=BOUND + 1) is True
        assert w1.done_at - rang < BOUND  # type: ignore[operator]
        assert w2.result(timeout=5) is False  # not cancelled: it waited its own 0.5 s out
        assert w2.done_at - began[0] >= 0.45  # type: ignore[operator]
    finally:
        h1.end()
        h2.end()


def test_a_stray_datagram_wakes_nobody_early(registry) -> None:
    reg = registry()
    c = Cancellation(reg)
    h = c.begin(1, "s")
    try:
        t0 = time.monotonic()
        w = Background(lambda: wake.wait_cancelled({HANDLE_KEY: h}, 0.6))
        w.start()
        _waiting(1, t0 + 5)
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            for _ in range(50):
                s.sendto(b"x" * 100, wake.doorbell_address(reg.name, os.getpid()))
        assert w.result(timeout=5) is False
        assert w.done_at - t0 >= 0.5  # type: ignore[operator]
    finally:
        h.end()


@pytest.mark.parametrize("seconds", [LONG, float("inf")])  # endless: woken, not refused
def test_wake_after_cancel_local_returns_at_once(registry, seconds: float) -> None:
    c = Cancellation(registry())
    h = c.begin(1, "s")
    try:
        w = Background(lambda: wake.wait_cancelled({HANDLE_KEY: h}, seconds))
        w.start()
        _waiting(1, time.monotonic() + 5)
        h.cancel_local("client disconnected")
        woke = time.monotonic()
        wake.wake(h)
        assert w.result(timeout=BOUND + 1) is True
        assert w.done_at - woke < BOUND  # type: ignore[operator]
        assert wake.waiting() == 0
    finally:
        h.end()


def test_a_cancellation_nobody_rang_is_seen_by_the_watchers_looks(
        registry, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cancellation recorded without a ring (another host's, a script's through the public
    API) still ends a long wait within ``WAIT_POLL``, seen by the watcher thread's looks at the
    waiting calls: the waits' own looks are a minute apart here, so nothing else can end it."""
    monkeypatch.setattr(wake, "_SLICE", 60.0)
    reg = registry()
    c = Cancellation(reg)
    h1, h2 = c.begin(1, "s"), c.begin(2, "s")
    wake.wait_cancelled({HANDLE_KEY: h1}, 0)  # the doorbell made, and the watcher thread
    _until_idle()
    try:
        w1 = Background(lambda: wake.wait_cancelled({HANDLE_KEY: h1}, LONG))
        w2 = Background(lambda: wake.wait_cancelled({HANDLE_KEY: h2}, LONG))
        w1.start()
        w2.start()
        _waiting(2, time.monotonic() + 5)
        at = _cancel_unrung(reg, 2)
        assert w2.result(timeout=BOUND + 1) is True
        # a look within WAIT_POLL; generous for a loaded machine, but under the watcher
        # thread's 1 s idle wait, which a wait that did not poke it would sit out
        assert w2.done_at - at < 0.5  # type: ignore[operator]
        assert w1.done_at is None and wake.waiting() == 1  # not cancelled: waits on
        h1.cancel_local("stop")
        wake.wake(h1)
        assert w1.result(timeout=BOUND + 1) is True
    finally:
        h1.end()
        h2.end()


@pytest.mark.parametrize("closed", ["doorbell", "doorbell and sender"])
def test_a_doorbell_closed_behind_the_processs_back_is_made_again_by_the_next_wait(
        registry, monkeypatch: pytest.MonkeyPatch, minute_waits, closed: str) -> None:
    """A ``closerange`` in a worker closes its doorbell: rings and pokes then reach nobody. The
    next wait that pokes the idle watcher thread finds it refused and makes the doorbell again:
    its cancellation is seen within the looks, and a ring reaches the process again. The idle
    wait and the waits' own looks are a minute here: without the new doorbell nothing ends it."""
    reg = registry()
    c = Cancellation(reg)
    h1, h2 = c.begin(1, "s"), c.begin(2, "s")
    try:
        wake.wait_cancelled({HANDLE_KEY: h1}, 0)  # the doorbell made; the thread looks, then
        _until_idle()  # ... idles, in a wait of a minute
        old = wake._bells[reg.name][1]
        os.close(old.fileno())  # behind its back: the socket object still has the number
        if closed != "doorbell":  # a closerange takes the ringing socket too (the next number)
            assert wake._sender is not None
            os.close(wake._sender[1].fileno())
        w1 = _long_wait(h1, 1)
        at = _cancel_unrung(reg, 1)
        _ends_cancelled_soon(w1, at)
        assert wake._bells[reg.name][1] is not old
        # and the new doorbell takes rings: a wait of the idle thread is ended by one
        monkeypatch.setattr(wake, "_poke", lambda registry_name: True)
        _until_idle()
        _a_rung_cancellation_ends_a_wait(c, h2)
    finally:
        h1.end()
        h2.end()


def test_a_doorbell_of_a_watcher_loop_that_ended_is_made_again(registry, rings_only) -> None:
    """The watcher loop ends when its epoll descriptor is closed behind its back; the doorbell
    it read is made again in the new loop by the next wait, and a ring reaches it."""
    reg = registry()
    c = Cancellation(reg)
    h = c.begin(1, "s")
    try:
        assert wake.wait_cancelled({HANDLE_KEY: h}, 0) is False  # the doorbell made
        _end_the_watcher_loop()
        _a_rung_cancellation_ends_a_wait(c, h)
    finally:
        h.end()


def test_waits_across_a_watcher_loop_that_ended_are_seen_by_the_new_loops_looks(
        registry, minute_waits) -> None:
    """A wait under way when the watcher loop ends, and one begun after: the second's doorbell
    is made in a new loop and pokes it (the ended loop's last turn left the waits armed), whose
    looks then see both cancellations, unrung, within ``WAIT_POLL``. The waits' own slices and
    the idle wait are a minute: nothing else ends them."""
    reg = registry()
    c = Cancellation(reg)
    h1, h2 = c.begin(1, "s"), c.begin(2, "s")
    try:
        w1 = _long_wait(h1, 1)
        _end_the_watcher_loop()
        w2 = _long_wait(h2, 2)
        at = _cancel_unrung(reg, 2)
        _ends_cancelled_soon(w2, at)
        at = _cancel_unrung(reg, 1)
        _ends_cancelled_soon(w1, at)
    finally:
        h1.end()
        h2.end()


def test_a_fork_child_never_closes_the_number_of_an_ended_loops_epoll(registry, tmp_path) -> None:
    """The ended loop's epoll number taken by another file (a pipe here): the at-fork hook
    closes the parent's epoll set in the child, but not that number, which is the pipe's."""
    c = Cancellation(registry())
    h = c.begin(1, "s")
    r = w = -1
    try:
        assert wake.wait_cancelled({HANDLE_KEY: h}, 0) is False  # a loop, with a doorbell
        loop = _end_the_watcher_loop()
        n = loop._ep.fileno()  # its object still holds the number, now free
        r, w = os.pipe()
        if r != n:
            os.dup2(r, n)
            os.close(r)
            r = n
        ino = os.fstat(r).st_ino

        def in_child(wr: int) -> None:
            try:
                ok = os.fstat(r).st_ino == ino
            except OSError:
                ok = False
            os.write(wr, b"1" if ok else b"0")

        assert first_message(in_child)[1] == b"1"
    finally:
        h.end()
        for fd in (r, w):
            if fd >= 0:
                os.close(fd)


def test_a_ringing_socket_whose_number_is_another_sockets_is_replaced(
        registry, monkeypatch: pytest.MonkeyPatch, minute_waits) -> None:
    """The ringing socket closed behind its back and its number then a connected stream
    socket's, where a datagram send fails (or, on TCP, goes out as nothing): a first wait's
    poke replaces it and reaches the idle thread, whose looks see an unrung cancellation."""
    reg = registry()
    c = Cancellation(reg)
    h = c.begin(1, "s")
    x, y = socket.socketpair()
    try:
        assert wake.wait_cancelled({HANDLE_KEY: h}, 0) is False  # doorbell and sender made
        _until_idle()
        assert wake._sender is not None
        n = wake._sender[1].fileno()
        os.dup2(x.fileno(), n)  # the number is a connected stream socket's now
        w = _long_wait(h, 1)
        at = _cancel_unrung(reg, 1)
        _ends_cancelled_soon(w, at)
        assert wake._sender[1].fileno() != n
        os.close(n)  # the dup of x
    finally:
        h.end()
        x.close()
        y.close()


def test_a_renewal_keeps_a_doorbell_still_open(registry) -> None:
    """Two waits refused at once both renew: the second finds the first's new doorbell, open,
    and keeps it (closing it would drop the rings already queued there)."""
    c = Cancellation(registry())
    h = c.begin(1, "s")
    try:
        assert wake.wait_cancelled({HANDLE_KEY: h}, 0) is False  # the doorbell made
        bell = wake._bells[c.registry.name][1]
        assert wake._renew_bell(c.registry.name) is True
        assert wake._bells[c.registry.name][1] is bell and bell.fileno() >= 0
    finally:
        h.end()


class _CountedConn(dict):  # type: ignore[type-arg]
    """A conn counting the looks at it (each ``cancelled(conn)`` asks for its handle first)."""

    def __init__(self, *a: Any) -> None:
        super().__init__(*a)
        self.looks = 0

    def get(self, key: Any, default: Any = None) -> Any:
        if key == HANDLE_KEY:
            self.looks += 1
        return super().get(key, default)


def test_a_conn_without_a_handle_polls_its_cancellation_while_it_waits(registry) -> None:
    c = Cancellation(registry())
    conn = _CountedConn({"REMOTE_ADDR": "127.0.0.1", "shmcancel.request_id": 7,
                         "shmcancel.cancellation": c})
    w = Background(lambda: wake.wait_cancelled(conn, LONG))
    w.start()
    deadline = time.monotonic() + 5
    while conn.looks < 3:  # the wait's own get, its first look, and one after a sleep
        assert time.monotonic() < deadline, "the wait does not look while it sleeps"
        time.sleep(0.005)
    c.cancel(7, "stop", c.scope(conn))
    at = time.monotonic()
    assert w.result(timeout=BOUND + 1) is True
    assert w.done_at - at < BOUND  # type: ignore[operator]


def test_a_conn_without_a_handle_sleeps_and_polls() -> None:
    t0 = time.monotonic()
    assert wake.wait_cancelled({}, 0.05) is False
    assert time.monotonic() - t0 >= 0.04
    assert wake.wait_cancelled({}, -1) is False  # a negative wait is no wait


def test_a_ring_to_the_owners_wakes_the_waiter_and_a_ring_elsewhere_does_not(
        registry, rings_only) -> None:
    """``notifications/cancelled`` rings only the processes running the call
    (``Cancellation.in_flight_pids``): that ring wakes it, one to another pid does not."""
    reg = registry()
    c = Cancellation(reg)
    h = c.begin(1, "s")
    try:
        assert c.in_flight_pids(1, "s") == {os.getpid()}
        assert c.in_flight_pids(2, "s") == set() and c.in_flight_pids(1.5, "s") is None
        w = _long_wait(h, 1)
        assert c.cancel_if_in_flight(1, "stop", "s")
        wake.ring(reg.name, {os.getppid()})  # not the owner: the waiter sleeps on
        time.sleep(0.2)
        assert w.done_at is None
        rang = time.monotonic()
        wake.ring(reg.name, c.in_flight_pids(1, "s"))
        assert w.result(timeout=BOUND + 1) is True
        assert w.done_at - rang < BOUND  # type: ignore[operator]
    finally:
        h.end()
    assert c.in_flight_pids(1, "s") == set()


def test_a_wake_that_misses_its_wait_does_not_cut_the_next_one_short(registry) -> None:
    """A wake can land after its wait timed out but before the wait unregistered (both take the
    module's lock): the thread's next wait must still last its time, not return at once."""
    c = Cancellation(registry())
    h = c.begin(1, "s")  # never cancelled: only the direct wake below reaches its waits
    conn = {HANDLE_KEY: h}
    second = threading.Event()

    def two_waits() -> float:
        wake.wait_cancelled(conn, 0.1)
        second.set()
        t0 = time.monotonic()
        assert wake.wait_cancelled(conn, 0.4) is False
        return time.monotonic() - t0

    try:
        w = Background(two_waits)
        w.start()
        _waiting(1, time.monotonic() + 5)
        with wake._lock:  # the first wait times out meanwhile, then blocks unregistering
            # Not a synchronisation: the time for the wait's 0.1 s to run out while it cannot
            # unregister. Should the waiter be slower, the wake below is an ordinary one.
            time.sleep(0.3)
            for _, lk in wake._waiters.values():  # what wake(h) does, under the same lock
                lk.release()
        assert second.wait(5)
        assert w.result(timeout=10) >= 0.35
    finally:
        h.end()


def test_a_wait_inside_a_wait_of_the_same_thread_keeps_the_outer_wake(registry) -> None:
    """A signal handler that waits while its thread is in a wait: the inner wait has a lock of
    its own, so the outer one's wake is not taken by it, and the outer wait returns once the
    handler is done, not at its own timeout."""
    c = Cancellation(registry())
    outer, inner = c.begin(1, "s"), c.begin(2, "s")
    took: dict[str, float] = {}

    def handler(signum: int, frame: object) -> None:
        t0 = time.monotonic()
        wake.wait_cancelled({HANDLE_KEY: inner}, 0.3)
        took["inner"] = time.monotonic() - t0

    def later() -> None:
        _waiting(1, time.monotonic() + 5)  # the outer wait
        os.kill(os.getpid(), signal.SIGUSR1)
        _waiting(2, time.monotonic() + 5)  # and the handler's, inside it
        outer.cancel_local("stop")
        wake.wake(outer)

    old = signal.signal(signal.SIGUSR1, handler)
    try:
        t = threading.Thread(target=later)
        t0 = time.monotonic()
        t.start()
        assert wake.wait_cancelled({HANDLE_KEY: outer}, 5.0) is True
        assert time.monotonic() - t0 < 2.0
        assert took["inner"] >= 0.25  # not cut short by the outer wait's wake
        t.join(5)
    finally:
        signal.signal(signal.SIGUSR1, old)
        outer.end()
        inner.end()


def _open_fds() -> set[int]:
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


def test_rings_open_no_descriptor_and_a_fork_child_rings_its_parent(registry, rings_only) -> None:
    """A ring's socket is closed when the ring is done (a burst of cancellations leaves no
    descriptor behind), and a fork child's ring wakes its parent's waiter."""
    reg = registry()
    c = Cancellation(reg)
    h = c.begin(1, "s")
    try:
        wake.ring(reg.name, {os.getppid()})  # no bell there: refused
        before = _open_fds()
        for _ in range(200):
            wake.ring(reg.name, {os.getppid(), os.getpid()})
        assert _open_fds() == before
        w = _long_wait(h, 1)
        assert c.cancel_if_in_flight(1, "stop", "s")
        owner = os.getpid()
        _, got = first_message(lambda wr: (wake.ring(reg.name, {owner}), os.write(wr, b"rang")))
        assert got == b"rang"
        assert w.result(timeout=BOUND + 1) is True  # the child's ring woke the waiter here
    finally:
        h.end()


def _reuse_number(fd: int, path: str) -> int:
    """Close ``fd`` behind its owner's back (a ``closerange``) and open ``path`` on that number."""
    os.close(fd)
    got = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    if got != fd:
        os.dup2(got, fd)
        os.close(got)
    return fd


def test_a_fork_child_never_closes_a_bell_number_another_file_took(registry, tmp_path) -> None:
    """The at-fork hook closes the parent's doorbells in the child, each only if its number is
    still that socket: after a ``closerange`` in the parent it may be another file's, which
    the child keeps."""
    reg = registry()
    c = Cancellation(reg)
    h = c.begin(1, "s")
    fd = -1
    try:
        assert wake.wait_cancelled({HANDLE_KEY: h}, 0.01) is False  # the bell is made
        fd = _reuse_number(wake._bells[reg.name][1].fileno(), str(tmp_path / "other"))
        st = os.fstat(fd)

        def in_child(wr: int) -> None:  # the at-fork hook ran: fd is still the file's
            os.write(wr, b"1" if os.fstat(fd).st_ino == st.st_ino else b"0")

        assert first_message(in_child)[1] == b"1"
    finally:
        h.end()
        if fd >= 0:
            wake._bells[reg.name][1].detach()  # the number is the file's: not the bell's to close
            del wake._bells[reg.name]
            os.close(fd)


def test_doorbells_nobody_reads_do_not_silence_the_rings(registry) -> None:
    """A doorbell nobody reads (its worker stopped, its watcher starved) keeps what was rung to
    it, up to ``net.unix.max_dgram_qlen`` + 1 datagrams, and each counts against the socket that
    sent it until it is read: enough of them (with the default queue of 10, some 26 doorbells)
    fill the send buffer of the process's ringing socket. A refused ring gets a fresh socket, so
    a live doorbell rung after them still hears it."""
    reg = registry()
    stuck: list[socket.socket] = []
    live = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        with open("/proc/sys/net/unix/max_dgram_qlen") as f:
            qlen = int(f.read())
        pids = [10**9 + i for i in range(64)]  # beyond any pid: doorbells of no process
        for pid in pids:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            stuck.append(s)
            s.bind(wake.doorbell_address(reg.name, pid))
        live.bind(wake.doorbell_address(reg.name, 10**9 + 100))
        for _ in range(min(qlen + 2, 20)):  # each unread doorbell's queue full
            wake.ring(reg.name, pids)
        live.settimeout(BOUND)
        wake.ring(reg.name, {10**9 + 100})
        assert live.recv(1) == b""  # (raises TimeoutError when the ring was refused)
    finally:
        for s in stuck:  # frees what they held
            s.close()
        live.close()


def test_a_ring_of_this_process_wakes_its_waiter_without_its_doorbell(
        registry, rings_only) -> None:
    """A cancellation recorded in the process running the call wakes its waiter at once, not
    through the process's own doorbell: even when another local user squats the doorbell's
    address (abstract sockets have no permissions), so the process has none."""
    reg = registry()
    c = Cancellation(reg)
    h = c.begin(1, "s")
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    w = None
    try:
        squatter.bind(wake.doorbell_address(reg.name, os.getpid()))
        w = _long_wait(h, 1)
        assert reg.name not in wake._bells  # its address was taken: no bell
        assert c.cancel_if_in_flight(1, "stop", "s")
        rang = time.monotonic()
        wake.ring(reg.name, {os.getpid()})
        assert w.result(timeout=BOUND + 1) is True
        assert w.done_at - rang < BOUND  # type: ignore[operator]
    finally:
        squatter.close()
        if w is not None and w.is_alive():
            h.cancel_local("test over")
            wake.wake(h)
            w.join(5)
        h.end()


def test_a_default_socket_timeout_never_makes_a_ring_wait(shm_name: str) -> None:
    """An application may set ``socket.setdefaulttimeout`` (for its own clients); the ringing
    socket must not take it. A socket with a timeout polls before each send and retries a
    refused one until the timeout, ``MSG_DONTWAIT`` or not: a ring to a doorbell whose queue is
    full (a stopped worker's) spun for the whole timeout in the thread answering the
    ``notifications/cancelled``, every time, and a ring refused for a full send buffer waited
    it out and was dropped (a ``TimeoutError``, not a refusal: no fresh socket)."""
    with open("/proc/sys/net/unix/max_dgram_qlen") as f:
        qlen = int(f.read())
    stuck_pid, live_pid = 10**9 + 200, 10**9 + 201  # beyond any pid: doorbells of no process

    def in_child(wr: int) -> None:  # a fresh sender (the at-fork hook let the parent's go)
        socket.setdefaulttimeout(3 * BOUND)
        stuck = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        stuck.bind(wake.doorbell_address(shm_name, stuck_pid))
        live = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        live.bind(wake.doorbell_address(shm_name, live_pid))
        slowest = 0.0
        for _ in range(qlen + 3):  # the stuck doorbell's queue full, then refused
            t0 = time.monotonic()
            wake.ring(shm_name, {stuck_pid})
            slowest = max(slowest, time.monotonic() - t0)
            if slowest > BOUND:
                break
        wake.ring(shm_name, {live_pid})
        live.settimeout(BOUND)
        heard = live.recv(1) == b""  # (raises TimeoutError when the ring was lost)
        os.write(wr, f"{slowest:.3f} {int(heard)}".encode())

    _, got = first_message(in_child, timeout=10 * BOUND)
    slowest, heard = got.split()
    assert float(slowest) < BOUND and heard == b"1", got


def _two_waits_on_a_doorbell(chan: Chan, name: str) -> None:
    """A worker with a doorbell: waits for call 1, then for call 2 (each up to ``LONG``), saying
    when each wait is under way and how it ended."""
    set_rings_only()  # as the fixture rings_only does
    c = Cancellation(Registry.attach(name))
    for request_id in (1, 2):
        h = c.begin(request_id, "s")
        w = Background(lambda h=h: wake.wait_cancelled({HANDLE_KEY: h}, LONG))
        w.start()
        _waiting(1, time.monotonic() + 5)  # its doorbell is bound before the wait registers
        chan.send(["waiting", name in wake._bells])
        chan.send(["woken", w.result(timeout=LONG + 5)])
        h.end()


def _all_stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is stopped (a SIGSTOP stops them one by one)."""
    states = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
            states.append(f.read().rpartition(b")")[2].split()[0])
    return all(st in (b"T", b"t") for st in states)


def _sender_inode() -> int:
    assert wake._sender is not None
    return wake._sender[3]


def test_a_full_doorbell_is_skipped_for_a_while_then_rung_again(registry, spawn) -> None:
    """A stopped worker's doorbell fills up (``max_dgram_qlen`` + 1 unread rings); then every
    ring to it was refused by the ringing socket and by a fresh one, and each ring replaced the
    process's socket (a churn of sockets, a ``socket`` and ``fstat`` apiece). Once refused so,
    it is skipped for ``wake._REFUSED_FOR``: rings to it and to a live doorbell replace the
    socket at most once per back-off, and the live one hears every ring. Skipping loses nothing:
    a cancellation recorded meanwhile wakes its waiter when the worker resumes and reads the
    rings it had; once drained, the worker's doorbell is rung again after the back-off."""
    reg = registry()
    c = Cancellation(reg)
    with open("/proc/sys/net/unix/max_dgram_qlen") as f:
        qlen = int(f.read())
    live_pid = 10**9 + 300  # beyond any pid: a doorbell of no process, read here
    live = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    worker = spawn(_two_waits_on_a_doorbell, reg.name)
    try:
        live.bind(wake.doorbell_address(reg.name, live_pid))
        live.settimeout(BOUND)
        assert worker.recv() == ["waiting", True]
        os.kill(worker.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while not _all_stopped(worker.pid):
            assert time.monotonic() < deadline, "the worker did not stop"
            time.sleep(0.005)
        for _ in range(qlen + 3):  # its doorbell's queue full, then refused
            wake.ring(reg.name, {worker.pid})

        sockets = {_sender_inode()}
        t0 = time.monotonic()
        for _ in range(200):
            wake.ring(reg.name, {worker.pid, live_pid})
            sockets.add(_sender_inode())
            assert live.recv(1) == b""  # (raises TimeoutError when the ring was lost)
        took = time.monotonic() - t0
        # one socket, and at most one fresh one each time the back-off ran out
        assert len(sockets) <= 2 + took / wake._REFUSED_FOR, (len(sockets), took)

        assert c.cancel_if_in_flight(1, "stop", "s")
        wake.ring(reg.name, {worker.pid})  # skipped (or refused): its queue is full
        os.kill(worker.pid, signal.SIGCONT)
        assert worker.recv(timeout=5) == ["woken", True]  # by the rings it had left to read

        assert worker.recv() == ["waiting", True]  # drained: a ring after the back-off reaches it
        assert c.cancel_if_in_flight(2, "stop", "s")
        t0 = time.monotonic()
        while True:
            wake.ring(reg.name, {worker.pid})
            try:
                got = worker.recv(timeout=0.02)
                break
            except TimeoutError:
                assert time.monotonic() - t0 < 5, "the drained doorbell is not rung again"
        assert got == ["woken", True]
        assert worker.wait() == 0
    finally:
        live.close()  # the worker, stopped or not, is SIGKILLed by pid by the spawn fixture


def test_the_refused_doorbells_stay_bounded_and_a_fork_child_forgets_them(shm_name: str) -> None:
    """At ``wake._MAX_REFUSED`` remembered doorbells, those whose back-off ran out go first (all
    when none has: each costs one fresh socket more); a fork child starts without the parent's
    back-offs (its own rings find full doorbells for themselves)."""
    addrs = [wake.doorbell_address(shm_name, 10**9 + i) for i in range(wake._MAX_REFUSED + 1)]
    try:
        wake._refused.clear()
        expired = time.monotonic() - 1
        for a in addrs[:-2]:
            wake._refused[a] = expired
        wake._back_off(addrs[-2])
        assert len(wake._refused) == wake._MAX_REFUSED  # it was not full yet: nothing went
        wake._back_off(addrs[-1])  # full: the expired went, the running back-offs stayed
        assert set(wake._refused) == {addrs[-2], addrs[-1]}
        for a in addrs[:-2]:
            wake._refused[a] = time.monotonic() + 60
        wake._back_off(addrs[0])  # full, none expired: all go but the new one
        assert list(wake._refused) == [addrs[0]]
        got = first_message(lambda wr: os.write(wr, str(len(wake._refused)).encode()))[1]
        assert got == b"0"
    finally:
        for a in addrs:
            wake._refused.pop(a, None)
