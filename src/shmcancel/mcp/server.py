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

Where the parts live: this module is the WSGI front end (routing, ``Origin``, body reading, the
status of what fails) and composes :class:`McpServer` from :mod:`.legacy` and :mod:`.modern` (the
two wires), :mod:`.call` (the ``tools/call`` lifecycle), :mod:`.tools` (the registry),
:mod:`.stop` (stopping a stuck tool), :mod:`.base` (settings, per-process state) and
:mod:`.reply` (replies, SSE, progress); no part imports one named before it, nor the two
wires each other (an import-linter contract).

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
past ``lock_timeout`` by a live process (``LockTimeout``), or a server whose ``registry=`` object
was closed in the worker (``RegistryClosed``), is answered 503 with ``Retry-After``;
a call that already ran keeps its reply, its end is owed and lands later
(:mod:`shmcancel.cancellation`). So is a session id this host does not hold when the cross-host
layer gives no answer about it (``RemoteUnavailable``: Redis slow or down); 404 only when it
answered that there is no such session.

Progress
--------
:func:`progress` sends ``notifications/progress`` for the request when the client gave a
``_meta.progressToken`` and accepts ``text/event-stream``: the reply then becomes an SSE stream
(through the WSGI ``write`` callable) ending with the JSON-RPC response. A failed write means the
client left: the request is cancelled like a disconnect.

Bounds
------
Bodies over ``max_body_bytes`` are refused with 413 (from ``Content-Length`` before reading;
reading is capped when it is absent or chunked). A body not received within ``body_timeout``
seconds is refused with 408 (a client that stalls mid-body would otherwise hold a ``sync``
worker until gunicorn's ``timeout`` kills it, and a ``gthread`` thread for good). Header
values read are capped (:data:`shmcancel.mcp.wire.MAX_HEADER_VALUE`). No malformed input yields
a 5xx.

Statuses (contract §5): a message read as a JSON-RPC request is answered with HTTP 200 carrying its
response, error or not (SDK clients turn a 4xx into a transport failure); 4xx only for what
cannot be processed as a request (malformed JSON or envelope, unknown session, refused
``Origin``, size, media types, the 2026-07-28 header/version rungs and unknown methods there),
each with a JSON-RPC error body (:func:`shmcancel.mcp.wire.dispatch_status`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Any

from ..exceptions import LockTimeout, RegistryClosed, RemoteUnavailable, TableFull
from ..shm.names import check_name
from ..shm.registry import Registry
from . import codes, jsonrpc
from .base import _NoRegistry, _ProcessState
from .body import EndingConnection, body_left_unread, read_body
from .call import _hang_up
from .jsonrpc import Request, RpcError
from .legacy import LegacyWire
from .modern import ModernWire
from .origin import OriginPolicy
from .reply import (
    _STATUS,
    StartResponse,
    _body_reply,
    _error_reply,
    _Exchange,
    _Reply,
    progress,
)
from .reply import PROGRESS_KEY as PROGRESS_KEY
from .sessions import SessionsFull
from .stop import RequestStopped, counted, gunicorn_quits
from .tools import Tool, ToolError
from .wire import (
    RequestHeaders,
    Wire,
    accepts,
    detect,
    detect_without_body,
)

__all__ = ["McpServer", "RequestStopped", "Tool", "ToolError", "progress"]

log = logging.getLogger("shmcancel.server")

_READ_CHUNK = 65536
_REPLY_ID_KEY = "shmcancel._reply_id"  # the id of the request being served, once read
_RETRY_AFTER = "1"  # seconds, the Retry-After of a 503 for a registry lock held past its timeout


def _retry_later(environ: dict[str, Any], e: Exception, message: str, retry_after: object,
                 level: int = logging.INFO) -> _Reply:
    """503 with ``Retry-After``: the request was not served (nothing half-done), a retry is
    safe. ``e`` is logged at ``level`` with the request's method and path, as from the caller
    (``stacklevel=2``: a format's ``funcName``/``lineno`` name the handler, as before)."""
    log.log(level, "%s %s: %s", environ.get("REQUEST_METHOD"), environ.get("PATH_INFO"), e,
            stacklevel=2)
    return _error_reply(503, environ.get(_REPLY_ID_KEY), codes.SERVER_ERROR, message,
                        headers=[("Retry-After", str(retry_after))])


class McpServer(LegacyWire, ModernWire):
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
    ``body_timeout``: seconds a POST body may take to arrive in full (read through
    ``environ["gunicorn.socket"]`` with a deadline; ``None``: no deadline); keep it below
    gunicorn's worker ``timeout``.
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

    def __init__(self, name: str, version: str, *, sessions: bool = True,
                 registry: Registry | str | None = None,
                 max_body_bytes: int = 1_000_000, poll_interval: float = 0.01,
                 path: str | None = "/mcp", instructions: str | None = None,
                 title: str | None = None, cache_ttl_ms: int = 60_000,
                 cache_scope: str = "public",
                 allowed_origins: Iterable[str] | str | None = None,
                 watch_disconnects: bool = True, body_timeout: float | None = 10.0) -> None:
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
        if body_timeout is not None and (isinstance(body_timeout, bool)
                                         or not isinstance(body_timeout, int | float)
                                         or not 0 < body_timeout < float("inf")):
            raise ValueError(f"body_timeout must be a positive number of seconds or None, "
                             f"got {body_timeout!r}")
        if cache_scope not in ("public", "private"):
            raise ValueError(f'cache_scope must be "public" or "private", got {cache_scope!r}')
        for what, value in (("title", title), ("instructions", instructions), ("path", path)):
            if value is not None and not isinstance(value, str):
                raise TypeError(f"{what} must be a str or None, got {type(value).__name__}")
        for what, flag in (("sessions", sessions), ("watch_disconnects", watch_disconnects)):
            if not isinstance(flag, bool):
                raise TypeError(f"{what} must be a bool, got {flag!r:.80}")
        if isinstance(registry, str):
            check_name(registry)  # InvalidRegistryName now, not a 500 per request
        elif registry is not None and not isinstance(registry, Registry):
            raise TypeError("registry must be a Registry, a registry name or None, got "
                            f"{type(registry).__name__}")
        self.name = name
        self.version = version
        self.title = title
        self.instructions = instructions
        self.sessions = bool(sessions)
        self.max_body_bytes = max_body_bytes
        self.poll_interval = float(poll_interval)
        self.watch_disconnects = bool(watch_disconnects)
        self.body_timeout = None if body_timeout is None else float(body_timeout)
        self.path = path
        self.cache_ttl_ms = cache_ttl_ms
        self.cache_scope = cache_scope
        self.origins = OriginPolicy(allowed_origins)
        self._registry_spec = registry
        self._tools: dict[str, Tool] = {}
        self._state: _ProcessState | None = None
        self._state_lock = threading.Lock()

    # ------------------------------------------------------------------ WSGI

    @counted
    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        held = self._lock_depth()  # holds around this request (a middleware's) go on
        try:
            reply = self._handle(environ, start_response)
        except _NoRegistry as e:
            log.error("%s", e)  # the reason, with paths, for the operator only
            reply = _error_reply(503, None, codes.INTERNAL_ERROR,
                                 "Server misconfigured: no usable shmcancel registry (the "
                                 "server's log says why)")
        except RequestStopped:
            reply = _error_reply(200, None, codes.REQUEST_CANCELLED, "Request cancelled")
        except RegistryClosed as e:
            # The registry object this server was given was closed in this process (a worker
            # exiting, an application's own close): not the client's fault; another worker may
            # serve a retry. Only what was done before the close stays done.
            reply = _retry_later(environ, e, "Service unavailable: the registry is closed in "
                                 "this worker; retry later", _RETRY_AFTER, logging.ERROR)
        except LockTimeout as e:
            # A live process holds the registry lock (stopped, stalled): not this request's
            # fault and not a server bug; nothing was half-written. Ask the client to retry.
            reply = _retry_later(environ, e, "Service unavailable: the registry is busy; retry "
                                 "later", _RETRY_AFTER, logging.WARNING)
        except SessionsFull as e:
            # A session another host minted that this host cannot take for its client now (every
            # session of the client here has a call in flight): it exists, so not 404. Retry.
            reply = _retry_later(environ, e, "Server busy: the session cannot be taken up here "
                                 f"now ({e})", e.retry_after)
        except TableFull as e:
            # A write the request needs found no room (/dev/shm filled since the registry was
            # created: ShmFull); nothing was written. Not the client's fault: retry later.
            reply = _retry_later(environ, e, "Service unavailable: the registry has no room "
                                 "left; retry later", _RETRY_AFTER, logging.ERROR)
        except RemoteUnavailable as e:
            # The cross-host layer gave no answer about a session minted elsewhere (or could
            # not store or deliver): it may well exist, so not 404 (a client takes that as its
            # session gone for good). Retry.
            reply = _retry_later(environ, e, "Service unavailable: the session store of other "
                                 f"hosts {e.cause}; retry later", e.retry_after)
        except SystemExit as e:
            # gunicorn stops this sync worker (worker timeout, shutdown) while the request waits
            # (for the registry lock, say): not served, nothing half-done, so a retry is safe;
            # escaping, this was gunicorn's HTML 500. (A tools/call answers its own, §5.)
            if not gunicorn_quits(environ):
                raise
            log.warning("%s %s: the worker is exiting (SystemExit %s); answered 503",
                        environ.get("REQUEST_METHOD"), environ.get("PATH_INFO"), e.code)
            reply = _error_reply(503, None, codes.SERVER_ERROR, "Service unavailable: the "
                                 "worker serving this request is exiting; retry",
                                 headers=[("Retry-After", _RETRY_AFTER)])
        except Exception:
            log.exception("internal error handling %s %s", environ.get("REQUEST_METHOD"),
                          environ.get("PATH_INFO"))
            reply = _error_reply(500, None, codes.INTERNAL_ERROR, "Internal error")
        self._release_leaked(environ, held)
        if reply is None:  # streamed: everything was written already
            return []
        ex = environ.get(PROGRESS_KEY)
        if isinstance(ex, _Exchange) and ex.committed:
            # Failed after a tools/call's SSE stream opened (gunicorn's quit in the middle of
            # writing its answer, say): the status line is out, so no reply can follow (a second
            # start_response is an error). End the connection: the client sees the stream cut.
            log.warning("%s %s: failed after its event stream began (HTTP %d not sendable); "
                        "the connection is ended", environ.get("REQUEST_METHOD"),
                        environ.get("PATH_INFO"), reply.status)
            _hang_up(environ)
            return []
        headers = [*reply.headers, ("Content-Length", str(len(reply.body)))]
        if reply.status != 204:
            for k, _ in reply.headers:
                if k == "Content-Type":
                    break
            else:
                headers.append(("Content-Type", "application/json"))  # an empty 202 too
        start_response(_STATUS.get(reply.status, f"{reply.status} Error"), headers)
        # a HEAD's reply has the headers of its GET's and no body (RFC 9110 §9.3.2)
        body = b"" if environ.get("REQUEST_METHOD") == "HEAD" else reply.body
        if reply.ends_connection or body_left_unread(environ, self.max_body_bytes):
            return EndingConnection(body, environ.get("gunicorn.socket"),
                                    environ.get("wsgi.input"))
        return [body] if body else []

    def _lock_depth(self) -> int:
        """This thread's depth in the registry lock (-1: no registry; its error is the
        request's to answer)."""
        try:
            return self._process_state().registry.lock.depth()
        except Exception:
            return -1

    def _release_leaked(self, environ: dict[str, Any], held: int) -> None:
        """No hold of the registry lock taken in a request outlives it: one left by an
        exception as its release began (a signal handler's) is ended here, down to ``held``
        (the depth at the request's start, :meth:`_lock_depth`), and logged."""
        st = self._state
        try:
            if held < 0 or st is None or not st.registry.lock.release_leaked(held):
                return
        except Exception:  # the registry closed meanwhile, say: the request is answered
            log.exception("%s %s: ending a hold of the registry lock left by the request "
                          "failed", environ.get("REQUEST_METHOD"), environ.get("PATH_INFO"))
            return
        log.error("%s %s: a hold of the registry lock outlived its block (an exception as its "
                  "release began: a signal handler's); released",
                  environ.get("REQUEST_METHOD"), environ.get("PATH_INFO"))

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

    # ------------------------------------------------------------------ POST

    def _post(self, environ: dict[str, Any], start_response: StartResponse,
              headers: RequestHeaders) -> _Reply | None:
        json_ok, sse_ok = accepts(headers.accept)
        body_or_reply = read_body(environ, headers, json_ok or sse_ok, self.max_body_bytes,
                                  self.body_timeout)
        if isinstance(body_or_reply, _Reply):
            return body_or_reply
        try:
            try:
                msg = jsonrpc.parse(jsonrpc.decode(body_or_reply))
                if type(msg) is Request:  # for a reply made without it (__call__'s 503s)
                    environ[_REPLY_ID_KEY] = msg.id
            except RpcError as e:
                if e.code == codes.INVALID_PARAMS and \
                        detect_without_body(headers) is Wire.MODERN:
                    # params is no object, so has no _meta: the 2026-07-28 ladder's first rung
                    # (400, "id": null), as for params without _meta (contract §6.2)
                    raise RpcError(codes.INVALID_PARAMS, "Invalid params: params._meta must "
                                   "be an object (params is not one)") from None
                raise
            wire = detect(msg, headers)
            if wire is Wire.MODERN:
                return self._modern(environ, start_response, headers, msg, json_ok, sse_ok)
            return self._legacy(environ, start_response, headers, msg, json_ok, sse_ok)
        except RpcError as e:
            if e.status == 200:  # a request that was read: its reply as the client accepts
                return _body_reply(200, e.body(), json_ok)  # (an SSE event when no JSON)
            return _error_reply(e.status, e.id, e.code, e.message, e.data)
