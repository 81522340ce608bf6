"""The principal shmcancel.sdk scopes an authenticated caller's calls by: the SDK's own
(client id, issuer, subject), kept apart for any two that differ, and short enough for the
transport's rows whatever the token carries."""

from __future__ import annotations

from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import AccessToken

from shmcancel import principal
from shmcancel.sdk._calls import conn_of


def _scope(client: str, subject: str | None, issuer: str | None = None) -> str:
    token = AccessToken(token="t", client_id=client, scopes=[], subject=subject,
                        claims={"iss": issuer} if issuer else None)
    return principal.scope(conn_of({"type": "http", "user": AuthenticatedUser(token),
                                    "client": ("203.0.113.9", 1), "headers": []}, False))


def test_principals_that_differ_in_any_part_have_scopes_apart() -> None:
    scopes = {_scope("a", "alice"), _scope("b", "alice"), _scope("alice", None),
              _scope("a", "alice", "https://one.example"), _scope("a", "alice", "https://two.example")}
    assert len(scopes) == 5 and all(s.startswith("principal:") for s in scopes)


def test_a_long_principal_is_a_short_digest() -> None:
    issuer = "https://login.example.com/72f988bf-86f1-41af-91ab-2d7cd011db47/v2.0"
    s = _scope("77f0eb10-77d7-450b-8885-1b8c0d87b3de", "A" * 43, issuer)
    assert s.startswith("principal:sdk:") and len(s) <= 48
    assert s != _scope("77f0eb10-77d7-450b-8885-1b8c0d87b3de", "B" * 43, issuer)


class _NamedUser:
    """A Starlette-style authenticated user of another auth backend: only an ``identity``."""

    is_authenticated = True

    def __init__(self, identity: str) -> None:
        self.identity = identity


def _user_scope(identity: str) -> str:
    return principal.scope(conn_of({"type": "http", "user": _NamedUser(identity),
                                    "client": ("203.0.113.9", 1), "headers": []}, False))


def test_an_identity_that_spells_a_bearer_principal_gets_a_scope_of_its_own() -> None:
    # A backend whose users pick their identity (a user name) must not hand one the scope of a
    # bearer token's principal: it could cancel that client's calls.
    issuer = "https://login.example.com/72f988bf-86f1-41af-91ab-2d7cd011db47/v2.0"
    for bearer in (_scope("a", "alice"), _scope("a" * 40, "B" * 43, issuer)):
        spelled = bearer.removeprefix("principal:")
        assert _user_scope(spelled) != bearer
    assert _user_scope("alice") != _user_scope("bob")
    assert _user_scope("alice").startswith("principal:")
