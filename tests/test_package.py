"""The distribution as SPEC §1 pins it: its runtime dependencies are ``posix_ipc`` and
``msgpack`` only (gunicorn, redis, the MCP SDK are extras)."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNTIME = {"posix-ipc", "msgpack"}


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[(]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_the_runtime_dependencies_are_posix_ipc_and_msgpack_only() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert {_name(r) for r in project["dependencies"]} == RUNTIME
    installed = [r for r in metadata.requires("shmcancel") or [] if "extra ==" not in r]
    assert {_name(r) for r in installed} == RUNTIME
