#!/usr/bin/env python3
"""Kill table writers at random moments and check that the tables always recover.

    python tools/crash_loop.py [--rounds 2000] [--mode kill|exit|both] [--seed N]

Each round forks a fresh writer child over one registry. The child runs a pre-drawn list of
random operations on the ``cancellations`` (set) and ``in_flight`` (bag) tables and acknowledges
every completed operation to the parent through a pipe (4 bytes, atomic). Mode ``kill``: the
parent SIGKILLs it after a random delay (microseconds to milliseconds). Mode ``exit``: the
child arms a one-shot ``setitimer`` whose handler raises ``SystemExit`` (what gunicorn's handlers
do) and exits when it propagates. Then the parent:

- takes the lock (``with reg.lock``): when the child died holding it, this recovers it (repair
  included) and must take under 1 s;
- runs ``fsck`` again, which must repair nothing;
- compares both tables with the model: every acknowledged operation applied, the one in flight
  fully applied or absent (a bag ``delete`` of several rows may stop between rows: each row goes
  atomically), every row decodes to the value written (nothing torn).

``tests/shm/test_crash.py`` runs a few hundred rounds; this tool runs more and prints statistics.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import struct
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack

from shmcancel import Config, Registry, TableFull

KEYS = [("scope", f"r{i}") for i in range(20)]
ACK = struct.Struct("<I")
CAPACITY = 12  # rows per table: small, so that TableFull and long probe chains happen
Op = tuple[Any, ...]


def config() -> Config:
    return Config(max_rows=CAPACITY, capacity=CAPACITY, in_flight_capacity=CAPACITY,
                  session_capacity=16, lock_timeout=10.0)


def _p(x: Any) -> bytes:
    return msgpack.packb(x, use_bin_type=True)


def draw_ops(rng: random.Random, n: int) -> list[Op]:
    """``n`` random operations; values of varying lengths."""
    ops: list[Op] = []
    for _ in range(n):
        k = rng.choice(KEYS)
        x = rng.random()
        if x < 0.35:
            ops.append(("c_insert", k, ("x" * rng.randrange(0, 300), rng.random())))
        elif x < 0.45:
            ops.append(("c_insert_new", k, (None, rng.random())))
        elif x < 0.6:
            ops.append(("c_delete", k))
        elif x < 0.8:
            ops.append(("f_insert", k, (rng.randrange(4), 7, rng.randrange(3), 0)))
        elif x < 0.93:
            ops.append(("f_delete_object", k, (rng.randrange(4), 7, rng.randrange(3), 0)))
        else:
            ops.append(("f_delete", k))
    return ops


@dataclass
class Model:
    """Packed rows: the set as {key: value}, the bag as a set of (key, value)."""

    c: dict[bytes, bytes] = field(default_factory=dict)
    f: set[tuple[bytes, bytes]] = field(default_factory=set)

    def copy(self) -> Model:
        return Model(dict(self.c), set(self.f))

    def apply(self, op: Op) -> Model:
        m = self.copy()
        name, k = op[0], _p(op[1])
        if name == "c_insert":
            if k in m.c or len(m.c) < CAPACITY:
                m.c[k] = _p(op[2])
        elif name == "c_insert_new":
            if k not in m.c and len(m.c) < CAPACITY:
                m.c[k] = _p(op[2])
        elif name == "c_delete":
            m.c.pop(k, None)
        elif name == "f_insert":
            if (k, _p(op[2])) not in m.f and len(m.f) < CAPACITY:
                m.f.add((k, _p(op[2])))
        elif name == "f_delete_object":
            m.f.discard((k, _p(op[2])))
        elif name == "f_delete":
            m.f = {r for r in m.f if r[0] != k}
        return m


def run_op(reg: Registry, op: Op) -> None:
    name = op[0]
    t = reg.table("cancellations") if name[0] == "c" else reg.table("in_flight")
    try:
        if name.endswith("_insert"):
            t.insert(op[1], op[2])
        elif name.endswith("_insert_new"):
            t.insert_new(op[1], op[2])
        elif name.endswith("_delete_object"):
            t.delete_object(op[1], op[2])
        else:
            t.delete(op[1])
    except TableFull:
        pass


def state(reg: Registry) -> Model:
    """The tables as a Model (scan decodes every row: a torn one would raise or mismatch)."""
    m = Model()
    for k, v in reg.table("cancellations").scan():
        assert _p(k) not in m.c, f"set key {k!r} twice"
        m.c[_p(k)] = _p(v)
    for k, v in reg.table("in_flight").scan():
        m.f.add((_p(k), _p(v)))
    assert reg.table("cancellations").count() == len(m.c)
    assert reg.table("in_flight").count() == len(m.f)
    return m


def _child(reg: Registry, ops: list[Op], wfd: int, exit_after: float | None) -> None:
    try:
        if exit_after is not None:
            def raise_exit(signum: int, frame: Any) -> None:
                raise SystemExit(0)
            signal.signal(signal.SIGALRM, raise_exit)
            signal.setitimer(signal.ITIMER_REAL, exit_after)
        for i, op in enumerate(ops):
            run_op(reg, op)
            os.write(wfd, ACK.pack(i))
        os.write(wfd, ACK.pack(0xFFFFFFFF))  # ran out of ops
    except SystemExit:
        pass
    finally:
        os._exit(0)


@dataclass
class RoundResult:
    acked: int
    outcome: str  # "absent" | "applied" | "partial" | "done"
    held: bool  # the child died (or exited) holding the lock
    midwrite: bool  # ... between two stores of one mutation (a bucket version left odd)
    recovery: float  # seconds the parent's `with reg.lock` took


def one_round(reg: Registry, model: Model, rng: random.Random, mode: str,
              nops: int = 1500) -> tuple[Model, RoundResult]:
    """Fork a writer, interrupt it, recover, check; returns the new model."""
    ops = draw_ops(rng, nops)
    exit_after = rng.uniform(20e-6, 3e-3) if mode == "exit" else None
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        os.close(r)
        _child(reg, ops, w, exit_after)
    os.close(w)
    buf = b""
    try:
        if mode == "kill":
            # the first ack says the child is running ops; then a random moment
            while len(buf) < ACK.size:
                chunk = os.read(r, 4096)
                if not chunk:
                    break
                buf += chunk
            time.sleep(rng.choice((0, 0, 1e-5, 1e-4, 5e-4, 1e-3, 2e-3)) * rng.random())
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pid = 0
        while chunk := os.read(r, 65536):
            buf += chunk
    finally:
        if pid:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(r)
    acks = [ACK.unpack_from(buf, i)[0] for i in range(0, len(buf) - len(buf) % 4, 4)]
    done = bool(acks) and acks[-1] == 0xFFFFFFFF
    acks = [a for a in acks if a != 0xFFFFFFFF]
    assert acks == list(range(len(acks))), "acks out of order"
    acked = len(acks)

    owner = reg.lock.owner()
    held = owner is not None and owner[0] != os.getpid()
    midwrite = any(v & 1 for t in reg.tables.values() for v in t._ver.tolist())
    t0 = time.monotonic()
    with reg.lock:
        recovery = time.monotonic() - t0
        again = reg.fsck()
    assert all(not any(r.values()) for r in again.values()), f"second fsck repaired {again}"
    assert recovery < 1.0, f"recovery took {recovery:.3f}s"

    for op in ops[:acked]:
        model = model.apply(op)
    got = state(reg)
    if done or acked == len(ops):
        assert got == model, "state differs from the model after every op completed"
        return model, RoundResult(acked, "done", held, midwrite, recovery)
    nxt = model.apply(ops[acked])
    if got == model:
        outcome = "absent"
    elif got == nxt:
        outcome, model = "applied", nxt
    else:
        op = ops[acked]
        k = _p(op[1])
        partial = (op[0] == "f_delete" and got.c == model.c
                   and nxt.f <= got.f <= model.f
                   and all(r[0] == k for r in model.f - got.f))
        assert partial, f"state after a crash in {op!r} is neither before nor after it"
        outcome, model = "partial", got
    return model, RoundResult(acked, outcome, held, midwrite, recovery)


def run(name: str, rounds: int, mode: str, seed: int, verbose: bool = False) -> list[RoundResult]:
    """``rounds`` rounds over a fresh registry ``name`` (created and unlinked here)."""
    rng = random.Random(seed)
    reg = Registry.create(name, config())
    results = []
    try:
        model = Model()
        for i in range(rounds):
            m = mode if mode != "both" else ("kill", "exit")[i % 2]
            model, res = one_round(reg, model, rng, m)
            results.append(res)
            if verbose and (i + 1) % 100 == 0:
                print(f"  {i + 1} rounds", file=sys.stderr)
    finally:
        reg.close()
        reg.unlink()
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--mode", choices=("kill", "exit", "both"), default="both")
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    t0 = time.monotonic()
    res = run(f"crashloop-{os.getpid()}", args.rounds, args.mode, seed, verbose=True)
    rec = [r.recovery for r in res if r.held]
    outcomes = {o: sum(r.outcome == o for r in res) for o in ("absent", "applied", "partial",
                                                                "done")}
    print(f"seed {seed}: {len(res)} rounds in {time.monotonic() - t0:.1f}s, mode {args.mode}")
    print(f"in-flight op: {outcomes}; acked ops per round: median "
          f"{statistics.median(r.acked for r in res):.0f}")
    if rec:
        rec.sort()
        print(f"died holding the lock: {len(rec)} rounds; recovery s: median "
              f"{statistics.median(rec):.3f}, p99 {rec[int(len(rec) * 0.99) - 1]:.3f}, "
              f"max {rec[-1]:.3f}")
    print(f"killed between two stores of a mutation: {sum(r.midwrite for r in res)} rounds")
    print("every round: recovered, second fsck clean, acked ops present, nothing torn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
