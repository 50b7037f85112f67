"""Estimates per remote node (`peer:<node id>`, issue #28): each peer converges on its own
rate beside the aggregate `peer` engines weigh, the store picks a chunk's fastest holder
with an unmeasured or stale one tried first, and a node not heard from is forgotten."""

from __future__ import annotations

import numpy as np
import pytest

from kvstrata.tiers.estimates import PEER, Cost, TierEstimates, fastest_first, peer_node, peer_tier
from tests.utils import FakeClock

MB = 1 << 20


def _batches(rng: np.random.Generator, latency: float, bandwidth: float, n: int):
    for _ in range(n):
        nbytes = int(rng.integers(1, 32)) * MB
        yield nbytes, (latency + nbytes / bandwidth) * float(rng.uniform(0.97, 1.03))


def test_a_slow_and_a_fast_peer_each_converge_on_their_own_rate_beside_the_aggregate() -> None:
    rng = np.random.default_rng(7)
    estimates = TierEstimates(clock=FakeClock())
    slow, fast = peer_tier("node-slow"), peer_tier("node-fast")
    for (slow_bytes, slow_s), (fast_bytes, fast_s) in zip(
        _batches(rng, 0.020, 20 * MB, 60), _batches(rng, 0.001, 800 * MB, 60)
    ):
        estimates.observe(slow, slow_bytes, slow_s)
        estimates.observe(fast, fast_bytes, fast_s)
        # The promotion batch as a whole (both peers in parallel: the slower one's time).
        estimates.observe(PEER, slow_bytes + fast_bytes, max(slow_s, fast_s))
    costs = estimates.costs()
    assert costs[slow].bytes_per_second == pytest.approx(20 * MB, rel=0.1)
    assert costs[slow].latency_seconds == pytest.approx(0.020, abs=0.01)
    assert costs[fast].bytes_per_second == pytest.approx(800 * MB, rel=0.1)
    # The aggregate is its own fit, neither peer's: faster than the slow one's alone.
    assert 20 * MB * 1.1 < costs[PEER].bytes_per_second < 800 * MB * 0.9


def test_peer_keys_name_a_node_and_tiers_do_not() -> None:
    assert peer_tier("abc123") == "peer:abc123"
    assert peer_node(peer_tier("abc123")) == "abc123"
    assert [peer_node(tier) for tier in ("peer", "disk", "object")] == [None, None, None]


def test_the_fastest_fresh_holder_comes_first_and_an_unmeasured_one_before_it() -> None:
    costs = {"slow": Cost(0.010, 20 * MB), "fast": Cost(0.001, 800 * MB), "old": Cost(0.0, 5000 * MB, age_seconds=31.0)}
    assert fastest_first(["slow", "fast"], costs, 8 * MB, stale_seconds=30.0) == ["fast", "slow"]
    # Never measured, or measured too long ago: tried first, as that is what measures it.
    assert fastest_first(["slow", "fast", "new"], costs, 8 * MB, 30.0) == ["new", "fast", "slow"]
    assert fastest_first(["fast", "old"], costs, 8 * MB, 30.0) == ["old", "fast"]
    # Nothing known: the given order (RAM holders first, from the directory) is kept.
    assert fastest_first(["b", "a", "c"], {}, 8 * MB, 30.0) == ["b", "a", "c"]


def test_the_ranking_weighs_latency_against_bandwidth_for_the_bytes_asked() -> None:
    costs = {"near": Cost(0.001, 50 * MB), "far": Cost(0.050, 1000 * MB)}
    # 1 MB: near takes 21 ms, far 51 ms. 64 MB: near 1.28 s, far 0.11 s.
    assert fastest_first(["far", "near"], costs, 1 * MB, 30.0) == ["near", "far"]
    assert fastest_first(["near", "far"], costs, 64 * MB, 30.0) == ["far", "near"]


def test_a_peer_not_observed_for_forget_seconds_is_dropped_but_tiers_are_kept() -> None:
    clock = FakeClock()
    estimates = TierEstimates(clock=clock, forget_seconds=600.0)
    for tier in (peer_tier("gone"), peer_tier("alive"), PEER, "disk"):
        for nbytes in (1 * MB, 2 * MB):
            estimates.observe(tier, nbytes, nbytes / (100 * MB))
    clock.advance(400.0)
    for nbytes in (1 * MB, 2 * MB):
        estimates.observe(peer_tier("alive"), nbytes, nbytes / (100 * MB))
    clock.advance(201.0)
    assert set(estimates.costs()) == {peer_tier("alive"), PEER, "disk"}
    # A node that comes back starts afresh (no estimate before two batches).
    estimates.observe(peer_tier("gone"), 1 * MB, 0.01)
    assert peer_tier("gone") not in estimates.costs()
