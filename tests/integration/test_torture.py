"""A CI-sized run of ``tools/torture.py`` (``--seconds 20``): a real gunicorn per scenario,
workers SIGKILLed, a stopped lock holder, HUP and USR2, a session flood, a cancel flood. Every
"must be 0" figure (5xx, bystander calls cancelled, legit sessions lost, rows left, scenario
errors) must be 0.

The tool runs as a subprocess with a deadline; on overrun it gets SIGTERM (it stops what it
started, in its ``finally``), then SIGKILL, and whatever still carries one of its registry names
in its environment is SIGKILLed by pid. Its registry names derive from ``shm_name``, so they are
unlinked afterwards and counted by the run's leftover check.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys

import pytest
from helpers.gunicorn_harness import REPO_ROOT, carrying
from helpers.procs import communicate

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SCENARIOS = ("steady", "lock-stall", "hup-usr2", "session-flood", "cancel-flood")
SECONDS = 20
DEADLINE = 240  # seconds for the whole run: starts, drains and stops are extra to --seconds


@pytest.mark.timeout(DEADLINE + 60)
def test_torture_must_be_zero_figures_are_zero(shm_name: str, shm_names: list[str]) -> None:
    shm_names.extend(f"{shm_name}-{s}" for s in SCENARIOS)
    proc = subprocess.Popen(
        [sys.executable, "tools/torture.py", "--seconds", str(SECONDS), "--json",
         "--registry-prefix", shm_name],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err, overran = communicate(proc, DEADLINE, grace=45)
        if overran:
            pytest.fail(f"tools/torture.py overran {DEADLINE} s:\n{err[-3000:]}")
    finally:
        for pid in carrying(shm_name, prefix=True):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    print(err)
    assert out.strip(), f"no JSON from tools/torture.py (exit {proc.returncode}):\n{err[-3000:]}"
    report = json.loads(out)
    assert [s["name"] for s in report["scenarios"]] == list(SCENARIOS)
    for s in report["scenarios"]:
        # the scenario really ran: requests served and a well-behaved client measured
        assert s["error"] is not None or (s["served"] > 0 and s["latency_samples"] > 0), s
    steady = report["scenarios"][0]
    assert steady["error"] is not None or steady["kills"] > 0, steady
    failed = {s["name"]: {k: s[k] for k in s["failed"]} | {"samples": s["samples"]}
              for s in report["scenarios"] if s["failed"]}
    assert not failed, f"{err}\n{json.dumps(failed, indent=1)[:6000]}"
    assert report["ok"] and proc.returncode == 0
