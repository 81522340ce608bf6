"""Sweeps of a table that never hold the lock for long: ``sweep_rows`` (every row, lock-free),
``sweep_delete`` (in short holds, re-validating each row; one bulk rewrite of the index for many
rows, with what else its caller stores in that hold), ``delete_where``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from .base import TableCorrupted
from .layout import _LENS, BUCKET_SLOTS, RECORD_HEADER, _unpack
from .rewrite import Companion, Rewrite, Rewrites, WindowTooSmall

SWEEP_HOLD = 0.0003  # seconds a sweep chunk holds the lock for (then it lets writers in)
SWEEP_BULK = 256  # rows from which a sweep tries bulk rewrites of the index first
SWEEP_BATCH = 2048  # rows a bulk rewrite deletes per hold (about: a window of the index)
SWEEP_GROUP = 128  # the same for what the first rewrites left (writers moved their buckets)
_BS = BUCKET_SLOTS
_STORE_TRIES = 3  # a bulk rewrite's stores run again when an exception cuts them short


def _store_both(plan: Rewrite, also: Companion | None) -> None:
    """Under the lock: ``plan``'s stores, then ``also``'s, both complete before any exception
    goes on. A signal handler's exception (gunicorn's quit: SystemExit) can come at any
    bytecode, in whichever thread runs Python's handlers, even with this one's signals blocked:
    between the two, the lock would be released normally with the companion's half undone and
    no recovery to say so (the counts of rows gone, left high). Both stores write values fixed
    by their plan, so running them again completes them; the first exception is raised after."""
    first: BaseException | None = None
    for _ in range(_STORE_TRIES):
        try:
            plan.store()
            if also is not None:
                also.store()
            break
        except BaseException as e:
            if first is None:
                first = e
    if first is not None:
        raise first


class Sweeps(Rewrites):
    """The sweeps of :class:`~shmcancel.shm.table.Table`."""

    def sweep_rows(self) -> list[tuple[int, int, bytes, bytes]]:
        """``(hash, record, kbytes, vbytes)`` of every row, without holding the lock for more
        than one copy of the index: the index is copied consistently (optimistic; else under
        the lock, one list copy), then each referenced record is read lock-free and kept only
        if it validates (length, crc) and its key still hashes to its entry. A row a writer
        changed after the index copy is missing or shows its newer content: callers re-validate
        under the lock (:meth:`sweep_delete`) before acting on a row."""
        self._check_open()
        words = self._index_words()
        out = []
        rec = self._record
        hash_ = self._hash
        for j in range(0, self._nwords, 2):
            h = words[j]
            if h:
                r = words[j + 1]
                got = rec(r)
                if got is not None and hash_(got[0]) == h:
                    out.append((h, r, got[0], got[1]))
        return out

    def sweep_delete(self, rows: list[tuple[int, int, bytes, bytes]],
                     pred: Callable[[Any, Any], bool] | None = None,
                     on_chunk: Callable[[list[tuple[Any, Any]]], None] | None = None,
                     hold: float = SWEEP_HOLD,
                     start: Callable[[], bool] | None = None,
                     prepare: Callable[[list[tuple[Any, Any]]], Companion] | None = None,
                     ) -> int:
        """Delete ``rows`` (as :meth:`sweep_rows` gives them) in order, in chunks that each
        hold the lock for about ``hold`` seconds (at least one row per chunk). Under the lock
        each row is re-validated: it is deleted only if its entry still references the same
        record holding the same bytes and, when given, ``pred(key, value)`` is still true; a
        row gone or changed meanwhile is left alone. ``on_chunk(deleted)`` gets the (key, value)
        pairs deleted, inside each chunk's hold after its deletions; it takes the lock
        (reentrant) for what it writes. Returns the rows deleted. When the caller already holds
        the lock everything runs in its hold. ``start()``, when given, is asked under the lock
        before the first deletion, in the same hold: False, and nothing is deleted (a decision
        made before the sweep that another writer's deletions made moot meanwhile).

        With no ``pred``, from ``SWEEP_BULK`` rows, bulk rewrites of the index are tried
        first (:mod:`.rewrite`: one short hold per window of about ``SWEEP_BATCH`` rows, see
        :meth:`_bulk_delete`; rows of windows that writers kept moving go row by row after),
        unless ``on_chunk`` is given without ``prepare``. ``prepare(deleted)`` then stands
        for ``on_chunk`` in a rewrite's hold: it gets the (key, value) pairs the rewrite
        will delete, before its hold (outside the lock, so nothing slow runs under it), and
        returns a :class:`~.rewrite.Companion` whose ``current()`` is asked in that hold
        before any store (False: the rewrite is computed again) and whose ``store()`` runs
        there right after the rewrite's stores. A writer killed after a rewrite thus leaves
        no change half made outside any hold (a lock recovery follows a death inside one),
        and no hold is longer than two rewrites' stores. The rows the rewrites leave go row
        by row, with ``on_chunk``."""
        self._check_open()
        lock = self._lock
        n = 0
        if pred is None and len(rows) >= SWEEP_BULK and (on_chunk is None or prepare is not None):
            bulk = self._bulk_delete(rows, start=start, prepare=prepare)
            if bulk is None:
                return 0
            deleted, rows, started = bulk
            n = len(deleted)
            if started:
                start = None
        i = 0
        total = len(rows)
        clock = time.perf_counter
        buf, offset = self._buf, self._offset
        # the deletions' share of a hold: on_chunk's writes come after them in it, so the share
        # starts at half and follows what the last chunk's on_chunk took
        share = hold if on_chunk is None else hold / 2
        while i < total:
            with lock:
                t0 = clock()
                t_end = t0 + share
                gone: list[tuple[Any, Any]] = []
                while i < total:
                    h, r, kb, vb = rows[i]
                    i += 1
                    s = self._locate(h, r)
                    if s < 0:
                        continue
                    # the same bytes as read lock-free (a referenced record is never written
                    # in place, so equal lengths and body mean the same row)
                    off = offset(r)
                    body = kb + vb
                    if (off < 0 or _LENS.unpack_from(buf, off + 4) != (len(kb), len(vb))
                            or buf[off + RECORD_HEADER:off + RECORD_HEADER + len(body)] != body):
                        continue
                    k, v = _unpack(kb), _unpack(vb)
                    if pred is not None and not pred(k, v):
                        continue
                    if start is not None:
                        if not start():
                            return 0
                        start = None
                    lock.dirty = True
                    try:
                        self._delete_slot(s)
                    except TableCorrupted as e:
                        self._repair(str(e))
                        continue
                    lock.dirty = False
                    gone.append((k, v))
                    if clock() >= t_end:
                        break
                if gone and on_chunk is not None:
                    t1 = clock()
                    on_chunk(gone)
                    share = max(hold / 10, hold * (t1 - t0) / max(clock() - t0, 1e-9))
                n += len(gone)
        return n

    def _bulk_delete(self, rows: list[tuple[int, int, bytes, bytes]], tries: int = 8,
                     start: Callable[[], bool] | None = None,
                     prepare: Callable[[list[tuple[Any, Any]]], Companion] | None = None,
                     ) -> tuple[list[tuple[Any, Any]], list[tuple[int, int, bytes, bytes]],
                                bool] | None:
        """Delete those of ``rows`` still present unchanged by rewrites of the index
        (:mod:`.rewrite`): a window of the index of about ``SWEEP_BATCH`` rows per hold, once;
        what writers left (they moved a bucket a rewrite touches) by windows of about
        ``SWEEP_GROUP`` rows, then an eighth of that (a writer moves fewer of the buckets a
        smaller window touches while it is planned), each planned from a fresh copy of its
        window, ``tries`` times. Returns the (key, value) pairs deleted, the rows left (in
        windows whose buckets writers kept moving, or that are corrupt; and rows gone or
        changed meanwhile) for the caller to delete row by row, and whether ``start`` was
        asked (and said True); None when it said False (nothing deleted)."""
        out: list[tuple[Any, Any]] = []
        started = False
        for size, n in ((SWEEP_BATCH, 1), (SWEEP_GROUP, tries), (SWEEP_GROUP // 8, tries)):
            got = self._bulk_pass(rows, -(-len(rows) // max(1, size)), n, start, prepare,
                                  started)
            if got is None:
                return None
            out += got[0]
            rows, started = got[1], got[2]
            if not rows or len(rows) < SWEEP_BULK // 8:
                break
        return out, rows, started

    def _bulk_pass(self, rows: list[tuple[int, int, bytes, bytes]], groups: int, tries: int,
                   start: Callable[[], bool] | None,
                   prepare: Callable[[list[tuple[Any, Any]]], Companion] | None,
                   started: bool) -> tuple[list[tuple[Any, Any]],
                                           list[tuple[int, int, bytes, bytes]], bool] | None:
        """:meth:`_bulk_delete` in ``groups`` windows of the index (one: the whole index),
        ``tries`` each; ``started``: ``start`` was asked already."""
        want = {(h, r): kb + vb for h, r, kb, vb in rows}
        buf, offset = self._buf, self._offset
        lock = self._lock
        nball = self._nbuckets
        width = -(-nball // min(nball, groups))
        out: list[tuple[Any, Any]] = []
        done: set[tuple[int, int]] = set()
        gone: list[tuple[int, int, bytes, bytes]] = []  # what the plan being made drops

        def drop(h: int, r: int) -> bool:
            body = want.get((h, r))
            off = offset(r) if body is not None else -1
            if body is None or off < 0:
                return False
            kl, vl = _LENS.unpack_from(buf, off + 4)
            if kl + vl == len(body) and \
                    buf[off + RECORD_HEADER:off + RECORD_HEADER + len(body)] == body:
                gone.append((h, r, body[:kl], body[kl:]))
                return True
            return False

        for g0 in range(0, nball, width):
            gn = min(width, nball - g0)
            pad = 2
            copy = None
            for _ in range(tries):
                while True:
                    gone.clear()
                    if copy is None:
                        copy = self.copy_window(g0 - 1, gn + 1 + pad)
                    else:  # planned again from the same copy, less what writers touched
                        copy.forget_moved()
                    lo, hi = (g0 * _BS, (g0 + gn) * _BS) if copy.whole else \
                        (_BS, (gn + 1) * _BS)
                    try:
                        plan = copy.without(drop, lo, hi)
                        break
                    except WindowTooSmall:  # a cluster runs past it
                        copy = None
                        pad *= 4
                if plan is None:
                    break  # nothing of ours here (left), or corrupt: row by row
                if not plan.current():  # lock-free: a writer moved it while we computed
                    continue
                deleted = [(_unpack(kb), _unpack(vb)) for _, _, kb, vb in gone]
                also = prepare(deleted) if prepare is not None else None
                with lock:
                    if not plan.current() or (also is not None and not also.current()):
                        continue
                    if start is not None and not started:
                        if not start():
                            return None
                        started = True
                    _store_both(plan, also)
                out += deleted
                done.update((h, r) for h, r, _, _ in gone)
                break
        return out, [row for row in rows if (row[0], row[1]) not in done], started

    def delete_where(self, pred: Callable[[Any, Any], bool]) -> int:
        """Remove every row for which ``pred(key, value)`` is true; returns how many. ``pred``
        sees every row before anything is removed (if it raises, nothing is). Unless the
        caller holds the lock, the rows are chosen lock-free and deleted in short holds
        (:meth:`sweep_delete`), where ``pred`` is asked again for each row."""
        self._check_open()
        lock = self._lock
        if not lock.held_by_me():
            chosen = [row for row in self.sweep_rows()
                      if pred(_unpack(row[2]), _unpack(row[3]))]
            return self.sweep_delete(chosen, pred) if chosen else 0
        with lock:
            words = self._idx.tolist()
            doomed = [(words[2 * s], r) for s, r, kb, vb, stamp in self._entries(words)
                      if stamp >= 0 and pred(_unpack(kb), _unpack(vb))]
            n = 0
            for h, r in doomed:
                s = self._locate(h, r)
                if s >= 0:
                    lock.dirty = True
                    try:
                        self._delete_slot(s)
                    except TableCorrupted as e:  # the rest is found again after the repair
                        self._repair(str(e))
                        continue
                    lock.dirty = False
                    n += 1
            return n
