"""Shared-memory segments: 2 MiB pages where the kernel allows, and a clean fallback where not."""

from __future__ import annotations

import errno
import logging
import os
import platform
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest

from kvstrata.tiers.arena import GROW_RETRY_SECONDS, Arena
from kvstrata.tiers.shm import HUGE_PAGE_BYTES, SharedMemoryFile
from tests.utils import FakeClock, key

PAGE = os.sysconf("SC_PAGE_SIZE")


def _kernel_collapses_shmem() -> str | None:
    """Why this machine cannot give shared memory 2 MiB pages, or None if it can."""
    release = tuple(int(part) for part in platform.release().split(".")[:2] if part.isdigit())
    if release < (6, 1):
        return f"MADV_COLLAPSE needs Linux 6.1+, this is {platform.release()}"
    try:
        if "[deny]" in Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read_text():
            return "shmem_enabled is deny"
    except OSError:
        return "no transparent huge page support"
    if not any(line.split()[1:3] == ["/dev/shm", "tmpfs"] for line in Path("/proc/mounts").read_text().splitlines()):
        return "/dev/shm is not tmpfs"
    return None


requires_collapse = pytest.mark.skipif(_kernel_collapses_shmem() is not None, reason=str(_kernel_collapses_shmem()))


@pytest.fixture
def shm_dir():
    with tempfile.TemporaryDirectory(prefix="kvstrata-test-", dir="/dev/shm") as directory:
        yield Path(directory)


def mappings_of(path: Path) -> int:
    return sum(line.rstrip().endswith(str(path)) for line in Path("/proc/self/maps").read_text().splitlines())


def physical_runs(array: np.ndarray) -> int | None:
    """How many physically contiguous runs the pages of `array` form (None without access to PFNs)."""
    pages = array.nbytes // PAGE
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(array.ctypes.data // PAGE * 8)
        frames = [entry & ((1 << 55) - 1) for entry in struct.unpack(f"{pages}Q", pagemap.read(pages * 8))]
    if not any(frames):
        return None  # not root: the kernel hides physical frame numbers
    return 1 + sum(1 for a, b in zip(frames, frames[1:]) if b != a + 1)


@requires_collapse
def test_a_prefaulted_segment_is_backed_by_2_mib_pages_and_shared(shm_dir):
    path = shm_dir / "segment"
    segment = SharedMemoryFile.create(path, 4 * HUGE_PAGE_BYTES)
    other = SharedMemoryFile.attach(path)
    try:
        assert segment.huge_pages
        assert mappings_of(path) == 2, "the temporary aligned mapping is gone; creator and reader remain"
        runs = physical_runs(segment.array)
        if runs is not None:  # four 2 MiB pages: at most four physical runs (4 KiB pages: hundreds)
            assert runs <= 4, f"{runs} physical runs in 8 MiB"
        data = np.random.default_rng(1).integers(0, 256, segment.size, dtype=np.uint8)
        segment.array[:] = data
        assert np.array_equal(other.array, data)
    finally:
        other.close()
        segment.close()
    assert not path.exists()


def test_without_huge_pages_a_segment_is_still_prefaulted_and_logged_once(tmp_path, caplog):
    """Outside tmpfs (here: the test's disk directory) the kernel refuses the collapse."""
    caplog.set_level(logging.INFO, logger="kvstrata.tiers.shm")
    segments = [SharedMemoryFile.create(tmp_path / f"segment-{n}", 2 * HUGE_PAGE_BYTES) for n in range(2)]
    try:
        assert not any(segment.huge_pages for segment in segments)
        assert all(mappings_of(tmp_path / f"segment-{n}") == 1 for n in range(2))
        assert os.stat(tmp_path / "segment-0").st_blocks * 512 >= 2 * HUGE_PAGE_BYTES, "prefaulted all the same"
        segments[0].array[:] = 7
        assert (segments[0].array == 7).all()
    finally:
        for segment in segments:
            segment.close()
    lines = [r.getMessage() for r in caplog.records if "4 KiB pages" in r.getMessage()]
    assert len(lines) == 1 and str(tmp_path) in lines[0]


@requires_collapse
def test_the_arena_reports_its_huge_page_segments(shm_dir):
    slot = HUGE_PAGE_BYTES
    arena = Arena(str(shm_dir), "node0", capacity=4 * slot, segment_size=2 * slot, lease_seconds=10, prefault=True)
    try:
        pool = arena.pool("ns", slot)
        slots = pool.reserve("a", 4)
        for n, s in enumerate(slots):
            pool.view(s)[:] = n
            assert pool.commit("a", s, key(n))
        stats = pool.stats()
        assert stats["segments"] == 2 and stats["huge_page_segments"] == 2
        assert all((pool.view(s) == n).all() for n, s in enumerate(slots))
    finally:
        arena.close()


def no_room(free: int):
    """A stand-in for `os.statvfs` on a filesystem with `free` bytes left."""

    class Stats:
        f_bavail, f_frsize = free // 4096, 4096

    return lambda path: Stats()


def test_a_segment_the_filesystem_has_no_room_for_is_refused_before_any_page_is_touched(shm_dir, monkeypatch):
    # On a full tmpfs the first touch of a page is a SIGBUS that kills the process.
    with monkeypatch.context() as patched:
        patched.setattr(os, "statvfs", no_room(1 << 20))
        with pytest.raises(OSError, match=rf"{shm_dir} has 1048576 bytes free, a new shared-memory segment needs 4194304") as raised:
            SharedMemoryFile.create(shm_dir / "seg", 4 << 20)
    assert raised.value.errno == errno.ENOSPC
    assert list(shm_dir.iterdir()) == []

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patched:  # the room went to someone else in between
        patched.setattr(os, "posix_fallocate", full)
        with pytest.raises(OSError, match="No space left"):
            SharedMemoryFile.create(shm_dir / "seg", 4 << 20)
    assert list(shm_dir.iterdir()) == []


def test_an_arena_without_room_to_grow_falls_short_logs_once_and_grows_when_room_is_back(shm_dir, monkeypatch, caplog):
    clock = FakeClock()
    arena = Arena(str(shm_dir), "n", capacity=8 * PAGE, segment_size=4 * PAGE, lease_seconds=10, clock=clock)
    try:
        pool = arena.pool("ns", PAGE)
        with monkeypatch.context() as patched, caplog.at_level(logging.ERROR, logger="kvstrata.tiers.arena"):
            patched.setattr(os, "statvfs", no_room(PAGE))
            assert pool.reserve("a", 2) == [] and pool.reserve("a", 2) == []
            clock.advance(GROW_RETRY_SECONDS)
            assert pool.reserve("a", 2) == []
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == [
            f"kvstrata arena: namespace ns cannot grow past 0 slots: {shm_dir} has {PAGE} bytes free, "
            f"a new shared-memory segment needs {4 * PAGE} (lower tiers.cpu.capacity or enlarge the filesystem, "
            "e.g. docker --shm-size)"
        ]
        stats = pool.stats()
        assert (stats["grow_failures"], stats["reserve_shortfall"], arena.allocated_bytes) == (2, 6, 0)
        assert len(pool.reserve("a", 2)) == 0  # within a second of the last failure: not retried
        clock.advance(GROW_RETRY_SECONDS)
        assert len(pool.reserve("a", 2)) == 2 and arena.allocated_bytes == 4 * PAGE
    finally:
        arena.close()
