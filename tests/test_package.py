"""The distribution as SPEC §1 pins it: its runtime dependencies are ``posix_ipc`` and
``msgpack`` only (gunicorn, redis, the MCP SDK are extras)."""

from __future__ import annotations

import re
import subprocess
import sys
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


def test_the_public_api_type_checks_and_a_misspelled_name_does_not(tmp_path: Path) -> None:
    """``py.typed`` promises types: a module ``__getattr__`` (the lazy ``McpServer``) made every
    name of ``shmcancel`` ``Any`` to mypy, so a misspelled one passed ``--strict``; and a tool
    taking its conn as the ``dict`` it is was refused."""
    program = tmp_path / "user.py"
    program.write_text(
        "from typing import Any\n"
        "import shmcancel\n"
        "from shmcancel.server import McpServer\n"
        "reg = shmcancel.Registry.create('x')\n"
        "c: shmcancel.Cancellation = shmcancel.Cancellation(reg)\n"
        "server = McpServer('n', '1', registry=reg)\n"
        "@server.tool('echo')\n"
        "def echo(conn: dict[str, Any], params: dict[str, Any]) -> str:\n"
        "    return 'x' if shmcancel.cancelled(conn) else 'y'\n"
        "shmcancel.Regsitry.create('y')\n")
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", "--cache-dir",
         str(tmp_path / "cache"), str(program)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)  # the installed package
    errors = [line for line in done.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1 and "user.py:10:" in errors[0] and "Regsitry" in errors[0], \
        done.stdout


def test_shmcancel_sdk_without_its_extra_names_the_extra() -> None:
    """Without the SDK (or httpx, which forwarding needs) ``import shmcancel.sdk`` raised a bare
    ``No module named 'mcp'`` (httpx's absence showed only at a session's first forward)."""
    for missing in ("mcp", "httpx"):
        done = subprocess.run(
            [sys.executable, "-c", f"import sys; sys.modules[{missing!r}] = None\n"
             "try:\n    import shmcancel.sdk\nexcept ImportError as e:\n    print(e)\n"],
            capture_output=True, text=True, timeout=60)
        assert done.stdout.strip() == (f"shmcancel.sdk needs the {missing} package: pip install "
                                       "'shmcancel[sdk]'"), done
