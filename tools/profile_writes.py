#!/usr/bin/env python3
"""Where a dispatched request's writes (``begin`` + ``end``) spend their time.

    python tools/profile_writes.py [--batches 30] [--batch 1000] [--cprofile]

Times, interleaved batch by batch (medians of ns/op), the whole pair for new ids (each request a
new key, as JSON-RPC ids usually are) and for a repeated id, and the parts it is made of: the
registry lock's enter+exit, preparing a key (msgpack + keyed hash), a ``Watch``, the in-flight
table's insert + delete of one row (a plain ``track`` row, found by value), add + remove of a
handle's row by its receipt (the row ``begin`` makes: in this process's lane while the shared
table has room, so not the in-flight table), ``clear`` of a key without a row. ``--cprofile``
adds the cProfile listing of 5000 pairs (relative weights only: profiling inflates small calls).
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import os
import pstats
import statistics
import sys
import time
import uuid
from collections.abc import Callable

from shmcancel import Config, Registry
from shmcancel.cancellation import Cancellation

_NOW = time.perf_counter_ns


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=30)
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--cprofile", action="store_true")
    args = ap.parse_args(argv)
    n = args.batch
    reg = Registry.create(f"profile-writes-{os.getpid()}-{uuid.uuid4().hex[:6]}",
                          Config(janitor_interval=3600.0))
    try:
        c = Cancellation(reg)
        st = c._store
        fresh = itertools.count()
        scope = "session:0123456789abcdef"
        owner = (os.getpid(), 1, 1, 0)
        lock = reg.lock

        def pair_new() -> None:
            c.begin(next(fresh), scope).end()

        def pair_same() -> None:
            c.begin(7, scope).end()

        def lock_hold() -> None:
            with lock:
                pass

        def prepare() -> None:
            reg.table("in_flight").prepare((scope, str(next(fresh))))

        def watch() -> None:
            st.watch(scope, str(next(fresh)))

        def track_untrack() -> None:  # a plain track() row (token 0): insert, then by value
            st.track(scope, "7", owner)
            st.untrack(scope, "7", owner)

        handle_owner = (*owner[:3], 1)

        def track_untrack_receipt() -> None:  # a handle's row (a token): add, then by receipt
            st.untrack(scope, "7", handle_owner, st.track(scope, "7", handle_owner))

        def clear_none() -> None:
            st.clear(scope, "7")

        parts: dict[str, Callable[[], None]] = {
            "begin + end, new id": pair_new,
            "begin + end, same id": pair_same,
            "lock enter + exit": lock_hold,
            "prepare a key": prepare,
            "Watch of a new key": watch,
            "in-flight insert + delete": track_untrack,
            "in-flight add + remove by receipt": track_untrack_receipt,
            "clear, no row": clear_none,
        }
        samples: dict[str, list[float]] = {k: [] for k in parts}
        for _ in range(args.batches):
            for k, f in parts.items():
                t0 = _NOW()
                for _ in range(n):
                    f()
                samples[k].append((_NOW() - t0) / n)
        print(f"medians of {args.batches} interleaved batches x {n} ops")
        for k, v in samples.items():
            print(f"  {k:30} {statistics.median(v) / 1000:7.2f} us")
        if args.cprofile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(5000):
                pair_new()
            prof.disable()
            pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(20)
    finally:
        reg.close()
        reg.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
