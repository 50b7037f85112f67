"""The tables of docs/dashboard.md, generated from what they describe.

    python scripts/metrics_table.py   # print the tables
    python scripts/gen_docs.py        # replace them (and every other generated table) in docs/

The panel table comes from examples/grafana/kvstrata.json (titles and descriptions), the
store's metrics from `kvstrata.actors.store_metrics.METRICS` (what the exporter declares
to Ray), the engine's from `kvstrata.connector.metrics` (what the spec declares to vLLM),
so the docs cannot drift from them: scripts/gen_docs.py writes them into docs/dashboard.md
(and the metric tables into docs/metrics-engine.md and docs/observability.md), and
tests/docs/test_generated_docs.py fails when a table in the docs differs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvstrata.actors.store_metrics import METRICS
from kvstrata.connector.metrics import COUNTER_NAMES, GAUGE_NAMES, metric_name

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "examples" / "grafana" / "kvstrata.json"


def panel_table(dashboard: dict | None = None) -> str:
    """Markdown: every panel of the dashboard, row by row, with what it shows."""
    dashboard = dashboard or json.loads(DASHBOARD.read_text())
    lines = ["| row | panel | what it shows, from which metrics |", "| --- | --- | --- |"]
    row = ""

    def walk(panels: list[dict]) -> None:
        nonlocal row
        for panel in panels:
            if panel["type"] == "row":
                row = panel["title"] + (" (collapsed)" if panel.get("collapsed") else "")
                walk(panel.get("panels", []))
                continue
            lines.append(f"| {row} | {panel['title']} | {panel['description'].replace('|', '/')} |")

    walk(dashboard["panels"])
    return "\n".join(lines) + "\n"


def store_metrics_table() -> str:
    """Markdown: the node store and directory metrics, as Ray's metrics port serves them."""
    lines = ["| Prometheus name | type | labels | meaning |", "| --- | --- | --- | --- |"]
    for name, spec in METRICS.items():
        labels = ", ".join(f"`{tag}`" for tag in spec.tags)
        lines.append(f"| `{spec.prometheus_name(name)}` | {spec.kind} | {labels} | {spec.description} |")
    return "\n".join(lines) + "\n"


def engine_metrics_table() -> str:
    """Markdown: the engine's counters and gauges, as vLLM's `/metrics` serves them."""
    lines = ["| Prometheus name | type | meaning |", "| --- | --- | --- |"]
    for names, kind, suffix in ((COUNTER_NAMES, "counter", "_total"), (GAUGE_NAMES, "gauge", "")):
        for name, description in names.items():
            lines.append(f"| `{metric_name(name)}{suffix}` | {kind} | {description} |")
    return "\n".join(lines) + "\n"


def metrics_table() -> str:
    """Markdown: one table of the node store and directory metrics, one of the engine's."""
    return (
        "Served on every Ray node's metrics port (`ray_` is Ray's prefix; counters get `_total`):\n\n"
        + store_metrics_table()
        + "\nServed on each vLLM engine's `/metrics` (`python -m vllm.entrypoints.openai.api_server`), "
        "labelled `model_name` and `engine` by vLLM:\n\n"
        + engine_metrics_table()
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    return parser


def main() -> int:
    build_parser().parse_args()
    sys.stdout.write(panel_table() + "\n" + metrics_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
