"""The docs' reference tables are what scripts/gen_docs.py writes from the code.

docs/config.md's key tables come from the pydantic models of kvstrata/config.py, the
metric tables of docs/metrics-engine.md, docs/observability.md and docs/dashboard.md from
the metric definitions. A changed key, default, bound, description or metric makes the
first test fail until `python scripts/gen_docs.py` is run and its changes committed.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HOW_TO_FIX = (
    "run `python scripts/gen_docs.py` and commit what it changed: it is the one way to refresh "
    "these tables (after merging a branch that adds config keys or metrics, too)"
)


@pytest.fixture(scope="module")
def gen_docs():
    path, modules = list(sys.path), set(sys.modules)
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    sys.path[:] = path
    for name in {"metrics_table"} - modules:
        sys.modules.pop(name, None)


def test_generated_tables_are_current(gen_docs):
    stale = gen_docs.stale_blocks()
    assert not stale, f"stale generated tables: {', '.join(stale)}; {HOW_TO_FIX}"


def test_a_changed_default_or_metric_makes_them_stale(gen_docs, monkeypatch):
    """What the test above sees when code moves without its docs."""
    from kvstrata.config import EngineConfig
    from kvstrata.connector import metrics

    assert gen_docs.stale_blocks() == []
    monkeypatch.setattr(EngineConfig.model_fields["reserve_slots"], "default", 64)
    assert gen_docs.stale_blocks() == ["docs/config.md: config-engine"]
    monkeypatch.undo()
    monkeypatch.setitem(metrics.COUNTER_NAMES, "chunks_prefetched", "Chunks a new metric counts.")
    assert gen_docs.stale_blocks() == ["docs/metrics-engine.md: engine-metrics", "docs/dashboard.md: metrics"]


def test_write_then_check_round_trips(gen_docs, tmp_path):
    """Writing into a copy with emptied blocks restores the committed files exactly."""
    for name, blocks in gen_docs.generated().items():
        copy = tmp_path / name
        copy.parent.mkdir(parents=True, exist_ok=True)
        text = (ROOT / name).read_text()
        for block in blocks:
            text = gen_docs.with_block(text, block, "")
        copy.write_text(text)
    assert len(gen_docs.stale_blocks(tmp_path)) == sum(len(blocks) for blocks in gen_docs.generated().values())
    gen_docs.write_all(tmp_path)
    assert gen_docs.stale_blocks(tmp_path) == []
    for name in gen_docs.generated():
        assert (tmp_path / name).read_text() == (ROOT / name).read_text()
