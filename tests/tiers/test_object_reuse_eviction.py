"""The object tier's capacity sweep weighs estimated reuse (issue #28, cost-based admission):
of the oldest few objects the least reused go first, so a prefix every request shares
outlives one-off prompts written after it; without a reuse estimate, age alone, as before.
Over fsspec's in-memory filesystem, with write times set by hand."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import numpy as np
import pytest

from kvstrata.store.node_store import NodeStore
from kvstrata.config import ObjectTierConfig, load_config
from kvstrata.tiers.disk import HEADER_BYTES
from kvstrata.tiers.object_store import ObjectTier
from kvstrata.tiers.reuse_eviction import REUSE_EVICTION_WINDOW
from tests.utils import FakeClock, key, reuse_estimate, store_config

NS = "ns-test"
OTHER = "other"
SIZE = 4096
RECORD = HEADER_BYTES + SIZE
BASE = datetime(2026, 1, 1, tzinfo=timezone.utc)


def chunk(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, SIZE, dtype=np.uint8)


def tier_with(url: str, capacity_records: int) -> ObjectTier:
    return ObjectTier(ObjectTierConfig(url=url, capacity=capacity_records * RECORD), clock=FakeClock())


def store_in_age_order(tier: ObjectTier, written: list[tuple[str, bytes]]) -> None:
    """Upload each (namespace, key), then date them a minute apart: the first is the oldest."""
    for age, (namespace, k) in enumerate(written):
        assert tier.put_many(namespace, [(k, chunk(age))]) == [True]
        tier.fs.store[tier.object_path(namespace, k)].created = BASE + timedelta(minutes=age)


def sweep(tier: ObjectTier) -> set[tuple[str, bytes]]:
    """One sweep; what stays, as the sweep says and as the bucket holds it."""
    kept = {(e.namespace, e.key) for e in tier.apply_limits(tier.scan())}
    assert {(e.namespace, e.key) for e in tier.scan()} == kept
    return kept


@pytest.mark.parametrize("with_reuse", [False, True], ids=["age", "reuse"])
def test_a_sweep_evicts_one_offs_before_older_reused_chunks(memory_bucket, with_reuse):
    tier = tier_with(memory_bucket, capacity_records=3)
    reused, one_offs = [key(0), key(1), key(2)], [key(3), key(4), key(5)]  # the reused are the oldest
    store_in_age_order(tier, [(NS, k) for k in reused + one_offs])
    asked = []
    if with_reuse:
        tier.reuse_of = reuse_estimate(reused, asked)
    kept = sweep(tier)
    assert kept == {(NS, k) for k in (reused if with_reuse else one_offs)}
    assert tier.counters["evicted"] == 3
    if with_reuse:
        assert asked == [(NS, reused + one_offs)]  # one window, one question per namespace
    tier.close()


def test_without_a_reuse_estimate_the_oldest_written_go_across_namespaces(memory_bucket):
    """reuse_of None: exactly the age order of before, over more objects than one window."""
    count = 2 * REUSE_EVICTION_WINDOW + 3
    written = [(NS if i % 3 else OTHER, key(i)) for i in range(count)]
    tier = tier_with(memory_bucket, capacity_records=5)
    store_in_age_order(tier, written)
    assert tier.reuse_of is None
    assert sweep(tier) == set(written[-5:])
    assert tier.counters["evicted"] == count - 5
    tier.close()


def test_age_still_rules_beyond_the_window(memory_bucket):
    """A one-off younger than the oldest window is not evicted before any of that window:
    reused chunks are protected only against chunks of their own window."""
    window = REUSE_EVICTION_WINDOW
    written = [(NS, key(i)) for i in range(2 * window)]
    one_off = key(window)  # the oldest of the second window
    tier = tier_with(memory_bucket, capacity_records=2 * window - 1)
    store_in_age_order(tier, written)
    tier.reuse_of = lambda namespace, keys: [1 if k == one_off else 9 for k in keys]
    assert sweep(tier) == set(written[1:])  # the first window is all reused alike: its oldest goes
    tier.close()
    # One older chunk gone, the one-off is among the oldest few: it goes before older reused ones.
    tier = tier_with(memory_bucket, capacity_records=2 * window - 2)
    tier.reuse_of = lambda namespace, keys: [1 if k == one_off else 9 for k in keys]
    assert sweep(tier) == set(written[1:window] + written[window + 1 :])
    tier.close()


def test_a_window_spanning_namespaces_asks_each_namespace_about_its_own_keys(memory_bucket):
    uses = {(NS, key(0)): 7, (OTHER, key(1)): 1, (NS, key(2)): 1, (OTHER, key(3)): 7, (NS, key(4)): 7}
    tier = tier_with(memory_bucket, capacity_records=3)
    store_in_age_order(tier, list(uses))
    asked = []

    def reuse_of(namespace, keys):
        asked.append(namespace)
        return [uses[(namespace, k)] for k in keys]  # a key asked under another namespace: KeyError

    tier.reuse_of = reuse_of
    assert sweep(tier) == {(NS, key(0)), (OTHER, key(3)), (NS, key(4))}
    assert sorted(asked) == [NS, OTHER]
    tier.close()


def test_a_one_off_anchor_takes_its_dependents_with_it(memory_bucket):
    """A hybrid model's full-attention chunk evicted as a one-off still takes its position's
    other groups (dead weight without it), though they look more reused; each goes once."""
    tier = tier_with(memory_bucket, capacity_records=2)
    tier.set_anchor_groups(NS, [0])
    anchor, dependents = key(9, group=0), [key(9, group=1), key(9, group=2)]
    reused = [key(1), key(2), key(3)]
    # The anchor and its dependents are younger than two reused chunks and older than one.
    store_in_age_order(tier, [(NS, k) for k in [reused[0], reused[1], anchor, *dependents, reused[2]]])
    counts = {anchor: 1, dependents[0]: 2, dependents[1]: 2}
    tier.reuse_of = lambda namespace, keys: [counts.get(k, 5) for k in keys]
    # Four must go: the anchor with its two dependents, then the oldest of the reused.
    assert sweep(tier) == {(NS, reused[1]), (NS, reused[2])}
    assert tier.counters["evicted"] == 2 and tier.counters["evicted_with_anchor"] == 2
    tier.close()


@pytest.mark.parametrize("object_admission", ["reuse", "always"])
def test_the_node_store_hands_its_reuse_sketch_to_the_object_tier(tmp_path, memory_bucket, object_admission):
    """The sweep weighs the same estimate as the disk's evictions, and only while the store
    keeps a sketch (some tier on `admission.store: reuse`)."""
    disk = {"path": str(tmp_path / "disk"), "capacity": 16 * RECORD}
    raw = store_config(tmp_path, capacity=8 * SIZE, reserve_slots=2, disk=disk)
    raw["tiers"]["object"] = {"url": memory_bucket}
    raw["admission"] = {"store": {"disk": "always", "object": object_admission, "min_uses": 2, "window": 4096}}
    store = NodeStore(load_config(raw), "node0")
    try:
        assert store.object is not None and store.disk is not None
        if object_admission == "always":
            assert store.object.reuse_of is None and store.disk.reuse_of is None
        else:
            assert store.object.reuse_of is not None
            assert store.object.reuse_of == store.disk.reuse_of
            assert list(store.object.reuse_of(NS, [key(1)])) == [0]  # never used: a one-off
    finally:
        store.close()
