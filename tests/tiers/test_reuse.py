"""Deferred slot reuse, step by step: a HIT answered from a mirror reads its chunk's bytes.

Each test plays one interleaving of an engine (a *watcher* that answers HIT from its
mirror and sends its pin later), the store's eviction, and another engine reusing
slots, in a fixed order: no threads, no sleeps.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvstrata.tiers.arena import Arena
from kvstrata.tiers.changelog import CPU, ChangeLog
from kvstrata.tiers.reuse import DeferredReuse
from tests.tiers.test_arena import SLOT, fill
from tests.utils import FakeClock, key

LEASE = 10


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def pool(tmp_path, clock):
    """A 4-slot pool whose index changes go to a change log, as in the node store."""
    arena = Arena(str(tmp_path), "node0", capacity=4 * SLOT, segment_size=4 * SLOT, lease_seconds=LEASE, prefault=False, clock=clock)
    pool = arena.pool("ns", SLOT)
    log = ChangeLog()
    pool.on_change = lambda keys, present: log.record_many(keys, CPU, present)
    pool.reuse.seq = lambda: log.seq
    pool.log = log
    yield pool
    arena.close()


def overwrite_every_slot_another_engine_gets(pool, holder="other", count=4) -> list[int]:
    """Another engine takes whatever slots it can and scribbles over them."""
    slots = pool.reserve(holder, count)
    for slot in slots:
        pool.view(slot)[:] = 0xEE
    return slots


def test_a_slot_evicted_after_a_mirror_hit_is_not_reused_before_the_engine_records_its_pin(pool):
    written = fill(pool, "writer", [key(i) for i in range(4)])
    pool.unpin("writer", [pool.lookup(k) for k in written])
    pool.watch("engine", pool.log.seq)  # the engine's mirror: all four resident
    hit_key = key(0)
    hit_slot = pool.lookup(hit_key)  # HIT from the mirror, no store call

    # The store evicts everything for another engine, which writes over what it gets.
    taken = overwrite_every_slot_another_engine_gets(pool)
    assert hit_slot not in taken and len(taken) == 0  # all four wait for the engine
    assert pool.stats()["awaiting_reuse"] == 4

    # The engine's next control call: its pin first, then its acknowledgement.
    assert pool.hold("engine", [(hit_key, hit_slot)]) == []
    pool.acknowledge("engine", pool.log.seq)
    taken = overwrite_every_slot_another_engine_gets(pool)
    assert hit_slot not in taken and len(taken) == 3
    assert np.array_equal(pool.view(hit_slot), written[hit_key])  # the load reads the chunk

    # Its load completes; the engine has seen the eviction already, so the slot is free.
    pool.unpin("engine", [hit_slot])
    assert overwrite_every_slot_another_engine_gets(pool, count=1) == [hit_slot]


def test_without_a_watcher_the_same_interleaving_reuses_the_slot_at_once(pool):
    """The control: this is what deferred reuse prevents."""
    written = fill(pool, "writer", [key(i) for i in range(4)])
    pool.unpin("writer", [pool.lookup(k) for k in written])
    hit_slot = pool.lookup(key(0))
    assert hit_slot in overwrite_every_slot_another_engine_gets(pool)
    assert not np.array_equal(pool.view(hit_slot), written[key(0)])


def test_a_pin_for_a_slot_that_was_reused_is_refused_and_named(pool):
    written = fill(pool, "writer", [key(i) for i in range(4)])
    pool.unpin("writer", [pool.lookup(k) for k in written])
    stale_slot = pool.lookup(key(0))
    overwrite_every_slot_another_engine_gets(pool)  # nobody watched: reused
    refused = pool.hold("late", [(key(0), stale_slot)])
    assert len(refused) == 1 and key(0).hex()[:8] in refused[0] and "ns" in refused[0]
    assert pool.stats()["holds_refused"] == 1


def test_an_engine_that_dies_between_hit_and_pin_holds_slots_only_until_its_lease_ends(pool, clock):
    written = fill(pool, "writer", [key(i) for i in range(4)])
    pool.unpin("writer", [pool.lookup(k) for k in written])
    pool.arena.renew("engine")
    pool.watch("engine", pool.log.seq)
    assert overwrite_every_slot_another_engine_gets(pool) == []  # all wait for the engine
    clock.advance(LEASE + 1)
    pool.arena.expire()  # the dead engine is forgotten: what waited on it is free
    assert len(overwrite_every_slot_another_engine_gets(pool)) == 4
    assert pool.stats()["watchers"] == 0


def test_a_chunk_reindexed_elsewhere_still_lets_the_old_slot_be_held_for_the_old_hit(pool):
    written = fill(pool, "writer", [key(i) for i in range(4)])
    pool.unpin("writer", [pool.lookup(k) for k in written])
    pool.watch("engine", pool.log.seq)
    old_slot = pool.lookup(key(0))
    pool.purge()  # everything leaves the index (a reset by another engine)
    pool.acknowledge("other-engine-not-a-watcher", pool.log.seq)  # ignored: not a watcher
    assert pool.stats()["awaiting_reuse"] == 4
    assert pool.hold("engine", [(key(0), old_slot)]) == []
    assert np.array_equal(pool.view(old_slot), written[key(0)])


def test_entries_leave_in_order_and_a_slot_retired_again_waits_for_its_new_sequence():
    seq = [5]
    reuse = DeferredReuse(lambda: seq[0])
    reuse.watch("a", 4)
    assert reuse.retire(1, b"k1")
    seq[0] = 6
    assert reuse.retire(2, b"k2")
    assert reuse.claim(1, b"k1") and not reuse.claim(2, b"other")
    seq[0] = 7
    assert reuse.retire(1, b"k1")  # pinned and unpinned again: waits for 7 now
    assert reuse.acknowledge("a", 6) == [2]
    assert reuse.acknowledge("a", 7) == [1]
    assert len(reuse) == 0 and reuse.peak == 2
    assert not reuse.retire(3, b"k3")  # everyone has seen 7 already: free at once
