"""contract §4 against a plain-dict model, through the public names only: a stateful property
test of cancel / clear / cancelled / reason / track / untrack / in_flight / cleanup with an
injected clock, several scopes, small ``max_rows`` (or ``None``: the physical capacity) and
``max_rows_per_scope``."""

from __future__ import annotations

import socket
from collections import Counter

from helpers.clock import Clock
from helpers.names import fresh_registry_name
from helpers.procs import Chan, Child, fork
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import shmcancel

_STRIP = {c for lo, hi in ((0x00, 0x1F), (0x7F, 0x9F), (0x061C, 0x061C), (0x200B, 0x200F),
                           (0x2028, 0x202E), (0x2060, 0x2060), (0x2066, 0x2069),
                           (0xFEFF, 0xFEFF)) for c in range(lo, hi + 1)}


def model_reason(reason: object) -> str | None:
    """§4.2, written from the SPEC text."""
    if reason is None:
        return None
    text = reason if isinstance(reason, str) else repr(reason)
    raw = text.encode("utf-8", "replace")
    if len(raw) > 800:
        raw = raw[:800]
    text = raw.decode("utf-8", "ignore")
    text = "".join(ch for ch in text if ord(ch) not in _STRIP)
    return text[:200]


def model_key(rid: object) -> str | None:
    if isinstance(rid, bool):
        return None
    if isinstance(rid, int):
        return str(rid)
    if isinstance(rid, str) and len(rid.encode("utf-8")) <= 256:
        return rid
    return None


def model_room(rows: dict[tuple[str, str], tuple[str | None, float]], key: tuple[str, str],
               quota: int | None, cap: int, batch: int) -> bool:
    """§4.3-§4.4 on the model, before ``key`` is written: False when it is new and its scope is
    at its quota; else True, a batch evicted first when the table is at its cap (largest scope
    first, then oldest, then scope, then id)."""
    if key in rows:
        return True
    if quota is not None and sum(1 for s, _ in rows if s == key[0]) >= quota:
        return False
    if len(rows) >= cap:
        sizes: dict[str, int] = {}
        for s, _ in rows:
            sizes[s] = sizes.get(s, 0) + 1
        for x in sorted(rows, key=lambda x: (-sizes[x[0]], rows[x][1], x[0], x[1]))[:batch]:
            del rows[x]
    return True


IDS = st.one_of(st.integers(0, 4), st.sampled_from(["0", "1", "2", "3", "4", "x", "é", ""]),
                st.sampled_from([True, False, 1.0, "y" * 257, None]))
SCOPES = st.sampled_from(["global", "session:a", "principal:b", "ip:1.2.3.4"])
REASONS = st.one_of(st.none(), st.text(max_size=300), st.integers(), st.binary(max_size=8))


class CancellationModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.reg = None
        self._name_cm = None

    @initialize(max_rows=st.one_of(st.none(), st.integers(1, 12)),
                capacity=st.integers(1, 24),
                quota=st.one_of(st.none(), st.integers(1, 6)),
                ttl=st.sampled_from([0.0, 0.5, 3.0]))
    def setup(self, max_rows, capacity, quota, ttl):
        if max_rows is not None:
            capacity = max(capacity, max_rows)
        self._name_cm = fresh_registry_name()
        name = self._name_cm.__enter__()
        self.reg = shmcancel.Registry.create(name, config=shmcancel.Config(
            max_rows=max_rows, capacity=capacity, max_rows_per_scope=quota, ttl=ttl,
            in_flight_capacity=6, session_capacity=4))
        self.clock = Clock()
        self.c = shmcancel.Cancellation(self.reg, clock=self.clock)
        self.cap = capacity if max_rows is None else max_rows
        self.batch = max(1, self.cap // 20)
        self.quota, self.ttl = quota, ttl
        self.rows: dict[tuple[str, str], tuple[str | None, float]] = {}
        self.flying: Counter[tuple[str, str]] = Counter()  # rows: one per track (§4.5)

    def teardown(self) -> None:
        if self.reg is not None:
            self.reg.close()
            self.reg.unlink()
        if self._name_cm is not None:
            self._name_cm.__exit__(None, None, None)

    @rule(dt=st.sampled_from([0.0, 0.0001, 0.25, 1.0]))
    def tick(self, dt):
        self.clock.t += dt

    @precondition(lambda self: self.reg is not None)
    @rule(rid=IDS, reason=REASONS, scope=SCOPES)
    def cancel(self, rid, reason, scope):
        k = model_key(rid)
        try:
            self.c.cancel(rid, reason, scope)
            got = "ok"
        except shmcancel.InvalidRequestId:
            got = "invalid"
        except shmcancel.CancellationLimitReached:
            got = "limit"
        if rid is None:
            assert got == "ok"
            return
        if k is None:
            assert got == "invalid"
            return
        key = (scope, k)
        if not model_room(self.rows, key, self.quota, self.cap, self.batch):
            assert got == "limit"
            return
        assert got == "ok"
        self.rows[key] = (model_reason(reason), self.clock.t)

    @precondition(lambda self: self.reg is not None)
    @rule(rid=IDS, scope=SCOPES)
    def clear(self, rid, scope):
        self.c.clear(rid, scope)
        k = model_key(rid)
        if k is not None:
            self.rows.pop((scope, k), None)

    @precondition(lambda self: self.reg is not None)
    @rule(rid=IDS, scope=SCOPES)
    def track(self, rid, scope):
        k = model_key(rid)
        total = self.flying.total()
        try:
            self.c.track(rid, scope)
        except shmcancel.TableFull:
            assert k is not None and total >= 6
            return
        if k is not None:
            # a row per track, the same thread's again too (contract §4.5): full at 6 rows
            assert total < 6
            self.flying[scope, k] += 1

    @precondition(lambda self: self.reg is not None)
    @rule(rid=IDS, scope=SCOPES)
    def untrack(self, rid, scope):
        self.c.untrack(rid, scope)
        k = model_key(rid)
        if k is not None and self.flying[scope, k]:
            self.flying[scope, k] -= 1  # one of them: the namesake stays in flight

    @precondition(lambda self: self.reg is not None)
    @rule(ttl=st.one_of(st.none(), st.sampled_from([0, 0.25, 1.0, 100])))
    def cleanup(self, ttl):
        limit = self.ttl if ttl is None else ttl
        now = self.clock.t
        gone = [k for k, (_, at) in self.rows.items() if now - at > limit]
        for k in gone:
            del self.rows[k]
        assert self.c.cleanup(ttl) == len(gone)

    @precondition(lambda self: self.reg is not None)
    @rule(rid=IDS, scope=SCOPES)
    def read(self, rid, scope):
        k = model_key(rid)
        row = None if k is None else self.rows.get((scope, k))
        assert self.c.cancelled(rid, scope) is (row is not None)
        assert self.c.reason(rid, scope) == (None if row is None else row[0])
        assert self.c.in_flight(rid, scope) is (k is not None and self.flying[scope, k] > 0)

    @invariant()
    def all_reads_agree(self):
        if self.reg is None:
            return
        for (scope, k), (reason, _) in self.rows.items():
            assert self.c.cancelled(k, scope)
            assert self.c.reason(k, scope) == reason
        for (scope, k), n in self.flying.items():
            assert self.c.in_flight(k, scope) is (n > 0)


CancellationModel.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_cancellation_matches_the_model = CancellationModel.TestCase


# ------------------------------------------------------- the same model, two processes writing
def _serve(chan: Chan, name: str) -> None:
    """A second process on the registry: runs the ops it is sent (its clock set by each)."""
    clock = Clock()
    c = shmcancel.Cancellation(shmcancel.Registry.attach(name), clock=clock)
    while True:
        op = chan.recv(60)
        if op[0] == "exit":
            return
        clock.t = op[1]
        args = op[2:]
        try:
            if op[0] == "read":
                out: object = [c.cancelled(*args), c.reason(*args), c.in_flight(*args)]
            elif op[0] == "cleanup":
                out = c.cleanup(*args)
            else:
                out = getattr(c, op[0])(*args)
        except shmcancel.ShmCancelError as e:
            out = type(e).__name__
        chan.send(out)


PROC_IDS = st.one_of(st.integers(0, 3), st.sampled_from(["0", "1", "x", ""]))


class TwoProcessModel(RuleBasedStateMachine):
    """cancel / clear / track / untrack / cleanup from either process, reads from both (their
    cached polls must follow the other's writes)."""

    def __init__(self) -> None:
        super().__init__()
        self.reg = None
        self.kid = None
        self._name_cm = None

    @initialize(max_rows=st.one_of(st.none(), st.integers(1, 8)), capacity=st.integers(1, 12),
                quota=st.one_of(st.none(), st.integers(1, 4)))
    def setup(self, max_rows, capacity, quota):
        if max_rows is not None:
            capacity = max(capacity, max_rows)
        self._name_cm = fresh_registry_name()
        name = self._name_cm.__enter__()
        self.reg = shmcancel.Registry.create(name, config=shmcancel.Config(
            max_rows=max_rows, capacity=capacity, max_rows_per_scope=quota, ttl=1.0,
            in_flight_capacity=4, session_capacity=4))
        a, b = socket.socketpair()

        def run() -> None:
            a.close()
            _serve(Chan(b), name)
        pid = fork(run)
        b.close()
        self.kid = Child(pid, Chan(a))
        self.clock = Clock()
        self.c = shmcancel.Cancellation(self.reg, clock=self.clock)
        self.cap = capacity if max_rows is None else max_rows
        self.batch = max(1, self.cap // 20)
        self.quota = quota
        self.rows: dict[tuple[str, str], tuple[str | None, float]] = {}
        self.flying: Counter[tuple[int, str, str]] = Counter()  # one row per track (§4.5)

    def teardown(self) -> None:
        if self.kid is not None:
            self.kid.kill()
            self.kid.chan.sock.close()
        if self.reg is not None:
            self.reg.close()
            self.reg.unlink()
        if self._name_cm is not None:
            self._name_cm.__exit__(None, None, None)

    def _do(self, where: int, op: str, *args: object) -> object:
        if where:
            self.kid.send([op, self.clock.t, *args])
            return self.kid.recv()
        try:
            if op == "read":
                return [self.c.cancelled(*args), self.c.reason(*args), self.c.in_flight(*args)]
            return getattr(self.c, op)(*args)
        except shmcancel.ShmCancelError as e:
            return type(e).__name__

    @rule(dt=st.sampled_from([0.0001, 0.6]))
    def tick(self, dt):
        self.clock.t += dt

    @precondition(lambda self: self.reg is not None)
    @rule(where=st.integers(0, 1), rid=PROC_IDS, reason=st.one_of(st.none(), st.text(max_size=9)),
          scope=SCOPES)
    def cancel(self, where, rid, reason, scope):
        got = self._do(where, "cancel", rid, reason, scope)
        key = (scope, str(rid))
        if not model_room(self.rows, key, self.quota, self.cap, self.batch):
            assert got == "CancellationLimitReached"
            return
        assert got is None
        self.rows[key] = (model_reason(reason), self.clock.t)

    @precondition(lambda self: self.reg is not None)
    @rule(where=st.integers(0, 1), rid=PROC_IDS, scope=SCOPES)
    def clear(self, where, rid, scope):
        assert self._do(where, "clear", rid, scope) is None
        self.rows.pop((scope, str(rid)), None)

    @precondition(lambda self: self.reg is not None)
    @rule(where=st.integers(0, 1), rid=PROC_IDS, scope=SCOPES)
    def track(self, where, rid, scope):
        got = self._do(where, "track", rid, scope)
        row = (where, scope, str(rid))
        if got == "TableFull":
            assert self.flying.total() >= 4
            return
        assert got is None and self.flying.total() < 4
        self.flying[row] += 1

    @precondition(lambda self: self.reg is not None)
    @rule(where=st.integers(0, 1), rid=PROC_IDS, scope=SCOPES)
    def untrack(self, where, rid, scope):
        assert self._do(where, "untrack", rid, scope) is None
        if self.flying[where, scope, str(rid)]:
            self.flying[where, scope, str(rid)] -= 1

    @precondition(lambda self: self.reg is not None)
    @rule(where=st.integers(0, 1), ttl=st.one_of(st.none(), st.sampled_from([0, 0.5])))
    def cleanup(self, where, ttl):
        limit = 1.0 if ttl is None else ttl
        gone = [k for k, (_, at) in self.rows.items() if self.clock.t - at > limit]
        for k in gone:
            del self.rows[k]
        assert self._do(where, "cleanup", ttl) == len(gone)

    @precondition(lambda self: self.reg is not None)
    @rule(where=st.integers(0, 1), rid=PROC_IDS, scope=SCOPES)
    def read(self, where, rid, scope):
        row = self.rows.get((scope, str(rid)))
        flying = any(s == scope and k == str(rid) and n for (_, s, k), n in self.flying.items())
        assert self._do(where, "read", rid, scope) == [
            row is not None, None if row is None else row[0], flying]


TwoProcessModel.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_two_processes_match_the_model = TwoProcessModel.TestCase
