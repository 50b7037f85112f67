"""A prompt's chunk keys, named exactly as the deployment's engines name them.

Why: the directory knows chunks by the engines' keys (vLLM's block hash at a chunk's last
hash position, and the KV group). A router that got one byte of that wrong would see
nothing cached anywhere. So the scheme is read from what the engines registered with
their node store (`layouts`: tokens per hash, tokens per block of each group, blocks per
chunk, the hash algorithm, and the layout namespace, which holds the model identity),
and the hashes come from vLLM's own functions (`compat.prefix_block_hashes`), with the
request's `cache_salt` and LoRA adapter as extra keys, as vLLM adds them.

Keys of group g: its chunks hold `tokens_per_block[g] * blocks_per_chunk` tokens, i.e.
`hashes_per_chunk` block hashes; chunk c's key is the hash at position
`(c + 1) * hashes_per_chunk - 1` with g's index appended (vLLM's
`RequestOffloadState.update_offload_keys`). Only whole chunks have keys.

Invariants: `PromptChunks.keys` lists every group's keys, group by group, each group's
in prompt order; `ends[i]` is the token position `keys[i]`'s prefix ends at. Pure
functions; the hasher is a parameter (vLLM's by default, imported only when called).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvstrata.keys import make_key

Hasher = Callable[..., list[bytes]]


@dataclass(frozen=True)
class KeyScheme:
    """How one layout namespace's engines name chunks, and what a chunk costs to move."""

    namespace: str
    tokens_per_hash: int
    chunk_tokens: tuple[int, ...]  # per group: tokens in one chunk
    group_ids: tuple[int, ...]
    # Groups that attend to the whole prefix (full attention); None where the engines'
    # vLLM does not say (< 0.33): every group is then scanned as a prefix.
    anchor_groups: tuple[int, ...] | None
    hash_algo: str
    slot_bytes: int  # bytes of one chunk (one key) in a tier

    @classmethod
    def from_layout(cls, namespace: str, layout: Mapping[str, Any]) -> KeyScheme:
        """From a layout as a node store reports it (`stats()["layouts"][namespace]`)."""
        try:
            per_block = tuple(int(t) for t in layout["tokens_per_block"])
            blocks = int(layout["blocks_per_chunk"])
            anchors = layout.get("anchor_groups")
            return cls(
                namespace=namespace,
                tokens_per_hash=int(layout["tokens_per_hash"]),
                chunk_tokens=tuple(t * blocks for t in per_block),
                group_ids=tuple(int(g) for g in layout["group_ids"]),
                anchor_groups=None if anchors is None else tuple(int(g) for g in anchors),
                hash_algo=str(layout["hash_algo"]),
                slot_bytes=int(layout["slot_bytes"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"kvstrata router: layout of namespace {namespace} is unusable: {exc!r}") from None

    def is_anchor(self, group: int) -> bool:
        return self.anchor_groups is None or group in self.anchor_groups

    @property
    def hashing(self) -> tuple[int, str]:
        """What the block hashes depend on besides the prompt: layouts equal in it share hashes."""
        return self.tokens_per_hash, self.hash_algo


@dataclass(frozen=True)
class PromptChunks:
    """A prompt's chunks in one namespace: what to ask the directory and how to read its answer."""

    scheme: KeyScheme
    keys: tuple[bytes, ...]
    ends: tuple[int, ...]  # token position each key's prefix ends at
    groups: tuple[int, ...]  # KV group of each key
    prompt_tokens: int

    @property
    def loadable_tokens(self) -> int:
        """The most a hit can cover: vLLM computes at least the prompt's last token itself."""
        chunk = max(self.scheme.chunk_tokens)
        return max(0, (self.prompt_tokens - 1) // chunk * chunk)


def block_hashes(
    token_ids: Sequence[int],
    tokens_per_hash: int,
    hash_algo: str,
    seed: str | None = None,
    lora: tuple[str, str] | None = None,
    cache_salt: str | None = None,
) -> list[bytes]:
    """vLLM's block hashes of a prompt (see `compat.prefix_block_hashes`)."""
    from kvstrata.connector.compat import prefix_block_hashes

    return prefix_block_hashes(list(token_ids), tokens_per_hash, hash_algo, seed, lora, cache_salt)


def prompt_chunks(scheme: KeyScheme, hashes: Sequence[bytes], prompt_tokens: int) -> PromptChunks:
    """The chunk keys of every group, from the prompt's block hashes (`block_hashes`)."""
    keys: list[bytes] = []
    ends: list[int] = []
    groups: list[int] = []
    for group, chunk in zip(scheme.group_ids, scheme.chunk_tokens):
        per_chunk = chunk // scheme.tokens_per_hash
        if per_chunk <= 0 or chunk % scheme.tokens_per_hash:
            raise ValueError(
                f"kvstrata router: namespace {scheme.namespace}: a chunk of {chunk} tokens is not a whole number "
                f"of {scheme.tokens_per_hash}-token hashes"
            )
        for position in range(per_chunk - 1, len(hashes), per_chunk):
            keys.append(make_key(hashes[position], group))
            ends.append((position + 1) * scheme.tokens_per_hash)
            groups.append(group)
    return PromptChunks(scheme, tuple(keys), tuple(ends), tuple(groups), prompt_tokens)


def chunks_of_prompt(
    scheme: KeyScheme,
    token_ids: Sequence[int],
    seed: str | None = None,
    lora: tuple[str, str] | None = None,
    cache_salt: str | None = None,
    hasher: Hasher = block_hashes,
) -> PromptChunks:
    """Hash a prompt and name its chunks in `scheme`."""
    hashes = hasher(token_ids, scheme.tokens_per_hash, scheme.hash_algo, seed, lora, cache_salt)
    return prompt_chunks(scheme, hashes, len(token_ids))
