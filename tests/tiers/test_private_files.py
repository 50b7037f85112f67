"""Files the tiers create are the store user's own (0600), never reached through a planted
symlink, and `file://` objects land whole (issue #29: a symlink in the disk directory
redirected writes; a `file://` object tier stored nothing)."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest

from kvstrata.config import ObjectTierConfig
from kvstrata.tiers.disk import DiskTier, DiskTierError, payload_alignment
from kvstrata.tiers.disk.slab import _slab_name
from kvstrata.tiers.object_store import ObjectTier
from kvstrata.tiers.private_files import TEMP_MARK, UnsafeFileError
from kvstrata.tiers.records import HEADER_BYTES
from kvstrata.tiers.shm import SharedMemoryFile
from tests.utils import FakeClock, key

SIZE = 8192
OTHER_UID = 65534  # nobody
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a file of another user")


def chunk(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, SIZE, dtype=np.uint8)


def mode_of(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_disk_files_are_created_private(tmp_path):
    tier = DiskTier(tmp_path / "disk", 16 * (SIZE + HEADER_BYTES), direct_io=False)
    try:
        assert tier.write_many("ns", [(key(1), chunk(1))]) == [True]
        made = [p for p in (tmp_path / "disk").iterdir() if p.is_file()]
        assert len(made) == 3  # lock, payloads, headers
        assert {mode_of(p) for p in made} == {0o600}
    finally:
        tier.close()


def test_a_symlink_planted_for_a_slab_is_refused_and_its_target_untouched(tmp_path):
    root = tmp_path / "disk"
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    tier = DiskTier(root, 16 * (SIZE + HEADER_BYTES), direct_io=False)
    try:
        (root / _slab_name("ns", SIZE, payload_alignment(SIZE))).symlink_to(victim)
        with pytest.raises(UnsafeFileError, match="symbolic link"):
            tier.write_many("ns", [(key(1), chunk(1))])
        assert victim.read_bytes() == b"precious"
    finally:
        tier.close()


def test_a_symlinked_lock_file_stops_the_disk_tier_with_a_clear_error(tmp_path):
    root = tmp_path / "disk"
    root.mkdir()
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    (root / ".kvstrata.lock").symlink_to(victim)
    with pytest.raises(DiskTierError, match=r"\.kvstrata\.lock: is a symbolic link"):
        DiskTier(root, 16 * (SIZE + HEADER_BYTES), direct_io=False)
    assert victim.read_bytes() == b"precious"


@as_root
def test_a_slab_file_of_another_user_is_refused(tmp_path):
    root = tmp_path / "disk"
    tier = DiskTier(root, 16 * (SIZE + HEADER_BYTES), direct_io=False)
    try:
        planted = root / _slab_name("ns", SIZE, payload_alignment(SIZE))
        planted.write_bytes(b"")
        os.chown(planted, OTHER_UID, OTHER_UID)
        with pytest.raises(UnsafeFileError, match=f"uid {OTHER_UID}"):
            tier.write_many("ns", [(key(1), chunk(1))])
    finally:
        tier.close()


def test_a_file_object_tier_creates_parents_and_private_objects_and_manifests(tmp_path):
    root = tmp_path / "shared" / "kv"  # nothing of it exists yet
    tier = ObjectTier(ObjectTierConfig(url=f"file://{root}"), clock=FakeClock())
    try:
        assert tier.write_manifest("ns", {"model": "tiny"})
        assert tier.put_many("ns", [(key(i), chunk(i)) for i in range(4)]) == [True] * 4
        files = [p for p in root.rglob("*") if p.is_file()]
        assert len(files) == 5 and {mode_of(p) for p in files} == {0o600}
        assert not [p for p in files if TEMP_MARK in p.name]
        outs = [(key(i), np.zeros(SIZE, np.uint8)) for i in range(4)]
        assert tier.get_many("ns", outs) == [True] * 4
        assert all(np.array_equal(out, chunk(i)) for i, (_, out) in enumerate(outs))
        assert tier.manifests() == {"ns": {"model": "tiny"}}
    finally:
        tier.close()


def test_a_file_object_is_replaced_whole_never_rewritten_in_place(tmp_path):
    """A reader that opened the old object keeps reading it whole: the new one is a new file
    renamed over the name (in place, the reader would see a truncated or mixed object)."""
    tier = ObjectTier(ObjectTierConfig(url=f"file://{tmp_path}/kv"), clock=FakeClock())
    try:
        assert tier.put_many("ns", [(key(1), chunk(1))]) == [True]
        path = tier.object_path("ns", key(1))
        with open(path, "rb") as reader:
            assert tier.put_many("ns", [(key(1), chunk(2))]) == [True]
            old = reader.read()
        assert len(old) == SIZE + HEADER_BYTES and old[HEADER_BYTES:] == chunk(1).tobytes()
        with open(path, "rb") as fresh:
            assert fresh.read()[HEADER_BYTES:] == chunk(2).tobytes()
    finally:
        tier.close()


def test_a_symlink_planted_as_a_file_object_is_never_followed(tmp_path):
    tier = ObjectTier(ObjectTierConfig(url=f"file://{tmp_path}/kv"), clock=FakeClock())
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    try:
        path = tier.object_path("ns", key(1))
        os.makedirs(os.path.dirname(path))
        os.symlink(victim, path)
        out = np.zeros(SIZE, np.uint8)
        assert tier.get_many("ns", [(key(1), out)]) == [False]  # not read through the link
        assert tier.available()  # a planted file is a miss, not a failing store
        assert tier.put_many("ns", [(key(1), chunk(1))]) == [True]  # the link is replaced
        assert victim.read_bytes() == b"precious" and not os.path.islink(path)
    finally:
        tier.close()


def test_a_worker_refuses_a_symlinked_segment(tmp_path):
    segment = SharedMemoryFile.create(str(tmp_path / "kvstrata-seg"), 1 << 16, prefault=False)
    try:
        link = tmp_path / "link"
        link.symlink_to(segment.path)
        with pytest.raises(UnsafeFileError, match="symbolic link"):
            SharedMemoryFile.attach(link)
    finally:
        segment.close()


@as_root
def test_a_worker_refuses_a_segment_of_another_user(tmp_path):
    segment = SharedMemoryFile.create(str(tmp_path / "kvstrata-seg"), 1 << 16, prefault=False)
    try:
        os.chown(segment.path, OTHER_UID, OTHER_UID)
        with pytest.raises(UnsafeFileError) as refused:
            SharedMemoryFile.attach(segment.path)
        assert str(segment.path) in str(refused.value) and f"uid {OTHER_UID}" in str(refused.value)
    finally:
        segment.close()
