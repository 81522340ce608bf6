"""The trusted-proxy middleware that ``shmcancel/mcp/principal.py`` documents ("Behind a reverse
proxy"), taken from that docstring as it is written, so the tests check what users copy."""

from __future__ import annotations

import textwrap

import shmcancel.mcp.principal as documented


def documented_middleware() -> type:
    """The ``TrustedProxy`` class of the docstring's example, executed as written."""
    doc = documented.__doc__ or ""
    start = doc.index("header)::\n") + len("header)::\n")
    lines = []
    for line in doc[start:].splitlines():
        if line and not line.startswith("    "):
            break
        lines.append(line)
    ns: dict = {"mcp_app": object()}
    exec(textwrap.dedent("\n".join(lines)), ns)  # the documented example itself
    return ns["TrustedProxy"]
