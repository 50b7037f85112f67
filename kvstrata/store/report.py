"""One node store's state as an operator reads it: per tier, per namespace, per engine.

`kvstrata status` prints it as tables, the metrics exporter (store_metrics.py) turns it
into Prometheus samples, and `NodeStore.stats()` carries it under `report` beside the
raw counters (`--json`). One builder, so the table, the dashboard and the JSON never
disagree about what "hits" or "used" means.

Every tier has the same fields (`TierReport`), so a table and a dashboard can compare
them:
- `hits`: chunks this tier served to engines, each counted once, by the tier it came
  from. The arena's are the chunks engines pinned minus those a promotion had just
  brought; disk, object and peer hits are their promotions into the arena.
- `misses`: the arena's are chunks engines asked for that no tier could bring
  (`pins_missing`); a lower tier's are its promotions that failed (absent, corrupt,
  unreachable).
- `read_*` / `write_*`: out of the tier towards engines / into it (io_meter.py); the
  arena's bytes are what engines loaded and stored (their workers copy, so no seconds).
- `dropped`: copies given up to keep engines from waiting (full queues, a paused or
  non-admitting tier; for the arena, slots engines asked to store into and did not get).
  `failed`: I/O errors. `corrupt`: chunks that failed their checksum.
- `state`: `on`, `off` (not configured), or `error`/`paused` with `reason`.

`store` is a `NodeStore` (node_store.py), read through its public fields and its context.
Must not: change the store (it only reads, under the store lock) or import a part of it.
"""

from __future__ import annotations

from typing import Any, TypedDict

from kvstrata.store.io_meter import DIRECTIONS
from kvstrata.store.context import PROMOTION_SOURCES
from kvstrata.tiers.changelog import OBJECT
from kvstrata.tiers.estimates import peer_node


class TierReport(TypedDict, total=False):
    state: str  # on | off | error | paused
    reason: str  # why a tier is not `on`
    capacity: int | None  # bytes; None where the tier has no bound (an object store without `capacity`)
    used: int  # bytes
    chunks: int
    hits: int
    misses: int
    evicted: int
    dropped: int
    failed: int
    corrupt: int
    read_bytes: int
    write_bytes: int
    read_seconds: float
    write_seconds: float
    read_bytes_per_second: float  # over the last minute
    write_bytes_per_second: float


def store_report(store: Any, disk_stats: dict[str, Any] | None) -> dict[str, Any]:
    """The report of one store (call it under the store's lock); `disk_stats`: the disk
    tier's `stats()` as the caller already took them (None without a disk tier)."""
    counters = store.counters
    pools = store.arena.pools
    promoted = sum(counters[f"{source}_promotions"] for source in PROMOTION_SOURCES)
    cpu_counters = _sum_counters(pool.counters for pool in pools.values())
    tiers: dict[str, TierReport] = {
        "cpu": {
            "state": "on",
            "capacity": store.arena.capacity,
            "used": sum(len(pool) * pool.geometry.slot_bytes for pool in pools.values()),
            "chunks": sum(len(pool) for pool in pools.values()),
            "hits": max(0, counters["engine_pins"] - promoted),
            "misses": counters["pins_missing"],
            "evicted": cpu_counters.get("evicted", 0),
            "dropped": cpu_counters.get("reserve_shortfall", 0),
            "failed": cpu_counters.get("grow_failures", 0) + cpu_counters.get("holds_refused", 0),
            "corrupt": 0,
        },
        "disk": _disk_report(store, disk_stats),
        "object": _object_report(store),
        "peer": _peer_report(store),
    }
    for name, tier in tiers.items():
        if tier["state"] in ("on", "paused"):
            tier.update(_io(store, name))
    return {
        "node_id": store.node_id,
        "tiers": tiers,
        "namespaces": _namespaces(store, disk_stats["resident"] if disk_stats else {}),
        "engines": _engines(store),
        "tenants": _tenants(store, disk_stats),
        "admission": _admission(store),
        "purges_refused": store.counters.get("purges_refused", 0),  # another engine's namespace named
        # What this store found of stores that died without cleaning up (kvstrata.tiers.orphans).
        "reclaimed": {
            "shm_files": len(store.arena.reclaimed.files),
            "shm_bytes": store.arena.reclaimed.bytes,
            "disk_locks_taken_over": disk_stats.get("lock_taken_over", 0) if disk_stats else 0,
        },
    }


def _admission(store: Any) -> dict[str, Any]:
    """Cost-based admission (docs/admission.md): copies skipped as unlikely to be reused,
    per tier; what each lower tier delivered lately (`estimates`: disk, object, peer, the
    figures engines weigh loads by); and what each other node delivered lately
    (`peer_estimates`, by node id: the store picks among a chunk's holders by them)."""
    counters = store.counters
    estimates = getattr(store, "tier_estimates", None)
    costs = estimates.costs() if estimates is not None else {}
    tiers: dict[str, Any] = {}
    peers: dict[str, Any] = {}
    for tier, cost in costs.items():
        node = peer_node(tier)
        figures = {
            "latency_seconds": cost.latency_seconds,
            "bytes_per_second": cost.bytes_per_second,
            "age_seconds": cost.age_seconds,
        }
        if node is None:
            tiers[tier] = figures
        else:
            peers[node] = figures
    return {
        "disk_writes_skipped_reuse": counters.get("disk_writes_skipped_reuse", 0),
        "object_uploads_skipped_reuse": counters.get("object_uploads_skipped_reuse", 0),
        "estimates": tiers,
        "peer_estimates": dict(sorted(peers.items())),
    }


def _disk_report(store: Any, stats: dict[str, Any] | None) -> TierReport:
    if stats is None:
        if store.disk_error:
            return {"state": "error", "reason": store.disk_error}
        return {"state": "off"}
    counters = store.counters
    return {
        "state": "on" if stats["admitting"] else "paused",
        **({} if stats["admitting"] else {"reason": "not admitting writes (disk full or failing)"}),
        "capacity": stats["capacity"],
        "used": stats["stored_bytes"],
        "chunks": sum(stats["resident"].values()),
        "hits": counters["disk_promotions"],
        "misses": counters["disk_promotion_failures"],
        "evicted": stats["evicted"],
        "dropped": counters["disk_writes_dropped"] + stats["dropped_not_admitting"],
        "failed": stats["write_errors"] + stats["read_errors"],
        # Records whose checksum failed on read, and headers found unreadable at start-up.
        "corrupt": stats["corrupt_chunks"] + stats.get("damaged_records", 0),
        "set_aside": stats.get("damaged_files", 0),  # files moved to damaged/ at start-up
    }


def _object_report(store: Any) -> TierReport:
    if store.object is None:
        return {"state": "off"}
    stats = store.object.stats()
    counters = store.counters
    chunks = used = 0
    for namespace, log in store.ctx.logs.items():
        count = log.count(OBJECT)
        chunks += count
        pool = store.arena.pools.get(namespace)
        used += count * pool.geometry.slot_bytes if pool is not None else 0
    report: TierReport = {
        "state": "on" if stats["available"] else "paused",
        "capacity": store.config.tiers.object.capacity,
        "used": used,
        "chunks": chunks,
        "hits": counters["object_promotions"],
        "misses": counters["object_promotion_failures"],
        "evicted": stats["evicted"] + stats["expired"] + stats.get("evicted_over_quota", 0),
        "dropped": counters["object_uploads_dropped"] + stats["skipped_while_paused"],
        "failed": stats["put_failures"] + stats["get_failures"],
        "corrupt": stats["corrupt_chunks"],
    }
    if not stats["available"] or stats["last_error"]:
        report["reason"] = str(stats["last_error"])
    return report


def _peer_report(store: Any) -> TierReport:
    if store.peers is None:
        return {"state": "off"}
    stats = {"directory_reachable": True, "peer_chunks": 0, "fetch_failures": 0, "sync_failures": 0,
             "corrupt_transfers": 0, **store.peers.stats()}  # fmt: skip (test doubles report fewer)
    counters = store.counters
    report: TierReport = {
        "state": "on" if stats["directory_reachable"] else "error",
        "capacity": None,
        "used": 0,
        "chunks": stats["peer_chunks"],
        "hits": counters["peer_promotions"],
        "misses": counters["peer_promotion_failures"],
        "evicted": 0,
        "dropped": 0,
        "failed": stats["fetch_failures"] + stats["sync_failures"],
        "corrupt": stats["corrupt_transfers"],
    }
    if not stats["directory_reachable"]:
        report["reason"] = "cluster directory unreachable"
    return report


def _io(store: Any, tier: str) -> TierReport:
    report: TierReport = {}
    for direction in DIRECTIONS:
        totals = store.io_meter.totals(tier, direction)
        report[f"{direction}_bytes"] = totals.bytes
        report[f"{direction}_seconds"] = round(totals.seconds, 6)
        report[f"{direction}_bytes_per_second"] = store.io_meter.rate(tier, direction)
    return report


def _namespaces(store: Any, disk_resident: dict[str, int]) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}
    for namespace in sorted(set(store.layouts) | set(store.arena.pools) | set(disk_resident)):
        pool = store.arena.pools.get(namespace)
        log = store.ctx.logs.get(namespace)
        found[namespace] = {
            "models": list(store.layouts.get(namespace, {}).get("models", [])),
            "chunks": {
                "cpu": len(pool) if pool is not None else 0,
                "disk": disk_resident.get(namespace, 0),
                "object": log.count(OBJECT) if log is not None and store.object is not None else 0,
            },
        }
    return found


def _tenants(store: Any, disk_stats: dict[str, Any] | None) -> dict[str, dict[str, dict[str, int | None]]]:
    """Per tenant (`namespace_prefix`) and tier: `used`, the bytes counted against its quota
    (arena: its pools' segments; disk: its slabs' records; object: its objects as of the
    last sweep plus this node's uploads since), and `quota` (None: none in that tier)."""
    per_tier = {
        "cpu": store.arena.quotas.usage(),
        "disk": (disk_stats or {}).get("tenants", {}),
        "object": store.object.quotas.usage() if store.object is not None else {},
    }
    tenants: dict[str, dict[str, dict[str, int | None]]] = {}
    for tier, usage in per_tier.items():
        for tenant, figures in usage.items():
            tenants.setdefault(tenant, {})[tier] = figures
    return dict(sorted(tenants.items()))


def _engines(store: Any) -> dict[str, dict[str, Any]]:
    """Engines with a live lease: seconds left on it, chunks they pin, slots they reserved,
    and the prefill rate `admission.load` weighs loads against (None: not known yet)."""
    engines: dict[str, dict[str, Any]] = {}
    for holder, seconds_left in store.arena.leases.remaining().items():
        pinned = reserved = 0
        for pool in store.arena.pools.values():
            holding = pool.holdings(holder)
            pinned += holding[0]
            reserved += holding[1]
        engines[holder] = {
            "lease_seconds_left": round(seconds_left, 1),
            "pinned": pinned,
            "reserved": reserved,
            "recompute_tokens_per_second": store.ctx.recompute_rates.get(holder),
        }
    return engines


def _sum_counters(counter_dicts: Any) -> dict[str, int]:
    total: dict[str, int] = {}
    for counters in counter_dicts:
        for name, value in counters.items():
            total[name] = total.get(name, 0) + value
    return total
