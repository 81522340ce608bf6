"""Lock-free reads of a table: the seqlock probe, ``member``/``lookup``/``get``, consistent
snapshots (``scan``, ``scan_slots``) and :class:`Watch`, a cached poll of one key.

Readers take no lock: they read a bucket's version before its slots, re-check every version they
read at the end, and validate record lengths and crc before decoding. After a bounded number of
retries (a writer killed mid-mutation leaves a bucket odd until fsck runs) they read under the lock.
A reader that meets corruption (no empty slot, a record failing validation) with unmoved versions
goes straight to the lock, where it is repaired (``fsck``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

from . import procinfo
from .base import _SPIN_BEFORE_YIELD, READ_RETRIES, PreparedKey, TableCorrupted
from .fsck import Fsck
from .layout import _LTOP, _ROWS, _TOP, _WORD, BUCKET_SLOTS, _unpack

_REFRESH_WAIT = 0.05  # seconds a refresh waits for another thread's refresh of the same watch


class Watch:
    """A cached lookup of one prepared key: ``member()``/``values()`` re-read the table only
    when a bucket version seen last time has moved.

    Valid because a referenced record is never written and every change of a slot moves its
    bucket's version: unchanged versions of every bucket the last probe read mean an unchanged
    answer. When that probe spanned several buckets ``_v`` is -1 (never a version): for two
    (a key homed in a bucket's last slots, ~2 % of keys at the default fill) ``_two`` holds
    both (bucket, version) pairs and the answer in one tuple, compared without ``_lk``; for more
    the slow path compares them all.

    A watch is shared by threads (the policy caches one per key; a handle's is polled by its
    tool and by the watcher thread): only the holder of ``_lk`` stores a refresh, else two
    interleaved refreshes could leave one's ``_member`` beside the other's newer ``_v``. A
    refresh waits ``_REFRESH_WAIT`` at most for another's (slow: it fell back to the registry
    lock), then answers from a read of its own and stores nothing. In a fork child the lock
    is replaced first (its holder may be a thread that did not survive the fork).
    """

    __slots__ = ("_b", "_lk", "_member", "_pid", "_pk", "_raw", "_seen", "_t", "_two", "_v",
                 "_values", "_ver")

    def __init__(self, table: Reads, pk: PreparedKey) -> None:
        self._t = table
        self._pk = pk
        self._ver = table._ver
        self._b = pk.b
        self._v = -1  # never equal to a version: the first call reads
        self._seen: tuple[tuple[int, int], ...] = ()
        self._two: tuple[int, int, int, int, bool] | None = None
        self._member = False
        self._raw: tuple[bytes, ...] = ()
        # (the raw tuple they were decoded from, the values): a decode of a _raw that another
        # thread's refresh replaced meanwhile is never taken for the new one's
        self._values: tuple[tuple[bytes, ...], tuple[Any, ...]] | None = None
        self._lk = threading.Lock()
        self._pid = procinfo.pid()  # the process _lk was made in

    @property
    def key(self) -> PreparedKey:
        return self._pk

    def member(self) -> bool:
        """True while the key has a row. One version load when nothing moved (two when the
        last probe spanned two buckets)."""
        try:
            if self._ver[self._b] == self._v:
                return self._member
            two = self._two  # one tuple: versions and answer of the same read, whatever refreshes
            if two is not None:
                ver = self._ver
                if ver[two[0]] == two[1] and ver[two[2]] == two[3]:
                    return two[4]
            return bool(self._refresh())
        except Exception:
            self._t._if_closed()
            raise

    def values(self) -> tuple[Any, ...]:
        """The key's values (at most one for a set), cached like ``member``."""
        try:
            raw = self._refresh() if self._ver[self._b] != self._v else self._raw
            got = self._values
            if got is None or got[0] is not raw:
                got = self._values = (raw, tuple(_unpack(x) for x in raw))
            return got[1]
        except Exception:
            self._t._if_closed()
            raise

    def _refresh(self) -> tuple[bytes, ...]:
        """The key's raw values, read again and stored (by the holder of ``_lk``)."""
        pid = procinfo.pid()  # kept by an at-fork hook: no system call
        if self._pid != pid:
            self._lk = threading.Lock()
            self._pid = pid
        lk = self._lk
        if not lk.acquire(timeout=_REFRESH_WAIT):
            return tuple(self._t._read(self._pk)[0])  # another's refresh is slow: not stored
        try:
            return self._refresh_held()
        finally:
            lk.release()

    def _refresh_held(self) -> tuple[bytes, ...]:
        ver = self._ver
        seen = self._seen
        if seen:
            for b, v in seen:
                if ver[b] != v:
                    break
            else:
                return self._raw
        rows, seen = self._t._read(self._pk)
        self._raw = raw = tuple(rows)
        self._values = None
        self._member = m = bool(raw)
        self._seen = seen
        self._two = (*seen[0], *seen[1], m) if len(seen) == 2 else None
        if len(seen) == 1:
            self._b, self._v = seen[0]
        else:
            self._b, self._v = self._pk.b, -1
        return raw


class Reads(Fsck):
    """The lock-free reads of :class:`~shmcancel.shm.table.Table`."""

    # ---------------------------------------------------------------- lock-free reads
    # Memory ordering: the seqlock relies on x86-64 (TSO): a writer's plain stores (version odd,
    # slots, version even) become visible in program order, and a reader's loads (version, slots,
    # version again) are not reordered with older loads; every u64 goes through a 'Q' memoryview
    # as one aligned 8-byte move, never torn, and CPython cannot reorder the separate C calls.
    # A weakly ordered CPU (ARM, POWER) would need fences around these stores and loads.

    def _probe(self, pk: PreparedKey, words: bool = False
               ) -> tuple[list[Any], list[tuple[int, int]]] | None:
        """One optimistic probe: (raw values, or with ``words`` the rows' words; [(bucket,
        version) read]) or None when it met a writer (odd or moved version) or a record failing
        validation. A set's word read this way is kept with its slot's bucket version in the
        key's ``wref``, as :meth:`Writes.word_ref` keeps it (valid only once the probe is)."""
        ver = self._ver
        loc = None
        idx = self._idx
        wmask = self._wmask
        h = pk.hash
        j = pk.j
        b = pk.b
        v = ver[b]
        if v & 1:
            return None
        seen = [(b, v)]
        out: list[Any] = []
        for _ in range(self.nslots):
            sh = idx[j]
            if not sh:
                break
            if sh == h:
                r = idx[j + 1]
                rec = self._record(r)
                if rec is None:
                    self._unless_corrupt(seen, "a referenced record fails validation")
                    return None
                if rec[0] == pk.kbytes:
                    if words:
                        # a word changes in place with no version move: load it as one aligned
                        # u32 (through the 'I' view; struct promises no single load for rec[3])
                        ref = (self._offset(r) + _WORD) >> 2
                        out.append(self._u32[ref])
                        loc = (b, v, ref)
                    else:
                        out.append(rec[1])
                    if self._set:  # a set holds one row per key: the probe can stop here
                        break
            j = (j + 2) & wmask
            if not j & 31:  # the next slot opens a new bucket
                b = j >> 5
                v = ver[b]
                if v & 1:
                    return None
                seen.append((b, v))
        else:
            self._unless_corrupt(seen, "a probe met no empty slot")
            return None
        for b, v in seen:
            if ver[b] != v:
                return None
        if loc is not None and self._set:
            pk.wref = loc
        return out, seen

    def _unless_corrupt(self, seen: list[tuple[int, int]], what: str) -> None:
        """Return (the caller retries) if a version in ``seen`` moved: the probe raced a writer.
        Else the bytes themselves are wrong: raise TableCorrupted (the reader goes to the lock)."""
        ver = self._ver
        for b, v in seen:
            if ver[b] != v:
                return None
        raise TableCorrupted(f"table {self.name!r}: {what}")

    def _read(self, pk: PreparedKey, words: bool = False
              ) -> tuple[list[Any], tuple[tuple[int, int], ...]]:
        """Raw values (or ``words``: the words) of ``pk``'s rows and the (bucket, version) pairs
        that validated them; never torn. Falls back to reading under the lock after
        READ_RETRIES attempts, or at once when a probe meets corruption (repaired there)."""
        for attempt in range(READ_RETRIES):
            try:
                got = self._probe(pk, words)
            except TableCorrupted:
                break
            if got is not None:
                return got[0], tuple(got[1])
            if attempt >= _SPIN_BEFORE_YIELD:
                os.sched_yield()  # let a preempted writer finish
        f = 5 if words else 3  # in a _find entry (slot, record, kbytes, vbytes, stamp, word)
        if self._lockless:  # no lock to fall back to: best effort
            try:
                return [e[f] for e in self._find(pk)], ()
            except TableCorrupted:
                return [], ()
        with self._lock:
            try:
                out = [e[f] for e in self._find(pk)]
            except TableCorrupted as err:
                self._repair(str(err))
                out = [e[f] for e in self._find(pk)]
            try:
                got = self._probe(pk)  # under the lock no writer moves a version
            except TableCorrupted:  # pragma: no cover - _find just found the probe sound
                got = None
            seen = tuple(got[1]) if got is not None else ()
            return out, seen

    def member(self, key: Any) -> bool:
        """True if ``key`` has a row. A miss costs a version load, the hashes of the probed slots
        of the home bucket, and the version again."""
        try:
            try:
                if key.t is not self:  # prepared for another table
                    key = self.prepare(key)
            except AttributeError:  # a plain key (no msgpack-able value has an attribute "t")
                key = self.prepare(key)
            ver = self._ver
            b = key.b
            v = ver[b]
            j = key.j
            idx = self._idx
            sh = idx[j]
            if not sh:  # empty home slot
                if ver[b] == v & -2:  # unchanged and even (versions only grow)
                    return False
            else:  # hashes only, within the home bucket
                h = key.hash
                while sh != h:
                    j += 2
                    if not j & 31:
                        break
                    sh = idx[j]
                    if not sh:
                        if ver[b] == v & -2:
                            return False
                        break
            return bool(self._read(key)[0])
        except Exception:
            self._if_closed()
            raise

    def absent(self, h: int) -> bool:
        """True when no key of keyed hash ``h`` has a row: :meth:`member`'s miss path by the hash
        alone (the ``hash`` of a key prepared for a table of the same hash key), so a caller
        holding such a key needs no key prepared for this table to learn that. False means
        only "maybe": :meth:`member` answers."""
        try:
            home = h & self._mask
            ver = self._ver
            b = home >> 4
            v = ver[b]
            j = 2 * home
            idx = self._idx
            sh = idx[j]
            while sh != h:
                if not sh:  # an empty slot first: a sure miss if no writer moved the bucket
                    return ver[b] == v & -2
                j += 2
                if not j & 31:
                    return False  # the probe goes on into the next bucket
                sh = idx[j]
            return False
        except Exception:
            self._if_closed()
            raise

    def lookup(self, key: Any) -> list[Any]:
        """The values of ``key``'s rows: ``[]``, ``[value]`` for a set, any number for a bag."""
        try:
            # member()'s miss path, inlined again: one shared helper made a miss 1.5-2x slower
            # (tools/bench_table.py, lookup miss 3.1x -> 4.5-6x the floor).
            try:
                if key.t is not self:  # prepared for another table
                    key = self.prepare(key)
            except AttributeError:  # a plain key (no msgpack-able value has an attribute "t")
                key = self.prepare(key)
            ver = self._ver
            b = key.b
            v = ver[b]
            j = key.j
            idx = self._idx
            sh = idx[j]
            if not sh:  # empty home slot
                if ver[b] == v & -2:  # unchanged and even (versions only grow)
                    return []
            else:  # hashes only, within the home bucket
                h = key.hash
                while sh != h:
                    j += 2
                    if not j & 31:
                        break
                    sh = idx[j]
                    if not sh:
                        if ver[b] == v & -2:
                            return []
                        break
            return [_unpack(x) for x in self._read(key)[0]]
        except Exception:
            self._if_closed()
            raise

    def word(self, key: Any) -> int | None:
        """The word of ``key``'s row (see ``layout.py``; a bag: of one of its rows), or None
        when it has no row. Lock-free and never torn: a word is one aligned u32 store, and the
        bucket versions around the read show its record was still the row's. A set's key that
        keeps its word's place (``wref``, from the last probe that found it) is read there, with
        no probe, while that slot's bucket version has not moved (before and after the load)."""
        try:
            if key.__class__ is not PreparedKey or key.t is not self:
                key = self.prepare(key)
            w = key.wref
            if w is not None:
                ver = self._ver
                b, v, ref = w
                if ver[b] == v:
                    word = self._u32[ref]
                    if ver[b] == v:
                        return word
            got = self._read(key, True)[0]
            return got[0] if got else None
        except Exception:
            self._if_closed()
            raise

    def get(self, key: Any, default: Any = None) -> Any:
        """The value of ``key`` (for a bag: one of its values), or ``default``."""
        vals = self.lookup(key)
        return vals[0] if vals else default

    def count(self) -> int:
        """Number of rows (the header counter: exact whenever no writer is mid-operation).
        A counter at or above capacity that disagrees with the free stack (garbage, or a writer
        mid-operation) is not trusted: the count then comes from the index (still lock-free)."""
        try:
            n = self._hq[_ROWS]
            if n >= self.capacity and n + self._hq[_TOP] + self._hq[_LTOP] != self._nrec:
                return min(self.nslots - self._idx.tolist()[::2].count(0), self.capacity)
            return n
        except Exception:
            self._if_closed()
            raise

    def watch(self, key: Any) -> Watch:
        """A cached poll of ``key`` (see :class:`Watch`)."""
        self._check_open()
        return Watch(self, self.prepare(key))

    def _snapshot(self) -> list[tuple[int, int, bytes, bytes, int]]:
        """A consistent copy of every row: optimistic (all versions even and unchanged around
        the copy), else under the lock. A copy with unmoved versions in which an entry fails
        validation or shares its record with another is corrupt: it is repaired under the lock
        (so no row is ever returned twice)."""
        ents = self._optimistic(self._entries)
        if ents is not None and _sound(ents):
            return ents
        if self._lockless:
            # No lock to fall back to (a writer died mid-write and left a version odd, or
            # keeps writing): the index as copied now, not consistent with the records read
            # after it. Kept: the entries whose record validates and holds a key of the slot's
            # hash (a slot copied before its record was freed and written again for another
            # key names that key's record), each record once (a writer killed mid backward
            # shift leaves one entry twice), and in a set each key once, its latest write (a
            # slot copied before an overwrite names the old record, intact until reused). A row
            # moved between slots while the index was copied may be missed: best effort.
            words = self._idx.tolist()
            seen: set[int] = set()
            out: list[tuple[int, int, bytes, bytes, int]] = []
            latest: dict[bytes, int] = {}  # a set's key -> its entry's place in out
            for e in self._entries(words):
                if e[4] < 0 or e[1] in seen or self._hash(e[2]) != words[2 * e[0]]:
                    continue
                seen.add(e[1])
                if not self._set:
                    out.append(e)
                elif (i := latest.get(e[2])) is None:
                    latest[e[2]] = len(out)
                    out.append(e)
                elif e[4] > out[i][4]:  # stamps grow with every write of the table
                    out[i] = e
            return out
        with self._lock:
            ents = self._entries(self._idx.tolist())
            if not _sound(ents):  # under the lock: corruption, not a race
                self._repair(f"table {self.name!r}: an index entry references a record failing "
                             "validation or referenced twice")
                ents = self._entries(self._idx.tolist())
            return [e for e in ents if e[4] >= 0]

    def large_rows(self) -> list[tuple[Any, Any]]:
        """(key, value) of every row held in a large record (see ``layout.py``). Under the
        lock: O(L), the large records off the free stack, each kept only if validated and
        referenced by its key's entry. Lock-free: from one consistent copy of the index."""
        self._check_open()
        if not self._nlarge:
            return []
        cap, rec, hq = self.capacity, self._record, self._hq
        out = []
        if self._lock.held_by_me() and hq[_LTOP] <= self._nlarge:
            free = set(self._free[cap + 1:cap + 1 + hq[_LTOP]])
            for r in range(cap + 1, self._nrec):
                got = rec(r) if r not in free else None
                if got is not None and self._locate(self._hash(got[0]), r) >= 0:
                    out.append((_unpack(got[0]), _unpack(got[1])))
            return out
        words = self._index_words()
        for j in range(0, self._nwords, 2):
            if words[j] and words[j + 1] > cap:
                got = rec(words[j + 1])
                if got is not None:
                    out.append((_unpack(got[0]), _unpack(got[1])))
        return out

    def scan(self, pred: Callable[[Any, Any], bool] | None = None) -> list[tuple[Any, Any]]:
        """Every (key, value) for which ``pred(key, value)`` is true (all rows when None), from
        one consistent snapshot, in index order."""
        self._check_open()
        out = []
        for _, _, kb, vb, _ in self._snapshot():
            k, v = _unpack(kb), _unpack(vb)
            if pred is None or pred(k, v):
                out.append((k, v))
        return out

    def scan_slots(self, start: int, count: int) -> tuple[list[tuple[Any, Any]], int]:
        """The (key, value) rows whose entries lie in index slots ``start .. start + count - 1``
        (cyclically), and the slot to continue from: a bounded piece of a full scan, for sweeps
        that must not hold the lock for a whole table. ``start`` is rounded down and ``count``
        up to whole buckets; ``count`` is capped at ``nslots``. Consistent within the piece
        (optimistic, else under the lock); a row a backward shift moves across the piece's edge
        between two calls may be missed by that pass."""
        self._check_open()
        nb = self.nslots // BUCKET_SLOTS
        b0 = (start % self.nslots) // BUCKET_SLOTS
        n = min(nb, max(1, -(-count // BUCKET_SLOTS)))
        buckets = [(b0 + i) % nb for i in range(n)]
        ver = self._ver
        idx = self._idx
        rec = self._record

        def read(strict: bool) -> list[tuple[bytes, bytes]] | None:
            out = []
            for b in buckets:
                j = 2 * BUCKET_SLOTS * b
                for w in range(j, j + 2 * BUCKET_SLOTS, 2):
                    if idx[w]:
                        r = rec(idx[w + 1])
                        if r is not None:
                            out.append((r[0], r[1]))
                        elif strict:  # torn by a writer, or damage fsck will drop
                            return None
            return out

        got = None
        for attempt in range(READ_RETRIES // 4):
            if attempt >= _SPIN_BEFORE_YIELD:
                os.sched_yield()
            v0 = [ver[b] for b in buckets]
            if any(v & 1 for v in v0):
                continue
            got = read(True)
            if got is not None and [ver[b] for b in buckets] == v0:
                break
            got = None
        if got is None and self._lockless:
            got = read(False) or []  # no lock to fall back to: the rows that validate
        elif got is None:
            with self._lock:
                got = read(False) or []
        nxt = ((b0 + n) % nb) * BUCKET_SLOTS
        return [(_unpack(kb), _unpack(vb)) for kb, vb in got], nxt


def _sound(ents: list[tuple[int, int, bytes, bytes, int]]) -> bool:
    """Every entry of ``ents`` (see ``Table._entries``) valid, no record referenced twice."""
    return all(e[4] >= 0 for e in ents) and len({e[1] for e in ents}) == len(ents)
