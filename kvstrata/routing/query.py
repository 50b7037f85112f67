"""Any router can ask: where a prompt's KV lives, in the shape of Mooncake's indexer API
(RFC kvcache-ai/Mooncake#1403, `POST /query` and `POST /query_by_hash`), answered from
kvstrata's cluster directory, as Dynamo's standalone indexer (`python -m dynamo.indexer`)
answers it from vLLM's KV events.

Request (JSON), as the RFC and Dynamo's indexer take it:

    {"model": "...", "token_ids": [...], "block_size": 16,            # /query
     "lora_name": null, "cache_salt": null, "tenant_id": "default", "instance_id": null}
    {"model": "...", "block_hashes": ["<hex>", ...], "block_size": 16}  # /query_by_hash
     (also `seq_hashes`, `block_hash`)

`block_size` is optional here (the engines registered theirs) and, when given, must be
the engines' tokens per block hash. By hash, the hashes are vLLM's block hashes of the
engines (what vLLM's `BlockStored` events carry, hex), not Mooncake's XXH3-64 sequence
hashes: kvstrata names chunks by vLLM's hashes and cannot translate.

Reply, per tenant, per instance (a node's engines: kvstrata's tiers are per node, every
engine on it reads them alike), prefix tokens a lookup there would find, cumulative as
Dynamo defines them (each tier adds to the ones before it, in the order the node store
promotes from):

    {"default": {"<instance>": {"longest_matched": 768, "GPU": 0, "CPU": 512, "DISK": 768,
                                "REMOTE": 768, "OBJECT": 768, "DP": {"0": 768}}}}

`CPU`: the node's arena alone; `DISK`: its arena and disk; `REMOTE`: and other nodes'
stores (a peer fetch); `OBJECT`: and the shared bucket; `longest_matched`: the longest
of them. `GPU` is 0: vLLM's own prefix cache is not in the directory (Dynamo's indexer
has it from the engines' KV events; combine the two). With `"format": "dynamo"` the same
figures come as Dynamo's `{"instances": {"<instance>": {"longest_matched", "gpu", "cpu",
"disk", "dp"}}}` (its `disk` is kvstrata's `OBJECT`: everything below host memory).

Invariants: answers only from the directory and the node stores' registered layouts (no
store is asked about a chunk); bad input is a `QueryError` naming the field; a directory
that does not answer within the timeout is `QueryUnavailable`, never a partial answer.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvstrata.routing.coverage import node_masks, prefix_tokens
from kvstrata.routing.figures import ClusterFigures
from kvstrata.routing.keys import Hasher, KeyScheme, PromptChunks, block_hashes, prompt_chunks
from kvstrata.routing.lookup import DirectoryUnavailable, directory_coverage

HASH_FIELDS = ("block_hashes", "seq_hashes", "block_hash")
FORMATS = ("mooncake", "dynamo")
_HEX = re.compile(r"^(0x)?[0-9a-fA-F]+$")


class QueryError(ValueError):
    """A request the API cannot answer; `field` names what is wrong (HTTP 400)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class QueryUnavailable(RuntimeError):
    """The directory did not answer (HTTP 503): no partial answer is given."""


@dataclass(frozen=True)
class Query:
    model: str
    token_ids: tuple[int, ...] | None = None
    block_hashes: tuple[bytes, ...] | None = None
    block_size: int | None = None
    lora_name: str | None = None
    cache_salt: str | None = None
    tenant_id: str = "default"
    instance_id: str | None = None
    format: str = "mooncake"


def parse_query(body: Any, by_hash: bool = False) -> Query:
    """A request body (decoded JSON) -> `Query`; `by_hash`: the `/query_by_hash` form."""
    if not isinstance(body, Mapping):
        raise QueryError("body", "must be a JSON object")
    model = body.get("model", body.get("model_name"))
    if not isinstance(model, str) or not model:
        raise QueryError("model", "required: the model as the engines name it")
    token_ids = hashes = None
    if by_hash:
        field = next((f for f in HASH_FIELDS if f in body), None)
        if field is None:
            raise QueryError("block_hashes", "required for /query_by_hash (vLLM block hashes, hex)")
        raw = body[field]
        if not isinstance(raw, list) or not all(isinstance(h, str) and _HEX.match(h) for h in raw):
            raise QueryError(field, "must be a list of vLLM block hashes as hex strings "
                                    "(Mooncake's XXH3-64 sequence hashes are not kvstrata's chunk names)")  # fmt: skip
        hashes = tuple(bytes.fromhex(h[2:] if h.startswith("0x") else h) for h in raw)
    else:
        raw = body.get("token_ids")
        if not isinstance(raw, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in raw):
            raise QueryError("token_ids", "required: a list of non-negative integer token ids")
        token_ids = tuple(raw)
    block_size = body.get("block_size")
    if block_size is not None and (not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0):
        raise QueryError("block_size", f"must be a positive integer, not {block_size!r}")
    fmt = body.get("format", "mooncake")
    if fmt not in FORMATS:
        raise QueryError("format", f"one of {', '.join(FORMATS)}, not {fmt!r}")
    optional = {}
    for field in ("lora_name", "cache_salt", "tenant_id", "instance_id"):
        value = body.get(field)
        if value is not None and not isinstance(value, str):
            raise QueryError(field, f"must be a string, not {type(value).__name__}")
        optional[field] = value or None
    return Query(
        model=model,
        token_ids=token_ids,
        block_hashes=hashes,
        block_size=block_size,
        lora_name=optional["lora_name"],
        cache_salt=optional["cache_salt"],
        tenant_id=optional["tenant_id"] or "default",
        instance_id=optional["instance_id"],
        format=fmt,
    )


@dataclass(frozen=True)
class TierPrefixes:
    """One node's cumulative prefix tokens: arena, + disk, + peers, + bucket."""

    cpu: int = 0
    disk: int = 0
    remote: int = 0
    object: int = 0

    def best(self, other: "TierPrefixes") -> "TierPrefixes":
        return self if (self.object, self.disk, self.cpu) >= (other.object, other.disk, other.cpu) else other


def _namespace_prefixes(chunks: PromptChunks, masks: Mapping[str, int], nodes: Sequence[str]) -> dict[str, TierPrefixes]:
    held, bucket = node_masks(masks)
    everyone = 0
    for arena, disk in held.values():
        everyone |= arena | disk
    out = {}
    for node_id in nodes:
        arena, disk = held.get(node_id, (0, 0))
        others = 0
        for other, (a, d) in held.items():
            if other != node_id:
                others |= a | d
        steps, mask = [], 0
        for tier_mask in (arena, disk, others, bucket):
            mask |= tier_mask
            steps.append(prefix_tokens(chunks, lambda i, m=mask: bool(m >> i & 1)))
        out[node_id] = TierPrefixes(*steps)
    return out


async def answer_query(
    query: Query,
    figures: ClusterFigures,
    instances: Mapping[str, Sequence[str]] | None = None,
    lora_paths: Mapping[str, str] | None = None,
    hash_seed: str | None = None,
    timeout_s: float = 1.0,
    hasher: Hasher = block_hashes,
) -> dict[str, Any]:
    """The reply to `query` (see the module's docstring). `instances`: node id -> the
    instance ids its engines are known by (default: the node id itself)."""
    lora = None
    if query.lora_name:
        path = (lora_paths or {}).get(query.lora_name)
        if path is None:
            raise QueryError("lora_name", f"unknown adapter {query.lora_name!r} (vLLM hashes the path it was loaded from)")
        lora = (query.lora_name, path)
    schemes: dict[str, KeyScheme] = {}
    nodes_of: dict[str, list[str]] = {}
    for node_id, node in figures.nodes.items():
        for namespace in node.namespaces(query.model):
            schemes.setdefault(namespace, node.schemes[namespace])
            nodes_of.setdefault(namespace, []).append(node_id)
    if query.block_size is not None:
        sizes = sorted({s.tokens_per_hash for s in schemes.values()})
        schemes = {ns: s for ns, s in schemes.items() if s.tokens_per_hash == query.block_size}
        if sizes and not schemes:
            raise QueryError("block_size", f"the engines of {query.model} hash every {sizes} tokens, not {query.block_size}")
    chunks: dict[str, PromptChunks] = {}
    hashed: dict[tuple[int, str], list[bytes]] = {}
    for namespace, scheme in schemes.items():
        if query.block_hashes is not None:
            hashes = list(query.block_hashes)
        elif scheme.hashing not in hashed:
            try:
                hashed[scheme.hashing] = hasher(
                    list(query.token_ids or ()), scheme.tokens_per_hash, scheme.hash_algo, hash_seed, lora, query.cache_salt
                )
            except ValueError as exc:
                raise QueryError("token_ids", f"the engines' block hashes cannot be reproduced here: {exc}") from None
            hashes = hashed[scheme.hashing]
        else:
            hashes = hashed[scheme.hashing]
        # Whole blocks only, every one counted (an indexer answers where a prefix is, not
        # what one engine's lookup of this exact prompt would skip).
        chunks[namespace] = prompt_chunks(scheme, hashes, len(hashes) * scheme.tokens_per_hash + 1)
    per_node: dict[str, TierPrefixes] = {}
    if chunks:
        try:
            masks = await directory_coverage(figures.shards, {ns: c.keys for ns, c in chunks.items()}, timeout_s)
        except DirectoryUnavailable as exc:
            raise QueryUnavailable(str(exc)) from None
        for namespace, namespace_chunks in chunks.items():
            for node_id, prefixes in _namespace_prefixes(namespace_chunks, masks[namespace], nodes_of[namespace]).items():
                per_node[node_id] = prefixes.best(per_node.get(node_id, TierPrefixes()))
    return _reply(query, per_node, instances)


def _reply(query: Query, per_node: Mapping[str, TierPrefixes], instances: Mapping[str, Sequence[str]] | None) -> dict:
    entries: dict[str, dict[str, Any]] = {}
    for node_id in sorted(per_node):
        tiers = per_node[node_id]
        longest = max(tiers.cpu, tiers.disk, tiers.remote, tiers.object)
        for instance in (instances or {}).get(node_id, (node_id,)):
            if query.instance_id is not None and instance != query.instance_id:
                continue
            if query.format == "dynamo":
                entries[instance] = {"longest_matched": longest, "gpu": 0, "cpu": tiers.cpu, "disk": tiers.object,
                                     "dp": {"0": longest}}  # fmt: skip
            else:
                entries[instance] = {"longest_matched": longest, "GPU": 0, "CPU": tiers.cpu, "DISK": tiers.disk,
                                     "REMOTE": tiers.remote, "OBJECT": tiers.object, "DP": {"0": longest}}  # fmt: skip
    if query.format == "dynamo":
        return {"instances": entries}
    return {query.tenant_id: entries}


FiguresSource = Callable[[], ClusterFigures]
