"""Prefetch with a lease on the node store (issue #41): dedup, budget, break-even, lease
expiry and release on first use.

The store runs in process on `ManualExecutor`s (the executor seam): each test decides when
a promotion's disk read lands, and a fake clock when a lease runs out. No threads, no sleeps.
"""

from __future__ import annotations

import pytest

from kvstrata._dev.executors import ManualExecutors
from kvstrata.store.node_store import NodeStore
from kvstrata.store.prefetch import PREFETCH
from kvstrata.protocol import StepRequest
from kvstrata.config import load_config
from kvstrata.tiers.disk import HEADER_BYTES
from tests.utils import FakeClock, key, layout, store_config

SLOT = 4096
KEYS = [key(i) for i in range(8)]


@pytest.fixture
def store(tmp_path):
    made = []

    def make(capacity_slots: int = 16, prefetch: dict | None = None, admission: dict | None = None):
        disk = {"path": str(tmp_path / "disk"), "capacity": 64 * (SLOT + HEADER_BYTES), "write_policy": "write_through"}
        raw = store_config(tmp_path, capacity=capacity_slots * SLOT, segment_size=capacity_slots * SLOT, disk=disk)
        raw["prefetch"] = prefetch or {}
        raw["admission"] = admission or {"load": "always"}
        clock = FakeClock()
        executors = ManualExecutors("disk")
        node = NodeStore(load_config(raw), "node0", clock=clock, executors=executors)
        made.append((node, executors))
        return node, executors, clock

    yield make
    for node, executors in made:
        executors.run_all()
        node.close()


def on_disk_only(node: NodeStore, executors: ManualExecutors, keys: list[bytes], namespace: str) -> str:
    """An engine stores `keys` (each slot filled with its index), the cascade writes them to
    disk, then the arena forgets them: they are on disk only. Returns the engine's epoch."""
    reg = node.register("engine-a", namespace, SLOT, layout().describe())
    pool = node.arena.pools[namespace]
    slots = pool.reserve("engine-a", len(keys))
    for index, slot in enumerate(slots):
        pool.view(slot)[:] = index + 1
    node.step(StepRequest("engine-a", namespace, epoch=reg.epoch, commit=list(zip(slots, keys))))
    executors.run_all()
    pool.drop_holder("engine-a")
    pool.purge()
    assert not any(k in pool for k in keys)
    return reg.epoch


def held(node: NodeStore, namespace: str, k: bytes) -> bool:
    pool = node.arena.pools[namespace]
    slot = pool.lookup(k)
    return slot is not None and PREFETCH in pool._pins.get(slot, ())


def test_two_prefetches_of_one_prefix_move_it_once(store):
    node, executors, _ = store()
    ns = layout().namespace
    on_disk_only(node, executors, KEYS[:4], ns)
    first = node.prefetch(ns, KEYS[:4])
    second = node.prefetch(ns, KEYS[:4])
    assert first == {"moving": 4} and second == {"joined": 4}
    reads_before = node.counters["disk_promotions"]
    executors.run_all()
    assert node.counters["disk_promotions"] - reads_before == 4  # each chunk read once
    assert node.counters["prefetch_moved"] == 4
    assert all(held(node, ns, k) for k in KEYS[:4])
    pool = node.arena.pools[ns]
    assert [int(pool.view(pool.lookup(k))[0]) for k in KEYS[:4]] == [1, 2, 3, 4]  # the bytes stored, in place
    # Held chunks are not moved again, and an engine's own promotion joins the prefetch's.
    assert node.prefetch(ns, KEYS[:4]) == {"joined": 4}
    assert not executors["disk"].pending


def test_prefix_stops_at_the_first_chunk_no_tier_holds(store):
    node, executors, _ = store()
    ns = layout().namespace
    on_disk_only(node, executors, KEYS[:2] + KEYS[3:5], ns)
    report = node.prefetch(ns, KEYS[:5])
    assert report == {"moving": 2, "refused_absent": 3}  # KEYS[3:5] are past the hole at KEYS[2]
    assert node.prefetch("unknown-ns", KEYS[:2]) == {"refused_unknown_namespace": 2}


def test_budget_bounds_what_prefetches_hold_and_never_evicts_a_held_chunk(store):
    node, executors, _ = store(capacity_slots=16, prefetch={"max_share": 0.25})  # 4 slots
    ns = layout().namespace
    on_disk_only(node, executors, KEYS[:8], ns)
    assert node.prefetch(ns, KEYS[:6]) == {"moving": 4, "refused_budget": 2}
    executors.run_all()
    assert node.prefetch(ns, KEYS[6:8]) == {"refused_budget": 2}
    # Another engine takes every slot it can: the held chunks stay.
    pool = node.arena.pools[ns]
    taken = pool.reserve("engine-b", 64)
    assert len(taken) == 12 and all(held(node, ns, k) for k in KEYS[:4])


def test_a_full_arena_of_pinned_chunks_refuses_rather_than_waits(store):
    node, executors, _ = store(capacity_slots=4, prefetch={"max_share": 1.0})
    ns = layout().namespace
    on_disk_only(node, executors, KEYS[:2], ns)
    node.arena.pools[ns].reserve("engine-b", 4)  # everything reserved by an engine
    assert node.prefetch(ns, KEYS[:2]) == {"refused_no_slot": 2}


def test_first_use_releases_the_hold_and_counts_it(store):
    node, executors, _ = store()
    ns = layout().namespace
    epoch = on_disk_only(node, executors, KEYS[:3], ns)
    node.prefetch(ns, KEYS[:3])
    executors.run_all()
    pool = node.arena.pools[ns]
    # The engine's first lookup answers HIT from its mirror and sends the hold (key, slot).
    reply = node.step(StepRequest("engine-a", ns, epoch=epoch, hold=[(KEYS[0], pool.lookup(KEYS[0]))], pin=[KEYS[1]]))
    assert not reply.rejected and KEYS[1] in reply.pinned
    assert node.counters["prefetch_used"] == 2
    assert not held(node, ns, KEYS[0]) and not held(node, ns, KEYS[1]) and held(node, ns, KEYS[2])


def test_a_lease_runs_out_unused_and_the_chunk_is_left_to_eviction(store):
    node, executors, clock = store(prefetch={"lease_seconds": 5})
    ns = layout().namespace
    epoch = on_disk_only(node, executors, KEYS[:2], ns)
    node.prefetch(ns, KEYS[:2], deadline_s=3)
    executors.run_all()
    clock.advance(7.9)  # before deadline + lease
    node.step(StepRequest("engine-a", ns, epoch=epoch))
    assert held(node, ns, KEYS[0]) and node.counters["prefetch_expired_unused"] == 0
    clock.advance(0.2)
    node.step(StepRequest("engine-a", ns, epoch=epoch))
    assert not held(node, ns, KEYS[0]) and KEYS[0] in node.arena.pools[ns]  # resident, unheld
    assert node.counters["prefetch_expired_unused"] == 2
    assert node.counters["prefetch_expired_unused_bytes"] == 2 * SLOT
    assert node.counters["prefetch_used"] == 0
    assert len(node.arena.pools[ns].reserve("engine-b", 64)) == 16  # its slots are an engine's to take again


def test_a_prefetch_whose_request_never_comes_frees_its_slots_also_when_its_move_lands_late(store):
    # A cancelled request's prefetch costs at most its lease: here the lease ends while
    # the chunks are still on their way; once they land they are not held.
    node, executors, clock = store(prefetch={"lease_seconds": 1})
    ns = layout().namespace
    epoch = on_disk_only(node, executors, KEYS[:3], ns)
    assert node.prefetch(ns, KEYS[:3]) == {"moving": 3}
    clock.advance(2)
    executors.run_all()  # landed after the lease ended
    node.step(StepRequest("engine-a", ns, epoch=epoch))
    assert not node.prefetch_holds(ns) and node.prefetch_pending(ns) == 0
    assert node.counters["prefetch_expired_unused"] == 3 and node.counters["prefetch_used"] == 0
    assert len(node.arena.pools[ns].reserve("engine-b", 64)) == 16
    assert node.arena.pools[ns].stats()["pinned"] == 0


def test_a_second_prefetch_extends_the_lease(store):
    node, executors, clock = store(prefetch={"lease_seconds": 5})
    ns = layout().namespace
    epoch = on_disk_only(node, executors, KEYS[:1], ns)
    node.prefetch(ns, KEYS[:1])
    executors.run_all()
    clock.advance(4)
    assert node.prefetch(ns, KEYS[:1]) == {"joined": 1}
    clock.advance(4)
    node.step(StepRequest("engine-a", ns, epoch=epoch))
    assert held(node, ns, KEYS[0])


def test_break_even_skips_a_tier_slower_than_recomputing(store):
    node, executors, _ = store(admission={"load": "break_even", "stale_seconds": 1e9})
    ns = layout().namespace
    epoch = on_disk_only(node, executors, KEYS[:2], ns)
    node.step(StepRequest("engine-a", ns, epoch=epoch, recompute_tokens_per_second=1e6))
    for _ in range(4):  # the disk delivers 1 KB/s: loading 2 chunks takes ~8 s, recomputing 64 tokens 64 us
        node.tier_estimates.observe("disk", 1024, 1.0)
    assert node.prefetch(ns, KEYS[:2]) == {"refused_break_even": 2}
    assert node.counters["prefetch_refused_break_even"] == 2


def test_a_purge_drops_holds_and_wants(store):
    node, executors, _ = store()
    ns = layout().namespace
    epoch = on_disk_only(node, executors, KEYS[:2], ns)
    node.prefetch(ns, KEYS[:1])
    executors.run_all()
    node.prefetch(ns, KEYS[1:2])  # on its way
    node.step(StepRequest("engine-a", ns, epoch=epoch, purge=True))
    executors.run_all()
    pool = node.arena.pools[ns]
    assert not node.prefetch_holds(ns) and KEYS[0] not in pool and KEYS[1] not in pool
    assert pool.stats()["pinned"] == 0


@pytest.mark.parametrize(
    "bad, named",
    [("notalist", "list of chunk keys"), ([b"xy"], "prefetch key 0"), ([KEYS[0], 7], "prefetch key 1")],
)
def test_bad_keys_are_named(store, bad, named):
    node, _, _ = store()
    with pytest.raises(ValueError, match=named):
        node.prefetch(layout().namespace, bad)
    with pytest.raises(ValueError, match="lease_s"):
        node.prefetch(layout().namespace, KEYS[:1], lease_s=0)


def test_a_move_waits_for_the_slots_it_evicted_and_starts_at_the_next_engine_step(store):
    node, executors, _ = store(capacity_slots=4, prefetch={"max_share": 1.0})
    ns = layout().namespace
    on_disk_only(node, executors, KEYS[:2], ns)
    reg = node.register("engine-w", ns, SLOT, layout().describe(), watch=True)  # answers HITs from a mirror
    pool = node.arena.pools[ns]
    slots = pool.reserve("engine-w", 4)
    node.step(StepRequest("engine-w", ns, epoch=reg.epoch, commit=list(zip(slots, KEYS[4:8])), known_seq=reg.seq))
    reply = node.step(StepRequest("engine-w", ns, epoch=reg.epoch, unpin=slots, known_seq=reg.seq))
    executors.run_all()  # their copies to disk done: nothing pins them
    assert node.prefetch(ns, KEYS[:2]) == {"waiting": 2}  # evicted two; they free once the engine saw them go
    assert node.prefetch_pending(ns) == 2 and not executors["disk"].pending
    seen = node.step(StepRequest("engine-w", ns, epoch=reg.epoch, known_seq=reply.seq))  # the evictions, in its view
    node.step(StepRequest("engine-w", ns, epoch=reg.epoch, known_seq=seen.seq))  # acknowledged: their slots free
    executors.run_all()
    assert node.prefetch_pending(ns) == 0 and all(held(node, ns, k) for k in KEYS[:2])
