"""The poll fast paths (issue #9) answer exactly as the general path (contract §4.1): 42 and "42"
are one request; bools, floats, over-long or unencodable ids are invalid; subclasses key as
their base type's text; a poll never raises. And ``import shmcancel`` stays light."""

from __future__ import annotations

import enum
import os
import subprocess
import sys
import textwrap
import types

import pytest
from helpers import procs
from helpers.rows import in_flight_rows, scope_counts

from shmcancel import Config, cancelled, principal
from shmcancel.cancel.policy import _WATCH_CACHE, Cancellation
from shmcancel.shm.reader import Watch
from shmcancel.shm.registry import Registry

SMALL = {"capacity": 400, "max_rows": 200, "in_flight_capacity": 64, "session_capacity": 16}
S = "ip:192.0.2.1"


@pytest.fixture
def c(shm_name):
    reg = Registry.create(shm_name, Config(**SMALL))
    try:
        yield Cancellation(reg)
    finally:
        reg.close()
        reg.unlink()


class Num(enum.IntEnum):
    ANSWER = 42


class Text(str):
    pass


class Sly(str):
    """A scope that claims to equal (and hash like) every str: never enters the cache (entries
    are keyed by plain text), so it cannot change another scope's answer. Like any object that
    claims equality with a dict key, it may be answered from the entry it claims to equal."""

    def __eq__(self, other: object) -> bool:
        return True

    def __hash__(self) -> int:
        return hash(S)


def test_int_and_str_forms_are_one_request_once_cached(c):
    for x in (42, "42", Num.ANSWER, Text("42")):  # warm the caches: all not cancelled
        assert c.cancelled(x, S) is False
        assert c.in_flight(x, S) is False
    c.cancel(42, "r", S)
    h = c.begin("42", S)
    for _ in range(2):  # the second round answers from the caches
        for x in (42, "42", Num.ANSWER, Text("42")):
            assert c.cancelled(x, S) is True
            assert c.in_flight(x, S) is True
    c.clear("42", S)
    h.end()
    for x in (42, "42", Num.ANSWER, Text("42")):
        assert c.cancelled(x, S) is False
        assert c.in_flight(x, S) is False


@pytest.mark.parametrize("bad", [True, False, 1.0, 42.0, "x" * 257, "é" * 129,
                                 "\ud800", b"42", None, [42]])
def test_invalid_ids_never_hit_a_cached_valid_one(c, bad):
    for good in (1, 0, 42, "x" * 256, "é" * 128, 10**256 - 1, 10**256):
        c.cancel(good, None, S)
        c.begin(good, S)
        assert c.cancelled(good, S) and c.in_flight(good, S)  # cached now
    for _ in range(2):
        assert c.cancelled(bad, S) is False
        assert c.in_flight(bad, S) is False
        assert c.cancelled({"REMOTE_ADDR": "192.0.2.1", "shmcancel.request_id": bad}) is False


def test_a_scope_subclass_does_not_poison_the_cache(c):
    c.cancel(7, None, "ip:192.0.2.99")
    assert c.cancelled(7, Sly("ip:192.0.2.99")) is True  # keys as its plain text
    assert c.in_flight(7, Sly("ip:192.0.2.99")) is False
    assert c.cancelled(7, S) is False  # not answered by the subclass's entry
    assert c.cancelled(7, "ip:192.0.2.99") is True
    for _ in range(2):  # an honest subclass is answered as its text, cached or not
        assert c.cancelled(7, Text("ip:192.0.2.99")) is True
        assert c.cancelled(7, Text(S)) is False


BAD_TEXT_SCOPES = ["\ud800", "ip:\udcff", "a" * 513, "é" * 257, Text("a" * 513)]


def test_bad_scopes_are_false_never_raise(c):
    c.cancel(5, None, S)
    assert c.cancelled(5, S)
    for scope in (None, 5, b"ip:192.0.2.1", object(), ["ip"], *BAD_TEXT_SCOPES):
        assert c.cancelled(5, scope) is False  # type: ignore[arg-type]
        assert c.in_flight(5, scope) is False  # type: ignore[arg-type]
        assert c.reason(5, scope) is None  # type: ignore[arg-type]


@pytest.mark.parametrize("scope", BAD_TEXT_SCOPES, ids=["surrogate", "surrogate in ip", "513 B",
                                                        "257 x 2 B", "a subclass, 513 B"])
def test_a_scope_that_cannot_be_stored_is_a_clear_error_and_writes_nothing(c, scope):
    """contract §3: a scope is at most 512 UTF-8 bytes (what scope(conn) makes, what the tables
    are sized for). One passed by hand beyond that, or with a lone surrogate (not encodable),
    is refused by cancel with a ValueError naming the bound, ignored by the writes that
    ignore bad ids, and reads as absent; no row is written either way."""
    with pytest.raises(ValueError, match="at most 512 UTF-8 bytes"):
        c.cancel(5, "r", scope)
    with pytest.raises(ValueError, match="at most 512 UTF-8 bytes"):
        c.cancel_if_in_flight(5, "r", scope)
    c.track(5, scope)
    c.untrack(5, scope)
    c.clear(5, scope)
    with c.begin(5, scope) as h:
        assert not h.tracked and not h.cancelled()
    assert c.cancel_scope(scope) == 0
    reg = c.registry
    assert reg.table("cancellations").count() == 0 and reg.table("in_flight").count() == 0


def test_reason_and_cancelled_at_read_a_scope_subclass_as_its_text(c):
    c.cancel(5, "why", Text(S))  # a StrEnum member is such a subclass
    for scope in (S, Text(S)):
        assert c.reason(5, scope) == "why" and c.cancelled_at(5, scope) is not None


def test_the_largest_scopes_are_stored(c):
    for scope in ("a" * 512, "é" * 256, Text("€" * 170 + "ab")):
        c.cancel(5, "x" * 800, scope)
        with c.begin("y" * 256, scope) as h:
            assert h.tracked and c.in_flight("y" * 256, scope)
        assert c.cancelled(5, scope) and c.reason(5, scope) == "x" * 200
        c.clear(5, scope)
        assert not c.cancelled(5, scope)


def test_caches_stay_bounded_and_correct(c):
    c.cancel(3, None, S)
    for i in range(3 * _WATCH_CACHE):
        assert c.cancelled(i, f"ip:10.0.{i % 7}.1") is False
        assert c.in_flight(i, S) is False
    assert c._watches.n <= _WATCH_CACHE and c._in_flight_polls.n <= _WATCH_CACHE
    assert sum(len(v) for v in c._watches.values()) == c._watches.n
    assert c.cancelled(3, S) is True


def test_conn_polls_match_the_general_path(c):
    c.cancel(9, None, "ip:192.0.2.1")
    c.cancel(9, None, "session:abc")
    conns = [
        ({"REMOTE_ADDR": "192.0.2.1", "shmcancel.request_id": 9}, True),
        ({"REMOTE_ADDR": "192.0.2.1", "shmcancel.request_id": "9"}, True),
        ({"REMOTE_ADDR": "::ffff:192.0.2.1", "shmcancel.request_id": 9}, True),
        ({"REMOTE_ADDR": "192.0.2.2", "shmcancel.request_id": 9}, False),
        ({"REMOTE_ADDR": 1234, "shmcancel.request_id": 9}, False),
        ({"REMOTE_ADDR": "192.0.2.1", "shmcancel.session_id": "abc",
          "shmcancel.request_id": 9}, True),
        ({"REMOTE_ADDR": "192.0.2.1", "shmcancel.session_id": "abd",
          "shmcancel.request_id": 9}, False),
        ({"REMOTE_ADDR": "192.0.2.1", "shmcancel.principal": {"id": "u"},
          "shmcancel.request_id": 9}, False),
        ({"REMOTE_ADDR": "192.0.2.1", "shmcancel.request_id": True}, False),
        ({"REMOTE_ADDR": "192.0.2.1"}, False),
    ]
    for _ in range(2):
        for conn, want in conns:
            assert c.cancelled(conn) is want, conn


def test_other_mappings_and_nested_ones(c):
    c.cancel(9, None, "ip:192.0.2.1")
    inner = {"REMOTE_ADDR": "192.0.2.1", "shmcancel.request_id": 9}
    for _ in range(2):
        assert c.cancelled(types.MappingProxyType(inner)) is True
        # a mapping where the id goes is an invalid id, not a conn to look into
        assert c.cancelled({"REMOTE_ADDR": "192.0.2.1",
                            "shmcancel.request_id": types.MappingProxyType(inner)}) is False
        assert c.cancelled({"REMOTE_ADDR": "192.0.2.1", "shmcancel.request_id": inner}) is False


def test_a_foreign_handle_falls_back_to_the_request_id(c, shm_names):
    name = f"{c.registry.name}-b"
    shm_names.append(name)
    other_reg = Registry.create(name, Config(**SMALL))
    try:
        h = Cancellation(other_reg).begin(9, "ip:192.0.2.1")
        conn = {"REMOTE_ADDR": "192.0.2.1", "shmcancel.request_id": 9, "shmcancel.handle": h}
        assert c.cancelled(conn) is False
        c.cancel(9, None, "ip:192.0.2.1")
        assert c.cancelled(conn) is True  # this Cancellation's row, not the handle's registry
        assert h.cancelled() is False
        h.end()
    finally:
        other_reg.close()
        other_reg.unlink()


@pytest.mark.parametrize("environ,scope", [
    ({"REMOTE_ADDR": "203.0.113.9"}, "ip:203.0.113.9"),
    ({"REMOTE_ADDR": "::ffff:203.0.113.9"}, "ip:203.0.113.9"),
    ({"REMOTE_ADDR": "2001:db8:1:2:3:4:5:6"}, "ip:2001:db8:1:2::/64"),
    ({"REMOTE_ADDR": "nonsense"}, "ip:unknown"),
    ({"REMOTE_ADDR": None}, "ip:unknown"),
    ({}, "ip:unknown"),
    ({"REMOTE_ADDR": "203.0.113.9", "shmcancel.session_id": "s1"}, "session:s1"),
    ({"REMOTE_ADDR": "203.0.113.9", "shmcancel.session_id": ""}, "ip:203.0.113.9"),
    ({"REMOTE_ADDR": "203.0.113.9", "shmcancel.principal": {"id": "alice"}}, "principal:alice"),
    ({"REMOTE_ADDR": "203.0.113.9", "shmcancel.principal": None}, "ip:203.0.113.9"),
])
def test_scope_of_plain_dicts(environ, scope):
    for _ in range(2):  # the second answer comes from the address cache
        assert principal.scope(environ) == scope
        assert principal.scope(dict(environ)) == scope


def test_import_loads_neither_the_server_nor_ssl_nor_ctypes_nor_openssl_hashes():
    """A process that only wants the table pays for none of them (``_hashlib`` is OpenSSL's
    libcrypto: ~4 MB of resident memory for hashes the table does not use)."""
    code = textwrap.dedent("""
        import sys
        import shmcancel
        heavy = [m for m in ("ssl", "ctypes", "_hashlib", "shmcancel.server",
                             "shmcancel.mcp.server", "shmcancel.mcp.disconnect")
                 if m in sys.modules]
        assert not heavy, heavy
        from shmcancel import McpServer, ToolError
        from shmcancel.server import McpServer as S, ToolError as T
        assert McpServer is S and ToolError is T and shmcancel.McpServer is S
        assert "McpServer" in dir(shmcancel)
        try:
            shmcancel.NoSuchThing
        except AttributeError:
            pass
        else:
            raise AssertionError("no AttributeError")
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


@pytest.mark.parametrize("polls", [0, 1])
@pytest.mark.parametrize("others", [0, 3])
def test_end_clears_the_row_whether_or_not_the_handle_was_polled(c, polls, others):
    for i in range(others):  # other rows in the scope, and in another scope
        c.cancel(100 + i, None, S)
        c.cancel(100 + i, None, "ip:192.0.2.200")
    h = c.begin(7, S)
    for _ in range(polls):
        assert h.cancelled() is False
    assert c.cancel_if_in_flight(7, "stop", S)
    h.end()
    assert c.cancelled(7, S) is False and c.in_flight(7, S) is False
    assert c.cancelled(100, S) is (others > 0)
    h2 = c.begin(8, S)  # a request nobody cancelled ends without writing a row
    h2.end()
    assert c.cancelled(8, S) is False


@pytest.mark.parametrize("polls", [1, 3])
@pytest.mark.parametrize("via", ["handle", "conn"])
def test_a_handle_that_cached_no_row_sees_a_cancel_from_another_process(c, polls, via):
    """The handle's hot poll trusts one bucket version: a cancel written by another process
    moves it, so the next poll answers True (a poll that missed it would stay False)."""
    name = c.registry.name
    h = c.begin(7, S)
    poll = h.cancelled if via == "handle" else lambda: cancelled({"shmcancel.handle": h})
    for _ in range(polls):
        assert poll() is False
    pid = procs.fork(lambda: Cancellation(Registry.attach(name)).cancel_if_in_flight(7, "x", S))
    assert procs.wait_exit(pid, 10) == 0
    assert poll() is True and h.reason() == "x"
    c.clear(7, S)
    assert poll() is True  # latched
    h.end()


def test_cancel_local_after_a_cached_poll_is_seen_at_once(c):
    h = c.begin(7, S)
    assert h.cancelled() is False and h.cancelled() is False
    h.cancel_local("gone")
    assert h.cancelled() is True and h.reason() == "gone"
    h.end()


def test_a_stale_row_is_not_cached_as_cancelled_and_goes_with_the_end(c):
    c.cancel(7, "old", S)  # a row of an earlier namesake: older than the handle
    h = c.begin(7, S)
    assert h.cancelled() is False
    # left in place (a namesake still running may be the one it is for), never this one's
    assert h.cancelled() is False and h.reason() is None
    assert c.cancel_if_in_flight(7, "new", S)
    assert h.cancelled() is True and h.reason() == "new"
    h.end()
    assert c.cancelled(7, S) is False


def test_a_stale_row_goes_with_the_end_of_the_request_that_found_it(c):
    c.cancel(7, "old", S)
    h = c.begin(7, S)
    assert h.cancelled() is False
    h.end()
    assert c.cancelled(7, S) is False


@pytest.mark.parametrize("polls", [1, 3])
def test_a_conn_without_a_handle_caches_its_poll_and_sees_another_process_cancel(c, polls):
    """A dict conn keeps the poll it resolved (issue #9: the scope is not read again while
    what it is read from stays the same); the cached poll still answers from shared memory,
    so another process's cancel is seen."""
    name = c.registry.name
    conn = {"REMOTE_ADDR": "192.0.2.1", "shmcancel.request_id": 7}
    for _ in range(polls):
        assert c.cancelled(conn) is False
    (kept,) = _kept_polls(conn)  # the poll is kept in the conn, under c's own key
    assert kept.rid is conn["shmcancel.request_id"]
    pid = procs.fork(lambda: Cancellation(Registry.attach(name)).cancel(7, "x", S))
    assert procs.wait_exit(pid, 10) == 0
    assert c.cancelled(conn) is True
    c.clear(7, S)
    assert c.cancelled(conn) is False  # no handle: nothing latches


def test_a_conn_whose_request_id_changes_is_resolved_again(c):
    c.cancel(8, None, S)
    conn = {"REMOTE_ADDR": "192.0.2.1", "shmcancel.request_id": 7}
    assert c.cancelled(conn) is False
    conn["shmcancel.request_id"] = 8
    assert c.cancelled(conn) is True
    conn["shmcancel.request_id"] = "7"
    assert c.cancelled(conn) is False
    del conn["shmcancel.request_id"]
    assert c.cancelled(conn) is False


def _set_session(conn, sid):
    conn["shmcancel.session_id"] = sid


def _mutate_principal(conn, pid):
    conn["shmcancel.principal"]["id"] = pid


def _readdress(conn, addr):
    conn["REMOTE_ADDR"] = addr


@pytest.mark.parametrize("change, new_scope", [
    (lambda conn: principal.put(conn, "alice"), "principal:alice"),
    (lambda conn: _set_session(conn, "s1"), "session:s1"),
    (lambda conn: _readdress(conn, "198.51.100.4"), "ip:198.51.100.4"),
], ids=["principal", "session", "address"])
def test_a_conn_whose_scope_changes_is_resolved_again(c, change, new_scope):
    """The kept poll is the old scope's: a conn given a principal or a session, or another
    address, after its first poll answers from its new scope (contract §3, §4.3): neither the
    old scope's row (invented) nor the new scope's missing (lost)."""
    conn = {"REMOTE_ADDR": "192.0.2.1", "shmcancel.request_id": 9}
    c.cancel(9, "old scope", "ip:192.0.2.1")
    assert c.cancelled(conn) is True
    change(conn)
    assert c.cancelled(conn) is False
    c.cancel(9, "new scope", new_scope)
    assert c.cancelled(conn) is True
    c.clear(9, new_scope)
    assert c.cancelled(conn) is False


@pytest.mark.parametrize("had_address", [True, False])
def test_a_conn_whose_address_comes_or_goes_is_resolved_again(c, had_address):
    """The kept poll checks the address too: a conn that loses its address (or had none and
    gets one) after its first poll answers from its new scope."""
    conn = {"shmcancel.request_id": 9}
    if had_address:
        conn["REMOTE_ADDR"] = "192.0.2.1"
    before, after = ("ip:192.0.2.1", "ip:unknown") if had_address else ("ip:unknown",
                                                                        "ip:192.0.2.1")
    c.cancel(9, None, before)
    assert c.cancelled(conn) is True
    if had_address:
        del conn["REMOTE_ADDR"]
    else:
        conn["REMOTE_ADDR"] = "192.0.2.1"
    assert c.cancelled(conn) is False
    c.cancel(9, None, after)
    assert c.cancelled(conn) is True


def test_a_principal_changed_in_place_is_seen(c):
    conn = {"REMOTE_ADDR": "192.0.2.1", "shmcancel.request_id": 9}
    principal.put(conn, "alice")
    c.cancel(9, None, "principal:alice")
    assert c.cancelled(conn) is True
    _mutate_principal(conn, "bob")
    assert c.cancelled(conn) is False
    c.cancel(9, None, "principal:bob")
    assert c.cancelled(conn) is True


def _kept_polls(conn):
    return [v for k, v in conn.items() if k.startswith("shmcancel.poll#")]


@pytest.mark.parametrize("where", ["instance key", "poll key"])
@pytest.mark.parametrize("junk", [5, "x", None, (1, 2, 3), {"c": None}, "shmcancel.poll#0"])
def test_junk_under_the_poll_keys_is_ignored_and_replaced(c, junk, where):
    conn = {"REMOTE_ADDR": "192.0.2.1", "shmcancel.request_id": 7}
    assert c.cancelled(conn) is False
    (key,) = (k for k in conn if k.startswith("shmcancel.poll#"))
    assert conn["shmcancel.poll"] == key  # names the instance key
    conn[key if where == "instance key" else "shmcancel.poll"] = junk
    c.cancel(7, None, S)
    assert c.cancelled(conn) is True
    assert type(conn[key]).__name__ == "_ConnPoll"
    c.clear(7, S)
    assert c.cancelled(conn) is False


def test_a_poll_cached_by_another_cancellation_is_not_trusted(c, shm_names):
    name = f"{c.registry.name}-b"
    shm_names.append(name)
    other_reg = Registry.create(name, Config(**SMALL))
    try:
        other = Cancellation(other_reg)
        conn = {"REMOTE_ADDR": "192.0.2.1", "shmcancel.request_id": 7}
        assert other.cancelled(conn) is False  # cached for `other`
        c.cancel(7, None, S)
        assert c.cancelled(conn) is True  # c's registry, not other's cached poll
        assert other.cancelled(conn) is False
        assert len(_kept_polls(conn)) == 1  # one instance's poll replaces the other's
    finally:
        other_reg.close()
        other_reg.unlink()


def test_a_first_poll_in_a_scope_without_rows_makes_no_watch(c):
    """The transport's own look when a tool returns is often a handle's only poll: with no row
    counted in the scope it answers from the count alone; the next poll makes the watch."""
    h = c.begin(7, S)
    assert h.cancelled() is False and h._watch is None
    assert h.cancelled() is False and h._watch is not None
    h.end()


@pytest.mark.parametrize("mine", [True, False])
def test_a_first_poll_in_a_scope_with_rows_reads_the_row(c, mine):
    c.cancel(8, None, S)  # another request's row: the scope's count is 1
    h = c.begin(7, S)
    if mine:
        assert c.cancel_if_in_flight(7, "x", S)
    assert h.cancelled() is mine
    assert h._watch is not None
    h.end()
    assert c.cancelled(7, S) is False and c.cancelled(8, S) is True


def test_end_removes_its_own_row_by_receipt_and_leaves_a_namesake(c):
    """A handle's row goes by the receipt its begin got; a namesake's row (same key, another
    owner) stays in flight."""
    a = c.begin(7, S)
    b = c.begin(7, S)
    assert a._receipt is not None and a._receipt != b._receipt
    a.end()
    assert c.in_flight(7, S) is True
    rows = [o for k, o in in_flight_rows(c.registry) if k == (S, "7")]
    assert rows == [b._owner]
    b.end()
    assert c.in_flight(7, S) is False


def test_a_fork_child_ending_an_inherited_handle_leaves_the_parents_row(c):
    """end() is idempotent by taking the handle's token out of this process's running set; a
    fork child's set is empty, so a copy of the parent's handle ends nothing there."""
    h = c.begin(7, S)

    def child() -> None:
        h.end()
        os._exit(0 if Cancellation(Registry.attach(name)).in_flight(7, S) else 3)

    name = c.registry.name
    assert procs.wait_exit(procs.fork(child), 10) == 0
    assert c.in_flight(7, S) is True
    h.end()
    h.end()  # a second end is a no-op
    assert c.in_flight(7, S) is False


def test_scope_has_rows_follows_the_count(c):
    st = c._store
    assert st.scope_has_rows(S) is False
    c.cancel(1, None, S)
    assert st.scope_has_rows(S) is True and st.scope_has_rows(Text(S)) is True
    assert st.scope_has_rows("ip:192.0.2.2") is False
    c.cancel(2, None, S)
    c.clear(1, S)
    assert st.scope_has_rows(S) is True
    c.clear(2, S)
    assert st.scope_has_rows(S) is False


def _count_rows(c: Cancellation) -> dict[bytes, int]:
    return scope_counts(c.registry, zeros=True)


def test_a_count_at_zero_keeps_its_row_and_the_next_cancel_only_stores(c):
    """A scope's count falling to 0 stays in its row: the next cancel in the scope changes one
    word (no slot of the table moves), and the count still reads 0 for every reader."""
    st = c._store
    t = c.registry.table("scope_counts")
    c.cancel(1, None, S)
    c.clear(1, S)
    assert _count_rows(c) == {st._digest(S): 0}
    assert st.scope_rows(S) == 0 and st.scope_has_rows(S) is False
    with c.begin(1, S) as h:
        assert h.cancelled() is False
    before = t._ver.tolist()
    c.cancel(2, None, S)
    assert t._ver.tolist() == before, "the count's row was written anew"
    assert _count_rows(c) == {st._digest(S): 1} and st.scope_has_rows(S) is True
    c.clear(2, S)
    assert _count_rows(c) == {st._digest(S): 0}


def test_counts_left_at_zero_are_bounded_and_leave_room_for_every_scope(shm_name):
    """max_rows 8: at most 2 rows at 0 stay (a quarter), whatever number of scopes cancelled
    once; then 8 rows in 8 new scopes all get counts (no TableFull), and the cap still evicts."""
    reg = Registry.create(shm_name, Config(**{**SMALL, "max_rows": 8, "ttl": 3600}))
    try:
        c = Cancellation(reg)
        t = reg.table("scope_counts")
        assert t.capacity == 8 + 2
        for i in range(20):
            c.cancel(i, None, f"once:{i}")
            c.clear(i, f"once:{i}")
            assert len(t.scan()) <= 2 and set(_count_rows(c).values()) <= {0}
        for i in range(8):
            c.cancel(i, None, f"full:{i}")
        assert sorted(_count_rows(c).values()) == [0] * (len(t.scan()) - 8) + [1] * 8
        c.cancel(99, None, "full:99")  # at the cap: a batch is evicted first
        assert sum(_count_rows(c).values()) == reg.table("cancellations").count() <= 8
        assert all(c._store.scope_rows(s) == sum(1 for r in c._store.cancellations()
                                                 if r[0] == s)
                   for s in [f"full:{i}" for i in range(8)] + ["full:99"])
    finally:
        reg.close()
        reg.unlink()


def test_a_sweep_removes_counts_at_zero(c):
    for i in range(3):
        c.cancel(i, None, f"s{i}")
        c.clear(i, f"s{i}")
    c.cancel(9, None, "kept")
    assert len(_count_rows(c)) == 4
    c.cleanup()
    assert _count_rows(c) == {c._store._digest("kept"): 1}


def test_a_cancel_local_landing_inside_another_threads_poll_is_not_lost(c, monkeypatch):
    """The disconnect watcher's thread calls cancel_local while the tool's thread may be inside
    a poll that is about to cache "no row". The interleaving is forced: cancel_local runs inside
    the watch's read of that poll. The poll, and every later one, answers True."""
    h = c.begin(1, S)
    try:
        assert h.cancelled() is False  # the first poll: the scope's count only
        real = Watch.member

        def member_then_cancel(self: Watch) -> bool:
            r = real(self)
            if not h._local:
                h.cancel_local("client disconnected")  # between the read and the caching
            return r

        monkeypatch.setattr(Watch, "member", member_then_cancel)
        first = h.cancelled()
        monkeypatch.undo()
        assert first is True
        assert all(h.cancelled() for _ in range(100))
    finally:
        h.end()


def test_a_conn_polled_by_a_new_cancellation_each_time_keeps_two_poll_keys(c):
    """A caller that makes a Cancellation per poll (each instance keeps its poll under a key
    of its own) does not grow the conn by a key per instance: bounded memory per conn."""
    conn = {"REMOTE_ADDR": "192.0.2.1", "shmcancel.request_id": 7}
    n0 = len(conn)
    for i in range(200):
        if i == 100:
            c.cancel(7, None, S)
        assert Cancellation(c.registry).cancelled(conn) is (i >= 100)
    assert len(conn) == n0 + 2  # "shmcancel.poll" and the last instance's key
    assert len(_kept_polls(conn)) == 1
