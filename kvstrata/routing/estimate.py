"""Time to first token on one replica, estimated from measured rates; and the choice among
replicas under a load bound.

Model (one request on one replica):

    ttft = queue + recompute + load
    recompute = tokens the replica computes / its measured prefill rate
    load      = slowest source of the covered prefix: latency + bytes / bandwidth
                (the node store promotes from disk, peers and the bucket in parallel;
                the arena part is the worker's copy)
    queue     = the wait behind prefill work this router already sent to the replica and
                not yet done, as vLLM's continuous batching shares it: a request shares
                each step's token budget with the k requests in flight, so it waits at
                most k times its own work, and never more than the work queued
                (min(backlog, k * (recompute + load)))

The covered prefix and the source of each chunk come from `coverage`; rates from the
node stores (`figures`): each store measures what its disk, peers and bucket deliver
(`TierEstimates`) and each engine its own prefill rate (`RecomputeRate`). A source slower
than recomputing its own tokens is priced as recomputing them: an engine with
`admission.load: break_even` (the default) would recompute them.

Load bound ("consistent hashing with bounded loads", Mirrokni et al. 2018), on requests
in flight: a replica may take a request while it has a free batch slot (fewer requests in
flight than its engine runs at once: another request there shares the steps rather than
waiting), or while its requests in flight stay within
`ceil(load_factor * (all in flight + 1) / replicas)`. Only requests this router sent by
estimate and not yet completed count: a completed request loads nothing (the app's
readiness probe, a conversation's earlier turn), and a request routed by the fallback
went where Serve's power of two choices put it, by the replica's own queue length. Past
its slots and the bound a hot prefix spills to the next cheapest replica; within them
the estimate's queue term prices the wait, so a second copy of a prefix is made only
where recomputing it elsewhere is cheaper than waiting for its home.

Among the replicas within the bound the smallest estimate wins, where estimates within a
margin of it count as equal and the one holding more of the prefix on its own node goes
first; among equals the prefix's rendezvous order (`rendezvous_order`: highest random
weight of the prefix's first block and the replica) decides, so a new prefix has one
home, the same in every router process, and the next request sharing it goes there too.
The others follow in order (Serve tries the next when one is full).

Invariants: pure, except `Backlog`, whose only state is per-replica figures read through
an injected clock. Ties keep the caller's order (callers put it in rendezvous order first).
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field

from kvstrata.routing.coverage import ARENA, NodeCoverage
from kvstrata.tiers.estimates import Cost

# What a source costs where nothing was measured yet: order-of-magnitude figures of a
# GPU node (pinned host memory, local NVMe, a 100 Gb/s peer, an S3 bucket). Measured
# estimates replace them as soon as the node store has any.
DEFAULT_COSTS: dict[str, Cost] = {
    "arena": Cost(0.0, 20e9),
    "disk": Cost(0.001, 3e9),
    "peer": Cost(0.002, 5e9),
    "bucket": Cost(0.02, 0.5e9),
}
DEFAULT_PREFILL_TOKENS_PER_SECOND = 5000.0


@dataclass(frozen=True)
class ReplicaRates:
    """What one replica's node measured: its engines' prefill rate and each source's cost."""

    prefill_tokens_per_second: float
    costs: Mapping[str, Cost]  # by source name (coverage.SOURCES)


@dataclass(frozen=True)
class TtftEstimate:
    seconds: float
    queue_seconds: float
    recompute_seconds: float
    load_seconds: float
    recompute_tokens: int
    loaded_tokens: int
    load_by_source: dict[str, float] = field(default_factory=dict)  # seconds per source read

    def parts(self) -> str:
        """One line for the decision log."""
        sources = " ".join(f"{name} {seconds * 1000:.1f}" for name, seconds in self.load_by_source.items())
        return (
            f"{self.seconds * 1000:.1f} ms = queue {self.queue_seconds * 1000:.1f} + recompute "
            f"{self.recompute_seconds * 1000:.1f} ({self.recompute_tokens} tok) + load "
            f"{self.load_seconds * 1000:.1f} ({self.loaded_tokens} tok{': ' + sources if sources else ''})"
        )


def estimate_ttft(
    prompt_tokens: int,
    coverage: NodeCoverage,
    slot_bytes: int,
    rates: ReplicaRates,
    backlog_seconds: float = 0.0,
    in_flight: int = 0,
) -> TtftEstimate:
    """The estimate for one replica whose node sees the prompt as `coverage`, with
    `backlog_seconds` of work and `in_flight` requests already sent there."""
    rate = rates.prefill_tokens_per_second
    # What the router just sent there is in the engine's own cache (or its arena): free.
    recompute_tokens = prompt_tokens - max(coverage.servable, coverage.recent)
    load_by_source: dict[str, float] = {}
    load = 0.0
    for source, keys in coverage.keys_by_source.items():
        tokens = coverage.tokens_by_source.get(source, 0)
        if coverage.recent >= coverage.servable:
            break  # all of it is in the engine's own cache already
        cost = rates.costs.get(source) or DEFAULT_COSTS[source]
        seconds = cost.load_seconds(keys * slot_bytes)
        if source != ARENA and tokens and seconds > tokens / rate:  # break_even: recomputed instead
            recompute_tokens += tokens
            continue
        load_by_source[source] = seconds
        load = max(load, seconds)
    recompute = recompute_tokens / rate
    queue_seconds = min(backlog_seconds, in_flight * (recompute + load))
    return TtftEstimate(
        seconds=queue_seconds + recompute + load,
        queue_seconds=queue_seconds,
        recompute_seconds=recompute,
        load_seconds=load,
        recompute_tokens=recompute_tokens,
        loaded_tokens=prompt_tokens - recompute_tokens,
        load_by_source=load_by_source,
    )


def load_bound(in_flight: Mapping[Hashable, float], load_factor: float) -> int:
    """The requests in flight a replica may have after taking one more."""
    total = sum(in_flight.values())
    return max(1, math.ceil(load_factor * (total + 1) / max(1, len(in_flight))))


def within_bound(
    replica: Hashable, in_flight: Mapping[Hashable, float], bound: int, slots: Mapping[Hashable, int] | None = None
) -> bool:
    """Whether `replica` may take one more request: a free batch slot, or within `bound`."""
    mine = in_flight.get(replica, 0)
    return mine < (slots or {}).get(replica, 0) or mine + 1 <= bound


def rank_replicas(
    replicas: Sequence[Hashable],
    estimates: Mapping[Hashable, float],
    in_flight: Mapping[Hashable, float],
    load_factor: float,
    local_tokens: Mapping[Hashable, int] | None = None,
    margin: float = 0.0,
    slots: Mapping[Hashable, int] | None = None,
) -> list[Hashable]:
    """Replicas in the order to try them: within the load bound by estimate, then the rest
    by requests in flight and estimate. `in_flight`: each replica's (missing: 0);
    `slots`: each replica's batch slots (missing: 0), never excluded while one is free.

    Within the bound, estimates less than `margin` (a fraction) above the best count as
    equal, and among those the replica whose node holds more of the prefix itself
    (`local_tokens`: its arena and disk) goes first: an estimate's error is larger than
    such a difference, and moving a request off the node that holds its prefix makes a
    second copy of it in another arena, which costs later requests.
    """
    bound = load_bound({r: in_flight.get(r, 0) for r in replicas}, load_factor)
    within = [r for r in replicas if within_bound(r, in_flight, bound, slots)]
    beyond = [r for r in replicas if not within_bound(r, in_flight, bound, slots)]
    within.sort(key=lambda r: estimates[r])
    beyond.sort(key=lambda r: (in_flight.get(r, 0), estimates[r]))
    if within and local_tokens and margin > 0:
        limit = estimates[within[0]] * (1.0 + margin)
        near = [r for r in within if estimates[r] <= limit]
        near.sort(key=lambda r: -local_tokens.get(r, 0))  # stable: by estimate among equals
        within = near + within[len(near) :]
    return within + beyond


def rendezvous_order(prefix: bytes, replicas: Sequence[Hashable], name: Callable[[Hashable], str] = str) -> list[Hashable]:
    """`replicas` by their rendezvous weight for `prefix`, highest first (Thaler & Ravishankar
    1998): a pure function of the prefix and the replica set, so every router process puts a
    new prefix on the same home, and a replica that leaves moves only the prefixes it was
    home to. `name`: a replica's stable name (its Serve replica id)."""

    def weight(replica: Hashable) -> bytes:
        return hashlib.blake2b(prefix + b"\0" + name(replica).encode(), digest_size=8).digest()

    return sorted(replicas, key=weight, reverse=True)


class Backlog:
    """Per replica, when the prefill work this router sent it should be done: each request
    starts when the one before it ends (`max(now, finish) + seconds`). Not thread-safe:
    the router calls it from its event loop only."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._finish: dict[Hashable, float] = {}

    def wait(self, replica: Hashable) -> float:
        """Seconds a request sent now would wait behind earlier ones."""
        return max(0.0, self._finish.get(replica, 0.0) - self._clock())

    def add(self, replica: Hashable, seconds: float) -> None:
        now = self._clock()
        self._finish[replica] = max(now, self._finish.get(replica, now)) + max(0.0, seconds)

    def forget(self, keep: set[Hashable]) -> None:
        for replica in [r for r in self._finish if r not in keep]:
            del self._finish[replica]
