"""The directory look-up for one request: prompt -> chunk keys -> per-node coverage.

`plan_prompt` (blocking: tokenizing and hashing; run it on a thread) finds the prompt's
token ids, the namespaces the candidate nodes' engines registered for the model, and
the prompt's chunk keys in each (hashed once per distinct hashing scheme).
`cluster_coverages` then makes the one batched directory call and reads, per node, how
much of the prefix it could serve and from where, and the bucket's coverage once;
`covered_by_node` keeps each node's best namespace (what the router weighs).

Every reason the look-up cannot answer is a `NoCoverage` with a short reason the router
counts (`no_prompt_tokens`, `no_layout`, `keys_unreproducible`, `directory_unavailable`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstrata.routing.coverage import ClusterCoverage, NodeCoverage, RecentPrefixes, cluster_coverage
from kvstrata.routing.figures import ClusterFigures
from kvstrata.routing.keys import Hasher, KeyScheme, PromptChunks, block_hashes, prompt_chunks
from kvstrata.routing.lookup import DirectoryUnavailable, directory_coverage
from kvstrata.routing.prompt import Tokenizers, prompt_token_ids


class NoCoverage(Exception):
    """The look-up cannot tell coverage for this request; `reason` says why (counted)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class PromptPlan:
    prompt_tokens: int
    chunks: dict[str, PromptChunks]  # namespace -> the prompt's keys there
    nodes: dict[str, list[str]]  # namespace -> candidate nodes whose engines use it
    hashes: dict[tuple[int, str], list[bytes]] = field(default_factory=dict)  # by hashing scheme: block hashes

    def blocks(self, namespace: str) -> list[bytes]:
        return self.hashes.get(self.chunks[namespace].scheme.hashing, [])


def plan_prompt(
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    tokenizers: Tokenizers,
    figures: ClusterFigures,
    node_ids: Sequence[str],
    model: str | None,
    seed: str | None = None,
    lora: tuple[str, str] | None = None,
    cache_salt: str | None = None,
    hasher: Hasher = block_hashes,
    tenant: str | None = None,
) -> PromptPlan:
    token_ids = prompt_token_ids(args, kwargs, tokenizers)
    if not token_ids:
        raise NoCoverage("no_prompt_tokens")
    schemes: dict[str, KeyScheme] = {}
    nodes: dict[str, list[str]] = {}
    for node_id in node_ids:
        node = figures.nodes.get(node_id)
        for namespace in node.namespaces(model, tenant) if node is not None else ():
            schemes.setdefault(namespace, node.schemes[namespace])
            nodes.setdefault(namespace, []).append(node_id)
    if not schemes:
        raise NoCoverage("no_layout")
    hashes: dict[tuple[int, str], list[bytes]] = {}
    chunks: dict[str, PromptChunks] = {}
    for namespace, scheme in schemes.items():
        if scheme.hashing not in hashes:
            try:
                hashes[scheme.hashing] = hasher(token_ids, scheme.tokens_per_hash, scheme.hash_algo, seed, lora, cache_salt)
            except ValueError:
                raise NoCoverage("keys_unreproducible") from None
        chunks[namespace] = prompt_chunks(scheme, hashes[scheme.hashing], len(token_ids))
    return PromptPlan(len(token_ids), chunks, nodes, hashes)


async def cluster_coverages(
    plan: PromptPlan, figures: ClusterFigures, timeout_s: float, recent: RecentPrefixes | None = None
) -> dict[str, ClusterCoverage]:
    """Namespace -> every candidate node's coverage and the bucket's: one batched directory
    call; with `recent`, the chunks this router just sent somewhere count as there."""
    try:
        masks = await directory_coverage(
            figures.shards, {namespace: chunks.keys for namespace, chunks in plan.chunks.items()}, timeout_s
        )
    except DirectoryUnavailable:
        raise NoCoverage("directory_unavailable") from None
    if recent is not None:
        for namespace, chunks in plan.chunks.items():
            for holder, mask in recent.masks(chunks.keys).items():
                masks[namespace][holder] = masks[namespace].get(holder, 0) | mask
    return {
        namespace: cluster_coverage(chunks, masks[namespace], plan.nodes[namespace])
        for namespace, chunks in plan.chunks.items()
    }


@dataclass(frozen=True)
class NodeView:
    """One node's best coverage of the prompt over its namespaces, and that namespace."""

    coverage: NodeCoverage
    namespace: str
    slot_bytes: int


async def covered_by_node(
    plan: PromptPlan, figures: ClusterFigures, timeout_s: float, recent: RecentPrefixes | None = None
) -> dict[str, NodeView]:
    """Node -> its best coverage over its namespaces (what the router weighs)."""
    best: dict[str, NodeView] = {}
    for namespace, coverage in (await cluster_coverages(plan, figures, timeout_s, recent)).items():
        for node_id in plan.nodes[namespace]:
            mine = coverage.of(node_id)
            if node_id not in best or mine.servable > best[node_id].coverage.servable:
                best[node_id] = NodeView(mine, namespace, plan.chunks[namespace].scheme.slot_bytes)
    return best


def own_cache_tokens(plan: PromptPlan, view: NodeView, cached_blocks: int) -> int:
    """Prompt tokens a replica's own prefix cache holds, from its first `cached_blocks`
    blocks (engine_cache.EngineCacheView): at most what the engine can skip (short of the
    last token), and none where the directory no longer shows whole chunks of that prefix
    on its node (a tail whose prefix was evicted there is likely gone with it)."""
    scheme = plan.chunks[view.namespace].scheme
    tokens = min(max(0, plan.prompt_tokens - 1), cached_blocks * scheme.tokens_per_hash)
    if tokens >= view.coverage.servable + max(scheme.chunk_tokens):
        return 0
    return tokens
