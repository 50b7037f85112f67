"""Sample output shown in docs/observability.md is what the code prints.

`kvstrata up`'s lines for a config with a disk path that cannot work, and the columns of
`kvstrata status`'s engines table, are compared with the code that prints them (their
figures, node ids and pids are the sample run's and not checked).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from kvstrata.cli import _tier_lines
from kvstrata.cli.status_view import engine_table
from kvstrata.config import load_config
from kvstrata.tiers.disk import DiskTier, DiskTierError

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "observability.md").read_text()


def fence_after(marker: str, lang: str) -> str:
    """The body of the first `lang` fence after `marker`."""
    rest = DOC.split(marker, 1)[1]
    return re.search(rf"^```{lang}\n(.*?)^```", rest, re.S | re.M).group(1)


def test_the_up_failure_sample_is_what_up_prints():
    config = load_config(yaml.safe_load(fence_after("With `broken.yaml` holding", "yaml")))
    with pytest.raises(DiskTierError) as failure:
        DiskTier(config.tiers.disk.path, config.tiers.disk.capacity)
    printed = [f"  {'ok ' if ok else 'FAILED'} {line}" for line, ok in _tier_lines(config, {"disk": str(failure.value)})]
    shown = DOC.split("$ kvstrata up --config broken.yaml\n", 1)[1].split("```", 1)[0].splitlines()
    assert shown[1:3] == printed
    assert shown[3] == (
        "1 configured tier(s) cannot work; the store serves without them. "
        "Fix the config (or pass --allow-degraded to accept this)."
    )


def test_the_engines_table_sample_has_the_status_columns():
    table = engine_table({"engine-0": {"lease_seconds_left": 30.0, "pinned": 0, "reserved": 0}})
    columns = [str(column.header) for column in table.columns]
    header = DOC.split("engines holding a lease\n", 1)[1].splitlines()[1]
    assert [cell.strip() for cell in header.strip("┃").split("┃")] == columns


def test_configs_local_yaml_is_the_built_in_default():
    """What README.md and docs/config.md say of it: no config and configs/local.yaml are the same."""
    assert load_config(ROOT / "configs" / "local.yaml") == load_config(None)
