"""A damaged disk directory does not stop the store: what the tier cannot use is set aside
into `damaged/`, counted and logged in one line, and the rest is served (issue #29: a
`*-0.payloads` file or a second slab of a namespace killed the store, arena and all)."""

from __future__ import annotations

import logging
import os
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest

from kvstrata.store.node_store import NodeStore
from kvstrata.store.report import _disk_report
from kvstrata.config import load_config
from kvstrata.tiers.disk import HEADER_BYTES, DiskTier
from kvstrata.tiers.disk.damaged import DAMAGED_DIR
from tests.utils import key, store_config

SIZE = 8192
CAPACITY = 64 * (SIZE + HEADER_BYTES)


def chunk(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, SIZE, dtype=np.uint8)


def build_damaged_directory(root, victim):
    """Two good slabs (namespaces ns, other: 4 chunks each, one of other's headers scribbled
    over), and next to them every kind of file the tier cannot use."""
    tier = DiskTier(root, CAPACITY, direct_io=False)
    assert tier.write_many("ns", [(key(i), chunk(i)) for i in range(4)]) == [True] * 4
    assert tier.write_many("other", [(key(i), chunk(10 + i)) for i in range(4)]) == [True] * 4
    tier.close()
    with open(root / "other-8192.headers", "r+b") as headers:
        headers.write(os.urandom(HEADER_BYTES))  # record 0's header: unreadable
    (root / "ns-4096.payloads").write_bytes(b"\0" * 100)  # a second, smaller slab of ns
    (root / "zero-0.payloads").write_bytes(b"")  # a chunk size of 0
    (root / "a b-8192.payloads").write_bytes(b"x" * SIZE)  # no valid namespace
    (root / "dir-8192.payloads").mkdir()  # not a file
    (root / "link-8192.payloads").symlink_to(victim)  # a symlink


def test_a_damaged_directory_is_set_aside_and_the_rest_served(tmp_path, caplog):
    root = tmp_path / "disk"
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    build_damaged_directory(root, victim)
    with caplog.at_level(logging.WARNING, logger="kvstrata.tiers.disk"):
        tier = DiskTier(root, CAPACITY, direct_io=False)
    try:
        stats = tier.stats()
        assert stats["damaged_files"] == 5 and stats["damaged_records"] == 1
        # What `kvstrata status --json` and the metrics show of it (store_report.py).
        report = _disk_report(SimpleNamespace(counters=defaultdict(int), disk_error=None), stats)
        assert report["set_aside"] == 5 and report["corrupt"] >= 1
        assert sorted(os.listdir(root / DAMAGED_DIR)) == sorted(
            ["ns-4096.payloads", "zero-0.payloads", "a b-8192.payloads", "dir-8192.payloads", "link-8192.payloads"]
        )
        set_aside_lines = [r for r in caplog.records if "set aside" in r.getMessage()]
        assert len(set_aside_lines) == 1 and "5 damaged slab(s)" in set_aside_lines[0].getMessage()
        assert victim.read_bytes() == b"precious"
        outs = [(key(i), np.zeros(SIZE, np.uint8)) for i in range(4)]
        assert tier.read_many("ns", outs) == [True] * 4
        assert all(np.array_equal(out, chunk(i)) for i, (_, out) in enumerate(outs))
        assert sorted(tier.keys("other")) == sorted(key(i) for i in range(1, 4))
        assert tier.write_many("other", [(key(0), chunk(10))]) == [True]  # its record is reused
    finally:
        tier.close()
    again = DiskTier(root, CAPACITY, direct_io=False)  # nothing left to set aside
    try:
        assert again.stats()["damaged_files"] == 0 and len(again.keys("other")) == 4
    finally:
        again.close()


def test_a_disk_tier_that_fails_in_any_way_leaves_the_store_serving_the_arena(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise ZeroDivisionError("integer division or modulo by zero")

    monkeypatch.setattr("kvstrata.store.lower.DiskTier", broken)
    disk = {"path": str(tmp_path / "disk"), "capacity": CAPACITY}
    store = NodeStore(load_config(store_config(tmp_path, capacity=8 * SIZE, disk=disk)), "node0")
    try:
        assert store.disk is None and store.arena is not None
        assert "ZeroDivisionError" in store.stats()["disk"]["error"]
    finally:
        store.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a file of another user")
def test_a_slab_of_another_user_is_set_aside(tmp_path):
    root = tmp_path / "disk"
    root.mkdir()
    planted = root / "ns-8192.payloads"
    planted.write_bytes(b"\0" * SIZE)
    os.chown(planted, 65534, 65534)
    tier = DiskTier(root, CAPACITY, direct_io=False)
    try:
        assert tier.stats()["damaged_files"] == 1 and (root / DAMAGED_DIR / "ns-8192.payloads").exists()
        assert tier.write_many("ns", [(key(1), chunk(1))]) == [True]
    finally:
        tier.close()
