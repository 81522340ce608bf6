"""What every part of the WSGI app shares: the server's settings (set by
:class:`~shmcancel.mcp.server.McpServer`'s constructor), its identity (``serverInfo``,
capabilities), the per-process registry state resolved after fork on first use, and a result reply
shaped for its wire.
"""

from __future__ import annotations

import threading
from typing import Any

from ..cancel.policy import Cancellation
from ..exceptions import RegistryIncompatible, RegistryNotFound, ShmCancelError
from ..shm import procinfo, registry
from . import jsonrpc
from .jsonrpc import Request
from .origin import OriginPolicy
from .reply import _body_reply, _Reply
from .session_storage import SessionStorage
from .sessions import SessionStore
from .wire import (
    Wire,
    shape_result,
)


class _ProcessState:
    """What a worker process needs of the registry, resolved after fork on first use."""

    __slots__ = ("cancellation", "pid", "registry", "sessions")

    def __init__(self, reg: Any) -> None:
        self.pid = procinfo.pid()
        self.registry = reg
        self.cancellation = Cancellation(reg)
        self.sessions: SessionStorage = SessionStore(reg)


class _NoRegistry(ShmCancelError):
    pass


class ServerBase:
    """The settings and per-process state the app's parts read; :class:`McpServer` sets them."""

    name: str
    version: str
    title: str | None
    instructions: str | None
    sessions: bool
    max_body_bytes: int
    poll_interval: float
    watch_disconnects: bool
    path: str | None
    cache_ttl_ms: int
    cache_scope: str
    origins: OriginPolicy
    _registry_spec: Any
    _state: _ProcessState | None
    _state_lock: threading.Lock

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
        pid = procinfo.pid()  # kept by an at-fork hook: no system call a request
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
                try:
                    reg = registry.Registry.attach(spec)
                except (RegistryNotFound, RegistryIncompatible) as e:  # the deployment's
                    raise _NoRegistry(str(e)) from None  # configuration, not the request
            else:
                reg = spec
            self._state = st = _ProcessState(reg)
            return st

    def _result(self, wire: Wire, msg: Request, result: dict[str, Any],
                json_ok: bool) -> _Reply:
        shaped = shape_result(wire, msg.method, result, server_info=self.server_info(),
                              ttl_ms=self.cache_ttl_ms, cache_scope=self.cache_scope)
        return _body_reply(200, jsonrpc.result_body(msg.id, shaped), json_ok)
