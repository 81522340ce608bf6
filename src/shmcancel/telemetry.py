"""Process-local telemetry, after Erlang's ``:telemetry``.

Handlers are attached per process (attach after fork in each worker that wants them).
``execute`` calls every handler attached to the event, in attach order, in the calling thread.
A handler that raises an ``Exception`` is detached and the error logged; it never reaches the
caller (contract §4.7).

A ``BaseException`` that is not an ``Exception`` is not swallowed: ``KeyboardInterrupt`` or
``SystemExit`` raised by a signal handler that ran while the telemetry handler did (gunicorn's
quit), ``GeneratorExit``, a framework's own (gevent's ``Timeout``, a test runner's failure) is
not the handler's fault, and stopping it would keep a process from exiting or a task from being
cancelled. It propagates out of ``execute`` and so out of the library call that emitted the
event; the handler stays attached, and the handlers after it are not called for that event.
The rule the library keeps for that: **an event is emitted only once the shared state it reports
is complete and the registry lock released**, never while the lock is held or between two
writes that go together. ``request cancelled`` comes after its row is written (a scope's
cancellation, a session's ``DELETE``: after every row of the scope), ``cancellation cleanup``
after the sweep, ``lock recovered`` when the hold that recovered the lock is released (after
the holder's writes, not before them). A signal's exception there finds the tables consistent;
it only skips what the call would have done after the event.

Events emitted by shmcancel:

- ``("shmcancel", "request", "cancelled")``: ``{"count": 1}``,
  ``{"request_id": str, "scope": str, "reason": str | None}``
- ``("shmcancel", "cancellation", "cleanup")``: ``{"removed": n, "in_flight_removed": m}``, ``{}``
- ``("shmcancel", "lock", "recovered")``: ``{"waited": seconds}``, ``{"dead_pid": int}``
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["Event", "Handler", "attach", "detach", "execute", "list_handlers", "listening"]

Event = tuple[str, ...]
Handler = Callable[[Event, Mapping[str, Any], Mapping[str, Any], Any], object]

log = logging.getLogger("shmcancel.telemetry")

_lock = threading.Lock()
# handler_id -> (event, handler, config). A dict keeps attach order; readers copy a snapshot.
# Changed in place, never rebound: a hot caller (every cancellation) tests it for listening().
_handlers: dict[str, tuple[Event, Handler, Any]] = {}


def _after_fork_in_child() -> None:
    # A thread of the parent (a janitor emitting its cleanup event) may have held the lock at
    # the fork: it does not exist in the child, which would wait for it forever. The
    # handlers stay attached (documented: attach per process; a handler is plain code).
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def attach(handler_id: str, event: Event, handler: Handler, config: Any = None) -> None:
    """Call ``handler(event, measurements, metadata, config)`` on every ``execute(event, ...)``.

    Attaching an id that exists replaces its handler (and its event and config).
    """
    if not callable(handler):
        raise TypeError(f"telemetry handler must be callable, got {handler!r}")
    if not isinstance(handler_id, str):
        raise TypeError(f"telemetry handler id must be a str, got {handler_id!r:.80}")
    if isinstance(event, str) or not isinstance(event, tuple | list) \
            or not all(isinstance(part, str) for part in event):
        # a str would be taken apart into characters: an event that never fires
        raise TypeError("telemetry event must be a tuple (or list) of str, e.g. "
                        f"('shmcancel', 'request', 'cancelled'), got {event!r:.80}")
    event = tuple(event)
    with _lock:
        _handlers.pop(handler_id, None)
        _handlers[handler_id] = (event, handler, config)


def detach(handler_id: str) -> None:
    """Remove a handler; an unknown id is a no-op."""
    with _lock:
        _handlers.pop(handler_id, None)


def list_handlers(event: Event | None = None) -> list[str]:
    """Ids of the handlers attached to ``event`` (all when ``None``), in attach order."""
    with _lock:
        return [h for h, (ev, _, _) in _handlers.items() if event is None or ev == tuple(event)]


def listening() -> bool:
    """Whether any handler is attached: a hot caller skips building an event's measurements
    and metadata when none is (``execute`` would deliver them to no one)."""
    return bool(_handlers)


def execute(event: Event, measurements: Mapping[str, Any], metadata: Mapping[str, Any]) -> None:
    """Deliver an event to its handlers. Never raises a handler's ``Exception``; a
    ``BaseException`` that is not one propagates (see the module docstring)."""
    if not _handlers:
        return
    with _lock:
        targets = [(hid, h, cfg) for hid, (ev, h, cfg) in _handlers.items() if ev == event]
    for hid, handler, cfg in targets:
        try:
            handler(event, measurements, metadata, cfg)
        except Exception:
            log.exception("telemetry handler %r for %r raised; detached", hid, event)
            with _lock:
                current = _handlers.get(hid)
                if current is not None and current[1] is handler:
                    del _handlers[hid]
