"""Regenerate the docs' reference tables from the code they describe; `--check` finds stale ones.

    python scripts/gen_docs.py           # rewrite every generated block in docs/
    python scripts/gen_docs.py --check   # exit 1 naming each block that differs (what CI's test does)

This is the one way to refresh them: after adding or changing a config key (a field of
the pydantic models in kvstrata/config.py: its type, default, bounds and `description`)
or a metric (`METRICS` in kvstrata/actors/store_metrics.py, `COUNTER_NAMES` /
`GAUGE_NAMES` in kvstrata/connector/metrics.py), run it and commit the docs it changed.
tests/docs/test_generated_docs.py fails while any block is stale.

A generated block sits between `<!-- generated:NAME by scripts/gen_docs.py; do not edit by
hand -->` and `<!-- /generated:NAME -->`; text around it is written by hand. The blocks:

- docs/config.md: one key table per config section (type, default, bounds, meaning);
- docs/metrics-engine.md: the engine's counters and gauges;
- docs/observability.md: the node store's and directory's metrics;
- docs/dashboard.md: the dashboard's panels and both metric tables (scripts/metrics_table.py).
"""

from __future__ import annotations

import argparse
import sys
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

import metrics_table  # noqa: E402 - the dashboard's tables, beside this script

from kvstrata.config import KvstrataConfig, parse_size  # noqa: E402

SCRIPT = "scripts/gen_docs.py"


def start_marker(block: str) -> str:
    return f"<!-- generated:{block} by {SCRIPT}; do not edit by hand -->"


def end_marker(block: str) -> str:
    return f"<!-- /generated:{block} -->"


# ---- the config key tables ----


def _strip_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        rest = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return annotation


def _is_size(annotation: Any, field: FieldInfo) -> bool:
    validators = [*field.metadata, *getattr(annotation, "__metadata__", ())]
    return any(getattr(item, "func", None) is parse_size for item in validators)


def _model(annotation: Any) -> type[BaseModel] | None:
    annotation = _strip_optional(annotation)
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def type_of(name: str, field: FieldInfo) -> str:
    annotation = _strip_optional(field.annotation)
    if _is_size(annotation, field):
        return "size"
    if typing.get_origin(annotation) is typing.Literal:
        return " or ".join(f"`{choice}`" for choice in typing.get_args(annotation))
    if typing.get_origin(annotation) is dict:
        value = _model(typing.get_args(annotation)[1])
        return "mapping: tenant → section" if value else "mapping"
    if _model(annotation):
        return "section"
    if annotation is float:
        return "seconds" if name.endswith("_seconds") else "number"
    return {int: "integer", bool: "boolean", str: "text"}.get(annotation, str(annotation))


def size_text(value: int) -> str:
    for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if value >= scale and value % scale == 0:
            return f"`{value // scale}{unit}`"
    return f"`{value}`"


def default_of(field: FieldInfo, size: bool, anchor: str) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "off" if _model(field.annotation) else "none"
    if isinstance(value, BaseModel):
        return f"[see below](#{anchor})" if anchor else "see below"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if size:
        return size_text(value)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if value == {}:
        return "none" if typing.get_origin(field.annotation) is dict and _model(typing.get_args(field.annotation)[1]) else "`{}`"
    return f'`"{value}"`' if value == "" else f"`{value}`"


def bounds_of(field: FieldInfo) -> str:
    found: dict[str, Any] = {}
    for item in field.metadata:
        for attribute in ("gt", "ge", "lt", "le", "min_length", "max_length", "pattern"):
            if getattr(item, attribute, None) is not None and not isinstance(item, type):
                found[attribute] = getattr(item, attribute)
    parts = []
    if "ge" in found and "le" in found:
        parts.append(f"{found['ge']:,}–{found['le']:,}")
    else:
        parts += [f"{sign} {found[name]:,}" for name, sign in (("gt", ">"), ("ge", "≥"), ("lt", "<"), ("le", "≤")) if name in found]
    if "min_length" in found or "max_length" in found:
        parts.append(f"length {found.get('min_length', 0)}–{found['max_length']}")
    if "pattern" in found:
        parts.append(f"matches `{found['pattern']}`".replace("|", "\\|"))
    return ", ".join(parts)


def description_of(field: FieldInfo) -> str:
    text = field.description or ((_model(field.annotation).__doc__ or "").strip().split("\n\n")[0] if _model(field.annotation) else "")
    return " ".join(text.split()).replace("|", "\\|")


def key_rows(model: type[BaseModel], prefix: str, flatten: bool) -> list[str]:
    """One row per key of `model`; with `flatten`, a nested section's keys instead of its row."""
    rows = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        nested = _model(field.annotation)
        if flatten and nested:
            rows += key_rows(nested, f"{key}.", flatten)
            continue
        annotation = _strip_optional(field.annotation)
        size = _is_size(annotation, field)
        anchor = SECTION_ANCHORS.get(key, "")
        cells = [f"`{key}`", type_of(name, field), default_of(field, size, anchor), bounds_of(field), description_of(field)]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def key_table(model: type[BaseModel], prefix: str, flatten: bool = True) -> str:
    header = ["| key | type | default | bounds | what it does |", "| --- | --- | --- | --- | --- |"]
    return "\n".join(header + key_rows(model, prefix, flatten)) + "\n"


def section(path: str) -> type[BaseModel]:
    model: type[BaseModel] = KvstrataConfig
    for name in path.split("."):
        model = _model(model.model_fields[name].annotation)
    return model


# The anchors of docs/config.md's sections, for the top table's "see below" links.
SECTION_ANCHORS = {
    "tiers": "tierscpu-the-arena",
    "engine": "engine-each-engines-manager",
    "admission": "admission-what-engines-load-and-what-the-store-writes-down",
    "ray": "ray",
}


def config_blocks() -> dict[str, str]:
    quota = typing.get_args(KvstrataConfig.model_fields["quotas"].annotation)[1]
    blocks = {"config-top": key_table(KvstrataConfig, "", flatten=False)}
    for path in ("tiers.cpu", "tiers.disk", "tiers.object", "engine", "admission", "ray", "cluster"):
        blocks[f"config-{path}"] = key_table(section(path), f"{path}.")
    blocks["config-quotas"] = key_table(quota, "quotas.<prefix>.")
    return blocks


# ---- every generated block, by file ----


def generated() -> dict[str, dict[str, Callable[[], str]]]:
    """File (relative to the repository root) -> block name -> what the block holds."""
    return {
        "docs/config.md": {name: (lambda text=text: text) for name, text in config_blocks().items()},
        "docs/metrics-engine.md": {"engine-metrics": metrics_table.engine_metrics_table},
        "docs/observability.md": {"store-metrics": metrics_table.store_metrics_table},
        "docs/dashboard.md": {"panels": metrics_table.panel_table, "metrics": metrics_table.metrics_table},
    }


def block_in(text: str, block: str) -> str:
    """A generated block of a document (between its markers)."""
    start, end = start_marker(block), end_marker(block)
    if start not in text or end not in text:
        raise ValueError(f"no generated block {block!r} (markers {start!r} ... {end!r})")
    return text.split(start, 1)[1].split(end, 1)[0].lstrip("\n")


def with_block(text: str, block: str, table: str) -> str:
    block_in(text, block)
    before, rest = text.split(start_marker(block), 1)
    after = rest.split(end_marker(block), 1)[1]
    return f"{before}{start_marker(block)}\n{table}{end_marker(block)}{after}"


def stale_blocks(root: Path = ROOT) -> list[str]:
    """`file: block` of every generated block that differs from what this script writes."""
    stale = []
    for name, blocks in generated().items():
        text = (root / name).read_text()
        for block, make in blocks.items():
            if start_marker(block) not in text or end_marker(block) not in text:
                stale.append(f"{name}: {block} (its markers are missing: put them back where the table belongs)")
            elif block_in(text, block) != make():
                stale.append(f"{name}: {block}")
    return stale


def write_all(root: Path = ROOT) -> list[str]:
    """Rewrite every generated block; the files that changed."""
    changed = []
    for name, blocks in generated().items():
        path = root / name
        text = original = path.read_text()
        for block, make in blocks.items():
            text = with_block(text, block, make())
        if text != original:
            path.write_text(text)
            changed.append(name)
    return changed


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 naming each stale block")
    return parser


def main() -> int:
    args = build_parser().parse_args()
    if args.check:
        stale = stale_blocks()
        for where in stale:
            print(f"stale: {where}")
        if stale:
            print(f"run: python {SCRIPT}")
        return 1 if stale else 0
    for name in write_all():
        print(f"rewrote {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
