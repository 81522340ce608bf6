"""Waking a tool that waits for its cancellation, instead of leaving it to its next poll.

A tool waits with ``wait_cancelled(conn, seconds)``: it sleeps up to ``seconds``, returns early
when the call is cancelled, and returns whether it is. Each process whose tools wait has a
*doorbell*: an abstract-namespace Unix datagram socket named after the registry and the pid
(:func:`doorbell_address`), read by the process's disconnect-watcher thread
(:mod:`.disconnect`). A process that records a cancellation (``notifications/cancelled``, a
session ``DELETE``) calls :func:`ring`: one empty datagram to the doorbell of every sibling
process (the children of its parent: under gunicorn, the workers) and, for its own waits, the
same look without the hop. On a ring the watcher thread polls every waiting call's handle once
(a lock-free shared-memory read each) and wakes those cancelled. A disconnect (``cancel_local``)
wakes its own call directly (:func:`wake`).

A ring is only a hint: lost, refused (no such doorbell, or one whose queue is full), skipped (a
full doorbell is not rung again for :data:`_REFUSED_FOR`) or sent by anyone, it costs at most the
waiters' polls; a waiter never waits past its ``seconds``, so the contract's poll bound (§6.1,
§8) holds without it. A doorbell closed behind the process's back (a ``closerange``) is made
again by the next wait that finds its poke refused. Linux only (abstract sockets, ``/proc``);
elsewhere a wait just sleeps.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import itertools
import math
import os
import socket
import sys
import threading
import time
from _thread import LockType
from _thread import allocate_lock as _allocate_lock
from collections.abc import Iterable, Mapping
from typing import Any

from ..cancel.handle import RequestHandle
from ..shm import procinfo
from ..shm.names import close_if_same
from .conn import HANDLE_KEY, cancelled
from .disconnect import process_loop

__all__ = ["doorbell_address", "ring", "wait_cancelled", "waiting", "wake"]

_LINUX = sys.platform.startswith("linux")
_DRAIN = 256  # the most datagrams one ring turn reads (the rest wait for the next turn)
_SIBLINGS_TTL = 1.0  # seconds a sibling list is reused (workers are replaced rarely)
_MAX_SIBLINGS = 256  # the most processes one ring reaches (a parent with more is not gunicorn's)
_MAX_ADDRESSES = 1024  # doorbell addresses kept (then the cache starts over)
_REFUSED_FOR = 0.1  # seconds a doorbell whose queue was full is not rung (see ring)
WAIT_POLL = 0.005
"""While waits are under way in a process, its watcher thread looks at every waiting call at
least this often (seconds), so a wait sees its cancellation within this, rung or not."""
_SLICE = 0.1  # seconds a wait sleeps at most between looks of its own (the watcher's fallback)
_MAX_REFUSED = 1024  # full doorbells remembered (then the expired ones go, or all)
# A send's errors that say the sending socket's descriptor is gone (closed behind its back)
_BROKEN = (errno.EBADF, errno.ENOTSOCK)

_lock = threading.RLock()  # guards _waiters (reentrant: a signal handler may wait); a wait's lock
# is released only under it
_waiters: dict[int, tuple[RequestHandle, LockType]] = {}  # wait -> (handle, its thread's lock)
_keys = itertools.count()
_tls = threading.local()
# A bell: (pid, its socket, st_dev, st_ino). The file's identity is checked before a fork
# child closes the number: after a closerange() it may be another file's.
_Bell = tuple[int, socket.socket, int, int]
_bells: dict[str, _Bell] = {}  # registry name -> this process's bell
_bell_loops: dict[str, Any] = {}  # registry name -> the watcher loop reading its bell
_sender: _Bell | None = None  # this process's socket that rings (replaced when refused)
_sender_lock = threading.RLock()  # reentrant: a signal handler may ring
_siblings: tuple[float, int, list[int]] = (-1.0, 0, [])  # (read at, pid, pids)
_addresses: dict[tuple[str, int], bytes] = {}  # (registry name, pid) -> doorbell_address
_refused: dict[bytes, float] = {}  # doorbell_address -> monotonic time until which it is skipped
_next_look = -math.inf  # monotonic time the waiting calls are due to be looked at again
# Whether the watcher thread's next wait ends by the next look; cleared by the thread before it
# reads _waiters, so a wait registered after that read finds it clear and pokes the thread
_armed = False


def doorbell_address(registry_name: str, pid: int) -> bytes:
    """The abstract socket address of ``pid``'s doorbell for the registry ``registry_name``."""
    digest = hashlib.sha256(registry_name.encode("utf-8", "surrogatepass")).hexdigest()[:24]
    return f"\0shmcancel-wake-{digest}-{pid}".encode()


def wait_cancelled(conn: Mapping[str, Any], seconds: float) -> bool:
    """Sleep up to ``seconds`` (at least 0; at most ``threading.TIMEOUT_MAX``), returning early
    once the call ``conn`` belongs to is cancelled; whether it is cancelled. A cancellation is
    seen within :data:`WAIT_POLL` of being recorded, rung or not: the process's watcher thread
    looks at every waiting call that often (or, for a conn without a transport handle or
    without a watcher, the wait polls ``cancelled(conn)`` itself that often)."""
    seconds = min(max(0.0, float(seconds)), threading.TIMEOUT_MAX)
    h = conn.get(HANDLE_KEY) if isinstance(conn, Mapping) else None
    if not isinstance(h, RequestHandle) or not _LINUX:
        return _sleep_polling(conn, seconds)
    if h.cancelled():
        return True
    registry = getattr(h._c, "registry", None)
    # the registry whose doorbell this process has (its watcher thread then looks at the waits)
    bell = registry.name if registry is not None and _ensure_bell(registry.name) else None
    step = WAIT_POLL if bell is None else _SLICE
    # The thread's own lock, held while nobody wakes it: a wake releases it. A tool polls in a
    # loop, so this is every poll's cost: one lock, no Event (a Condition, two locks) per wait.
    # A wait inside a wait of the same thread (a signal handler's) gets a lock of its own.
    lk = getattr(_tls, "lock", None)
    nested = getattr(_tls, "busy", False)
    if lk is None or nested:
        lk = _allocate_lock()
        lk.acquire()
        if not nested:
            _tls.lock = lk
    key = next(_keys)
    if not nested:
        _tls.busy = True
    try:
        with _lock:
            _waiters[key] = (h, lk)
        # The watcher thread may be in a long wait: looks start now. A poke refused means the
        # doorbell is gone (its descriptor closed behind this process's back: a closerange),
        # and so are the rings: a new one, else this wait looks for itself.
        if bell is not None and not _armed and not (_bell_intact(bell) and _poke(bell)) \
                and not _renew_bell(bell):
            step = WAIT_POLL
        end = time.monotonic() + seconds
        # a cancel before the registration found nobody to wake: hence the look first
        while not h.cancelled():
            left = end - time.monotonic()
            if left <= 0 or lk.acquire(True, min(left, step)):
                break
    finally:
        with _lock:
            _waiters.pop(key, None)
        # Wakes release only registered waits (under _lock): one that came after the timeout
        # is taken back here, so the next wait does not return at once.
        lk.acquire(False)
        if not nested:
            _tls.busy = False
    return h.cancelled()


def _sleep_polling(conn: Mapping[str, Any], seconds: float) -> bool:
    """:func:`wait_cancelled` without a watcher thread: ``cancelled(conn)`` every
    :data:`WAIT_POLL` seconds."""
    end = time.monotonic() + seconds
    while not cancelled(conn):
        left = end - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(left, WAIT_POLL))
    return True


def wake(handle: RequestHandle) -> None:
    """Wake the waits of ``handle`` (after ``handle.cancel_local``)."""
    with _lock:
        for h, lk in _waiters.values():
            if h is handle:
                _release(lk)


def waiting() -> int:
    """How many waits are under way in this process."""
    return len(_waiters)


def ring(registry_name: str, pids: Iterable[int] | None = None) -> None:
    """Ring the doorbells for ``registry_name`` of ``pids`` (the processes running the call
    just cancelled), or when ``None`` of this process and its siblings. Never raises; costs a
    ``/proc`` read at most once a second (siblings) and one ``sendto`` per other process; this
    process's own waits are looked at here, without the hop through its watcher thread.

    One socket per process sends, never blocking. A datagram a bell has not read yet counts
    against the socket that sent it, so bells nobody reads (a stopped worker's) can fill its
    send buffer: a refused send gets a fresh socket and is tried once more. Refused again, that
    bell's own queue is full, and it is not rung for :data:`_REFUSED_FOR` seconds (rung anyway,
    each ring would replace the socket again, a ``socket`` and ``fstat`` apiece). Skipping it
    loses nothing: a full bell has rings to read already, and when its process reads them it
    looks at every waiting call, this one's too (recorded before the ring); only a cancellation
    recorded after the bell drained but within the back-off is left to its waiter's poll, as any
    lost ring is. The rest of the ring's bells are rung as ever; a bell rung after its back-off
    is tried afresh. With nothing refused, the back-off costs a look at an empty dict."""
    if not _LINUX:
        return
    try:
        me = procinfo.pid()
        pids = _sibling_pids() if pids is None else sorted(pids)[:_MAX_SIBLINGS]
        s = None
        for pid in pids:
            if pid == me:
                _wake_cancelled()
                continue
            addr = _address(registry_name, pid)
            if _refused:
                until = _refused.get(addr)
                if until is not None:
                    if time.monotonic() < until:
                        continue  # its queue was full: it has rings to read (see above)
                    _refused.pop(addr, None)
            if s is None:
                s = _live_sender()
            try:
                s = _send(s, addr)
            except BlockingIOError:
                s = _sending_socket(s)
                try:
                    s.sendto(b"", socket.MSG_DONTWAIT, addr)
                except BlockingIOError:  # refused by a fresh socket too: the bell's queue is full
                    _back_off(addr)
                except OSError:
                    pass
            except OSError:  # no bell there
                pass
    except OSError:
        pass


def _address(registry_name: str, pid: int) -> bytes:
    addr = _addresses.get((registry_name, pid))
    if addr is None:
        if len(_addresses) >= _MAX_ADDRESSES:
            _addresses.clear()
        addr = _addresses[registry_name, pid] = doorbell_address(registry_name, pid)
    return addr


def _back_off(addr: bytes) -> None:
    """Skip the bell at ``addr`` for :data:`_REFUSED_FOR` seconds. Past :data:`_MAX_REFUSED`
    bells, those whose back-off ran out are forgotten, or all when none has (each then costs
    one more fresh socket)."""
    now = time.monotonic()
    if len(_refused) >= _MAX_REFUSED:
        for a, until in list(_refused.items()):  # a copy: other threads may ring meanwhile
            if until <= now:
                _refused.pop(a, None)
        if len(_refused) >= _MAX_REFUSED:
            _refused.clear()
    _refused[addr] = now + _REFUSED_FOR


def _sending_socket(refused: socket.socket | None) -> socket.socket:
    """This process's ringing socket; a new one when it is ``refused`` (the one a send was just
    refused on). A replaced socket is closed by its last user (another thread may be sending on
    it): only a fork child's inherited one is let go by number (:func:`_after_fork_in_child`)."""
    global _sender
    with _sender_lock:
        got = _sender
        if got is not None and got[0] == procinfo.pid() and got[1] is not refused:
            return got[1]
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        # not socket.getdefaulttimeout()'s: with a timeout, a send polls first and retries a
        # refusal until the timeout (MSG_DONTWAIT or not), so a full bell would stall the ring
        s.setblocking(False)
        _sender = _bell(s)
        return s


def _live_sender() -> socket.socket:
    """This process's ringing socket, replaced first when its descriptor is no longer its own
    (closed behind its back; the number may be another socket's, where sends go astray or
    fail): one ``fstat`` per ring or poke."""
    s = _sending_socket(None)
    got = _sender
    if got is not None and got[1] is s and not _intact(got):
        s = _replace_broken_sender(s)
    return s


def _send(s: socket.socket, addr: bytes) -> socket.socket:
    """One empty datagram from the ringing socket ``s`` to ``addr``, never blocking; the
    socket it went from: a new one when ``s``'s descriptor turned out gone (EBADF, ENOTSOCK),
    with the send tried once more on it. Raises what the send raises otherwise."""
    try:
        s.sendto(b"", socket.MSG_DONTWAIT, addr)
    except OSError as e:
        if e.errno not in _BROKEN:
            raise
        s = _replace_broken_sender(s)
        s.sendto(b"", socket.MSG_DONTWAIT, addr)
    return s


def _replace_broken_sender(broken: socket.socket) -> socket.socket:
    """A new ringing socket in place of ``broken``, whose descriptor was closed behind its
    back (a closerange): let go by number, never closed blindly (the number may be another
    file's now)."""
    global _sender
    with _sender_lock:
        got = _sender
        if got is not None and got[1] is broken:
            _sender = None
            _let_go(got)
        return _sending_socket(None)


def _bell(s: socket.socket) -> _Bell:
    st = os.fstat(s.fileno())
    return (procinfo.pid(), s, st.st_dev, st.st_ino)


def _let_go(b: _Bell) -> None:
    """Close ``b``'s socket unless its number is another file's now; never close it twice."""
    with contextlib.suppress(OSError, ValueError):
        close_if_same(b[1].detach(), b[2], b[3])


def _sibling_pids() -> list[int]:
    global _siblings
    me = procinfo.pid()
    at, pid, pids = _siblings
    now = time.monotonic()
    if pid == me and now - at < _SIBLINGS_TTL:
        return pids
    ppid = os.getppid()
    found = {me}
    with contextlib.suppress(OSError, ValueError), \
            open(f"/proc/{ppid}/task/{ppid}/children", "rb") as f:
        found.update(int(p) for p in f.read().split()[:_MAX_SIBLINGS])
    pids = sorted(found)
    _siblings = (now, me, pids)
    return pids


def _ensure_bell(registry_name: str) -> bool:
    """Whether this process has its doorbell for ``registry_name`` (made on first use, its
    watcher thread then looking at the waits, see :func:`_look_at_waits`); ``False`` when it
    cannot have one (no watcher thread, or its address is taken)."""
    global _armed
    got = _bells.get(registry_name)
    if _is_mine(registry_name, got):
        return True
    with _lock:
        got = _bells.get(registry_name)
        if _is_mine(registry_name, got):
            return True
        if got is not None:  # inherited across fork (the parent's), or its loop ended
            _let_go(got)
            del _bells[registry_name]
        loop = process_loop()
        if loop is None:
            return False
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            s.setblocking(False)
            s.bind(doorbell_address(registry_name, procinfo.pid()))
        except OSError:
            s.close()
            return False
        if not loop.add_reader(s.fileno(), lambda: _rung(s)):
            s.close()
            return False
        loop.set_ticker(_look_at_waits)
        _bell_loops[registry_name] = loop  # first: _bells' readers look it up
        _bells[registry_name] = _bell(s)
        # a new loop (the last one ended) has not armed: the next wait must poke it, whatever
        # the ended loop's last turn left here
        _armed = False
        return True


def _is_mine(registry_name: str, got: _Bell | None) -> bool:
    """Whether the doorbell ``got`` is this process's (not a fork parent's) and read by a live
    watcher loop."""
    return (got is not None and got[0] == procinfo.pid()
            and _bell_loops[registry_name].alive())


def _poke(registry_name: str) -> bool:
    """Have the watcher thread turn now: a datagram to this process's doorbell. ``False`` when
    nothing is bound there (the doorbell is gone); a full one has rings to read already."""
    try:
        _send(_live_sender(), _address(registry_name, procinfo.pid()))
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except Exception:  # full (BlockingIOError), interrupted: the thread has rings to read
        return True
    return True


def _renew_bell(registry_name: str) -> bool:
    """This process's doorbell for ``registry_name`` made again, after a poke found nothing bound
    at its address: whether the new one is there and the watcher thread poked. A doorbell whose
    socket is still open is kept (another wait, refused too, made it again first)."""
    with _lock:
        got = _bells.get(registry_name)
        if got is not None and got[0] == procinfo.pid() and not _intact(got):
            del _bells[registry_name]
            _let_go(got)  # its number may be another file's now: closed only if still its own
    return _ensure_bell(registry_name) and _poke(registry_name)


def _bell_intact(registry_name: str) -> bool:
    """Whether this process's doorbell for ``registry_name`` is still its socket (one
    ``fstat``: a first wait after an idle spell checks, whoever answers at the address)."""
    got = _bells.get(registry_name)
    return got is not None and _intact(got)


def _intact(b: _Bell) -> bool:
    """Whether ``b``'s descriptor is still its socket."""
    try:
        st = os.fstat(b[1].fileno())
    except (OSError, ValueError):
        return False
    return st.st_dev == b[2] and st.st_ino == b[3]


def _look_at_waits() -> float:
    """The watcher thread's ticker: while waits are under way, :func:`_wake_cancelled` once
    :data:`WAIT_POLL` has passed since the last look; seconds until the next is due."""
    global _armed
    _armed = False
    if not _waiters:
        return math.inf
    _armed = True
    wait = _next_look - time.monotonic()
    if wait > 0:
        return wait
    _wake_cancelled()
    return WAIT_POLL


def _rung(s: socket.socket) -> None:
    """In the watcher thread: drain the doorbell, then wake every cancelled waiter."""
    for _ in range(_DRAIN):
        try:
            s.recv(1, socket.MSG_DONTWAIT)  # never blocks, whatever the descriptor is now
        except OSError:  # BlockingIOError: drained
            break
    _wake_cancelled()


def _wake_cancelled() -> None:
    """Wake every waiter of this process whose call is cancelled. The handles are read with
    ``peek``, without their janitor check: it may wait for the registry lock, and the watcher
    thread (its looks, a ring's drain) must keep looking and watching."""
    global _next_look
    _next_look = time.monotonic() + WAIT_POLL  # a wait registered after this looks itself
    with _lock:
        waiters = list(_waiters.items())
    woken = [(key, entry) for key, entry in waiters if entry[0].peek()]
    if woken:
        with _lock:
            for key, entry in woken:
                if _waiters.get(key) is entry:  # still that wait: never a later one's lock
                    _release(entry[1])


def _release(lk: LockType) -> None:
    with contextlib.suppress(RuntimeError):  # woken twice: released already
        lk.release()


def _after_fork_in_child() -> None:
    # The child runs none of the parent's waits; its doorbells are the parent's (by pid).
    global _lock, _tls, _sender, _sender_lock, _armed
    _lock = threading.RLock()
    _tls = threading.local()
    _sender_lock = threading.RLock()
    _waiters.clear()
    _armed = False  # the child's watcher thread is its own, started afresh
    _refused.clear()  # the parent's rings' back-offs: the child's rings find out for themselves
    for b in _bells.values():
        _let_go(b)
    _bells.clear()
    _bell_loops.clear()
    if _sender is not None:
        _let_go(_sender)
        _sender = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
