"""The tier estimator behind `admission.load: break_even`: it finds a tier's latency and
bandwidth from its batches, follows a tier that slows down, and an old estimate is not
trusted."""

from __future__ import annotations

import numpy as np
import pytest

from kvstrata.tiers.estimates import Cost, TierEstimate, TierEstimates, break_even

MB = 1 << 20


def _synthetic_batches(rng: np.random.Generator, latency: float, bandwidth: float, n: int):
    for _ in range(n):
        nbytes = int(rng.integers(1, 64)) * MB
        # 5 % noise on each batch's time, as a real tier has.
        yield nbytes, (latency + nbytes / bandwidth) * float(rng.uniform(0.95, 1.05))


def test_the_estimate_converges_on_a_synthetic_tier() -> None:
    rng = np.random.default_rng(3)
    estimate = TierEstimate()
    assert estimate.cost() is None  # nothing known before any batch
    for nbytes, seconds in _synthetic_batches(rng, latency=0.010, bandwidth=200 * MB, n=60):
        estimate.observe(nbytes, seconds)
    latency, bandwidth = estimate.cost()
    assert bandwidth == pytest.approx(200 * MB, rel=0.1)
    assert latency == pytest.approx(0.010, abs=0.005)


def test_the_estimate_follows_a_tier_that_slows_down() -> None:
    rng = np.random.default_rng(4)
    estimate = TierEstimate(half_life=8.0)
    for nbytes, seconds in _synthetic_batches(rng, latency=0.002, bandwidth=500 * MB, n=40):
        estimate.observe(nbytes, seconds)
    for nbytes, seconds in _synthetic_batches(rng, latency=0.002, bandwidth=20 * MB, n=40):
        estimate.observe(nbytes, seconds)
    _, bandwidth = estimate.cost()
    assert bandwidth == pytest.approx(20 * MB, rel=0.15)


def test_equal_sized_batches_charge_all_time_to_bandwidth() -> None:
    estimate = TierEstimate()
    for _ in range(5):
        estimate.observe(8 * MB, 0.1)
    latency, bandwidth = estimate.cost()
    assert latency == 0.0 and bandwidth == pytest.approx(80 * MB)


def test_break_even_recomputes_only_when_a_fresh_estimate_says_loading_is_slower() -> None:
    now = [0.0]
    estimates = TierEstimates(clock=lambda: now[0])
    for _ in range(4):
        estimates.observe("object", 10 * MB, 1.0)  # 10 MB/s
    costs = estimates.costs()
    assert costs["object"].bytes_per_second == pytest.approx(10 * MB)
    # 100 MB at 10 MB/s = 10 s; 1000 tokens at 1000 tok/s = 1 s: recompute.
    assert break_even({"object": 100 * MB}, 1000, costs, 1000.0, 0.2, 30.0) == (False, "object")
    # 10 MB = 1 s vs 1 s: within the safety margin, load.
    assert break_even({"object": 10 * MB}, 1000, costs, 1000.0, 0.2, 30.0) == (True, None)
    # No recompute rate, or a tier never measured: load (loading is what measures).
    assert break_even({"object": 100 * MB}, 1000, costs, None, 0.2, 30.0) == (True, None)
    assert break_even({"disk": 100 * MB}, 1000, costs, 1000.0, 0.2, 30.0) == (True, None)
    # The same estimate 31 s later is stale: load, and the load measures the tier again.
    now[0] = 31.0
    stale = estimates.costs()
    assert stale["object"].age_seconds == pytest.approx(31.0)
    assert break_even({"object": 100 * MB}, 1000, stale, 1000.0, 0.2, 30.0) == (True, None)


def test_parallel_tiers_cost_their_slowest() -> None:
    costs = {"disk": Cost(0.0, 1000 * MB), "object": Cost(0.0, 10 * MB)}
    assert break_even({"disk": 100 * MB, "object": 50 * MB}, 1000, costs, 1000.0, 0.0, 30.0) == (False, "object")
