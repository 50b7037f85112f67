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


def _run_with_hints(seed: int) -> tuple[dict[str, int], int, int]:
    """One random run of `EVENTS` actions with hints on, every invariant checked after each;
    (the store's counters, chunks pinned by two owners at once, hints the live engines dropped)."""
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
        store = dict(world.store.ctx.counters)
        dropped = sum(engine.current._counters["hints_dropped"] for engine in world.engines if engine.current)
    finally:
        world.close()
    return store, shared, dropped


BOUNDS = ("prefetch_refused_quota", "retain_refused_full", "prefetch_lease_cut", "retain_ttl_cut", "hints_applied")


def test_a_random_run_with_hints_reaches_every_bound_and_keeps_every_invariant():
    """Seed 0 first, then 2 and 4 (seeds with hints on) only for what it did not reach: the
    order of a run's set iterations follows PYTHONHASHSEED, which pytest does not fix, and
    seed 0 alone missed a quota refusal in about half the processes (28 Nov 2026)."""
    reached: dict[str, int] = dict.fromkeys(BOUNDS, 0)
    shared = dropped = 0
    for seed in (0, 2, 4):
        store, run_shared, run_dropped = _run_with_hints(seed)
        for name in BOUNDS:
            reached[name] += store.get(name, 0)
        shared, dropped = shared + run_shared, dropped + run_dropped
        if all(reached.values()) and shared and dropped:
            break
    assert all(reached.values()), reached
    assert shared > 0
    assert dropped > 0  # (the engines alive at the end: out-of-range numbers, too many actions or hashes)
