"""Prometheus metrics of the node stores and the directory, exported through Ray.

Ray serves every `ray.util.metrics` metric on each node's metrics export port next to its
own, with the prefix `ray_` (a Counter named `kvstrata_x` is scraped as
`ray_kvstrata_x_total`), so the scrape config a Ray user already has picks these up. The
store does not count into Ray on its hot paths: an exporter thread turns the store's
report (kvstrata/store/report.py) into samples every `EXPORT_SECONDS`, sets the gauges and adds
each counter's growth since the last export.

Names do not collide with the engines' metrics: under Ray Serve LLM vLLM exports its
`kvstrata:*` metrics through Ray with `:` turned into `_` (hence `kvstrata_store_pinned_chunks`,
not `kvstrata_pinned_chunks`).

Labels: `node` (the Ray node id) on every store metric, `tier` (cpu, disk, object, peer)
or `source` where the metric is per tier, `namespace` only on chunks per tier and
namespace, capped at `MAX_NAMESPACE_LABELS` namespaces per store (the rest are summed
under `other`), so cardinality is bounded by nodes x tiers x a few. The tier estimates
also carry `tier="peer:<node id>"`, one per other node measured lately (nodes x nodes).

`METRICS` is the one list of names: the exporter declares exactly these, and the test of
the Grafana dashboard (examples/grafana/kvstrata.json) checks every name it queries
against it.

Invariants: a counter's exported value never decreases (a store restart is a new process
and a new series); `metric_samples` is pure, so what is exported is tested without Ray.
Must not: call into the store other than through the `report` callable it is given.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

from kvstrata.tiers.estimates import peer_tier

logger = logging.getLogger(__name__)

EXPORT_SECONDS = 5.0
MAX_NAMESPACE_LABELS = 16
RAY_PREFIX = "ray_"  # what Ray puts before every application metric it serves


@dataclass(frozen=True)
class MetricSpec:
    kind: Literal["counter", "gauge"]
    description: str
    tags: tuple[str, ...]

    def prometheus_name(self, name: str) -> str:
        """The name Prometheus scrapes from Ray's metrics port."""
        return f"{RAY_PREFIX}{name}" + ("_total" if self.kind == "counter" else "")


_NODE_TIER = ("node", "tier")
METRICS: dict[str, MetricSpec] = {
    "kvstrata_tier_capacity_bytes": MetricSpec("gauge", "Bytes the tier may hold on this node (0: unbounded).", _NODE_TIER),
    "kvstrata_tier_used_bytes": MetricSpec(
        "gauge", "Bytes of chunks the tier holds (object: this node's view of the shared bucket).", _NODE_TIER
    ),
    "kvstrata_tier_chunks": MetricSpec("gauge", "Chunks the tier holds, per namespace.", ("node", "tier", "namespace")),
    "kvstrata_tier_up": MetricSpec(
        "gauge", "1 if a configured tier is on and answering, 0 if it failed or is paused (absent: not configured).", _NODE_TIER
    ),
    "kvstrata_tier_hits": MetricSpec("counter", "Chunks served to engines, by the tier they came from.", _NODE_TIER),
    "kvstrata_tier_misses": MetricSpec(
        "counter", "Chunks asked for that no tier had (cpu), or failed promotions from a tier.", _NODE_TIER
    ),
    "kvstrata_tier_read_bytes": MetricSpec("counter", "Bytes read out of the tier towards engines.", _NODE_TIER),
    "kvstrata_tier_write_bytes": MetricSpec("counter", "Bytes written into the tier.", _NODE_TIER),
    "kvstrata_tier_read_seconds": MetricSpec("counter", "Seconds spent in the tier's read batches.", _NODE_TIER),
    "kvstrata_tier_write_seconds": MetricSpec("counter", "Seconds spent in the tier's write batches.", _NODE_TIER),
    "kvstrata_tier_evicted": MetricSpec("counter", "Chunks evicted (or expired) from the tier.", _NODE_TIER),
    "kvstrata_tier_dropped": MetricSpec("counter", "Copies given up so engines never wait (full queues, paused tier).", _NODE_TIER),
    "kvstrata_tier_failed": MetricSpec("counter", "I/O errors of the tier.", _NODE_TIER),
    "kvstrata_tier_corrupt": MetricSpec(
        "counter", "Chunks that failed their checksum in the tier (disk: also headers unreadable at start-up).", _NODE_TIER
    ),
    "kvstrata_tier_set_aside_files": MetricSpec(
        "counter", "Files the disk tier found unusable at start-up and moved to its damaged/ directory.", _NODE_TIER
    ),
    "kvstrata_purges_refused": MetricSpec(
        "counter", "Purges refused: the engine named a namespace it did not register with this store.", ("node",)
    ),
    "kvstrata_promotions": MetricSpec("counter", "Chunks promoted into the arena, by source tier.", ("node", "source")),
    "kvstrata_object_requests": MetricSpec(
        "counter", "Object-store chunk requests by operation and outcome.", ("node", "op", "outcome")
    ),
    "kvstrata_object_backoffs": MetricSpec("counter", "Failures that paused the object tier (its retry back-off).", ("node",)),
    "kvstrata_object_throttles": MetricSpec("counter", "Object-store answers saying slow down (503 SlowDown, 429).", ("node",)),
    "kvstrata_peer_fetches": MetricSpec("counter", "Fetch calls to other nodes' stores.", ("node",)),
    "kvstrata_peer_fetch_bytes": MetricSpec("counter", "Bytes fetched from other nodes' stores.", ("node",)),
    "kvstrata_admission_writes_skipped": MetricSpec(
        "counter", "Copies to a lower tier not made as the chunk was not reused (admission.store: reuse).", _NODE_TIER
    ),
    "kvstrata_tier_estimate_bytes_per_second": MetricSpec(
        "gauge", "What the tier's promotions delivered lately, bytes/s (admission.load weighs it).", _NODE_TIER
    ),
    "kvstrata_tier_estimate_latency_seconds": MetricSpec(
        "gauge", "The tier's fixed cost per promotion batch lately, seconds (admission.load weighs it).", _NODE_TIER
    ),
    "kvstrata_leases_held": MetricSpec("gauge", "Engines holding a lease on this node's store.", ("node",)),
    "kvstrata_store_pinned_chunks": MetricSpec("gauge", "Arena chunks pinned by engines on this node.", ("node",)),
    "kvstrata_directory_entries": MetricSpec(
        "gauge", "Chunk locations a directory shard holds, per namespace.", ("shard", "namespace")
    ),
}

Sample = tuple[str, dict[str, str], float]
_PER_TIER = {
    "capacity": "kvstrata_tier_capacity_bytes",
    "used": "kvstrata_tier_used_bytes",
    "hits": "kvstrata_tier_hits",
    "misses": "kvstrata_tier_misses",
    "read_bytes": "kvstrata_tier_read_bytes",
    "write_bytes": "kvstrata_tier_write_bytes",
    "read_seconds": "kvstrata_tier_read_seconds",
    "write_seconds": "kvstrata_tier_write_seconds",
    "evicted": "kvstrata_tier_evicted",
    "dropped": "kvstrata_tier_dropped",
    "failed": "kvstrata_tier_failed",
    "corrupt": "kvstrata_tier_corrupt",
    "set_aside": "kvstrata_tier_set_aside_files",
}


def metric_samples(stats: dict[str, Any]) -> list[Sample]:
    """Samples of one store's `stats()` (with its `report`): (metric, labels, value)."""
    report = stats["report"]
    node = str(report["node_id"])
    samples: list[Sample] = []
    for tier, fields in report["tiers"].items():
        if fields["state"] == "off":
            continue  # not configured: no series at all, so "down" always means failed or paused
        labels = {"node": node, "tier": tier}
        samples.append(("kvstrata_tier_up", labels, float(fields["state"] == "on")))
        for field, metric in _PER_TIER.items():
            if field in fields:
                samples.append((metric, labels, float(fields[field] or 0)))
        if tier != "cpu":
            samples.append(("kvstrata_promotions", {"node": node, "source": tier}, float(fields.get("hits", 0))))
    samples.extend(_namespace_samples(node, report["namespaces"]))
    samples.extend(_admission_samples(node, report.get("admission")))
    engines = report["engines"].values()
    samples.append(("kvstrata_leases_held", {"node": node}, float(len(report["engines"]))))
    samples.append(("kvstrata_purges_refused", {"node": node}, float(report.get("purges_refused", 0))))
    samples.append(("kvstrata_store_pinned_chunks", {"node": node}, float(sum(engine["pinned"] for engine in engines))))
    samples.extend(_object_samples(node, stats.get("object")))
    peers = stats.get("peers")
    if peers:
        samples.append(("kvstrata_peer_fetches", {"node": node}, float(peers.get("fetch_calls", 0))))
        samples.append(("kvstrata_peer_fetch_bytes", {"node": node}, float(peers.get("bytes_fetched", 0))))
    return samples


def _admission_samples(node: str, admission: dict[str, Any] | None) -> Iterator[Sample]:
    if not admission:
        return
    for tier, counter in (("disk", "disk_writes_skipped_reuse"), ("object", "object_uploads_skipped_reuse")):
        yield ("kvstrata_admission_writes_skipped", {"node": node, "tier": tier}, float(admission.get(counter, 0)))
    # Per peer: tier `peer:<its node id>`, so at most one series per other node.
    estimates = dict(admission.get("estimates", {}))
    estimates.update((peer_tier(peer), cost) for peer, cost in admission.get("peer_estimates", {}).items())
    for tier, cost in estimates.items():
        labels = {"node": node, "tier": tier}
        yield ("kvstrata_tier_estimate_bytes_per_second", labels, float(cost["bytes_per_second"]))
        yield ("kvstrata_tier_estimate_latency_seconds", labels, float(cost["latency_seconds"]))


def directory_samples(stats: dict[str, Any]) -> list[Sample]:
    """Samples of one directory shard's `stats()`."""
    shard = str(stats["shard"])
    return [
        ("kvstrata_directory_entries", {"shard": shard, "namespace": namespace}, float(count))
        for namespace, count in _capped(stats["namespaces"]).items()
    ]


def _namespace_samples(node: str, namespaces: dict[str, dict[str, Any]]) -> Iterator[Sample]:
    per_tier: dict[str, dict[str, int]] = {}
    for namespace, info in namespaces.items():
        for tier, count in info["chunks"].items():
            per_tier.setdefault(tier, {})[namespace] = count
    for tier, counts in per_tier.items():
        for namespace, count in _capped(counts).items():
            yield "kvstrata_tier_chunks", {"node": node, "tier": tier, "namespace": namespace}, float(count)


def _object_samples(node: str, stats: dict[str, Any] | None) -> Iterator[Sample]:
    if not stats:
        return
    outcomes = {
        ("put", "ok"): stats["puts"],
        ("put", "failed"): stats["put_failures"],
        ("get", "ok"): stats["gets"],
        ("get", "failed"): stats["get_failures"],
        ("get", "not_found"): stats["not_found"],
        ("get", "corrupt"): stats["corrupt_chunks"],
        ("any", "skipped_while_paused"): stats["skipped_while_paused"],
    }
    for (op, outcome), count in outcomes.items():
        yield "kvstrata_object_requests", {"node": node, "op": op, "outcome": outcome}, float(count)
    yield "kvstrata_object_backoffs", {"node": node}, float(stats["backoffs"])
    yield "kvstrata_object_throttles", {"node": node}, float(stats["throttled"])


def _capped(counts: dict[str, int]) -> dict[str, int]:
    """The largest `MAX_NAMESPACE_LABELS` namespaces by count; the rest summed as `other`."""
    if len(counts) <= MAX_NAMESPACE_LABELS:
        return counts
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    kept = dict(ranked[: MAX_NAMESPACE_LABELS - 1])
    kept["other"] = sum(count for _, count in ranked[MAX_NAMESPACE_LABELS - 1 :])
    return kept


class MetricsExporter:
    """A daemon thread that exports `samples()` into Ray's metrics every `period` seconds.

    Owned by the store (or directory shard) that starts it; `close` stops it and waits.
    Gauges are set; counters grow by the difference from the value last exported for the
    same labels (never by a negative amount).
    """

    def __init__(self, samples: Callable[[], list[Sample]], period: float = EXPORT_SECONDS, name: str = "kvstrata-metrics"):
        from ray.util import metrics

        self._samples = samples
        self._period = period
        self._metrics: dict[str, Any] = {}
        for metric, spec in METRICS.items():
            cls = metrics.Counter if spec.kind == "counter" else metrics.Gauge
            self._metrics[metric] = cls(metric, description=spec.description, tag_keys=spec.tags)
        self._exported: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> MetricsExporter:
        self._thread.start()
        return self

    def export_once(self) -> None:
        for metric, labels, value in self._samples():
            if METRICS[metric].kind == "gauge":
                self._metrics[metric].set(value, tags=labels)
                continue
            key = (metric, tuple(sorted(labels.items())))
            grown = value - self._exported.get(key, 0.0)
            if grown > 0:
                self._metrics[metric].inc(grown, tags=labels)
                self._exported[key] = value

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self._period)

    def _run(self) -> None:
        while True:
            try:
                self.export_once()
            except Exception:  # noqa: BLE001 - metrics must never take the store down
                logger.exception("kvstrata metrics: export failed")
            if self._stop.wait(self._period):
                return
