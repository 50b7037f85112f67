"""The node arena alone: bytes, eviction, pins, leases, sharing across processes."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import numpy as np
import pytest

from kvstrata.keys import key_name
from kvstrata.tiers.arena import Arena, SlotError
from tests.utils import FakeClock, key

SLOT = 8192


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def arena(tmp_path, clock):
    arena = Arena(str(tmp_path), "node0", capacity=4 * SLOT, segment_size=2 * SLOT, lease_seconds=10, prefault=False, clock=clock)
    yield arena
    arena.close()


def fill(pool, holder, keys, seed=0):
    """Reserve, write random bytes and commit each key; returns the bytes written."""
    written = {}
    rng = np.random.default_rng(seed)
    slots = pool.reserve(holder, len(keys))
    assert len(slots) == len(keys)
    for k, slot in zip(keys, slots):
        data = rng.integers(0, 256, SLOT, dtype=np.uint8)
        pool.view(slot)[:] = data
        assert pool.commit(holder, slot, k)
        written[k] = data
    return written


def test_bytes_round_trip_exactly(arena):
    pool = arena.pool("ns", SLOT)
    written = fill(pool, "a", [key(i) for i in range(4)])
    pinned = pool.pin("b", written)
    for k, data in written.items():
        assert np.array_equal(pool.view(pinned[k]), data)


def test_segments_are_private_files_and_grow_within_budget(arena, tmp_path):
    pool = arena.pool("ns", SLOT)
    fill(pool, "a", [key(i) for i in range(4)])
    files = sorted(tmp_path.iterdir())
    assert len(files) == 2
    for f in files:
        assert stat.S_IMODE(f.stat().st_mode) == 0o600
    assert arena.allocated_bytes == 4 * SLOT
    assert pool.reserve("a", 1) == []  # budget spent; everything is pinned by the writer


def test_eviction_never_touches_pinned_or_reserved_slots(arena):
    pool = arena.pool("ns", SLOT)
    keys = [key(i) for i in range(4)]
    written = fill(pool, "writer", keys)
    pool.drop_holder("writer")  # writer's pins released: all four are evictable
    pool.pin("reader", keys[:2])
    granted = pool.reserve("other", 4)
    assert len(granted) == 2  # only the two unpinned chunks could be evicted
    for k in keys[:2]:
        assert np.array_equal(pool.view(pool.lookup(k)), written[k])
    assert pool.lookup(keys[2]) is None and pool.lookup(keys[3]) is None
    # Reserved slots are not evictable either: nothing is left to grant.
    assert pool.reserve("third", 1) == []


def test_lru_evicts_the_least_recently_pinned(arena):
    pool = arena.pool("ns", SLOT)
    keys = [key(i) for i in range(4)]
    fill(pool, "w", keys)
    pool.drop_holder("w")
    pool.pin("r", [keys[0]])
    pool.drop_holder("r")  # keys[0] is now the most recently used
    pool.reserve("x", 1)
    assert pool.lookup(keys[1]) is None
    assert pool.lookup(keys[0]) is not None


def test_leases_expire_and_release_everything(arena, clock):
    pool = arena.pool("ns", SLOT)
    arena.renew("dead")
    keys = [key(i) for i in range(2)]
    fill(pool, "dead", keys)
    pool.reserve("dead", 2)
    arena.renew("alive")
    assert pool.reserve("alive", 1) == []
    clock.advance(5)
    arena.renew("alive")
    assert arena.expire() == []
    clock.advance(6)
    arena.renew("alive")
    assert arena.expire() == ["dead"]
    # The dead engine's reserved slots are free and its chunks evictable again.
    assert len(pool.reserve("alive", 4)) == 4


def test_commit_requires_own_reservation(arena):
    pool = arena.pool("ns", SLOT)
    (slot,) = pool.reserve("a", 1)
    with pytest.raises(SlotError, match=f"slot {slot} of namespace ns is not reserved by b"):
        pool.commit("b", slot, key(1))
    assert pool.commit("a", slot, key(1))


def test_a_batch_commit_indexes_the_good_items_and_names_each_refused_one(arena):
    pool = arena.pool("ns", SLOT)
    heard = []
    pool.on_change = lambda keys, present: heard.append((list(keys), present))
    mine, theirs = pool.reserve("a", 3), pool.reserve("b", 1)
    assert pool.commit("a", mine[0], key(9))  # already indexed: its second copy becomes an orphan
    heard.clear()
    committed, refused = pool.commit_many("a", [(mine[1], key(1)), (theirs[0], key(2)), (mine[2], key(9))])
    assert committed == [(key(1), mine[1])]
    assert refused == [f"cannot commit chunk {key_name(key(2))}: slot {theirs[0]} of namespace ns is not reserved by a"]
    assert heard == [([key(1)], True)]  # one change for the whole batch
    assert pool.lookup(key(1)) == mine[1] and pool.lookup(key(2)) is None and pool.lookup(key(9)) == mine[0]
    stats = pool.stats()
    assert (stats["reserved"], stats["pinned"], stats["orphans"], stats["duplicate_commits"]) == (1, 3, 1, 1)
    pool.commit("b", theirs[0], key(2))  # the refused slot is still the other holder's to commit
    # The committer keeps a pin on every slot it committed, the orphan too, until it unpins.
    assert pool.drop_holder("a") == 3
    assert pool.stats()["orphans"] == 0


def test_duplicate_commit_keeps_first_copy_and_frees_second_on_unpin(arena):
    pool = arena.pool("ns", SLOT)
    first, second = pool.reserve("a", 1)[0], pool.reserve("b", 1)[0]
    assert pool.commit("a", first, key(1))
    assert not pool.commit("b", second, key(1))
    assert pool.lookup(key(1)) == first
    assert pool.stats()["orphans"] == 1
    pool.unpin("b", [second])
    assert pool.stats()["orphans"] == 0
    assert second in pool.reserve("c", 4)


def test_index_changes_are_reported_in_order(arena):
    pool = arena.pool("ns", SLOT)
    heard = []
    pool.on_change = lambda keys, present: heard.extend((k, present) for k in keys)
    fill(pool, "w", [key(0), key(1)])
    pool.drop_holder("w")
    pool.purge()
    assert heard == [(key(0), True), (key(1), True), (key(0), False), (key(1), False)]


def test_write_back_hook_keeps_evicted_bytes_until_released(arena):
    pool = arena.pool("ns", SLOT)
    written = fill(pool, "w", [key(i) for i in range(4)])
    pool.drop_holder("w")
    claimed = []

    def claim(k, slot):
        claimed.append((k, slot))
        return ["disk", "object"]

    pool.on_evict = claim
    assert pool.reserve("x", 2) == []  # two chunks leave the index, but their bytes stay
    assert [k for k, _ in claimed] == [key(0), key(1)]  # and no more than asked for
    for k, slot in claimed:
        assert np.array_equal(pool.view(slot), written[k])
    pool.unpin("disk", [slot for _, slot in claimed])  # on disk, still uploading
    assert pool.reserve("x", 2) == []
    pool.unpin("object", [slot for _, slot in claimed])  # written back everywhere: now free
    assert len(pool.reserve("x", 2)) == 2


def test_namespaces_are_separate_pools(arena):
    a = arena.pool("model-a", SLOT)
    b = arena.pool("model-b", SLOT)
    fill(a, "w", [key(1)])
    assert b.lookup(key(1)) is None
    with pytest.raises(ValueError, match="slot size"):
        arena.pool("model-a", 2 * SLOT)


def test_second_process_sees_the_bytes_and_does_not_delete_the_file(arena):
    pool = arena.pool("ns", SLOT)
    written = fill(pool, "w", [key(0)])
    slot = pool.lookup(key(0))
    segment, offset = pool.geometry.locate(slot)
    path = pool.geometry.segment_path(segment)
    code = (
        "import sys, hashlib\n"
        "from kvstrata.tiers.shm import SharedMemoryFile\n"
        "m = SharedMemoryFile.attach(sys.argv[1])\n"
        "off = int(sys.argv[2])\n"
        "print(hashlib.sha256(m.array[off:off+int(sys.argv[3])].tobytes()).hexdigest())\n"
        "m.array[off] = 7\n"
        "m.close()\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, path, str(offset), str(SLOT)], capture_output=True, text=True, timeout=60, check=True
    )
    import hashlib

    assert out.stdout.strip() == hashlib.sha256(written[key(0)].tobytes()).hexdigest()
    assert os.path.exists(path)
    assert pool.view(slot)[0] == 7


def test_invalid_arena_settings_are_named(tmp_path):
    with pytest.raises(ValueError, match="capacity must be positive"):
        Arena(str(tmp_path), "n", capacity=0, segment_size=1, lease_seconds=1)
    with pytest.raises(ValueError, match="eviction_policy"):
        Arena(str(tmp_path), "n", capacity=1, segment_size=1, lease_seconds=1, eviction_policy="fifo")
    with pytest.raises(ValueError, match="not a directory"):
        Arena(str(tmp_path / "missing"), "n", capacity=1, segment_size=1, lease_seconds=1)


def test_evicting_a_full_attention_chunk_takes_the_window_and_state_at_its_position(arena):
    """Hybrid model, group 0 full attention, 1 sliding window, 2 Mamba: the window and the
    state at a position are only ever loaded with that position's group-0 chunk."""
    pool = arena.pool("ns", SLOT)
    pool.positions.set_anchor_groups([0])
    p0 = [key(0, group=g) for g in (0, 1, 2)]  # one position, three groups
    p1 = [key(1, group=0)]
    fill(pool, "w", p0 + p1)
    pool.drop_holder("w")
    pool.touch([p0[1], p0[2], p1[0]])  # the full-attention chunk of position 0 is now the oldest
    assert len(pool.reserve("x", 1)) == 1
    assert [pool.lookup(k) for k in p0] == [None, None, None]  # the position left as a whole
    assert pool.lookup(p1[0]) is not None
    assert pool.stats()["evicted_with_anchor"] == 2
    assert len(pool.reserve("x", 2)) == 2  # and its slots are free for the next stores


def test_a_window_chunk_leaves_alone_and_a_pinned_one_stays(arena):
    pool = arena.pool("ns", SLOT)
    pool.positions.set_anchor_groups([0])
    full, window, state = (key(0, group=g) for g in (0, 1, 2))
    fill(pool, "w", [window, full, state, key(1)])
    pool.drop_holder("w")
    pool.reserve("x", 1)  # the window chunk is the oldest: only it goes
    assert pool.lookup(window) is None and pool.lookup(full) is not None and pool.lookup(state) is not None
    pool.pin("reader", [state])
    pool.touch([key(1)])
    pool.reserve("x", 1)  # the full-attention chunk goes; the pinned state is being loaded: kept
    assert pool.lookup(full) is None and pool.lookup(state) is not None


def test_without_known_anchor_groups_positions_are_not_linked(arena):
    """vLLM < 0.33 does not say which group is full attention: plain LRU, chunk by chunk."""
    pool = arena.pool("ns", SLOT)
    keys = [key(0, group=g) for g in (0, 1)] + [key(1), key(2)]
    fill(pool, "w", keys)
    pool.drop_holder("w")
    pool.reserve("x", 1)
    assert pool.lookup(keys[0]) is None and pool.lookup(keys[1]) is not None
