"""Segments of stores that died are reclaimed; a live store's are never touched.

Each store runs in a process of its own, as on a machine (or simulated nodes sharing
/dev/shm): one stays alive, the other is SIGKILLed, so its locks go the way a dead
store's do, by the kernel, and nothing of it runs a cleanup.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvstrata.tiers import orphans
from kvstrata.tiers.arena import Arena
from kvstrata.tiers.orphans import hold_new_file, reclaim_orphans
from kvstrata.tiers.shm import SharedMemoryFile
from tests.utils import FakeClock

SLOT = 64 * 1024

# A store's arena in a process of its own: it grows one segment per namespace, prints
# their paths, and lives until its stdin closes (or it is killed).
_STORE = """
import sys
from kvstrata.tiers.arena import Arena
arena = Arena(sys.argv[1], sys.argv[2], capacity=4 * {slot}, segment_size=2 * {slot}, lease_seconds=30, prefault=False)
for namespace in ("ns-a", "ns-b"):
    pool = arena.pool(namespace, {slot})
    slots = pool.reserve("engine", 1)
    pool.view(slots[0])[:] = 1  # memory in use, as a store's would be
    print(pool.geometry.segment_path(0), flush=True)
sys.stdin.read()
arena.close()
"""


@pytest.fixture
def shm_dir():
    with tempfile.TemporaryDirectory(prefix="kvs-orphans-", dir="/dev/shm") as directory:
        yield Path(directory)


class StoreProcess:
    def __init__(self, shm_dir: Path, node_tag: str):
        self.process = subprocess.Popen(
            [sys.executable, "-c", _STORE.format(slot=SLOT), str(shm_dir), node_tag],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2],
        )  # fmt: skip
        self.segments = [Path(self.process.stdout.readline().strip()) for _ in range(2)]
        assert all(path.is_file() for path in self.segments), self.segments

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait(timeout=30)


@pytest.fixture
def stores(shm_dir):
    started: list[StoreProcess] = []

    def start(node_tag: str) -> StoreProcess:
        started.append(StoreProcess(shm_dir, node_tag))
        return started[-1]

    yield start
    for store in started:
        store.stop()


def test_a_dead_stores_segments_are_reclaimed_and_a_live_ones_stay(shm_dir, stores, caplog):
    live, dead = stores("node-live"), stores("node-dead")
    dead.kill()
    assert all(path.exists() for path in dead.segments)  # nothing cleans up after SIGKILL

    with caplog.at_level(logging.WARNING, logger="kvstrata.tiers.orphans"):
        found = reclaim_orphans(shm_dir, why="test")

    assert sorted(found.files) == sorted(map(str, dead.segments))
    assert not any(path.exists() for path in dead.segments)
    assert all(path.exists() for path in live.segments)
    assert found.bytes >= 2 * SLOT  # the pages the dead store had written
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 1 and f"{found.bytes} bytes freed" in lines[0], lines
    # A second pass finds nothing more, and logs nothing.
    assert not reclaim_orphans(shm_dir).files
    assert len(caplog.records) == 1


def test_a_new_arena_reclaims_after_a_lease_and_counts_it(shm_dir, stores):
    live, dead = stores("node-live"), stores("node-dead")
    dead.kill()
    clock = FakeClock()
    arena = Arena(str(shm_dir), "node-new", capacity=4 * SLOT, segment_size=2 * SLOT, lease_seconds=10, prefault=False, clock=clock)
    try:
        arena.expire()
        assert all(path.exists() for path in dead.segments)  # engines of the dead store may still be loading
        clock.advance(11)
        arena.expire()
        assert not any(path.exists() for path in dead.segments)
        assert all(path.exists() for path in live.segments)
        reclaimed = arena.stats()["orphans_reclaimed"]
        assert reclaimed["files"] == 2 and reclaimed["bytes"] >= 2 * SLOT
    finally:
        arena.close()
    assert all(path.exists() for path in live.segments)  # closing an arena spares live stores too


def test_a_store_that_died_after_being_restarted_on_its_node_is_reclaimed(shm_dir, stores):
    """Ray restarts a store on the same node (same tag): the old epoch's files go once a lease
    has passed (in-flight loads of its engines may still read them), the live ones stay."""
    dead = stores("node0")
    dead.kill()
    clock = FakeClock()
    arena = Arena(str(shm_dir), "node0", capacity=4 * SLOT, segment_size=2 * SLOT, lease_seconds=10, prefault=False, clock=clock)
    try:
        arena.pool("ns-a", SLOT).reserve("engine", 1)
        mine = Path(arena.pools["ns-a"].geometry.segment_path(0))
        arena.expire()
        assert all(path.exists() for path in dead.segments)
        clock.advance(11)
        arena.expire()
        assert not any(path.exists() for path in dead.segments)
        assert mine.exists()
        # Another pass (as `kvstrata down` would run beside it) spares this live arena.
        assert not reclaim_orphans(shm_dir).files and mine.exists()
    finally:
        arena.close()
    assert not mine.exists()


def test_symlinks_directories_and_other_names_are_left_alone(shm_dir, stores):
    dead = stores("node-dead")
    dead.kill()
    target = shm_dir / "not-kvstrata"
    target.write_bytes(b"x")
    (shm_dir / "kvstrata-link").symlink_to(target)
    (shm_dir / "kvstrata-dir").mkdir()
    found = reclaim_orphans(shm_dir)
    assert sorted(found.files) == sorted(map(str, dead.segments))
    assert target.exists() and (shm_dir / "kvstrata-link").is_symlink() and (shm_dir / "kvstrata-dir").is_dir()


def test_a_segment_unlinked_while_being_created_is_created_again(shm_dir, monkeypatch):
    """The instant between O_EXCL and the lock: a reclaimer that unlinks the file then does not win."""
    path = shm_dir / "kvstrata-racing"
    real_flock = orphans.fcntl.flock
    raced = []

    def flock_after_a_reclaimer(fd, operation):
        if not raced:
            raced.append(None)
            monkeypatch.setattr(orphans.fcntl, "flock", real_flock)
            raced[0] = reclaim_orphans(shm_dir)  # sees the new file unlocked, unlinks it
        real_flock(fd, operation)

    monkeypatch.setattr(orphans.fcntl, "flock", flock_after_a_reclaimer)
    fd = hold_new_file(path)
    monkeypatch.undo()
    try:
        assert raced[0].files == [str(path)]
        assert path.exists() and os.fstat(fd).st_ino == path.stat().st_ino
        assert not reclaim_orphans(shm_dir).files and path.exists()
    finally:
        os.unlink(path)
        os.close(fd)


def test_a_closed_segment_leaves_no_lock_behind(shm_dir):
    segment = SharedMemoryFile.create(shm_dir / "kvstrata-own", SLOT, prefault=False)
    assert segment.lock_fd >= 0
    segment.close()
    assert segment.lock_fd == -1 and not (shm_dir / "kvstrata-own").exists()


_DISK_STORE = """
import sys
from kvstrata.tiers.disk import DiskTier
tier = DiskTier(sys.argv[1], 1 << 20, direct_io=False)
print("open", flush=True)
sys.stdin.read()
tier.close()
"""


def _disk_store(directory: Path) -> subprocess.Popen:
    process = subprocess.Popen(
        [sys.executable, "-c", _DISK_STORE, str(directory)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2],
    )  # fmt: skip
    assert process.stdout.readline().strip() == "open"
    return process


def test_a_dead_stores_disk_directory_is_taken_over_and_a_live_ones_refused(tmp_path, caplog):
    from kvstrata.tiers.disk import DiskTier, DiskTierError

    live_dir, dead_dir = tmp_path / "live", tmp_path / "dead"
    live, dead = _disk_store(live_dir), _disk_store(dead_dir)
    try:
        dead.send_signal(signal.SIGKILL)
        dead.wait(timeout=30)
        with pytest.raises(DiskTierError, match="in use by another kvstrata store"):
            DiskTier(live_dir, 1 << 20, direct_io=False)
        with caplog.at_level(logging.WARNING, logger="kvstrata.tiers.disk"):
            tier = DiskTier(dead_dir, 1 << 20, direct_io=False)
        assert tier.stats()["lock_taken_over"] == 1
        assert any(f"pid {dead.pid}" in record.getMessage() for record in caplog.records)
        tier.close()
        again = DiskTier(dead_dir, 1 << 20, direct_io=False)  # closed cleanly: nothing to take over
        assert again.stats()["lock_taken_over"] == 0
        again.close()
    finally:
        live.stdin.close()
        live.wait(timeout=30)


def test_a_symlink_planted_where_a_locked_file_goes_is_never_followed(tmp_path):
    target = tmp_path / "victim"
    target.write_bytes(b"keep")
    planted = tmp_path / "kvstrata-planted"
    planted.symlink_to(target)
    with pytest.raises(FileExistsError):
        orphans.hold_new_file(planted)
    dangling = tmp_path / "kvstrata-dangling"
    dangling.symlink_to(tmp_path / "not-there")
    with pytest.raises(FileExistsError):
        orphans.hold_new_file(dangling)
    assert target.read_bytes() == b"keep" and not (tmp_path / "not-there").exists()
