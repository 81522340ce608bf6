"""contract §3: principal.put / id / client_bucket and the scope order."""

from __future__ import annotations

import types

import pytest

from shmcancel import principal
from shmcancel.principal import MAX_SCOPE_BYTES, client_bucket, put, scope


@pytest.mark.parametrize(
    ("given", "stored_id"),
    [
        ("alice", "alice"),
        ("", ""),
        (123, "123"),
        (-7, "-7"),
        (True, None),
        (False, None),
        (None, None),
        (1.5, None),
        (["alice"], None),
        ({"id": "alice"}, "alice"),
        ({"id": 42}, "42"),
        ({"id": None, "sub": "bob"}, "bob"),
        ({"sub": 9}, "9"),
        ({"id": True, "sub": "bob"}, None),  # "id" is not None: it wins, and is no id
        ({"id": {"id": "nested"}}, "nested"),
        ({"id": None, "sub": None}, None),
        ({}, None),
        (types.MappingProxyType({"id": "m"}), "m"),
    ],
)
def test_put_normalises(given, stored_id):
    env: dict = {}
    assert put(env, given) is env
    assert env["shmcancel.principal"]["id"] == stored_id
    assert principal.id(env) == stored_id


class _IntOverridingInt(int):
    def __int__(self) -> int:
        return 99


class _IntRaisingInt(int):
    def __int__(self) -> int:
        raise TypeError("no __int__ here")


@pytest.mark.parametrize(
    ("given", "stored_id"),
    [(_IntOverridingInt(5), "5"), (_IntRaisingInt(6), "6"), ({"sub": _IntOverridingInt(7)}, "7")],
)
def test_put_normalises_an_int_subclass_by_its_value(given, stored_id):
    # contract §3: an int is its decimal string, whatever a subclass's __int__ says (as request
    # ids are keyed, contract §4.1), and put does not raise on it
    env: dict = {}
    put(env, given)
    assert principal.id(env) == stored_id
    assert scope(env) == "principal:" + stored_id


def test_put_keeps_other_claims():
    env: dict = {}
    put(env, {"sub": 5, "role": "admin"})
    assert env["shmcancel.principal"] == {"sub": 5, "role": "admin", "id": "5"}


@pytest.mark.parametrize(
    "stored",
    [{"id": 123}, {"id": {"id": "x"}}, {"id": None}, {"sub": "x"}, "alice", 5, None, ["id"]],
)
def test_id_without_put_only_trusts_a_str(stored):
    env = {"shmcancel.principal": stored, "REMOTE_ADDR": "198.51.100.7"}
    assert principal.id(env) is None
    assert scope(env) == "ip:198.51.100.7"


@pytest.mark.parametrize("env", [None, 5, "x", [("shmcancel.principal", {"id": "a"})]])
def test_id_of_non_mapping(env):
    assert principal.id(env) is None


@pytest.mark.parametrize(
    ("addr", "bucket"),
    [
        ("203.0.113.9", "203.0.113.9"),
        ("10.0.0.1", "10.0.0.1"),
        ("::ffff:203.0.113.9", "203.0.113.9"),
        ("::FFFF:192.0.2.1", "192.0.2.1"),
        ("2001:db8:1:2:3:4:5:6", "2001:db8:1:2::/64"),
        ("2001:0db8:0001:0002:ffff:ffff:ffff:ffff", "2001:db8:1:2::/64"),
        ("2001:db8::1", "2001:db8::/64"),
        ("::1", "::/64"),
        ("fe80::1%eth0", "fe80::/64"),
        ("", "unknown"),
        ("not-an-ip", "unknown"),
        ("203.0.113.256", "unknown"),
        ("010.0.0.1", "unknown"),
        (" 203.0.113.9", "unknown"),
        ("203.0.113.9:5000", "unknown"),
        (None, "unknown"),
        (b"203.0.113.9", "unknown"),
        (2130706433, "unknown"),
    ],
)
def test_client_bucket(addr, bucket):
    assert client_bucket({"REMOTE_ADDR": addr}) == bucket


def test_client_bucket_missing():
    assert client_bucket({}) == "unknown"
    assert client_bucket(None) == "unknown"


def test_two_ipv6_hosts_in_one_64_share_a_bucket():
    a = client_bucket({"REMOTE_ADDR": "2001:db8:1:2::a"})
    b = client_bucket({"REMOTE_ADDR": "2001:db8:1:2:ffff::b"})
    c = client_bucket({"REMOTE_ADDR": "2001:db8:1:3::a"})
    assert a == b != c


P = "shmcancel.principal"
S = "shmcancel.session_id"
A = "REMOTE_ADDR"


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({S: "s1", P: {"id": "alice"}, A: "203.0.113.9"}, "session:s1"),
        ({S: "", P: {"id": "alice"}, A: "203.0.113.9"}, "principal:alice"),
        ({S: 5, P: {"id": "alice"}}, "principal:alice"),
        ({S: None, P: {"id": 5}, A: "203.0.113.9"}, "ip:203.0.113.9"),
        ({P: {"id": "203.0.113.9"}, A: "203.0.113.9"}, "principal:203.0.113.9"),
        ({A: "203.0.113.9"}, "ip:203.0.113.9"),
        ({A: "2001:db8:1:2::99"}, "ip:2001:db8:1:2::/64"),
        ({}, "ip:unknown"),
        (None, "global"),
        (42, "global"),
        ("session:x", "global"),
    ],
)
def test_scope_order(env, expected):
    assert scope(env) == expected


def test_principal_equal_to_ip_string_is_another_scope():
    anon = {A: "203.0.113.9"}
    auth = put({A: "198.51.100.1"}, "203.0.113.9")
    assert scope(anon) == "ip:203.0.113.9"
    assert scope(auth) == "principal:203.0.113.9"
    assert scope(anon) != scope(auth)


@pytest.mark.parametrize(("key", "prefix"), [(S, "session:"), (P, "principal:")])
def test_long_ids_become_a_fixed_length_digest(key, prefix):
    def env(ident):
        return {key: ident if key == S else {"id": ident}}

    fits = "x" * (MAX_SCOPE_BYTES - len(prefix))
    assert scope(env(fits)) == prefix + fits
    one_more = fits + "x"
    long_a = one_more + "a" * 1000
    long_b = one_more + "a" * 999 + "b"  # same first 1500 bytes: truncation would merge them
    scopes = [scope(env(v)) for v in (one_more, long_a, long_b, "é" * 300, "\ud800" * 3)]
    assert len(set(scopes)) == len(scopes)
    for s in scopes:
        assert s.startswith(prefix)
        assert len(s.encode()) == len(scopes[0].encode()) <= MAX_SCOPE_BYTES
    assert scope(env(long_a)) == scopes[1]  # stable


def test_multibyte_scope_limit_counts_bytes():
    fits = "é" * ((MAX_SCOPE_BYTES - len("principal:")) // 2)
    assert scope({P: {"id": fits}}) == "principal:" + fits
    assert scope({P: {"id": fits + "é"}}).startswith("principal:~sha256:")


class Exploding(dict):
    def get(self, *a):
        raise RuntimeError("boom")


def test_scope_never_raises():
    assert scope(Exploding()) == "ip:unknown"
    assert principal.id(Exploding()) is None
    assert client_bucket(Exploding()) == "unknown"


class NoTruth:
    """A value whose truth cannot be told (as a numpy array's): ``bool()`` raises."""

    def __bool__(self) -> bool:
        raise ValueError("truth value is ambiguous")


class LenlessStr(str):
    def __len__(self) -> int:  # bool() of a str subclass asks __len__
        raise RuntimeError("boom")


class UnhashableStr(str):
    def __hash__(self) -> int:
        raise TypeError("unhashable")


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        # a session id that is not a str falls through whatever its truth does
        ({S: NoTruth(), P: {"id": "alice"}}, "principal:alice"),
        ({S: NoTruth(), A: "203.0.113.9"}, "ip:203.0.113.9"),
        # a str subclass is its text (contract §3)
        ({S: LenlessStr("s1"), P: {"id": "alice"}}, "session:s1"),
        ({S: LenlessStr(""), P: {"id": "alice"}}, "principal:alice"),
        ({A: UnhashableStr("203.0.113.9")}, "ip:203.0.113.9"),
        ({P: {"id": None}, A: UnhashableStr("2001:db8:1:2::99")}, "ip:2001:db8:1:2::/64"),
    ],
)
def test_scope_never_raises_on_odd_values(env, expected):
    """scope() and client_bucket() never raise (the module's promise, test_scope_never_raises):
    not for a session id whose truth value raises, nor for an address whose hash does."""
    assert scope(env) == expected
    if A in env:
        assert client_bucket(env) == expected.removeprefix("ip:")


@pytest.mark.parametrize(("key", "prefix"), [(S, "session:"), (P, "principal:")])
def test_a_short_id_spelling_a_digest_is_not_the_long_id_it_names(key, prefix):
    """A short id that spells the digest form of a long one (``"~sha256:<its hex>"``) is
    another caller: kept as itself it would share the long id's rows and quota (a principal
    who can choose their id would cancel the long id's calls)."""
    import hashlib

    def env(ident):
        return {key: ident if key == S else {"id": ident}}

    long_id = "u" * (MAX_SCOPE_BYTES + 1)
    forged = "~sha256:" + hashlib.sha256(long_id.encode()).hexdigest()
    assert scope(env(long_id)) == prefix + forged  # the digest form (contract §3)
    assert scope(env(forged)) != scope(env(long_id))
    assert scope(env(forged)).startswith(prefix + "~sha256:")  # still fixed-length
    assert len(scope(env(forged))) == len(scope(env(long_id)))
    assert scope(env("~sha256")) == prefix + "~sha256"  # only the digest's own tag is taken


class TouchyKey(str):
    """A key whose equality raises: a dict lookup of an equal-hashing key compares with it."""

    __hash__ = str.__hash__

    def __eq__(self, other: object) -> bool:
        raise RuntimeError("boom")


@pytest.mark.parametrize("key", [S, P, A])
def test_scope_never_raises_on_an_odd_key(key):
    """A dict conn holding one of the keys the library reads as a str subclass whose ``==``
    raises: reading that key fails, so it counts as absent, as a value that cannot be read does
    (``principal.id`` and ``client_bucket`` already answer so); ``scope`` never raises."""
    from shmcancel import Cancellation

    env = {TouchyKey(key): "203.0.113.9" if key == A else "x"}
    if key != A:
        env[A] = "203.0.113.9"
    expected = "ip:unknown" if key == A else "ip:203.0.113.9"
    assert client_bucket(env) == expected.removeprefix("ip:")
    assert scope(env) == expected
    assert Cancellation.scope(env) == expected


def test_documented_proxy_middleware_refuses_zero_hops():
    """``hops`` counts the proxies (N proxies: the N-th entry from the right). ``hops=0``
    (read as "no proxy beyond the first") took ``chain[-0]``, the *leftmost* entry, which the
    client writes itself: any client could name another's address, and so cancel its calls;
    without the header it raised (HTTP 500). It is refused when the middleware is made."""
    from helpers.proxy_doc import documented_middleware

    proxy = documented_middleware()
    seen = []

    def app(environ, start_response):
        seen.append(environ["REMOTE_ADDR"])
        return [b""]

    for hops in (0, -1):
        with pytest.raises(ValueError):
            proxy(app, proxies=["10.0.0.0/8"], hops=hops)
    two = proxy(app, proxies=["10.0.0.0/8"], hops=2)
    two({"REMOTE_ADDR": "10.0.0.1", "HTTP_X_FORWARDED_FOR": "198.51.100.7, 203.0.113.5, 10.0.0.2"},
        None)
    two({"REMOTE_ADDR": "10.0.0.1"}, None)
    assert seen == ["203.0.113.5", "10.0.0.1"]
