"""Which table each of a segment's lane sets belongs to (``TableDecl(lanes=True)``): an attach
whose declarations give the lanes to other tables than the creator's is refused, even when the
number of lane sets (the size of the lanes region) is the same. The header matches tables by
name; the lane sets must be matched to them too, else one table's lane rows are read as
another's (in-flight rows as session calls)."""

from __future__ import annotations

import dataclasses

import pytest

from shmcancel.config import Config
from shmcancel.exceptions import RegistryIncompatible
from shmcancel.shm import registry
from shmcancel.shm.registry import Registry
from shmcancel.shm.schema import TableDecl

pytestmark = pytest.mark.timeout(30)

SMALL = Config(max_rows=100, capacity=200, in_flight_capacity=64, session_capacity=32,
               lock_timeout=5)


def with_lanes(*names: str) -> list[TableDecl]:
    """The declared tables, with lanes exactly on the bags ``names``."""
    return [dataclasses.replace(d, lanes=d.name in names) if d.kind == "bag" else d
            for d in registry._decls(None)]


@pytest.mark.parametrize("readonly", [False, True])
def test_lane_sets_of_other_tables_are_refused(shm_name: str, readonly: bool) -> None:
    Registry.create(shm_name, SMALL, tables=with_lanes("session_calls")).close()
    with pytest.raises(RegistryIncompatible, match="lane"):
        Registry.attach(shm_name, readonly=readonly, tables=with_lanes("in_flight")).close()


def test_the_creators_lane_sets_are_accepted(shm_name: str) -> None:
    decls = with_lanes("in_flight", "session_calls")
    with (Registry.create(shm_name, SMALL, tables=decls) as reg,
          Registry.attach(shm_name, tables=list(reversed(decls))) as other):
        assert sorted(other.lanes) == ["in_flight", "session_calls"]
        assert reg.lanes["in_flight"]._base == other.lanes["in_flight"]._base
    Registry.attach(shm_name, readonly=True).close()  # the default declarations: the same
