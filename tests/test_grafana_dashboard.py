"""The Grafana dashboard (examples/grafana/kvstrata.json) queries only metrics kvstrata
exports, with labels those metrics have, and shows what the operator asks of it.

A dashboard that names a metric the store does not export, or groups by a label it does
not carry, imports without a complaint and draws an empty or flat panel: nobody notices
until the day it matters. These checks fail on such a typo instead. No Ray, no Grafana.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstrata.actors.store_metrics import METRICS
from kvstrata.connector.metrics import COUNTER_NAMES, GAUGE_NAMES, metric_name

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "examples" / "grafana" / "kvstrata.json"
DOCS = ROOT / "docs" / "dashboard.md"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}

# Scraped name -> the labels the series carry (beyond those Ray or Prometheus add).
STORE_METRICS = {spec.prometheus_name(name): set(spec.tags) for name, spec in METRICS.items()}
# vLLM serves the engine's metrics through prometheus_client: a counter gets `_total`;
# its labels are vLLM's (model_name, engine).
ENGINE_LABELS = {"model_name", "engine"}
ENGINE_METRICS = {metric_name(name) + "_total": ENGINE_LABELS for name in COUNTER_NAMES}
ENGINE_METRICS |= {metric_name(name): ENGINE_LABELS for name in GAUGE_NAMES}
KNOWN_METRICS = STORE_METRICS | ENGINE_METRICS

PROMQL_FUNCTIONS = {
    "abs", "avg", "avg_over_time", "clamp_max", "clamp_min", "count", "delta", "deriv", "histogram_quantile",
    "increase", "irate", "label_replace", "max", "max_over_time", "min", "min_over_time", "quantile", "rate",
    "scalar", "sum", "sum_over_time", "topk", "bottomk", "vector", "absent",
}  # fmt: skip
PROMQL_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset"}
IDENTIFIER = r"[a-zA-Z_:][a-zA-Z0-9_:]*"


def panels(items: list[dict]) -> Iterator[dict]:
    """Every panel, those inside collapsed rows too."""
    for panel in items:
        yield panel
        yield from panels(panel.get("panels", []))


def metric_names(expr: str) -> set[str]:
    """Metric names an expression selects: identifiers that are not functions, keywords
    or label names. Label matchers, ranges and `by (...)`-style label lists are removed
    first; an identifier followed by `(` must be a known function."""
    bare = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    bare = re.sub(r"\{[^}]*\}", " ", bare)
    bare = re.sub(r"\[[^\]]*\]", " ", bare)
    bare = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", bare)
    names = set()
    for match in re.finditer(rf"(?<![\w:$.]){IDENTIFIER}", bare):
        word = match.group(0)
        if re.match(r"\s*\(", bare[match.end() :]):
            assert word in PROMQL_FUNCTIONS, f"unknown function {word!r} in {expr}"
        elif word not in PROMQL_KEYWORDS:
            names.add(word)
    return names


def selectors(expr: str) -> Iterator[tuple[str, dict[str, str]]]:
    """(metric, {label: matcher text}) of every `metric{...}` selector."""
    for match in re.finditer(rf"({IDENTIFIER})\{{([^}}]*)\}}", expr):
        matchers = re.findall(rf'({IDENTIFIER})\s*(=~|!~|!=|=)\s*("(?:[^"\\]|\\.)*")', match.group(2))
        yield match.group(1), {label: op + value for label, op, value in matchers}


def grouped_labels(expr: str) -> Iterator[tuple[set[str], str]]:
    """(labels of a `by (...)` clause, the expression that aggregation applies to)."""
    for match in re.finditer(r"\bby\s*\(([^)]*)\)\s*\(", expr):
        depth, end = 1, match.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(expr[end], 0)
            end += 1
        labels = {label.strip() for label in match.group(1).split(",") if label.strip()}
        yield labels, expr[match.end() : end - 1]


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def queried(dashboard) -> list[tuple[dict, str]]:
    """(panel, expr) of every query of every panel."""
    found = [(panel, target["expr"]) for panel in panels(dashboard["panels"]) for target in panel.get("targets", [])]
    assert len(found) > 20
    return found


def test_every_queried_metric_is_one_kvstrata_exports(queried):
    unknown = {(panel["title"], name) for panel, expr in queried for name in metric_names(expr) if name not in KNOWN_METRICS}
    assert not unknown, f"the dashboard queries metrics nobody exports: {sorted(unknown)}"


def test_every_store_metric_has_a_panel(queried):
    shown = set().union(*(metric_names(expr) for _, expr in queried))
    assert not set(STORE_METRICS) - shown, f"exported but on no panel: {sorted(set(STORE_METRICS) - shown)}"


def test_selectors_and_groupings_use_labels_the_metrics_carry(queried):
    for panel, expr in queried:
        for name, matchers in selectors(expr):
            assert set(matchers) <= KNOWN_METRICS[name], f"{panel['title']}: {name} has no label {set(matchers) - KNOWN_METRICS[name]}"
        for labels, inner in grouped_labels(expr):
            for name in metric_names(inner):
                assert labels <= KNOWN_METRICS[name], f"{panel['title']}: {name} cannot be grouped by {labels}"


def test_every_store_panel_follows_the_node_variable(queried):
    for panel, expr in queried:
        for name, matchers in selectors(expr):
            if "node" in STORE_METRICS.get(name, ()):
                assert matchers.get("node") == '=~"$node"', f"{panel['title']}: {name} ignores $node"
        for name in metric_names(expr):
            if "node" in STORE_METRICS.get(name, ()):
                assert re.search(rf"{re.escape(name)}\{{", expr), f"{panel['title']}: {name} has no selector"


def test_panels_use_the_datasource_variable_and_have_unique_ids(dashboard):
    everything = list(panels(dashboard["panels"]))
    ids = [panel["id"] for panel in everything]
    assert len(ids) == len(set(ids))
    for panel in everything:
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target.get("datasource", DATASOURCE) == DATASOURCE, panel["title"]


def test_template_variables(dashboard):
    variables = {variable["name"]: variable for variable in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    node = variables["node"]
    assert node["query"]["query"] == node["definition"] == "label_values(ray_kvstrata_tier_up, node)"
    assert node["multi"] and node["includeAll"] and node["allValue"] == ".*"
    for variable in variables.values():
        if variable["type"] != "query":
            continue
        assert variable["datasource"] == DATASOURCE
        metric, label = re.fullmatch(rf"label_values\(({IDENTIFIER}), (\w+)\)", variable["definition"]).groups()
        assert label in KNOWN_METRICS[metric], variable["definition"]
    assert dashboard["schemaVersion"] >= 36 and dashboard["uid"] == "kvstrata"


@pytest.mark.parametrize(
    "title, metrics",
    [
        ("Hit ratio by tier", {"ray_kvstrata_tier_hits_total", "ray_kvstrata_tier_misses_total"}),
        ("Bytes used per tier", {"ray_kvstrata_tier_used_bytes", "ray_kvstrata_tier_capacity_bytes"}),
        ("Read throughput per tier", {"ray_kvstrata_tier_read_bytes_total"}),
        ("Write throughput per tier", {"ray_kvstrata_tier_write_bytes_total"}),
        ("Promotions by source tier", {"ray_kvstrata_promotions_total"}),
        (
            "Dropped, failed and corrupt chunks per tier",
            {
                "ray_kvstrata_tier_dropped_total",
                "ray_kvstrata_tier_failed_total",
                "ray_kvstrata_tier_corrupt_total",
                "ray_kvstrata_tier_set_aside_files_total",  # damaged disk files, issue #29
                "ray_kvstrata_purges_refused_total",
            },
        ),
    ],
)
def test_what_the_issue_asks_for_has_its_panel(dashboard, title, metrics):
    """Hit ratio by tier, bytes per tier, throughput, promotions, errors (issue #27)."""
    found = [panel for panel in panels(dashboard["panels"]) if panel["title"] == title]
    assert len(found) == 1, title
    panel = found[0]
    assert not panel.get("collapsed") and panel["type"] == "timeseries"
    used = set().union(*(metric_names(target["expr"]) for target in panel["targets"]))
    assert used == metrics


def test_the_hit_ratio_stacks_to_one_over_the_tiers_and_the_misses(dashboard):
    """Its denominator is every chunk asked for: every tier's hits plus the arena's misses
    (a lower tier's misses are failed promotions of chunks already counted as asked)."""
    panel = next(panel for panel in panels(dashboard["panels"]) if panel["title"] == "Hit ratio by tier")
    by_tier, misses = (target["expr"] for target in panel["targets"])
    hits_per_tier, _, asked = by_tier.partition(" / on() group_left() ")
    missed, _, asked_too = misses.partition(" / on() ")
    assert asked == asked_too
    assert metric_names(hits_per_tier) == {"ray_kvstrata_tier_hits_total"} and "by (tier)" in hits_per_tier
    assert dict(selectors(missed))["ray_kvstrata_tier_misses_total"]["tier"] == '="cpu"'
    assert dict(selectors(asked))["ray_kvstrata_tier_misses_total"]["tier"] == '="cpu"'
    assert metric_names(asked) == {"ray_kvstrata_tier_hits_total", "ray_kvstrata_tier_misses_total"}
    assert panel["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"


def test_the_metrics_table_names_every_metric_the_dashboard_uses():
    """The table scripts/gen_docs.py writes into docs/dashboard.md (tests/docs/test_generated_docs.py
    checks that the docs hold it) lists every metric the dashboard queries."""
    spec = importlib.util.spec_from_file_location("metrics_table", ROOT / "scripts" / "metrics_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    metrics = module.metrics_table()
    assert not [name for name in STORE_METRICS | ENGINE_METRICS if f"`{name}`" not in metrics]


def test_metric_names_are_read_from_expressions():
    """The extractor the checks above rest on: functions, keywords, labels and variables are not metrics."""
    expr = (
        'sum by (tier) (rate(ray_kvstrata_tier_hits_total{node=~"$node", tier!="cpu"}[$__rate_interval])) '
        "/ on() group_left() (sum(kvstrata:pinned_chunks) or vector(0)) > 0"
    )
    assert metric_names(expr) == {"ray_kvstrata_tier_hits_total", "kvstrata:pinned_chunks"}
    assert dict(selectors(expr))["ray_kvstrata_tier_hits_total"] == {"node": '=~"$node"', "tier": '!="cpu"'}
    assert [labels for labels, _ in grouped_labels(expr)] == [{"tier"}]
    with pytest.raises(AssertionError, match="unknown function"):
        metric_names("summ(ray_kvstrata_tier_hits_total)")
