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
from dataclasses import dataclass, field, replace
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
    call; with `recent`, the chunks this router just sent somewhere count as there, and
    each node's `recent` says how much of the prompt it just computed."""
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
    coverages = {}
    for namespace, chunks in plan.chunks.items():
        coverage = cluster_coverage(chunks, masks[namespace], plan.nodes[namespace])
        if recent is not None:
            blocks = plan.blocks(namespace)
            limit = max(0, plan.prompt_tokens - 1)
            chunk = max(chunks.scheme.chunk_tokens)
            for node_id in plan.nodes[namespace]:
                mine = coverage.of(node_id)
                tokens = min(limit, recent.prefix_blocks(node_id, blocks) * chunks.scheme.tokens_per_hash)
                if tokens >= mine.servable + chunk:  # whole chunks of it are gone from there: so is its tail
                    tokens = 0
                coverage.nodes[node_id] = replace(mine, recent=tokens)
        coverages[namespace] = coverage
    return coverages


async def covered_by_node(
    plan: PromptPlan, figures: ClusterFigures, timeout_s: float, recent: RecentPrefixes | None = None
) -> dict[str, tuple[NodeCoverage, int]]:
    """Node -> (its best coverage over its namespaces, that namespace's chunk bytes)."""
    best: dict[str, tuple[NodeCoverage, int]] = {}
    for namespace, coverage in (await cluster_coverages(plan, figures, timeout_s, recent)).items():
        for node_id in plan.nodes[namespace]:
            mine = coverage.of(node_id)
            if node_id not in best or max(mine.servable, mine.recent) > max(best[node_id][0].servable, best[node_id][0].recent):
                best[node_id] = (mine, plan.chunks[namespace].scheme.slot_bytes)
    return best
