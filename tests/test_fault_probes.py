"""The fault matrix's leak check on an arena that fills as rows run (issue #51 finding 13).

`two-engines-race` failed on "store fds 96 -> 124": the store's arena (320 slots in
segments of 8) had opened 22 of its 40 segments by round 1 and all 40 by recovery, two
descriptors each. That is the arena filling to its capacity, not a leak; the check now
holds the arena's segment descriptors to the arena's exact bound and the others to the
growth tolerance.
"""

from __future__ import annotations

import os

from kvstrata._dev.faults.probes import (
    ProcessSample,
    arena_fd_bound,
    fd_kinds,
    growth_problems,
    object_pool_fd_bound,
    object_pool_growth,
    sample_process,
)
from kvstrata.keys import make_key
from kvstrata.tiers.arena import Arena

SLOT = 8192


def test_an_arena_holds_two_descriptors_per_segment_and_never_more_than_its_bound(tmp_path):
    capacity, segment = 12 * SLOT, 2 * SLOT
    bound = arena_fd_bound(capacity, segment)
    arena = Arena(str(tmp_path), "node0", capacity=capacity, segment_size=segment, lease_seconds=10, prefault=False)
    try:
        pool = arena.pool("ns", SLOT)
        seen = []
        for i in range(40):  # three times the arena: evictions, never more segments than fit
            slots = pool.reserve("w", 1)
            assert pool.commit("w", slots[0], make_key(bytes([i]) * 32, 0))
            pool.unpin("w", slots)
            seen.append(sample_process(os.getpid(), tmp_path).arena_fds)
        assert seen[0] == 2  # the first segment: the file and mmap's duplicate
        assert max(seen) == bound == 12  # full: six segments, and no more however long it runs
        assert fd_kinds(os.getpid())[f"file {tmp_path}"] == bound
    finally:
        arena.close()
    assert sample_process(os.getpid(), tmp_path).arena_fds == 0


def test_arena_segments_opened_after_the_baseline_are_not_a_leak():
    before = ProcessSample(1, 100 << 20, fds=96, threads=26, arena_fds=44)  # 22 of 40 segments open
    after = ProcessSample(1, 100 << 20, fds=124, threads=26, arena_fds=80)  # all 40: the arena is full
    assert growth_problems(before, after) == ["store fds 96->124"]  # what the old check said
    assert growth_problems(before, after, arena_fds_bound=80) == []


def test_descriptors_beyond_the_arena_bound_or_besides_it_still_leak():
    before = ProcessSample(1, 100 << 20, fds=96, threads=26, arena_fds=44)
    over = ProcessSample(1, 100 << 20, fds=126, threads=26, arena_fds=82)
    assert growth_problems(before, over, arena_fds_bound=80) == ["store arena descriptors 82 over the arena's bound 80"]
    sockets = ProcessSample(1, 100 << 20, fds=96 + 25, threads=26, arena_fds=44)  # 25 more of something else
    assert growth_problems(before, sockets, arena_fds_bound=80) == ["store fds besides the arena's 52->77"]


def test_the_object_clients_pool_is_held_to_its_own_bound_not_the_tolerance():
    """The full matrix of 28 Nov 2026: five object rows grew 25-49 descriptors besides the
    arena's, all of them pyarrow's pooled S3 connections (+8 to +17, to the endpoint) and
    their anonymous inodes (+18 to +32): a pool that fills up to the tier's concurrency."""
    before = ProcessSample(1, 100 << 20, fds=93, threads=26, arena_fds=40)
    after = ProcessSample(1, 100 << 20, fds=142, threads=26, arena_fds=40)
    kinds_before = {"tcp 127.0.0.1:9000 ESTABLISHED": 1, "anon_inode:[eventfd]": 10}
    kinds_after = {"tcp 127.0.0.1:9000 ESTABLISHED": 18, "anon_inode:[eventfd]": 42}  # +17 and +32
    pool = object_pool_growth(kinds_before, kinds_after, 9000)
    assert pool == 17 + 32
    assert growth_problems(before, after, arena_fds_bound=80) == ["store fds besides the arena's 53->102"]  # the old check
    assert growth_problems(before, after, arena_fds_bound=80, object_pool=(pool, object_pool_fd_bound(16))) == []
    # A leak beside the pool still shows, and so does a pool past the tier's concurrency.
    leaky = ProcessSample(1, 100 << 20, fds=142 + 25, threads=26, arena_fds=40)
    assert growth_problems(before, leaky, arena_fds_bound=80, object_pool=(pool, object_pool_fd_bound(16))) == [
        "store fds besides the arena's and the object pool 53->78"
    ]
    assert growth_problems(before, after, arena_fds_bound=80, object_pool=(pool, object_pool_fd_bound(4))) == [
        "object client pool descriptors +49 over its bound 15"
    ]
    # Inodes count as the pool's only up to two per connection to the endpoint.
    assert object_pool_growth({}, {"tcp 127.0.0.1:9000 ESTABLISHED": 2, "anon_inode:[eventfd]": 30}, 9000) == 6
    assert object_pool_growth({}, {"tcp 127.0.0.1:8000 ESTABLISHED": 5, "anon_inode:[eventfd]": 30}, 9000) == 0
