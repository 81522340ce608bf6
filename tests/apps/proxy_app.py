"""The app test_trusted_proxy.py serves with gunicorn (``transport_conf.py``): the transport
test app (``transport_app.py``: ``/mcp`` with sessions, ``/stateless`` without) behind the
trusted-proxy middleware that ``shmcancel/mcp/principal.py`` documents ("Behind a reverse proxy"),
taken from that docstring as it is written, trusting the proxy at ``127.0.0.1`` (or the
comma-separated ``proxies`` in ``$SHMCANCEL_TEST_PROXIES``). A ``scope`` tool answers the
caller's scope as the library sees it.
"""

from __future__ import annotations

import os

from shmcancel.principal import scope
from tests.apps.transport_app import build
from tests.helpers.proxy_doc import documented_middleware

PROXIES = os.environ.get("SHMCANCEL_TEST_PROXIES", "127.0.0.1/32").split(",")


TrustedProxy = documented_middleware()


def _with_scope_tool(server):
    @server.tool("scope")
    def scope_tool(conn, params):
        return scope(conn)

    return server


mcp = _with_scope_tool(build(True, "/mcp"))
stateless = _with_scope_tool(build(False, "/stateless"))


def _app(environ, start_response):
    if environ.get("PATH_INFO", "").rstrip("/") == "/stateless":
        return stateless(environ, start_response)
    return mcp(environ, start_response)


app = TrustedProxy(_app, proxies=PROXIES)
