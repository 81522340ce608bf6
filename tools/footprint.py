#!/usr/bin/env python3
"""Bytes of each table of a registry's segment for a Config, and the segment's total.

    python tools/footprint.py [--max-rows N|none] [--capacity N] [--in-flight-capacity N]
                              [--session-capacity N] [--sessions-per-client N] [--preallocate]

Per table: rows held, record sizes (small/large, see ``shm/layout.py``), large rows held (L),
region bytes, and the bytes of its large records, whose pages are backed on demand (as large
rows are written, ``layout.py``). The totals: the file size of ``/dev/shm/shmcancel.NAME``, and
the bytes allocated when it is created (what /dev/shm holds until large rows are written; it
grows to the file size at most). Computed, nothing is created. Without options: the default
``Config()`` and ``Config(max_rows=100)``.
"""

from __future__ import annotations

import argparse

from shmcancel import Config
from shmcancel.shm import lanes, registry
from shmcancel.shm.segment import HEADER_SIZE, PAGE, TableSpec, backed_spans

MIB = 1 << 20


def footprint(config: Config) -> tuple[list[TableSpec], int]:
    """Each table's spec and the segment's total bytes (header and page alignment included)."""
    specs = registry.table_specs(config)
    total = (HEADER_SIZE + sum(_pages(s.region_size) for s in specs)
             + _pages(lanes.region_size() * len(registry.lane_tables())))
    return specs, total


def allocated_at_create(config: Config) -> int:
    """Bytes of the segment ``Registry.create`` allocates: all but the whole pages of the large
    records (``backed_spans``, the regions laid out as ``Segment.create`` lays them)."""
    specs, total = footprint(config)
    lazy, off = [], HEADER_SIZE
    for s in specs:
        lazy.append((off + s.lazy[0], s.lazy[1]))
        off += _pages(s.region_size)
    return sum(n for _, n in backed_spans(total, lazy))


def _pages(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


def report(config: Config, title: str) -> None:
    specs, total = footprint(config)
    at_create = allocated_at_create(config)
    print(f"{title}: {at_create:,} bytes ({at_create / MIB:.2f} MiB) allocated at create, up to "
          f"{total:,} ({total / MIB:.2f} MiB, the file size) as large rows are written")
    print(f"  {'table':20} {'rows':>7} {'record':>10} {'large':>6} {'bytes':>12} "
          f"{'on demand':>12}")
    for s in specs:
        rec = f"{s.small_size}/{s.record_size}" if s.large_count else str(s.record_size)
        print(f"  {s.name:20} {s.capacity:7} {rec:>10} {s.large_count or '-':>6} "
              f"{s.region_size:12,} {f'{s.lazy[1]:,}' if s.lazy[1] else '-':>12}")
    for t in registry.lane_tables():
        print(f"  {t + ' lanes':20} {lanes.LANES * lanes.BUCKETS * lanes.WAYS:7} "
              f"{lanes.BODY + 8:>10} {'-':>6} {lanes.region_size():12,}  ({lanes.LANES} "
              f"processes' own rows)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--max-rows")
    ap.add_argument("--capacity", type=int)
    ap.add_argument("--in-flight-capacity", type=int)
    ap.add_argument("--session-capacity", type=int)
    ap.add_argument("--sessions-per-client", type=int)
    ap.add_argument("--preallocate", action="store_true",
                    help="Config(preallocate=True): every page allocated at create")
    args = ap.parse_args(argv)
    kw: dict[str, object] = {}
    if args.max_rows is not None:
        kw["max_rows"] = None if args.max_rows.lower() == "none" else int(args.max_rows)
    for name in ("capacity", "in_flight_capacity", "session_capacity", "sessions_per_client"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    if args.preallocate:
        kw["preallocate"] = True
    if kw:
        report(Config(**kw), f"Config({', '.join(f'{k}={v!r}' for k, v in kw.items())})")
    else:
        report(Config(), "Config()")
        report(Config(max_rows=100), "Config(max_rows=100)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
