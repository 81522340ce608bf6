"""The ``tools/call`` lifecycle (§5, §6): check the call, track it (``Cancellation.begin``),
watch the client's socket while the tool runs, run it, end its rows in a ``finally``, and answer:
``-32800`` when it was cancelled (whatever the tool did), else its result or error, as one body or
at the end of the SSE stream its progress opened. ``tools/list`` and ``tools/call`` are served
alike by both wires (:meth:`CallLifecycle._tool_methods`).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from typing import Any

from ..exceptions import LockTimeout
from . import codes, jsonrpc, remote, wake
from .base import ServerBase, _ProcessState
from .conn import CANCELLATION_KEY, HANDLE_KEY, REQUEST_ID_KEY
from .disconnect import Watcher
from .jsonrpc import Request, RpcError
from .reply import PROGRESS_KEY, StartResponse, _body_reply, _Exchange, _Reply
from .stop import RequestStopped, _stop_request, gunicorn_quits
from .tools import _MAX_TEXT, ToolError, ToolRegistry, _invalid_arguments, _tool_result
from .wire import (
    Wire,
    dispatch_status,
    progress_token,
    shape_result,
    validate_param_headers,
)

log = logging.getLogger("shmcancel.server")  # one logger for the whole app, as before


class CallLifecycle(ToolRegistry, ServerBase):
    """The tool methods of the app; a mixin of :class:`~shmcancel.mcp.server.McpServer`."""

    def _tool_methods(self, environ: dict[str, Any], start_response: StartResponse, wire: Wire,
                      msg: Request, json_ok: bool, sse_ok: bool) -> _Reply | None:
        """The methods both wires serve alike: ``tools/list``, ``tools/call``; any other method
        is not found."""
        if msg.method == "tools/list":
            return self._result(wire, msg, self._tools_list(msg), json_ok)
        if msg.method == "tools/call":
            return self._tools_call(environ, start_response, wire, msg, json_ok, sse_ok)
        raise RpcError(codes.METHOD_NOT_FOUND, f"Method not found: {msg.method[:100]!r}",
                       id=msg.id, status=dispatch_status(wire, codes.METHOD_NOT_FOUND))

    def _tools_call(self, environ: dict[str, Any], start_response: StartResponse, wire: Wire,
                    msg: Request, json_ok: bool, sse_ok: bool) -> _Reply | None:
        # contract §5: the request was read, so its errors travel with HTTP 200 (an SDK client
        # turns a 4xx into a transport failure): a call naming no tool is -32602, invalid
        # arguments are a tool execution error the model can read.
        params = msg.params
        if params is None:
            raise RpcError(codes.INVALID_PARAMS, "Invalid params: tools/call needs params",
                           id=msg.id, status=200)
        name = params.get("name")
        if not isinstance(name, str):
            raise RpcError(codes.INVALID_PARAMS, 'Invalid params: "name" must be a string',
                           id=msg.id, status=200)
        token = progress_token(msg)
        tool = self._tools.get(name)
        if tool is None:
            raise RpcError(codes.INVALID_PARAMS, f"Unknown tool: {name[:100]!r}", id=msg.id,
                           status=200)
        arguments = params.get("arguments")
        if arguments is None:
            arguments = {}
        elif not isinstance(arguments, dict):
            return self._result(wire, msg, _invalid_arguments(name, '"arguments" must be an '
                                                              "object"), json_ok)
        if wire is Wire.MODERN and tool.param_headers:
            validate_param_headers(tool.param_headers, arguments, environ, msg.id)

        st = self._process_state()
        c = st.cancellation
        ex = _Exchange(start_response, json_ok=json_ok, sse_ok=sse_ok, token=token)
        handle = c.begin(msg.id, c.scope(environ))
        if isinstance(handle.error, LockTimeout):
            handle.end()
            raise handle.error  # 503: the tool has not run, a retry is safe
        environ[HANDLE_KEY] = handle
        environ[REQUEST_ID_KEY] = msg.id
        environ[CANCELLATION_KEY] = c
        environ[PROGRESS_KEY] = ex
        ex.on_gone = lambda: _cancel_local(handle)
        rb = remote.current()
        remote_call = rb.track(msg.id, handle.scope) if rb is not None else None
        stopping: list[bool] = []  # the watcher's timeout is stopping the tool (see below)
        watcher = self._watch(environ, handle, st, stopping)
        stopped = False
        aborted = False  # gunicorn stopped the worker under the tool (timeout, shutdown)
        cancelled = False
        reason: str | None = None
        outcome: tuple[str, Any] = ("crash", None)
        try:
            try:
                try:
                    if not self._call_tracked(environ, handle):  # else it never runs
                        outcome = ("ok", tool.fn(environ, arguments))
                except ToolError as e:
                    outcome = ("error", e)
                except Exception as e:
                    outcome = ("crash", e)
                    log.warning("tool %r raised", name, exc_info=True)
                except (SystemExit, RequestStopped):
                    raise
                except BaseException as e:
                    # The tool's own (asyncio's CancelledError, a stray GeneratorExit): a crash,
                    # not gunicorn's HTML 500 (contract §5). gunicorn's workers turn SIGINT into
                    # SystemExit, so a KeyboardInterrupt under gunicorn is the tool's too;
                    # elsewhere (a development server) it is Ctrl-C, which stops the server.
                    if isinstance(e, KeyboardInterrupt) and "gunicorn.socket" not in environ:
                        raise
                    outcome = ("crash", e)
                    log.warning("tool %r raised %s", name, type(e).__name__, exc_info=True)
            finally:
                if watcher is not None:
                    watcher.stop()
                cancelled = handle.cancelled()
                if cancelled:
                    reason = handle.reason()
                handle.end()
        except (RequestStopped, SystemExit) as e:
            # The watcher's timeout stops the tool: RequestStopped in a gthread tool's thread;
            # in a sync worker gunicorn's own quit (SIGQUIT: its handler raises SystemExit here
            # and has set the worker not alive, so it exits once this request is answered;
            # escaping, it would be gunicorn's HTML 500). Either way the call was cancelled:
            # -32800 like any other (contract §5). gunicorn raises the same SystemExit in a
            # sync worker it stops itself (the worker timeout's SIGABRT, a quick shutdown's
            # SIGQUIT): the call was read, so HTTP 200 with a JSON-RPC error, not that 500.
            # Any other SystemExit is not ours.
            if isinstance(e, SystemExit) and not stopping:
                if not gunicorn_quits(environ):
                    raise
                aborted = True
                log.warning("tool %r stopped: gunicorn is stopping its worker (worker timeout "
                            "or shutdown)", name)
            stopped = True
            if watcher is not None:
                watcher.stop()  # the stop may have landed inside the finally's, cutting it short
            handle.end()
        finally:
            if rb is not None:
                rb.untrack(remote_call)

        if aborted and not (cancelled or ex.gone):
            body = jsonrpc.error_body(msg.id, codes.INTERNAL_ERROR, "Internal error: the "
                                      "server stopped the call (its worker is exiting: the "
                                      "worker timeout, or a shutdown)")
            return self._finish(ex, wire, 200, body)
        if stopped or cancelled or ex.gone:
            if ex.cut:
                _hang_up(environ)
                return None
            data = {"reason": reason} if reason else None
            body = jsonrpc.error_body(msg.id, codes.REQUEST_CANCELLED, "Request cancelled", data)
            return self._finish(ex, wire, 200, body)
        kind, value = outcome
        if kind == "error" and value.code == codes.INVALID_PARAMS:
            result: Any = _invalid_arguments(name, value.message)
        elif kind == "error":
            # Whatever its code (even one that has a 4xx of its own elsewhere, such as -32601),
            # a tool's error answers a request that was read: 200.
            body = jsonrpc.error_body(msg.id, value.code, value.message, value.data)
            return self._finish(ex, wire, 200, body)
        elif kind == "crash":
            text = f"Error executing tool {name}: {type(value).__name__}: {_text_of(value)}"
            result = {"content": [{"type": "text", "text": text[:_MAX_TEXT]}], "isError": True}
        else:
            result = _tool_result(value)
            if result is None:
                log.error("tool %r returned %s", name, "a dict that is not JSON-serialisable"
                          if isinstance(value, dict) else
                          f"{type(value).__name__}, not a str or dict")
                body = jsonrpc.error_body(msg.id, codes.INTERNAL_ERROR,
                                          "Internal error: the tool returned an invalid result")
                return self._finish(ex, wire, 200, body)
        shaped = shape_result(wire, "tools/call", result, server_info=self.server_info(),
                              ttl_ms=self.cache_ttl_ms, cache_scope=self.cache_scope)
        return self._finish(ex, wire, 200, jsonrpc.result_body(msg.id, shaped))

    def _call_tracked(self, environ: dict[str, Any], handle: Any) -> bool:
        """A wire's hook, run once a ``tools/call`` is tracked and before its tool runs;
        ``True`` when it cancelled the call (the tool is then not run). No poll of the handle
        here: its first poll is its cheap one, kept for the call's end."""
        return False

    def _finish(self, ex: _Exchange, wire: Wire, status: int,
                body: dict[str, Any]) -> _Reply | None:
        """Send a tools/call reply: on the SSE stream when one was opened, else as one body."""
        try:
            raw = jsonrpc.encode(body)
        except (TypeError, ValueError):
            log.error("tool result is not JSON-serialisable", exc_info=True)
            body = jsonrpc.error_body(body.get("id"), codes.INTERNAL_ERROR,
                                      "Internal error: the tool result is not JSON")
            raw = jsonrpc.encode(body)
            status = 200
        if ex.committed:
            ex.send_event(body)
            return None
        return _body_reply(status, body, ex.json_ok, raw)

    # ------------------------------------------------------------------ disconnects

    def _watch(self, environ: dict[str, Any], handle: Any, st: _ProcessState,
               stopping: list[bool]) -> Watcher | None:
        sock = environ.get("gunicorn.socket")
        if sock is None or not self.watch_disconnects:
            return None
        multithread = bool(environ.get("wsgi.multithread"))
        tool_thread = threading.get_ident()
        grace = float(st.registry.config.stream_cancel_timeout)
        holder: list[Watcher] = []

        def on_disconnect() -> None:
            _cancel_local(handle)

        def on_timeout() -> None:
            stopping.append(True)
            _stop_request(holder[0], handle, tool_thread, multithread, grace)

        w = Watcher(sock, on_disconnect=on_disconnect, on_timeout=on_timeout, grace=grace)
        holder.append(w)
        return w if w.start() else None


def _text_of(e: BaseException) -> str:
    """``str(e)`` for the tool execution error naming it, or a placeholder when that raises
    (a ``__str__``, or an argument's ``__repr__``, that fails or recurses too deep): never an
    exception here, which would turn the call's answer into an HTTP 500."""
    try:
        return str(e)
    except Exception:
        return "<exception str() failed>"


def _hang_up(environ: dict[str, Any]) -> None:
    """A stop cut a write of the call's stream short: end the connection with nothing more on
    it, so the client sees the stream cut (a transport error), not a corrupt one."""
    sock = environ.get("gunicorn.socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_WR)


def _cancel_local(handle: Any) -> None:
    """The client left: cancel exactly this call, and wake its tool if it waits."""
    handle.cancel_local("client disconnected")
    wake.wake(handle)
