"""A connector reset through the node store: the purged generation's pool gives its segments
back for the next generation (issue 50), and the store's status copes with a pool that has none."""

from __future__ import annotations

from kvstrata.config import load_config
from kvstrata.protocol import StepRequest
from kvstrata._dev.executors import ManualExecutors
from kvstrata.store.node_store import NodeStore
from tests.utils import key, store_config

SLOT = 4096


def test_each_reset_generation_gets_the_budget_and_status_reports_the_given_back_pool(tmp_path):
    config = load_config(store_config(tmp_path, capacity=4 * SLOT, segment_size=2 * SLOT))
    store = NodeStore(config, "node0", executors=ManualExecutors("disk", "object"))
    try:
        for generation in range(3):  # the matrix's failing case: the third generation got nothing
            holder, namespace = f"engine-g{generation}", f"gen-{generation}"
            epoch = store.register(holder, namespace, SLOT).epoch
            pool = store.arena.pools[namespace]
            slots = pool.reserve(holder, 4)
            assert len(slots) == 4, f"generation {generation} got {len(slots)} of 4 slots"
            for i, slot in enumerate(slots):
                pool.view(slot)[:] = generation
            store.step(StepRequest(holder, namespace, epoch=epoch, commit=[(slot, key(i)) for i, slot in enumerate(slots)]))
            assert not store.step(StepRequest(holder, namespace, epoch=epoch, purge=True)).rejected  # reset_connector=True
            store.release_holder(holder, epoch)  # the old generation's manager shuts down
        stats = store.stats()
        old = stats["pools"]["gen-0"]
        assert old["segments"] == 0 and old["slots"] == 0 and old["segments_given_back"] == 1
        assert stats["allocated"] <= stats["capacity"]
        report = stats["report"]
        assert report["tiers"]["cpu"]["chunks"] == 0 and "gen-0" in report["namespaces"]
    finally:
        store.close()
