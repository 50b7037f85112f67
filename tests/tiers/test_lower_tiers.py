"""What every tier below the arena does for the node store, run on each: this node's disk,
the object store, and a test-only in-memory tier that plugs in by registration alone
(tests/tiers/memory_tier.py; no edit to the store's cascade, promotion or purges).

A committed chunk is copied down and comes back byte-exact once the arena forgot it; a
purge empties the tier and a later pin is a miss; a copy queued before a purge never lands.
The store's I/O runs on `ManualExecutor`s: each test picks when jobs land, no threads.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvstrata.config import load_config
from kvstrata.protocol import StepRequest
from kvstrata._dev.executors import ManualExecutors
from kvstrata.store.node_store import NodeStore
from kvstrata.tiers.disk import HEADER_BYTES
from tests.tiers import memory_tier
from tests.utils import key, store_config

SLOT = 4096
NS = "ns-lower"
K = key(7)
TIERS = ("disk", "object", "memory")


@pytest.fixture
def built(tmp_path):
    made = []

    def make(tier: str) -> tuple[NodeStore, ManualExecutors]:
        disk = {"path": str(tmp_path / "disk"), "capacity": 64 * (SLOT + HEADER_BYTES), "write_policy": "write_through"}
        raw = store_config(tmp_path, capacity=16 * SLOT, disk=disk if tier == "disk" else None)
        if tier == "object":
            raw["tiers"]["object"] = {"url": f"file://{tmp_path}/bucket/kv", "write_policy": "write_through"}
        executors = ManualExecutors("disk", "object", memory_tier.MemoryTier.name)
        lower = {"lower": [tier]} if tier == "memory" else {}
        made.append((NodeStore(load_config(raw), "node0", executors=executors, **lower), executors))
        return made[-1]

    yield make
    for store, executors in made:
        executors.run_all()
        store.close()


def commit(store: NodeStore, executors: ManualExecutors, data: np.ndarray) -> str:
    """Register, store `data` as K and commit it; the copies down are queued, not run."""
    epoch = store.register("engine", NS, SLOT).epoch
    executors.run_all()  # the first sweep of a listed tier
    pool = store.arena.pools[NS]
    [slot] = pool.reserve("engine", 1)
    pool.view(slot)[:] = data
    store.step(StepRequest("engine", NS, epoch=epoch, commit=[(slot, K)]))
    return epoch


def forget_in_arena(store: NodeStore) -> None:
    pool = store.arena.pools[NS]
    pool.drop_holder("engine")
    pool.purge()


@pytest.mark.parametrize("tier", TIERS)
def test_a_committed_chunk_comes_back_from_the_tier_byte_exact(built, tier):
    store, executors = built(tier)
    assert store.stats()["lower_tiers"] == [tier]
    data = np.random.default_rng(7).integers(0, 256, SLOT, dtype=np.uint8)
    epoch = commit(store, executors, data)
    executors.run_all()
    assert store.tier(tier).present(NS, [K]) == {K}
    forget_in_arena(store)
    assert store.read(NS, K) is None
    assert store.step(StepRequest("engine", NS, epoch=epoch, pin=[K])).pending == [K]
    executors.run_all()
    reply = store.step(StepRequest("engine", NS, epoch=epoch, pin=[K]))
    assert list(reply.pinned) == [K]
    assert store.read(NS, K) == data.tobytes()
    assert store.counters[f"{tier}_promotions"] == 1


@pytest.mark.parametrize("tier", TIERS)
def test_a_purge_empties_the_tier_and_a_later_pin_is_a_miss(built, tier):
    store, executors = built(tier)
    epoch = commit(store, executors, np.full(SLOT, 3, dtype=np.uint8))
    executors.run_all()
    assert not store.step(StepRequest("engine", NS, epoch=epoch, purge=True)).rejected
    executors.run_all()
    assert store.tier(tier).present(NS, [K]) == set()
    assert store.step(StepRequest("engine", NS, epoch=epoch, pin=[K])).missing == [K]


@pytest.mark.parametrize("tier", TIERS)
def test_a_copy_queued_before_a_purge_never_lands(built, tier):
    store, executors = built(tier)
    epoch = commit(store, executors, np.full(SLOT, 5, dtype=np.uint8))  # its copy down waits
    assert not store.step(StepRequest("engine", NS, epoch=epoch, purge=True)).rejected
    executors.run_all()
    assert store.tier(tier).present(NS, [K]) == set()
    forget_in_arena(store)
    assert store.step(StepRequest("engine", NS, epoch=epoch, pin=[K])).missing == [K]
