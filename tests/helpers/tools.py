"""The scripts of tools/ that tests drive in-process, loaded by path (tools/ is not a package)."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from .gunicorn_harness import REPO_ROOT


def load_tool(name: str) -> ModuleType:
    """``tools/<name>.py`` as a module (loaded once)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
