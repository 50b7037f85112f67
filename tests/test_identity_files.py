"""How the exact fingerprint reads (or avoids reading) a checkpoint's bytes: the
Hugging Face cache's content names, this node's remembered digests, and files that
change while they are hashed."""

from __future__ import annotations

import hashlib
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from kvstrata.identity import EXACT, FULL, DigestCache, LongRead, fingerprint, resolve_model_identity
from kvstrata.identity import digest_cache as digest_cache_module
from kvstrata.identity import files as files_module
from kvstrata.identity.files import FileChanged, content_key, hash_files, hash_piece

SETTINGS = {"quantization": None, "kv_cache_dtype": "auto"}
MiB = 1 << 20


@contextmanager
def bytes_read():
    """Bytes this process reads through read(2)/pread(2) meanwhile (/proc/self/io `rchar`)."""

    def rchar() -> int:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("rchar:"):
                return int(line.split()[1])
        raise AssertionError("no rchar in /proc/self/io")

    counted = {"bytes": 0}
    before = rchar()
    yield counted
    counted["bytes"] = rchar() - before


def random_bytes(size: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def hub_cache(cache: Path, files: dict[str, bytes], lfs_from: int = 64 << 10) -> Path:
    """A Hugging Face cache repository as `huggingface_hub` lays it out: blobs named by
    sha256 (LFS files) or git blob id (small files), written first; then the snapshot's
    relative links to them. Returns the snapshot directory."""
    repo = cache / "models--org--tiny"
    snapshot = repo / "snapshots" / ("c0ffee" * 6 + "c0ff")
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(snapshot.name)
    for relative, content in files.items():
        if len(content) >= lfs_from:
            name = hashlib.sha256(content).hexdigest()
        else:
            name = hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()
        (repo / "blobs" / name).write_bytes(content)
        link = snapshot / relative
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(repo / "blobs" / name, link.parent))
    return snapshot


def past_the_tick_of(path: Path) -> None:
    """Return once the filesystem's clock (coarse: one kernel tick) has moved past `path`'s
    ctime, so that a write made now is seen as later than it (bounded, no sleep)."""
    probe = path.parent / ".tick"
    try:
        for _ in range(1_000_000):
            probe.write_bytes(b"")
            if probe.stat().st_ctime_ns > path.lstat().st_ctime_ns:
                return
        raise AssertionError("the filesystem clock did not move")
    finally:
        probe.unlink()


CHECKPOINT = {
    "config.json": b'{"hidden_size": 128}',
    "tokenizer.json": b'{"vocab": {}}',
    "model-00001-of-00002.safetensors": random_bytes(3 * MiB, 1),
    "model-00002-of-00002.safetensors": random_bytes(2 * MiB, 2),
}
CHECKPOINT_BYTES = sum(map(len, CHECKPOINT.values()))


@pytest.fixture
def old_files(monkeypatch):
    monkeypatch.setattr(digest_cache_module, "RACY_SECONDS", -1e9)


# --- Hugging Face cache snapshots ---------------------------------------------------------


def test_a_hub_snapshot_is_read_once_per_node_then_identified_without_reading(tmp_path, old_files):
    snapshot = hub_cache(tmp_path / "hub", CHECKPOINT)
    cache = DigestCache(tmp_path / "digests")
    with bytes_read() as counted:
        first = fingerprint(snapshot, EXACT, cache)  # every name verified against its blob's bytes
    assert first.named == len(CHECKPOINT) and first.hashed_bytes == CHECKPOINT_BYTES
    assert counted["bytes"] >= CHECKPOINT_BYTES
    with bytes_read() as counted:
        again = fingerprint(snapshot, EXACT, cache)
    assert again.weights == first.weights and again.named == len(CHECKPOINT) and again.hashed_bytes == 0
    assert counted["bytes"] < 4096 < CHECKPOINT_BYTES  # links, inodes and the remembered names only
    assert again.weights.startswith("hub:")
    # Control: the same files outside a hub cache are read whole.
    plain = tmp_path / "plain"
    shutil.copytree(snapshot, plain)  # follows the links: regular files
    with bytes_read() as counted:
        assert fingerprint(plain, EXACT, cache).hashed_bytes == CHECKPOINT_BYTES
    assert counted["bytes"] >= CHECKPOINT_BYTES


def test_the_same_snapshot_in_another_nodes_cache_shares_and_another_revision_does_not(tmp_path):
    here = hub_cache(tmp_path / "node-a" / "hub", CHECKPOINT)
    there = hub_cache(tmp_path / "node-b" / "cache" / "huggingface", CHECKPOINT)
    revised = hub_cache(tmp_path / "node-c" / "hub", {**CHECKPOINT, "config.json": b'{"hidden_size": 256}'})
    names = {fingerprint(s, EXACT).weights for s in (here, there)}
    assert len(names) == 1 and fingerprint(revised, EXACT).weights not in names


def test_a_blob_edited_through_its_link_is_hashed_not_trusted(tmp_path, old_files):
    """Patching `snapshots/<rev>/model.safetensors` in place writes the blob: its name no
    longer says what it holds. Sizes are unchanged."""
    snapshot = hub_cache(tmp_path / "hub", CHECKPOINT)
    cache = DigestCache(tmp_path / "digests")
    before = fingerprint(snapshot, EXACT, cache)
    shard = snapshot / "model-00002-of-00002.safetensors"
    past_the_tick_of(shard)  # a patch comes later than the download (never in the same kernel tick)
    with open(shard, "r+b") as handle:  # follows the link into blobs/
        handle.seek(12345)
        handle.write(b"\x7f")
    after = fingerprint(snapshot, EXACT, cache)
    assert after.weights != before.weights
    assert after.named == len(CHECKPOINT) - 1 and after.hashed_bytes == len(CHECKPOINT[shard.name])


@pytest.mark.parametrize("evidence_lost_by", ["touch -h", "cp -a"])
def test_an_edited_blob_whose_ctime_evidence_is_gone_is_still_not_trusted(tmp_path, old_files, evidence_lost_by):
    """Issue 51, finding 2: after an in-place edit, `touch -h` on the link (or `chown -R`)
    or a copy of the cache (links made after blobs) left the blob older than its link,
    and the edited checkpoint was given the original's identity."""
    original = fingerprint(hub_cache(tmp_path / "pristine" / "hub", CHECKPOINT), EXACT, DigestCache(tmp_path / "d0"))
    snapshot = hub_cache(tmp_path / "hub", CHECKPOINT)
    cache = DigestCache(tmp_path / "digests")
    assert fingerprint(snapshot, EXACT, cache).weights == original.weights  # verified and remembered
    shard = snapshot / "model-00002-of-00002.safetensors"
    with open(shard, "r+b") as handle:  # the edit, through the link into blobs/
        handle.seek(12345)
        handle.write(b"\x7f")
    if evidence_lost_by == "touch -h":
        past_the_tick_of(shard.resolve())
        os.utime(shard, follow_symlinks=False)  # the link is now newer than the blob
    else:
        repo = snapshot.parent.parent
        copy = tmp_path / "copy" / "hub" / repo.name
        shutil.copytree(repo / "blobs", copy / "blobs")  # as cp -a or rsync: blobs first, then links
        past_the_tick_of(copy / "blobs" / shard.resolve().name)
        shutil.copytree(repo / "snapshots", copy / "snapshots", symlinks=True)
        snapshot = copy / "snapshots" / snapshot.name
        shard = snapshot / shard.name
    assert shard.resolve().stat().st_ctime_ns <= shard.lstat().st_ctime_ns  # no ctime evidence left
    edited = fingerprint(snapshot, EXACT, cache)
    assert edited.weights != original.weights
    assert edited.named == len(CHECKPOINT) - 1


def test_links_that_leave_the_cache_or_name_no_content_are_hashed(tmp_path):
    snapshot = hub_cache(tmp_path / "hub", CHECKPOINT)
    outside = tmp_path / "elsewhere.safetensors"
    outside.write_bytes(random_bytes(MiB, 3))
    (snapshot / "extra.safetensors").symlink_to(outside)
    blobs = snapshot.parent.parent / "blobs"
    (blobs / "not-a-content-name").write_bytes(b"x" * 100)
    (snapshot / "extra.json").symlink_to(os.path.relpath(blobs / "not-a-content-name", snapshot))
    found = fingerprint(snapshot, EXACT)
    assert found.named == len(CHECKPOINT) and found.hashed_bytes == CHECKPOINT_BYTES + MiB + 100  # names verified, the rest hashed


def test_full_mode_reads_a_hub_snapshot_too(tmp_path):
    snapshot = hub_cache(tmp_path / "hub", CHECKPOINT)
    found = fingerprint(snapshot, FULL)
    assert found.named == 0 and found.hashed_bytes == CHECKPOINT_BYTES and found.weights.startswith("content:")


# --- remembered digests ---------------------------------------------------------------------


def test_a_restart_reads_no_weight_bytes(tmp_path, old_files):
    snapshot = hub_cache(tmp_path / "hub", CHECKPOINT)
    plain = tmp_path / "plain"
    shutil.copytree(snapshot, plain)
    cache = DigestCache(tmp_path / "digests")
    first = fingerprint(plain, EXACT, cache)
    with bytes_read() as counted:
        again = fingerprint(plain, EXACT, cache)
    assert again.weights == first.weights and again.remembered == 2 and again.hashed_bytes == len(CHECKPOINT["config.json"]) + len(CHECKPOINT["tokenizer.json"])
    assert counted["bytes"] < 4096


@pytest.mark.parametrize("hub", [False, True], ids=["plain", "hub-snapshot"])
def test_a_read_over_the_limit_is_refused_before_any_weight_byte_is_read(tmp_path, old_files, hub):
    """The engine asks with a limit at start (connector/spec.py): a node's first read of a
    large checkpoint is refused, having read nothing, and done off the start path; once
    remembered, the same limit lets a restart through."""
    snapshot = hub_cache(tmp_path / "hub", CHECKPOINT)
    root = snapshot if hub else Path(shutil.copytree(snapshot, tmp_path / "plain"))
    cache = DigestCache(tmp_path / "digests")
    with bytes_read() as counted, pytest.raises(LongRead) as refused:
        fingerprint(root, EXACT, cache, read_limit=MiB)
    assert counted["bytes"] < 4096 and refused.value.read_bytes >= 5 * MiB
    with pytest.raises(LongRead):  # nothing was remembered by the refusal
        resolve_model_identity(str(root), EXACT, SETTINGS, digest_cache=cache, read_limit=MiB)
    first = fingerprint(root, EXACT, cache)  # what the deferred start does, unlimited
    again = fingerprint(root, EXACT, cache, read_limit=MiB)
    assert again.weights == first.weights
    assert fingerprint(root, FULL, read_limit=CHECKPOINT_BYTES).weights  # a limit that fits is no refusal
    with pytest.raises(LongRead):
        fingerprint(root, FULL, read_limit=MiB)  # full reads everything at every start


def test_a_file_written_in_the_last_seconds_is_hashed_again_next_time(tmp_path, monkeypatch):
    """A write in the same timestamp tick as the hash could leave the key unchanged, so a
    digest is remembered only for a file whose times are RACY_SECONDS old."""
    weights = tmp_path / "model" / "model.safetensors"
    weights.parent.mkdir()
    weights.write_bytes(random_bytes(2 * MiB, 4))
    now = weights.stat().st_mtime_ns / 1e9
    cache = DigestCache(tmp_path / "digests", clock=lambda: now + 0.5)
    fingerprint(weights.parent, EXACT, cache)
    assert fingerprint(weights.parent, EXACT, cache).remembered == 0
    cache = DigestCache(tmp_path / "digests", clock=lambda: now + digest_cache_module.RACY_SECONDS + 0.1)
    fingerprint(weights.parent, EXACT, cache)
    assert fingerprint(weights.parent, EXACT, cache).remembered == 1


def test_a_damaged_or_foreign_cache_entry_is_no_entry(tmp_path, old_files):
    weights = tmp_path / "model" / "model.safetensors"
    weights.parent.mkdir()
    weights.write_bytes(random_bytes(2 * MiB, 5))
    cache = DigestCache(tmp_path / "digests")
    truth = fingerprint(weights.parent, FULL).weights
    fingerprint(weights.parent, EXACT, cache)
    (entry,) = [p for p in cache.directory.iterdir()]
    for damage in ("{not json", '{"format": "other", "key": [], "digest": "00"}', ""):
        entry.write_text(damage)
        found = fingerprint(weights.parent, EXACT, cache)
        assert found.weights == truth and found.remembered == 0


# --- hashing ----------------------------------------------------------------------------------


def test_a_files_digest_does_not_depend_on_how_many_threads_read_it(tmp_path, monkeypatch):
    monkeypatch.setattr(files_module, "PIECE_BYTES", 256 << 10)  # many pieces per file
    paths = []
    for i, size in enumerate((0, 1, (256 << 10) - 1, 256 << 10, 3 * MiB + 7)):
        path = tmp_path / f"f{i}"
        path.write_bytes(random_bytes(size, i))
        paths.append(path)
    digests = [hash_files(paths, threads=t) for t in (1, 2, 8)]
    assert digests[0] == digests[1] == digests[2]
    assert len({d.digest for d in digests[0].values()}) == len(paths)


def write_during_read(path: Path, replace: bool = False):
    """A read_piece that changes `path` once, after reading the first piece: a write, or
    the path replaced by another file of the same size (an atomic rename)."""
    done = []

    def read_piece(fd: int, offset: int, length: int) -> bytes:
        piece = hash_piece(fd, offset, length)
        if not done:
            done.append(True)
            if replace:
                other = path.with_name("incoming")
                other.write_bytes(path.read_bytes()[::-1])
                os.replace(other, path)
            else:
                with open(path, "r+b") as handle:
                    handle.seek(path.stat().st_size - 1)
                    handle.write(b"\0")
        return piece

    return read_piece


@pytest.mark.parametrize("replace", [False, True], ids=["written", "replaced"])
def test_a_file_that_changes_while_hashed_is_detected(tmp_path, monkeypatch, replace):
    monkeypatch.setattr(files_module, "PIECE_BYTES", 256 << 10)
    path = tmp_path / "model.safetensors"
    path.write_bytes(random_bytes(MiB, 6))
    with pytest.raises(FileChanged):
        hash_files([path], threads=1, read_piece=write_during_read(path, replace))


def test_an_engine_whose_checkpoint_changes_under_it_shares_nothing(tmp_path, monkeypatch, caplog):
    checkpoint = tmp_path / "model"
    checkpoint.mkdir()
    weights = checkpoint / "model.safetensors"
    weights.write_bytes(random_bytes(2 * MiB, 7))
    monkeypatch.setattr(files_module, "hash_piece", write_during_read(weights))
    identity = resolve_model_identity(str(checkpoint), EXACT, SETTINGS)
    assert not identity.shared and "changed while it was fingerprinted" in identity.reason
    assert content_key(weights.stat())  # the file is still there; only the identity was refused
