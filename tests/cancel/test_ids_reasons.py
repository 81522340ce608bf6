"""contract §4.1 request ids and §4.2 reasons (the pure rules; their use by Cancellation is in
test_cancellation.py)."""

from __future__ import annotations

import enum
import re

import pytest

from shmcancel import InvalidRequestId
from shmcancel.cancel.ids import MAX_ID_BYTES, MAX_KEY_BYTES, key, require_key
from shmcancel.cancel.reasons import STRIPPED, sanitize


class Color(enum.IntEnum):
    RED = 7


class S(str):
    def __str__(self):
        return "sneaky"


@pytest.mark.parametrize(
    ("rid", "k"),
    [
        (42, "42"),
        ("42", "42"),
        (0, "0"),
        (-1, "-1"),
        ("", ""),
        ("a" * 256, "a" * 256),
        ("é" * 128, "é" * 128),  # 256 bytes
        ("€" * 85 + "a", "€" * 85 + "a"),  # 256 bytes
        (10**256 - 1, "9" * 256),
        (-(10**254), "-1" + "0" * 254),
        (Color.RED, "7"),
        (S("x"), "x"),
    ],
)
def test_valid_ids(rid, k):
    assert key(rid) == k
    assert require_key(rid) == k


@pytest.mark.parametrize(
    "rid",
    [
        True,
        False,
        1.0,
        float("nan"),
        [1],
        {"id": 1},
        (1,),
        b"42",
        "a" * 257,
        "é" * 128 + "a",  # 257 bytes
        "€" * 86,  # 258 bytes in 86 characters
        "\ud800",
        object(),
    ],
)
def test_invalid_ids(rid):
    assert key(rid) is None
    with pytest.raises(InvalidRequestId):
        require_key(rid)


@pytest.mark.parametrize("n", [10**256, -(10**255), 2**4000, -(2**4000) + 1, 10**5000 + 7],
                         ids=["257 digits", "-1e255", "2**4000", "-(2**4000)+1", "5001 digits"])
def test_an_int_of_any_size_is_a_valid_id_with_a_key_no_str_id_has(n):
    """contract §4.1: any int but a bool. Past 256 characters (and past the 4 300 digits
    Python prints) its key is its own text: longer than any valid str id, bounded, the same
    for equal values (an IntEnum-like subclass too) and different for neighbours."""
    k = require_key(n)
    assert key(n) == k == key(int(str(n)) if abs(n) < 10**4000 else n)
    assert MAX_ID_BYTES < len(k.encode()) <= MAX_KEY_BYTES
    assert key(n + 1) != k and key(-n) != k
    assert key(type("Big", (int,), {})(n)) == k


def test_an_int_subclass_that_overrides_everything_keys_as_its_value():
    class Hostile(int):
        def __int__(self) -> int:
            raise RuntimeError

        def __lt__(self, other: object) -> bool:
            raise RuntimeError

        __gt__ = __le__ = __ge__ = __repr__ = __str__ = __lt__  # type: ignore[assignment]

    assert key(Hostile(5)) == "5" and key(Hostile(10**300)) == key(10**300)


def test_none_is_no_key():
    assert key(None) is None


def test_42_and_str_42_are_one_key():
    assert key(42) == key("42")


@pytest.mark.parametrize(
    ("reason", "stored"),
    [
        (None, None),
        ("user pressed stop", "user pressed stop"),
        ("", ""),
        ("tab\there", "tabhere"),
        ("line\r\nbreak", "linebreak"),
        ("nul\x00bell\x07esc\x1b[31m", "nulbellesc[31m"),
        ("del\x7fc1\x85\x9f", "delc1"),
        ("zero\u200bwidth\u200c\u200d\u200e\u200f", "zerowidth"),
        ("bidi\u202etxt.exe\u202a\u2028\u2029", "biditxt.exe"),
        ("\u061carabic\u2060word\u2066\u2067\u2068\u2069\ufeff", "arabicword"),
        ("keep é ñ 中 🙂 \u00a0 \u00a1", "keep é ñ 中 🙂 \u00a0 \u00a1"),
        (42, "42"),
        (b"bytes", "b'bytes'"),
        ({"why": "x"}, "{'why': 'x'}"),
        (["a\nb"], "['a\\nb']"),
        ("x" * 300, "x" * 200),
        ("\n" * 100 + "y" * 300, "y" * 200),
    ],
)
def test_sanitize(reason, stored):
    assert sanitize(reason) == stored


def test_stripped_set_is_exactly_the_spec_ranges():
    expected = set(range(0x00, 0x20)) | set(range(0x7F, 0xA0)) | {0x061C}
    expected |= set(range(0x200B, 0x2010)) | set(range(0x2028, 0x202F)) | {0x2060}
    expected |= set(range(0x2066, 0x206A)) | {0xFEFF}
    assert expected == STRIPPED
    every = "".join(map(chr, range(0x10000)))
    every = "".join(c for c in every if not 0xD800 <= ord(c) <= 0xDFFF)
    chunks = (sanitize(every[i : i + 150]) for i in range(0, len(every), 150))
    kept = {ord(c) for c in "".join(chunks)}
    assert kept.isdisjoint(STRIPPED)
    assert len(kept) == len(every) - len(STRIPPED)


def test_clamp_to_800_bytes_happens_before_stripping():
    # 800 bytes of control characters first: the clamp keeps only them, stripping empties it.
    assert sanitize("\x01" * 800 + "visible") == ""
    assert sanitize("\x01" * 799 + "visible") == "v"


def test_clamp_never_breaks_a_character():
    # 3-byte characters: 800 bytes hold 266 whole ones; the 200-character cut comes after.
    r = sanitize("\x01" * 200 + "€" * 300)
    assert r == "€" * 200
    r = sanitize("\x01" * 700 + "€" * 300)  # 100 bytes left: 33 whole euros, no fragment
    assert r == "€" * 33
    r = sanitize("\x01" * 790 + "🙂" * 10)  # 10 bytes left: two 4-byte emoji
    assert r == "🙂" * 2


def test_lone_surrogates_do_not_break_storage():
    r = sanitize("a\ud800b")
    assert r == "a\ufffdb"
    r.encode("utf-8")


class BadRepr:
    def __repr__(self):
        raise RuntimeError("no")


class NotStrRepr:
    def __repr__(self):
        return 5  # type: ignore[return-value]


def test_repr_that_fails_still_gives_text():
    assert sanitize(BadRepr()).startswith("<test_ids_reasons.BadRepr object at")
    assert sanitize(NotStrRepr()).startswith("<test_ids_reasons.NotStrRepr object at")


def test_plain_ascii_fast_path_matches_the_general_rules():
    """A plain ``str`` of printable ASCII takes a shortcut; a ``str`` subclass takes the general
    steps: both give the same text for every ASCII character (printable or not) and around
    the 200-character and 800-byte cuts."""

    class Text(str):
        pass

    samples = [chr(c) * n for c in range(128) for n in (1, 3)]
    samples += ["a" * n for n in (0, 199, 200, 201, 799, 800, 801, 2000)]
    samples += ["ok " + chr(c) + " ok" for c in range(128)]
    samples += ["x" * 150 + "\x7f" + "y" * 100, "~" * 300, " leading and trailing "]
    for s in samples:
        assert sanitize(s) == sanitize(Text(s)), repr(s)
        assert type(sanitize(s)) is str


def test_an_id_with_a_lone_surrogate_is_refused_for_what_it_is():
    """It is refused (no UTF-8 encodes it), and the message said "at most 256 UTF-8 bytes, got
    a str of 3 bytes": true of its size, silent on its problem."""
    problem = re.escape("not valid UTF-8 (a lone surrogate at index 1)")
    with pytest.raises(InvalidRequestId, match=problem):
        require_key("a\ud800")
    with pytest.raises(InvalidRequestId, match="got a str of 257 bytes"):
        require_key("x" * 257)
