"""The app tests/mcp/test_stop_races.py serves with gunicorn (``transport_conf.py``): the stateless
server of ``transport_app`` plus tools whose timing a profile hook (``threading.setprofile``: the
threads the worker starts after the import, its ``gthread`` pool and the stop threads) pins to a
point in the watcher's stop. Files as in ``transport_app`` (``$SHMCANCEL_TEST_DIR``).

``held`` ignores ``RequestStopped`` (it catches it, as a tool catching ``BaseException`` would)
until the stop thread, after it asked the worker to exit, has decided to end the process (its
call of ``_exit_unless_stopped``); that thread is then held until the tool's thread has returned
from ``Watcher.stop()``, and the tool's thread until the stop thread has decided
(``_stop_request`` returned, or the process is gone). So the tool ends just between the stop
thread's last wait and its ``_exit``. It waits in
short steps, so ``RequestStopped`` is taken at once: while an asynchronous exception is pending
for a thread blocked in C, CPython 3.11 spins every traced or profiled thread at its next call.

``shout`` sends one progress notification of ``size`` bytes and returns.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType
from typing import Any

from shmcancel.mcp import reply as _reply
from shmcancel.mcp.disconnect import Watcher
from shmcancel.mcp.stop import _exit_unless_stopped, _stop_request
from shmcancel.server import RequestStopped, progress
from tests.apps.transport_app import _record, build

_STOP = Watcher.stop.__code__
_STOP_REQUEST = _stop_request.__code__
_EXIT = _exit_unless_stopped.__code__

_last_wait_over = threading.Event()  # the stop thread's last wait is over: it is to _exit
_tool_stopped = threading.Event()  # the tool's thread returned from Watcher.stop()
_decided = threading.Event()  # the stop thread returned from _stop_request


def _profile(frame: FrameType, event: str, arg: Any) -> None:
    if event == "call" and frame.f_code is _EXIT:
        os.write(2, b"stop-race: the stop thread's last wait is over: it is to _exit\n")
        _last_wait_over.set()
        _tool_stopped.wait(20)
        return
    if event != "return":
        return
    if frame.f_code is _STOP:
        if _last_wait_over.is_set() and not _tool_stopped.is_set():
            _tool_stopped.set()
            _decided.wait(20)
    elif frame.f_code is _STOP_REQUEST:
        os.write(2, b"stop-race: the stop thread returned\n")
        _decided.set()


threading.setprofile(_profile)

app = build(False, "/stateless")


@app.tool("held")
def held(conn: Any, params: dict) -> str:
    _record(params.get("tag"), "started", str(os.getpid()))
    while True:
        try:
            if _last_wait_over.wait(0.01):
                return "held"
        except RequestStopped:
            os.write(2, b"stop-race: held caught RequestStopped\n")
            sys.setprofile(_profile)  # it may have landed in the hook, which that switched off


@app.tool("shout")
def shout(conn: Any, params: dict) -> str:
    """One progress notification whose message is ``size`` characters (a client that does not
    read leaves the worker blocked writing it), then return."""
    _record(params.get("tag"), "started", str(os.getpid()))
    progress(conn, 1, message="x" * int(params.get("size", 0)))
    return "shouted"


_SSE = _reply._sse.__code__


def _quit_at_encode(frame: FrameType, event: str, arg: Any) -> None:
    """The worker's main thread, once: gunicorn's quit (SIGQUIT) as the event is about to be
    encoded, before any byte of it is written."""
    if event == "call" and frame.f_code is _SSE:
        sys.setprofile(None)
        os.kill(os.getpid(), signal.SIGQUIT)


@app.tool("quit_before_write")
def quit_before_write(conn: Any, params: dict) -> str:
    """``sync``: one progress notification, with gunicorn's quit landing before it is written
    (nothing of the event on the wire): the call is answered all the same."""
    _record(params.get("tag"), "started", str(os.getpid()))
    sys.setprofile(_quit_at_encode)
    try:
        progress(conn, 1, message="never sent")
    finally:
        sys.setprofile(None)
    return "not stopped"
