"""The simulation's hints (kvstrata/_dev/sim/hints.py) reach every bound they check: a random
run with hints on refuses pins past a tenant's quota, retentions past its share, cuts
leases and TTLs, drops requests' hints past their sizes and out-of-range numbers, and
sees two owners pin one chunk -- so the checks that each bound holds are not vacuous."""

from __future__ import annotations

import logging
import random

import pytest

from kvstrata._dev.sim.explore import Explorer, config_for
from kvstrata._dev.sim.world import World

EVENTS = 12_000


@pytest.fixture(autouse=True)
def _quiet_store():
    logging.disable(logging.CRITICAL)
    yield
    logging.disable(logging.NOTSET)


def test_a_random_run_with_hints_reaches_every_bound_and_keeps_every_invariant():
    seed = 0
    config = config_for(seed)
    assert config.hints
    world = World(config)
    explorer = Explorer(world, random.Random(seed))
    shared = 0  # chunks pinned by two owners at once (an unpin must end only its own)
    try:
        for _ in range(EVENTS):
            if world.apply(explorer.next_action()):
                world.check()
            assert not world.violations, world.violations[0]
            for holds in world.store.prefetcher._held.values():
                shared += sum(1 for hold in holds.values() if len(hold.owners) > 1)
        store = world.store.ctx.counters
        dropped = sum(engine.current._counters["hints_dropped"] for engine in world.engines if engine.current)
    finally:
        world.close()
    assert store["prefetch_refused_quota"] > 0 and store["retain_refused_full"] > 0
    assert store["prefetch_lease_cut"] > 0 and store["retain_ttl_cut"] > 0
    assert store["hints_applied"] > 0 and shared > 0
    assert dropped > 0  # (the engines alive at the end: out-of-range numbers, too many actions or hashes)
