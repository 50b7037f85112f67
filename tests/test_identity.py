"""Model identity: equal for the same checkpoint anywhere, different for any other one,
down to one byte that keeps every file's size."""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from kvstrata.config import ConfigError, load_config
from kvstrata.identity import (
    EXACT,
    FULL,
    SAMPLED,
    WHOLE_FILE_BYTES,
    DigestCache,
    fingerprint,
    fingerprint_checkpoint,
    resolve_model_identity,
    sampled_ranges,
)
from tests.utils import layout

WEIGHTS_BYTES = 6 * WHOLE_FILE_BYTES + 12345  # large enough to be sampled and remembered
SETTINGS = {"quantization": None, "kv_cache_dtype": "auto", "model_dtype": "float32", "hf_config": {"rope_theta": 1e4}}


def write_checkpoint(directory: Path, seed: int = 0) -> Path:
    directory.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    (directory / "model.safetensors").write_bytes(rng.integers(0, 256, WEIGHTS_BYTES, dtype=np.uint8).tobytes())
    (directory / "config.json").write_text('{"hidden_size": 128, "num_hidden_layers": 2}')
    (directory / "tokenizer.json").write_text('{"vocab": ["a", "b"]}')
    return directory


def flip(path: Path, offset: int, keep_mtime: bool = False) -> None:
    """Change one byte in place; with `keep_mtime`, put the file's mtime back as `cp -p` or rsync would."""
    before = path.stat()
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)[0]
        handle.seek(offset)
        handle.write(bytes([byte ^ 0x01]))
    if keep_mtime:
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def unsampled_offset(size: int) -> int:
    covered = np.zeros(size, dtype=bool)
    for start, length in sampled_ranges(size):
        covered[start : start + length] = True
    outside = np.flatnonzero(~covered)
    return int(outside[len(outside) // 2])


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    return write_checkpoint(tmp_path / "model")


@pytest.fixture
def old_files(monkeypatch):
    """Every file written counts as older than the racy window (a checkpoint written long ago)."""
    monkeypatch.setattr("kvstrata.identity.digest_cache.RACY_SECONDS", -1e9)


def test_a_copy_at_another_path_with_other_mtimes_has_the_same_fingerprint(checkpoint, tmp_path):
    copy = tmp_path / "elsewhere" / "renamed-model"
    shutil.copytree(checkpoint, copy)
    for path in copy.iterdir():
        os.utime(path, (1, 1))
    for mode in (EXACT, FULL, SAMPLED):
        assert fingerprint_checkpoint(copy, mode) == fingerprint_checkpoint(checkpoint, mode)
    # Remembered and freshly hashed digests are the same digest: `exact` and `full` agree.
    assert fingerprint_checkpoint(checkpoint, EXACT) == fingerprint_checkpoint(checkpoint, FULL)


@pytest.mark.parametrize("where", ["first", "unsampled", "last"])
@pytest.mark.parametrize("keep_mtime", [False, True], ids=["mtime-changed", "mtime-restored"])
def test_one_byte_edited_in_place_after_a_start_changes_the_identity(checkpoint, old_files, where, keep_mtime):
    """The edit the sampled default missed: sizes unchanged, and the node remembers the
    old file's digest from the engine's previous start."""
    weights = checkpoint / "model.safetensors"
    before = fingerprint(checkpoint)
    assert fingerprint(checkpoint).remembered == 1  # the restart took the remembered digest
    offset = {"first": 0, "unsampled": unsampled_offset(WEIGHTS_BYTES), "last": WEIGHTS_BYTES - 1}[where]
    flip(weights, offset, keep_mtime)
    after = fingerprint(checkpoint)
    assert after.weights != before.weights and after.remembered == 0
    assert fingerprint_checkpoint(checkpoint, FULL) == after.weights


def test_sampled_misses_a_byte_outside_its_sample_that_exact_and_full_see(checkpoint):
    """The trade-off `sampled` makes, measured rather than assumed: why it is no longer the default."""
    before = {mode: fingerprint_checkpoint(checkpoint, mode) for mode in (EXACT, FULL, SAMPLED)}
    assert sum(length for _, length in sampled_ranges(WEIGHTS_BYTES)) < WEIGHTS_BYTES // 8  # really a sample
    flip(checkpoint / "model.safetensors", unsampled_offset(WEIGHTS_BYTES))
    assert fingerprint_checkpoint(checkpoint, SAMPLED) == before[SAMPLED]
    assert fingerprint_checkpoint(checkpoint, EXACT) != before[EXACT]
    assert fingerprint_checkpoint(checkpoint, FULL) != before[FULL]


@pytest.mark.parametrize(
    "change",
    [
        lambda d: (d / "config.json").write_text('{"hidden_size": 128, "num_hidden_layers": 3}'),
        lambda d: (d / "quantize_config.json").write_text('{"bits": 4}'),
        lambda d: (d / "model.safetensors").rename(d / "model-00001.safetensors"),
        lambda d: open(d / "model.safetensors", "ab").write(b"\0"),
    ],
    ids=["config", "added-file", "renamed-file", "grown-file"],
)
@pytest.mark.parametrize("mode", [EXACT, SAMPLED])
def test_small_files_names_and_sizes_are_part_of_the_fingerprint(checkpoint, change, mode):
    before = fingerprint_checkpoint(checkpoint, mode)
    change(checkpoint)
    assert fingerprint_checkpoint(checkpoint, mode) != before


def test_documentation_and_hidden_files_are_not(checkpoint):
    before = fingerprint_checkpoint(checkpoint)
    (checkpoint / "README.md").write_text("a new model card")
    (checkpoint / ".cache").mkdir()
    (checkpoint / ".cache" / "download.lock").write_text("x")
    assert fingerprint_checkpoint(checkpoint) == before


def test_another_checkpoint_of_the_same_shape_is_another_model(tmp_path):
    first = write_checkpoint(tmp_path / "a", seed=1)
    second = write_checkpoint(tmp_path / "b", seed=2)
    assert fingerprint_checkpoint(first) != fingerprint_checkpoint(second)


@pytest.mark.parametrize(
    "setting, value",
    [
        ("quantization", "fp8"),
        ("kv_cache_dtype", "fp8_e5m2"),
        ("model_dtype", "bfloat16"),
        ("hf_config", {"rope_theta": 5e5}),
        ("revision", "v2"),
    ],
)
def test_every_setting_that_changes_kv_bytes_changes_the_identity(checkpoint, setting, value):
    base = resolve_model_identity(str(checkpoint), EXACT, SETTINGS)
    changed = resolve_model_identity(str(checkpoint), EXACT, {**SETTINGS, setting: value})
    assert base.shared and changed.shared
    assert base.digest != changed.digest


def test_the_model_name_alone_does_not_change_the_identity(checkpoint, tmp_path):
    copy = tmp_path / "served-as-another-name"
    shutil.copytree(checkpoint, copy)
    here = resolve_model_identity(str(checkpoint), EXACT, SETTINGS)
    there = resolve_model_identity(str(copy), EXACT, SETTINGS)
    assert here.name != there.name and here.digest == there.digest
    assert here.describe()["identity"] == here.short == here.digest[:12]
    assert here.source == "content"


def test_an_explicit_identity_replaces_the_weights_but_not_the_settings(tmp_path):
    a = resolve_model_identity(str(write_checkpoint(tmp_path / "a", seed=1)), "release-7", SETTINGS)
    b = resolve_model_identity(str(write_checkpoint(tmp_path / "b", seed=2)), "release-7", SETTINGS)
    other_label = resolve_model_identity(str(tmp_path / "a"), "release-8", SETTINGS)
    quantized = resolve_model_identity(str(tmp_path / "a"), "release-7", {**SETTINGS, "quantization": "fp8"})
    assert a.digest == b.digest and a.source == "explicit"
    assert len({a.digest, other_label.digest, quantized.digest}) == 3


def test_weights_that_cannot_be_read_are_never_shared(tmp_path, caplog):
    remote = resolve_model_identity("s3://bucket/not-here", EXACT, SETTINGS)
    again = resolve_model_identity("s3://bucket/not-here", EXACT, SETTINGS)
    assert not remote.shared and remote.digest != again.digest
    assert remote.describe()["identity_reason"] == "the weights are not on a local filesystem"
    assert "shared with no other engine" in caplog.text
    empty = tmp_path / "empty"
    empty.mkdir()
    assert not resolve_model_identity(str(empty), EXACT, SETTINGS).shared


def test_without_the_engine_config_only_an_explicit_identity_is_shared(checkpoint):
    assert not resolve_model_identity(str(checkpoint), EXACT, None).shared
    explicit = resolve_model_identity(str(checkpoint), "v1", None)
    assert explicit.shared and explicit.settings == {"engine_settings": "unknown"}


def test_weights_updated_in_place_get_an_identity_of_their_own(checkpoint):
    served = resolve_model_identity(str(checkpoint), EXACT, SETTINGS)
    first, second = served.updated(1), served.updated(1)
    assert not first.shared and first.source == "updated"
    assert len({served.digest, first.digest, second.digest}) == 3  # not even two engines' updates share


def test_the_identity_replaces_the_model_path_in_the_namespace():
    at_one_path, at_another = layout(model="/nodeA/llama"), layout(model="/nodeB/llama")
    assert at_one_path.namespace != at_another.namespace  # no identity: the name stands for it
    same = [dataclasses.replace(x, model_identity="abc") for x in (at_one_path, at_another)]
    assert same[0].namespace == same[1].namespace
    assert dataclasses.replace(at_one_path, model_identity="abd").namespace != same[0].namespace


@pytest.mark.parametrize("bad", ["", " leading-space", "tab\there", "x" * 257, "naïve"])
def test_a_bad_model_identity_in_the_yaml_names_the_key(bad):
    with pytest.raises(ConfigError, match="model_identity"):
        load_config({"model_identity": bad})


def test_exact_is_the_default():
    assert load_config({}).model_identity == EXACT


def test_an_unwritable_cache_directory_costs_speed_not_the_identity(checkpoint, tmp_path, old_files, caplog):
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("a file where the cache directory should be")
    cache = DigestCache(blocked / "identity")
    assert fingerprint_checkpoint(checkpoint, EXACT, cache) == fingerprint_checkpoint(checkpoint, FULL)
    assert "cannot keep model fingerprints" in caplog.text
    assert fingerprint(checkpoint, EXACT, cache).remembered == 0
