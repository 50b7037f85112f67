"""Found by the exactness matrix (issue 50): the arena's budget stays with a namespace's
pool after the namespace is purged, so on a full arena a new namespace gets no slot.

In the matrix, an engine's second `reset_prefix_cache(reset_connector=True)` on a 4 MiB
arena: every reset starts a new namespace (`connector/weight_updates.py`) and purges the
old one, but the purged pools kept their segments (2 x 16 free slots each) and the third
generation's pool got none (`reserve_shortfall` 1,600): from then on the engine stored
nothing and every request was a miss (right answers, no cache) until the store restarts.
The same happens to any new namespace (another model, another tenant) once the arena's
budget was handed out. Fixed: a wholly idle pool gives its segments back when another
pool needs budget (`kvstrata.tiers.giveback`); its segment numbers, hence file names and
slot numbers, are never reused, so a worker's stale mapping is never resolved again.
"""

from __future__ import annotations

import pytest

import os

import numpy as np

from kvstrata.tiers.arena import Arena, SlotError
from kvstrata.tiers.shm import SharedMemoryFile
from tests.tiers.test_arena import SLOT, fill
from tests.utils import FakeClock, key


@pytest.fixture
def arena(tmp_path):
    arena = Arena(str(tmp_path), "node0", capacity=4 * SLOT, segment_size=2 * SLOT, lease_seconds=10, prefault=False, clock=FakeClock())
    yield arena
    arena.close()


def test_a_new_namespace_gets_slots_once_the_old_one_is_purged(arena):
    old = arena.pool("old", SLOT)
    keys = [key(i) for i in range(4)]
    fill(old, "engine-g0", keys)  # the whole budget: two segments
    old.unpin("engine-g0", [old.lookup(k) for k in keys])  # the writer's pins, dropped once stored
    assert old.purge() == 4
    assert old.stats()["free"] == 4  # nothing of the old namespace is left
    new = arena.pool("new", SLOT)
    assert new.reserve("engine-g1", 2), "the new namespace got no slot from a budget only empty pools hold"


def _segment_paths(pool):
    return {pool.geometry.segment_path(number) for number in pool.segments}


def _full_old_pool(arena, namespace="old"):
    """A pool of four committed chunks (the fixture's whole budget: two segments), its writer's pins dropped."""
    old = arena.pool(namespace, SLOT)
    keys = [key(i) for i in range(4)]
    fill(old, "engine-g0", keys)
    old.unpin("engine-g0", [old.lookup(k) for k in keys])
    return old, keys


def test_a_worker_mapping_a_given_back_segment_never_sees_another_chunk_through_it(arena):
    old, keys = _full_old_pool(arena)
    old_paths = _segment_paths(old)
    # A worker of the old generation mapped both segments (as `ArenaMap` does) and keeps them.
    mapped = {path: SharedMemoryFile.attach(path) for path in old_paths}
    before = {path: segment.array.copy() for path, segment in mapped.items()}
    try:
        old.purge()
        new = arena.pool("new", SLOT)
        new_keys = [key(100 + i) for i in range(4)]
        fill(new, "engine-g1", new_keys, seed=1)
        assert old.stats()["segments"] == 0 and old.stats()["segments_given_back"] == 1
        assert not any(os.path.exists(path) for path in old_paths)  # unlinked: no one maps them again
        assert not _segment_paths(new) & old_paths
        # The old namespace grows again (an engine still watching it stores): new segment
        # numbers, so every new slot resolves to a file no worker mapped before.
        new.unpin("engine-g1", [new.lookup(k) for k in new_keys])
        new.purge()
        back = fill(old, "engine-g0b", [key(200 + i) for i in range(4)], seed=2)
        for k in back:
            slot = old.lookup(k)
            assert old.geometry.segment_path(old.geometry.locate(slot)[0]) not in old_paths
        with pytest.raises(SlotError):
            old.view(0)  # a slot of a given-back segment names no bytes any more
        for path, segment in mapped.items():  # the stale mappings saw none of the later bytes
            assert np.array_equal(segment.array, before[path])
    finally:
        for segment in mapped.values():
            segment.close()


def _pinned(old, keys):
    old.pin("reader", keys[:1])


def _reserved(old, keys):
    old.purge()
    assert old.reserve("late-writer", 1)


def _held(old, keys):
    old.reuse.seq = lambda: 5
    old.watch("watcher", 0)
    slot = old.lookup(keys[0])
    old.purge()
    assert not old.hold("watcher", [(keys[0], slot)])  # a HIT answered from its mirror before the purge


def _unacknowledged(old, keys):
    old.reuse.seq = lambda: 5
    old.watch("watcher", 0)


@pytest.mark.parametrize("keeper", [_pinned, _reserved, _held, _unacknowledged])
def test_a_pool_with_a_pinned_held_reserved_or_unacknowledged_slot_keeps_its_segments(arena, keeper):
    old, keys = _full_old_pool(arena)
    old_paths = _segment_paths(old)
    keeper(old, keys)
    old.purge()
    new = arena.pool("new", SLOT)
    assert new.reserve("engine-g1", 2) == []
    assert old.stats()["segments"] == 2 and old.stats()["segments_given_back"] == 0
    assert all(os.path.exists(path) for path in old_paths)
    # Once the last of them lets go, the budget moves.
    for holder in ("reader", "late-writer", "watcher"):
        arena.release_holder(holder)
    assert len(new.reserve("engine-g1", 2)) == 2
    assert not any(os.path.exists(path) for path in old_paths)


def test_an_unacknowledged_purge_gives_back_once_the_watcher_acknowledges(arena):
    old, keys = _full_old_pool(arena)
    old.reuse.seq = lambda: 5
    old.watch("watcher", 0)
    old.purge()
    new = arena.pool("new", SLOT)
    assert new.reserve("engine-g1", 1) == []
    old.acknowledge("watcher", 5)
    assert len(new.reserve("engine-g1", 1)) == 1


def test_a_tenants_purged_generation_gives_its_quota_to_the_next_and_spares_other_tenants(tmp_path):
    arena = Arena(str(tmp_path), "node0", capacity=16 * SLOT, segment_size=2 * SLOT, lease_seconds=10,
                  prefault=False, clock=FakeClock(), quotas={"a": 4 * SLOT})  # fmt: skip
    try:
        for namespace, tenant in [("a-g0", "a"), ("a-g1", "a"), ("b", "b")]:
            arena.quotas.assign(namespace, tenant)
        idle_other = arena.pool("b", SLOT)
        fill(idle_other, "engine-b", [key(50)])
        idle_other.unpin("engine-b", [idle_other.lookup(key(50))])
        idle_other.purge()  # idle, but the budget is not short: it keeps its segment
        old, keys = _full_old_pool(arena, "a-g0")
        old.purge()
        new = arena.pool("a-g1", SLOT)
        assert len(new.reserve("engine-a1", 4)) == 4  # the quota, not the budget, was short
        assert old.stats()["segments"] == 0 and idle_other.stats()["segments"] == 1
        assert arena.quotas.usage()["a"]["used"] == 4 * SLOT
    finally:
        arena.close()



# Found by the covering run of 28 Nov 2026: the matrix's TP 2 engine filled the arena with
# its namespace's chunks and stopped; every TP 1 engine after it (another namespace) stored
# nothing, since a pool holding chunks kept its budget for good. An abandoned pool (no
# engine watches it, none reserved in it) now drains when another namespace needs budget.


def test_a_stopped_engines_chunks_make_room_for_another_namespace(arena):
    old, keys = _full_old_pool(arena)
    old.watch("engine-tp2", 0)
    new = arena.pool("new", SLOT)
    assert new.reserve("engine-tp1", 2) == []  # its engine lives: first come, first served
    assert len(old) == 4
    arena.release_holder("engine-tp2")  # the engine stopped
    got = new.reserve("engine-tp1", 2)
    assert len(got) == 2, "a namespace no engine watches kept the whole budget"
    assert len(old) == 0 and old.stats()["segments"] == 0
    assert old.counters["evicted"] == 4


def test_draining_writes_back_and_gives_back_only_once_the_copies_let_go(arena):
    old, keys = _full_old_pool(arena)
    copied = []

    def write_back(chunk, slot):  # the cascade: a copy to disk pins the slot until it lands
        copied.append((chunk, bytes(old.view(slot)[:8])))
        return ["disk-writer"]

    old.on_evict = write_back
    new = arena.pool("new", SLOT)
    assert new.reserve("engine-new", 2) == []  # the copies still read the old slots
    assert sorted(chunk for chunk, _ in copied) == sorted(keys)
    assert old.stats()["segments"] == 2
    arena.release_holder("disk-writer")  # the copies landed
    assert len(new.reserve("engine-new", 2)) == 2
    assert old.stats()["segments"] == 0


def test_a_pinned_chunk_of_an_abandoned_pool_stays_readable(arena):
    old, keys = _full_old_pool(arena)
    slot = old.lookup(keys[0])
    expected = bytes(old.view(slot))
    old.pin_slots("peer-reader", [slot])  # a peer is reading it
    new = arena.pool("new", SLOT)
    assert new.reserve("engine-new", 2) == []  # three evicted, one pinned: the pool is not idle
    assert old.lookup(keys[0]) == slot and bytes(old.view(slot)) == expected
    assert [old.lookup(k) for k in keys[1:]] == [None, None, None]


def test_an_abandoned_pool_with_a_reservation_keeps_its_chunks(arena):
    old, keys = _full_old_pool(arena)
    freed = old.lookup(keys[3])
    old.purge([keys[3]])
    assert old.reserve("late-writer", 1) == [freed]  # an engine mid-store, not watching (yet)
    new = arena.pool("new", SLOT)
    assert new.reserve("engine-new", 2) == []
    assert len(old) == 3


def test_draining_is_bounded_per_call(arena, monkeypatch):
    from kvstrata.tiers import giveback

    monkeypatch.setattr(giveback, "DRAIN_PER_CALL", 1)
    old, keys = _full_old_pool(arena)
    new = arena.pool("new", SLOT)
    assert new.reserve("engine-new", 1) == []  # one chunk evicted: not idle yet
    assert len(old) == 3
    for _ in range(3):
        new.reserve("engine-new", 1)
    assert len(old) == 0
    assert len(new.reserve("engine-new", 1)) == 1
