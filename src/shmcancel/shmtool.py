"""``shmtool``: inspect and maintain shmcancel registries (contract §7).

::

    shmtool list [--json]            registries in /dev/shm: name, size, bytes allocated,
                                     creator pid, state (alive, stale: creator gone,
                                     orphaned: creator gone, other processes still using
                                     it, leftover: no segment, foreign: created in another
                                     pid namespace (its processes cannot be judged here),
                                     unusable: unreadable, or a worker could not attach it)
                                     and a one-line note: what is wrong, which command removes
                                     it (or, for a damaged region header, `fsck` repairs it),
                                     other users' entries under its names
    shmtool dump NAME [--json]       every cancellation and in-flight row (the shared table's
                                     and the processes' lanes'), and every unreadable entry
                                     (a corrupted record: table, slot, record number)
    shmtool stats NAME [--json]      capacity, rows per table, top scopes, probe lengths, lock,
                                     recoveries, evictions, sweeps, the processes' lanes,
                                     unreadable entries per table
    shmtool cleanup NAME [--ttl S]   run a cleanup now (expired rows, dead owners' rows; it
                                     repairs the tables first and prints per table what it
                                     repaired: unreadable entries dropped, counters)
    shmtool cleanup --stale [NAME..] remove every stale or leftover registry (or only those
                                     named); a live one is never removed (named: exit 1), nor
                                     an orphaned one or a segment without a shmcancel header
                                     (exit 1)
    shmtool fsck NAME                check and repair every table under the lock, as a worker's
                                     lock recovery does; the one repair for a table's damaged
                                     region header, which makes new attachments fail
    shmtool unlink NAME [--force]    remove whatever exists of the registry's segment, semaphore,
                                     lock file and temporaries (attached processes keep their
                                     mapping until they exit); refused while its creator lives

``list``, ``dump`` and ``stats`` attach read-only: they never take the registry lock, never block
on it and never write. ``cleanup`` and ``fsck`` attach read-write and take the lock like any
worker.
No command follows, blocks on or uses an entry of /dev/shm that is not a regular file owned by the
current user (a symbolic link, a FIFO, another user's file): it is reported in one line.
Another user's entry under a registry's names (``shmcancel.NAME~x``, say) is not part of that
registry: ``cleanup --stale`` and ``unlink`` report it in one line and leave it, and it neither
blocks removing the rest nor changes their exit status. A link or FIFO of the current user's own
is removed by ``unlink`` only (``cleanup --stale`` removes regular files), and ``list`` advises
accordingly.

Exit status (also in ``shmtool --help``): 0 on success (``dump`` and ``stats`` report unreadable
entries in their output, with 0: the rest was read); 1 for a shmcancel error (a missing registry,
a bad name, an incompatible segment, a table's damaged region header, a live creator's registry
to unlink, ...) with one line on stderr and no traceback, or for ``cleanup --stale`` when it
skipped any registry (one line each); 2 for a usage error.

Every ``--json`` output is strict JSON: a time or number that is not finite (a row written with a
broken clock, a garbled header) is ``null``, never ``NaN`` or ``Infinity``.

``dump --json`` prints one object::

    {"name": ..., "now": <time.time()>,
     "cancellations": [{"scope", "request_id", "reason", "cancelled_at"}, ...],
     "in_flight": [{"scope", "request_id", "pid", "alive", "start_time", "thread", "token"}, ...],
     "sessions": <how many session rows>,
     "unreadable": [{"table", "slot", "record"}, ...]}  (entries whose record is corrupted)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shlex
import shutil
import stat
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import posix_ipc

from .cancel.policy import Cancellation
from .cancel.shm_storage import ShmBackend
from .cancel.tables import CANCELLATIONS
from .exceptions import RegistryIncompatible, RegistryNotFound, ShmCancelError
from .mcp.session_tables import SESSIONS
from .shm import procinfo
from .shm.names import (
    SHM_DIR,
    NotOurs,
    check_entry,
    check_name,
    describe,
    drop_lockfile,
    flock_bounded,
    lock_path,
    registry_owner,
    segment_path,
    split_paths,
    stat_problem,
)
from .shm.names import unlink_names as _unlink_names
from .shm.registry import Registry, add_repairs
from .shm.segment import ForeignPidNamespace, creator_of
from .shm.table import RegionHeaderDamaged

__all__ = ["main"]

PREFIX = "shmcancel."
# Entries of /dev/shm that belong to a registry NAME: prefix + NAME (+ "~..." for temporaries).
ENTRY_PREFIXES = ("shmcancel.", "sem.shmcancel.", "shmcancel-lock.")
TOP_SCOPES = 10
LOCK_WAIT = 1.0  # seconds unlink / cleanup --stale wait for a creation to finish


_EXIT_STATUS = """\
exit status: 0 on success (dump and stats also when they report unreadable entries, fsck
also when it repaired the registry); 1 for a shmcancel error (one line on stderr: a missing
registry, a bad name, a registry a worker cannot attach, e.g. a table's damaged region
header, which `fsck` repairs), or for cleanup --stale when it skipped a registry; 2 for a
usage error."""


class _Usage(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def _parser() -> argparse.ArgumentParser:
    p = _Usage(prog="shmtool", description="Inspect and maintain shmcancel registries.",
               formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_EXIT_STATUS)
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND", parser_class=_Usage)
    s = sub.add_parser("list", help="registries in /dev/shm")
    s.add_argument("--json", action="store_true", help="one JSON object")
    s = sub.add_parser("dump", help="every cancellation and in-flight row (read-only)")
    s.add_argument("name")
    s.add_argument("--json", action="store_true", help="one JSON object")
    s = sub.add_parser("stats", help="sizes, counters, top scopes, probe lengths (read-only)")
    s.add_argument("name")
    s.add_argument("--json", action="store_true", help="one JSON object")
    s = sub.add_parser("cleanup", help="remove expired rows and dead processes' rows now; "
                       "with --stale, remove every registry whose creator is gone and that no "
                       "process uses")
    s.add_argument("name", nargs="*")
    s.add_argument("--ttl", type=float, default=None, help="seconds (default: the config's)")
    s.add_argument("--stale", action="store_true",
                   help="remove all stale and leftover registries (with NAMEs: only those)")
    s = sub.add_parser("fsck", help="check and repair every table under the lock (a damaged "
                       "region header included, which new attachments refuse)")
    s.add_argument("name")
    s = sub.add_parser("unlink", help="remove the registry's segment, semaphore, lock file and "
                       "temporaries")
    s.add_argument("name")
    s.add_argument("--force", action="store_true",
                   help="even while the registry's creator (a server) is alive")
    return p


# ------------------------------------------------------------------------------------ helpers
def _finite(v: Any) -> Any:
    """``v`` with every float that is not finite (NaN, +-Infinity: a header or row written with a
    broken clock, or garbage) replaced by ``None``, through dicts and lists."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_finite(x) for x in v]
    return v


def _print_json(obj: Any) -> None:
    """One object as strict JSON (non-finite floats as ``null``, never ``NaN``/``Infinity``)."""
    print(json.dumps(_finite(obj), allow_nan=False))


def _age(now: float, t: float) -> str:
    """How long ago ``t`` was (``now``, ``t``: seconds), or how far ahead ("in ..."): a short
    word whatever the stamp (an injected clock's 1e308 too)."""
    d = now - t
    if not math.isfinite(d):
        return "-"
    return f"in {_span(-d)}" if d < 0 else f"{_span(d)} ago"


def _span(d: float) -> str:
    if d < 120:
        return f"{d:.1f}s"
    if d < 7200:
        return f"{d / 60:.1f}m"
    if d < 172800:
        return f"{d / 3600:.1f}h"
    return f"{d / 86400:.1f}d" if d < 8.64e10 else f"{d / 86400:.3g}d"  # past a million days


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    raise AssertionError  # pragma: no cover


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Aligned columns; numbers right-aligned."""
    cells = [[("-" if v is None else str(v)) for v in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    numeric = [all(isinstance(r[i], int | float) and not isinstance(r[i], bool) for r in rows)
               and rows for i in range(len(headers))]
    out = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    for r in cells:
        out.append("  ".join(
            (c.rjust(w) if numeric[i] else c.ljust(w))
            for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip())
    return "\n".join(out)


def _printable(s: Any) -> str:
    """A scope, id or reason for a terminal: control characters escaped (reasons are already
    stripped of them; scopes and ids are client text). So are the names of entries in /dev/shm
    (anyone can make ``shmcancel.NAME~<line break, escapes>``) in every message: one line each,
    nothing for the terminal to act on."""
    s = str(s)
    return s if s.isprintable() else s.encode("unicode_escape").decode("ascii")


def _basenames(paths: Sequence[str]) -> str:
    """Entries of /dev/shm for a message: their file names, escaped (:func:`_printable`)."""
    return ", ".join(_printable(os.path.basename(p)) for p in paths)


def _attach_ro(name: str) -> Registry:
    return Registry.attach(check_name(name), readonly=True)


def _read(name: str, collect: Callable[[Registry], dict[str, Any]]) -> dict[str, Any]:
    """``collect(reg)`` over registry ``name`` attached read-only (closed afterwards)."""
    reg = _attach_ro(name)
    try:
        return collect(reg)
    finally:
        reg.close()


# ------------------------------------------------------------------------------------ commands
def _entries() -> dict[str, list[str]]:
    """Registry name -> its entries in /dev/shm (file names), for every valid name."""
    try:
        files = sorted(os.listdir(SHM_DIR))
    except OSError as e:
        raise ShmCancelError(f"cannot list {SHM_DIR}: {e.strerror}") from None
    out: dict[str, list[str]] = {}
    for f in files:
        for prefix in ENTRY_PREFIXES:
            if f.startswith(prefix):
                name = f[len(prefix):].split("~", 1)[0]
                if "~" in f and prefix != PREFIX:
                    continue
                try:
                    check_name(name)
                except ShmCancelError:
                    continue
                out.setdefault(name, []).append(f)
                break
    return out


def _one_line(e: BaseException | str) -> str:
    """``e``'s message on one line, escaped (:func:`_printable`)."""
    return _printable(" ".join(str(e).split()) or type(e).__name__)


def _short(e: BaseException | str) -> str:
    msg = _one_line(e)
    return msg if len(msg) <= 160 else msg[:157] + "..."


def _left(path: str, st: os.stat_result) -> str:
    """One line on another user's entry under a registry's names, which is left alone."""
    return f"{_printable(path)} belongs to uid {st.st_uid} ({describe(st)}): left alone"


def _report_left(name: str, others: list[tuple[str, os.stat_result]]) -> None:
    """One line on stderr for each of ``others``: reported, not a failure (other users' entries
    are not part of registry ``name``)."""
    for path, st in others:
        print(f"shmtool: {name}: {_left(path, st)}", file=sys.stderr)


def _bad_own(own: list[str], skip: Sequence[str] = ()) -> dict[str, str]:
    """Of the registry's own entries (but ``skip``), those ``cleanup --stale`` will not touch: a
    symbolic link, a FIFO, not a regular file (``unlink`` removes them), by path."""
    out = {}
    for path in own:
        if path in skip:
            continue
        try:
            problem = stat_problem(os.lstat(path))
        except FileNotFoundError:
            continue
        except OSError as e:
            problem = f"cannot be examined ({e.strerror})"
        if problem is not None:
            out[path] = f"{_printable(path)} {problem}"
    return out


def _registry_row(name: str) -> dict[str, Any]:
    """One row of ``list``; ``state``: alive, stale (creator gone), orphaned (creator gone,
    other processes still mapping it: a killed master's workers), leftover (no segment, only
    a semaphore / lock file / temporary), or unusable (unreadable, or a worker could not attach
    it: its semaphore missing, replaced, a link, a FIFO, another user's). ``error``
    is one line: what is wrong, the command that removes the registry when one would, then
    other users' entries under its names (which every command leaves alone)."""
    row: dict[str, Any] = {"name": name, "size": 0, "allocated": 0, "creator_pid": None,
                           "creator_alive": None, "state": "unusable", "error": None}
    own, others = split_paths(name)
    seg = segment_path(name)
    said: set[str] = {seg}  # paths an earlier part of the note names already

    def note(problems: Sequence[str], advice: str | None = None) -> None:
        parts = "; ".join(problems) + (f": {advice}" if advice else "")
        left = [_left(p, st) for p, st in others if p not in said]
        row["error"] = "; ".join([x for x in (parts, *left) if x]) or None

    def removable(state: str, problem: str, skip: Sequence[str]) -> dict[str, Any]:
        # ``cleanup --stale`` removes it unless an entry of ours (but ``skip``) is a link, a
        # FIFO or a directory (it removes regular files only); ``unlink`` removes those too.
        # Other users' entries are left alone by both and block neither.
        row["state"] = state
        bad = _bad_own(own, skip=skip)
        # the command for this registry alone: --stale without a NAME removes every stale one
        note([problem, *bad.values()],
             f"{_prog()} {'unlink' if bad else 'cleanup --stale'} {name} removes it")
        return row

    try:
        st = check_entry("segment", seg)
        if st is None:
            if not own:
                row["state"] = "leftover"
                note(["no segment, nothing of ours"])
                return row
            return removable("leftover", f"no segment, only {_basenames(own)}", ())
        row["size"], row["allocated"] = st.st_size, st.st_blocks * 512
        reg = _attach_ro(name)
    except ShmCancelError as e:
        # a damaged region header: the long field-by-field message would hide the advice, and
        # the registry is one to repair, never to remove
        fix = (f"{_prog()} fsck {name} repairs it" if isinstance(e, RegionHeaderDamaged)
               else None)
        problem = (f"table {_printable(e.table)!r}: region header damaged"
                   if isinstance(e, RegionHeaderDamaged) else _short(e))
        note([problem], fix)
        with contextlib.suppress(ShmCancelError, OSError):
            # a readable header of another layout, or of another user's, still has one
            owner = creator_of(name, any_owner=True)
            if owner is not None:
                row["creator_pid"], row["creator_alive"] = owner[0], procinfo.alive(*owner)
        if fix is not None:
            if row["creator_alive"] is False:
                row["state"] = "stale"
                note([problem, "creator gone"], fix)
            elif row["creator_alive"]:
                note([f"{problem}; its creator, pid {row['creator_pid']}, is alive"], fix)
        elif row["creator_alive"] is False and isinstance(e, NotOurs):
            # cleanup --stale leaves another user's segment alone (check_entry)
            row["state"] = "stale"
            note([_short(e)], f"{_prog()} unlink {name}, run by its owner or root, removes it")
        elif row["creator_alive"] is False:
            removable("stale", _short(e), [seg])
        elif row["creator_alive"]:  # not one to remove, whoever can: a server uses it
            problem = _short(e.problem if isinstance(e, NotOurs) else e)
            note([f"{problem}; its creator, pid {row['creator_pid']}, is alive"])
        return row
    try:
        info = reg.info()
        cannot_attach = reg.attach_problems()
    finally:
        reg.close()
    row["creator_pid"] = info["creator_pid"]
    row["creator_alive"] = info["creator_alive"]
    row["created_at"] = info["created_at"]
    if info["creator_alive"] is None:  # another pid namespace's: neither alive nor stale here
        row["state"] = "foreign"
        note(["created in another pid namespace: its processes cannot be judged from here"])
        return row
    if info["creator_alive"]:
        said.update(cannot_attach)
        bad = _bad_own(own, skip=list(said))
        if cannot_attach:
            # Every worker's attach (and ``cleanup NAME``) refuses it: not "alive".
            row["state"] = "unusable"
            note(["a worker cannot attach it: " + "; ".join(
                _short(m.removeprefix(f"registry {name}: ")) for m in cannot_attach.values()),
                *bad.values()])
        else:
            row["state"] = "alive"
            note(list(bad.values()))
        return row
    users = _users(seg)
    if users:  # the creator gone, its workers not (a master killed): not for cleanup --stale
        row["state"] = "orphaned"
        note([f"creator gone, but {_still_used(users)}"],
             f"{_prog()} unlink {name} removes it under them")
        return row
    return removable("stale", "creator gone", [seg])


def _users(seg: str) -> list[int]:
    """Pids of other processes seen to map the segment file ``seg`` (their ``/proc`` maps
    readable: a process whose are not, which may map it or not, is not counted, so a stale
    registry is not kept for pid 1); empty when it is gone. A ``/proc`` scan: milliseconds."""
    try:
        ino = os.stat(seg, follow_symlinks=False).st_ino
    except OSError:
        return []
    return sorted(procinfo.mappers(seg, ino, seen_only=True))


def _still_used(pids: list[int]) -> str:
    """"pid 12 still uses it", "pids 12, 13 still use it" (five named at most)."""
    shown = ", ".join(map(str, pids[:5])) + (f" and {len(pids) - 5} more" if len(pids) > 5 else "")
    return f"pid {shown} still uses it" if len(pids) == 1 else f"pids {shown} still use it"


def _registries() -> list[dict[str, Any]]:
    return [_registry_row(name) for name in _entries()]


def cmd_list(args: argparse.Namespace) -> int:
    regs = _registries()
    if args.json:
        _print_json({"registries": regs})
        return 0
    if not regs:
        print(f"no registries in {SHM_DIR}")
        return 0
    rows = [(r["name"], _size(r["size"]), _size(r["allocated"]), r["creator_pid"], r["state"],
             r["error"] or "") for r in regs]
    print(_table(("NAME", "SIZE", "ALLOCATED", "CREATOR", "STATE", "NOTE"), rows))
    return 0


def _dump(reg: Registry) -> dict[str, Any]:
    now = time.time()
    cancels = []
    for k, v in reg.table(CANCELLATIONS).scan():
        scope, rid = (k[0], k[1]) if isinstance(k, tuple) and len(k) == 2 else (repr(k), None)
        reason, at = (v[0], v[1]) if isinstance(v, tuple) and len(v) == 2 else (repr(v), None)
        if not isinstance(at, int | float) or isinstance(at, bool) or not math.isfinite(at):
            at = None  # not a time (a broken clock wrote it): null, sorted first
        cancels.append({"scope": scope, "request_id": rid, "reason": reason, "cancelled_at": at})
    cancels.sort(key=lambda r: (r["cancelled_at"] or 0.0, str(r["scope"]), str(r["request_id"])))
    flights = []
    alive_cache: dict[tuple[int, int], bool | None] = {}
    for k, v in ShmBackend(reg).in_flight_rows():
        scope, rid = (k[0], k[1]) if isinstance(k, tuple) and len(k) == 2 else (repr(k), None)
        if isinstance(v, tuple) and len(v) == 4 and all(isinstance(x, int) for x in v):
            pid, start, tid, token = v
            if (pid, start) not in alive_cache:
                alive_cache[(pid, start)] = reg.alive(pid, start)
            alive: bool | None = alive_cache[(pid, start)]
        else:
            pid = start = tid = token = None
            alive = None
        flights.append({"scope": scope, "request_id": rid, "pid": pid, "alive": alive,
                        "start_time": start, "thread": tid, "token": token})
    flights.sort(key=lambda r: (str(r["scope"]), str(r["request_id"]), r["pid"] or 0))
    unreadable = [{"table": name, "slot": slot, "record": r}
                  for name, t in reg.tables.items() for slot, r in t.unreadable()]
    return {"name": reg.name, "now": now, "cancellations": cancels, "in_flight": flights,
            "sessions": reg.table(SESSIONS).count(), "unreadable": unreadable}


def cmd_dump(args: argparse.Namespace) -> int:
    d = _read(args.name, _dump)
    if args.json:
        _print_json(d)
        return 0
    now = d["now"]
    bad = d["unreadable"]
    print(f"registry {d['name']}: {len(d['cancellations'])} cancellations, "
          f"{len(d['in_flight'])} in flight, {d['sessions']} sessions"
          + (f", {len(bad)} UNREADABLE entries" if bad else ""))
    print()
    if bad:
        print(f"unreadable entries (corrupted records, not shown below; `shmtool cleanup "
              f"{d['name']}` drops them)")
        print(_table(("TABLE", "SLOT", "RECORD"),
                     [(r["table"], r["slot"], r["record"]) for r in bad]))
        print()
    if d["cancellations"]:
        print(_table(("SCOPE", "REQUEST_ID", "CANCELLED", "REASON"), [
            (_printable(r["scope"]), _printable(r["request_id"]),
             _age(now, r["cancelled_at"]) if r["cancelled_at"] is not None else None,
             "" if r["reason"] is None else _printable(r["reason"]))
            for r in d["cancellations"]]))
    else:
        print("no cancellations")
    print()
    if d["in_flight"]:
        print(_table(("SCOPE", "REQUEST_ID", "PID", "STATE", "THREAD"), [
            (_printable(r["scope"]), _printable(r["request_id"]), r["pid"],
             {True: "alive", False: "dead", None: "?"}[r["alive"]], r["thread"])
            for r in d["in_flight"]]))
    else:
        print("nothing in flight")
    return 0


def _lanes(reg: Registry) -> list[dict[str, Any]]:
    """The claimed lanes of each table that has them: owner and rows (written without the lock;
    docs/design.md, "Lanes")."""
    out = []
    for table, lanes in sorted(reg.lanes.items()):
        rows = Counter((o[0], o[1]) for _, o in lanes.rows())
        out += [{"table": table, "lane": i, "pid": o[0], "alive": reg.alive(*o),
                 "rows": rows[o]} for i, o in lanes.lane_owners()]
    return out


def _stats(reg: Registry) -> dict[str, Any]:
    info = reg.info()
    tables = {}
    for name, t in reg.tables.items():
        st = t.stats()
        st["kind"] = t.kind
        st["probe_histogram"] = {str(k): v for k, v in st["probe_histogram"].items()}
        tables[name] = st
    per_scope = Counter(k[0] for k, _ in reg.table(CANCELLATIONS).scan()
                        if isinstance(k, tuple) and len(k) == 2)
    cfg = info["config"]
    return {
        "name": reg.name,
        "size": info["total_size"],
        "allocated": info["allocated"],
        "created_at": info["created_at"],
        "creator_pid": info["creator_pid"],
        "creator_alive": info["creator_alive"],
        "config": cfg,
        "capacity": cfg["capacity"],
        "max_rows": cfg["max_rows"],
        "max_rows_per_scope": cfg["max_rows_per_scope"],
        "rows": {n: st["rows"] for n, st in tables.items()},
        "unreadable": {n: st["unreadable"] for n, st in tables.items()},
        "tables": tables,
        "top_scopes": [{"scope": s, "rows": n} for s, n in per_scope.most_common(TOP_SCOPES)],
        "scopes": len(per_scope),
        "lock": {"owner_pid": info["lock_owner_pid"], "owner_alive": info["lock_owner_alive"],
                 "owner_stopped": (info["lock_owner_alive"] is True
                                   and procinfo.stopped(info["lock_owner_pid"])),
                 "generation": info["lock_generation"],
                 "semaphore_value": info["semaphore_value"]},
        "lanes": _lanes(reg),
        "recoveries": info["recoveries"],
        "evictions": info["evictions"],
        "sweeps": info["sweeps"],
        "last_sweep": info["last_sweep"] if info["sweeps"] else None,  # the creation's stamp
        "last_sweeper_pid": info["last_sweeper_pid"],
    }


def cmd_stats(args: argparse.Namespace) -> int:
    s = _read(args.name, _stats)
    if args.json:
        _print_json(s)
        return 0
    now = time.time()
    lock = s["lock"]
    unknown = "unknown: another pid namespace"
    holder = ("free" if lock["owner_pid"] is None else
              f"held by pid {lock['owner_pid']} "
              f"({ {True: 'alive', False: 'DEAD', None: unknown}[lock['owner_alive']]})")
    if lock.get("owner_stopped"):
        holder += (f" but STOPPED (SIGSTOP or a debugger): `kill -CONT {lock['owner_pid']}` "
                   "resumes it, else every write waits out lock_timeout")
    if lock["owner_pid"] is None and lock.get("semaphore_value") == 0:
        # taken between its sem_wait and recording itself, or stopped there (SIGSTOP); a
        # waiter recovers it once it is known dead (docs/design.md, "The lock and its recovery")
        holder = "taken by a process that has not recorded itself (semaphore 0)"
    alloc = "" if s["allocated"] is None else f" ({_size(s['allocated'])} allocated)"
    print(f"registry {s['name']}: {_size(s['size'])}{alloc}, created "
          f"{_age(now, s['created_at'])} "
          f"by pid {s['creator_pid']} "
          f"({ {True: 'alive', False: 'gone', None: unknown}[s['creator_alive']]})")
    print(f"limits: max_rows={s['max_rows']} capacity={s['capacity']} "
          f"max_rows_per_scope={s['max_rows_per_scope']} ttl={s['config']['ttl']}s "
          f"janitor_interval={s['config']['janitor_interval']}s")
    print(f"lock: {holder}, generation {lock['generation']}, recoveries {s['recoveries']}")
    last = "never" if s["sweeps"] == 0 else _age(now, s["last_sweep"])
    print(f"evictions {s['evictions']}, sweeps {s['sweeps']} (last {last})")
    lanes = ", ".join(f"{x['table']} pid {x['pid']}{'' if x['alive'] is not False else ' (DEAD)'}: "
                      f"{x['rows']}" for x in s["lanes"]) or "none"
    print(f"lanes claimed (rows written without the lock): {lanes}")
    print()
    print(_table(("TABLE", "KIND", "ROWS", "CAPACITY", "LOAD", "MAX_PROBE", "RECORD",
                  "LARGE"), [
        (n, t["kind"], t["rows"], t["capacity"], f"{t['load']:.1%}", t["max_probe"],
         f"{t['small_size']}/{t['record_size']}" if t["large_count"] else t["record_size"],
         f"{t['large_rows']}/{t['large_count']}" if t["large_count"] else "-")
        for n, t in s["tables"].items()]))
    bad = {n: t["unreadable"] for n, t in s["tables"].items() if t["unreadable"]}
    if bad:
        print("UNREADABLE entries (corrupted records, counted in ROWS; `shmtool cleanup "
              f"{s['name']}` drops them): " + ", ".join(f"{n} {k}" for n, k in bad.items()))
    print()
    print("probe lengths (distance from home slot: entries)")
    for n, t in s["tables"].items():
        hist = ", ".join(f"{k}: {v}" for k, v in t["probe_histogram"].items()) or "empty"
        print(f"  {n}: {hist}")
    print()
    if s["top_scopes"]:
        print(f"top scopes ({s['scopes']} with rows)")
        print(_table(("SCOPE", "ROWS"), [(_printable(r["scope"]), r["rows"])
                                          for r in s["top_scopes"]]))
    else:
        print("no cancellation rows")
    return 0


def cmd_cleanup(args: argparse.Namespace) -> int:
    if args.stale:
        if args.ttl is not None:
            raise _UsageError("cleanup --stale takes no --ttl")
        return _cleanup_stale([check_name(n) for n in args.name])
    if len(args.name) != 1:
        raise _UsageError("cleanup needs one registry NAME (or --stale)")
    if args.ttl is not None and not args.ttl >= 0:
        raise _UsageError(f"--ttl must be a number of seconds >= 0, got {args.ttl}")
    reg = Registry.attach(check_name(args.name[0]))
    try:
        # what the attach's own check repaired, then what the sweep checks first: here to say
        repaired: dict[str, Counter[str]] = {}
        for rep in (reg.attach_repairs, reg.check()):
            add_repairs(repaired, rep)
        removed, in_flight_removed = Cancellation(reg).sweep(args.ttl)
    finally:
        reg.close()
    print(f"removed {removed} cancellation rows, {in_flight_removed} in-flight rows")
    for table, counts in repaired.items():
        bad = counts.get("bad_entries", 0)
        what = ", ".join(f"{k} {v}" for k, v in counts.items() if v and k != "bad_entries")
        print(f"table {table}: " + ", ".join(
            ([f"dropped {bad} unreadable entries"] if bad else [])
            + ([f"repaired ({what})"] if what else [])))
    return 0


def cmd_fsck(args: argparse.Namespace) -> int:
    reg = Registry.attach(check_name(args.name), repair=True)
    try:
        rep = reg.repair()
        recovered = reg.recovery_repairs
    finally:
        reg.close()
    if not rep:
        print(f"registry {args.name}: clean, nothing to repair")
    for table, counts in rep.items():
        what = ", ".join(f"{k} {v}" for k, v in counts.items() if v)
        by = (" (by the lock's recovery from a dead holder, as fsck took the lock)"
              if table in recovered else "")
        print(f"table {table}: repaired ({what}){by}")
    return 0


class _UsageError(Exception):
    pass


@contextlib.contextmanager
def _creation_lock(name: str, force: bool) -> Iterator[None]:
    """Hold ``name``'s creation flock, so that no creation is under way while
    its entries are removed. A lock file that is not ours cannot be what a creator of ours
    holds: nothing is locked then. Nor is anything for another user's registry (root removing
    it): its creators refuse a lock file of ours, and one made here would be left behind, not
    part of their registry. A lock file this made is removed again on leaving (a registry kept,
    a segment without a header skipped: the name is left as found). ``force``: go on even if
    the flock stays held."""
    fd = None
    made = False
    lockable = registry_owner(name) == os.geteuid()
    if lockable:
        try:
            made = check_entry("lock file", lock_path(name)) is None
        except RegistryIncompatible:
            lockable = False
    if lockable:
        try:
            fd = flock_bounded(name, LOCK_WAIT)
        except RegistryIncompatible:
            if not force:
                raise
    try:
        yield
    finally:
        if fd is not None:
            if made:
                drop_lockfile(name, fd)
            os.close(fd)


def _creator(name: str) -> tuple[bool, tuple[int, int] | None]:
    """``(headerless, creator)`` of ``name``'s segment, from one read of its header:
    ``(True, None)`` for a segment without a shmcancel header (not a registry: another
    program's file under our prefix, a bare table; no creator says whether it is in use; a
    registry's segment appears complete, written aside then linked into place); ``(False,
    None)`` when there is no segment or it is not a regular file; else the creator as
    ``creator_of`` reads it, alive or not. Another user's segment counts too: root must not
    remove a live server's registry by accident either. A regular file of ours that cannot be
    read: :class:`ShmCancelError` (:func:`_refuse_unreadable`)."""
    try:
        owner = creator_of(name, any_owner=True)
    except FileNotFoundError:
        return False, None
    except ForeignPidNamespace:
        raise  # whether it is in use cannot be judged here: kept
    except ShmCancelError:
        _refuse_unreadable(name)
        return False, None
    return owner is None, owner


def _refuse_unreadable(name: str) -> None:
    """``ShmCancelError`` when ``name``'s segment is a regular file of ours that could not be
    opened (its mode denies us, a careless ``chmod``): its creator is unknown, not gone, and the
    registry may be a live server's."""
    path = segment_path(name)
    try:
        st = os.lstat(path)
    except OSError:
        return
    if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
        raise ShmCancelError(
            f"registry {name}: {path} cannot be read (mode {stat.S_IMODE(st.st_mode):o}), so "
            f"whether its creator is alive is unknown: kept (chmod 600 it to inspect it, or "
            f"{_prog()} unlink {name} --force removes it)")


def _live_creator(name: str) -> int | None:
    """The pid of ``name``'s creator if it is alive (see :func:`_creator`), else ``None``."""
    _, owner = _creator(name)
    return owner[0] if owner is not None and procinfo.alive(*owner) else None


def _cleanup_stale(only: list[str]) -> int:
    """Remove stale and leftover registries (all, or those in ``only``): only what is known
    unused, a creator gone or no segment at all. A live one is kept, and reported when named;
    a segment without a shmcancel header is kept and reported. 1 if any was skipped or kept
    for a reason worth a line."""
    skipped = 0
    done = 0
    names = list(_entries())
    for name in only:
        if name not in names:
            print(f"shmtool: skipped {name}: no registry named {name} in {SHM_DIR}",
                  file=sys.stderr)
            skipped += 1
    for name in names:
        if only and name not in only:
            continue
        try:
            own, others = split_paths(name)
            if not own:  # only other users' entries: nothing of ours to remove
                if only:
                    _report_left(name, others)
                continue
            for path in own:  # only ever removes entries of ours, regular files
                check_entry("entry", path)
            with _creation_lock(name, force=False):
                headerless, owner = _creator(name)
                if owner is not None and procinfo.alive(*owner):
                    if only:
                        print(f"shmtool: kept {name}: its creator, pid {owner[0]}, is alive",
                              file=sys.stderr)
                        skipped += 1
                    continue
                users = _users(segment_path(name))
                if users:  # its creator is gone, its workers are not (a master killed)
                    print(f"shmtool: kept {name}: its creator is gone, but {_still_used(users)} "
                          f"({_prog()} unlink {name} removes it under them)", file=sys.stderr)
                    skipped += 1
                    continue
                if headerless:
                    print(f"shmtool: skipped {name}: its segment has no shmcancel header, so "
                          f"whether it is in use is unknown ({_prog()} unlink {name} removes it)",
                          file=sys.stderr)
                    skipped += 1
                    continue
                own, others = split_paths(name)
                if not own:  # gone meanwhile
                    continue
                for path in own:
                    check_entry("entry", path)
                removed = _unlink_names(name, own)
        except ShmCancelError as e:
            print(f"shmtool: skipped {name}: {_short(e)}", file=sys.stderr)
            skipped += 1
            continue
        done += 1
        print(f"removed stale registry {name} "
              f"({_basenames(removed)})")
        _report_left(name, others)
    if not done and not skipped:
        print("no stale registries")
    return 1 if skipped else 0


def _refuse_live_creator(name: str) -> None:
    """``ShmCancelError`` naming the creator of registry ``name`` when it is alive."""
    pid = _live_creator(name)
    if pid is not None:
        raise ShmCancelError(
            f"registry {name} is in use: its creator, pid {pid}, is alive (unlinking it "
            "would make the server's next worker fail to start); stop that server first, "
            "or pass --force")


def cmd_unlink(args: argparse.Namespace) -> int:
    name = check_name(args.name)
    existing, others = split_paths(name)
    if not existing:
        if others:
            path, st = others[0]
            raise RegistryNotFound(
                f"no registry named {name} of ours: only other users' entries "
                f"({path} belongs to uid {st.st_uid}), which are left alone")
        raise RegistryNotFound(f"no registry named {name} (nothing of it in {SHM_DIR})")
    if not args.force:
        # Refused at once while the creator lives, naming it, even while a creation holds the
        # flock below (waiting for it would end with a message naming no
        # process); checked again under the flock.
        _refuse_live_creator(name)
    with _creation_lock(name, args.force):  # may create the lock file: not reported
        if not args.force:
            _refuse_live_creator(name)
        own, others = split_paths(name)  # other users' entries: never touched
        removed = [p for p in _unlink_names(name, own) if p in existing]
    print(f"unlinked {name} ({_basenames(removed) or 'nothing left'})")
    _report_left(name, others)
    return 0


COMMANDS = {"list": cmd_list, "dump": cmd_dump, "stats": cmd_stats, "cleanup": cmd_cleanup,
            "fsck": cmd_fsck, "unlink": cmd_unlink}


@contextlib.contextmanager
def _escaping_stdout() -> Iterator[None]:
    """Scopes, request ids and reasons are client text: what the terminal's encoding cannot show
    (a Latin-1 or ASCII locale) is printed backslash-escaped, never a UnicodeEncodeError."""
    out = sys.stdout
    errors = getattr(out, "errors", None)
    reconfigure = getattr(out, "reconfigure", None)
    if reconfigure is None or errors in (None, "backslashreplace"):
        yield
        return
    try:
        reconfigure(errors="backslashreplace")
    except Exception:  # pragma: no cover - a stream that cannot be reconfigured
        yield
        return
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            reconfigure(errors=errors)


def _prog() -> str:
    """How to name this command in advice: as it was run (``.venv/bin/shmtool``, quoted for a
    shell; ``python -m shmcancel.shmtool`` with this interpreter), unless a ``shmtool`` on
    ``PATH`` runs it."""
    run = sys.argv[0] if sys.argv else ""
    found = shutil.which("shmtool")
    if os.path.basename(run) != "shmtool":  # python -m shmcancel.shmtool, or main() from Python
        return "shmtool" if found else f"{shlex.quote(sys.executable)} -m shmcancel.shmtool"
    if found and os.path.realpath(found) == os.path.realpath(run):
        return "shmtool"
    return shlex.quote(run)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        with _escaping_stdout():
            return COMMANDS[args.cmd](args)
    except _UsageError as e:
        parser.error(str(e))
        return 2  # pragma: no cover - error() exits
    except (ShmCancelError, posix_ipc.Error) as e:
        print(f"shmtool: {_one_line(e)}", file=sys.stderr)
        return 1
    except OSError as e:
        if isinstance(e, BrokenPipeError):
            # the reader went away (shmtool dump | head): not an error worth a traceback
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
        print(f"shmtool: {e.strerror or e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
