"""The server-middleware half of :mod:`shmcancel.sdk`: tracking each ``tools/call`` and stopping it.

Invariants:

- every ``tools/call`` that reaches the SDK's handler chain holds one :class:`RequestHandle` from
  before its handler starts until after it ends (``end()`` in a ``finally``), so the registry
  shows it in flight exactly while it runs and holds nothing of it afterwards;
- a call is stopped only when *its own* handle says it is cancelled (a row in its scope newer than
  its start, or a local cancel of this very call on disconnect); it is then answered ``-32800``;
- the poller runs on the worker's event loop, never blocks it (the handle's poll is a lock-free
  read of shared memory), and exits when no call is running.
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any, TypeVar

import anyio
from mcp.shared.exceptions import MCPError
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS

from .. import Cancellation, Registry, RequestHandle, errors, principal
from ..cancel import ids

__all__ = ["RequestCancelled", "cancelled", "current_handle", "raise_if_cancelled"]

log = logging.getLogger("shmcancel.sdk")

#: Seconds between two looks of the per-worker poller at the running calls' handles.
POLL_INTERVAL = 0.002
#: Seconds the worker's shutdown waits for the calls it stopped to be answered (their HTTP
#: responses sent) before the SDK's session manager is torn down, which answers a JSON response
#: still waiting for its call HTTP 500 ``-32603``: a tool that polls for cancellation (<= 10 ms)
#: is answered well within it.
STOPPED_ANSWER_WAIT = 2.0
SESSION_HEADER = b"mcp-session-id"
VERSION_HEADER = b"mcp-protocol-version"

_T = TypeVar("_T")

_current: contextvars.ContextVar[RequestHandle | None] = contextvars.ContextVar(
    "shmcancel_sdk_handle", default=None)


class RequestCancelled(MCPError):
    """Raised by :func:`raise_if_cancelled`: an ``MCPError`` with code ``-32800``, which the SDK
    passes through its tool layer untouched and answers as a JSON-RPC error."""

    def __init__(self, reason: str | None = None) -> None:
        super().__init__(errors.REQUEST_CANCELLED, "Request cancelled",
                         {"reason": reason} if reason else None)


def current_handle() -> RequestHandle | None:
    """The :class:`~shmcancel.RequestHandle` of the ``tools/call`` running in this context (the
    handler task, or the worker thread of a sync tool: anyio copies the context), else ``None``."""
    return _current.get()


def cancelled() -> bool:
    """Whether the current tool call was cancelled (by a ``notifications/cancelled`` reaching any
    worker, or by its client disconnecting on the 2026-07-28 wire). ``False`` outside a call.
    Lock-free; never raises; safe from a sync tool's thread."""
    h = _current.get()
    return h is not None and h.cancelled()


def raise_if_cancelled() -> None:
    """Raise :class:`RequestCancelled` when :func:`cancelled` is true (what a sync tool calls in its
    loop)."""
    h = _current.get()
    if h is not None and h.cancelled():
        raise RequestCancelled(h.reason())


# --- the process's Cancellation ----------------------------------------------------------------

_lock = threading.Lock()
_cached: tuple[int, Cancellation | None] | None = None
_warned = False


def process_cancellation() -> Cancellation | None:
    """The :class:`~shmcancel.Cancellation` over this worker's registry: the one the gunicorn hooks
    attached (``shmcancel.gunicorn.registry()``), else the registry named by ``SHMCANCEL_REGISTRY``
    (attached once per process). ``None`` when there is none: calls then run untracked (logged
    once per process)."""
    global _cached, _warned
    pid = os.getpid()
    cached = _cached
    if cached is not None and cached[0] == pid and cached[1] is not None:
        return cached[1]
    with _lock:
        from .. import gunicorn as hooks  # the hooks module imports nothing heavy

        reg: Any = hooks.registry()
        if reg is None:
            name = os.environ.get("SHMCANCEL_REGISTRY")
            if name:
                try:
                    reg = Registry.attach(name)
                except Exception as e:
                    if not _warned:
                        _warned = True
                        log.warning("shmcancel.sdk: cannot attach registry %r: %s; tool calls "
                                    "run uncancellable", name, e)
        c = Cancellation(reg) if reg is not None else None
        if c is None and not _warned:
            _warned = True
            log.warning("shmcancel.sdk: no shmcancel registry in this process (use the "
                        "shmcancel.gunicorn hooks or set SHMCANCEL_REGISTRY); tool calls run "
                        "uncancellable")
        _cached = (pid, c)
        return c


# --- scope -----------------------------------------------------------------------------------

def _header(scope: Mapping[str, Any], name: bytes) -> str | None:
    for k, v in scope.get("headers") or ():
        if k == name:
            return bytes(v).decode("latin-1")
    return None


def modern_wire(scope: Mapping[str, Any]) -> bool:
    """True when the request is on the 2026-07-28 wire (the SDK's own routing rule: a protocol
    version header that is not one of the handshake versions)."""
    pv = _header(scope, VERSION_HEADER)
    return pv is not None and pv not in HANDSHAKE_PROTOCOL_VERSIONS


MAX_PRINCIPAL_TEXT = 64  # characters of an SDK principal kept as text; longer ones: a digest


def _principal_of(user: object) -> object:
    """What identifies an authenticated Starlette user: for the SDK's bearer user, the SDK's
    principal of its token (``principal_components``: client id, issuer, subject) as compact
    JSON (``[...]``, or ``sdk:`` and a digest); another user's ``identity`` (a ``str``, or an
    ``int`` as its decimal text) behind ``user:``, so that no identity spells a bearer
    principal and shares its scope; ``None`` when not authenticated or without an identity."""
    if user is None or not getattr(user, "is_authenticated", False):
        return None
    token = getattr(user, "access_token", None)
    if token is not None:
        try:
            from mcp.server.auth.provider import principal_components
        except ImportError:  # pragma: no cover - an SDK without it: its subject, else client
            return getattr(token, "subject", None) or getattr(token, "client_id", None)
        # The SDK's own principal (client id, issuer, subject), as one unambiguous text: two
        # clients, or two issuers, with a subject in common are two principals. A long one (an
        # issuer URL, GUIDs) becomes a digest: the scope keys every call's in-flight row, and a
        # key past a small record's room takes a large record, slower to scan (tables.py).
        text = json.dumps(list(principal_components(token)), separators=(",", ":"))
        if len(text) <= MAX_PRINCIPAL_TEXT:
            return text
        return "sdk:" + hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
    try:
        ident = principal.normalize(user.identity)  # type: ignore[attr-defined]
    except Exception:
        return None
    return None if ident is None else "user:" + ident


def conn_of(scope: Mapping[str, Any] | None, stateful: bool) -> dict[str, Any]:
    """A contract §3 conn for an ASGI request scope: its session (stateful servers, 2025-era wire),
    its authenticated principal (``scope["user"]``), its client address."""
    conn: dict[str, Any] = {}
    if not isinstance(scope, Mapping):
        return conn
    client = scope.get("client")
    if client:
        conn["REMOTE_ADDR"] = str(client[0])
    p = _principal_of(scope.get("user"))
    if p is not None:
        principal.put(conn, p)
    if stateful and not modern_wire(scope):
        sid = _header(scope, SESSION_HEADER)
        if sid:
            conn["shmcancel.session_id"] = sid
    return conn


# --- the running calls and the poller ----------------------------------------------------------

class Call:
    """One running ``tools/call``: its handle, the cancel scope its handler runs in and the HTTP
    exchange carrying it (``None`` when not served through the ASGI layer)."""

    __slots__ = ("cancel_scope", "exchange", "handle")

    def __init__(self, handle: RequestHandle, exchange: Exchange | None = None) -> None:
        self.handle = handle
        self.cancel_scope = anyio.CancelScope()
        self.exchange = exchange

    def stop(self, reason: str | None = None) -> None:
        """Cancel this call only, in this process (a disconnect): the handle latches, the scope is
        cancelled. Call from the event loop's thread."""
        self.handle.cancel_local(reason)
        self.cancel_scope.cancel()


class _Poller:
    """The running calls of one event loop (``running``: from before its handler starts until
    it ended, cancelled or not), and the task that looks every ``POLL_INTERVAL`` seconds at the
    handles of those not yet seen cancelled (``calls``) while there are any."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.calls: set[Call] = set()
        self.running: set[Call] = set()
        self.task: asyncio.Task[None] | None = None

    def add(self, call: Call) -> None:
        self.running.add(call)
        self.calls.add(call)
        if self.task is None or self.task.done():
            self.task = self.loop.create_task(self._run())

    def discard(self, call: Call) -> None:
        self.calls.discard(call)
        self.running.discard(call)

    async def _run(self) -> None:
        while self.calls:
            await asyncio.sleep(POLL_INTERVAL)
            for call in list(self.calls):
                try:
                    if call.handle.peek():  # cancelled() may run the janitor's sweep
                        call.cancel_scope.cancel()
                        self.calls.discard(call)
                except Exception:  # a poll never raises; a cancel scope might, once closed
                    log.debug("poller: a call could not be stopped", exc_info=True)
                    self.calls.discard(call)


_pollers: dict[int, _Poller] = {}


def stop_calls_in_scope(scope: str, reason: str) -> int:
    """Stop, in this process only, every call of ``scope`` running on the current event loop
    (:meth:`Call.stop`: its handle latches, its cancel scope is cancelled): what a deleted
    session's calls get when the registry could not record their cancellations (a stalled
    lock). A stateful session's calls all run in the worker that owns it, which serves its
    ``DELETE``. Call from the event loop's thread. Returns how many were stopped."""
    return len(_stop_calls(reason, scope))


async def stop_running_calls(reason: str, wait: float = STOPPED_ANSWER_WAIT) -> int:
    """Stop, in this process only, every call running on the current event loop
    (:meth:`Call.stop`): what the calls still running at the app's lifespan shutdown get; then
    wait up to ``wait`` seconds until each stopped call's exchange is answered. By then the
    server has drained its connections, and an SSE stream ended as the server's exit began
    (``sse_starlette`` ends them all at once), its session dying with this worker: a sync tool
    would run on, unheard, for up to gunicorn's ``graceful_timeout``. A call forwarded from
    another worker with a JSON response is still awaited on the worker's socket server, which
    the main server's drain does not wait for: it gets its ``-32800`` once answered here,
    before the lifespan tears down the SDK's session manager. Call from the event loop's
    thread. Returns how many were stopped."""
    stopped = _stop_calls(reason)
    waits = [asyncio.ensure_future(call.exchange.answered.wait()) for call in stopped
             if call.exchange is not None and not call.exchange.answered.is_set()]
    if waits:
        _, late = await asyncio.wait(waits, timeout=wait)
        for w in late:
            w.cancel()
        if late:
            log.warning("shmcancel.sdk: %d call(s) stopped at the worker's shutdown were not "
                        "answered within %g s", len(late), wait)
    return len(stopped)


def _stop_calls(reason: str, scope: str | None = None) -> list[Call]:
    """:meth:`Call.stop` every call running on the current event loop (of ``scope`` only,
    unless None), those already cancelled included (a sync tool, or cleanup code, still runs
    after its cancel scope was cancelled: its answer is still to come); those stopped."""
    p = _pollers.get(id(asyncio.get_running_loop()))
    if p is None:
        return []
    stopped = [call for call in list(p.running) if scope is None or call.handle.scope == scope]
    for call in stopped:
        call.stop(reason)
    return stopped


def _poller() -> _Poller:
    loop = asyncio.get_running_loop()
    p = _pollers.get(id(loop))
    if p is None or p.loop is not loop:
        p = _pollers[id(loop)] = _Poller(loop)
    return p


EXCHANGE_KEY = "shmcancel.sdk.exchange"


class Exchange:
    """What the ASGI layer shares with the middleware about one HTTP exchange: the calls it carries,
    whether the client went away before its response was complete (set only where the layer
    watches the connection) and whether it is answered (its response sent whole, or the SDK
    done with it)."""

    __slots__ = ("answered", "calls", "gone")

    def __init__(self) -> None:
        self.calls: set[Call] = set()
        self.gone = False
        self.answered = asyncio.Event()

    def disconnected(self) -> None:
        self.gone = True
        self.stop("client disconnected")

    def stop(self, reason: str) -> None:
        """:meth:`Call.stop` every call this exchange carries."""
        for call in list(self.calls):
            call.stop(reason)


async def _registry_write(c: Cancellation, fn: Callable[..., _T], *args: Any) -> _T:
    """``fn(*args)``, a handle's begin or end: a registry write that may wait for the lock. On
    the event loop while no other process holds the lock (a wait of microseconds); in a thread
    while it is stalled (a holder stopped: a wait of up to ``lock_timeout``, which on the loop
    would hold up every request and every cancellation poll of the worker). Shielded: a begin
    must be matched by its end, and an end must run."""
    lock = getattr(getattr(c, "registry", None), "lock", None)
    stalled = getattr(lock, "stalled", None)
    if stalled is None or not stalled():
        return fn(*args)
    with anyio.CancelScope(shield=True):
        done = await anyio.to_thread.run_sync(fn, *args)
    return done


class Tracker:
    """The server middleware (``MCPServer.middleware``): see the module docstring."""

    def __init__(self, stateful: bool) -> None:
        self.stateful = stateful

    async def __call__(self, ctx: Any, call_next: Any) -> Any:
        if ctx.method != "tools/call" or ctx.request_id is None:
            return await call_next(ctx)
        c = process_cancellation()
        if c is None:
            return await call_next(ctx)
        if ids.key(ctx.request_id) is None:
            # A string id over MAX_ID_BYTES, which the SDK takes: the registry cannot key it, so
            # the call would run untracked, deaf to every cancellation (contract §9: every call
            # is tracked, within §4's bounds). Refused, as the WSGI transport refuses it.
            raise MCPError(errors.INVALID_REQUEST,
                           f"Invalid Request: the request id is longer than {ids.MAX_ID_BYTES} "
                           "UTF-8 bytes (or not UTF-8)")
        scope = getattr(ctx.request, "scope", None)
        conn = conn_of(scope, self.stateful)
        handle = await _registry_write(c, c.begin, ctx.request_id, principal.scope(conn))
        exchange = scope.get(EXCHANGE_KEY) if isinstance(scope, MutableMapping) else None
        call = Call(handle, exchange if isinstance(exchange, Exchange) else None)
        poller = _poller()
        token = _current.set(handle)
        result: Any = None
        try:
            if isinstance(exchange, Exchange):
                exchange.calls.add(call)
                if exchange.gone:
                    call.stop("client disconnected")
            poller.add(call)
            with call.cancel_scope:
                try:
                    result = await call_next(ctx)
                except Exception:
                    if not handle.cancelled():
                        raise
            if handle.cancelled():
                raise RequestCancelled(handle.reason())
            return result
        finally:
            poller.discard(call)
            if isinstance(exchange, Exchange):
                exchange.calls.discard(call)
            _current.reset(token)
            await _registry_write(c, handle.end)
