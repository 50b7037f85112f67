"""The estimate orders replicas by what their nodes measured, the load bound (on requests in
flight, past free batch slots) spreads a hot prefix, a new prefix has one rendezvous home,
and the backlog charges work already sent (synthetic coverages and rates)."""

from __future__ import annotations

import pytest

from kvstrata.routing.coverage import ARENA, BUCKET, DISK, NodeCoverage
from kvstrata.routing.estimate import Backlog, ReplicaRates, estimate_ttft, load_bound, rank_replicas, rendezvous_order
from kvstrata.tiers.estimates import Cost
from tests.utils import FakeClock

SLOT = 1 << 20  # one 256-token chunk: 1 MiB
COSTS = {ARENA: Cost(0.0, 10e9), DISK: Cost(0.001, 1e9), BUCKET: Cost(0.02, 0.05e9)}


def covered(**tokens: int) -> NodeCoverage:
    return NodeCoverage(0, 0, 0, sum(tokens.values()), dict(tokens), {s: t // 256 for s, t in tokens.items()})


def test_more_of_the_prefix_in_a_faster_tier_is_the_smaller_estimate():
    rates = ReplicaRates(2000.0, COSTS)
    nothing = estimate_ttft(4096, covered(), SLOT, rates)
    in_arena = estimate_ttft(4096, covered(arena=3840), SLOT, rates)
    on_disk = estimate_ttft(4096, covered(disk=3840), SLOT, rates)
    half = estimate_ttft(4096, covered(arena=2048), SLOT, rates)
    assert in_arena.seconds < on_disk.seconds < half.seconds < nothing.seconds
    assert nothing.seconds == pytest.approx(4096 / 2000)
    assert in_arena.recompute_tokens == 256 and in_arena.load_by_source == {ARENA: pytest.approx(15 * SLOT / 10e9)}
    assert on_disk.load_seconds == pytest.approx(0.001 + 15 * SLOT / 1e9)


def test_a_replica_that_prefills_faster_can_beat_one_holding_more():
    slow_with_cache = estimate_ttft(4096, covered(arena=1024), SLOT, ReplicaRates(1000.0, COSTS))
    fast_cold = estimate_ttft(4096, covered(), SLOT, ReplicaRates(8000.0, COSTS))
    assert fast_cold.seconds < slow_with_cache.seconds  # 0.51 s against 3.07 s


def test_a_source_slower_than_recomputing_is_priced_as_recomputing():
    rates = ReplicaRates(20000.0, COSTS)  # fast prefill: the 50 MB/s bucket loses (break_even)
    bucket = estimate_ttft(4096, covered(bucket=3840), SLOT, rates)
    assert bucket.recompute_tokens == 4096 and bucket.load_by_source == {}
    assert bucket.seconds == pytest.approx(4096 / 20000)


def test_queued_work_counts_as_continuous_batching_shares_it():
    rates = ReplicaRates(2000.0, COSTS)
    idle = estimate_ttft(4096, covered(), SLOT, rates)
    busy = estimate_ttft(4096, covered(arena=2048), SLOT, rates, backlog_seconds=2.5, in_flight=3)
    assert idle.seconds < busy.seconds and busy.queue_seconds == 2.5  # 3 x 1.02 s of its own work > 2.5 s
    # A cheap request shares the steps with the one in flight rather than waiting it out.
    cheap = estimate_ttft(4096, covered(arena=3840), SLOT, rates, backlog_seconds=2.5, in_flight=1)
    assert cheap.queue_seconds == pytest.approx(cheap.recompute_seconds + cheap.load_seconds)
    assert cheap.seconds < idle.seconds


def test_the_load_bound_spills_a_hot_prefix_to_the_next_replica():
    estimates = {"a": 0.1, "b": 1.0, "c": 2.0}
    assert rank_replicas(["a", "b", "c"], estimates, {"a": 0, "b": 0, "c": 0}, 1.25) == ["a", "b", "c"]
    # 3 in flight over 3 replicas: one more may go where at most ceil(1.25 * 4 / 3) = 2 are.
    assert load_bound({"a": 2, "b": 1, "c": 0}, 1.25) == 2
    assert rank_replicas(["a", "b", "c"], estimates, {"a": 2, "b": 1, "c": 0}, 1.25) == ["b", "c", "a"]
    # A looser bound keeps it on the cheap replica longer.
    assert rank_replicas(["a", "b", "c"], estimates, {"a": 2, "b": 1, "c": 0}, 2.0) == ["a", "b", "c"]


def test_under_the_bound_no_replica_ever_holds_more_than_its_share():
    in_flight = {"a": 0, "b": 0}
    for _ in range(40):  # every request prefers "a"; none completes
        chosen = rank_replicas(["a", "b"], {"a": 0.0, "b": 9.0}, in_flight, 1.25)[0]
        in_flight[chosen] += 1
        assert in_flight[chosen] <= load_bound({r: n - (r == chosen) for r, n in in_flight.items()}, 1.25)
    assert max(in_flight.values()) <= 1.25 * 20 + 1


def test_a_replica_with_a_free_batch_slot_is_never_excluded_by_the_bound():
    estimates = {"a": 0.1, "b": 1.0}
    # Two in flight on "a" already: the bound (ceil(1.25 * 3 / 2) = 2) alone would spill...
    assert rank_replicas(["a", "b"], estimates, {"a": 2, "b": 0}, 1.25) == ["b", "a"]
    # ...but "a" runs 4 at once: it takes the request beside the two (continuous batching).
    assert rank_replicas(["a", "b"], estimates, {"a": 2, "b": 0}, 1.25, slots={"a": 4, "b": 4}) == ["a", "b"]
    # Its slots full, the bound decides again.
    assert rank_replicas(["a", "b"], estimates, {"a": 4, "b": 0}, 1.25, slots={"a": 4, "b": 4}) == ["b", "a"]


def test_completed_requests_load_nothing():
    """The bound counts requests in flight only: six requests that came and went one at a
    time (a readiness probe, a conversation's earlier turns) leave the cheap replica first."""
    in_flight = {"a": 0, "b": 0}
    for _ in range(6):
        chosen = rank_replicas(["a", "b"], {"a": 0.1, "b": 1.0}, in_flight, 1.25)[0]
        assert chosen == "a"  # sent, then completed before the next: never counted against "a"


def test_a_new_prefix_has_one_home_and_a_leaving_replica_moves_only_its_own():
    replicas = [f"r{i}" for i in range(8)]
    prefixes = [bytes([i]) * 32 for i in range(200)]
    homes = {p: rendezvous_order(p, replicas)[0] for p in prefixes}
    assert homes == {p: rendezvous_order(p, list(reversed(replicas)))[0] for p in prefixes}  # any order given
    assert len(set(homes.values())) == 8  # spread over every replica
    assert max(list(homes.values()).count(r) for r in replicas) < 200 / 8 * 2
    left = [r for r in replicas if r != "r3"]
    for p in prefixes:  # only r3's prefixes move; each to its second choice
        home = rendezvous_order(p, left)[0]
        assert home == homes[p] if homes[p] != "r3" else home == rendezvous_order(p, replicas)[1]
    # Equal estimates keep the rendezvous order: the home goes first.
    order = rendezvous_order(prefixes[0], replicas)
    assert rank_replicas(order, dict.fromkeys(replicas, 0.5), dict.fromkeys(replicas, 0), 1.25)[0] == homes[prefixes[0]]


def test_the_backlog_drains_with_time():
    clock = FakeClock()
    backlog = Backlog(clock)
    backlog.add("a", 2.0)
    backlog.add("a", 1.0)  # behind the first
    assert backlog.wait("a") == 3.0 and backlog.wait("b") == 0.0
    clock.advance(2.5)
    assert backlog.wait("a") == pytest.approx(0.5)
    clock.advance(5)
    backlog.add("a", 1.0)  # starts now, not where the idle replica's backlog ended
    assert backlog.wait("a") == 1.0


def test_estimates_within_the_margin_go_to_the_node_holding_the_prefix():
    estimates = {"home": 0.52, "away": 0.50, "far": 0.70}
    local = {"home": 1280, "away": 768, "far": 0}
    in_flight = {"home": 0, "away": 0, "far": 0}
    assert rank_replicas(["home", "away", "far"], estimates, in_flight, 1.25) == ["away", "home", "far"]
    assert rank_replicas(["home", "away", "far"], estimates, in_flight, 1.25, local, 0.1) == ["home", "away", "far"]
    assert rank_replicas(["home", "away", "far"], {**estimates, "home": 0.60}, in_flight, 1.25, local, 0.1)[0] == "away"
