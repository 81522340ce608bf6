"""``transport_app`` behind a buffering middleware that never calls its answers' ``close()``
(PEP 3333 says it must; such middlewares are common): for tests/mcp/test_disconnect.py."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from tests.apps.transport_app import app as _inner


def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    return [b"".join(_inner(environ, start_response))]
