"""`kvstrata status` as tables: is the cache working, which tier serves the hits, is anything failing.

Renders the `report` part of node stores' `stats()` (actors/store_report.py says what
each field means) and the directory shards' stats with `rich`. Pure: it takes the
dictionaries and returns renderables, so it is tested without Ray.

Must not: call Ray or a store; compute figures the report does not carry (a table that
computed its own "hits" could disagree with the dashboard).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

TIER_NAMES = {"cpu": "cpu arena", "disk": "disk", "object": "object store", "peer": "peers"}
STATE_STYLES = {"on": "green", "off": "dim", "paused": "yellow", "error": "bold red"}


def render_status(stores: Iterable[Mapping[str, Any]], directory: Iterable[Mapping[str, Any]] = ()) -> RenderableType:
    """Every store's tables, then the directory's (if any shard answered)."""
    parts: list[RenderableType] = [render_store(stats) for stats in stores]
    shards = list(directory)
    if shards:
        parts.append(render_directory(shards))
    if not parts:
        parts.append(Text("no kvstrata node store answered", style="yellow"))
    return Group(*parts)


def render_store(stats: Mapping[str, Any]) -> RenderableType:
    report = stats["report"]
    title = f"node {report['node_id']}  ·  store pid {stats.get('pid', '?')}  ·  epoch {stats.get('epoch', '?')}"
    parts: list[RenderableType] = [Text(title, style="bold"), tier_table(report["tiers"])]
    problems = [
        Text(f"  {TIER_NAMES.get(name, name)}: {tier['state']}: {tier.get('reason', '')}", style=STATE_STYLES[tier["state"]])
        for name, tier in report["tiers"].items()
        if tier["state"] in ("error", "paused")
    ]
    parts.extend(problems)
    admission = admission_line(report.get("admission"))
    if admission is not None:
        parts.append(admission)
    if report["namespaces"]:
        parts.append(namespace_table(report["namespaces"]))
    if any(tier.get("quota") is not None for tiers in report.get("tenants", {}).values() for tier in tiers.values()):
        parts.append(tenant_table(report["tenants"]))
    parts.append(engine_table(report["engines"]))
    parts.append(Text(""))
    return Group(*parts)


def tier_table(tiers: Mapping[str, Mapping[str, Any]]) -> Table:
    table = Table(title="tiers (GB/s over the last minute)", title_justify="left", expand=False)
    for column in ("tier", "state", "used / capacity", "chunks", "hits", "misses", "read GB/s", "write GB/s"):
        table.add_column(column, justify="left" if column in ("tier", "state") else "right")
    for column in ("evicted", "dropped", "failed", "corrupt"):
        table.add_column(column, justify="right")
    for name, tier in tiers.items():
        state = Text(tier["state"], style=STATE_STYLES.get(tier["state"], ""))
        if tier["state"] in ("off", "error"):  # an error's reason is printed under the table
            table.add_row(TIER_NAMES.get(name, name), state, *[""] * 10, style="dim" if tier["state"] == "off" else "")
            continue
        table.add_row(
            TIER_NAMES.get(name, name),
            state,
            f"{_bytes(tier.get('used'))} / {_bytes(tier.get('capacity'))}",
            _count(tier.get("chunks")),
            _count(tier.get("hits")),
            _count(tier.get("misses")),
            _rate(tier.get("read_bytes_per_second")),
            _rate(tier.get("write_bytes_per_second")),
            *(_alarm(tier.get(field), field != "evicted") for field in ("evicted", "dropped", "failed", "corrupt")),
        )
    return table


def admission_line(admission: Mapping[str, Any] | None) -> Text | None:
    """Cost-based admission's decisions and estimates (docs/admission.md); None when it has
    neither skipped anything nor measured a tier (nothing to say)."""
    if not admission:
        return None
    skipped = {
        "disk": admission.get("disk_writes_skipped_reuse", 0),
        "object": admission.get("object_uploads_skipped_reuse", 0),
    }
    estimates = admission.get("estimates", {})
    peers = admission.get("peer_estimates", {})
    if not any(skipped.values()) and not estimates and not peers:
        return None
    text = Text("  admission: ")
    text.append("writes skipped as not reused: " + ", ".join(f"{tier} {_count(n)}" for tier, n in skipped.items()))
    for tier, cost in estimates.items():
        text.append(f"  ·  {TIER_NAMES.get(tier, tier)} delivers {_delivers(cost)}")
    if peers:  # the store's own choice among a chunk's holders; engines weigh `peers` above
        each = (f"node {node[:12]} delivers {_delivers(cost)}" for node, cost in peers.items())
        text.append("\n  per peer: " + "  ·  ".join(each))
    return text


def _delivers(cost: Mapping[str, float]) -> str:
    return (
        f"{_rate(cost['bytes_per_second'])} GB/s after {cost['latency_seconds'] * 1000:.1f} ms"
        f" ({cost['age_seconds']:.0f} s ago)"
    )


def namespace_table(namespaces: Mapping[str, Mapping[str, Any]]) -> Table:
    table = Table(title="namespaces (chunks per tier)", title_justify="left")
    table.add_column("namespace")
    table.add_column("models")
    for tier in ("cpu", "disk", "object"):
        table.add_column(tier, justify="right")
    for namespace, info in namespaces.items():
        chunks = info["chunks"]
        models = ", ".join(info["models"]) or "(no engine registered since start)"
        table.add_row(namespace, models, *(_count(chunks.get(tier, 0)) for tier in ("cpu", "disk", "object")))
    return table


def tenant_table(tenants: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> Table:
    """Bytes each tenant holds per tier against its quota (`quotas:`); `∞`: no quota there."""
    table = Table(title="tenants (used / quota per tier)", title_justify="left")
    table.add_column("tenant (namespace_prefix)")
    for tier in ("cpu", "disk", "object"):
        table.add_column(tier, justify="right")
    for tenant, tiers in tenants.items():
        cells = []
        for tier in ("cpu", "disk", "object"):
            figures = tiers.get(tier)
            cells.append("" if figures is None else f"{_bytes(figures['used'])} / {_bytes(figures['quota'])}")
        table.add_row(tenant or "(empty prefix)", *cells)
    return table


def engine_table(engines: Mapping[str, Mapping[str, Any]]) -> RenderableType:
    if not engines:
        return Text("engines: none holds a lease now", style="dim")
    table = Table(title="engines holding a lease", title_justify="left")
    for column in ("engine", "lease left", "pinned chunks", "reserved slots", "recompute rate"):
        table.add_column(column, justify="left" if column == "engine" else "right")
    for holder, engine in engines.items():
        rate = engine.get("recompute_tokens_per_second")
        table.add_row(
            holder,
            f"{engine['lease_seconds_left']:.1f} s",
            _count(engine["pinned"]),
            _count(engine["reserved"]),
            f"{rate:,.0f} tokens/s" if rate else "not measured",
        )
    return table


def render_directory(shards: list[Mapping[str, Any]]) -> Table:
    table = Table(title="cluster directory (chunk locations per shard)", title_justify="left")
    table.add_column("shard", justify="right")
    table.add_column("epoch")
    table.add_column("namespace")
    table.add_column("entries", justify="right")
    for shard in sorted(shards, key=lambda s: s["shard"]):
        namespaces = shard["namespaces"] or {"": 0}
        for namespace, entries in namespaces.items():
            table.add_row(str(shard["shard"]), shard["epoch"], namespace or "(empty)", _count(entries))
    return table


def _bytes(value: int | None) -> str:
    if value is None:
        return "∞"
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if value >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value} B"


def _count(value: int | None) -> str:
    return "" if value is None else f"{value:,}"


def _rate(bytes_per_second: float | None) -> str:
    return "" if bytes_per_second is None else f"{bytes_per_second / 1e9:.3f}"


def _alarm(value: int | None, alarming: bool) -> Text:
    text = _count(value)
    return Text(text, style="bold red" if alarming and value else "")
