"""Stateful SDK sessions across workers: every request of a session is served by the worker that
holds it (the SDK keeps a session in the memory of the worker that created it: its issue #520).

Design (invariants):

- Each worker serves the same app a second time, on a unix socket of its own,
  ``<dir>/<token>.sock``, where ``token`` is the worker's pid and a random nonce (hex): a worker
  that dies, or a new worker that reuses its pid, never answers for the old one's sessions.
- The session id a client sees is ``<token>-<the SDK's id>``: the owning worker is part of the
  id, so no map needs keeping (nor cleaning on idle timeout, ``DELETE`` or a worker's death). A
  2025-era request whose session id carries another worker's token is forwarded to that worker's
  socket unchanged (method, path, headers, body; the SSE response streamed back as it comes),
  with the client's address in ``x-shmcancel-client`` (trusted only on the unix socket). The
  owner strips its token before the SDK sees the id, and prefixes the id of a session it
  creates. The 2026-07-28 wire has no sessions: the SDK ignores the header there, and so does
  the routing.
- A worker that is gone (no listener on its socket) answers 404 ``Session not found``, as the SDK
  does for a session it no longer has: never a hang, never a 5xx. A session dies with its worker
  (crash, ``max_requests``, ``HUP``): the client must open a new one.
- Hop-by-hop headers are not forwarded either way. The forwarded request passes the owner's full
  app again (its auth middleware, the SDK's Origin/Host and session checks).

The second server is a ``uvicorn.Server`` whose signal capture is turned off (the worker's own
handlers stay in charge), started on the worker's event loop on its first request; it serves
without a lifespan (the worker's app already ran it) and without logging setup of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import re
import secrets
import signal
import socket
import stat
import tempfile
from collections.abc import Iterator, MutableMapping
from typing import Any
from urllib.parse import unquote_to_bytes

from ..exceptions import ShmCancelError

log = logging.getLogger("shmcancel.sdk")

INTERNAL_KEY = "shmcancel.sdk.internal"
CLIENT_HEADER = b"x-shmcancel-client"
SESSION_HEADER = b"mcp-session-id"
_TOKEN = re.compile(r"^([0-9a-f]{1,8}x[0-9a-f]{12})-(.+)$")
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate",
                        b"proxy-authorization", b"te", b"trailer", b"trailers",
                        b"transfer-encoding", b"upgrade", b"content-length", CLIENT_HEADER})
MAX_CLIENTS = 64
# The URL origin of a forwarded request (the socket decides where it goes; the client's own Host
# header is forwarded as it came).
FORWARD_ORIGIN = "http://shmcancel-worker"
# Seconds to connect to the owner. No bound on its response head: a JSON response starts only
# when the call ends.
FORWARD_TIMEOUT = 10.0
EXIT_LOOK = 0.25  # seconds between looks, in a forwarded event stream, for this worker's exit
# Seconds between a worker's looks at its own socket (bound again when found removed)
KEEP_BOUND_EVERY = 1.0
# Seconds a pooled connection to another worker is reused after its last answer, and seconds the
# worker's socket server keeps an idle connection: the client must always give up first. With
# both at 5 s (httpx's and uvicorn's defaults) a reuse at the edge raced the server's close, and
# the forward failed (ReadError: a 503 for a live session).
FORWARD_KEEPALIVE = 5.0
INTERNAL_KEEPALIVE = 60


def socket_dir() -> str:
    """Where the workers' sockets live: ``SHMCANCEL_SDK_SOCKET_DIR``, else a directory per user
    under the temporary directory (created 0700). Whoever can reach a worker's socket can send
    it requests as any client (the forwarded client address is trusted), so the directory must
    be a real directory of this user that no one else can enter: one of this user's with group
    or other bits gets them cleared; a symlink, another user's directory or a file raises
    :class:`SocketDirUnsafe` (another local user squatting the name under ``/tmp``). Checked
    once per process and directory."""
    # normalised: "dir/" would lstat what a symlink "dir" points to, and pass
    d = os.path.normpath(os.environ.get("SHMCANCEL_SDK_SOCKET_DIR") or os.path.join(
        tempfile.gettempdir(), f"shmcancel-sdk-{os.getuid()}"))
    if _checked.get(d) != os.getpid() and len(os.fsencode(d)) > SOCKET_DIR_MAX:
        raise SocketDirTooLong(
            f"shmcancel.sdk: the socket directory {d} is {len(os.fsencode(d))} bytes long; "
            f"a worker's socket in it would pass the {_SUN_PATH_MAX} bytes a unix socket's "
            f"path holds: set SHMCANCEL_SDK_SOCKET_DIR to a directory of at most "
            f"{SOCKET_DIR_MAX} bytes")
    return _private(d)


def _private(d: str) -> str:
    """``d``, made (0700) when missing, once a real directory of this user that nobody else can
    enter (group and other bits are cleared); else :class:`SocketDirUnsafe`. Checked once per
    process and directory."""
    if _checked.get(d) == os.getpid():
        return d
    with contextlib.suppress(FileExistsError):  # a file or a dangling symlink: said below
        os.makedirs(d, mode=0o700, exist_ok=True)
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        what = ("a symlink" if stat.S_ISLNK(st.st_mode) else
                "not a directory" if not stat.S_ISDIR(st.st_mode) else f"owned by uid {st.st_uid}")
        raise SocketDirUnsafe(
            f"shmcancel.sdk: the socket directory {d} is {what}, not a directory of uid "
            f"{os.getuid()}: remove it, or set SHMCANCEL_SDK_SOCKET_DIR to a private directory")
    if st.st_mode & 0o077:
        os.chmod(d, 0o700)
    _checked[d] = os.getpid()
    return d


def server_dir() -> str:
    """This server's part of :func:`socket_dir`: a subdirectory per registry (the workers of one
    server share it; another server's sessions are unknown here, never served through this
    server's port). A worker with no registry shares one with the processes of its parent
    (gunicorn's master, uvicorn's supervisor): two such servers started by one shell share it."""
    from ._calls import process_cancellation

    c = process_cancellation()
    reg = getattr(c, "registry", None)
    # "parent:" cannot be a registry name (no colon in one)
    return registry_dir(socket_dir(), reg.name if reg is not None else f"parent:{os.getppid()}")


def registry_dir(base: str, registry_name: str) -> str:
    """The subdirectory of the private ``base`` for the registry ``registry_name``, made 0700
    (or checked as :func:`socket_dir` checks its directory). Named by a digest of the name, not
    the name (up to 64 characters): a unix socket's path holds 107 bytes at most."""
    digest = hashlib.blake2b(registry_name.encode(), digest_size=6).hexdigest()
    # checked too: one planted while the base directory was open to others is refused
    return _private(os.path.join(base, f"r-{digest}"))


def _socket_path(token: str) -> str:
    """The socket of the worker whose token is ``token``, in :func:`server_dir`."""
    return os.path.join(server_dir(), f"{token}.sock")


def _reachable(path: str) -> bool:
    """Whether ``path`` (:func:`_socket_path`) is a socket of this user's in directories of
    this user's that nobody else can write to, each looked at now without following a symlink.
    A forward must not trust this process's first check of the directories: removed since (a
    cleaner of old files under ``/tmp``), another local user may have made them again, planted
    a socket named after a worker's token (every client sees the tokens), and would read the
    requests forwarded to it. (Read and search bits for others plant nothing: a ``chmod 750``
    of the base is not refused.) Answered as a worker gone (404), logged once until a forward
    finds the directories sound again."""
    global _unsafe_logged
    uid = os.getuid()
    try:
        st = os.lstat(path)
        if not stat.S_ISSOCK(st.st_mode):
            return False
        ok = st.st_uid == uid
        d = os.path.dirname(path)
        for _ in range(2):  # the registry's directory, then the base
            dst = os.lstat(d)
            ok = ok and stat.S_ISDIR(dst.st_mode) and dst.st_uid == uid \
                and not dst.st_mode & 0o022
            d = os.path.dirname(d)
    except OSError:
        return False
    if ok:
        _unsafe_logged = False
    elif not _unsafe_logged:
        _unsafe_logged = True
        log.error("shmcancel.sdk: %s is not a socket of uid %d in directories only it can "
                  "write to: not forwarded to (its sessions answer 404); was the socket "
                  "directory replaced? Restart the server", path, uid)
    return ok


_unsafe_logged = False


def _peer_path(token: str) -> str | None:
    """:func:`_socket_path` of another worker's ``token`` for a forward, or None when the
    socket directory is refused now (:class:`SocketDirUnsafe`, or an OSError making it:
    replaced since this process checked it; logged once), which makes the worker unreachable,
    never an HTTP 500."""
    global _unsafe_logged
    try:
        return _socket_path(token)
    except (ShmCancelError, OSError) as e:  # OSError: a makedirs on what replaced it
        if not _unsafe_logged:
            _unsafe_logged = True
            log.error("%s; nothing is forwarded (sessions of other workers answer 404)", e)
        return None


def _bind(token: str) -> tuple[socket.socket, str]:
    """A unix socket bound at the socket path of ``token`` (:func:`_socket_path`), and that path;
    the socket file is its owner's only (0600, in a 0700 directory). A worker of the same server
    that exits removes the directory once it holds no socket (:meth:`Router.close`): when that
    happens between this process's making or check of the directory and its bind, the bind or
    the check finds no directory, and every directory is made and checked again (the base too:
    ``makedirs`` re-makes a missing parent with the umask's mode), up to :data:`_BIND_TRIES`
    times (each try needs another worker's exit in that window)."""
    for _ in range(_BIND_TRIES):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            path = _socket_path(token)
            sock.bind(path)
            os.chmod(path, 0o600)
        except FileNotFoundError:
            sock.close()
            _checked.clear()
            continue
        except BaseException:
            sock.close()
            raise
        return sock, path
    raise RuntimeError(f"shmcancel.sdk: the worker's socket directory kept vanishing before its "
                       f"bind ({_BIND_TRIES} tries): is something removing {server_dir()}?")


_BIND_TRIES = 8
# A unix socket's path: 108 bytes on Linux with the terminating NUL. Below the base directory
# come "/r-" + 12 hex + "/" + a token of at most 21 characters + ".sock".
_SUN_PATH_MAX = 107
SOCKET_DIR_MAX = _SUN_PATH_MAX - len("/r-") - 12 - len("/") - 21 - len(".sock")


class SocketDirUnsafe(ShmCancelError, RuntimeError):
    """The workers' socket directory is not a private directory of this user (see
    :func:`socket_dir`)."""


class SocketDirTooLong(ShmCancelError, ValueError):
    """The workers' socket directory's path is longer than :data:`SOCKET_DIR_MAX` bytes: a
    worker's unix socket in it could not be bound."""


_checked: dict[str, int] = {}  # socket directory -> the pid that checked it


def split(session_id: str) -> tuple[str, str] | None:
    """``(token, sdk_id)`` of a session id this module made, else ``None``."""
    m = _TOKEN.match(session_id)
    return (m.group(1), m.group(2)) if m else None


def token_pid(token: str) -> int | None:
    """The pid of the worker whose token is ``token`` (``{pid:x}x{random}``), else ``None``."""
    head, sep, _ = token.partition("x")
    try:
        return int(head, 16) if sep else None
    except ValueError:
        return None


def set_header(scope: MutableMapping[str, Any], name: bytes, value: bytes | None) -> None:
    """Replace ``scope``'s ``name`` headers (ASGI's lowercase names) by one of ``value``, or
    by none when it is ``None``."""
    headers = [(k, v) for k, v in scope.get("headers") or () if k != name]
    if value is not None:
        headers.append((name, value))
    scope["headers"] = headers


def _header(scope: MutableMapping[str, Any], name: bytes) -> bytes | None:
    for k, v in scope.get("headers") or ():
        if k == name:
            return bytes(v)
    return None


class _QuietServer:
    """Builds a ``uvicorn.Server`` that leaves signal handling to the worker."""

    @staticmethod
    def make(config: Any) -> Any:
        import uvicorn

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:
                yield

        return Server(config)


class Router:
    """One worker's side of the routing: its token, its socket, its second server."""

    def __init__(self, app: Any) -> None:
        self.app = app  # the full Starlette app, served again on the socket
        self.pid = 0
        self.token = ""
        self.path = ""
        # this worker's socket servers (the last one's socket is bound) and their tasks
        self._servers: list[Any] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._keeper: asyncio.Task[None] | None = None
        self._ino = 0  # the inode of the socket this worker bound last
        self._started: asyncio.Event | None = None
        self._clients: dict[str, Any] = {}  # socket path -> httpx.AsyncClient (this process's)
        self._uses: dict[Any, int] = {}  # client -> forwards under way through it

    def _client(self, path: str) -> Any:
        """A pooled client for the worker at ``path`` (building one costs milliseconds: an SSL
        context); :meth:`_prune` before a new one keeps at most ``MAX_CLIENTS``."""
        if not self._clients:
            _quiet_httpx()
        import httpx

        h = self._clients.get(path)
        if h is None:
            # No pool bound of its own: each forward holds one of this worker's own client
            # connections, so those bound it (httpx's default of 100 made the 101st concurrent
            # stream wait FORWARD_TIMEOUT, then fail).
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=32,
                                  keepalive_expiry=FORWARD_KEEPALIVE)
            h = self._clients[path] = httpx.AsyncClient(
                transport=httpx.AsyncHTTPTransport(uds=path, limits=limits),
                timeout=httpx.Timeout(FORWARD_TIMEOUT, read=None))
            # httpx's own defaults (Accept: */*, Accept-Encoding, User-Agent, Connection) would
            # be merged into every forward: a request without Accept, refused 406 by its own
            # worker, was served once forwarded. Only the client's headers go.
            h.headers.clear()
        return h

    async def _prune(self) -> None:
        """Before a client for a new worker is made: drop the clients of workers whose socket
        is gone (their pooled connections lead nowhere, and nothing else would close them: a
        gone worker's sessions need not ever be forwarded here again), then the oldest past
        ``MAX_CLIENTS - 1``."""
        for p in [p for p in self._clients if not os.path.exists(p)]:
            await self._drop(p)
        while len(self._clients) >= MAX_CLIENTS:
            await self._drop(next(iter(self._clients)))

    async def _drop(self, path: str) -> None:
        """Forget the client for ``path`` and close it (its pooled connections): now when no
        forward uses it, else once the last one ends (:meth:`forward`). Never left to the
        cyclic garbage collector, which alone would free its sockets."""
        h = self._clients.pop(path, None)
        if h is not None and h not in self._uses:
            with contextlib.suppress(Exception):
                await h.aclose()

    # --- this worker's second server -----------------------------------------------------

    async def ensure(self) -> None:
        """Start this worker's socket server once (per process); return when it listens."""
        if self.pid == os.getpid() and self._started is not None:
            await self._started.wait()
            return
        self.pid = os.getpid()
        self.token = f"{self.pid:x}x{secrets.token_hex(6)}"
        self._servers, self._tasks = [], []
        self._started = started = asyncio.Event()
        try:  # whatever happens, requests waiting for the start go on
            await self._serve(self._bind_own())
        finally:
            started.set()
        _sweep(os.path.dirname(self.path))
        self._keeper = asyncio.get_running_loop().create_task(self._keep_bound())

    def _bind_own(self) -> socket.socket:
        """This worker's socket bound at its path (:func:`_bind`), its inode kept for the
        keeper's looks."""
        sock, self.path = _bind(self.token)
        self._ino = os.lstat(self.path).st_ino
        return sock

    async def _serve(self, sock: socket.socket) -> None:
        """Serve the app on the bound ``sock`` with a uvicorn server of its own; return once it
        listens (within ~5 s, else RuntimeError)."""
        import uvicorn

        # no Server or Date header: the public server's go back to the client
        config = uvicorn.Config(self._internal, lifespan="off", log_config=None,
                                interface="asgi3", proxy_headers=False,
                                server_header=False, date_header=False,
                                access_log=False, timeout_graceful_shutdown=1,
                                timeout_keep_alive=INTERNAL_KEEPALIVE)
        server = _QuietServer.make(config)
        task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
        self._servers.append(server)
        self._tasks.append(task)
        for _ in range(500):  # up to ~5 s
            if server.started:
                return
            if task.done():
                raise RuntimeError(f"the worker's socket server stopped: {task!r}")
            await asyncio.sleep(0.01)
        raise RuntimeError("the worker's socket server did not start within 5 s")

    async def _keep_bound(self) -> None:
        """While the worker serves, every :data:`KEEP_BOUND_EVERY` seconds: its socket bound
        again when it is gone (removed behind its back: an operator, a cleaner of old files
        under ``/tmp``), else every session it holds is 404 from the other workers for good.
        The directories are checked again first (whoever removed the socket may have replaced
        them: a symlink, another user's directory); a refusal is logged once, and tried again.
        The earlier server stops listening (its socket is unreachable) and goes on serving the
        connections it has."""
        failing = False
        while True:
            await asyncio.sleep(KEEP_BOUND_EVERY)
            self._retire()
            try:
                ours = os.lstat(self.path).st_ino == self._ino
            except OSError:
                ours = False
            if ours and _reachable(self.path):
                failing = False
                continue
            _checked.clear()  # the directories are checked again, by the next two calls
            try:
                if ours:  # still there, its directories not sound: put right, or refused
                    _socket_path(self.token)
                    continue
                sock = self._bind_own()
            except Exception as e:
                if not failing:
                    log.warning("shmcancel.sdk: this worker's socket %s cannot be served "
                                "(%s); tried again every %g s", self.path, e,
                                KEEP_BOUND_EVERY)
                failing = True
                continue
            failing = False
            for old in self._servers:
                for listener in getattr(old, "servers", None) or ():
                    listener.close()  # no more accepts; its connections go on
            try:
                await self._serve(sock)
            except Exception as e:
                log.warning("shmcancel.sdk: this worker's socket %s was bound again, but its "
                            "server did not start (%s)", self.path, e)
                with contextlib.suppress(OSError):
                    os.unlink(self.path)  # the next look binds again
                continue
            log.warning("shmcancel.sdk: this worker's socket %s was removed while it served; "
                        "bound again", self.path)

    def _retire(self) -> None:
        """Stop the earlier servers (replaced by a bind again) once they serve no connection,
        and forget those stopped: one per removal of the socket would pile up otherwise."""
        kept = [(self._servers[-1], self._tasks[-1])] if self._servers else []
        for server, task in zip(self._servers[:-1], self._tasks[:-1], strict=True):
            if not getattr(getattr(server, "server_state", None), "connections", None):
                server.should_exit = True
            if not task.done():
                kept.insert(-1, (server, task))
        self._servers = [srv for srv, _ in kept]
        self._tasks = [task for _, task in kept]

    def close(self) -> None:
        """Stop this worker's socket server and remove its socket (the app's lifespan shutdown),
        and the server's socket directory when that leaves it empty (the last worker of a server
        stopped: the directory is named by the registry, which the next run may not share), the
        sockets of dead workers in it removed first. A worker killed outright leaves its socket:
        a worker that closes later, the next worker to start, or the first forward that finds no
        listener on it removes it."""
        if self.pid != os.getpid() or not self.path:
            return
        if self._keeper is not None:
            self._keeper.cancel()
            self._keeper = None
        for server in self._servers:
            server.should_exit = True
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        here = os.path.dirname(self.path)
        _sweep(here)  # dead workers' sockets (killed ones': a quick stop, an upgrade's old ones)
        with contextlib.suppress(OSError):  # not empty: a live worker's socket is in it
            os.rmdir(here)

    async def _internal(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        """The app as served on the socket: a forwarded request, its client address restored."""
        if scope.get("type") == "http":
            if worker_exiting():
                # the session dies with this worker, which is draining: what sse_starlette
                # would answer now is an empty stream (a client's call then "ended without a
                # response"); 404 tells its client to open a new session
                await _not_found(send)
                return
            scope[INTERNAL_KEY] = True
            addr = _header(scope, CLIENT_HEADER)
            set_header(scope, CLIENT_HEADER, None)
            if addr:
                scope["client"] = (addr.decode("latin-1"), 0)
        elif scope.get("type") == "lifespan":  # pragma: no cover - lifespan is off
            return
        await self.app(scope, receive, send)

    # --- a request's session id ------------------------------------------------------------

    @staticmethod
    def sdk_id(scope: MutableMapping[str, Any]) -> str | None:
        """The SDK's own id inside the request's session id (any worker's), else ``None``."""
        raw = _header(scope, SESSION_HEADER)
        parts = split(raw.decode("latin-1")) if raw is not None else None
        return parts[1] if parts else None

    @staticmethod
    def with_sdk_id(scope: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        """A copy of ``scope`` whose session header carries the SDK's own id."""
        copy = dict(scope)
        sid = Router.sdk_id(scope)
        set_header(copy, SESSION_HEADER, sid.encode("latin-1") if sid else None)
        return copy

    def route(self, scope: MutableMapping[str, Any]) -> str | None:
        """Look at the request's session id: ``None`` when this worker serves it (the header,
        if any, is rewritten to the SDK's own id), else the token of the worker that owns it.
        An id this module did not make, or (on the socket) a token not this worker's, is
        replaced by one that cannot exist, so the SDK answers 404."""
        raw = _header(scope, SESSION_HEADER)
        if raw is None:
            return None
        parts = split(raw.decode("latin-1"))
        if parts is not None and parts[0] == self.token:
            set_header(scope, SESSION_HEADER, parts[1].encode("latin-1"))
            return None
        if parts is None or scope.get(INTERNAL_KEY):
            set_header(scope, SESSION_HEADER, b"unknown-session")
            return None
        return parts[0]

    def tag(self, message: MutableMapping[str, Any]) -> None:
        """Prefix this worker's token to a session id in a response head."""
        if message.get("type") != "http.response.start":
            return
        headers = []
        for k, v in message.get("headers") or ():
            if k.lower() == SESSION_HEADER and not bytes(v).startswith(self.token.encode()):
                v = self.token.encode() + b"-" + bytes(v)
            headers.append((k, v))
        message["headers"] = headers

    @staticmethod
    def names_worker(token: str) -> bool:
        """Whether ``token`` (from :meth:`route`) names a worker serving now (its socket, in
        directories still this user's own: :func:`_reachable`)."""
        path = _peer_path(token)
        return path is not None and _reachable(path)

    # --- forwarding -------------------------------------------------------------------------

    async def forward(self, token: str, scope: MutableMapping[str, Any], body: bytes | None,
                      receive: Any, send: Any) -> None:
        """Serve the request by the worker ``token`` (see the module docstring)."""
        path = _peer_path(token)
        if path is None or not _reachable(path):
            # No such worker (gone and swept, or a token anyone can forge), or one not safely
            # reachable: answered before a client is built for it, which would cost
            # milliseconds of this event loop (an SSL context), where every call's
            # cancellation poll runs too.
            if path is not None:
                await self._drop(path)
            await _not_found(send)
            return
        headers = [(k, v) for k, v in scope.get("headers") or () if k.lower() not in HOP_BY_HOP]
        client = scope.get("client")
        if client:
            headers.append((CLIENT_HEADER, str(client[0]).encode("latin-1")))
        target = _route_path(scope)
        if scope.get("query_string"):
            target = target + b"?" + bytes(scope["query_string"])
        url = FORWARD_ORIGIN + target.decode("latin-1")
        if path not in self._clients:
            await self._prune()
        h = self._client(path)
        self._uses[h] = self._uses.get(h, 0) + 1
        try:
            await self._forward_via(h, token, path, scope["method"], url, headers, body,
                                    receive, send)
        finally:
            n = self._uses.pop(h) - 1
            if n:
                self._uses[h] = n
            elif self._clients.get(path) is not h:  # dropped while in use: its last user
                with contextlib.suppress(Exception):  # closes it
                    await h.aclose()

    async def _forward_via(self, h: Any, token: str, path: str, method: str, url: str,
                           headers: list[tuple[Any, Any]], body: bytes | None, receive: Any,
                           send: Any) -> None:
        """:meth:`forward` through the client ``h`` for the worker at ``path``."""
        import httpx

        req = h.build_request(method, url, headers=headers, content=body or b"")
        try:
            resp = await h.send(req, stream=True)
        except (httpx.ConnectError, FileNotFoundError, ConnectionRefusedError):
            # no listener: the owner is gone, and its sessions with it
            self._clients.pop(path, None)
            if os.path.exists(path) and _refused(path):
                with contextlib.suppress(OSError):
                    os.unlink(path)
            await _not_found(send)
            return
        except httpx.HTTPError as e:  # the owner broke the exchange before its answer began
            # (it stopped), or the connection timed out. Once the answer began: _cut_short.
            log.warning("shmcancel.sdk: forwarding to worker %s failed: %r", token, e)
            await _busy(send)
            return
        try:
            out = [(k, v) for k, v in resp.headers.raw if k.lower() not in HOP_BY_HOP]
            await send({"type": "http.response.start", "status": resp.status_code,
                        "headers": out})
            gone = asyncio.Event()

            async def watch() -> None:
                while (await receive()).get("type") != "http.disconnect":
                    pass
                gone.set()

            watcher = asyncio.get_running_loop().create_task(watch())
            tail = EventTail()  # an event stream's end so far (for _cut_short)
            sse = resp.headers.get("content-type", "").lower().startswith("text/event-stream")
            stop = asyncio.ensure_future(gone.wait())
            nxt: asyncio.Future[bytes] | None = None
            try:
                chunks = resp.aiter_raw().__aiter__()
                while True:
                    if nxt is None:
                        nxt = asyncio.ensure_future(chunks.__anext__())
                    # An event stream (a GET's has no end) is also ended when this worker
                    # begins to exit, as sse_starlette ends the SDK's own: uvicorn's drain
                    # waits for every response, and for this one until gunicorn's timeout.
                    done, _ = await asyncio.wait({nxt, stop}, timeout=EXIT_LOOK if sse else None,
                                                 return_when=asyncio.FIRST_COMPLETED)
                    if nxt not in done and (stop in done or worker_exiting()):
                        nxt.cancel()  # the client left, or this worker exits: dropped upstream
                        with contextlib.suppress(BaseException):
                            await nxt
                        if stop not in done:
                            await _cut_short(send, token, None, sse, tail, body)
                        return
                    if nxt not in done:
                        continue
                    try:
                        chunk = nxt.result()
                    except StopAsyncIteration:
                        break
                    except httpx.HTTPError as e:
                        await _cut_short(send, token, e, sse, tail, body)
                        return
                    nxt = None
                    if sse:
                        tail.feed(chunk)
                    await send({"type": "http.response.body", "body": chunk,
                                "more_body": True})
                    # looked at on every event too: a stream that never pauses for EXIT_LOOK
                    # (progress every 0.2 s) was never ended
                    if sse and worker_exiting() and not tail.inside_event:
                        await _cut_short(send, token, None, sse, tail, body)
                        return
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            finally:
                stop.cancel()
                watcher.cancel()
        finally:
            await resp.aclose()


class _ForwardsFilter(logging.Filter):
    """Drops httpx's one INFO line per request for forwarded requests (one per hop would double
    the server's log); its other records pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        return not (isinstance(args, tuple) and len(args) > 1
                    and str(args[1]).startswith(FORWARD_ORIGIN))


def _quiet_httpx() -> None:
    lg = logging.getLogger("httpx")
    if not any(isinstance(f, _ForwardsFilter) for f in lg.filters):
        lg.addFilter(_ForwardsFilter())


def _sweep(directory: str) -> None:
    """Remove the sockets of workers that no longer exist (by the pid in their name)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names[:4096]:
        m = re.match(r"^([0-9a-f]{1,8})x[0-9a-f]{12}\.sock$", name)
        if m is None:
            continue
        try:
            os.kill(int(m.group(1), 16), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(directory, name))
        except OSError:
            pass


def _route_path(scope: MutableMapping[str, Any]) -> bytes:
    """The request's raw path as the app routes it (Starlette's route path): without the
    ``root_path`` the app is served under (a ``Mount`` prefix, uvicorn's ``--root-path``), which
    both put in front of ``raw_path``. The socket server serves the app itself at its root: the
    full path would be its 404."""
    raw = bytes(scope.get("raw_path") or scope.get("path", "/").encode())
    root = str(scope.get("root_path") or "").encode("utf-8", "surrogateescape")
    if not root:
        return raw
    if raw.startswith(root) and raw[len(root):len(root) + 1] == b"/":
        return raw[len(root):]
    # root_path is decoded (a Mount's matched path: a path parameter's "acme corp"), raw_path
    # is as sent ("acme%20corp"): the prefix is the raw one, ending before a "/", that decodes
    # to root_path
    i = raw.find(b"/", 1)
    while i > 0:
        if unquote_to_bytes(raw[:i]) == root:
            return raw[i:]
        i = raw.find(b"/", i + 1)
    return raw


def _refused(path: str) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    finally:
        s.close()
    return False


TAIL_MAX = 65536  # bytes kept of an event stream's last event, and of the one under way


class EventTail:
    """What an event stream answering a request says about its end so far, in bounded memory:
    whether it stopped inside an event, and the first :data:`TAIL_MAX` bytes (its line ends
    made ``\\n``, the blank line ending it left out) and the length of its last event. Fed the
    stream's bytes in order (:meth:`feed`), in chunks cut anywhere."""

    __slots__ = ("_cr", "_end", "cur", "cur_len", "last", "last_len")

    def __init__(self) -> None:
        self._cr = False  # the bytes fed end with a CR, held back: it may begin a CRLF
        self._end = b"\n\n"  # the stream's last two bytes (line ends made \n) so far
        self.cur = b""  # the head of the event under way, and its length so far
        self.cur_len = 0
        self.last = b""  # the head of the last event ended, and its length
        self.last_len = 0

    def feed(self, chunk: bytes) -> None:
        data = (b"\r" if self._cr else b"") + chunk
        self._cr = data.endswith(b"\r")
        data = _lines(data[:-1] if self._cr else data)
        if not data:
            return
        start = 0
        if self._end.endswith(b"\n") and data.startswith(b"\n"):
            self._close()
            start = 1
        while (i := data.find(b"\n\n", start)) >= 0:
            self._add(data[start:i + 1])
            self._close()
            start = i + 2
        self._add(data[start:])
        self._end = (self._end + data)[-2:]

    def _add(self, part: bytes) -> None:
        if not self.cur_len:
            part = part.lstrip(b"\n")  # blank lines between events end nothing
        if self.cur_len < TAIL_MAX:
            self.cur += part[:TAIL_MAX - self.cur_len]
        self.cur_len += len(part)

    def _close(self) -> None:
        if self.cur_len:
            self.last, self.last_len = self.cur, self.cur_len
            self.cur, self.cur_len = b"", 0

    @property
    def inside_event(self) -> bool:
        """Whether the stream so far stopped inside an event (a held CR ends a line)."""
        return (self._end + (b"\n" if self._cr else b""))[-2:] != b"\n\n"

    @property
    def at_line_start(self) -> bool:
        """Whether the stream so far ends with a line end (a held CR ends a line)."""
        return self._cr or self._end.endswith(b"\n")

    def last_event(self) -> tuple[bytes, int]:
        """The head and length of the event the stream ended with, when not inside one
        (``(b"", 0)`` for none): the one under way when only a held CR ends it."""
        if self.cur_len:
            return self.cur, self.cur_len
        return self.last, self.last_len


async def _cut_short(send: Any, token: str, e: Exception | None, sse: bool, tail: EventTail,
                     body: bytes | None) -> None:
    """The owner broke a forwarded answer it had begun (it was killed: ``e``), or this worker
    ends it as it exits (``e`` None). An event stream ends as :func:`end_event_stream` ends it,
    its error ``-32000``. Any other answer is left incomplete (uvicorn then drops the client's
    connection, as the owner's was dropped): ended cleanly, a body cut short would pass for
    whole."""
    if e is None:
        log.info("shmcancel.sdk: this worker is stopping: a forwarded stream of worker %s "
                 "ended", token)
        why = "the worker carrying this stream is stopping; the call may still run"
    else:
        log.warning("shmcancel.sdk: worker %s stopped in the middle of a forwarded answer: "
                    "%r", token, e)
        why = "the worker holding the session stopped before answering"
    if sse:
        await end_event_stream(send, tail, body, {"code": -32000, "message": why})


def _carries_answer(tail: EventTail, rid: tuple[int | str]) -> bool:
    """Whether an event stream answering request ``rid``, whose end so far is ``tail``
    (between events), ended with its answer as its last event. A last event longer than
    :data:`TAIL_MAX` is read from its head (:func:`_head_answers`)."""
    event, size = tail.last_event()
    return _answers(event, rid) if size <= TAIL_MAX else _head_answers(event, rid)


# Ends an event cut short without dispatching it as a message: the last "event" field names
# its type, and MCP clients take only "message" events (an unknown type is ignored)
VOID_EVENT = b"event: shmcancel-cut\r\n\r\n"


async def end_event_stream(send: Any, tail: EventTail, body: bytes | None,
                           error: dict[str, Any]) -> None:
    """End an event stream answering the request in ``body`` that stops early, ``tail`` its
    end so far, with one more event, the request's JSON-RPC error response (``error``, its
    ``code``, ``message`` and perhaps ``data``), so that its client learns the call failed,
    unless it already carried the answer (:func:`_carries_answer`). One cut inside an event first
    ends that event: as it is when, ended there, it is the answer (whole, and at most
    :data:`TAIL_MAX` bytes), else as :data:`VOID_EVENT` (its data cut, or the answer only
    perhaps: never dispatched as a message). The bytes ending the stream go in one message,
    then the end (a send given up writes nothing with uvicorn)."""
    out = b""
    rid = _request_id(body)
    if tail.inside_event:
        nl = b"" if tail.at_line_start else b"\r\n"
        event, size = tail.cur, tail.cur_len
        if rid is not None and size <= TAIL_MAX and _answers(event, rid):
            out, rid = nl + b"\r\n", None
        else:
            out = nl + VOID_EVENT
    elif rid is not None and _carries_answer(tail, rid):
        rid = None
    if rid is not None:
        msg = {"jsonrpc": "2.0", "id": rid[0], "error": error}
        out += b"event: message\r\ndata: " + json.dumps(msg).encode() + b"\r\n\r\n"
    if out:
        await send({"type": "http.response.body", "body": out, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def _lines(tail: bytes) -> bytes:
    """An event stream's bytes with its three line ends (CRLF, CR, LF) made ``\\n``."""
    return tail.replace(b"\r\n", b"\n").replace(b"\r", b"\n")


def worker_exiting() -> bool:
    """Whether this worker's server has begun to exit (gunicorn's ``TERM``, ``max_requests``):
    the uvicorn server whose ``handle_exit`` is the ``SIGTERM`` handler says ``should_exit``,
    where sse_starlette looks too (this worker's socket server installs no handler)."""
    server = getattr(signal.getsignal(signal.SIGTERM), "__self__", None)
    return getattr(server, "should_exit", False) is True


def exit_at_request_limit() -> None:
    """Make this worker's request limit (gunicorn's ``max_requests``) begin its exit as a
    ``TERM`` does: uvicorn's server only leaves its main loop when ``on_tick`` finds the limit
    reached, its ``should_exit`` left False, so neither :func:`worker_exiting` nor
    sse_starlette saw an exit (event streams were not ended, and the drain waited for them
    until gunicorn's ``timeout`` killed the worker). Wraps the ``on_tick`` of the server whose
    ``handle_exit`` is the ``SIGTERM`` handler (called from the app's lifespan startup, before
    its main loop) so that its ``True`` sets ``should_exit`` too; once per server."""
    server: Any = getattr(signal.getsignal(signal.SIGTERM), "__self__", None)
    tick = getattr(server, "on_tick", None)
    if tick is None or not hasattr(server, "should_exit") or getattr(tick, "_exits", False):
        return

    async def on_tick(counter: int) -> bool:
        done = bool(await tick(counter))
        if done:
            server.should_exit = True
        return done

    on_tick._exits = True  # type: ignore[attr-defined]
    server.on_tick = on_tick


def _data(event: bytes) -> bytes:
    """The data of ``event`` (an event stream's event, its lines ended by ``\\n``)."""
    return b"\n".join(line[5:].removeprefix(b" ") for line in event.split(b"\n")
                      if line.startswith(b"data:"))


def _answers(event: bytes, rid: tuple[int | str]) -> bool:
    """Whether ``event`` (an event stream's event, its lines ended by ``\\n``) carries the
    JSON-RPC response to the request ``rid``."""
    data = _data(event)
    try:
        msg = json.loads(data)
    except ValueError:
        return False
    return (isinstance(msg, dict) and msg.get("id") == rid[0]
            and ("result" in msg or "error" in msg))


def _skip(text: str, pos: int) -> int:
    """``pos`` past the JSON whitespace at it in ``text``."""
    while pos < len(text) and text[pos] in " \t\n\r":
        pos += 1
    return pos


def _head_answers(head: bytes, rid: tuple[int | str]) -> bool:
    """Whether an event longer than :data:`TAIL_MAX`, whose first bytes are ``head``, may carry
    the JSON-RPC response to the request ``rid``, read from its data's first members: the SDK
    writes a message's ``id`` before its ``result`` or ``error`` (pydantic's field order) and
    ``method`` before its large parts, so the member after the small ones tells. ``False`` only
    for a message with a ``method`` (a notification, or a request of the server's) or the
    response to another id; anything else counts as the answer: never a second one."""
    text = _data(head).decode("utf-8", "replace")  # the cut may split a character
    dec = json.JSONDecoder()
    pos = _skip(text, 0)
    if not text.startswith("{", pos):
        return True
    pos += 1
    rids: list[Any] = []
    while True:
        try:
            key, pos = dec.raw_decode(text, _skip(text, pos))
        except ValueError:  # cut before the member that tells
            return True
        pos = _skip(text, pos)
        if not isinstance(key, str) or not text.startswith(":", pos):
            return True
        if key == "method":
            return False
        if key in ("result", "error"):
            return not rids or rids[-1] == rid[0]
        try:
            value, pos = dec.raw_decode(text, _skip(text, pos + 1))
        except ValueError:
            return True
        if key == "id":
            rids.append(value)
        pos = _skip(text, pos)
        if not text.startswith(",", pos):
            return True
        pos += 1


def _request_id(body: bytes | None) -> tuple[int | str] | None:
    """``(id,)`` of the JSON-RPC request in ``body``, or None (a notification, no JSON)."""
    try:
        msg = json.loads(body or b"")
    except ValueError:
        return None
    if isinstance(msg, dict) and "method" in msg and type(msg.get("id")) in (int, str):
        return (msg["id"],)
    return None


async def _busy(send: Any) -> None:
    body = (b'{"jsonrpc":"2.0","id":null,"error":{"code":-32000,'
            b'"message":"Server busy: the worker holding the session did not answer"}}')
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _not_found(send: Any) -> None:
    body = b'{"jsonrpc":"2.0","id":null,"error":{"code":-32600,"message":"Session not found"}}'
    await send({"type": "http.response.start", "status": 404,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})
