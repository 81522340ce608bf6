"""``blake2b`` without importing ``hashlib``, which loads OpenSSL's libcrypto (about 4 MB of
resident memory per process) for algorithms the table does not use: CPython's ``hashlib.blake2b``
is its built-in ``_blake2`` module's, taken here directly."""

from __future__ import annotations

try:
    from _blake2 import blake2b
except ImportError:  # an interpreter without CPython's built-in module
    from hashlib import blake2b

__all__ = ["blake2b"]
