"""KV hints on the node store: retention in the arena's eviction order, pins within the
tenant's quota, and malformed hints refused with a reason, never raised."""

from __future__ import annotations

import pytest

from kvstrata.store.node_store import NodeStore
from kvstrata.protocol import StepRequest
from kvstrata.config import load_config
from tests.utils import FakeClock, key, layout, store_config

SLOT = 4096


@pytest.fixture
def store(tmp_path):
    made = []

    def make(capacity_slots: int = 8, prefetch: dict | None = None):
        raw = store_config(tmp_path, capacity=capacity_slots * SLOT, segment_size=capacity_slots * SLOT)
        raw["prefetch"] = prefetch or {}
        clock = FakeClock()
        made.append(NodeStore(load_config(raw), "node0", clock=clock))
        return made[-1], clock

    yield make
    for node in made:
        node.close()


def commit(node: NodeStore, keys: list[bytes], holder: str = "engine-a") -> str:
    """An engine stores `keys`, then lets them go (they stay resident, unpinned)."""
    ns = layout().namespace
    epochs = node.__dict__.setdefault("test_epochs", {})
    if holder not in epochs:
        epochs[holder] = node.register(holder, ns, SLOT, layout().describe()).epoch
    pool = node.arena.pools[ns]
    slots = pool.reserve(holder, len(keys))
    node.step(StepRequest(holder, ns, epoch=epochs[holder], commit=list(zip(slots, keys))))
    node.step(StepRequest(holder, ns, epoch=epochs[holder], unpin=slots))
    return epochs[holder]


def flood(node: NodeStore, count: int, first: int = 1000) -> None:
    """One-off prompts: another engine stores `count` new chunks and lets them go, one at a time."""
    for i in range(first, first + count):
        commit(node, [key(i)], holder="engine-flood")


def test_a_retained_prefix_outlives_a_flood_ten_times_the_arena_until_its_retention_ends(store):
    node, clock = store(capacity_slots=8)
    ns = layout().namespace
    system = [key(i) for i in range(3)]
    commit(node, system)
    assert node.retain(ns, system, 90, 3600) == {"retained": 3, "refused_full": 0, "ttl_cut": 0}
    flood(node, 80)
    pool = node.arena.pools[ns]
    assert all(k in pool for k in system)
    clock.advance(3601)  # the retention ran out: LRU takes it like any old chunk
    flood(node, 8, first=2000)
    assert not any(k in pool for k in system)


def test_without_a_retention_lru_loses_the_prefix(store):
    node, _ = store(capacity_slots=8)
    system = [key(i) for i in range(3)]
    commit(node, system)
    flood(node, 80)
    assert not any(k in node.arena.pools[layout().namespace] for k in system)


def test_eviction_takes_lower_priorities_first(store):
    node, _ = store(capacity_slots=4)
    ns = layout().namespace
    low, high = key(1), key(2)
    commit(node, [high, low])
    node.retain(ns, [low], 10, 60)
    node.retain(ns, [high], 60, 60)
    pool = node.arena.pools[ns]
    flood(node, 3)  # fills the pool: the unretained flood chunks go first
    assert low in pool and high in pool
    commit(node, [key(50), key(51), key(52)], holder="engine-b")  # 3 more, all pinned: low, then high
    assert low not in pool and high in pool


def test_pins_hold_chunks_within_the_tenants_pin_quota_until_unpinned(store):
    node, _ = store(capacity_slots=8, prefetch={"pin_share": 0.25})  # 2 slots of pins
    ns = layout().namespace
    keys = [key(i) for i in range(3)]
    commit(node, keys)
    assert node.pin_chunks(ns, keys) == {"resident": 2, "refused_quota": 1}
    flood(node, 40)
    pool = node.arena.pools[ns]
    assert keys[0] in pool and keys[1] in pool and keys[2] not in pool
    assert node.unpin_chunks(ns, keys) == 2
    flood(node, 40, first=5000)
    assert keys[0] not in pool


def test_malformed_hints_are_refused_with_a_reason_and_counted(store):
    node, _ = store()
    ns = layout().namespace
    commit(node, [key(1)])
    outcomes = node.apply_hints(
        ns,
        [
            {"action": "kv.retain", "keys": [key(1)], "priority": 50, "ttl_seconds": 60},
            {"action": "kv.evaporate", "keys": [key(1)]},
            {"action": "kv.retain", "keys": [key(1)], "priority": 500, "ttl_seconds": 60},
            {"action": "kv.prefetch", "keys": "not keys"},
            "not a mapping",
            {"action": "unpin", "keys": [key(1)]},
        ],
    )
    assert [o["ok"] for o in outcomes] == [True, False, False, False, False, True]
    assert "unknown action 'kv.evaporate'" in outcomes[1]["error"]
    assert "priority" in outcomes[2]["error"] and "hint action 3" in outcomes[3]["error"]
    assert node.counters["hints_refused"] == 4 and node.counters["hints_applied"] == 2
    assert node.retention_priority(ns, key(1)) == 50


def test_a_retention_ttl_over_the_longest_allowed_is_cut_and_counted(store):
    node, clock = store(prefetch={"max_retain_seconds": 60})
    ns = layout().namespace
    assert node.retain(ns, [key(1)], 50, 86400)["ttl_cut"] == 1
    clock.advance(61)
    assert node.retention_priority(ns, key(1)) == 0
