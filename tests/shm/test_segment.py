"""segment: create / attach / validate / unlink of the raw shared segment (no tables involved)."""

from __future__ import annotations

import os
import select
import struct

import posix_ipc
import pytest
from helpers.names import leftovers
from helpers.procs import child

from shmcancel.exceptions import (
    InvalidRegistryName,
    RegistryIncompatible,
    RegistryNotFound,
    SegmentTooLarge,
)
from shmcancel.shm import procinfo
from shmcancel.shm.names import lock_path, segment_path, sem_path, unlink_names
from shmcancel.shm.segment import CONFIG_MAX, HEADER_SIZE, Segment, TableSpec

pytestmark = pytest.mark.timeout(20)

SPECS = [TableSpec("t0", "set", 10, 64, 5000), TableSpec("t1", "bag", 3, 128, 100)]
CFG = b"opaque config"


def test_create_attach_roundtrip(shm_name: str) -> None:
    cfg = b"\x00config\xff"
    seg = Segment.create(shm_name, cfg, SPECS)
    try:
        assert seg.config == cfg
        assert seg.creator == procinfo.me()
        assert len(seg.hash_key) == 16
        st = os.stat(segment_path(shm_name))
        assert st.st_size == seg.total_size == HEADER_SIZE + 8192 + 4096
        assert st.st_mode & 0o777 == 0o600
        assert os.stat(sem_path(shm_name)).st_mode & 0o777 == 0o600
        assert seg.sem is not None and seg.sem.value == 1
        assert [(d.name, d.kind, d.capacity, d.record_size, d.offset, d.region_size)
                for d in seg.tables] == [("t0", "set", 10, 64, 4096, 5000),
                                         ("t1", "bag", 3, 128, 12288, 100)]
        seg.region(0)[:4] = b"abcd"
        other = Segment.attach(shm_name)
        try:
            assert other.config == cfg
            assert other.hash_key == seg.hash_key
            assert other.created_at == seg.created_at
            assert other.tables == seg.tables
            assert bytes(other.region(0)[:4]) == b"abcd"
        finally:
            other.close()
            other.close()  # idempotent
    finally:
        seg.close()
        unlink_names(shm_name)
    assert leftovers(shm_name) == []


def test_config_bytes_roundtrip(shm_name: str) -> None:
    for cfg in (b"", b"\x00", os.urandom(CONFIG_MAX)):
        seg = Segment.create(shm_name, cfg, SPECS)
        seg.close()
        seg = Segment.attach(shm_name)
        assert seg.config == cfg
        seg.close()
        unlink_names(shm_name)


def test_create_refuses_what_the_header_cannot_hold(shm_name: str) -> None:
    with pytest.raises(ValueError, match=f"at most {CONFIG_MAX}"):
        Segment.create(shm_name, b"x" * (CONFIG_MAX + 1), SPECS)
    for bad in ("", "T0", "a-b", "x" * 33, "é"):
        with pytest.raises(ValueError, match="table name"):
            Segment.create(shm_name, CFG, [TableSpec(bad, "set", 10, 64, 5000)])
    with pytest.raises(ValueError, match="twice"):
        Segment.create(shm_name, CFG, [SPECS[0], SPECS[0]])
    assert leftovers(shm_name) == []


def test_attach_missing(shm_name: str) -> None:
    with pytest.raises(RegistryNotFound, match=f"no registry named {shm_name} "
                                               rf"\(/dev/shm/shmcancel\.{shm_name}\)"):
        Segment.attach(shm_name)


@pytest.mark.parametrize("bad", ["", "a/b", "x" * 65, "é", "a b", "../x", "a~b", None, 5])
def test_invalid_names(bad: object) -> None:
    for op in (lambda: Segment.attach(bad),  # type: ignore[arg-type]
               lambda: Segment.create(bad, CFG, SPECS)):  # type: ignore[arg-type]
        with pytest.raises(InvalidRegistryName):
            op()


def test_create_over_live_creator_refused(shm_name: str) -> None:
    def creator(w: int) -> None:
        seg = Segment.create(shm_name, CFG, SPECS)
        os.write(w, b"k")
        select.select([], [], [], 30)  # until the parent kills us
        seg.close()

    pid, r = child(creator)
    try:
        assert os.read(r, 1) == b"k"
        with pytest.raises(RegistryIncompatible, match=f"in use by live pid {pid}"):
            Segment.create(shm_name, CFG, SPECS)
        seg = Segment.attach(shm_name)  # attaching is fine
        assert seg.creator is not None and seg.creator[0] == pid
        seg.close()
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        os.close(r)
    # The creator is gone now: create replaces the stale segment.
    seg = Segment.create(shm_name, CFG, SPECS)
    assert seg.creator == procinfo.me()
    seg.close()


def test_create_over_dead_creator_replaces(shm_name: str) -> None:
    def creator(w: int) -> None:
        seg = Segment.create(shm_name, b"old", SPECS)
        os.write(w, seg.hash_key)

    pid, r = child(creator)
    old_key = os.read(r, 16)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    assert status == 0
    old_ino = os.stat(segment_path(shm_name)).st_ino
    seg = Segment.create(shm_name, CFG, SPECS)
    try:
        assert seg.hash_key != old_key
        assert seg.config == CFG
        assert seg.sem is not None and seg.sem.value == 1
        assert os.stat(segment_path(shm_name)).st_ino != old_ino
    finally:
        seg.close()


def _write_file(path: str, data: bytes, mode: int = 0o600) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, data)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


@pytest.mark.parametrize(("data", "match"), [
    (b"", "truncated"),
    (b"shmcancl" + b"\0" * 100, "truncated"),
    (os.urandom(8192), "not a shmcancel segment"),
    (b"\0" * HEADER_SIZE, "not a shmcancel segment"),
])
def test_garbage_segment(shm_name: str, data: bytes, match: str) -> None:
    _write_file(segment_path(shm_name), data)
    with pytest.raises(RegistryIncompatible, match=match):
        Segment.attach(shm_name)
    with pytest.raises(RegistryIncompatible, match=match):
        Segment.attach(shm_name, readonly=True)
    seg = Segment.create(shm_name, CFG, SPECS)  # garbage is replaced by create
    seg.close()
    Segment.attach(shm_name).close()


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _patch(name: str, off: int, fmt: str, value: object) -> None:
    fd = os.open(segment_path(name), os.O_RDWR)
    try:
        os.pwrite(fd, struct.pack(fmt, value), off)
    finally:
        os.close(fd)


@pytest.mark.parametrize(("off", "fmt", "value", "match"), [
    (0, "<8s", b"shmcancX", "not a shmcancel segment"),
    (8, "<Q", 1, "layout version 1"),
    (16, "<Q", 8192, "header size 8192"),
    (24, "<Q", 4096, "header says 4096 bytes"),
    (2048, "<Q", CONFIG_MAX + 1, f"config is {CONFIG_MAX + 1} bytes"),
    (512, "<Q", 1000, "tables"),
    (520, "<8s", b"BAD NAME", "table descriptor 0"),  # not a table name
    (520 + 32, "<Q", 100, "table descriptor 0"),  # table 0 at a non-page offset
])
def test_corrupt_header(shm_name: str, off: int, fmt: str, value: object, match: str) -> None:
    Segment.create(shm_name, CFG, SPECS).close()
    _patch(shm_name, off, fmt, value)
    with pytest.raises(RegistryIncompatible, match=match):
        Segment.attach(shm_name)


def test_a_registry_of_the_lock_file_recovery_protocol_is_refused(shm_name: str) -> None:
    """Layout 7's processes take a dead holder's unit over under an flock on the lock file,
    this code's under one on the segment's file (shm/lock.py): side by side on one registry (a
    USR2 upgrade's old and new workers) each would flock a file of its own, and both take the
    same unit over (two holders). Such a registry is refused, naming the versions, as any
    other layout's is; it was attached, its layout number unchanged."""
    Segment.create(shm_name, CFG, SPECS).close()
    _patch(shm_name, 8, "<Q", 7)
    with pytest.raises(RegistryIncompatible, match="layout version 7, this shmcancel speaks 9"):
        Segment.attach(shm_name)


def test_a_registry_of_blake2b_index_hashes_is_refused(shm_name: str) -> None:
    """Layout 8's processes hash a row's key with keyed blake2b, this code's with SipHash-2-4:
    side by side on one registry each would find none of the other's rows (a cancellation
    recorded by one, never seen by the other's poll). Such a registry is refused, naming the
    versions."""
    Segment.create(shm_name, CFG, SPECS).close()
    _patch(shm_name, 8, "<Q", 8)
    with pytest.raises(RegistryIncompatible, match="layout version 8, this shmcancel speaks 9"):
        Segment.attach(shm_name)


def test_size_mismatch(shm_name: str) -> None:
    seg = Segment.create(shm_name, CFG, SPECS)
    seg.close()
    with open(segment_path(shm_name), "r+b") as f:
        f.truncate(seg.total_size + 4096)
    with pytest.raises(RegistryIncompatible, match=r"but /dev/shm/.* has"):
        Segment.attach(shm_name)
    with open(segment_path(shm_name), "r+b") as f:
        f.truncate(HEADER_SIZE + 10)
    with pytest.raises(RegistryIncompatible, match=r"but /dev/shm/.* has"):
        Segment.attach(shm_name)


def test_a_semaphore_unlinked_while_attach_opens_it_is_reported_missing(shm_name: str) -> None:
    """The semaphore removed (a registry being unlinked) between its open and the check of its
    inode: the attach reports it missing, naming the registry, not a raw FileNotFoundError.
    The removal is made at that very line by a trace hook: a real unlink, at a real window."""
    import sys

    from shmcancel.shm import segment as seg_mod

    Segment.create(shm_name, CFG, SPECS).close()
    code = seg_mod._open_semaphore.__code__
    fired: list[bool] = []

    def tracer(frame, event, arg):  # type: ignore[no-untyped-def]
        if frame.f_code is not code:
            return None
        def line(frame, event, arg):  # type: ignore[no-untyped-def]
            if event == "line" and not fired and "sem" in frame.f_locals:
                fired.append(True)
                posix_ipc.unlink_semaphore("/shmcancel." + shm_name)
            return line
        return line

    sys.settrace(tracer)
    try:
        with pytest.raises(RegistryIncompatible, match=rf"registry {shm_name}: .*semaphore .* "
                                                       r"is missing"):
            Segment.attach(shm_name)
    finally:
        sys.settrace(None)
    assert fired


def test_zero_byte_and_missing_semaphore(shm_name: str) -> None:
    Segment.create(shm_name, CFG, SPECS).close()
    posix_ipc.unlink_semaphore("/shmcancel." + shm_name)
    with pytest.raises(RegistryIncompatible, match=r"semaphore .* is missing"):
        Segment.attach(shm_name)
    _write_file(sem_path(shm_name), b"")
    with pytest.raises(RegistryIncompatible, match="is 0 bytes"):
        Segment.attach(shm_name)
    # A well-formed semaphore that is not the one created with the segment.
    os.unlink(sem_path(shm_name))
    posix_ipc.Semaphore("/shmcancel." + shm_name, posix_ipc.O_CREX, mode=0o600,
                        initial_value=1).close()
    with pytest.raises(RegistryIncompatible, match="not the one created with the segment"):
        Segment.attach(shm_name)
    # Read-only attachment needs no semaphore. We are the (live) creator: create refuses.
    Segment.attach(shm_name, readonly=True).close()
    with pytest.raises(RegistryIncompatible, match="in use by live pid"):
        Segment.create(shm_name, CFG, SPECS)
    unlink_names(shm_name)
    Segment.create(shm_name, CFG, SPECS).close()
    Segment.attach(shm_name).close()


def test_other_users_segment_refused(shm_name: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to chown")
    Segment.create(shm_name, CFG, SPECS).close()
    os.chown(segment_path(shm_name), 65534, 65534)
    with pytest.raises(RegistryIncompatible, match="belongs to uid 65534"):
        Segment.attach(shm_name)
    with pytest.raises(RegistryIncompatible, match="belongs to uid 65534"):
        Segment.create(shm_name, CFG, SPECS)
    os.chown(segment_path(shm_name), 0, 0)
    os.chown(sem_path(shm_name), 65534, 65534)
    with pytest.raises(RegistryIncompatible, match=r"semaphore .* belongs to uid 65534"):
        Segment.attach(shm_name)


def test_wrong_mode_refused(shm_name: str) -> None:
    Segment.create(shm_name, CFG, SPECS).close()
    os.chmod(segment_path(shm_name), 0o644)
    with pytest.raises(RegistryIncompatible, match="mode 644"):
        Segment.attach(shm_name)


def test_too_large_for_dev_shm(shm_name: str) -> None:
    vfs = os.statvfs("/dev/shm")
    huge = vfs.f_blocks * vfs.f_frsize + 2**30
    with pytest.raises(SegmentTooLarge, match=r"needs \d+ bytes .* only \d+ bytes .* free"):
        Segment.create(shm_name, CFG, [TableSpec("t", "set", 1, 64, huge)])
    assert leftovers(shm_name) in ([], [f"shmcancel-lock.{shm_name}"])
    assert not os.path.exists(sem_path(shm_name))


def test_failed_init_leaves_nothing(shm_name: str) -> None:
    def init(seg: Segment) -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        Segment.create(shm_name, CFG, SPECS, init=init)
    assert not os.path.exists(segment_path(shm_name))
    assert not os.path.exists(sem_path(shm_name))
    assert not [f for f in os.listdir("/dev/shm") if shm_name + "~" in f]


def test_readonly_attach_never_writes(shm_name: str) -> None:
    seg = Segment.create(shm_name, CFG, SPECS)
    try:
        before = _read(segment_path(shm_name))
        ro = Segment.attach(shm_name, readonly=True)
        assert ro.readonly and ro.sem is None
        assert ro.buf.readonly
        with pytest.raises(TypeError):
            ro.words[0] = 1
        region = ro.region(0)
        assert bytes(region[:8]) == bytes(seg.region(0)[:8])
        ro.close()
        assert _read(segment_path(shm_name)) == before
    finally:
        seg.close()


def test_close_releases_views(shm_name: str) -> None:
    seg = Segment.create(shm_name, CFG, SPECS)
    v = seg.region(0)
    w = seg.region(1)
    seg.close()
    assert seg.closed
    with pytest.raises(ValueError):
        v[0]  # released
    with pytest.raises(ValueError):
        w[0]


def test_unlink_names_idempotent(shm_name: str) -> None:
    Segment.create(shm_name, CFG, SPECS).close()
    assert os.path.exists(lock_path(shm_name))
    unlink_names(shm_name)
    unlink_names(shm_name)
    assert leftovers(shm_name) == []
    with pytest.raises(RegistryNotFound):
        Segment.attach(shm_name)
