"""Model identity: which weights and which settings computed a chunk's KV bytes.

A chunk's key is vLLM's block hash: the token ids of the prefix (plus LoRA name/path,
`cache_salt`, multimodal hashes). It says nothing about the weights. Two checkpoints
of one architecture under one path (a fine-tune redeployed in place, a patched
embedding, a re-trained norm, a new revision pulled under the same name) produce the
same keys and different KV bytes, so the layout namespace must carry the model's
identity or new weights are served old KV: a silent wrong answer, persistent in the
disk and object tiers.

The identity is built from *content*, never from a path, a name or an mtime: a
cluster copies a checkpoint to each node's local disk under different paths, and
those copies must share chunks, while two checkpoints that differ in one byte must not.

- `exact` (default): every file's exact content, at almost no cost after the first
  start. A Hugging Face cache snapshot names its files by content already (`hub.py`):
  those names are used once this node has read each blob and found it to be what its
  name says (remembered by the blob's content key: a restart reads nothing). Any other
  file is hashed whole (xxh3-128, `files.py`) once per node; the digest is remembered
  by the file's (device, inode, size, mtime_ns, ctime_ns) in the user's cache directory
  (`digest_cache.py`), so a restart costs a `stat` per file.
- `full`: every byte of every file hashed at every start; no names, no remembered
  digests (for filesystems whose inode metadata cannot be trusted).
- `sampled`: sizes and a fixed sample of each large file's bytes (`sampled.py`); misses
  most edits that keep file sizes: an explicit opt-in only.
- an explicit string: the user's own version label replaces the weights' content.

Settings that change KV bytes for the same token ids (quantization, KV-cache dtype,
the effective HF config after overrides, ...) are gathered by the connector (only it
sees vLLM's config) and enter the digest beside the weights' fingerprint.

Invariant: two identities are equal only if their checkpoints' fingerprints and
settings are equal; an identity that cannot be computed (a file unreadable, or
changed while it was hashed) is *unshared* (unique to one engine process), never a
guess. This package reads files only: no Ray, no vLLM.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from kvstrata.identity.digest_cache import DigestCache
from kvstrata.identity.files import FileChanged, checkpoint_files, content_key, hash_files
from kvstrata.identity.hub import VERIFIED_NAME_FORMAT, hub_snapshot, verify_names
from kvstrata.identity.sampled import WHOLE_FILE_BYTES, sampled_digest, sampled_ranges

__all__ = [
    "CONTENT_MODES", "EXACT", "FULL", "SAMPLED", "WHOLE_FILE_BYTES", "DigestCache", "FileChanged", "Fingerprint",
    "LongRead", "ModelIdentity", "checkpoint_files", "fingerprint", "fingerprint_checkpoint", "locate_checkpoint",
    "resolve_model_identity", "sampled_ranges",
]  # fmt: skip

logger = logging.getLogger(__name__)

EXACT = "exact"
FULL = "full"
SAMPLED = "sampled"
CONTENT_MODES = (EXACT, FULL, SAMPLED)
# Files this small are hashed at every start: reading one costs what reading its cache entry would.
REMEMBERED_MIN_BYTES = 1 << 20


class LongRead(Exception):  # noqa: N818 - not an error: the caller asked to be told
    """The fingerprint would read more than the caller's `read_limit`; nothing was read.

    The connector asks with a limit at engine start (a restart, a small or labelled
    checkpoint costs milliseconds) and computes a long read off the start path."""

    def __init__(self, root: Path, read_bytes: int, read_limit: int):
        super().__init__(f"fingerprinting {root} reads {read_bytes} bytes (limit {read_limit})")
        self.root = root
        self.read_bytes = read_bytes
        self.read_limit = read_limit


@dataclass(frozen=True)
class ModelIdentity:
    """What an engine's KV bytes depend on beyond the layout: weights and settings.

    `weights` is `<source>:<hex or label>`: `content` (every byte, hashed or
    remembered), `hub` (Hugging Face cache names, the rest hashed), `sampled`,
    `explicit`, `unshared`, or `updated` (weights changed in place while serving,
    `kvstrata.connector.weight_updates`). `digest` covers `weights` and `settings`,
    never `name`.
    """

    name: str
    weights: str
    settings: Mapping[str, Any] = field(default_factory=dict)
    reason: str = ""  # why the identity is unshared, when it is

    @property
    def shared(self) -> bool:
        return not self.weights.startswith(("unshared:", "updated:"))

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

    def updated(self, generation: int) -> ModelIdentity:
        """The identity after the engine's weights changed in place (the `generation`-th
        time): unique to this engine process, as nothing tells what the weights are now."""
        weights = f"updated:{self.digest}-{generation}-{uuid.uuid4().hex}"
        return ModelIdentity(self.name, weights, self.settings, f"weights updated in place ({generation}x)")


@dataclass(frozen=True)
class Fingerprint:
    """A checkpoint's fingerprint and how it was reached (for the start-up log line)."""

    weights: str
    files: int
    named: int = 0  # by the Hugging Face cache's content names
    remembered: int = 0  # by this node's digest cache
    hashed_bytes: int = 0
    seconds: float = 0.0

    def summary(self) -> str:
        return (
            f"{self.files} files: {self.named} named by the Hugging Face cache, {self.remembered} remembered, "
            f"{self.hashed_bytes / (1 << 30):.2f} GiB hashed in {self.seconds:.3f} s"
        )


def fingerprint(
    root: str | Path, mode: str = EXACT, cache: DigestCache | None = None, read_limit: int | None = None
) -> Fingerprint:
    """The fingerprint of the checkpoint at `root` (a directory or one file).

    `cache` is used in `exact` mode only (default: the user's cache directory).
    `read_limit`: raise LongRead, having read nothing, if the files to read whole (not
    remembered, not yet verified by name) hold more bytes than this (`sampled` reads a
    fixed sample of each file and is never refused).
    Raises OSError if a file cannot be read or changed while it was read
    (FileChanged), ValueError for an unknown mode or a checkpoint with no files.
    """
    if mode not in CONTENT_MODES:
        raise ValueError(f"model_identity mode {mode!r} is not one of {CONTENT_MODES}")
    began = time.perf_counter()
    root = Path(root)
    files = checkpoint_files(root)
    if not files:
        raise ValueError(f"no checkpoint files under {root}")
    tags: dict[Path, tuple[int, str]] = {}  # path -> (size, content tag)
    named = remembered = hashed_bytes = 0
    if mode == SAMPLED:
        for path in files:
            size = path.stat().st_size
            tags[path] = (size, sampled_digest(path, size))
    else:
        snapshot = hub_snapshot(root) if mode == EXACT else None
        cache = (cache or DigestCache()) if mode == EXACT else None
        to_hash, claims = [], {}
        for path in files:
            found = snapshot.content_name(path) if snapshot is not None else None
            if found is not None and cache is not None:
                if cache.get(content_key(path.stat()), VERIFIED_NAME_FORMAT) == found[0]:
                    tags[path] = (found[1], found[0])  # this very blob version was read and matched
                    named += 1
                else:
                    claims[path] = found[0]
                continue
            if cache is not None:
                key = content_key(path.stat())
                digest = cache.get(key) if key[2] >= REMEMBERED_MIN_BYTES else None
                if digest is not None:
                    tags[path] = (key[2], f"xxh3:{digest}")
                    remembered += 1
                    continue
            to_hash.append(path)
        if read_limit is not None:
            read_bytes = sum(path.stat().st_size for path in [*claims, *to_hash])
            if read_bytes > read_limit:
                raise LongRead(root, read_bytes, read_limit)
        for path, (matches, key, read) in verify_names(claims.items()).items():
            hashed_bytes += read
            if not matches:
                to_hash.append(path)  # not what its name says: an edited blob, hashed as a plain file
                continue
            tags[path] = (key[2], claims[path])
            named += 1
            cache.put(key, claims[path], VERIFIED_NAME_FORMAT)
        for path, hashed in hash_files(to_hash).items():
            tags[path] = (hashed.size, f"xxh3:{hashed.digest}")
            hashed_bytes += hashed.size
            if cache is not None and hashed.size >= REMEMBERED_MIN_BYTES:
                cache.put(hashed.key, hashed.digest)
    digest = xxhash.xxh3_128()
    for path in files:
        relative = path.name if root.is_file() else path.relative_to(root).as_posix()
        size, tag = tags[path]
        digest.update(f"{relative}\0{size}\0{tag}\n".encode())
    source = SAMPLED if mode == SAMPLED else ("hub" if named else "content")
    seconds = time.perf_counter() - began
    return Fingerprint(f"{source}:{digest.hexdigest()}", len(files), named, remembered, hashed_bytes, seconds)


def fingerprint_checkpoint(root: str | Path, mode: str = EXACT, cache: DigestCache | None = None) -> str:
    """`<source>:<hex>` over the checkpoint at `root`; see `fingerprint`."""
    return fingerprint(root, mode, cache).weights


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
    digest_cache: DigestCache | None = None,
    read_limit: int | None = None,
) -> ModelIdentity:
    """The identity of the model an engine serves, per the YAML's `model_identity`.

    `settings` is None when the engine's vLLM config could not be read: then only an
    explicit identity can be shared, since quantization and overrides are unknown.
    Never raises, except LongRead where a `read_limit` is given (see `fingerprint`):
    what cannot be computed becomes an unshared identity with a reason.
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
        found = fingerprint(root, setting, digest_cache, read_limit)
    except (OSError, ValueError) as exc:
        return _unshared(name, known_settings, f"the checkpoint at {root} could not be read ({exc})")
    logger.info("kvstrata: fingerprinted %s (%s): %s", root, setting, found.summary())
    return ModelIdentity(name, found.weights, known_settings)


def _unshared(name: str, settings: dict[str, Any], reason: str) -> ModelIdentity:
    logger.warning(
        "kvstrata: no content identity for model %s (%s): its chunks are shared with no other engine; "
        "set model_identity to a version string in the kvstrata config to share them",
        name,
        reason,
    )
    return ModelIdentity(name, f"unshared:{uuid.uuid4().hex}", settings, reason)
