"""Tables declared by the layers above: a registry holds exactly the declared tables, reached by
name; attach refuses a registry whose tables or config are not what this process expects."""

from __future__ import annotations

import os
import struct

import msgpack
import pytest

from shmcancel.config import Config
from shmcancel.exceptions import RegistryIncompatible
from shmcancel.shm import schema
from shmcancel.shm.names import segment_path
from shmcancel.shm.registry import Registry
from shmcancel.shm.schema import PACKED_INT, TableDecl, packed_str
from shmcancel.shm.segment import CONFIG_MAX, OFF_CONFIG

pytestmark = pytest.mark.timeout(30)

SMALL = Config(max_rows=100, capacity=200, in_flight_capacity=64, session_capacity=32,
               lock_timeout=5)


def _half_capacity(config: Config) -> int:
    assert config.capacity is not None
    return config.capacity // 2


# A made-up upper layer: two tables of its own, nothing of cancellation or MCP.
WIDGETS = (
    TableDecl("widgets", "set", _half_capacity, packed_str(20), packed_str(40)),
    TableDecl("widget_log", "bag", 8, packed_str(20), 1 + 2 * PACKED_INT),
)


def _both(name: str, tables: object = None) -> None:
    """Attach ``name`` writable and read-only (what shmtool does) with ``tables``."""
    for readonly in (False, True):
        Registry.attach(name, readonly=readonly, tables=tables).close()  # type: ignore[arg-type]


def test_a_registry_holds_exactly_the_tables_declared_to_it(shm_name: str) -> None:
    with Registry.create(shm_name, SMALL, tables=WIDGETS) as reg:
        assert list(reg.tables) == ["widgets", "widget_log"]
        w, log = reg.table("widgets"), reg.table("widget_log")
        assert (w.kind, w.capacity, log.kind, log.capacity) == ("set", 100, "bag", 8)
        assert [t["name"] for t in reg.info()["tables"]] == ["widgets", "widget_log"]
        w.insert("w" * 20, "v" * 40)  # the declared worst case fits
        log.insert("k", (1, 2))
        log.insert("k", (3, 4))
        with pytest.raises(KeyError, match=r"no table 'cancellations' \(it has widgets, "):
            reg.table("cancellations")
        with Registry.attach(shm_name, tables=reversed(WIDGETS)) as other:  # any order
            assert other.table("widgets").get("w" * 20) == "v" * 40
            assert sorted(other.table("widget_log").lookup("k")) == [(1, 2), (3, 4)]
        reg.unlink()


def test_the_declared_tables_are_the_default(shm_name: str) -> None:
    names = [d.name for d in schema.declared()]
    assert {"cancellations", "in_flight", "scope_counts", "sessions", "session_clients",
            "session_calls"} == set(names)
    with Registry.create(shm_name, SMALL) as reg:
        assert list(reg.tables) == names
        _both(shm_name, schema.declared())
        # A process of another code version, which declares other tables, is refused.
        with pytest.raises(RegistryIncompatible, match=(
                f"registry {shm_name}: holds tables {', '.join(names)}; expected widgets, "
                r"widget_log \(created by another version of the code\?\)")):
            Registry.attach(shm_name, tables=WIDGETS)
        reg.unlink()


@pytest.mark.parametrize(("tables", "match"), [
    (WIDGETS[:1], "holds tables widgets, widget_log; expected widgets "),
    ((*WIDGETS, TableDecl("gizmos", "set", 4, 10, 10)),
     "holds tables widgets, widget_log; expected widgets, widget_log, gizmos "),
    ((TableDecl("widgets", "bag", _half_capacity, packed_str(20), packed_str(40)), WIDGETS[1]),
     r"table widgets is set/100 rows/.*; expected bag/100/"),
    ((TableDecl("widgets", "set", 99, packed_str(20), packed_str(40)), WIDGETS[1]),
     r"table widgets is set/100 rows/.*; expected set/99/"),
    ((WIDGETS[0], TableDecl("widget_log", "bag", 8, packed_str(20), 500)),
     r"table widget_log is bag/8 rows/\d+-byte records/\d+ bytes; expected bag/8/>=\d+/"),
])
def test_attach_refuses_other_declarations(shm_name: str, tables: tuple[TableDecl, ...],
                                           match: str) -> None:
    with Registry.create(shm_name, SMALL, tables=WIDGETS) as reg:
        for readonly in (False, True):
            with pytest.raises(RegistryIncompatible, match=f"registry {shm_name}: {match}"):
                Registry.attach(shm_name, readonly=readonly, tables=tables)
        # Records larger than a row needs are fine (as a registry made before a bound shrank).
        _both(shm_name, (WIDGETS[0], TableDecl("widget_log", "bag", 8, 5, 5)))
        reg.unlink()


def test_declarations_are_checked() -> None:
    for bad in ("", "Widgets", "9lives", "a-b", "x" * 33, "é"):
        with pytest.raises(ValueError, match="table name"):
            TableDecl(bad, "set", 1, 1, 1)
    with pytest.raises(ValueError, match="kind must be 'set' or 'bag'"):
        TableDecl("t", "list", 1, 1, 1)
    with pytest.raises(ValueError, match="capacity must be a positive int, got 0"):
        TableDecl("t", "set", lambda c: 0, 1, 1).size("capacity", SMALL)
    with pytest.raises(ValueError, match="a table name repeats"):
        Registry.create("never-made", SMALL, tables=(WIDGETS[0], WIDGETS[0]))
    # Declaring a declared name again: the same declaration is fine, another one is not.
    d = schema.declared()[0]
    schema.declare(d)
    assert schema.declared()[0] is d
    with pytest.raises(ValueError, match=f"table {d.name} is already declared differently"):
        schema.declare(TableDecl(d.name, d.kind, 1, 1, 1))
    assert schema.declared()[0] is d


def _write_config(name: str, blob: bytes, length: int | None = None) -> None:
    fd = os.open(segment_path(name), os.O_RDWR)
    try:
        os.pwrite(fd, struct.pack("<Q", len(blob) if length is None else length) + blob,
                  OFF_CONFIG)
    finally:
        os.close(fd)


def _packed(**change: object) -> bytes:
    d = {k: getattr(SMALL, k) for k in SMALL.__dataclass_fields__}
    d.update(change)
    return msgpack.packb({k: v for k, v in d.items() if v is not ...})


@pytest.mark.parametrize(("blob", "length", "match"), [
    (b"", CONFIG_MAX + 1, f"config is {CONFIG_MAX + 1} bytes"),
    (b"", 2**64 - 1, f"config is {2**64 - 1} bytes"),
    (b"", None, "invalid config in header: not a packed Config"),
    (b"\xc1", None, "invalid config in header: not a packed Config"),
    (os.urandom(300), None, "invalid config in header"),
    (b"\x91" * 2000, None, "invalid config in header: not a packed Config"),  # deep nesting
    (msgpack.packb([1, 2, 3]), None, r"not a packed Config \(a tuple, not a map\)"),
    (_packed(ttl=...), None, r"Config fields missing \['ttl'\], unknown \[\]"),
    (_packed(colour="red"), None, r"Config fields missing \[\], unknown \['colour'\]"),
    (msgpack.packb({1: 2}), None, "invalid config in header: not a packed Config"),
    (_packed(capacity=-1), None, "invalid config in header: Config.capacity must be an int"),
    (_packed(ttl="300"), None, "invalid config in header: Config.ttl must be a number of seconds"),
])
def test_attach_refuses_a_corrupt_config(shm_name: str, blob: bytes, length: int | None,
                                         match: str) -> None:
    Registry.create(shm_name, SMALL).close()
    _write_config(shm_name, blob, length)
    for readonly in (False, True):
        with pytest.raises(RegistryIncompatible, match=f"registry {shm_name}: .*{match}"):
            Registry.attach(shm_name, readonly=readonly)


def test_a_valid_config_of_other_sizes_is_refused_by_the_tables(shm_name: str) -> None:
    Registry.create(shm_name, SMALL).close()
    _write_config(shm_name, _packed(max_rows=150))
    with pytest.raises(RegistryIncompatible,
                       match=r"table cancellations is set/100 rows/.*; expected set/150/"):
        Registry.attach(shm_name)
    _write_config(shm_name, _packed(ttl=7.5))  # sizes unchanged: the header's config wins
    with Registry.attach(shm_name) as reg:
        assert reg.config.ttl == 7.5 and reg.config.capacity == 200
