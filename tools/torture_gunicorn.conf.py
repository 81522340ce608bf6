"""gunicorn config of ``tools/torture.py``: the example's (``examples/gunicorn/gunicorn.conf.py``,
loaded as is: app, hooks, settings), with a registry sized and timed for torture.

- ``lock_timeout`` from ``SHMCANCEL_TORTURE_LOCK_TIMEOUT`` (seconds, default 0.5), so that a
  stopped lock holder is waited out within a short run;
- ``session_capacity`` from ``SHMCANCEL_TORTURE_SESSIONS`` (default 256), so that a session flood
  fills the table within seconds;
- ``graceful_timeout`` of 5 s, so that a ``HUP``/``USR2``/``TERM`` never waits long for workers.

Command-line flags (``-b``, ``-w``, ``-k``, ``--threads``) override these, as for the example.
"""

import os
import runpy

import shmcancel
import shmcancel.gunicorn

_EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "examples",
                        "gunicorn", "gunicorn.conf.py")
globals().update({k: v for k, v in runpy.run_path(os.path.normpath(_EXAMPLE)).items()
                  if not k.startswith("_")})

graceful_timeout = 5
shmcancel.gunicorn.configure(config=shmcancel.Config(
    ttl=300.0,
    lock_timeout=float(os.environ.get("SHMCANCEL_TORTURE_LOCK_TIMEOUT", "0.5")),
    session_capacity=int(os.environ.get("SHMCANCEL_TORTURE_SESSIONS", "256")),
))
