"""Model identity: equal for the same checkpoint anywhere, different for any other one."""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from kvstrata.config import ConfigError, load_config
from kvstrata.identity import (
    FULL,
    SAMPLED,
    WHOLE_FILE_BYTES,
    fingerprint_checkpoint,
    resolve_model_identity,
    sampled_ranges,
)
from tests.utils import layout

WEIGHTS_BYTES = 6 * WHOLE_FILE_BYTES + 12345  # large enough to be sampled, not read whole
SETTINGS = {"quantization": None, "kv_cache_dtype": "auto", "model_dtype": "float32", "hf_config": {"rope_theta": 1e4}}


def write_checkpoint(directory: Path, seed: int = 0) -> Path:
    directory.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    (directory / "model.safetensors").write_bytes(rng.integers(0, 256, WEIGHTS_BYTES, dtype=np.uint8).tobytes())
    (directory / "config.json").write_text('{"hidden_size": 128, "num_hidden_layers": 2}')
    (directory / "tokenizer.json").write_text('{"vocab": ["a", "b"]}')
    return directory


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)[0]
        handle.seek(offset)
        handle.write(bytes([byte ^ 0x01]))


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    return write_checkpoint(tmp_path / "model")


def test_a_copy_at_another_path_with_other_mtimes_has_the_same_fingerprint(checkpoint, tmp_path):
    copy = tmp_path / "elsewhere" / "renamed-model"
    shutil.copytree(checkpoint, copy)
    for path in copy.iterdir():
        os.utime(path, (1, 1))
    for mode in (SAMPLED, FULL):
        assert fingerprint_checkpoint(copy, mode) == fingerprint_checkpoint(checkpoint, mode)


@pytest.mark.parametrize("mode", [SAMPLED, FULL])
def test_a_change_in_any_sampled_weight_byte_changes_the_fingerprint(checkpoint, mode):
    weights = checkpoint / "model.safetensors"
    original = fingerprint_checkpoint(checkpoint, mode)
    ranges = sampled_ranges(WEIGHTS_BYTES)
    assert sum(length for _, length in ranges) < WEIGHTS_BYTES // 8  # really a sample
    rng = np.random.default_rng(1)
    for start, length in ranges:
        for offset in (start, start + length - 1, start + int(rng.integers(length))):
            flip(weights, offset)
            assert fingerprint_checkpoint(checkpoint, mode) != original, (mode, offset)
            flip(weights, offset)  # restore
    assert fingerprint_checkpoint(checkpoint, mode) == original


def test_only_full_mode_sees_a_byte_outside_the_sample(checkpoint):
    """The trade-off `sampled` makes, measured rather than assumed."""
    covered = np.zeros(WEIGHTS_BYTES, dtype=bool)
    for start, length in sampled_ranges(WEIGHTS_BYTES):
        covered[start : start + length] = True
    unsampled = int(np.flatnonzero(~covered)[len(np.flatnonzero(~covered)) // 2])
    sampled, full = fingerprint_checkpoint(checkpoint, SAMPLED), fingerprint_checkpoint(checkpoint, FULL)
    flip(checkpoint / "model.safetensors", unsampled)
    assert fingerprint_checkpoint(checkpoint, SAMPLED) == sampled
    assert fingerprint_checkpoint(checkpoint, FULL) != full


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
def test_small_files_names_and_sizes_are_part_of_the_fingerprint(checkpoint, change):
    before = fingerprint_checkpoint(checkpoint)
    change(checkpoint)
    assert fingerprint_checkpoint(checkpoint) != before


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
    base = resolve_model_identity(str(checkpoint), SAMPLED, SETTINGS)
    changed = resolve_model_identity(str(checkpoint), SAMPLED, {**SETTINGS, setting: value})
    assert base.shared and changed.shared
    assert base.digest != changed.digest


def test_the_model_name_alone_does_not_change_the_identity(checkpoint, tmp_path):
    copy = tmp_path / "served-as-another-name"
    shutil.copytree(checkpoint, copy)
    here = resolve_model_identity(str(checkpoint), SAMPLED, SETTINGS)
    there = resolve_model_identity(str(copy), SAMPLED, SETTINGS)
    assert here.name != there.name and here.digest == there.digest
    assert here.describe()["identity"] == here.short == here.digest[:12]


def test_an_explicit_identity_replaces_the_weights_but_not_the_settings(tmp_path):
    a = resolve_model_identity(str(write_checkpoint(tmp_path / "a", seed=1)), "release-7", SETTINGS)
    b = resolve_model_identity(str(write_checkpoint(tmp_path / "b", seed=2)), "release-7", SETTINGS)
    other_label = resolve_model_identity(str(tmp_path / "a"), "release-8", SETTINGS)
    quantized = resolve_model_identity(str(tmp_path / "a"), "release-7", {**SETTINGS, "quantization": "fp8"})
    assert a.digest == b.digest and a.source == "explicit"
    assert len({a.digest, other_label.digest, quantized.digest}) == 3


def test_weights_that_cannot_be_read_are_never_shared(tmp_path, caplog):
    remote = resolve_model_identity("s3://bucket/not-here", SAMPLED, SETTINGS)
    again = resolve_model_identity("s3://bucket/not-here", SAMPLED, SETTINGS)
    assert not remote.shared and remote.digest != again.digest
    assert remote.describe()["identity_reason"] == "the weights are not on a local filesystem"
    assert "shared with no other engine" in caplog.text
    empty = tmp_path / "empty"
    empty.mkdir()
    assert not resolve_model_identity(str(empty), SAMPLED, SETTINGS).shared


def test_without_the_engine_config_only_an_explicit_identity_is_shared(checkpoint):
    assert not resolve_model_identity(str(checkpoint), SAMPLED, None).shared
    explicit = resolve_model_identity(str(checkpoint), "v1", None)
    assert explicit.shared and explicit.settings == {"engine_settings": "unknown"}


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
