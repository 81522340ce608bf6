"""Read the conformance suite's results folder: ``{scenario: (passed, detail)}``."""

from __future__ import annotations

import json
import pathlib
import re


def scenarios(folder: pathlib.Path) -> dict[str, tuple[bool, str]]:
    """One entry a scenario run into ``folder``: passed when every check succeeded (and there was
    one); ``detail`` is the first failure's message, or the number of checks."""
    got = {}
    for checks in sorted(folder.glob("*/checks.json")):
        name = re.sub(r"-\d{4}-\d\d-\d\dT[\dZ-]+$", "", checks.parent.name.removeprefix("server-"))
        results = json.loads(checks.read_text())
        failed = [c for c in results if c.get("status") not in ("SUCCESS", "INFO")]
        detail = (failed[0].get("errorMessage") or failed[0].get("description", "")) \
            if failed else f"{len(results)} check(s)"
        got[name] = (not failed and bool(results), " ".join(str(detail).split()))
    return got
