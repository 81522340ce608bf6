"""A janitor thread: sweeps a registry every ``janitor_interval`` even while nothing calls it.

``Cancellation`` already sweeps on the back of its own calls; that stops when a server goes
idle, and expired rows would then stay until the next request. ``shmcancel.gunicorn`` starts one
``Janitor`` in every worker after fork (never in the master, which must have no thread when it
forks). The workers' janitors race for ``Registry.claim_sweep``, so one sweep runs per interval
whatever the number of workers, and the first comes one interval after the registry's creation.
Between sweeps it lands the request ends its process owes (``end()`` met a stalled lock), every
``OWED_RETRY`` seconds while any are owed, and removes its process's rows of ended requests.
"""

from __future__ import annotations

import logging
import threading
import time

from ..exceptions import LockTimeout, RegistryClosed
from ..shm.registry import sweep_due
from . import owed
from .owed import owed_ends
from .policy import Cancellation

__all__ = ["Janitor"]

log = logging.getLogger("shmcancel.janitor")

MIN_WAIT = 0.05  # seconds: the loop never spins faster, even when a claim keeps failing
OWED_RETRY = owed.RETRY  # seconds between two tries at landing request ends this process owes


class Janitor:
    """A daemon thread running ``cancellation``'s sweep when its interval is due.

    ``start`` is idempotent; ``stop`` wakes the thread and waits for it (bounded). The thread
    dies with its process; a sweep cut short by that is repaired like any interrupted write.
    It ends by itself once its registry is closed (logged once); ``start`` on a closed
    registry raises :class:`~shmcancel.RegistryClosed`. ``Registry.close()`` does not stop it
    first: the close waits for a hold of the sweep in progress to end (never cutting a write
    short), and the sweep's next step then meets the closed registry and ends quietly. Call
    ``stop`` before closing to have the thread gone when ``close`` returns.
    """

    def __init__(self, cancellation: Cancellation, *, name: str = "shmcancel-janitor") -> None:
        if cancellation.registry is None:
            raise ValueError("a Janitor needs a Cancellation over a shared-memory Registry")
        self._c = cancellation
        self._reg = cancellation.registry
        self._name = name
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by stop() and when this process comes to owe an end
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self._reg.closed:
            raise RegistryClosed.of(self._reg.name)
        if self.running:
            return
        self._stop.clear()
        owed.listeners.add(self._wake.set)
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 1.0) -> None:
        self._stop.set()
        self._wake.set()
        owed.unlisten(self._wake.set)
        t, self._thread = self._thread, None
        if t is not None and t is not threading.current_thread():
            t.join(timeout)

    def _run(self) -> None:
        c = self._c
        reg = self._reg
        interval = reg.config.janitor_interval
        settled = time.monotonic()
        while True:
            if reg.closed:
                self._on_closed()
                return
            try:
                last, now = reg.last_sweep, time.time()
                due = last + interval - now
                if sweep_due(last, now, interval):
                    c.tick()  # settles too
                    settled = time.monotonic()
                    due = reg.last_sweep + interval - time.time()
                elif owed_ends() or time.monotonic() - settled >= interval:
                    # another worker won the sweep: this process's own rows are its own to settle
                    c.settle()
                    settled = time.monotonic()
            except RegistryClosed:  # closed by another thread meanwhile
                self._on_closed()
                return
            except Exception as e:  # a lock timeout: try again later
                log.warning("janitor: sweep of %s failed: %s", getattr(reg, "name", "?"), e,
                            exc_info=not isinstance(e, LockTimeout))
                due = interval
            if owed_ends():
                due = min(due, OWED_RETRY)
            self._wake.wait(max(MIN_WAIT, min(due, interval)))  # MIN_WAIT: a tiny interval too
            self._wake.clear()
            if self._stop.is_set():
                return

    def _on_closed(self) -> None:
        """The registry was closed: this thread ends (no sweep can run through it again)."""
        owed.unlisten(self._wake.set)
        log.info("janitor: registry %s was closed; the janitor stops", self._reg.name)
