"""Stress the registry lock's dead-holder recovery: N rounds of SIGKILL-ing a holder while other
writers hammer the lock. Prints recovery-time percentiles and any violation.

    python3 tools/lock_kill_loop.py [--rounds 300] [--writers 2] [--raw-every 10]

Each round a victim process takes the lock, marks the critical section busy and dirties it, then
is SIGKILLed after a random 0-5 ms (every ``--raw-every``-th round it instead takes the raw
semaphore without recording itself, exercising the stable-generation rule). Writers increment a
shared counter under the lock and check that nobody else is inside (a busy flag; the repair
callback clears a dead holder's flag). The recovery time is from the kill to the takeover, as
reported by the ``("shmcancel", "lock", "recovered")`` telemetry of whichever writer recovered.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import select
import signal
import statistics
import sys
import time
import uuid

from shmcancel import telemetry
from shmcancel.shm.lock import RegistryLock
from shmcancel.shm.names import unlink_names
from shmcancel.shm.segment import Segment, TableSpec

COUNT, BUSY, VIOLATIONS, SEM_OVER = 0, 1, 2, 3


def writer(seg: Segment, lock: RegistryLock, report_w: int, stop_r: int) -> None:
    q = seg.region(0).cast("Q")
    lock._repair = lambda: q.__setitem__(BUSY, 0)  # a dead holder's flag is not a violation
    telemetry.attach("loop", ("shmcancel", "lock", "recovered"),
                     lambda e, m, md, c: os.write(
                         report_w, f"{time.monotonic():.6f} {md['dead_pid']}\n".encode()))
    while not select.select([stop_r], [], [], 0)[0]:
        with lock:
            if q[BUSY]:
                q[VIOLATIONS] += 1
            q[BUSY] = 1
            if seg.sem.value > 0:
                q[SEM_OVER] += 1
            q[COUNT] += 1
            q[BUSY] = 0
    q.release()


def victim(seg: Segment, lock: RegistryLock, w: int, raw: bool) -> None:
    q = seg.region(0).cast("Q")
    if raw:
        seg.sem.acquire()
        os.write(w, b"h")
        select.select([], [], [], 60)
    with lock:
        if q[BUSY]:
            q[VIOLATIONS] += 1
        q[BUSY] = 1
        lock.dirty = True
        os.write(w, b"h")
        while True:
            q[COUNT] += 0


def fork(fn, *args) -> int:
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            fn(*args)
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        finally:
            os._exit(code)
    return pid


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--writers", type=int, default=2)
    ap.add_argument("--raw-every", type=int, default=10)
    args = ap.parse_args()
    logging.getLogger("shmcancel.lock").setLevel(logging.ERROR)  # one warning per round

    name = f"lockloop-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    seg = Segment.create(name, b"", [TableSpec("t", "set", 1, 64, 4096)], timeout=10)
    lock = RegistryLock(seg)
    rep_r, rep_w = os.pipe()
    stop_r, stop_w = os.pipe()
    pids: list[int] = []
    times: list[float] = []
    raw_times: list[float] = []
    missing = 0
    try:
        pids += [fork(writer, seg, lock, rep_w, stop_r) for _ in range(args.writers)]
        buf = b""
        for rnd in range(args.rounds):
            raw = args.raw_every > 0 and rnd % args.raw_every == args.raw_every - 1
            hr, hw = os.pipe()
            vpid = fork(victim, seg, lock, hw, raw)
            os.close(hw)
            if not select.select([hr], [], [], 30)[0]:
                print(f"round {rnd}: victim never got the lock", file=sys.stderr)
                return 1
            os.read(hr, 1)
            os.close(hr)
            time.sleep(random.uniform(0, 0.005))
            t_kill = time.monotonic()
            os.kill(vpid, signal.SIGKILL)
            os.waitpid(vpid, 0)
            deadline = time.monotonic() + 5
            got = None
            while got is None and time.monotonic() < deadline:
                if select.select([rep_r], [], [], 0.05)[0]:
                    buf += os.read(rep_r, 4096)
                    while b"\n" in buf:
                        line, buf = buf.split(b"\n", 1)
                        ts, dead = line.split()
                        if int(dead) in (vpid, 0):
                            got = float(ts) - t_kill
            if got is None:
                missing += 1
                print(f"round {rnd}: no recovery within 5 s", file=sys.stderr)
            else:
                (raw_times if raw else times).append(got)
        os.write(stop_w, b"x")
        for p in pids:
            os.waitpid(p, 0)
        pids.clear()
        q = seg.region(0).cast("Q")
        count, violations, sem_over = q[COUNT], q[VIOLATIONS], q[SEM_OVER]
        q.release()
        recoveries = lock.recoveries

        def pct(xs: list[float], p: float) -> float:
            xs = sorted(xs)
            return xs[min(len(xs) - 1, int(p / 100 * len(xs)))] if xs else float("nan")

        print(f"rounds {args.rounds}, writers {args.writers}, recoveries {recoveries}, "
              f"missing {missing}, writes {count}")
        for label, xs in (("dead owner", times), ("unrecorded owner", raw_times)):
            if xs:
                print(f"{label:17s} n={len(xs):4d} recovery ms: p50 {pct(xs, 50) * 1e3:.0f}  "
                      f"p90 {pct(xs, 90) * 1e3:.0f}  p99 {pct(xs, 99) * 1e3:.0f}  "
                      f"max {max(xs) * 1e3:.0f}  mean {statistics.mean(xs) * 1e3:.0f}")
        print(f"double holders {violations}, semaphore value > 0 while held {sem_over}")
        ok = (violations == 0 and sem_over == 0 and missing == 0
              and recoveries == args.rounds and seg.sem.value == 1)
        print("OK" if ok else "FAILED")
        return 0 if ok else 1
    finally:
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
                os.waitpid(p, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        lock.close()
        seg.close()
        unlink_names(name)


if __name__ == "__main__":
    sys.exit(main())
