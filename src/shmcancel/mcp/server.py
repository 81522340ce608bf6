"""MCP over HTTP as a WSGI application: tools that are plain sync functions, cancellable across
gunicorn workers through the shared registry (contract §6).

::

    from shmcancel.server import McpServer, ToolError

    server = McpServer(name="example", version="0.1.0")

    @server.tool("sleep", description="...", input_schema={"type": "object", ...})
    def sleep(conn, params):           # conn: the WSGI environ; params: the call's arguments
        while working:
            if shmcancel.cancelled(conn):
                raise ToolError(codes.REQUEST_CANCELLED, "Request cancelled")
            ...
        return "done"                  # a str, or a dict (the MCP CallToolResult)

    application = server               # server(environ, start_response)

One ``POST /mcp`` carries one JSON-RPC message. Both wires are served and told apart per request
(:mod:`shmcancel.mcp.wire`): the 2025-era one (``initialize``, sessions,
``notifications/cancelled``, ``DELETE`` ends a session) and 2026-07-28 (stateless,
header/``_meta`` validation, ``server/discover``, cancellation by closing the connection). ``GET``
is 405 on both: a held-open server-to-client stream would pin a sync worker per client.

Tools
-----
A tool is ``fn(conn, params)``: ``conn`` is the request's WSGI environ (what
``shmcancel.cancelled(conn)`` takes), ``params`` the call's ``arguments`` object (``{}`` when
absent). It returns

- a ``str`` — the result is one text content block;
- a ``dict`` with a ``"content"`` list — used as the ``CallToolResult`` as is;
- any other ``dict`` — sent as ``structuredContent``, with its JSON as the text content;

or raises :class:`ToolError`: with ``codes.INVALID_PARAMS`` (its arguments are invalid) the
answer is a tool execution error, a result with ``isError: true`` naming the problem, as MCP
2025-11-25 asks, so the model can correct its call; with any other code, a JSON-RPC error reply
with that code. Any other exception is a tool execution error naming it. A call naming an unknown
tool is a ``-32602`` error; ``arguments`` that are not an object are a tool execution error. A
call that was cancelled — by ``notifications/cancelled``, a session ``DELETE`` or the client
disconnecting — is answered ``-32800`` whatever the tool did.

Cancellation plumbing
---------------------
Every ``tools/call`` is tracked for its whole run (``Cancellation.begin``) and ended (untrack, then
clear) in a ``finally``. The request's environ carries ``shmcancel.handle``,
``shmcancel.request_id``, ``shmcancel.cancellation`` and — once the ``Mcp-Session-Id`` header was
validated against the shared session table — ``shmcancel.session_id``. Under gunicorn the client
socket is watched while the tool runs (:mod:`shmcancel.mcp.disconnect`); a disconnect cancels
exactly that request (``cancel_local``), and a tool still running ``stream_cancel_timeout`` seconds
later is stopped: its rows are removed, then in a ``sync`` worker the worker exits (``SIGQUIT``:
gunicorn's own quit, which unwinds the tool with ``SystemExit``; a hard ``_exit`` if that does
not end it within a second) and gunicorn replaces it; in ``gthread`` :class:`RequestStopped` is
raised in the tool's thread, and if the tool still has not returned after another grace period
the worker is asked to exit gracefully (``SIGTERM``). A request meeting a registry lock held
past ``lock_timeout`` by a live process (``LockTimeout``) is answered 503 with ``Retry-After``;
a call that already ran keeps its reply, its end is owed and lands later
(:mod:`shmcancel.cancellation`).

Progress
--------
:func:`progress` sends ``notifications/progress`` for the request when the client gave a
``_meta.progressToken`` and accepts ``text/event-stream``: the reply then becomes an SSE stream
(through the WSGI ``write`` callable) ending with the JSON-RPC response. A failed write means the
client left: the request is cancelled like a disconnect.

Bounds
------
Bodies over ``max_body_bytes`` are refused with 413 (from ``Content-Length`` before reading;
reading is capped when it is absent or chunked). Header values read are capped
(:data:`shmcancel.mcp.wire.MAX_HEADER_VALUE`). No malformed input yields a 5xx.

Statuses (contract §5): a message read as a JSON-RPC request is answered with HTTP 200 carrying its
response, error or not (SDK clients turn a 4xx into a transport failure); 4xx only for what
cannot be processed as a request (malformed JSON or envelope, unknown session, refused
``Origin``, size, media types, the 2026-07-28 header/version rungs and unknown methods there),
each with a JSON-RPC error body (:func:`shmcancel.mcp.wire.dispatch_status`).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import os
import signal
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..cancel import ids
from ..cancel.policy import Cancellation
from ..exceptions import CancellationLimitReached, InvalidRequestId, LockTimeout, ShmCancelError
from ..shm import registry
from . import codes, jsonrpc, principal
from .conn import CANCELLATION_KEY, HANDLE_KEY, REQUEST_ID_KEY
from .disconnect import Watcher
from .jsonrpc import Notification, Request, Response, RpcError
from .origin import OriginPolicy
from .principal import PRINCIPAL_KEY, REMOTE_ADDR_KEY, SESSION_KEY
from .sessions import SessionsFull, SessionStore
from .wire import (
    SUPPORTED_VERSIONS,
    ParamHeader,
    RequestHeaders,
    Wire,
    accepts,
    detect,
    detect_without_body,
    dispatch_status,
    is_json_content_type,
    negotiate_legacy_version,
    param_headers,
    progress_token,
    shape_result,
    valid_session_id,
    validate_modern,
    validate_param_headers,
)

__all__ = ["McpServer", "RequestStopped", "Tool", "ToolError", "progress"]

log = logging.getLogger("shmcancel.server")

StartResponse = Callable[..., Callable[[bytes], Any]]
ToolFn = Callable[[Mapping[str, Any], dict[str, Any]], Any]

PROGRESS_KEY = "shmcancel.progress"
_READ_CHUNK = 65536
_HARD_EXIT_GRACE = 1.0  # seconds between SIGQUIT and os._exit for a sync worker's stuck tool
_MAX_TEXT = 1000  # characters of an exception message put into an isError result
_RETRY_AFTER = "1"  # seconds, the Retry-After of a 503 for a registry lock held past its timeout

_STATUS = {200: "200 OK", 202: "202 Accepted", 204: "204 No Content", 400: "400 Bad Request",
           403: "403 Forbidden", 404: "404 Not Found", 405: "405 Method Not Allowed",
           406: "406 Not Acceptable",
           411: "411 Length Required", 413: "413 Content Too Large",
           415: "415 Unsupported Media Type", 429: "429 Too Many Requests",
           500: "500 Internal Server Error", 503: "503 Service Unavailable"}

_SSE_HEADERS = [("Content-Type", "text/event-stream"), ("Cache-Control", "no-cache, no-transform"),
                ("X-Accel-Buffering", "no")]


class ToolError(Exception):
    """Raised by a tool to answer its call with a JSON-RPC error (``code``, ``message``,
    optional ``data``), e.g. ``ToolError(codes.REQUEST_CANCELLED, "Request cancelled")``;
    always with HTTP 200. ``ToolError(codes.INVALID_PARAMS, problem)`` is the exception: the
    call's arguments are invalid, which is answered as a tool execution error (a result with
    ``isError: true`` and the text ``Invalid arguments for tool NAME: problem``)."""

    def __init__(self, code: int, message: str, data: Any = None) -> None:
        if isinstance(code, bool) or not isinstance(code, int):
            raise TypeError(f"ToolError code must be an int, got {code!r}")
        super().__init__(message)
        self.code = code
        self.message = str(message)
        self.data = data


class RequestStopped(BaseException):
    """Raised inside a ``gthread`` tool's thread when its client left and it did not return
    within ``stream_cancel_timeout``. A ``BaseException`` so ``except Exception`` in tool code
    does not swallow it."""


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    fn: ToolFn
    description: str | None = None
    input_schema: Mapping[str, Any] = field(default_factory=lambda: {"type": "object"})
    title: str | None = None
    annotations: Mapping[str, Any] | None = None
    output_schema: Mapping[str, Any] | None = None
    param_headers: tuple[ParamHeader, ...] = ()

    def describe(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "inputSchema": dict(self.input_schema)}
        if self.title is not None:
            d["title"] = self.title
        if self.description is not None:
            d["description"] = self.description
        if self.annotations is not None:
            d["annotations"] = dict(self.annotations)
        if self.output_schema is not None:
            d["outputSchema"] = dict(self.output_schema)
        return d


def progress(conn: Mapping[str, Any], progress: float, total: float | None = None,
             message: str | None = None) -> bool:
    """Send ``notifications/progress`` for the request ``conn`` belongs to.

    A no-op (``False``) when the request carried no ``_meta.progressToken``, the client does
    not accept ``text/event-stream``, ``conn`` is not a dispatched request or the client is gone.
    ``True`` when the notification was written.
    """
    ex = conn.get(PROGRESS_KEY) if isinstance(conn, Mapping) else None
    if not isinstance(ex, _Exchange):
        return False
    return ex.progress(progress, total, message)


class _Reply:
    """What the WSGI callable sends: a status, headers and a body (or a streamed exchange)."""

    __slots__ = ("body", "headers", "status")

    def __init__(self, status: int, body: bytes = b"",
                 headers: list[tuple[str, str]] | None = None) -> None:
        self.status = status
        self.body = body
        self.headers = headers or []


class _Exchange:
    """One request/response exchange: decides JSON vs SSE, streams progress."""

    def __init__(self, start_response: StartResponse, *, json_ok: bool, sse_ok: bool,
                 token: int | str | None) -> None:
        self._start_response = start_response
        self.json_ok = json_ok
        self.sse_ok = sse_ok
        self.token = token
        self.write: Callable[[bytes], Any] | None = None
        self.gone = False
        self.on_gone: Callable[[], None] | None = None

    @property
    def committed(self) -> bool:
        return self.write is not None

    def progress(self, value: float, total: float | None, message: str | None) -> bool:
        if (isinstance(value, bool) or not isinstance(value, int | float)
                or not math.isfinite(value)):
            raise ValueError(f"progress must be a finite number, got {value!r}")
        if total is not None and (isinstance(total, bool) or not isinstance(total, int | float)
                                  or not math.isfinite(total)):
            raise ValueError(f"total must be a finite number or None, got {total!r}")
        if message is not None and not isinstance(message, str):
            raise ValueError(f"message must be a str or None, got {message!r}")
        if self.token is None or not self.sse_ok or self.gone:
            return False
        params: dict[str, Any] = {"progressToken": self.token, "progress": value}
        if total is not None:
            params["total"] = total
        if message is not None:
            params["message"] = message
        return self.send_event({"jsonrpc": "2.0", "method": "notifications/progress",
                                "params": params})

    def send_event(self, obj: Any) -> bool:
        if self.gone:
            return False
        try:
            if self.write is None:
                self.write = self._start_response(_STATUS[200], list(_SSE_HEADERS))
            self.write(_sse(obj))
            return True
        except Exception:
            self.gone = True
            if self.on_gone is not None:
                self.on_gone()
            return False


def _sse(obj: Any) -> bytes:
    return b"event: message\ndata: " + jsonrpc.encode(obj) + b"\n\n"


class _ProcessState:
    """What a worker process needs of the registry, resolved after fork on first use."""

    __slots__ = ("cancellation", "pid", "registry", "sessions")

    def __init__(self, reg: Any) -> None:
        self.pid = os.getpid()
        self.registry = reg
        self.cancellation = Cancellation(reg)
        self.sessions = SessionStore(reg)


class McpServer:
    """A WSGI application serving MCP tools at ``path`` (default ``/mcp``).

    ``sessions``: mint an ``Mcp-Session-Id`` at ``initialize`` on the 2025-era wire (stored in the
    registry, valid in every worker); ``False`` serves that wire statelessly. ``registry``: a
    :class:`~shmcancel.shm.registry.Registry`, a registry name (attached on first use in each
    process), or ``None`` for :func:`shmcancel.shm.registry.current` (what the gunicorn hooks attach
    in each worker). ``max_body_bytes``: the largest accepted POST body. ``poll_interval``: no
    longer used (the disconnect watcher is woken by the kernel; kept and checked for
    compatibility). ``watch_disconnects``: ``False`` turns disconnect detection off (contract §6.3
    is then not met: for measuring its cost, as ``tools/bench_watch.py`` does).
    ``cache_ttl_ms`` / ``cache_scope``: the 2026-07-28 caching hints of ``tools/list`` and
    ``server/discover`` (the tool list is the same for every caller, hence ``"public"``).
    ``allowed_origins`` (contract §6.0, the transport's DNS-rebinding defence): a request whose
    ``Origin`` header is present and not allowed is refused with 403 and a JSON-RPC error, on
    both wires and every HTTP method; a request without ``Origin`` (not a browser) passes.
    ``None`` (the default) allows ``http``/``https`` pages on ``localhost``, ``127.0.0.1`` and
    ``[::1]``, any port (:data:`shmcancel.mcp.origin.LOCALHOST_ORIGINS`); a list replaces that with
    exactly its origins, each ``"scheme://host[:port]"`` with ``port`` a number or ``*``, e.g.
    ``[*LOCALHOST_ORIGINS, "https://app.example.com"]``; ``"*"`` turns the check off, for a
    deployment whose proxy checks ``Origin`` itself. Parsing is strict
    (:mod:`shmcancel.mcp.origin`): a malformed or ``null`` origin is refused; an invalid pattern
    raises ``ValueError`` here.
    """

    def __init__(self, name: str, version: str, *, sessions: bool = True, registry: Any = None,
                 max_body_bytes: int = 1_000_000, poll_interval: float = 0.01,
                 path: str | None = "/mcp", instructions: str | None = None,
                 title: str | None = None, cache_ttl_ms: int = 60_000,
                 cache_scope: str = "public",
                 allowed_origins: Iterable[str] | str | None = None,
                 watch_disconnects: bool = True) -> None:
        if not isinstance(name, str) or not isinstance(version, str):
            raise TypeError("name and version must be strings")
        if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) \
                or max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be a positive int, got {max_body_bytes!r}")
        if isinstance(poll_interval, bool) or not isinstance(poll_interval, int | float) \
                or not 0 < poll_interval <= 1:
            raise ValueError(f"poll_interval must be in (0, 1] seconds, got {poll_interval!r}")
        if isinstance(cache_ttl_ms, bool) or not isinstance(cache_ttl_ms, int) or cache_ttl_ms < 0:
            raise ValueError(f"cache_ttl_ms must be an int >= 0, got {cache_ttl_ms!r}")
        if cache_scope not in ("public", "private"):
            raise ValueError(f'cache_scope must be "public" or "private", got {cache_scope!r}')
        self.name = name
        self.version = version
        self.title = title
        self.instructions = instructions
        self.sessions = bool(sessions)
        self.max_body_bytes = max_body_bytes
        self.poll_interval = float(poll_interval)
        self.watch_disconnects = bool(watch_disconnects)
        self.path = path
        self.cache_ttl_ms = cache_ttl_ms
        self.cache_scope = cache_scope
        self.origins = OriginPolicy(allowed_origins)
        self._registry_spec = registry
        self._tools: dict[str, Tool] = {}
        self._state: _ProcessState | None = None
        self._state_lock = threading.Lock()

    # ------------------------------------------------------------------ tools

    def tool(self, name: str, description: str | None = None,
             input_schema: Mapping[str, Any] | None = None, *, title: str | None = None,
             annotations: Mapping[str, Any] | None = None,
             output_schema: Mapping[str, Any] | None = None) -> Callable[[ToolFn], ToolFn]:
        """Decorator registering ``fn(conn, params)`` as tool ``name``."""
        def register(fn: ToolFn) -> ToolFn:
            self.add_tool(fn, name, description, input_schema, title=title,
                          annotations=annotations, output_schema=output_schema)
            return fn
        return register

    def add_tool(self, fn: ToolFn, name: str, description: str | None = None,
                 input_schema: Mapping[str, Any] | None = None, *, title: str | None = None,
                 annotations: Mapping[str, Any] | None = None,
                 output_schema: Mapping[str, Any] | None = None) -> Tool:
        if not callable(fn):
            raise TypeError(f"tool {name!r}: {fn!r} is not callable")
        if not isinstance(name, str) or not name:
            raise ValueError(f"tool name must be a non-empty str, got {name!r}")
        if name in self._tools:
            raise ValueError(f"tool {name!r} is already registered")
        schema = {"type": "object"} if input_schema is None else dict(input_schema)
        if schema.get("type") != "object":
            raise ValueError(f'tool {name!r}: input_schema must have "type": "object"')
        jsonrpc.encode(schema)  # must be JSON
        try:
            mirrored = param_headers(schema)
        except ValueError as e:
            raise ValueError(f"tool {name!r}: {e}") from None
        t = Tool(name, fn, description, schema, title, annotations, output_schema, mirrored)
        self._tools[name] = t
        return t

    @property
    def tools(self) -> dict[str, Tool]:
        return dict(self._tools)

    def server_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"name": self.name, "version": self.version}
        if self.title is not None:
            info["title"] = self.title
        return info

    def capabilities(self) -> dict[str, Any]:
        return {"tools": {"listChanged": False}}

    # ------------------------------------------------------------------ per-process state

    def _process_state(self) -> _ProcessState:
        st = self._state
        pid = os.getpid()
        if st is not None and st.pid == pid and not getattr(st.registry, "closed", False):
            return st
        with self._state_lock:
            st = self._state
            if st is not None and st.pid == pid and not getattr(st.registry, "closed", False):
                return st
            spec = self._registry_spec
            if spec is None:
                reg = registry.current()
                if reg is None:
                    raise _NoRegistry("no shmcancel registry is attached in this process "
                                      "(use the shmcancel.gunicorn hooks, or pass registry=)")
            elif isinstance(spec, str):
                reg = registry.Registry.attach(spec)
            else:
                reg = spec
            self._state = st = _ProcessState(reg)
            return st

    # ------------------------------------------------------------------ WSGI

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        try:
            reply = self._handle(environ, start_response)
        except _NoRegistry as e:
            log.error("%s", e)
            reply = _error_reply(503, None, codes.INTERNAL_ERROR,
                                 "Server misconfigured: " + str(e))
        except RequestStopped:
            reply = _error_reply(200, None, codes.REQUEST_CANCELLED, "Request cancelled")
        except LockTimeout as e:
            # A live process holds the registry lock (stopped, stalled): not this request's
            # fault and not a server bug; nothing was half-written. Ask the client to retry.
            log.warning("%s %s: %s", environ.get("REQUEST_METHOD"), environ.get("PATH_INFO"), e)
            reply = _error_reply(503, None, codes.SERVER_ERROR,
                                 "Service unavailable: the registry is busy; retry later",
                                 headers=[("Retry-After", _RETRY_AFTER)])
        except Exception:
            log.exception("internal error handling %s %s", environ.get("REQUEST_METHOD"),
                          environ.get("PATH_INFO"))
            reply = _error_reply(500, None, codes.INTERNAL_ERROR, "Internal error")
        if reply is None:  # streamed: everything was written already
            return []
        headers = [*reply.headers, ("Content-Length", str(len(reply.body)))]
        if reply.status != 204 and not any(k == "Content-Type" for k, _ in headers):
            headers.append(("Content-Type", "application/json"))  # an empty 202 names one too
        start_response(_STATUS.get(reply.status, f"{reply.status} Error"), headers)
        return [reply.body] if reply.body else []

    def _handle(self, environ: dict[str, Any], start_response: StartResponse) -> _Reply | None:
        method = str(environ.get("REQUEST_METHOD") or "GET").upper()
        if self.path is not None:
            path = str(environ.get("PATH_INFO") or "/")
            if path.rstrip("/") != self.path.rstrip("/"):
                return _Reply(404, b"Not Found", [("Content-Type", "text/plain")])
        headers = RequestHeaders.from_environ(environ)
        origin = environ.get("HTTP_ORIGIN")
        if not self.origins.allows(origin if isinstance(origin, str) else None):
            log.debug("refused a request from Origin %.200r", origin)
            return _error_reply(403, None, codes.INVALID_REQUEST,
                                "Forbidden: Origin not allowed (DNS-rebinding protection)")
        if method == "POST":
            return self._post(environ, start_response, headers)
        if method == "DELETE":
            return self._delete(environ, headers)
        wire = detect_without_body(headers)
        allow = "POST, DELETE" if self.sessions and wire is not Wire.MODERN else "POST"
        return _error_reply(405, None, codes.INVALID_REQUEST,
                            f"Method Not Allowed: {method} (use POST)", headers=[("Allow", allow)])

    # ------------------------------------------------------------------ DELETE

    def _delete(self, environ: dict[str, Any], headers: RequestHeaders) -> _Reply:
        wire = detect_without_body(headers)
        if wire is None:
            e = _unsupported_header(headers.protocol_version or "")
            return _error_reply(e.status, None, e.code, e.message, e.data)
        if wire is Wire.MODERN or not self.sessions:
            return _error_reply(405, None, codes.INVALID_REQUEST,
                                "Method Not Allowed: this server keeps no sessions to end",
                                headers=[("Allow", "POST")])
        sid = headers.session_id
        bad = _session_error(sid, None)
        if bad is not None:
            return _error_reply(bad.status, None, bad.code, bad.message)
        st = self._process_state()
        if st.sessions.get(sid) is None or not st.sessions.delete(sid):  # type: ignore[arg-type]
            return _error_reply(404, None, codes.INVALID_REQUEST, "Session not found")
        environ[SESSION_KEY] = sid
        n = st.cancellation.cancel_scope(st.cancellation.scope(environ), "session deleted")
        if n:
            log.info("session deleted: cancelled %d request(s) in flight", n)
        return _Reply(204)

    # ------------------------------------------------------------------ POST

    def _post(self, environ: dict[str, Any], start_response: StartResponse,
              headers: RequestHeaders) -> _Reply | None:
        body_or_reply = self._read_body(environ, headers)
        if isinstance(body_or_reply, _Reply):
            return body_or_reply
        json_ok, sse_ok = accepts(headers.accept)
        try:
            msg = jsonrpc.parse(jsonrpc.decode(body_or_reply))
            wire = detect(msg, headers)
        except RpcError as e:
            return _error_reply(e.status, e.id, e.code, e.message, e.data)
        try:
            if wire is Wire.MODERN:
                return self._modern(environ, start_response, headers, msg, json_ok, sse_ok)
            return self._legacy(environ, start_response, headers, msg, json_ok, sse_ok)
        except RpcError as e:
            return _error_reply(e.status, e.id, e.code, e.message, e.data)

    def _read_body(self, environ: dict[str, Any], headers: RequestHeaders) -> bytes | _Reply:
        limit = self.max_body_bytes
        raw_len = environ.get("CONTENT_LENGTH")
        length: int | None = None
        if raw_len not in (None, ""):
            text = str(raw_len).strip()
            if not text.isdigit() or len(text) > 18:
                return _error_reply(400, None, codes.INVALID_REQUEST, "Invalid Content-Length")
            length = int(text)
            if length > limit:
                return _error_reply(413, None, codes.INVALID_REQUEST,
                                    f"Request body too large (limit {limit} bytes)")
        if not is_json_content_type(headers.content_type):
            return _error_reply(415, None, codes.INVALID_REQUEST,
                                "Unsupported Media Type: Content-Type must be application/json")
        json_ok, sse_ok = accepts(headers.accept)
        if not (json_ok or sse_ok):
            return _error_reply(406, None, codes.INVALID_REQUEST,
                                "Not Acceptable: accept application/json or text/event-stream")
        stream = environ.get("wsgi.input")
        if stream is None:
            return b""
        if length is None:
            if not environ.get("wsgi.input_terminated"):
                return _error_reply(411, None, codes.INVALID_REQUEST,
                                    "Length Required: send Content-Length")
            want = limit + 1  # read to EOF, but never more than one byte past the limit
        else:
            want = length
        chunks: list[bytes] = []
        got = 0
        while got < want:
            try:
                chunk = stream.read(min(_READ_CHUNK, want - got))
            except Exception:  # the client went away mid-body, or a malformed chunk
                return _error_reply(400, None, codes.INVALID_REQUEST, "Could not read the body")
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        if got > limit:
            return _error_reply(413, None, codes.INVALID_REQUEST,
                                f"Request body too large (limit {limit} bytes)")
        return b"".join(chunks)

    # ------------------------------------------------------------------ 2026-07-28

    def _modern(self, environ: dict[str, Any], start_response: StartResponse,
                headers: RequestHeaders, msg: Request | Notification | Response,
                json_ok: bool, sse_ok: bool) -> _Reply | None:
        if isinstance(msg, Response):
            raise RpcError(codes.INVALID_REQUEST,
                           "Invalid Request: clients must not send responses on 2026-07-28")
        if isinstance(msg, Notification):
            # No client-to-server notifications exist on this wire (a client cancels by closing
            # the connection); accept and drop, as the transport's rules allow.
            return _Reply(202)
        validate_modern(msg, headers)
        environ.pop(SESSION_KEY, None)  # an Mcp-Session-Id header is ignored on this wire
        if msg.method == "server/discover":
            # serverInfo also travels in _meta (io.modelcontextprotocol/serverInfo) on every
            # 2026-07-28 result; discover names it plainly too, as initialize does.
            result = {"supportedVersions": list(SUPPORTED_VERSIONS),
                      "capabilities": self.capabilities(), "serverInfo": self.server_info()}
            if self.instructions is not None:
                result["instructions"] = self.instructions
            return self._result(Wire.MODERN, msg, result, json_ok)
        return self._tool_methods(environ, start_response, Wire.MODERN, msg, json_ok, sse_ok)

    # ------------------------------------------------------------------ 2025-era

    def _legacy(self, environ: dict[str, Any], start_response: StartResponse,
                headers: RequestHeaders, msg: Request | Notification | Response,
                json_ok: bool, sse_ok: bool) -> _Reply | None:
        if isinstance(msg, Response):
            return _Reply(202)  # a reply to a server request; this server sends none: dropped
        if isinstance(msg, Request) and msg.method == "initialize":
            return self._initialize(environ, msg, json_ok)
        rid = msg.id if isinstance(msg, Request) else None
        call = None
        if self.sessions:
            sid = headers.session_id
            bad = _session_error(sid, rid)
            if bad is not None:
                raise bad
            st = self._process_state()
            session = st.sessions.get(sid)
            if session is not None and isinstance(msg, Request) and msg.method == "tools/call":
                # recorded for the call's whole run: a session with a call in flight is never
                # displaced by its client's new sessions
                call = st.sessions.begin_call(session)
                if call is None:
                    session = None  # displaced or deleted since the lookup
            elif session is not None:
                st.sessions.touch(session)
            if session is None:
                raise RpcError(codes.INVALID_REQUEST, "Session not found", id=rid, status=404)
            environ[SESSION_KEY] = sid
        else:
            environ.pop(SESSION_KEY, None)
        if isinstance(msg, Notification):
            if msg.method == "notifications/cancelled":
                return self._notification_cancelled(environ, msg)
            return _Reply(202)
        if msg.method == "ping":
            return self._result(Wire.LEGACY, msg, {}, json_ok)
        if call is None:
            return self._tool_methods(environ, start_response, Wire.LEGACY, msg, json_ok, sse_ok)
        try:
            return self._tool_methods(environ, start_response, Wire.LEGACY, msg, json_ok, sse_ok)
        finally:
            st.sessions.end_call(call)

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

    def _initialize(self, environ: dict[str, Any], msg: Request, json_ok: bool) -> _Reply:
        params = msg.params or {}
        requested = params.get("protocolVersion")
        if not isinstance(requested, str):
            raise RpcError(codes.INVALID_PARAMS,
                           'Invalid params: initialize needs a "protocolVersion" string', id=msg.id,
                           status=200)
        for key in ("capabilities", "clientInfo"):
            if key in params and not isinstance(params[key], dict):
                raise RpcError(codes.INVALID_PARAMS,
                               f'Invalid params: "{key}" must be an object', id=msg.id,
                               status=200)
        version = negotiate_legacy_version(requested)
        result: dict[str, Any] = {"protocolVersion": version,
                                  "capabilities": self.capabilities(),
                                  "serverInfo": self.server_info()}
        if self.instructions is not None:
            result["instructions"] = self.instructions
        extra: list[tuple[str, str]] = []
        if self.sessions:
            # Minting counts against the client: its principal, else its address bucket.
            client = principal.scope({k: environ[k] for k in (PRINCIPAL_KEY, REMOTE_ADDR_KEY)
                                      if k in environ})
            try:
                session = self._process_state().sessions.create(version, client)
            except SessionsFull as e:
                return _error_reply(503, msg.id, codes.SERVER_ERROR,
                                    f"Server busy: no session available ({e})",
                                    headers=[("Retry-After", str(e.retry_after))])
            extra.append(("Mcp-Session-Id", session.id))
        reply = self._result(Wire.LEGACY, msg, result, json_ok)
        reply.headers.extend(extra)
        return reply

    def _notification_cancelled(self, environ: dict[str, Any], msg: Notification) -> _Reply:
        """Record a cancellation only for a request in flight in the caller's scope (§6.1)."""
        params = {} if msg.params is None else msg.params  # parse() rejected non-objects (400)
        rid = params.get("requestId")
        if rid is None:
            return _Reply(202)
        reason = params.get("reason")  # any JSON value: cancel() makes a non-str its repr
        if ids.key(rid) is None:
            return _error_reply(400, None, codes.INVALID_PARAMS,
                                'Invalid params: "requestId" must be an integer or a string of '
                                f"at most {ids.MAX_ID_BYTES} bytes")
        st = self._process_state()
        c = st.cancellation
        scope = c.scope(environ)
        try:
            # One step: a call ending meanwhile leaves no row. Unknown or finished: ignored, as
            # MCP permits; nothing recorded.
            c.cancel_if_in_flight(rid, reason, scope)
        except CancellationLimitReached:
            return _error_reply(429, None, codes.SERVER_ERROR,
                                "Too many cancellations recorded for this client")
        except InvalidRequestId:
            return _error_reply(400, None, codes.INVALID_PARAMS, 'Invalid params: "requestId"')
        return _Reply(202)

    # ------------------------------------------------------------------ methods

    def _tools_list(self, msg: Request) -> dict[str, Any]:
        params = msg.params or {}
        cursor = params.get("cursor")
        if cursor is not None and not isinstance(cursor, str):
            raise RpcError(codes.INVALID_PARAMS, 'Invalid params: "cursor" must be a string',
                           id=msg.id, status=200)
        return {"tools": [t.describe() for t in self._tools.values()]}

    def _result(self, wire: Wire, msg: Request, result: dict[str, Any],
                json_ok: bool) -> _Reply:
        shaped = shape_result(wire, msg.method, result, server_info=self.server_info(),
                              ttl_ms=self.cache_ttl_ms, cache_scope=self.cache_scope)
        return _body_reply(200, jsonrpc.result_body(msg.id, shaped), json_ok)

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
        ex.on_gone = lambda: handle.cancel_local("client disconnected")
        watcher = self._watch(environ, handle, st)
        stopped = False
        cancelled = False
        reason: str | None = None
        outcome: tuple[str, Any] = ("crash", None)
        try:
            try:
                try:
                    outcome = ("ok", tool.fn(environ, arguments))
                except ToolError as e:
                    outcome = ("error", e)
                except Exception as e:
                    outcome = ("crash", e)
                    log.warning("tool %r raised", name, exc_info=True)
            finally:
                if watcher is not None:
                    watcher.stop()
                cancelled = handle.cancelled()
                if cancelled:
                    reason = handle.reason()
                handle.end()
        except RequestStopped:
            stopped = True
            handle.end()

        if stopped or cancelled or ex.gone:
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
            text = f"Error executing tool {name}: {type(value).__name__}: {value}"
            result = {"content": [{"type": "text", "text": text[:_MAX_TEXT]}], "isError": True}
        else:
            result = _tool_result(value)
            if result is None:
                log.error("tool %r returned %s, not a str or dict", name, type(value).__name__)
                body = jsonrpc.error_body(msg.id, codes.INTERNAL_ERROR,
                                          "Internal error: the tool returned an invalid result")
                return self._finish(ex, wire, 200, body)
        shaped = shape_result(wire, "tools/call", result, server_info=self.server_info(),
                              ttl_ms=self.cache_ttl_ms, cache_scope=self.cache_scope)
        return self._finish(ex, wire, 200, jsonrpc.result_body(msg.id, shaped))

    def _finish(self, ex: _Exchange, wire: Wire, status: int,
                body: dict[str, Any]) -> _Reply | None:
        """Send a tools/call reply: on the SSE stream when one was opened, else as one body."""
        try:
            jsonrpc.encode(body)
        except (TypeError, ValueError):
            log.error("tool result is not JSON-serialisable", exc_info=True)
            body = jsonrpc.error_body(body.get("id"), codes.INTERNAL_ERROR,
                                      "Internal error: the tool result is not JSON")
            status = 200
        if ex.committed:
            ex.send_event(body)
            return None
        return _body_reply(status, body, ex.json_ok)

    # ------------------------------------------------------------------ disconnects

    def _watch(self, environ: dict[str, Any], handle: Any, st: _ProcessState) -> Watcher | None:
        sock = environ.get("gunicorn.socket")
        if sock is None or not self.watch_disconnects:
            return None
        multithread = bool(environ.get("wsgi.multithread"))
        tool_thread = threading.get_ident()
        grace = float(st.registry.config.stream_cancel_timeout)
        holder: list[Watcher] = []

        def on_disconnect() -> None:
            handle.cancel_local("client disconnected")

        def on_timeout() -> None:
            _stop_request(holder[0], handle, tool_thread, multithread, grace)

        w = Watcher(sock, on_disconnect=on_disconnect, on_timeout=on_timeout, grace=grace)
        holder.append(w)
        return w if w.start() else None


class _NoRegistry(ShmCancelError):
    pass


def _stop_request(watcher: Watcher, handle: Any, tool_thread: int, multithread: bool,
                  grace: float) -> None:
    """The client left ``grace`` seconds ago and the tool is still running: stop it.

    First its rows go (untrack, clear), so nothing of the request stays in the tables whatever
    happens next. Then, in a ``sync`` worker (the request is the process), gunicorn's own quit
    (``SIGQUIT``: ``SystemExit`` in the main thread, which unwinds the tool) and gunicorn forks a
    replacement; ``os._exit`` if the tool is stuck where no signal handler can run. In
    ``gthread``, :class:`RequestStopped` is raised in the tool's thread; if it has still not
    returned after another ``grace``, the worker is asked to exit gracefully (``SIGTERM``).
    """
    handle.end()
    if not multithread:
        with watcher.running() as running:
            if not running:
                return
            log.warning("a tool did not return %.1fs after its client left; the worker exits "
                        "(gunicorn replaces it)", grace)
            os.kill(os.getpid(), signal.SIGQUIT)
        if not watcher.wait_stopped(_HARD_EXIT_GRACE):
            with contextlib.suppress(OSError):
                os.write(2, b"shmcancel: a stuck tool ignored the worker's quit; exiting now\n")
            os._exit(1)
        return
    with watcher.running() as running:
        if not running:
            return
        log.warning("a tool did not return %.1fs after its client left; stopping its thread",
                    grace)
        _async_raise(tool_thread, RequestStopped)
    if watcher.wait_stopped(max(grace, 1.0)):
        return
    log.error("a stopped tool still runs; asking the worker to exit gracefully")
    os.kill(os.getpid(), signal.SIGTERM)


def _async_raise(thread_ident: int, exc: type[BaseException]) -> bool:
    n = ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_ident),
                                                   ctypes.py_object(exc))
    if n > 1:  # pragma: no cover - cannot happen for one ident; undo as the C API asks
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_ident), None)
        return False
    return n == 1


def _tool_result(value: Any) -> dict[str, Any] | None:
    if isinstance(value, str):
        return {"content": [{"type": "text", "text": value}], "isError": False}
    if isinstance(value, dict):
        if isinstance(value.get("content"), list):
            return dict(value)
        try:
            text = jsonrpc.encode(value).decode("utf-8")
        except (TypeError, ValueError):
            return None
        return {"content": [{"type": "text", "text": text}], "structuredContent": value,
                "isError": False}
    return None


def _invalid_arguments(tool: str, problem: str) -> dict[str, Any]:
    """The tool execution error (``isError: true``) that answers a call with invalid
    arguments, naming the problem (MCP 2025-11-25: input validation errors are tool errors, so
    the model can correct its call)."""
    text = f"Invalid arguments for tool {tool}: {problem}"
    return {"content": [{"type": "text", "text": text[:_MAX_TEXT]}], "isError": True}


def _session_error(sid: str | None, rid: int | str | None) -> RpcError | None:
    if sid is None:
        return RpcError(codes.INVALID_REQUEST, "Bad Request: missing Mcp-Session-Id header",
                        id=rid, status=400)
    if not valid_session_id(sid):
        return RpcError(codes.INVALID_REQUEST, "Bad Request: malformed Mcp-Session-Id header",
                        id=rid, status=400)
    return None


def _unsupported_header(requested: str) -> RpcError:
    shown = requested if len(requested) <= 128 else requested[:128] + "..."
    return RpcError(codes.UNSUPPORTED_PROTOCOL_VERSION,
                    f"Unsupported protocol version: {shown!r}",
                    data={"supported": list(SUPPORTED_VERSIONS), "requested": shown})


def _body_reply(status: int, body: dict[str, Any], json_ok: bool) -> _Reply:
    if json_ok:
        return _Reply(status, jsonrpc.encode(body), [("Content-Type", "application/json")])
    return _Reply(status, _sse(body), list(_SSE_HEADERS))


def _error_reply(status: int, id: int | str | None, code: int, message: str, data: Any = None,
                 *, headers: list[tuple[str, str]] | None = None) -> _Reply:
    reply = _body_reply(status, jsonrpc.error_body(id, code, message, data), True)
    if headers:
        reply.headers.extend(headers)
    return reply

