"""Sessions bounded per client (contract §6.1, issue #7 defect 3): the store over a real registry,
a model-based run of it, and a session flood from one loopback address against a real gunicorn
while a client at another address keeps an idle session and a busy one."""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import httpx
import pytest
from helpers.clock import Clock
from helpers.gunicorn_harness import Gunicorn
from helpers.mcp_client import ACCEPT, LEGACY, dump, reply_of
from helpers.procs import child, first_message, reap, recv
from helpers.session_calls import lane_row
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from shmcancel import Config, errors
from shmcancel.mcp.sessions import Session, SessionsFull, SessionStore
from shmcancel.shm.registry import Registry

TTL = 100.0
PER_CLIENT = 4
CAPACITY = 16


def small() -> Config:
    return Config(capacity=64, max_rows=64, in_flight_capacity=16, session_capacity=CAPACITY,
                  sessions_per_client=PER_CLIENT, session_ttl=TTL)


@pytest.fixture
def reg(shm_name: str) -> Iterator[Registry]:
    r = Registry.create(shm_name, small())
    try:
        yield r
    finally:
        r.close()


@pytest.fixture
def clock() -> Clock:
    return Clock(1000.0)


@pytest.fixture
def store(reg: Registry, clock: Clock) -> SessionStore:
    return SessionStore(reg, clock=clock)


def has_call_row(reg: Registry, sid: str) -> bool:
    """A ``session_calls`` row of ``sid`` in a lane or in the table."""
    return lane_row(reg, sid) or reg.table("session_calls").member(sid)


def mint(store: SessionStore, clock: Clock, client: str, n: int = 1) -> list[str]:
    out = []
    for _ in range(n):
        clock.t += 1
        out.append(store.create(LEGACY, client).id)
    return out


def live(store: SessionStore, ids: list[str]) -> list[str]:
    return [s for s in ids if store.get(s) is not None]


# ------------------------------------------------------------------------------ the store


def test_config_sessions_per_client() -> None:
    assert Config().sessions_per_client == 32
    assert Config(session_capacity=8).sessions_per_client == 8
    for bad in (0, -1, 1025, 17, True, 2.0, "4"):
        with pytest.raises(ValueError, match="sessions_per_client"):
            Config(session_capacity=16, sessions_per_client=bad)


def test_a_client_only_displaces_its_own_sessions(store: SessionStore, clock: Clock) -> None:
    a = mint(store, clock, "ip:192.0.2.1", 3)
    flood = mint(store, clock, "ip:192.0.2.66", 50)
    assert live(store, a) == a  # never displaced by another client
    assert live(store, flood) == flood[-4:]  # the flooder keeps its 4 newest
    assert store.count() == 7
    assert store.client_sessions("ip:192.0.2.66") == tuple(flood[-4:])
    # principal and address are different clients, even with the same text
    p = mint(store, clock, "principal:192.0.2.66", 4)
    assert live(store, p) == p and live(store, flood) == flood[-4:]


def test_a_session_remembers_whether_a_principal_minted_it(store: SessionStore) -> None:
    """The transport keeps a request without a principal out of a principal's sessions: the
    session's client digest says which kind of client minted it, for every client (a set bit
    taken from the hash would say "principal" for about half of the addresses)."""
    for i in range(64):
        for client, principal in ((f"ip:192.0.2.{i}", False), (f"principal:u{i}", True),
                                  (f"ip:2001:db8:{i:x}::/64", False), ("global", False),
                                  (f"principal:~sha256:{i:064x}", True)):
            s = store.create("2025-11-25", client)
            assert store.minted_for_principal(s) is principal, client
            assert store.minted_for_principal(store.get(s.id)) is principal, client
            assert s.client == store.client_digest(client)
            store.delete(s.id)
    assert not store.minted_for_principal(Session("x", 0.0, 0.0, "2025-11-25", b""))


def test_the_least_recently_seen_goes_first(store: SessionStore, clock: Clock) -> None:
    s = mint(store, clock, "ip:192.0.2.9", 4)
    clock.t += 5
    store.touch(store.get(s[0]))  # type: ignore[arg-type]
    mint(store, clock, "ip:192.0.2.9")
    assert live(store, s) == [s[0], s[2], s[3]]


def test_a_session_with_a_call_in_flight_is_never_displaced(store: SessionStore,
                                                            clock: Clock) -> None:
    s = mint(store, clock, "ip:192.0.2.9", 4)
    calls = [store.begin_call(store.get(s[0])), store.begin_call(store.get(s[0]))]  # type: ignore[arg-type]
    assert all(c is not None for c in calls)
    more = mint(store, clock, "ip:192.0.2.9", 10)
    assert store.get(s[0]) is not None and live(store, more) == more[-3:]
    store.end_call(calls[0])  # type: ignore[arg-type]
    mint(store, clock, "ip:192.0.2.9", 5)
    assert store.get(s[0]) is not None  # the other call still runs
    store.end_call(calls[1])  # type: ignore[arg-type]
    clock.t += 1
    more = mint(store, clock, "ip:192.0.2.9", 4)
    assert store.get(s[0]) is None  # idle now: displaceable again
    # every session of the client busy: refused, nothing written, nobody displaced
    busy = [store.begin_call(store.get(x)) for x in more]  # type: ignore[arg-type]
    before = store.client_sessions("ip:192.0.2.9")
    with pytest.raises(SessionsFull, match="call in flight") as e:
        store.create(LEGACY, "ip:192.0.2.9")
    assert e.value.retry_after > 0
    assert store.client_sessions("ip:192.0.2.9") == before and live(store, more) == more
    for c in busy:
        store.end_call(c)  # type: ignore[arg-type]


def test_a_call_touches_its_session_at_most_once_per_interval(store: SessionStore,
                                                              clock: Clock) -> None:
    """Short calls leave ``last_seen`` alone (no shared write); a call that outlasts the touch
    interval refreshes it at its end, so the session lives ``TTL`` from then."""
    sid = mint(store, clock, "ip:192.0.2.10")[0]
    seen = store.get(sid).last_seen  # type: ignore[union-attr]
    for _ in range(5):
        clock.t += 0.1
        call = store.begin_call(store.get(sid))  # type: ignore[arg-type]
        clock.t += 0.05
        store.end_call(call)  # type: ignore[arg-type]
    assert store.get(sid).last_seen == seen  # type: ignore[union-attr]
    call = store.begin_call(store.get(sid))  # type: ignore[arg-type]
    clock.t += TTL - 1  # a long call: never expires while it runs
    assert store.get(sid) is not None
    store.end_call(call)  # type: ignore[arg-type]
    ended = clock.t
    assert store.get(sid).last_seen == ended  # type: ignore[union-attr]
    clock.t = ended + TTL - 1
    assert store.get(sid) is not None
    clock.t = ended + TTL + 1
    assert store.get(sid) is None


def test_a_session_used_only_by_short_calls_still_expires(store: SessionStore,
                                                          clock: Clock) -> None:
    sid = mint(store, clock, "ip:192.0.2.11")[0]
    last = clock.t
    for _ in range(300):  # 30 s of calls every 0.1 s: touched about once a second
        clock.t += 0.1
        store.end_call(store.begin_call(store.get(sid)))  # type: ignore[arg-type]
        last = clock.t
    assert last - store.get(sid).last_seen <= 1.0  # type: ignore[union-attr]
    clock.t = last + TTL - 1.0 - 1e-6  # within ttl - interval of the last call: alive
    assert store.get(sid) is not None
    clock.t = last + TTL + 1e-6  # ttl after the last call: gone
    assert store.get(sid) is None


def test_a_lookup_racing_a_long_calls_end_finds_the_session(store: SessionStore,
                                                            reg: Registry,
                                                            clock: Clock) -> None:
    """A call longer than the ttl ends (its session touched, its row gone) just after another
    worker's lookup read the session row, still older than the ttl: the lookup then finds no
    call, and its expiry is refused under the lock (the row changed). The session is there,
    fresh: the lookup must return it, not ``None`` (a 404, which tells the client its session
    is gone for good)."""
    sid = mint(store, clock, "ip:192.0.2.12")[0]
    c = store.begin_call(store.get(sid))  # type: ignore[arg-type]
    assert c is not None
    clock.t += 3 * TTL
    armed: list[bool] = []

    def other_clock() -> float:
        if armed:  # the lookup has read the row: the call ends now, in its own worker
            armed.clear()
            store.end_call(c)
        return clock.t

    other = SessionStore(reg, clock=other_clock)
    assert other.get(sid) is not None  # the call runs (this lookup also ran its sweep piece)
    armed.append(True)
    found = other.get(sid)
    assert not armed  # the call ended inside that lookup
    assert store.get(sid) is not None  # kept: touched by its call's end
    assert found is not None


def test_a_dead_callers_row_does_not_pin_its_session(store: SessionStore, reg: Registry,
                                                     clock: Clock) -> None:
    s = mint(store, clock, "ip:192.0.2.9", 4)

    def run(w: int) -> None:
        c = SessionStore(reg, clock=clock).begin_call(store.get(s[0]))  # type: ignore[arg-type]
        os.write(w, b"ok" if c is not None else b"no")
        os._exit(0)  # never ends its call

    assert first_message(run)[1] == b"ok"
    assert has_call_row(reg, s[0])
    mint(store, clock, "ip:192.0.2.9", 4)
    assert live(store, s) == []  # given up, though the dead caller's row is still in its lane
    assert has_call_row(reg, s[0])


def test_begin_call_on_a_displaced_session_is_refused(store: SessionStore,
                                                      clock: Clock) -> None:
    s = mint(store, clock, "ip:192.0.2.9", 4)
    seen = store.get(s[0])
    mint(store, clock, "ip:192.0.2.9")  # displaces s[0] after the request looked it up
    assert store.begin_call(seen) is None  # type: ignore[arg-type]


def test_full_of_other_clients_refuses_a_new_client(store: SessionStore, reg: Registry,
                                                    clock: Clock) -> None:
    ids = []
    for i in range(4):
        ids += mint(store, clock, f"ip:192.0.2.{i}", 4)
    assert store.count() == 16
    rows = sorted(reg.table("sessions").scan())
    with pytest.raises(SessionsFull, match="full") as e:
        store.create(LEGACY, "ip:198.51.100.7")
    assert e.value.retry_after > 0
    assert sorted(reg.table("sessions").scan()) == rows  # nothing written, nobody evicted
    assert store.client_sessions("ip:198.51.100.7") == ()
    # even when every other session has expired, a mint removes none of them: the sweep does
    clock.t += TTL + 1
    with pytest.raises(SessionsFull):
        store.create(LEGACY, "ip:198.51.100.7")
    assert store.sweep_all() == 16 and store.count() == 0
    assert all(store.client_sessions(f"ip:192.0.2.{i}") == () for i in range(4))
    assert store.create(LEGACY, "ip:198.51.100.7") is not None


def test_in_a_full_table_a_client_replaces_its_own(store: SessionStore, clock: Clock) -> None:
    mine = mint(store, clock, "ip:192.0.2.1", 2)
    others = []
    for i in range(2, 6):
        others += mint(store, clock, f"ip:192.0.2.{i}", 4 if i < 5 else 2)
    assert store.count() == 16
    new = mint(store, clock, "ip:192.0.2.1")
    assert live(store, mine + new) == [mine[1], *new] and live(store, others) == others


def test_mint_never_scans_the_table(store: SessionStore, reg: Registry, clock: Clock,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    for i in range(4):
        mint(store, clock, f"ip:192.0.2.{i}", 4)
    clock.t += TTL + 1  # all expired: the old mint swept them all, under the lock

    def scan(*a: Any, **k: Any) -> Any:
        raise AssertionError("a mint scanned the sessions table")

    for name in ("scan", "delete_where", "scan_slots"):
        monkeypatch.setattr(reg.table("sessions"), name, scan)
    store._next_sweep = float("inf")  # no sweep piece due in this process
    for i in range(4):
        mint(store, clock, f"ip:192.0.2.{i}", 6)  # at its bound: replaces its own
    with pytest.raises(SessionsFull):
        store.create(LEGACY, "ip:198.51.100.7")


def test_expiry_is_swept_in_bounded_pieces(reg: Registry, clock: Clock) -> None:
    store = SessionStore(reg, clock=clock)
    ids = []
    for i in range(4):
        ids += mint(store, clock, f"ip:192.0.2.{i}", 4)
    busy = store.begin_call(store.get(ids[5]))  # type: ignore[arg-type]
    clock.t += TTL + 10
    nslots = reg.table("sessions").nslots
    removed = []
    for _ in range(2 * nslots // 16):  # a pass may miss a row shifted across the table's end
        removed.append(store.sweep(slots=16))  # one bucket of 16 index slots at a time
        assert removed[-1] <= 16
        if sum(removed) == 15:
            break
    assert sum(removed) == 15 and len([n for n in removed if n]) > 1
    assert store.count() == 1 and store.get(ids[5]) is not None  # busy: kept, though idle
    assert [store.client_sessions(f"ip:192.0.2.{i}") for i in range(4)] == [(), (ids[5],), (), ()]
    store.end_call(busy)  # type: ignore[arg-type]  # and seen now
    assert store.sweep_all() == 0
    clock.t += TTL + 10
    assert store.sweep_all() == 1 and store.count() == 0


def test_phantom_ids_are_dropped(store: SessionStore, reg: Registry, clock: Clock) -> None:
    """A writer killed between listing an id and inserting its session leaves a phantom: it
    never makes the client displace a live session, and the sweep drops it."""
    s = mint(store, clock, "ip:192.0.2.9", 3)
    digest = store.client_digest("ip:192.0.2.9")
    for listed in ((*s, "P" * 32), ("P" * 32, *s)):  # a mint or a displacement interrupted
        reg.table("session_clients").insert(digest, listed)
        new = mint(store, clock, "ip:192.0.2.9")
        assert live(store, s) == s and store.client_sessions("ip:192.0.2.9") == (*s, *new)
        store.delete(new[0])
    gone = store.client_digest("ip:192.0.2.10")
    reg.table("session_clients").insert(gone, ("Q" * 32,))
    store.sweep_all()
    assert store.client_sessions("ip:192.0.2.10") == ()
    assert reg.table("session_clients").get(gone) is None


def test_processes_minting_at_once_keep_the_bound(reg: Registry) -> None:
    store = SessionStore(reg)  # the wall clock, as the children's
    other = [store.create(LEGACY, "ip:192.0.2.1").id for _ in range(4)]

    def flood(w: int) -> None:
        mine = SessionStore(reg)
        for _ in range(60):
            mine.create(LEGACY, "ip:192.0.2.66")
        os.write(w, b"done")

    kids = [child(flood) for _ in range(3)]
    try:
        for _, r in kids:
            assert recv(r, timeout=60) == b"done"
    finally:
        for pid, r in kids:
            os.close(r)
            reap(pid)
    listed = store.client_sessions("ip:192.0.2.66")
    assert len(listed) == 4 and live(store, list(listed)) == list(listed)
    assert live(store, other) == other and store.count() == 8


def test_another_process_changing_a_session_is_seen_through_this_ones_cached_keys(
        store: SessionStore, reg: Registry, clock: Clock) -> None:
    """This process keeps each session's prepared keys and a watch of its row: a touch, a
    delete and a new session under the same id made by another process are all seen by the
    next get and begin_call here."""
    sid = mint(store, clock, "ip:192.0.2.5")[0]
    got = store.get(sid)
    assert got is not None and got.last_seen == clock.t
    call = store.begin_call(got)
    assert call is not None
    store.end_call(call)

    def in_child(fn: Any) -> None:
        def run(w: int) -> None:
            fn(SessionStore(reg, clock=Clock(clock.t + 50)))
            os.write(w, b"done")
        _, message = first_message(run)
        assert message == b"done"

    in_child(lambda other: other.touch(other.get(sid)))
    touched = store.get(sid)
    assert touched is not None and touched.last_seen == clock.t + 50
    in_child(lambda other: other.delete(sid))
    assert store.get(sid) is None and store.begin_call(got) is None
    in_child(lambda other: other.create(LEGACY, "ip:192.0.2.5", session_id=sid))
    again = store.get(sid)
    assert again is not None and again.created == clock.t + 50
    assert store.begin_call(again) is not None


def test_the_cached_session_keys_are_bounded(store: SessionStore, clock: Clock,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import shmcancel.mcp.sessions as sessions_mod

    monkeypatch.setattr(sessions_mod, "_KEYS_MAX", 3)
    ids = [f"{i:032d}" for i in range(10)]  # well-formed ids no session has
    for sid in ids:
        assert store.get(sid) is None
        assert len(store._keys) <= 3
    s = mint(store, clock, "ip:192.0.2.6")[0]
    assert store.get(s) is not None and s in store._keys


def test_delete_unlists(store: SessionStore, clock: Clock) -> None:
    s = mint(store, clock, "ip:192.0.2.9", 2)
    assert store.delete(s[0]) and not store.delete(s[0])
    assert store.client_sessions("ip:192.0.2.9") == (s[1],)
    assert store.delete(s[1]) and store.client_sessions("ip:192.0.2.9") == ()


# ------------------------------------------------------------------------------ model-based


CLIENTS = ["ip:192.0.2.1", "ip:192.0.2.2", "principal:alice", "ip:2001:db8::/64", "ip:unknown"]


class SessionModel(RuleBasedStateMachine):
    """The store against a dict: no client ever loses a session to another client's mint, a
    busy session is never removed, bounds always hold, and a refusal happens only when the
    client has nothing of its own to give up."""

    base = ""  # set by test_model: a fixture's name, and its list of names to unlink
    names: ClassVar[list[str]] = []
    made = itertools.count()

    def __init__(self) -> None:
        super().__init__()
        name = f"{self.base}.{next(self.made)}"
        self.names.append(name)
        self.reg = Registry.create(name, small())
        self.clock = Clock(1000.0)
        self.store = SessionStore(self.reg, clock=self.clock)
        self.store._next_sweep = float("inf")  # sweeps only when the rule runs one
        self.model: dict[str, tuple[str, float]] = {}  # id -> (client, last_seen)
        self.calls: dict[str, list[Any]] = {}

    def teardown(self) -> None:
        for cs in self.calls.values():
            for c in cs:
                self.store.end_call(c)
        self.reg.unlink()
        self.reg.close()

    @staticmethod
    def pick(data: st.DataObject, ids: list[str]) -> str:
        """One of ``ids`` (in minting order) by position: ids are random, positions are not."""
        return ids[data.draw(st.integers(0, len(ids) - 1))]

    def expired(self, sid: str) -> bool:
        return (self.clock.t - self.model[sid][1] > TTL
                and not self.calls.get(sid))

    def lookup(self, data: st.DataObject) -> tuple[str, Session | None]:
        """A session of the model and what ``get`` says of it: ``None`` exactly when the model
        says it expired (then it leaves the model too)."""
        sid = self.pick(data, list(self.model))
        s = self.store.get(sid)
        if self.expired(sid):
            assert s is None
            del self.model[sid]
            return sid, None
        assert s is not None
        return sid, s

    @rule(client=st.sampled_from(CLIENTS), dt=st.sampled_from([0.0, 1.0, 30.0]))
    def create(self, client: str, dt: float) -> None:
        self.clock.t += dt
        mine = [s for s, (c, _) in self.model.items() if c == client]
        idle = [s for s in mine if not self.calls.get(s)]
        must_displace = (len(mine) >= PER_CLIENT
                         or len(self.model) >= CAPACITY)
        try:
            new = self.store.create(LEGACY, client)
        except SessionsFull:
            assert must_displace and not idle
            return
        if must_displace:
            assert idle, "minted without anything of its own to give up"
            oldest = min(self.model[s][1] for s in idle)
            gone = [s for s in idle if self.reg.table("sessions").get(s) is None]
            assert len(gone) == 1 and self.model[gone[0]][1] == oldest
            del self.model[gone[0]]
        self.model[new.id] = (client, self.clock.t)

    @rule(data=st.data())
    @precondition(lambda self: self.model)
    def touch(self, data: st.DataObject) -> None:
        self.clock.t += 2
        sid, s = self.lookup(data)
        if s is None:
            return
        self.store.touch(s)
        self.model[sid] = (self.model[sid][0], self.clock.t)

    @rule(data=st.data())
    @precondition(lambda self: self.model and sum(map(len, self.calls.values())) < 16)
    def begin(self, data: st.DataObject) -> None:
        """(At most in_flight_capacity calls: a full session_calls table leaves a call
        unrecorded, as a full in-flight table leaves it uncancellable.)"""
        sid, s = self.lookup(data)
        if s is None:
            return
        c = self.store.begin_call(s)
        assert c is not None
        self.calls.setdefault(sid, []).append(c)
        client, last = self.model[sid]
        if self.clock.t - last >= 1.0:  # touched at most once a second
            self.model[sid] = (client, self.clock.t)

    @rule(data=st.data())
    @precondition(lambda self: any(self.calls.values()))
    def end(self, data: st.DataObject) -> None:
        sid = self.pick(data, [s for s, cs in self.calls.items() if cs])
        self.store.end_call(self.calls[sid].pop())
        if sid in self.model and self.clock.t - self.model[sid][1] >= 1.0:  # coalesced too
            self.model[sid] = (self.model[sid][0], self.clock.t)

    @rule(data=st.data())
    @precondition(lambda self: self.model)
    def delete(self, data: st.DataObject) -> None:
        sid = self.pick(data, list(self.model))
        assert self.store.delete(sid)
        del self.model[sid]

    @rule(dt=st.sampled_from([10.0, TTL]))
    def sweep(self, dt: float) -> None:
        self.clock.t += dt
        for _ in range(5):  # a backward shift may carry a row past a pass's cursor: repeat
            if self.store.sweep_all() == 0:
                break
        for sid in [s for s in self.model if self.expired(s)]:
            del self.model[sid]

    @invariant()
    def agrees(self) -> None:
        rows = dict(self.reg.table("sessions").scan())
        assert set(rows) == set(self.model)  # an expired one lingers until swept or read
        for client in CLIENTS:
            listed = self.store.client_sessions(client)
            assert len(listed) <= PER_CLIENT
            assert sorted(listed) == sorted(s for s, (c, _) in self.model.items() if c == client)
        assert len(rows) <= CAPACITY


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::hypothesis.errors.NonInteractiveExampleWarning")
def test_model(shm_name: str, shm_names: list[str]) -> None:
    SessionModel.base, SessionModel.names = shm_name, shm_names
    SessionModel.TestCase.settings = settings(
        max_examples=150, stateful_step_count=40, deadline=None,
        suppress_health_check=[HealthCheck.too_slow])
    SessionModel.TestCase().runTest()


# ------------------------------------------------------------------------------ over HTTP


def _client(source: str) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=15.0)


def _post(http: httpx.Client, url: str, obj: Any, sid: str | None = None) -> httpx.Response:
    h = {"Accept": ACCEPT, "Content-Type": "application/json"}
    if obj.get("method") != "initialize":
        h["MCP-Protocol-Version"] = LEGACY
    if sid is not None:
        h["Mcp-Session-Id"] = sid
    return http.post(url, content=json.dumps(obj).encode(), headers=h)


INIT = {"jsonrpc": "2.0", "id": 0, "method": "initialize",
        "params": {"protocolVersion": LEGACY, "capabilities": {},
                   "clientInfo": {"name": "sessions-test", "version": "1"}}}


def _initialize(http: httpx.Client, url: str) -> httpx.Response:
    return _post(http, url, INIT)


def _echo(http: httpx.Client, url: str, sid: str, text: str) -> httpx.Response:
    return _post(http, url, {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                             "params": {"name": "echo", "arguments": {"text": text}}}, sid)


@pytest.mark.slow
@pytest.mark.integration
def test_a_flood_from_one_address_logs_nobody_else_out(shm_name: str, tmp_path: Any) -> None:
    """127.0.0.2 loops initialize (past the table's 64 sessions, 3 times over) while 127.0.0.1
    holds one idle session and 127.0.0.2 itself runs a long call in one of its own: afterwards
    both still work; then a third address finds the table full of others' live sessions and is
    told to retry (HTTP 200 carrying the JSON-RPC error -32000 for its request's id, with
    Retry-After: a request the client could read, contract §5; it was a 503, which an SDK client
    takes for a transport failure), and nobody lost a session to it."""
    conf = tmp_path / "conf.py"
    conf.write_text(
        "import shmcancel, shmcancel.gunicorn\n"
        "from shmcancel.gunicorn import child_exit, on_exit, post_fork, when_ready  # noqa\n"
        "control_socket_disable = True\ntimeout = 30\n"
        "shmcancel.gunicorn.configure(config=shmcancel.Config(session_capacity=64))\n")
    env = {"SHMCANCEL_TEST_DIR": str(tmp_path)}
    with Gunicorn("tests.apps.transport_app:app", registry_name=shm_name, config=str(conf),
                  workers=2, env=env) as g, \
            _client("127.0.0.1") as idle, _client("127.0.0.2") as flood, \
            _client("127.0.0.3") as third, _client("127.0.0.4") as late:
        url = g.url
        r = _initialize(idle, url)
        assert r.status_code == 200
        sid = r.headers["mcp-session-id"]
        assert reply_of(_echo(idle, url, sid, "before"))["result"]["content"][0]["text"] == "before"

        r = _initialize(flood, url)
        busy_sid = r.headers["mcp-session-id"]
        call: dict[str, Any] = {}

        def long_call() -> None:
            with _client("127.0.0.2") as h:
                call["reply"] = reply_of(_post(h, url, {
                    "jsonrpc": "2.0", "id": 7, "method": "tools/call",
                    "params": {"name": "sleep", "arguments": {"seconds": 3, "tag": "busy"}}},
                    busy_sid))

        t = threading.Thread(target=long_call, daemon=True)
        t.start()
        deadline = time.monotonic() + 10
        while not (tmp_path / "busy.started").exists():
            assert time.monotonic() < deadline, "the long call did not start"
            time.sleep(0.01)
        statuses = [_initialize(flood, url).status_code for _ in range(200)]
        assert statuses == [200] * 200  # a client always gets a session by giving up its own
        t.join(15)
        assert call["reply"]["result"]["content"][0]["text"] == "slept 3s", call

        r = _echo(idle, url, sid, "after")
        assert r.status_code == 200, r.text  # base: 404, evicted by the flood
        assert reply_of(r)["result"]["content"][0]["text"] == "after"
        r = _echo(flood, url, busy_sid, "busy")
        assert r.status_code == 200, r.text  # never displaced while its call ran
        assert dump(shm_name)["sessions"] == 1 + 32  # 127.0.0.2 holds its 32, no more

        for _ in range(40):  # 127.0.0.3 takes its 31 (the table's last rows), then its own
            assert _initialize(third, url).status_code == 200
        assert dump(shm_name)["sessions"] == 64
        r = _initialize(late, url)
        assert r.status_code == 200, r.text
        assert int(r.headers["retry-after"]) > 0
        assert r.json()["id"] == INIT["id"], r.text
        err = r.json()["error"]
        assert err["code"] == errors.SERVER_ERROR and "retry" in err["message"]
        assert "mcp-session-id" not in r.headers
        assert _echo(idle, url, sid, "still").status_code == 200
        assert _echo(flood, url, busy_sid, "still").status_code == 200


def test_the_transport_holds_sessions_through_the_storage_interface(reg: Registry,
                                                                      store: SessionStore) -> None:
    from shmcancel.mcp.base import _ProcessState
    from shmcancel.mcp.session_storage import SessionStorage

    assert isinstance(store, SessionStorage)
    st = _ProcessState(reg)
    assert isinstance(st.sessions, SessionStorage)
    s = st.sessions.create("2025-06-18", "ip:192.0.2.1")
    call = st.sessions.begin_call(s)
    assert call is not None and st.sessions.get(s.id) is not None
    st.sessions.end_call(call)
    assert st.sessions.delete(s.id) and st.sessions.get(s.id) is None


def test_a_mint_planned_during_another_mints_commit_does_not_unlist_its_session(
        reg: Registry, clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two workers minting for one client at once (contract §6.1, sessions bounded per client).
    A commits its mint under the lock: the client row listing its new id first, then the
    session row. B plans lock-free in between: at the bound it sees A's id listed with no
    session yet (what an interrupted mint leaves) and drops it as a phantom. Re-checked under the
    lock only against the client row, which A wrote before B read it, B's plan passed and it
    rewrote the row without A's id: A's live session was counted against nobody, and a client
    minting from several workers at once grew the table past ``sessions_per_client`` (8
    concurrent initializes from one address against the example server left 17 such sessions
    beyond its 32 in 9 000 mints)."""
    a = SessionStore(reg, clock=clock)
    b = SessionStore(reg, clock=clock)
    client = "ip:192.0.2.7"
    mint(a, clock, client, PER_CLIENT - 1)
    planned: list[Any] = []
    insert_new = a._table.insert_new

    def between_client_row_and_session_row(sid: str, value: Any) -> bool:
        planned.append(b._plan(b.client_digest(client), clock()))  # B's lock-free plan
        return insert_new(sid, value)

    monkeypatch.setattr(a._table, "insert_new", between_client_row_and_session_row)
    sa = a.create(LEGACY, client).id
    monkeypatch.undo()
    plan_b = b._plan
    monkeypatch.setattr(b, "_plan", lambda digest, now: planned.pop() if planned
                        else plan_b(digest, now))
    clock.t += 1
    sb = b.create(LEGACY, client).id
    listed = a.client_sessions(client)
    assert sa in listed and sb in listed, (sa, sb, listed)
    assert a.count() == len(listed) <= PER_CLIENT  # every session counted, none beyond the bound


def test_adopting_a_session_already_adopted_here_keeps_the_clients_others(
        reg: Registry, store: SessionStore, clock: Clock) -> None:
    """contract §6.1: a client's session is given up only for a session of its own that is
    new. Two requests of a session minted on another host both miss it here and both adopt it
    (legacy._adopt_session); the second, in another worker, found the id stored already: it
    gave up the client's least recently seen session, listed the id twice and raised "session
    id collision" (its request answered 404)."""
    client = "ip:192.0.2.30"
    mine = mint(store, clock, client, PER_CLIENT - 1)
    sid = "A" * 32  # minted elsewhere
    clock.t += 1
    store.create(LEGACY, client, session_id=sid)

    def adopt(w: int) -> None:
        got = SessionStore(reg, clock=Clock(clock.t + 1)).create(LEGACY, client, session_id=sid)
        os.write(w, got.id.encode())

    _, message = first_message(adopt)
    assert message == sid.encode()
    assert store.client_sessions(client) == (*mine, sid)
    assert all(store.get(s) is not None for s in (*mine, sid))


def test_sessions_expire_after_the_clock_steps_back(reg: Registry, clock: Clock) -> None:
    """contract §6.1 / README ``session_ttl``: a session idle for ``session_ttl`` expires. The
    clock (wall time, shared by every process) steps back two hours (NTP, a restored VM):
    every session then looks last seen in the future, so it was neither expired nor touched
    (a touch refuses to write an older ``last_seen``) until the clock caught up, two hours
    plus the ttl later. A table full of departed clients' sessions refused every new client
    (503) for as long as the step. As the janitor's schedule does (``sweep_due``), a
    ``last_seen`` more than an interval ahead counts as seen before the step: the sweep
    stamps it now, so it expires one ttl after the step was noticed."""
    start = clock.t

    def mint_elsewhere(w: int) -> None:  # another worker, on the same clock
        other = SessionStore(reg, clock=Clock(start))
        for i in range(4):
            for _ in range(PER_CLIENT):
                other._clock.t += 1  # type: ignore[attr-defined]
                other.create(LEGACY, f"ip:192.0.2.{i}")
        os.write(w, b"done")

    assert first_message(mint_elsewhere)[1] == b"done"
    store = SessionStore(reg, clock=clock)
    assert store.count() == CAPACITY
    clock.t = start - 7200.0  # the clock steps back
    step = clock.t
    while clock.t - step <= TTL + 10:  # the server goes on: a sweep piece now and then
        clock.t += 5
        store.sweep_all()
    assert store.count() == 0  # every one idle for more than the ttl since the step
    assert store.create(LEGACY, "ip:198.51.100.7") is not None


def test_a_call_running_across_a_clock_step_back_keeps_its_session(reg: Registry,
                                                                   clock: Clock) -> None:
    """A call that began before the clock stepped back remembers the ``last_seen`` it found
    (now in the future), so its end makes no touch. Had another worker's sweep stamped the
    session while the call ran, a call longer than the ttl would end with its session already
    expired (its client's next request: 404). A busy session is stamped only once idle."""
    store = SessionStore(reg, clock=clock)
    sid = mint(store, clock, "ip:192.0.2.40")[0]
    call = store.begin_call(store.get(sid))  # type: ignore[arg-type]
    assert call is not None
    clock.t -= 7200.0  # the clock steps back while the call runs
    step = clock.t

    def sweep_elsewhere(w: int) -> None:  # another worker goes on sweeping meanwhile
        other = SessionStore(reg, clock=Clock(step))
        while other._clock.t - step <= TTL + 10:  # type: ignore[attr-defined]
            other._clock.t += 5  # type: ignore[attr-defined]
            other.sweep_all()
        os.write(w, b"done")

    assert first_message(sweep_elsewhere)[1] == b"done"
    clock.t = step + TTL + 15
    store.end_call(call)  # a call longer than the ttl ends
    assert store.get(sid) is not None
    clock.t += 5
    store.sweep_all()  # idle now: stamped, it expires one ttl from here
    assert store.get(sid) is not None
    clock.t += TTL + 5
    store.sweep_all()
    assert store.get(sid) is None
