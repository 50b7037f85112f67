"""The slow-moving figures a router weighs replicas by, read from the node stores.

Each node store reports (`stats()["report"]`, the same report `kvstrata status` prints):
the layouts its engines registered (how they name chunks), what its disk, its peers and
the bucket delivered lately (`admission.estimates`), and each engine's measured prefill
rate (`engines[*].recompute_tokens_per_second`). A router reads them every few seconds,
in the background, never while it routes a request. The number of directory shards is
found the same way: by the names of the shards that exist.

Invariants: `node_figures` is pure (a report in, figures out); `read_cluster` never
raises: a store that does not answer within the timeout keeps its last figures (or none),
and is counted in `unreachable`.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvstrata.protocol import StoreClient
from kvstrata.routing.coverage import BUCKET, DISK, PEER
from kvstrata.routing.keys import KeyScheme
from kvstrata.tiers.estimates import Cost

logger = logging.getLogger(__name__)

MAX_SHARDS = 256  # ClusterConfig.directory_shards' bound
REPORTED_SOURCES = {"disk": DISK, "peer": PEER, "object": BUCKET}  # store estimate name -> source


@dataclass(frozen=True)
class NodeFigures:
    node_id: str
    schemes: dict[str, KeyScheme] = field(default_factory=dict)  # namespace -> how its engines name chunks
    models: dict[str, tuple[str, ...]] = field(default_factory=dict)  # namespace -> model names registered
    costs: dict[str, Cost] = field(default_factory=dict)  # source -> measured cost
    prefill_tokens_per_second: float | None = None  # median over the node's engines that measured one
    tenants: dict[str, str] = field(default_factory=dict)  # namespace -> its engines' namespace_prefix

    def namespaces(self, model: str | None, tenant: str | None = None) -> list[str]:
        """The namespaces of `model` on this node (every one when no model is named), of
        `tenant` (a `namespace_prefix`) only when one is named: a warm or a route-time
        prefetch lands in the tenant asked for, not in every tenant's copy of the model."""
        return [
            ns
            for ns in self.schemes
            if (model is None or any(names_model(model, m) for m in self.models.get(ns, ())))
            and (tenant is None or self.tenants.get(ns, "") == tenant)
        ]


def names_model(model: str, registered: str) -> bool:
    """Whether an engine that registered `registered` serves `model` (a Serve LLM
    `model_source`): the same string, or the local copy Serve downloaded a Hugging Face
    id to (`.../models--org--name/snapshots/<revision>`)."""
    return registered == model or f"models--{model.replace('/', '--')}/" in registered


def node_figures(node_id: str, stats: Mapping[str, Any]) -> NodeFigures:
    """Figures from one store's `stats()`; layouts it cannot read are left out (logged)."""
    schemes: dict[str, KeyScheme] = {}
    models: dict[str, tuple[str, ...]] = {}
    tenants: dict[str, str] = {}
    for namespace, layout in (stats.get("layouts") or {}).items():
        try:
            schemes[namespace] = KeyScheme.from_layout(namespace, layout)
        except ValueError as exc:
            logger.warning("%s", exc)
            continue
        models[namespace] = tuple(str(m) for m in layout.get("models", ()))
        tenants[namespace] = str(layout.get("namespace_prefix") or "")
    report = stats.get("report") or {}
    costs = {}
    for name, figures in ((report.get("admission") or {}).get("estimates") or {}).items():
        source = REPORTED_SOURCES.get(name)
        if source is not None and figures.get("bytes_per_second", 0) > 0:
            costs[source] = Cost(
                float(figures.get("latency_seconds", 0.0)),
                float(figures["bytes_per_second"]),
                float(figures.get("age_seconds", 0.0)),
            )
    rates = [
        float(engine["recompute_tokens_per_second"])
        for engine in (report.get("engines") or {}).values()
        if engine.get("recompute_tokens_per_second")
    ]
    return NodeFigures(node_id, schemes, models, costs, statistics.median(rates) if rates else None, tenants)


@dataclass
class ClusterFigures:
    """What the router knows of the cluster; replaced whole by each refresh."""

    nodes: dict[str, NodeFigures] = field(default_factory=dict)
    shards: list[Any] = field(default_factory=list)  # directory shard handles, by shard number
    unreachable: int = 0  # stores that did not answer the last refresh

    def costs(self, node_id: str, defaults: Mapping[str, Cost]) -> dict[str, Cost]:
        """Each source's cost on a node: its own measurement; else the median of what the
        other nodes measured (a node that never fetched from a peer yet is no faster at it
        than the others); else `defaults`."""
        own = self.nodes.get(node_id)
        out = dict(defaults)
        for source in defaults:
            if own is not None and source in own.costs:
                out[source] = own.costs[source]
                continue
            seen = sorted((n.costs[source] for n in self.nodes.values() if source in n.costs), key=lambda c: c.bytes_per_second)
            if seen:
                out[source] = seen[len(seen) // 2]
        return out

    def prefill_rate(self, node_id: str, default: float) -> float:
        """The node's measured prefill rate; else the median of the nodes that measured one; else `default`."""
        own = self.nodes.get(node_id)
        if own is not None and own.prefill_tokens_per_second:
            return own.prefill_tokens_per_second
        known = [n.prefill_tokens_per_second for n in self.nodes.values() if n.prefill_tokens_per_second]
        return statistics.median(known) if known else default


def _store(node_id: str) -> StoreClient:
    from kvstrata.actors.client import store_client

    return store_client(node_id)


def directory_shards() -> list[Any]:
    """Handles of the directory shards that exist (blocking: a few name look-ups)."""
    import ray

    from kvstrata.actors.directory import directory_actor_name
    from kvstrata.actors.options import STORE_NAMESPACE

    shards = []
    for shard in range(MAX_SHARDS):
        try:
            shards.append(ray.get_actor(directory_actor_name(shard), namespace=STORE_NAMESPACE))
        except ValueError:
            break
    return shards


async def read_cluster(node_ids: Iterable[str], previous: ClusterFigures, timeout_s: float) -> ClusterFigures:
    """Every node's figures and the directory's shards, read concurrently."""
    node_ids = sorted(set(node_ids))

    async def one(node_id: str) -> NodeFigures | None:
        try:
            store = await asyncio.to_thread(_store, node_id)
            stats = await asyncio.wait_for(store.stats_async(), timeout_s)
            return node_figures(node_id, stats)
        except Exception as exc:  # noqa: BLE001 - no store there (yet), or a busy one
            logger.debug("kvstrata router: node %s store unreadable (%s)", node_id[:12], type(exc).__name__)
            return None

    answers = await asyncio.gather(*(one(node_id) for node_id in node_ids))
    try:
        shards = await asyncio.to_thread(directory_shards)
    except Exception:  # noqa: BLE001 - Ray not reachable: keep what we had
        shards = previous.shards
    nodes: dict[str, NodeFigures] = {}
    for node_id, figures in zip(node_ids, answers):
        kept = figures or previous.nodes.get(node_id)
        if kept is not None:
            nodes[node_id] = kept
    return ClusterFigures(nodes, shards, sum(figures is None for figures in answers))
