"""Model identity: which weights and which settings computed a chunk's KV bytes.

A chunk's key is vLLM's block hash: the token ids of the prefix (plus LoRA name/path,
`cache_salt`, multimodal hashes). It says nothing about the weights. Two checkpoints
of one architecture under one path (a fine-tune redeployed in place, a re-quantized
model, a new revision pulled under the same name) produce the same keys and
different KV bytes, so the layout namespace must carry the model's identity or a new
checkpoint is served the old one's KV: a silent wrong answer, persistent in the disk
and object tiers.

The identity is built from *content*, never from a path, a name or an mtime: a
cluster copies a checkpoint to each node's local disk under different paths, and
those copies must share chunks, while two different checkpoints at one path must not.

- `sampled` (default): every file of the checkpoint directory by relative name and
  size; small files (configs, tokenizer, quantization metadata, custom code) whole;
  large files (the weights) by their head, tail and a deterministic sample of
  `SAMPLES_PER_FILE` pieces spread over the file. A fine-tune, re-quantization or
  re-initialisation changes essentially every tensor, so it changes sampled bytes;
  reading ~0.4 MiB per weight file costs milliseconds at engine start.
- `full`: every byte of every file (xxh3-128), for users who want certainty and
  accept reading the whole checkpoint once per engine start.
- an explicit string: the user's own version label replaces the weights' content.

Settings that change KV bytes for the same token ids (quantization, KV-cache dtype,
the effective HF config after overrides, ...) are gathered by the connector (only it
sees vLLM's config) and enter the digest beside the weights' fingerprint.

Invariant: two identities are equal only if their checkpoints' fingerprints and
settings are equal; an identity that cannot be computed is *unshared* (unique to one
engine process), never a guess. This module reads files only: no Ray, no vLLM.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

logger = logging.getLogger(__name__)

SAMPLED = "sampled"
FULL = "full"
CONTENT_MODES = (SAMPLED, FULL)

# Files up to this size are hashed whole in `sampled` mode (configs, tokenizers, code).
WHOLE_FILE_BYTES = 1 << 20
# A large file is read at its head and tail (safetensors and GGUF headers: tensor
# names, dtypes, shapes, offsets) and at SAMPLES_PER_FILE places in between.
EDGE_BYTES = 64 << 10
SAMPLE_BYTES = 4 << 10
SAMPLES_PER_FILE = 64
FULL_READ_BYTES = 8 << 20
# Files that never change a KV byte; left out so a README edit does not split a cache.
IGNORED_NAMES = ("README", "LICENSE", "NOTICE", "USE_POLICY")
IGNORED_SUFFIXES = (".md", ".png", ".jpg", ".jpeg", ".gif", ".pdf")



@dataclass(frozen=True)
class ModelIdentity:
    """What an engine's KV bytes depend on beyond the layout: weights and settings.

    `weights` is `sampled:<hex>`, `full:<hex>`, `explicit:<label>` or
    `unshared:<uuid>`; `digest` covers `weights` and `settings`, never `name`.
    """

    name: str
    weights: str
    settings: Mapping[str, Any] = field(default_factory=dict)
    reason: str = ""  # why the identity is unshared, when it is

    @property
    def shared(self) -> bool:
        return not self.weights.startswith("unshared:")

    @property
    def digest(self) -> str:
        canonical = json.dumps({"weights": self.weights, "settings": self.settings}, sort_keys=True, default=str)
        return hashlib.blake2b(canonical.encode(), digest_size=16).hexdigest()

    @property
    def short(self) -> str:
        """What an operator reads in `kvstrata status` and logs: enough to tell two checkpoints apart."""
        return self.digest[:12]

    @property
    def source(self) -> str:
        return self.weights.split(":", 1)[0]

    def describe(self) -> dict[str, object]:
        described: dict[str, object] = {"model": self.name, "identity": self.short, "identity_source": self.source}
        if self.reason:
            described["identity_reason"] = self.reason
        return described


def sampled_ranges(size: int) -> list[tuple[int, int]]:
    """The (offset, length) pieces `sampled` mode reads from a file of `size` bytes.

    A function of the size alone (seeded by it), so every node samples the same places
    of the same file; sorted and merged so each byte is read at most once.
    """
    if size <= WHOLE_FILE_BYTES:
        return [(0, size)] if size else []
    rng = random.Random(size)
    starts = [0, size - EDGE_BYTES]
    lengths = [EDGE_BYTES, EDGE_BYTES]
    for _ in range(SAMPLES_PER_FILE):
        starts.append(rng.randrange(EDGE_BYTES, size - EDGE_BYTES - SAMPLE_BYTES))
        lengths.append(SAMPLE_BYTES)
    merged: list[tuple[int, int]] = []
    for start, length in sorted(zip(starts, lengths)):
        if merged and start <= merged[-1][0] + merged[-1][1]:
            last_start, last_length = merged[-1]
            merged[-1] = (last_start, max(last_length, start + length - last_start))
        else:
            merged.append((start, length))
    return merged


def checkpoint_files(root: Path) -> list[Path]:
    """The files whose content is the checkpoint, in a stable order (relative names sorted).

    Hidden files and directories (`.git`, `.cache`, lock files) and documentation are
    left out; symbolic links are followed (a Hugging Face snapshot links to its blobs).
    """
    if root.is_file():
        return [root]
    files = []
    for directory, subdirs, names in os.walk(root, followlinks=True):
        subdirs[:] = sorted(d for d in subdirs if not d.startswith("."))
        for name in names:
            if name.startswith(".") or name.startswith(IGNORED_NAMES) or name.lower().endswith(IGNORED_SUFFIXES):
                continue
            path = Path(directory, name)
            if path.is_file():
                files.append(path)
    return sorted(files, key=lambda path: path.relative_to(root).as_posix())


def fingerprint_checkpoint(root: str | Path, mode: str = SAMPLED) -> str:
    """`<mode>:<hex>` over the checkpoint at `root` (a directory or one file).

    Raises OSError if a file cannot be read, ValueError for an unknown mode or a
    checkpoint with no files.
    """
    if mode not in CONTENT_MODES:
        raise ValueError(f"model_identity mode {mode!r} is not one of {CONTENT_MODES}")
    root = Path(root)
    files = checkpoint_files(root)
    if not files:
        raise ValueError(f"no checkpoint files under {root}")
    digest = xxhash.xxh3_128()
    for path in files:
        size = path.stat().st_size
        relative = path.name if root.is_file() else path.relative_to(root).as_posix()
        digest.update(f"{relative}\0{size}\0".encode())
        ranges = [(0, size)] if mode == FULL else sampled_ranges(size)
        with open(path, "rb", buffering=0) as handle:
            for offset, length in ranges:
                _hash_range(handle.fileno(), offset, length, digest)
    return f"{mode}:{digest.hexdigest()}"


def _hash_range(fd: int, offset: int, length: int, digest: Any) -> None:
    end = offset + length
    while offset < end:
        piece = os.pread(fd, min(FULL_READ_BYTES, end - offset), offset)
        if not piece:
            raise OSError(f"file shrank while being fingerprinted (read ended at byte {offset})")
        digest.update(piece)
        offset += len(piece)


def locate_checkpoint(name: str, revision: str | None = None, cache_dir: str | None = None) -> Path | None:
    """Where the checkpoint `name` lies on this node: a local directory or file, or the
    Hugging Face cache snapshot of `name` at `revision` (vLLM has downloaded it before
    the scheduler starts). None when neither exists (weights streamed from elsewhere).
    """
    path = Path(name).expanduser()
    if path.exists():
        return path
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(name, "config.json", cache_dir=cache_dir, revision=revision)
    except Exception:  # an id the hub client rejects (a URL, an odd name) is simply not cached
        return None
    return Path(found).parent if isinstance(found, str) else None


def resolve_model_identity(
    name: str,
    setting: str,
    settings: Mapping[str, Any] | None,
    revision: str | None = None,
    cache_dir: str | None = None,
) -> ModelIdentity:
    """The identity of the model an engine serves, per the YAML's `model_identity`.

    `settings` is None when the engine's vLLM config could not be read: then only an
    explicit identity can be shared, since quantization and overrides are unknown.
    Never raises: what cannot be computed becomes an unshared identity with a reason.
    """
    known_settings = dict(settings or {})
    if setting not in CONTENT_MODES:
        if settings is None:
            known_settings["engine_settings"] = "unknown"
        return ModelIdentity(name, f"explicit:{setting}", known_settings)
    if settings is None:
        return _unshared(name, known_settings, "the engine's vLLM config could not be read")
    root = locate_checkpoint(name, revision, cache_dir)
    if root is None:
        return _unshared(name, known_settings, "the weights are not on a local filesystem")
    try:
        weights = fingerprint_checkpoint(root, setting)
    except (OSError, ValueError) as exc:
        return _unshared(name, known_settings, f"the checkpoint at {root} could not be read ({exc})")
    return ModelIdentity(name, weights, known_settings)


def _unshared(name: str, settings: dict[str, Any], reason: str) -> ModelIdentity:
    logger.warning(
        "kvstrata: no content identity for model %s (%s): its chunks are shared with no other engine; "
        "set model_identity to a version string in the kvstrata config to share them",
        name,
        reason,
    )
    return ModelIdentity(name, f"unshared:{uuid.uuid4().hex}", settings, reason)
