"""The tables of docs/dashboard.md, generated from what they describe.

    python scripts/metrics_table.py           # print the tables
    python scripts/metrics_table.py --write   # replace them in docs/dashboard.md

The panel table comes from examples/grafana/kvstrata.json (titles and descriptions), the
store's metrics from `kvstrata.actors.store_metrics.METRICS` (what the exporter declares
to Ray), the engine's from `kvstrata.connector.metrics` (what the spec declares to vLLM),
so the docs cannot drift from them: tests/test_grafana_dashboard.py fails when a table in
the docs differs from what this prints.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvstrata.actors.store_metrics import METRICS
from kvstrata.connector.metrics import COUNTER_NAMES, GAUGE_NAMES, metric_name

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "dashboard.md"
DASHBOARD = ROOT / "examples" / "grafana" / "kvstrata.json"


def start_marker(block: str) -> str:
    return f"<!-- generated:{block} by scripts/metrics_table.py; do not edit by hand -->"


def end_marker(block: str) -> str:
    return f"<!-- /generated:{block} -->"


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


def metrics_table() -> str:
    """Markdown: one table of the node store and directory metrics, one of the engine's."""
    lines = [
        "Served on every Ray node's metrics port (`ray_` is Ray's prefix; counters get `_total`):",
        "",
        "| Prometheus name | type | labels | meaning |",
        "| --- | --- | --- | --- |",
    ]
    for name, spec in METRICS.items():
        labels = ", ".join(f"`{tag}`" for tag in spec.tags)
        lines.append(f"| `{spec.prometheus_name(name)}` | {spec.kind} | {labels} | {spec.description} |")
    lines += [
        "",
        "Served on each vLLM engine's `/metrics` (`vllm serve`), labelled `model_name` and `engine` by vLLM:",
        "",
        "| Prometheus name | type | meaning |",
        "| --- | --- | --- |",
    ]
    for names, kind, suffix in ((COUNTER_NAMES, "counter", "_total"), (GAUGE_NAMES, "gauge", "")):
        for name, description in names.items():
            lines.append(f"| `{metric_name(name)}{suffix}` | {kind} | {description} |")
    return "\n".join(lines) + "\n"


def blocks() -> dict[str, str]:
    """Each generated block of docs/dashboard.md by name."""
    return {"panels": panel_table(), "metrics": metrics_table()}


def block_in(text: str, block: str) -> str:
    """A generated block of a document (between its markers)."""
    start, end = start_marker(block), end_marker(block)
    if start not in text or end not in text:
        raise ValueError(f"no generated block {block!r} (markers {start!r} ... {end!r})")
    return text.split(start, 1)[1].split(end, 1)[0].lstrip("\n")


def with_blocks(text: str, generated: dict[str, str]) -> str:
    for block, table in generated.items():
        before, rest = text.split(start_marker(block), 1)
        after = rest.split(end_marker(block), 1)[1]
        text = f"{before}{start_marker(block)}\n{table}{end_marker(block)}{after}"
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"replace the tables in {DOCS}")
    return parser


def main() -> int:
    parser = build_parser()
    args = parser.parse_args()
    generated = blocks()
    if not args.write:
        sys.stdout.write("\n".join(generated.values()))
        return 0
    DOCS.write_text(with_blocks(DOCS.read_text(), generated))
    return 0


if __name__ == "__main__":
    sys.exit(main())
