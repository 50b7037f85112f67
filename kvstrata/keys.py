"""Chunk keys and the layout namespace: the floor every other module stands on.

vLLM names a chunk by `OffloadKey` = block hash ‖ 4-byte big-endian KV group index.
We keep those bytes unchanged everywhere (arena index, names, events) so a hybrid
model's groups never collide. Bytes are only comparable inside one *layout
namespace*: the digest of everything that makes KV bytes incompatible. Chunks of
different namespaces never mix in any tier.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass

# Layout fields that steer policy or describe, not bytes: kept out of the namespace
# digest so that engines that know more (a newer vLLM) still share chunks with those
# that know less, and so that how an identity was reached does not split a cache.
POLICY_FIELDS = ("anchor_groups", "identity_source")

GROUP_BYTES = 4
# Slots are page aligned: DMA registration and O_DIRECT both want it.
SLOT_ALIGNMENT = 4096


def make_key(block_hash: bytes, group_idx: int) -> bytes:
    """Same encoding as vLLM's `make_offload_key`, without importing vLLM."""
    return bytes(block_hash) + group_idx.to_bytes(GROUP_BYTES, "big", signed=False)


def key_group(key: bytes) -> int:
    return int.from_bytes(key[-GROUP_BYTES:], "big", signed=False)


def key_hash(key: bytes) -> bytes:
    return key[:-GROUP_BYTES]


def key_name(key: bytes) -> str:
    """Readable, file-safe name of a chunk: `<hash hex>-g<group>`."""
    return f"{key_hash(key).hex()}-g{key_group(key)}"


def align_up(value: int, alignment: int = SLOT_ALIGNMENT) -> int:
    return -(-value // alignment) * alignment


def align_down(value: int, alignment: int = SLOT_ALIGNMENT) -> int:
    return value // alignment * alignment


@dataclass(frozen=True)
class Layout:
    """Everything that decides whether two engines' KV bytes are interchangeable."""

    model: str
    dtype: str
    kv_cache_layout: str
    tokens_per_block: tuple[int, ...]
    group_ids: tuple[int, ...]
    tokens_per_hash: int
    blocks_per_chunk: int
    worker_kv_bytes_per_block: int
    world_size: int
    tp_size: int
    pp_size: int
    pcp_size: int
    dcp_size: int
    hash_algo: str
    namespace_prefix: str = ""
    # KV groups whose attention reaches back without bound (full attention), when vLLM
    # says (0.33+: `sliding_window_size_in_chunks is None`); None when unknown. A
    # sliding-window or Mamba chunk is useless once its position's anchor chunk is gone.
    anchor_groups: tuple[int, ...] | None = None
    # Digest of the weights' content and the settings that change KV bytes
    # (`kvstrata.identity`). When set, it replaces `model` (a path or a name) in the
    # namespace: copies of one checkpoint at different paths share, different
    # checkpoints at one path never do. Empty only where no identity was computed
    # (a layout built outside an engine); then the model's name stands for it.
    model_identity: str = ""
    # How `model_identity` was reached: hub / content / sampled / explicit / unshared / updated (for operators).
    identity_source: str = ""

    @property
    def rank_bytes(self) -> int:
        """Bytes one worker rank writes into a chunk's slot."""
        return self.worker_kv_bytes_per_block * self.blocks_per_chunk

    @property
    def slot_bytes(self) -> int:
        """Bytes of one chunk across all ranks, rounded up to the slot alignment."""
        return align_up(self.rank_bytes * self.world_size)

    @property
    def namespace(self) -> str:
        """Stable digest of the layout; also part of file and object names."""
        return namespace_of(asdict(self))

    def describe(self) -> dict[str, object]:
        described = {"namespace": self.namespace, "slot_bytes": self.slot_bytes, **asdict(self)}
        if self.model_identity:
            described["identity"] = self.model_identity[:12]
        return described


# What `Layout.describe` adds to the layout's fields (left out of the digest, as the policy fields are).
DESCRIBED_EXTRAS = ("namespace", "slot_bytes", "identity")


def namespace_of(fields: Mapping[str, object]) -> str:
    """The namespace of a layout's fields (`asdict(layout)`, or `describe()` as an engine sends
    it): a digest of every field but the policy fields and what `describe` adds, and of the
    model's identity instead of its name when there is one. A store checks a registration's
    layout with it (actors/registration_check.py): over the fields the engine sent, so an
    engine of another kvstrata version with a field more or less still digests its own way.
    """
    ignored = POLICY_FIELDS + DESCRIBED_EXTRAS + (("model",) if fields.get("model_identity") else ("model_identity",))
    kept = {name: value for name, value in fields.items() if name not in ignored}
    canonical = json.dumps(kept, sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(canonical.encode(), digest_size=10).hexdigest()
