"""Exceptions raised by shmcancel. Every one derives from :class:`ShmCancelError`."""

from __future__ import annotations


class ShmCancelError(Exception):
    """Base class of every error shmcancel raises on purpose."""


class InvalidRegistryName(ShmCancelError, ValueError):
    """A registry name outside ``[A-Za-z0-9_.-]{1,64}``."""


class RegistryNotFound(ShmCancelError):
    """``Registry.attach`` named a segment that does not exist."""


class RegistryClosed(ShmCancelError, ValueError):
    """A registry was used after ``Registry.close()`` in this process (its mapping, semaphore
    and descriptors are gone): a call through it, its tables, or a :class:`Cancellation` or
    request handle made over it. The registry itself is untouched (other processes go on):
    ``Registry.attach(name)`` again to use it. A ``ValueError`` too, as Python's own "I/O
    operation on closed file" is. The calls the contract says never raise (``cancelled``,
    ``in_flight``, a handle's ``cancelled()`` and ``end()``, ``Cancellation.begin``) still
    do not: they give their safe answer."""

    @classmethod
    def of(cls, name: object, what: str = "") -> RegistryClosed:
        """The error for registry ``name`` (``what``: the part that was used, if not the
        registry itself, e.g. ``"table 'cancellations'"``)."""
        used = f"{what} cannot be used; attach the registry" if what else "attach it"
        return cls(f"registry {name} is closed in this process (Registry.close() was called): "
                   f"{used} again to use it")


class RegistryIncompatible(ShmCancelError):
    """The segment exists but cannot be used: foreign or older layout, truncated, another
    user's, or (for ``create``) still owned by a live creator."""


class SegmentTooLarge(ShmCancelError):
    """``/dev/shm`` cannot hold the segment the config asks for (raised at ``create``)."""


class LockTimeout(ShmCancelError):
    """The registry lock stayed held by a live process for longer than the lock timeout."""


class TableFull(ShmCancelError):
    """A table has no free row left (its capacity is fixed at creation)."""


class RowTooLarge(ShmCancelError, ValueError):
    """A key or value does not fit the table's fixed record size. Nothing was written."""


class InvalidRequestId(ShmCancelError, ValueError):
    """A request id that is neither an ``int`` (not ``bool``) nor a ``str`` of at most
    256 UTF-8 bytes."""


class CancellationLimitReached(ShmCancelError):
    """The scope already holds ``max_rows_per_scope`` cancellation rows."""


class RemoteUnavailable(ShmCancelError):
    """The cross-host layer (``shmcancel.redis``) gave no answer: its call timed out, failed or
    was skipped (Redis down, this process's other Redis call holding on). What it would have said
    is unknown, so nothing may be concluded from it (a session it may hold is not "unknown"): the
    transport answers HTTP 503 with ``Retry-After: retry_after`` seconds, saying why: the shared
    store ``cause`` (a phrase sent to the client: "did not answer", "is full", ...; the
    message, which may carry Redis's own words, is only logged)."""

    retry_after = 1

    def __init__(self, *args: object, cause: str = "did not answer") -> None:
        super().__init__(*args)
        self.cause = cause
