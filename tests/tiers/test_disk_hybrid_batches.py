"""A hybrid model's chunks on disk, written in batches that need several evictions (issue #51,
finding 12): evicting an anchor drops its dependents, and the eviction order must not hand
out a dependent dropped meanwhile (a KeyError that leaked the batch's records and left the
namespace's disk tier empty for good). Checked on `DiskTier` alone and through `NodeStore`."""

from __future__ import annotations

import numpy as np
import pytest

from kvstrata._dev.executors import ManualExecutors
from kvstrata.store.node_store import NodeStore
from kvstrata.protocol import StepRequest
from kvstrata.config import load_config
from kvstrata.tiers.disk import HEADER_BYTES, DiskTier
from kvstrata.tiers.retention import RetentionTable
from tests.utils import FakeClock, key, layout, store_config

CHUNK = 16384
NS = "ns0"
SLOT = 4096


def chunk(seed: int, size: int = CHUNK) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def position(i: int) -> list[bytes]:
    """A hybrid position: the anchor (group 0, full attention) and two dependents."""
    return [key(i, group=g) for g in (0, 1, 2)]


def accounted(tier: DiskTier, namespace: str) -> None:
    """Every record is free, indexed or beyond the slab's records: none leaked."""
    slab = tier._slabs[namespace]
    assert len(slab.free) + len(slab.index) == slab.num_records, "records leaked"
    assert set(slab.free).isdisjoint(slab.key_of)


@pytest.mark.parametrize("retention", [False, True], ids=["lru", "with-retention"])
def test_batches_that_evict_several_positions_keep_the_tier_working(tmp_path, retention):
    tier = DiskTier(tmp_path, 9 * (HEADER_BYTES + CHUNK))  # three positions
    try:
        if retention:
            table = RetentionTable(FakeClock())
            tier.use_retention(table)
            table.retain(NS, [key(999)], 50, 60)  # any retention: the retention-aware order
        tier.set_anchor_groups(NS, [0])
        first = [k for i in range(3) for k in position(i)]
        assert all(tier.write_many(NS, [(k, chunk(n)) for n, k in enumerate(first)]))
        for batch in range(3, 12, 2):  # each batch: two positions, six records, two evictions or more
            keys = position(batch) + position(batch + 1)
            assert all(tier.write_many(NS, [(k, chunk(batch * 10 + n)) for n, k in enumerate(keys)])), batch
            assert set(keys) <= set(tier.keys(NS))
            accounted(tier, NS)
        assert tier.stats()["write_errors"] == 0 and tier.stats()["evicted_with_anchor"] > 0
        for n, k in enumerate(position(11)):  # the last batch reads back bit-exact
            out = np.zeros(CHUNK, dtype=np.uint8)
            assert tier.read_into(NS, k, out) and np.array_equal(out, chunk(110 + n))
    finally:
        tier.close()


def test_a_hybrid_namespace_keeps_its_disk_tier_through_the_node_store(tmp_path):
    hybrid = layout()
    hybrid = type(hybrid)(**{**hybrid.__dict__, "tokens_per_block": (32, 32), "group_ids": (0, 1), "anchor_groups": (0,)})
    ns = hybrid.namespace
    disk = {
        "path": str(tmp_path / "disk"), "capacity": 8 * (SLOT + HEADER_BYTES), "write_policy": "write_through", "io_threads": 1
    }  # one batch per step
    raw = store_config(tmp_path, capacity=64 * SLOT, segment_size=64 * SLOT, disk=disk)
    raw["admission"] = {"load": "always"}
    executors = ManualExecutors("disk")
    node = NodeStore(load_config(raw), "node0", clock=FakeClock(), executors=executors)
    try:
        epoch = node.register("engine-a", ns, SLOT, hybrid.describe()).epoch
        pool = node.arena.pools[ns]
        for batch in range(6):  # each step stores three positions of two groups: six chunks
            keys = [key(batch * 3 + i, group=g) for i in range(3) for g in (0, 1)]
            slots = pool.reserve("engine-a", len(keys))
            node.step(StepRequest("engine-a", ns, epoch=epoch, commit=list(zip(slots, keys))))
            executors.run_all()
            node.step(StepRequest("engine-a", ns, epoch=epoch, unpin=slots))
            on_disk = set(node.disk.keys(ns))
            assert set(keys) <= on_disk, f"batch {batch}: the disk tier lost the namespace ({len(on_disk)} chunks)"
            accounted(node.disk, ns)
        assert node.disk.stats()["write_errors"] == 0
    finally:
        executors.run_all()
        node.close()
