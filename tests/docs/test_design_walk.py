"""docs/design.md's walks through the code name files that exist.

The walks ("a lookup, from `StrataManager.lookup` to the arena's bytes" and "a store, from
the worker to the bucket") are how a newcomer finds the room to change: a file renamed or
moved without the walk following it sends them to nothing.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"
PATH = re.compile(r"`((?:kvstrata|docs|tests)/[A-Za-z0-9_./]+)`")


def walk_section() -> str:
    text = DESIGN.read_text()
    start = text.index("## Walks through the code")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def test_every_file_the_walks_name_exists():
    named = PATH.findall(walk_section())
    assert len(named) >= 25, named  # both walks, file by file
    missing = [path for path in named if not (ROOT / path).exists()]
    assert not missing, missing


def test_the_walks_pass_through_each_layer():
    named = set(PATH.findall(walk_section()))
    for needed in (
        "kvstrata/connector/pins.py",  # StrataManager.lookup
        "kvstrata/protocol.py",
        "kvstrata/actors/store_client.py",
        "kvstrata/store/control.py",
        "kvstrata/store/promotion.py",
        "kvstrata/tiers/base.py",
        "kvstrata/tiers/arena.py",
        "kvstrata/connector/worker.py",
        "kvstrata/store/cascade.py",
        "kvstrata/tiers/object_store.py",
    ):
        assert needed in named, needed


def test_every_kvstrata_path_the_design_names_exists():
    """Not only the walks: a path anywhere in docs/design.md is a promise too."""
    named = set(PATH.findall(DESIGN.read_text()))
    missing = [path for path in sorted(named) if not (ROOT / path).exists() and not (ROOT / f"{path}.py").exists()]
    assert not missing, missing
