"""What the WSGI app sends back: a reply (status, headers, body), or an exchange that turns into
a Server-Sent Events stream when the tool reports progress (the reply then ends that stream).

:func:`progress` is the tools' way in: it finds the request's exchange under :data:`PROGRESS_KEY`
in the environ. A failed write marks the exchange gone and calls its ``on_gone`` (the call
lifecycle cancels the request then, as for a disconnect).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from http import HTTPStatus
from typing import Any

from . import jsonrpc

StartResponse = Callable[..., Callable[[bytes], Any]]

PROGRESS_KEY = "shmcancel.progress"

# Status lines by code, phrases from http.HTTPStatus; 413 by its RFC 9110 name (Python < 3.13 still
# says "Request Entity Too Large").
_STATUS = {s.value: f"{s.value} {s.phrase}" for s in HTTPStatus} | {413: "413 Content Too Large"}

_SSE_HEADERS = [("Content-Type", "text/event-stream"), ("Cache-Control", "no-cache, no-transform"),
                ("X-Accel-Buffering", "no")]


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
    """What the WSGI callable sends: a status, headers and a body (or a streamed exchange).
    ``ends_connection``: the request's body was cut off where the server cannot tell its end,
    so where a next request would start on the connection is unknown; the connection ends
    after this reply."""

    __slots__ = ("body", "ends_connection", "headers", "status")

    def __init__(self, status: int, body: bytes = b"",
                 headers: list[tuple[str, str]] | None = None) -> None:
        self.status = status
        self.body = body
        self.headers = headers or []
        self.ends_connection = False


class _Exchange:
    """One request/response exchange: decides JSON vs SSE, streams progress. ``cut``: a write
    was cut short by a stop (see :meth:`send_event`); the connection must end with no more on
    it."""

    cut = False

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
        writing = False
        try:
            if self.write is None:
                self.write = self._start_response(_STATUS[200], list(_SSE_HEADERS))
            data = _sse(obj)
            writing = True
            self.write(data)
            return True
        except Exception:
            self.gone = True
            if self.on_gone is not None:
                self.on_gone()
            return False
        except BaseException:
            # A stop (gunicorn's quit or abort: SystemExit; RequestStopped) in the middle of a
            # write: part of the event may be on the wire, and anything after it (the call's
            # answer, the chunked body's end) would make the stream corrupt. Landing before the
            # write (in start_response, or as the event is encoded), nothing of it is out: the
            # call is answered on the stream as it stands.
            if writing:
                self.gone = self.cut = True
            raise


def _sse(obj: Any) -> bytes:
    return b"event: message\ndata: " + jsonrpc.encode(obj) + b"\n\n"


def _body_reply(status: int, body: dict[str, Any], json_ok: bool,
                encoded: bytes | None = None) -> _Reply:
    """``body`` as one JSON body, or as one SSE event when the client takes no JSON;
    ``encoded``: ``body`` already encoded (not encoded again)."""
    raw = jsonrpc.encode(body) if encoded is None else encoded
    if json_ok:
        return _Reply(status, raw, [("Content-Type", "application/json")])
    return _Reply(status, b"event: message\ndata: " + raw + b"\n\n", list(_SSE_HEADERS))


def _error_reply(status: int, id: int | str | None, code: int, message: str, data: Any = None,
                 *, headers: list[tuple[str, str]] | None = None) -> _Reply:
    reply = _body_reply(status, jsonrpc.error_body(id, code, message, data), True)
    if headers:
        reply.headers.extend(headers)
    return reply
