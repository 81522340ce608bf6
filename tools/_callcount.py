"""Counting the interpreter calls gunicorn workers make in a window (``bench_burst.py
--count-calls``): a measure of the Python work a burst costs that does not drift with the
machine's load, as its CPU time does.

The workers get :data:`SITECUSTOMIZE` (through ``PYTHONPATH``; the benchmark's own process does
not). It installs a profile function in every thread of a worker that, while counting is on,
counts each call of a Python function (``py``) and of a builtin (``c``), by the file of the
calling code: ``shmcancel``, ``gunicorn``, ``app`` (the served module, the bench's wrappers) or
``other`` (the standard library, msgpack's Python parts). Counting is switched on and off by two
real-time signals, acknowledged through files in the directory named by ``BENCH_CALLS_DIR``:
:class:`CallCounter` waits (bounded) for every worker's acknowledgement, so a window counts
exactly the calls between its start and stop. The profile function costs each call a few
hundred nanoseconds even while off: a run that counts measures latencies it inflated.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

ON = signal.SIGRTMIN + 3
OFF = signal.SIGRTMIN + 4
ACK_WAIT = 5.0  # seconds a switch waits for every worker's acknowledgement
KINDS = ("shmcancel", "gunicorn", "app", "other")

SITECUSTOMIZE = f"""
import json as _cc_json
import os as _cc_os
import signal as _cc_signal
import sys as _cc_sys
import threading as _cc_threading

_cc_dir = _cc_os.environ.get("BENCH_CALLS_DIR")
_cc_on = False
_cc_counts = {{}}
_cc_kinds = {{}}


def _cc_kind(filename):
    k = _cc_kinds.get(filename)
    if k is None:
        if "/shmcancel/" in filename:
            k = "shmcancel"
        elif "/gunicorn/" in filename:
            k = "gunicorn"
        elif "bench" in filename or filename.endswith("/app.py"):
            k = "app"
        else:
            k = "other"
        _cc_kinds[filename] = k
    return k


def _cc_profile(frame, event, arg):
    if not _cc_on:
        return
    if event == "call":
        key = (_cc_kind(frame.f_code.co_filename), "py")
    elif event == "c_call":
        key = (_cc_kind(frame.f_code.co_filename), "c")
    else:
        return
    _cc_counts[key] = _cc_counts.get(key, 0) + 1


def _cc_ack(name, data):
    path = f"{{_cc_dir}}/{{_cc_os.getpid()}}.{{name}}"
    with open(path + ".tmp", "w") as f:
        _cc_json.dump(data, f)
    _cc_os.replace(path + ".tmp", path)


def _cc_switch(signum, frame):
    # runs in the worker's main thread, wherever it was: it must never raise into gunicorn
    global _cc_on
    on = signum == {int(ON)}
    _cc_on = False  # the acknowledgement's own calls are not the window's
    try:
        seq = int(open(f"{{_cc_dir}}/seq").read())
        counts = {{f"{{k}} {{w}}": n for (k, w), n in list(_cc_counts.items())}}
        _cc_ack("ack", {{"seq": seq, "on": on, "counts": counts}})
    except Exception:
        pass
    _cc_on = on


def _cc_child():
    # every key there from the start: the handler reads the dict while threads count
    _cc_counts.clear()
    _cc_counts.update({{(k, w): 0 for k in {KINDS!r} for w in ("py", "c")}})
    _cc_signal.signal({int(ON)}, _cc_switch)
    _cc_signal.signal({int(OFF)}, _cc_switch)
    _cc_sys.setprofile(_cc_profile)
    _cc_threading.setprofile(_cc_profile)


if _cc_dir and b"gunicorn" in open("/proc/self/cmdline", "rb").read():
    _cc_os.register_at_fork(after_in_child=_cc_child)
"""


class CallCounter:
    """Switches the counting of a gunicorn's workers (given :data:`SITECUSTOMIZE`) on and off
    and reads what a window counted. ``directory``: the workers' ``BENCH_CALLS_DIR``."""

    def __init__(self, directory: str) -> None:
        self.dir = Path(directory)
        self.seq = 0
        self._at_start: dict[str, Counter[str]] = {}

    def _switch(self, pids: list[str], sig: int) -> dict[str, Counter[str]] | None:
        """Signal ``pids`` and wait for each one's acknowledgement; their cumulative counts,
        or ``None`` when some worker did not answer within :data:`ACK_WAIT`."""
        self.seq += 1
        (self.dir / "seq").write_text(str(self.seq))
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), sig)
        got: dict[str, Counter[str]] = {}
        deadline = time.monotonic() + ACK_WAIT
        while len(got) < len(pids) and time.monotonic() < deadline:
            for pid in pids:
                if pid in got:
                    continue
                with contextlib.suppress(OSError, ValueError):
                    ack = json.loads((self.dir / f"{pid}.ack").read_text())
                    if ack["seq"] == self.seq:
                        got[pid] = Counter(ack["counts"])
            if len(got) < len(pids):
                time.sleep(0.002)
        return got if len(got) == len(pids) else None

    def start(self, worker_pids: Callable[[], list[str]]) -> None:
        """Counting on in every worker (acknowledged)."""
        self._at_start = self._switch(worker_pids(), ON) or {}

    def stop(self, worker_pids: Callable[[], list[str]]) -> Counter[str] | None:
        """Counting off; what the workers counted since :meth:`start` (``"<kind> py|c"``), or
        ``None`` when some worker did not answer or was replaced meanwhile."""
        pids = worker_pids()
        end = self._switch(pids, OFF)
        if end is None or set(end) != set(self._at_start):
            return None
        total: Counter[str] = Counter()
        for pid, counts in end.items():
            total.update(counts)
            total.subtract(self._at_start[pid])
        return total
