"""How much of a prompt's prefix each node could serve, and from where: the directory's
answer (one bitmask per holder) read as an engine's lookup would read it.

An engine's lookup scans a prompt's chunks from the first and stops at the first it
cannot get (a MISS), so only a contiguous prefix counts. For one node, each chunk can
come from its own arena, its own disk, another node's store (a peer fetch) or the
bucket; the node store promotes from the first of those that holds it, in that order
(`SOURCES`). A node's `servable` prefix is the longest whose every chunk has a source;
`tokens_by_source` / `keys_by_source` split it by the source each chunk would come from.
Besides, each tier's own contiguous prefix is kept (`arena`, `disk`, `peer`, and the
bucket's once per prompt), for the decision log and the benchmarks.

Hybrid models: full-attention ("anchor") groups are scanned as a prefix; the hit point
is where every anchor group's prefix reaches, moved back until every other group
(sliding window, Mamba) holds its chunk ending there, as vLLM scans those from the end.

Invariants: pure; masks name keys by their index in `PromptChunks.keys`; a prefix never
exceeds `PromptChunks.loadable_tokens`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kvstrata.actors.directory import BUCKET_HOLDER, holder_label, split_holder
from kvstrata.keys import key_hash
from kvstrata.routing.keys import PromptChunks
from kvstrata.tiers.changelog import CPU, STORAGE

ARENA, DISK, PEER, BUCKET = "arena", "disk", "peer", "bucket"
SOURCES = (ARENA, DISK, PEER, BUCKET)  # the order a node store promotes from


@dataclass(frozen=True)
class NodeCoverage:
    """One node's view of a prompt: tokens of the prefix per tier, and what it would load."""

    arena: int  # contiguous prefix tokens in its own arena
    disk: int  # ... on its own disk
    peer: int  # ... held by other nodes (arena or disk)
    servable: int  # ... from any source
    tokens_by_source: dict[str, int] = field(default_factory=dict)  # within `servable`
    keys_by_source: dict[str, int] = field(default_factory=dict)  # chunks to move, within `servable`
    recent: int = 0  # prompt tokens the router just sent to this node (its engine's own cache)


@dataclass(frozen=True)
class ClusterCoverage:
    prompt_tokens: int
    bucket: int  # contiguous prefix tokens in the bucket
    nodes: dict[str, NodeCoverage]  # every node asked about, held anything or not

    def of(self, node_id: str) -> NodeCoverage:
        return self.nodes.get(node_id) or _nothing()


def _nothing() -> NodeCoverage:
    return NodeCoverage(0, 0, 0, 0, {}, {})


def node_masks(masks: Mapping[str, int]) -> tuple[dict[str, tuple[int, int]], int]:
    """Holder masks -> node -> (arena mask, disk mask), and the bucket's mask."""
    nodes: dict[str, tuple[int, int]] = {}
    bucket = 0
    for holder, mask in masks.items():
        if holder == BUCKET_HOLDER:
            bucket |= mask
            continue
        node_id, tier = split_holder(holder)
        arena, disk = nodes.get(node_id, (0, 0))
        if tier == CPU:
            arena |= mask
        elif tier == STORAGE:
            disk |= mask
        nodes[node_id] = (arena, disk)
    return nodes, bucket


def prefix_tokens(chunks: PromptChunks, has: Callable[[int], bool]) -> int:
    """Tokens of the longest prefix an engine would find, when `has(i)` tells whether key i is there."""
    scheme = chunks.scheme
    limit = chunks.loadable_tokens
    reach: int | None = None
    others: dict[int, dict[int, int]] = {}  # non-anchor group -> end -> key index
    for group in scheme.group_ids:
        if not scheme.is_anchor(group):
            others[group] = {}
    ends_by_group: dict[int, int] = {}
    broken: set[int] = set()
    for i, (end, group) in enumerate(zip(chunks.ends, chunks.groups)):
        if end > limit:
            continue
        if group in others:
            others[group][end] = i
        elif group not in broken:
            if has(i):
                ends_by_group[group] = end
            else:
                broken.add(group)
    for group in scheme.group_ids:
        if group not in others:
            reach = min(reach if reach is not None else limit, ends_by_group.get(group, 0))
    reach = limit if reach is None else reach  # no anchor group at all: the other groups decide
    while reach > 0 and not all(_ends_at(keys, reach, has) for keys in others.values()):
        reach = max((end for end in chunks.ends if end < reach), default=0)
    return reach


def _ends_at(keys_by_end: dict[int, int], reach: int, has: Callable[[int], bool]) -> bool:
    """Whether a non-anchor group holds its chunk ending at (or last before) `reach`."""
    ends = [end for end in keys_by_end if end <= reach]
    return bool(ends) and has(keys_by_end[max(ends)])


def cluster_coverage(chunks: PromptChunks, masks: Mapping[str, int], nodes: list[str]) -> ClusterCoverage:
    """Every node's coverage of the prompt, from the directory's holder masks."""
    held, bucket = node_masks(masks)
    order = list(held)
    # What the nodes before / after each one hold, so "every other node" is one OR per node.
    before, after = [0] * (len(order) + 1), [0] * (len(order) + 1)
    for n, node_id in enumerate(order):
        before[n + 1] = before[n] | held[node_id][0] | held[node_id][1]
    for n in range(len(order) - 1, -1, -1):
        after[n] = after[n + 1] | held[order[n]][0] | held[order[n]][1]
    position = {node_id: n for n, node_id in enumerate(order)}
    coverages: dict[str, NodeCoverage] = {}
    for node_id in nodes:
        arena, disk = held.get(node_id, (0, 0))
        n = position.get(node_id)
        others = before[-1] if n is None else before[n] | after[n + 1]
        coverages[node_id] = _node_coverage(chunks, arena, disk, others, bucket)
    return ClusterCoverage(
        prompt_tokens=chunks.prompt_tokens,
        bucket=prefix_tokens(chunks, lambda i: bool(bucket >> i & 1)),
        nodes=coverages,
    )


def _node_coverage(chunks: PromptChunks, arena: int, disk: int, others: int, bucket: int) -> NodeCoverage:
    sources = ((ARENA, arena), (DISK, disk), (PEER, others), (BUCKET, bucket))
    union = arena | disk | others | bucket
    servable = prefix_tokens(chunks, lambda i: bool(union >> i & 1))
    scheme = chunks.scheme
    first_anchor = next((g for g in scheme.group_ids if scheme.is_anchor(g)), None)
    # The chunks a hit at `servable` loads: every anchor group's up to it, and each other
    # group's one chunk ending there (or last before).
    window_key = {
        group: max((i for i, (end, g) in enumerate(zip(chunks.ends, chunks.groups)) if g == group and end <= servable),
                   key=lambda i: chunks.ends[i], default=None)
        for group in scheme.group_ids
        if not scheme.is_anchor(group)
    }  # fmt: skip
    tokens: dict[str, int] = {}
    keys: dict[str, int] = {}
    previous_end = 0
    for i, (end, group) in enumerate(zip(chunks.ends, chunks.groups)):
        if end > servable or (group in window_key and window_key[group] != i):
            continue
        source = next(name for name, mask in sources if mask >> i & 1)
        keys[source] = keys.get(source, 0) + 1
        if group == first_anchor:
            tokens[source] = tokens.get(source, 0) + end - previous_end
            previous_end = end
    return NodeCoverage(
        arena=prefix_tokens(chunks, lambda i: bool(arena >> i & 1)),
        disk=prefix_tokens(chunks, lambda i: bool(disk >> i & 1)),
        peer=prefix_tokens(chunks, lambda i: bool(others >> i & 1)),
        servable=servable,
        tokens_by_source=tokens,
        keys_by_source=keys,
    )


class RecentPrefixes:
    """The prompts a router just sent to each node, block by block, for a while.

    Why: an engine stores a prompt's chunks only once it has computed them, and the
    directory hears of them one sync later -- a second or more after the request was
    routed -- and only whole chunks: the tail of a prompt shorter than a chunk (a
    conversation's latest turn, typically) lives only in that engine's own prefix cache,
    which no directory sees. So the router notes the block hashes (vLLM's, every
    `tokens_per_hash` tokens) of each request it routed, under the node it went to, and
    reads them back two ways:
    - `masks`: for `pending_seconds`, the prompt's chunks count as in that node's arena
      (long enough for the engine to compute and store them and the directory to hear of
      it; after that the directory's word stands, evictions included);
    - `prefix_blocks`: for `recent_seconds`, how much of a prompt that node's engine just
      computed (the caller believes it only as far as the directory still shows the
      prefix's whole chunks there: a tail whose prefix was evicted is gone with it).

    Invariants: an entry is forgotten `recent_seconds` after it was last noted; at most
    `max_blocks` entries are kept, the oldest going first. Not thread-safe: the router's
    event loop only.
    """

    def __init__(
        self,
        pending_seconds: float = 5.0,
        recent_seconds: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        max_blocks: int = 200_000,
    ):
        self._pending = pending_seconds
        self._recent = max(recent_seconds, pending_seconds)
        self._clock = clock
        self._max = max_blocks
        self._noted: dict[tuple[str, bytes], float] = {}  # (node, block hash) -> when noted, oldest first

    def add(self, node_id: str, block_hashes: Iterable[bytes]) -> None:
        now = self._clock()
        for block in block_hashes:
            self._noted.pop((node_id, block), None)  # re-inserted: now the newest
            self._noted[(node_id, block)] = now
        self._expire(now)

    def masks(self, keys: Sequence[bytes]) -> dict[str, int]:
        """Holder (`<node>/CPU`) -> mask over `keys` of the chunks noted there within `pending_seconds`."""
        since = self._clock() - self._pending
        out: dict[str, int] = {}
        for node in {node for (node, _), noted in self._noted.items() if noted >= since}:
            mask = 0
            for bit, key in enumerate(keys):
                noted = self._noted.get((node, key_hash(key)))
                if noted is not None and noted >= since:
                    mask |= 1 << bit
            if mask:
                out[holder_label(node, CPU)] = mask
        return out

    def prefix_blocks(self, node_id: str, block_hashes: Sequence[bytes]) -> int:
        """How many of the prompt's first blocks were noted on `node_id` within `recent_seconds`, in a row."""
        since = self._clock() - self._recent
        count = 0
        for block in block_hashes:
            noted = self._noted.get((node_id, block))
            if noted is None or noted < since:
                break
            count += 1
        return count

    def _expire(self, now: float) -> None:
        while self._noted:
            oldest = next(iter(self._noted))
            if self._noted[oldest] >= now - self._recent and len(self._noted) <= self._max:
                break
            del self._noted[oldest]
