"""The keyed hashes of the shared tables.

``siphash(key16, data)``: SipHash-2-4 (``siphashc``, C), the index hash of a row's packed key,
64 bits, one call and no hash object: a keyed PRF made for hash tables whose keys an attacker
chooses (a client cannot aim its ids at one bucket without the segment's random key).
:func:`table_key` derives its 16-byte key from a table's hash key (1..64 bytes).

``blake2b`` without importing ``hashlib``, which loads OpenSSL's libcrypto (about 4 MB of
resident memory per process) for algorithms the table does not use: CPython's ``hashlib.blake2b``
is its built-in ``_blake2`` module's, taken here directly."""

from __future__ import annotations

from siphashc import siphash

try:
    from _blake2 import blake2b
except ImportError:  # an interpreter without CPython's built-in module
    from hashlib import blake2b

__all__ = ["blake2b", "siphash", "table_key"]


def table_key(hash_key: bytes) -> bytes:
    """The 16-byte SipHash key of a table whose hash key is ``hash_key`` (the same in every
    process attaching the segment: a pure function of the header's bytes)."""
    return blake2b(hash_key, digest_size=16, person=b"shmcancel-index").digest()
