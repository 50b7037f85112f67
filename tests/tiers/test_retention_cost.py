"""Evictions cost O(1) per chunk whatever is retained (issue #51, finding 7): counted, not
timed -- the candidates an eviction reads and the retention lookups it makes, in the
arena (through `NodeStore`) and on disk, with all but a few chunks retained."""

from __future__ import annotations

import numpy as np

from kvstrata.store.node_store import NodeStore
from kvstrata.protocol import StepRequest
from kvstrata.config import load_config
from kvstrata.tiers.disk import HEADER_BYTES, DiskTier
from kvstrata.tiers.policies import LRUPolicy
from kvstrata.tiers.retention import RetentionTable
from kvstrata.tiers.retention_order import RetentionOrder
from tests.utils import FakeClock, key, layout, store_config

SLOT = 4096
CHUNK = 4096


def counting(table: RetentionTable) -> list[int]:
    """Count the table's lookups from now on (every eviction order asks through these)."""
    calls = [0]
    for name in ("priority", "entry"):
        real = getattr(table, name, None)
        if real is None:
            continue

        def counted(*args, _real=real):
            calls[0] += 1
            return _real(*args)

        setattr(table, name, counted)
    return calls


def test_arena_evictions_read_no_retained_chunk_before_an_unretained_one(tmp_path):
    slots = 1024
    raw = store_config(tmp_path, capacity=slots * SLOT, segment_size=slots * SLOT)
    node = NodeStore(load_config(raw), "node0", clock=FakeClock())
    try:
        ns = layout().namespace
        epoch = node.register("engine-a", ns, SLOT, layout().describe()).epoch
        pool = node.arena.pools[ns]
        keys = [key(i) for i in range(slots)]
        taken = pool.reserve("engine-a", slots)
        node.step(StepRequest("engine-a", ns, epoch=epoch, commit=list(zip(taken, keys))))
        node.step(StepRequest("engine-a", ns, epoch=epoch, unpin=taken))
        node.retain(ns, keys[: slots - 64], 50, 3600)  # the oldest 960 retained, the newest 64 not
        lookups = counting(node.hints._retention)
        visited = getattr(pool.policy, "visited", 0)
        assert len(pool.reserve("engine-b", 32)) == 32
        read = (getattr(pool.policy, "visited", 0) - visited) + lookups[0]
        assert read <= 2 * 32, f"32 evictions read {read} candidates or retention lookups"
        assert all(k in pool for k in keys[: slots - 64])  # and took none of the retained
    finally:
        node.close()


def test_disk_evictions_read_no_retained_record_before_an_unretained_one(tmp_path):
    records = 1024
    clock = FakeClock()
    table = RetentionTable(clock)
    tier = DiskTier(tmp_path, records * (HEADER_BYTES + CHUNK))
    try:
        data = np.full(CHUNK, 3, dtype=np.uint8)
        keys = [key(i) for i in range(records)]
        assert all(tier.write_many("ns", [(k, data) for k in keys]))
        tier.use_retention(table)
        table.retain("ns", keys[: records - 64], 50, 3600)
        lookups = counting(table)
        policy = tier._slabs["ns"].policy
        visited = policy.visited
        assert all(tier.write_many("ns", [(key(10_000 + i), data) for i in range(32)]))
        read = (policy.visited - visited) + lookups[0]
        assert read <= 3 * 32, f"32 evictions read {read} candidates or retention lookups"
        assert set(keys[: records - 64]) <= set(tier.keys("ns"))
    finally:
        tier.close()


def test_an_ended_retention_rejoins_the_order_where_its_use_puts_it():
    clock = FakeClock()
    table = RetentionTable(clock)
    slots = {n: key(n) for n in range(6)}
    order = RetentionOrder(LRUPolicy(), slots.get, lambda k: table.entry("ns", k), table.clock)
    table.listeners.append(lambda ns, keys: [order.refresh(s) for s, k in slots.items() if k in keys])
    for slot in slots:
        order.add(slot)
    table.retain("ns", [slots[0], slots[1]], 50, 10)
    table.retain("ns", [slots[2]], 20, 100)
    assert list(order.candidates()) == [3, 4, 5, 2, 0, 1]  # unretained, then priority 20, then 50
    order.touch(1)  # used while retained
    clock.advance(11)  # 0 and 1 ended: 0 unused is the oldest, 1 used is the newest
    assert list(order.candidates()) == [0, 3, 4, 5, 1, 2]
    table.release("ns", [slots[2]])
    assert list(order.candidates())[-1] != 2 and order.retained() == 0
    order.remove(4)
    assert 4 not in list(order.candidates())
