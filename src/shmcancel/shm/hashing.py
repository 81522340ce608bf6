"""The keyed hashes of the shared tables.

``siphash(key16, data)``: SipHash-2-4, the index hash of a row's packed key, 64 bits: a keyed PRF
made for hash tables whose keys an attacker chooses (a client cannot aim its ids at one bucket
without the segment's random key). One C call (~40 ns) from the optional extension
(``_cwrite.c``); where it is not built, or ``SHMCANCEL_PURE_PYTHON`` is set
(:data:`PURE_PYTHON`), the same function in Python (:func:`siphash_py`, ~17 µs for a 40-byte
key), so processes of both kinds share a registry. :func:`table_key` derives its 16-byte key from
a table's hash key (1..64 bytes).

``blake2b`` without importing ``hashlib``, which loads OpenSSL's libcrypto (about 4 MB of
resident memory per process) for algorithms the table does not use: CPython's ``hashlib.blake2b``
is its built-in ``_blake2`` module's, taken here directly."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

try:
    from _blake2 import blake2b
except ImportError:  # an interpreter without CPython's built-in module
    from hashlib import blake2b

__all__ = ["blake2b", "siphash", "siphash_py", "table_key"]

_M = 0xFFFFFFFFFFFFFFFF


def siphash_py(key: bytes, data: bytes) -> int:
    """SipHash-2-4 of ``data`` under the 16-byte ``key`` (Aumasson and Bernstein), its 64-bit
    result as an int: the C extension's ``siphash``, in Python."""
    key, data = _contiguous(key), _contiguous(data)
    if len(key) != 16:
        raise ValueError("siphash: the key is 16 bytes")
    k0 = int.from_bytes(key[:8], "little")
    k1 = int.from_bytes(key[8:], "little")
    v0 = k0 ^ 0x736F6D6570736575
    v1 = k1 ^ 0x646F72616E646F6D
    v2 = k0 ^ 0x6C7967656E657261
    v3 = k1 ^ 0x7465646279746573
    n = len(data)
    whole = n & ~7
    words = [int.from_bytes(data[i:i + 8], "little") for i in range(0, whole, 8)]
    words.append(((n & 0xFF) << 56) | int.from_bytes(data[whole:], "little"))
    rounds = (2,) * len(words) + (4,)  # two rounds per word, four to finish
    for i, r in enumerate(rounds):
        if r == 2:
            v3 ^= words[i]
        else:
            v2 ^= 0xFF
        for _ in range(r):
            v0 = (v0 + v1) & _M
            v1 = ((v1 << 13) | (v1 >> 51)) & _M ^ v0
            v0 = ((v0 << 32) | (v0 >> 32)) & _M
            v2 = (v2 + v3) & _M
            v3 = ((v3 << 16) | (v3 >> 48)) & _M ^ v2
            v0 = (v0 + v3) & _M
            v3 = ((v3 << 21) | (v3 >> 43)) & _M ^ v0
            v2 = (v2 + v1) & _M
            v1 = ((v1 << 17) | (v1 >> 47)) & _M ^ v2
            v2 = ((v2 << 32) | (v2 >> 32)) & _M
        if r == 2:
            v0 ^= words[i]
    return v0 ^ v1 ^ v2 ^ v3


def _contiguous(b: bytes) -> bytes:
    """``b``'s bytes, if it is a contiguous bytes-like object, as the C one takes it (not an
    int: ``bytes(5)`` is five zeros); else ``TypeError`` or ``BufferError``."""
    m = memoryview(b)
    if not m.c_contiguous:  # (contiguous is C or Fortran order; the C one takes C order only)
        raise BufferError("siphash: a contiguous buffer is needed")
    return m.tobytes()


#: ``SHMCANCEL_PURE_PYTHON`` set to anything but empty or ``0``: the C part is not used.
PURE_PYTHON = os.environ.get("SHMCANCEL_PURE_PYTHON", "").strip() not in ("", "0")

siphash: Callable[[bytes, bytes], int] = siphash_py
if not PURE_PYTHON:
    # not built (no compiler), or built from an older source: the Python one
    with contextlib.suppress(ImportError):
        from ._cwrite import siphash


def table_key(hash_key: bytes) -> bytes:
    """The 16-byte SipHash key of a table whose hash key is ``hash_key`` (the same in every
    process attaching the segment: a pure function of the header's bytes)."""
    return blake2b(hash_key, digest_size=16, person=b"shmcancel-index").digest()
