"""The ASGI half of :mod:`shmcancel.sdk`: :func:`asgi` and the layer inside the ``/mcp`` route.

The layer sits where the SDK's route endpoint was, inside the SDK's ``RequireAuthMiddleware``
when the server has auth, so that check has run before it on every path. For every POST it reads
the body itself, at most the SDK's ``max_request_body_size`` bytes (413 beyond), and hands it on
unchanged; it answers on its own only

- a 2025-era ``notifications/cancelled`` whose request is in flight in the caller's scope on any
  worker: recorded with ``cancel_if_in_flight`` (one lock hold), answered 202 after the same
  Origin/Host/Content-Type checks the SDK's transport makes (its own ``TransportSecurityMiddleware``
  with the server's settings) and its Accept rule. A notification for a request not in flight
  there, one that fails the Accept rule, or one without a session on a stateful server goes on to
  the SDK, which answers it as it always does (and, in the worker owning a stateful session, acts
  on it);
- a quota refusal (429) or a stalled registry (503 with ``Retry-After``) of such a notification.

On the 2026-07-28 wire, and on a stateless server, it also watches the connection: a client that
goes away before its response is complete stops the calls of that exchange (JSON responses
included). A stateful 2025-era exchange is not watched: its session outlives the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any

import pydantic_core
from mcp.server.streamable_http import CONTENT_TYPE_JSON

from .. import (
    CancellationLimitReached,
    InvalidRequestId,
    LockTimeout,
    ShmCancelError,
    TableFull,
    errors,
    principal,
)
from ..cancel import ids
from ._calls import (
    EXCHANGE_KEY,
    SESSION_HEADER,
    STOPPED_ANSWER_WAIT,
    Exchange,
    RequestCancelled,
    Tracker,
    _header,
    conn_of,
    modern_wire,
    process_cancellation,
    stop_calls_in_scope,
    stop_running_calls,
)
from ._routing import (
    EventTail,
    Router,
    end_event_stream,
    exit_at_request_limit,
    set_header,
    token_pid,
    worker_exiting,
)

__all__ = ["asgi"]

log = logging.getLogger("shmcancel.sdk")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

CANCELLED_METHOD = "notifications/cancelled"
RETRY_AFTER = "1"  # seconds, for a 503 on a stalled registry
MAX_ESCAPED = 64 * 1024  # bytes: the largest body with JSON escapes read for a cancellation
STOPPING = "the worker is stopping"  # the reason of the calls a worker's exit stops


def asgi(server: Any, *, route_sessions: bool = True, **options: Any) -> Any:
    """The ASGI app serving ``server`` (an ``mcp.server.mcpserver.MCPServer``) at its streamable
    HTTP path, with cross-worker cancellation installed (contract §9). ``options`` go to
    ``server.streamable_http_app()`` (``stateless_http``, ``json_response``, ``transport_security``,
    ``max_request_body_size``, ...). Installs one :class:`Tracker` in ``server.middleware`` (once,
    however often it is called) and wraps the ``/mcp`` route's endpoint. A stateful server routes
    each session's requests to the worker holding it (:mod:`shmcancel.sdk._routing`) unless
    ``route_sessions=False`` (one worker, or a proxy that keeps sessions sticky)."""
    app = server.streamable_http_app(**options)
    stateful = not options.get("stateless_http", False)
    chain = server.middleware
    for i, mw in enumerate(chain):
        if isinstance(mw, Tracker):
            chain[i] = Tracker(stateful)
            break
    else:
        chain.append(Tracker(stateful))
    manager = server.session_manager
    path = options.get("streamable_http_path", "/mcp")
    router = Router(app) if stateful and route_sessions else None
    wrapped = False
    for route in app.routes:
        if getattr(route, "path", None) == path and hasattr(route, "app"):
            holder = route
            if _is_auth(route.app):  # inside the SDK's auth check: it runs first, on every path
                holder = route.app
            holder.app = Layer(holder.app, manager, stateful, router)
            wrapped = True
    if not wrapped:  # pragma: no cover - the SDK always makes that route
        raise RuntimeError(f"shmcancel.sdk.asgi: no route {path!r} in the SDK's app")
    _with_shutdown(app, router)
    return app


def _is_auth(endpoint: Any) -> bool:
    """Whether ``endpoint`` is the SDK's ``RequireAuthMiddleware`` (the route of a server with
    auth): the layer goes inside it, so that no request reaches the layer unauthenticated."""
    try:
        from mcp.server.auth.middleware.bearer_auth import RequireAuthMiddleware
    except ImportError:  # pragma: no cover - every supported SDK has it
        return False
    return isinstance(endpoint, RequireAuthMiddleware)


def _with_shutdown(app: Any, router: Router | None) -> None:
    """Around the SDK's own lifespan: make the worker's request limit an exit that its streams
    see (:func:`exit_at_request_limit`), start the worker's socket server (if it routes
    sessions) and, at the shutdown, stop the calls still running and wait (bounded) for their
    answers (:func:`stop_running_calls`), then the socket server (removing the socket), all
    before the SDK's session manager is torn down."""
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a: Any) -> AsyncIterator[Any]:
        async with inner(a) as state:
            exit_at_request_limit()
            if router is not None:
                await router.ensure()
            try:
                yield state
            finally:
                try:
                    if n := await stop_running_calls(STOPPING):
                        log.info("stopped %d call(s) still running at the worker's shutdown", n)
                    await _streams_ended(STOPPED_ANSWER_WAIT)
                finally:
                    if router is not None:
                        router.close()

    app.router.lifespan_context = lifespan


def _json_error(status: int, code: int, message: str,
                headers: list[tuple[bytes, bytes]] | None = None) -> tuple[int, bytes, list]:
    body = json.dumps({"jsonrpc": "2.0", "id": None,
                       "error": {"code": code, "message": message}}).encode()
    return status, body, [(b"content-type", b"application/json"), *(headers or [])]


def _invalid_request_id() -> tuple[int, bytes, list]:
    """A ``notifications/cancelled`` naming no possible request: 400 ``-32602`` (§6.1)."""
    return _json_error(400, errors.INVALID_PARAMS, 'Invalid params: "requestId" must be an '
                       f"integer or a string of at most {ids.MAX_ID_BYTES} bytes")


async def _respond(send: Send, status: int, body: bytes = b"",
                   headers: list[tuple[bytes, bytes]] | None = None) -> None:
    hdrs = [*(headers or []), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class Layer:
    """The ASGI layer in front of the SDK's ``/mcp`` endpoint (see the module docstring)."""

    def __init__(self, app: ASGIApp, manager: Any, stateful: bool,
                 router: Router | None = None) -> None:
        self.app = app
        self.manager = manager
        self.stateful = stateful
        self.router = router
        self.max_body = int(getattr(manager, "max_request_body_size", 4 * 1024 * 1024))
        # the SDK replays a stream only from its event store; without one it answers a GET
        # naming a Last-Event-ID with no response at all (uvicorn's 500), mcp 2.3.0
        self.resumable = stateful and getattr(manager, "event_store", None) is not None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        owner: str | None = None
        router = self.router
        modern = modern_wire(scope)
        if router is not None:
            await router.ensure()
            # The 2026-07-28 wire has no sessions: the SDK ignores an Mcp-Session-Id there, so
            # it neither routes the request (a gone worker's id would be a 404; a forward would
            # not see its client leave before a JSON answer) nor is rewritten.
            if not modern:
                owner = router.route(scope)
            if owner is None:  # served here: the session ids it hands out name this worker
                send = _tagging(send, router)
        if scope.get("method") != "POST":
            if owner is not None and router is not None:
                await router.forward(owner, scope, None, receive, send)
            elif scope.get("method") == "DELETE" and self.stateful:
                await self._delete(scope, receive, send)
            elif scope.get("method") == "GET" and not self.resumable:
                # nothing to resume from: the stream opens afresh, as a server that does not
                # resume answers such a GET (the MCP spec's resumability is optional)
                set_header(scope, b"last-event-id", None)
                await self.app(scope, receive, send)
            else:
                await self.app(scope, receive, send)
            return
        body = await self._read_body(scope, receive, send)
        if body is None:
            return
        if owner is not None and router is not None:
            # a cancel is answered here from the registry (no hop); anything else goes to the
            # owner, as does a cancel whose id names no worker (answered 404 there, as any
            # request of a session nobody holds: it used to be answered 202 here)
            if (modern or not _may_cancel(body) or not router.names_worker(owner)
                    or not await self._cancel(router.with_sdk_id(scope), body, send,
                                              local=False, owner=owner)):
                await router.forward(owner, scope, body, receive, send)
            return
        if (not modern and _may_cancel(body)
                and await self._cancel(scope, body, send, local=True)):
            return
        if modern or not self.stateful:  # an exchange nobody can resume: leaving abandons it
            await self._watched(scope, body, receive, send)
            return
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        exchange = Exchange()  # not watched: its session outlives the connection
        scope[EXCHANGE_KEY] = exchange
        ending = _exchange_send(send, exchange, body)
        try:
            await self.app(scope, replay, ending.outer)
            await ending.finish()
        finally:
            exchange.answered.set()

    async def _delete(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The SDK ends the session; once it said so (2xx), every call still in flight in it is
        cancelled in the registry too (contract §6.1). The SDK cancels the handlers' tasks, but
        a sync tool's thread runs on: this is what its ``raise_if_cancelled()`` sees."""
        status = 0

        async def tx(message: Message) -> None:
            nonlocal status
            if message.get("type") == "http.response.start":
                status = int(message.get("status", 0))
            await send(message)

        await self.app(scope, receive, tx)
        c = process_cancellation()
        conn = conn_of(scope, True)
        if c is None or not 200 <= status < 300 or "shmcancel.session_id" not in conn:
            return
        sc = principal.scope(conn)
        try:
            await asyncio.to_thread(c.cancel_scope, sc, "session deleted")
        except ShmCancelError as e:  # a stalled lock: no rows; its calls run here (the owner)
            n = stop_calls_in_scope(sc, "session deleted")
            log.warning("shmcancel.sdk: the deleted session's cancellations could not be "
                        "recorded (%s); its %d call(s) in this worker were stopped here", e, n)

    async def _read_body(self, scope: Scope, receive: Receive, send: Send) -> bytes | None:
        """The whole body, or ``None`` when it was refused (413, answered) or the client left."""
        for k, v in scope.get("headers") or ():
            if k == b"content-length":
                try:
                    declared = int(v)
                except ValueError:
                    declared = -1
                if declared > self.max_body:
                    await _respond(send, *_too_large(self.max_body))
                    return None
        chunks: list[bytes] = []
        size = 0
        while True:
            msg = await receive()
            if msg.get("type") == "http.disconnect":
                return None
            chunk = msg.get("body") or b""
            size += len(chunk)
            if size > self.max_body:
                await _respond(send, *_too_large(self.max_body))
                return None
            chunks.append(chunk)
            if not msg.get("more_body", False):
                return b"".join(chunks)

    async def _cancel(self, scope: Scope, body: bytes, send: Send, *, local: bool,
                      owner: str | None = None) -> bool:
        """Answer a ``notifications/cancelled`` whose request is in flight in the caller's scope.
        Returns ``False`` (nothing sent) for anything else: the SDK answers it. ``owner``: the
        token of the worker the session id names, when not this one (the call must run
        there: a session's calls run in the worker holding it)."""
        try:
            # The SDK's own parser: a body it refuses (a lone surrogate escape, say, which
            # json.loads takes) is its 400, never a cancel answered here.
            msg = pydantic_core.from_json(body)
        except (ValueError, UnicodeDecodeError, RecursionError):  # the SDK answers it (400)
            return False
        if (not isinstance(msg, dict) or msg.get("method") != CANCELLED_METHOD or "id" in msg
                or msg.get("jsonrpc") != "2.0" or not isinstance(msg.get("params"), dict)):
            return False
        params = msg["params"]
        rid = params.get("requestId")
        if rid is None:
            return False  # nothing named to cancel: the SDK answers it (202)
        c = process_cancellation()
        if c is None:
            return False
        if self.stateful and not _header(scope, SESSION_HEADER):
            return False  # the SDK refuses it (400): no session, no scope to cancel in
        if not self._accepts(scope):
            return False  # the SDK refuses it (406)
        if not _json_media_type(scope):
            return False  # the SDK refuses it (415)
        refused = await self._checks(scope)
        if refused is not None:
            status, rbody, headers = refused
            await _respond(send, status, rbody, headers)
            return True
        if self.stateful and not self._creator_asks(scope, local):
            return False  # the SDK answers it: 404, or (another worker's session) forwarded
        if isinstance(rid, bool) or not isinstance(rid, int | str):
            # a float, a bool, an array, an object: no request has that id (contract §6.1), as
            # the WSGI transport answers it (the SDK answers 202 and records nothing)
            await _respond(send, *_invalid_request_id())
            return True
        where = principal.scope(conn_of(scope, self.stateful))
        if owner is not None:
            # A session id pairing another worker's token with this SDK id names no session
            # (the SDK ids are the workers' own): it is not the one running the call. Left to
            # the forward, whose worker answers 404 as for any request of that id.
            pids = c.in_flight_pids(rid, where)
            if pids is not None and token_pid(owner) not in pids:
                return False
        reason = params.get("reason")  # any JSON value: cancel() makes a non-str its repr
        try:
            # In a thread: a stopped lock holder makes this wait up to lock_timeout, which on
            # the event loop would stall every request of the worker.
            recorded = await asyncio.to_thread(
                c.cancel_if_in_flight, rid, reason, where)
        except CancellationLimitReached as e:
            await _respond(send, *_json_error(429, errors.SERVER_ERROR, str(e)))
            return True
        except LockTimeout:
            await _respond(send, *_json_error(503, errors.SERVER_ERROR, "registry busy",
                                              [(b"retry-after", RETRY_AFTER.encode())]))
            return True
        except TableFull as e:  # no room for the row (/dev/shm filled since: ShmFull): the
            # SDK would answer 202 and record nothing, a cancel lost; nothing was written
            log.error("shmcancel.sdk: a cancellation could not be recorded: %s", e)
            await _respond(send, *_json_error(503, errors.SERVER_ERROR,
                                              "Service unavailable: the registry has no room "
                                              "left; retry later",
                                              [(b"retry-after", RETRY_AFTER.encode())]))
            return True
        except InvalidRequestId:  # a string over MAX_ID_BYTES: no call runs with it (Tracker)
            await _respond(send, *_invalid_request_id())
            return True
        except ShmCancelError:  # the registry closed in this worker, say: the SDK answers it
            return False
        if not recorded:
            return False
        await _respond(send, 202)
        return True

    def _creator_asks(self, scope: Scope, local: bool) -> bool:
        """Whether the caller presents the credential that created the session, as the SDK's
        session manager checks it (a session is used only with that credential: else 404).
        Only the worker holding the session knows its creator: elsewhere a cancel is answered
        here only on a server without authentication (no ``user`` in the scope: every session
        is anonymous), else forwarded there (``False``): an anonymous caller may not cancel in
        an authenticated client's session (the SDK answers it 404), which this worker cannot
        tell from an anonymous one."""
        user = scope.get("user")
        authed = bool(getattr(user, "is_authenticated", False)) and hasattr(user, "access_token")
        owners = getattr(self.manager, "_session_owners", None)
        live = getattr(self.manager, "_server_instances", None)
        if not local or not isinstance(owners, dict) or not isinstance(live, dict):
            return "user" not in scope
        sid = _header(scope, SESSION_HEADER)
        if sid not in live:
            return False
        if not authed:
            return owners.get(sid) is None
        from mcp.server.auth.middleware.bearer_auth import authorization_context

        return bool(authorization_context(user) == owners.get(sid))  # type: ignore[arg-type]

    def _accepts(self, scope: Scope) -> bool:
        """The SDK transport's Accept rule for a POST: ``application/json``, and with SSE
        responses ``text/event-stream`` too (wildcards as the SDK reads them)."""
        from mcp.server.streamable_http import check_accept_headers
        from starlette.requests import Request

        has_json, has_sse = check_accept_headers(Request(scope))
        return has_json and (has_sse or bool(getattr(self.manager, "json_response", False)))

    async def _checks(self, scope: Scope) -> tuple[int, bytes, list] | None:
        """The SDK transport's own Origin/Host and Content-Type checks, with the server's
        settings; the refusal as ``(status, body, headers)`` or ``None``."""
        from mcp.server.transport_security import TransportSecurityMiddleware
        from starlette.requests import Request

        checks = TransportSecurityMiddleware(self.manager.security_settings)
        refusal = await checks.validate_request(Request(scope), is_post=True)
        if refusal is None:
            return None
        hdrs = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in refusal.headers.items()
                if k.lower() != "content-length"]
        return refusal.status_code, bytes(refusal.body), hdrs

    async def _watched(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        """Serve an exchange, stopping its calls if the client leaves before the response is
        complete, or when the worker's exit ends its event stream (:func:`_ending_at_exit`)."""
        exchange = Exchange()
        scope[EXCHANGE_KEY] = exchange
        gone = asyncio.Event()
        complete = False
        delivered = False

        async def watch() -> None:
            while (await receive()).get("type") != "http.disconnect":
                pass
            gone.set()
            if not complete:
                exchange.disconnected()

        async def replay() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def tx(message: Message) -> None:
            nonlocal complete
            if message.get("type") == "http.response.body" and not message.get("more_body"):
                complete = True
            await send(message)

        watcher = asyncio.get_running_loop().create_task(watch())
        ending = _exchange_send(tx, exchange, body)
        try:
            await self.app(scope, replay, ending.outer)
            await ending.finish()
        finally:
            exchange.answered.set()
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await watcher


def _json_media_type(scope: Scope) -> bool:
    """The SDK transport's Content-Type rule for a POST (after its Origin/Host check, which
    looks at the prefix only): the media type is ``application/json`` itself, as written."""
    ct = _header(scope, b"content-type") or ""
    return any(p.strip() == CONTENT_TYPE_JSON for p in ct.split(";")[0].split(","))


def _may_cancel(body: bytes) -> bool:
    """Whether ``body`` may be a ``notifications/cancelled`` (then it is parsed): the method
    name as written, or any JSON escape in a body small enough to parse twice (a name can be
    spelled with escapes, ``notifications\\/cancelled``); a larger body with escapes when the
    name appears once its ``\\/`` and ``\\u00XX`` escapes are read (a long reason must not
    hide the cancel: PHP's json_encode escapes every ``/``)."""
    name = CANCELLED_METHOD.encode()
    if name in body:
        return True
    if b"\\" not in body:
        return False
    if len(body) <= MAX_ESCAPED:
        return True
    if b"\\/" not in body and b"\\u00" not in body:  # other escapes spell none of its characters
        return False
    for escape, char in _ESCAPES:
        if escape in body:
            body = body.replace(escape, char)
    return name in body


# The escapes that can spell the method's characters: ``\/`` and ``\u00XX`` (either case of
# hex). Replaced as bytes (C loops, no callback per escape, whatever the body's size); read
# everywhere, even after an escaped backslash, they can only add matches: a filter.
_ESCAPES = [(b"\\/", b"/")] + [
    (b"\\u00" + spelling.encode(), bytes([c]))
    for c in sorted(set(CANCELLED_METHOD.encode()))
    for spelling in {f"{c:02x}", f"{c:02X}"}]


def _exchange_send(send: Send, exchange: Exchange, body: bytes) -> _StreamEnd:
    """``send`` for ``exchange``, answering the POST ``body``: :func:`_ending_at_exit`'s, marked
    answered by :func:`_answering`. Its ``finish()`` is awaited once the app returned."""
    ending = _ending_at_exit(send, exchange, body)
    ending.outer = _answering(ending, exchange)
    return ending


def _answering(send: Send, exchange: Exchange) -> Send:
    """``send``, marking ``exchange`` answered once its response's last part is sent."""
    async def answering(message: Message) -> None:
        await send(message)
        if message.get("type") == "http.response.body" and not message.get("more_body"):
            exchange.answered.set()

    return answering


# the exchanges whose event streams this worker's exit is ending (_StreamEnd.end): the
# lifespan shutdown awaits them (bounded) before the worker goes
_ending: set[Exchange] = set()


class _StreamEnd:
    """``send`` for an exchange answering a POST (:func:`_ending_at_exit`). ``outer``: what the
    app is given (this, or a wrapper of it)."""

    def __init__(self, send: Send, exchange: Exchange, body: bytes) -> None:
        self.send = send
        self.outer: Send = self
        self.exchange = exchange
        self.body = body
        self.sse = False
        self.complete = False  # the response's last part was sent
        self.tail = EventTail()  # the stream's bytes sent so far (uvicorn wrote them whole)
        self.pending = b""  # bytes whose send has not returned (a cancelled one wrote nothing)

    async def __call__(self, message: Message) -> None:
        kind = message.get("type")
        if kind == "http.response.start":
            self.sse = any(k.lower() == b"content-type"
                           and bytes(v).lower().startswith(b"text/event-stream")
                           for k, v in message.get("headers") or ())
        elif kind == "http.response.body" and self.sse:
            chunk = bytes(message.get("body") or b"")
            if not message.get("more_body", False) and worker_exiting():
                self.pending = chunk
                await self.end()
                return
            # fed once sent: a send cancelled while it waits for the client (uvicorn waits
            # for the drain before it writes) wrote nothing, and is still pending (it may be
            # the answer: end() writes it first)
            self.pending = chunk
            await self.send(message)
            self.pending = b""
            self.tail.feed(chunk)
            self.complete = not message.get("more_body", False)
            return
        await self.send(message)

    async def finish(self) -> None:
        """After the app returned: an event stream it left unended while this worker exits
        (the exit cancelled sse_starlette in a send that waited for a slow client: it then
        sends no end) ends as :meth:`end` ends it."""
        if self.sse and not self.complete and not self.exchange.gone and worker_exiting():
            await self.end()

    async def end(self) -> None:
        """Stop the exchange's calls and end its stream as :func:`end_event_stream` ends it:
        with the request's ``-32800`` error, as every call the exit stops, unless it carried
        the answer already (a part the app sent that was not written yet, the answer perhaps,
        is written first). Within :data:`STOPPED_ANSWER_WAIT` seconds: a client that does not
        read cannot hold the worker on it (the send given up wrote nothing; uvicorn then
        drops the connection)."""
        self.exchange.stop(STOPPING)
        error = RequestCancelled(STOPPING).error.model_dump(mode="json", exclude_none=True)
        _ending.add(self.exchange)
        try:
            async with asyncio.timeout(STOPPED_ANSWER_WAIT):
                if self.pending:  # first what the app sent that was not written
                    await self.send({"type": "http.response.body", "body": self.pending,
                                     "more_body": True})
                    self.tail.feed(self.pending)
                    self.pending = b""
                await end_event_stream(self.send, self.tail, self.body, error)
        except TimeoutError:
            log.warning("shmcancel.sdk: a stream ended at the worker's exit was not read "
                        "within %g s: cut", STOPPED_ANSWER_WAIT)
        finally:
            self.complete = True
            _ending.discard(self.exchange)
            self.exchange.answered.set()


def _ending_at_exit(send: Send, exchange: Exchange, body: bytes) -> _StreamEnd:
    """``send`` for an exchange answering a POST. An event stream the SDK ends while this worker
    exits (sse_starlette ends them all as the exit begins, stateful or stateless; the lifespan
    shutdown stops the calls only later: their answers went nowhere, and the client's stream
    ended with no answer), or leaves unended (cancelled in a send: :meth:`_StreamEnd.finish`),
    stops the exchange's calls then, and ends as :func:`end_event_stream` ends it: with the
    request's ``-32800`` error, as every call the exit stops, unless it carried the answer
    already (a 2026-07-28 stream, which the SDK writes itself, ends only with its answer)."""
    return _StreamEnd(send, exchange, body)


async def _streams_ended(wait: float) -> None:
    """Wait up to ``wait`` seconds for the streams this worker's exit is ending
    (:meth:`_StreamEnd.end`): a forwarded one is served by the socket server, whose requests
    the main server's drain does not wait for."""
    waits = [asyncio.ensure_future(x.answered.wait()) for x in _ending]
    if waits:
        _, late = await asyncio.wait(waits, timeout=wait)
        for w in late:
            w.cancel()


def _tagging(send: Send, router: Router) -> Send:
    async def tagged(message: Message) -> None:
        router.tag(message)
        await send(message)

    return tagged


def _too_large(limit: int) -> tuple[int, bytes, list]:
    return _json_error(413, errors.INVALID_REQUEST, f"request body larger than {limit} bytes")
