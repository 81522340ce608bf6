"""The 2025-era wire: ``initialize`` (minting a session), ``Mcp-Session-Id`` checked against the
shared session table on every other message, ``ping``, ``notifications/cancelled`` (contract §6.1),
and ``DELETE`` ending a session (cancelling its calls in flight).
"""

from __future__ import annotations

import logging
from typing import Any

from ..cancel import ids
from ..exceptions import (
    CancellationLimitReached,
    InvalidRequestId,
    LockTimeout,
    RemoteUnavailable,
    ShmCancelError,
)
from ..shm.lanes import fence
from . import codes, principal, remote, wake
from .base import _ProcessState
from .call import CallLifecycle
from .jsonrpc import Notification, Request, Response, RpcError
from .principal import PRINCIPAL_KEY, REMOTE_ADDR_KEY, SESSION_KEY
from .reply import StartResponse, _error_reply, _Reply
from .sessions import SessionsFull
from .stop import gunicorn_quits
from .wire import (
    SUPPORTED_VERSIONS,
    RequestHeaders,
    Wire,
    detect_without_body,
    negotiate_legacy_version,
    valid_session_id,
)

log = logging.getLogger("shmcancel.server")  # one logger for the whole app, as before


class LegacyWire(CallLifecycle):
    """The 2025-era request handling; a mixin of :class:`~shmcancel.mcp.server.McpServer`."""

    # ------------------------------------------------------------------ DELETE

    def _delete(self, environ: dict[str, Any], headers: RequestHeaders) -> _Reply:
        wire = detect_without_body(headers)
        if wire is None:
            e = _unsupported_header(headers.protocol_version or "")
            return _error_reply(e.status, None, e.code, e.message, e.data)
        if wire is Wire.MODERN or not self.sessions:
            why = "the 2026-07-28 wire has" if self.sessions else "this server keeps"
            return _error_reply(405, None, codes.INVALID_REQUEST,
                                f"Method Not Allowed: {why} no sessions to end",
                                headers=[("Allow", "POST")])
        sid = headers.session_id
        bad = _session_error(sid, None)
        if bad is not None:
            return _error_reply(bad.status, None, bad.code, bad.message)
        st = self._process_state()
        session = st.sessions.get(sid)
        if session is None:
            session = _adopt_session(st, sid, environ)
        if session is None or not _yours(st, session, environ):
            return _error_reply(404, None, codes.INVALID_REQUEST, "Session not found")
        environ[SESSION_KEY] = sid
        c = st.cancellation
        scope = c.scope(environ)
        reason = "session deleted"

        def end() -> bool:  # the session, here and on other hosts (their calls, their copies)
            if not st.sessions.delete(sid):  # type: ignore[arg-type]
                return False
            if (rb := remote.current()) is not None and sid:
                rb.cancel_scope(scope, reason)
                rb.delete_session(sid)
            return True

        # Its calls are cancelled before the session goes and after (one beginning later finds
        # no session: _call_tracked); each reported once, by the DELETE that ends it. A stall
        # (LockTimeout: 503 "retry later") leaves no call in flight before the DELETE running.
        keys = c.cancel_scope_around(scope, reason, end, reported=[],
                                     ring=lambda: wake.ring(st.registry.name))
        if keys is None:  # another DELETE ended it meanwhile
            return _error_reply(404, None, codes.INVALID_REQUEST, "Session not found")
        if keys:
            log.info("session deleted: cancelled %d request(s) in flight", len(keys))
        return _Reply(204)

    # ------------------------------------------------------------------ 2025-era

    def _legacy(self, environ: dict[str, Any], start_response: StartResponse,
                headers: RequestHeaders, msg: Request | Notification | Response,
                json_ok: bool, sse_ok: bool) -> _Reply | None:
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
            if session is None:
                session = _adopt_session(st, sid, environ)  # minted on another host
            if session is not None and not _yours(st, session, environ):
                session = None
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
            if (rb := remote.current()) is not None:  # other hosts keep finding it in use
                rb.keep_session(sid, _client_of(environ))  # type: ignore[arg-type]
        else:
            environ.pop(SESSION_KEY, None)
        if isinstance(msg, Response):
            # a reply to a server request; this server sends none: dropped. After the session
            # check, as every message but initialize (contract §6.1: unknown session → 404).
            return _Reply(202)
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
            _end_call(st, call, environ)

    def _call_tracked(self, environ: dict[str, Any], handle: Any) -> bool:
        """A call's session was checked before it was tracked: a DELETE landing in between
        (another worker) found nothing in flight to cancel. Once tracked, a DELETE sees the
        call; one that came before left no session row, so look again (lock-free): gone, the
        call is cancelled and ``True`` returned (its tool is not run)."""
        sid = environ.get(SESSION_KEY)
        if not self.sessions or not isinstance(sid, str):
            return False
        # The call's in-flight row (a lane store, no lock) must be visible before the session
        # is read: a DELETE removes the session, then (past its lock's barrier) reads the rows
        # in flight. With a barrier on both sides one of them sees the other.
        fence()
        try:
            gone = self._process_state().sessions.get(sid) is None
        except ShmCancelError:  # the store could not tell (a lock timeout): run the call
            return False
        if gone:
            handle.cancel_local("session deleted")
        return gone

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
            client = _client_of(environ)
            st = self._process_state()
            try:
                session = st.sessions.create(version, client)
            except SessionsFull as e:
                # a request the client could read: 200 with its error (contract §5), which an
                # SDK client raises as such, not a transport failure; Retry-After says when
                return _error_reply(200, msg.id, codes.SERVER_ERROR,
                                    f"Server busy: no session available ({e})",
                                    headers=[("Retry-After", str(e.retry_after))])
            extra.append(("Mcp-Session-Id", session.id))
            if (rb := remote.current()) is not None:
                try:
                    rb.publish_session(session.id, version, client, minted=True)
                except RemoteUnavailable:
                    # Redis refused to store it (full): other hosts would answer it 404. Not
                    # handed out, so not kept here either: 503, the client retries.
                    st.sessions.delete(session.id)
                    raise
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
            if c.cancel_if_in_flight(rid, reason, scope):
                # its tool may be waiting: wake the processes running it (all when unknown)
                wake.ring(st.registry.name, c.in_flight_pids(rid, scope))
            elif (rb := remote.current()) is not None:
                rb.cancel(rid, reason, scope)  # running on another host? the remote delivers it
        except CancellationLimitReached:
            return _error_reply(429, None, codes.SERVER_ERROR,
                                "Too many cancellations recorded for this client")
        except InvalidRequestId:
            return _error_reply(400, None, codes.INVALID_PARAMS, 'Invalid params: "requestId"')
        return _Reply(202)


def _end_call(st: _ProcessState, call: Any, environ: dict[str, Any]) -> None:
    """End a session's call once its tool has run and its answer is made (or streamed).
    ``end_call`` may wait for the registry lock (the session's touch is due); gunicorn's quit or
    abort landing in that wait (``SystemExit`` in a ``sync`` worker) must not replace the
    call's answer: escaping, it was answered 503 "retry is safe" for a tool that ran, or, on an
    SSE stream already open, ``start_response`` was called a second time. gunicorn has set the
    worker not alive, so it exits once this request is answered (as for a stop inside the tool,
    :mod:`.call`); the row goes with the process (a dead owner's)."""
    try:
        st.sessions.end_call(call)
    except SystemExit as e:
        if not gunicorn_quits(environ):
            raise
        log.warning("a session call's end was cut short: gunicorn is stopping its worker "
                    "(SystemExit %s); the call keeps its answer", e.code)


def _client_of(environ: dict[str, Any]) -> str:
    """The client a request counts against (its principal, else its address bucket), as
    ``initialize`` counts a session it mints."""
    return principal.scope({k: environ[k] for k in (PRINCIPAL_KEY, REMOTE_ADDR_KEY)
                            if k in environ})


def _yours(st: _ProcessState, session: Any, environ: dict[str, Any]) -> bool:
    """Whether the caller may use ``session``: a request under a principal may use only a
    session minted for that principal, or one minted anonymously from its own address (the
    same client, authenticated since); a request without one only a session minted
    anonymously (from any address: an anonymous client's address bucket moves with its
    address). Another's is answered as for a session it does not know, 404: a leaked id is no
    key to someone else's session and calls."""
    mine = _clients_of(environ)
    if mine is None:
        return not st.sessions.minted_for_principal(session)
    digest = st.sessions.client_digest
    return any(session.client == digest(client) for client in mine)


def _clients_of(environ: dict[str, Any]) -> tuple[str, ...] | None:
    """The clients whose sessions a request under a principal may use (its principal's, its
    address bucket's); None for a request without one (any anonymous client's)."""
    if type(principal.id(environ)) is not str:
        return None
    anonymous = {k: environ[k] for k in (REMOTE_ADDR_KEY,) if k in environ}
    return _client_of(environ), principal.scope(anonymous)


def _anonymous(client: str) -> bool:
    """Whether a session published for ``client`` (a scope) was minted without a principal."""
    return not principal.of_principal(client)


def _session_error(sid: str | None, rid: int | str | None) -> RpcError | None:
    if sid is None:
        return RpcError(codes.INVALID_REQUEST, "Bad Request: missing Mcp-Session-Id header",
                        id=rid, status=400)
    if not valid_session_id(sid):  # names no session: unknown, as contract §5 answers those
        return RpcError(codes.INVALID_REQUEST, "Session not found (a malformed Mcp-Session-Id)",
                        id=rid, status=404)
    return None


def _unsupported_header(requested: str) -> RpcError:
    shown = requested if len(requested) <= 128 else requested[:128] + "..."
    return RpcError(codes.UNSUPPORTED_PROTOCOL_VERSION,
                    f"Unsupported protocol version: {shown!r}",
                    data={"supported": list(SUPPORTED_VERSIONS), "requested": shown})


def _adopt_session(st: _ProcessState, sid: str | None, environ: dict[str, Any]) -> Any:
    """A session another host minted (found through the remote), stored here under the same id
    and counted against the same client; None when there is none. Raises ``RemoteUnavailable``
    when the remote gave no answer, ``LockTimeout`` when the registry lock was held too long and
    ``SessionsFull`` when this host cannot take it for its client now (every session of the
    client here has a call in flight, or the table is full of other clients'): the session may
    well exist (for ``SessionsFull`` it does), so the front end answers 503 with
    ``Retry-After``, not 404. A session the caller may not use (:func:`_yours`) is None
    before it is adopted or renewed in Redis."""
    rb = remote.current()
    if rb is None or sid is None or not valid_session_id(sid):
        return None
    mine = _clients_of(environ)
    got = rb.lookup_session(sid, _anonymous if mine is None else mine.__contains__)
    if got is None:
        return None
    try:
        session = st.sessions.create(got[0], got[1], session_id=sid)
    except (LockTimeout, SessionsFull):
        raise  # not adopted *now*: a 404 would tell the client its session is gone for good
    except ShmCancelError:
        return None
    # The lookup listed this worker among the holders before the copy was here: an end told
    # to it meanwhile found nothing to end. The bridge marks a session ended before it ends
    # the copy, and this looks after the insert: one of the two sees the other.
    if rb.session_ended(sid):
        st.sessions.delete(sid)
        return None
    return session
