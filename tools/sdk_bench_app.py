"""The app ``tools/bench_sdk.py`` serves: the example's tools (examples/sdk/app.py), stateless with
JSON responses, wrapped by ``shmcancel.sdk.asgi`` or, with ``SHMCANCEL_SDK_BENCH_BARE=1``, the
SDK's own ``streamable_http_app`` alone (the baseline); ``SHMCANCEL_SDK_BENCH_STATEFUL=1``: stateful
(the SDK's default), with the session routing."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples",
                                "sdk"))
os.environ["SHMCANCEL_SDK_STATELESS"] = "1"

from app import mcp

import shmcancel.sdk

if os.environ.get("SHMCANCEL_SDK_BENCH_STATEFUL", "") not in ("", "0"):
    app = shmcancel.sdk.asgi(mcp)
elif os.environ.get("SHMCANCEL_SDK_BENCH_BARE", "") not in ("", "0"):
    app = mcp.streamable_http_app(stateless_http=True, json_response=True)
else:
    app = shmcancel.sdk.asgi(mcp, stateless_http=True, json_response=True)
