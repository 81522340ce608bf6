"""The Origin check (contract §6.0): strict parsing of serialised origins and the policy built from
``allowed_origins``. The transport's use of it is tested in test_server.py (in-process) and
test_http.py (gunicorn)."""

from __future__ import annotations

import pytest

from shmcancel.mcp.origin import LOCALHOST_ORIGINS, Origin, OriginPolicy, parse_origin

ALLOWED_BY_DEFAULT = [
    "http://localhost", "http://localhost:8000", "https://localhost:1", "http://127.0.0.1",
    "https://127.0.0.1:65535", "http://[::1]", "http://[::1]:8000",
    "HTTP://LOCALHOST:8000",          # scheme and host are case-insensitive
    "http://LocalHost",
    "http://localhost:8000/",         # one trailing slash
    "http://[0:0:0:0:0:0:0:1]:8000",  # IPv6 compared in canonical form
    "http://localhost:80",            # the default port, spelled out
]

REFUSED_BY_DEFAULT = [
    "http://evil.example", "https://evil.example:8000",
    "http://localhost.evil.example",      # the host is matched whole
    "http://evil.localhost.example", "http://127.0.0.1.evil.example", "http://localhostx",
    "http://xlocalhost", "http://127.0.0.2", "http://[::2]", "http://0.0.0.0",
    "http://[::ffff:127.0.0.1]",          # another address, whatever it maps to
    "null", "NULL", "", " ", "localhost", "localhost:8000", "//localhost",
    "http://", "http://:8000", "http:/localhost", "http:localhost",
    "http://::1", "http://::1:8000", "http://[::1", "http://::1]", "http://[::1]x",
    "http://[::1]8000", "http://[fe80::1%25eth0]", "http://[localhost]",
    "http://localhost:", "http://localhost:99999", "http://localhost:-1", "http://localhost:+80",
    "http://localhost:08000", "http://localhost:80:80", "http://localhost:8o",
    "http://localhost:*",                 # a pattern, not an origin a browser sends
    "http://localhost//", "http://localhost/x", "http://localhost?x", "http://localhost#x",
    "http://user@localhost", "http://user:pw@localhost:8000", "http://localhost\\@evil",
    "http://local host", "http://localhost\t", " http://localhost", "http://localhost ",
    "http://localhost.",                  # a trailing dot is another name
    "http://127.1", "http://2130706433", "http://127.0.0.01", "http://127.0.0.256",
    "http://-localhost", "http://localhost-", "http://" + "a" * 64 + ".example",
    "http://lоcalhost",                   # Cyrillic o
    "http://localhost, http://evil.example",  # two Origin lines joined by the server
    "http://localhost http://evil.example",   # an RFC 6454 origin list
    "file://localhost", "ws://localhost:8000", "chrome-extension://abcdef",
    "http://localhost:8000" + "/" * 3000,
]


@pytest.mark.parametrize("origin", ALLOWED_BY_DEFAULT)
def test_default_policy_allows_loopback_pages(origin: str) -> None:
    assert OriginPolicy().allows(origin)


@pytest.mark.parametrize("origin", REFUSED_BY_DEFAULT)
def test_default_policy_refuses_everything_else(origin: str) -> None:
    assert not OriginPolicy().allows(origin)


def test_no_origin_header_passes_every_policy() -> None:
    for policy in (OriginPolicy(), OriginPolicy([]), OriginPolicy("*"),
                   OriginPolicy(["https://app.example.com"])):
        assert policy.allows(None)


def test_parse_normalises_case_default_port_and_ipv6() -> None:
    assert parse_origin("HTTPS://App.Example.COM/") == (Origin("https", "app.example.com", 443),
                                                       False)
    assert parse_origin("http://[0::1]:8000") == (Origin("http", "[::1]", 8000), False)
    assert parse_origin("http://[::1]:*", wildcard_port=True) == (Origin("http", "[::1]", None),
                                                                 True)
    assert parse_origin("app://x") == (Origin("app", "x", None), False)  # no default port


def test_an_explicit_list_replaces_the_defaults() -> None:
    p = OriginPolicy(["https://app.example.com", "http://localhost:3000/"])
    assert p.allows("https://app.example.com") and p.allows("https://app.example.com:443")
    assert p.allows("http://localhost:3000") and p.allows("HTTP://localhost:3000/")
    assert not p.allows("http://app.example.com")       # another scheme
    assert not p.allows("https://app.example.com:8443")  # another port
    assert not p.allows("http://localhost:3001")
    assert not p.allows("http://127.0.0.1:3000")        # the defaults are gone


def test_port_wildcard_and_adding_to_the_defaults() -> None:
    p = OriginPolicy([*LOCALHOST_ORIGINS, "https://app.example.com:*", "vscode-webview://abc"])
    assert p.allows("http://localhost:5173") and p.allows("https://app.example.com:8443")
    assert p.allows("https://app.example.com") and p.allows("vscode-webview://abc")
    assert not p.allows("https://evil.example") and not p.allows("https://x.app.example.com")


def test_empty_list_refuses_every_browser_and_star_opts_out() -> None:
    assert not OriginPolicy([]).allows("http://localhost:8000")
    star = OriginPolicy("*")
    assert star.allow_all
    for origin in ("http://evil.example", "null", "garbage"):
        assert star.allows(origin)


@pytest.mark.parametrize("bad", [
    ["null"], ["http://localhost/mcp"], ["localhost:8000"], ["http://localhost:"],
    ["*", "http://localhost"], ["http://[::1"], [""], ["https://*.example.com"],
])
def test_invalid_patterns_fail_at_construction(bad: list[str]) -> None:
    with pytest.raises(ValueError, match="allowed_origins"):
        OriginPolicy(bad)


@pytest.mark.parametrize("bad", ["http://localhost:8000", b"*", [b"http://localhost"], [5]])
def test_a_bare_string_or_non_str_pattern_is_a_type_error(bad: object) -> None:
    with pytest.raises(TypeError, match="allowed_origins"):
        OriginPolicy(bad)  # type: ignore[arg-type]
