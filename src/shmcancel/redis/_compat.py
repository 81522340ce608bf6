"""Imports of modules that another branch moves into subpackages (``shmcancel.cancel``)."""

from __future__ import annotations

try:  # the layout with subpackages
    from shmcancel.cancel import ids, reasons  # type: ignore[attr-defined,unused-ignore]
except ImportError:  # the flat layout
    from shmcancel import ids, reasons  # type: ignore[no-redef,unused-ignore]

__all__ = ["ids", "reasons"]
