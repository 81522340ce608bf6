"""One dispatched request as the transport holds it: :class:`RequestHandle` (contract §4.3).

``Cancellation.begin`` makes one: it writes the request's in-flight row (never raising: an
untracked handle still cancels locally), ``cancelled()`` is the tool's lock-free cached poll and
latches, ``end()`` untracks then clears, is idempotent, and owes what a stalled lock refuses
(:mod:`shmcancel.cancel.owed`).
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .. import telemetry
from ..exceptions import LockTimeout, RegistryClosed, ShmCancelError
from ..shm import procinfo
from ..shm.reader import Watch as _Watch
from . import ids, owed
from .owed import settle_owed
from .reasons import sanitize
from .storage import Owner, Poll, clear_ended, clock_seconds
from .tables import SCOPE_MAX

if TYPE_CHECKING:
    from .policy import Cancellation

__all__ = ["CANCELLED_EVENT", "POLLS_PER_CLOCK", "RequestHandle", "valid_scope"]

log = logging.getLogger("shmcancel.cancellation")

CANCELLED_EVENT = ("shmcancel", "request", "cancelled")

_tokens = itertools.count(1)
#: Cached polls between two clock reads of the janitor check (per handle, and per Cancellation
#: for its own polls).
POLLS_PER_CLOCK = 16
_NO_VERSIONS: Sequence[int] = (0,)  # a handle's versions before its first poll: never == -1
_full_logged = False
_failed_logged = False


def _reset_after_fork() -> None:
    global _full_logged, _failed_logged
    _full_logged = _failed_logged = False


os.register_at_fork(after_in_child=_reset_after_fork)


def valid_scope(scope: object) -> bool:
    """A scope is a string (a ``str`` subclass too: the stores read it as a plain ``str``) of
    at most ``SCOPE_MAX`` (512) UTF-8 bytes, as ``scope(conn)`` makes them and the tables are
    sized for; a lone surrogate cannot be encoded, so it is not one either."""
    if type(scope) is str and scope.isascii():  # the common case: one byte a character
        return len(scope) <= SCOPE_MAX
    if not isinstance(scope, str):
        return False
    try:
        return len(str.__str__(scope).encode("utf-8")) <= SCOPE_MAX
    except UnicodeEncodeError:
        return False


class RequestHandle:
    """One dispatched request, as the transport holds it (see the module docstring).

    ``request_id`` (as given), ``scope``, ``tracked``, ``error`` (why it is not tracked, or
    ``None``; a :class:`~shmcancel.LockTimeout` there means the registry is stalled).
    ``cancelled()`` is the hot poll; ``cancel_local(reason)`` cancels this request only, in this
    process; ``end()`` untracks then clears, is idempotent and never raises.

    ``began`` is the ``clock`` before the row was written: a cancellation is recorded only
    while the request is in flight, hence at or after ``began``; a row with an older
    ``cancelled_at`` is a leftover of an earlier namesake, never this request's (unless the wall
    clock stepped back since ``began``: :meth:`_predates`). A clock that
    raises or returns no finite number leaves the request untracked (``error`` says why;
    ``began`` is NaN), as does an invalid id or scope (``error`` ``None``).
    """

    __slots__ = (
        "_b", "_c", "_local", "_local_reason", "_mono", "_n", "_owner", "_polled", "_receipt",
        "_rid", "_token", "_v", "_ver", "_watch", "began", "error", "request_id",
        "scope", "tracked",
    )

    def __init__(self, c: Cancellation, request_id: object, scope: str) -> None:
        self._c = c
        self.request_id = request_id
        self.scope = scope
        self.tracked = False
        self._local = False
        self._local_reason: str | None = None
        self._owner: Owner | None = None
        self._receipt: object = None
        self._polled = False  # see _poll
        self._watch: Poll | None = None
        # The hot poll's cache: "not cancelled while versions[_b] == _v" (_v = -1: never).
        self._ver: Sequence[int] = _NO_VERSIONS
        self._b = 0
        self._v = -1
        self._n = POLLS_PER_CLOCK  # polls left before the janitor check
        self._token = 0
        self.error: Exception | None = None
        self.began = math.nan
        rid = self._rid = ids.key(request_id) if valid_scope(scope) else None
        if rid is None:
            return
        if type(scope) is not str:  # a str subclass: rows are keyed and read by its text
            scope = self.scope = str.__str__(scope)
        try:
            began = c.clock()
            if began.__class__ is not float or began - began:  # NaN, an infinity: no row
                began = clock_seconds(began)  # could be told older than it
        except Exception as e:  # served untracked, as for a store that fails (never raises)
            self._rid = None
            self.error = e
            _log_failed(e)
            return
        self.began = began
        self._mono = time.monotonic()
        token = self._token = next(_tokens)
        # Before the row exists (see owed.running); it stays, rows or not, until end() takes
        # it out, which makes end() idempotent (see there).
        owed.running.add(token)
        try:
            try:
                pid, start = procinfo.me()
                owner = (pid, start, threading.get_ident(), token)
                self._receipt = c._store.track(scope, rid, owner)
                self._owner = owner
                self.tracked = True
            except LockTimeout as e:
                self.error = e
                log.warning("a request could not be tracked: %s", e)
            except RegistryClosed as e:  # not a full table: no advice about its capacity
                self.error = e
                _log_failed(e)
            except ShmCancelError as e:
                self.error = e
                _log_untracked(e)
            except Exception as e:  # a backend's own error (Redis unreachable): never the caller's
                self.error = e
                _log_failed(e)
            else:
                if owed.queue:
                    settle_owed()  # the lock answered: land what this process owes
            c._tick()
        except BaseException:
            # a signal handler's exception (or an async one), the row perhaps written: the
            # caller gets no handle to end it, so the request is no longer running, and this
            # process's reap of ended rows removes the row (Cancellation.settle, cleanup)
            owed.running.discard(token)
            raise

    def __repr__(self) -> str:
        return (f"<RequestHandle {self.scope!r} {self._rid!r} tracked={self.tracked} "
                f"cancelled={self.cancelled()}>")

    def cancelled(self) -> bool:
        """True once this request was cancelled, here or by any process. Lock-free; never
        raises. Once true it stays true (it latches: a namesake's ``end()``, an eviction or the
        janitor removing the shared row afterwards does not un-cancel a running tool).

        The hot path is one version load: ``_ver[_b] == _v`` holds while the bucket the watch
        last read without finding a row has not moved (a latch or ``cancel_local`` sets
        ``_v = -1``, which no version equals). When the poll fails (its registry closed since:
        the versions' view is released), what this handle knows: latched or cancelled locally
        stays true, anything else is ``False``."""
        try:
            if self._ver[self._b] == self._v:
                n = self._n = self._n - 1
                if n < 0:
                    self._n = POLLS_PER_CLOCK
                    self._c._tick()
                return False
            return self._poll()
        except Exception:
            return self._local

    def peek(self) -> bool:
        """:meth:`cancelled` without its janitor check (which may wait for the registry lock):
        for a thread that must not block, the watcher's looks at the waiting calls."""
        try:
            if self._ver[self._b] == self._v:
                return False
            return self._poll(False)
        except Exception:
            return self._local

    def _poll(self, tick: bool = True) -> bool:
        """:meth:`cancelled` when the cached answer cannot be trusted: read the watch (made on
        the first poll: many tools never poll), latch a row, or cache its "no row"."""
        if self._local:
            return True
        w = self._watch
        if w is None and self._rid is not None:
            if not self._polled:
                # The first poll (often the only one: the transport's own look when the tool
                # returns) reads the scope's count, never below its rows: 0 means no row for
                # this request either, and the watch is not worth making yet.
                self._polled = True
                if not self._c._store.scope_has_rows(self.scope):
                    return False
            w = self._watch = self._c._store.watch(self.scope, self._rid)
        if w is not None:
            if w.member():
                if self._latch():
                    return True
            elif w.__class__ is _Watch:
                seen = w._seen  # one tuple: the (bucket, version) pairs of that read
                if len(seen) == 1 and not w._member:
                    self._ver = w._ver
                    self._b, self._v = seen[0]
                    # cancel_local (another thread: the disconnect watcher) stores _local, then
                    # _v = -1; this poll stored _v, then reads _local: either it sees the flag
                    # or that -1 lands after its own store. Else the cache would hide the flag.
                    if self._local:
                        self._v = -1
                        return True
        if not tick:
            return False
        n = self._n = self._n - 1
        if n < 0:
            self._n = POLLS_PER_CLOCK
            self._c._tick()
        return False

    def _latch(self) -> bool:
        """The shared row was seen: latch it unless it is older than this request (then
        ``False``, the row left to the namesake it is for, or to the key's last end), or gone
        by the time it is read (a leftover another process removed between the poll's two
        reads: nothing says it was this request's, and latching it would cancel a request
        nobody cancelled). A store
        that fails to answer latches: a cancellation is never ignored for that."""
        row = None
        if self._rid is not None:
            try:
                row = self._c._store.get(self.scope, self._rid)
            except Exception:
                row = None
            else:
                if row is None:
                    return False
        if row is not None and self._predates(row[1]):
            # Not removed: while a namesake that began before it runs, it is that one's (which
            # may not have polled yet); else the last end of the key's requests clears it.
            return False
        self._local_reason = row[0] if row is not None else None
        self._local = True
        self._v = -1
        return True

    def _predates(self, stamp: float) -> bool:
        """Whether a row stamped ``stamp`` was recorded before this request began: older than
        ``began``, and, with the default clock (``time.time``), older than ``began`` less any
        step back the wall clock took since (the monotonic clock's elapsed time less the wall
        clock's; an NTP step). A cancellation recorded after such a step is stamped before
        ``began`` and would be ignored; a leftover stamped within the step before ``began`` is
        taken as this request's instead: a cancellation is never ignored for a clock step."""
        if stamp >= self.began:
            return False
        if self._c.clock != time.time:
            return True
        back = (time.monotonic() - self._mono) - (time.time() - self.began)
        return back <= 0 or stamp < self.began - back

    def cancel_local(self, reason: object = None) -> None:
        """Cancel exactly this request, in this process only (a client disconnect). Emits the
        ``cancelled`` telemetry event with ``"local": True`` in its metadata."""
        if self._local:
            return
        self._local_reason = sanitize(reason)
        self._local = True
        self._v = -1  # after _local: a poll that misses the -1 once finds _local next time
        telemetry.execute(
            CANCELLED_EVENT,
            {"count": 1},
            {"request_id": self._rid if self._rid is not None else repr(self.request_id),
             "scope": self.scope, "reason": self._local_reason, "local": True},
        )

    def reason(self) -> str | None:
        """The shared row's reason when one exists, else the one latched or given to
        :meth:`cancel_local` (or ``None``)."""
        if self._rid is not None:
            try:
                row = self._c._store.get(self.scope, self._rid)
            except Exception:
                row = None
            if row is not None and not self._predates(row[1]):
                return row[0]
        return self._local_reason

    def end(self) -> None:
        """Untrack this request's own row, then clear the key's cancellation row. Idempotent;
        logs and swallows storage errors (it runs in a ``finally``). On a registry closed
        since it began: one line logged, nothing owed (this process has no registry to land
        it in; its lane rows went with the close, a shared-table row goes when its process
        exits)."""
        rid = self._rid
        if rid is None:
            return
        # end() runs from the request's finally and from the disconnect watcher's stop: the
        # first caller takes the token out of owed.running (one atomic set operation) and
        # ends the request, any other returns here (so does a copy of the handle in a fork
        # child, whose running set was emptied: the parent's request is the parent's).
        try:
            owed.running.remove(self._token)
        except KeyError:
            return
        c = self._c
        st = c._store
        try:
            ended_at = c.clock()
            if self._owner is not None:
                st.untrack(self.scope, rid, self._owner, self._receipt)
            # A polled handle's watch says in one load when there is no row; else clear_ended
            # reads the row first (the store's cheapest read), and stops there without one.
            w = self._watch
            if w is None or w.member():
                # a namesake's in-flight row is read after the untrack's barrier, like the row
                clear_ended(st, self.scope, rid)
        except LockTimeout as e:
            owed.owe(st, self.scope, rid, self._owner, ended_at)
            log.warning("ending request %r in %r: %s; retried later", rid, self.scope[:80], e)
        except RegistryClosed as e:
            log.warning("ending request %r in %r: %s", rid, self.scope[:80], e)
        except Exception:
            log.warning("ending request %r in %r failed", rid, self.scope[:80], exc_info=True)
        else:
            if owed.queue:
                settle_owed()

    def __enter__(self) -> RequestHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.end()


def _log_failed(e: Exception) -> None:
    """A request that could not be tracked for ``e``, neither a lock timeout nor a full table:
    logged once per process, then at debug level."""
    global _failed_logged
    log.log(logging.DEBUG if _failed_logged else logging.WARNING,
            "a request could not be tracked (%s: %s); it runs uncancellable by "
            "notifications (logged once per process, then at debug level)",
            type(e).__name__, e)
    _failed_logged = True


def _log_untracked(e: Exception) -> None:
    global _full_logged
    if not _full_logged:
        _full_logged = True
        log.warning(
            "a request could not be tracked (%s); it runs uncancellable by notifications. "
            "Raise Config.in_flight_capacity. (Logged once per process.)", e,
        )
