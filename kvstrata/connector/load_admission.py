"""Load or recompute (`admission.load: break_even`): where a request's prefix stops loading.

Why: a chunk in a slow tier (a throttled bucket, a busy disk, a far peer) is a "hit"
that can arrive later than the engine would have recomputed it. The node store measures
what each tier delivers (tiers/estimates.py) and sends the estimates with every step
reply; this engine knows its prefill rate: `engine.recompute_tokens_per_second` when the
YAML gives it, else what it measured of its own steps (recompute_rate.py).

How: the first time a request's lookup reaches a chunk that is not in the arena but in a
lower tier, `LoadAdmission.decide` takes the rest of the prefix from there -- the
request's chunks at that position and after, as far as the anchor (full-attention)
chunks are known to some tier -- and weighs loading its lower-tier chunks (by the tier
each would come from) against recomputing its tokens (`estimates.break_even`). If
recomputing wins, the request's *cut* is that position: every lookup of the request at
or after it answers MISS, for every group. So the arena part before the cut is still
loaded, the rest is recomputed, whole chunks in prefix order; and no group is loaded
beyond its anchor (vLLM takes the smallest hit over the groups). The decision is made
once per request, so a RETRY pass cannot change it half way.

What it needs of vLLM: the positions of the request's chunks (`ReqContext` records them
for every key from 0.32 on, before any lookup). Without them, or before a recompute rate
is configured or measured, everything loads.

No wait on an unmeasured or saturated tier (#48): a request whose rest would come from a
tier this engine has no estimate for recomputes it at once, and its chunks there are
promoted in the background (`take_probes`, at most once per tier per second until the
store has an estimate), which measures the tier with no request waiting on it. Waiting instead could cost the
request `lookup_wait_seconds` and then a recompute anyway (a bucket whose link uploads
saturate: 2 s stalls in every router's benchmark). A tier is saturated for this request
when the promotions this engine already waits on from it (`waiting`: bytes ahead of its
own in the store's queue) plus its own would take longer than recomputing: it
recomputes too. An estimate older than `stale_seconds` that still says recompute is
followed and probed the same way; one that says load is loaded (which measures it too).
`note_timed_out` counts requests that waited `lookup_wait_seconds` and then recomputed
(`requests_waited_then_recomputed`): what this module exists to keep at 0.

Invariants: a cut only moves MISSes earlier, never turns a MISS into a HIT; a
request's cut is fixed once decided and forgotten when the request finishes. Plain
Python; must not call the store or import vLLM (positions come in as a mapping).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Collection, Mapping

from kvstrata.config import AdmissionConfig
from kvstrata.connector.recompute_rate import RecomputeRate
from kvstrata.tiers.changelog import CPU, OBJECT, PEER, STORAGE
from kvstrata.tiers.estimates import Cost, break_even

logger = logging.getLogger(__name__)

# The tier a promotion would read a chunk from, in the store's order of preference.
PROMOTION_ORDER = ((STORAGE, "disk"), (PEER, "peer"), (OBJECT, "object"))
TIERS = tuple(tier for _, tier in PROMOTION_ORDER)
# How often a tier with no estimate yet is probed at most: the store's estimate needs a
# few reads (`TierEstimate.min_batches`), so it must not wait `stale_seconds` between them.
UNMEASURED_PROBE_SECONDS = 1.0


def source_tier(media: Collection[str]) -> str | None:
    """The lower tier the store would promote a chunk from; None if it is in none."""
    for medium, tier in PROMOTION_ORDER:
        if medium in media:
            return tier
    return None


class LoadAdmission:
    def __init__(
        self,
        admission: AdmissionConfig,
        configured_rate: float | None,
        chunk_bytes: int,
        counters: dict[str, int],
        measured_rate: RecomputeRate | None = None,
    ):
        self.enabled = admission.load == "break_even"
        self.safety_margin = admission.safety_margin
        self.stale_seconds = admission.stale_seconds
        self.configured_rate = configured_rate
        self.measured_rate = measured_rate
        self.chunk_bytes = chunk_bytes
        self.costs: dict[str, Cost] = {}
        self._costs_at = 0.0  # when `costs` arrived (the engine's clock)
        self._cuts: dict[str, int | None] = {}  # req_id -> first position recomputed (None: load all)
        self._probes: list[bytes] = []  # chunks to promote in the background (take_probes)
        self._probed_at: dict[str, float] = {}  # tier -> when its last background probe was asked for
        self._timed_out: set[str] = set()  # requests counted in `requests_waited_then_recomputed`
        # `loads_skipped_<tier>`: lower-tier chunks recomputed rather than loaded (the manager's counters).
        self.counters = counters
        if self.enabled:
            logger.info(
                "kvstrata engine: admission.load break_even, recompute rate %s, safety margin %.0f%%",
                f"{configured_rate:g} tokens/s (engine.recompute_tokens_per_second)" if configured_rate
                else "measured from this engine's steps (it loads everything until measured)",
                100 * self.safety_margin,
            )  # fmt: skip

    @property
    def recompute_tokens_per_second(self) -> float | None:
        """The configured rate, else the measured one (None until measured)."""
        if self.configured_rate or self.measured_rate is None:
            return self.configured_rate
        return self.measured_rate.tokens_per_second()

    def receive_costs(self, costs: Mapping[str, tuple[float, float, float]], now: float) -> None:
        """The store's estimates as a step reply carries them: tier -> (latency, bytes/s, age)."""
        self.costs = {tier: Cost(*values) for tier, values in costs.items()}
        self._costs_at = now

    def current_costs(self, now: float) -> dict[str, Cost]:
        waited = max(0.0, now - self._costs_at)
        return {
            tier: Cost(cost.latency_seconds, cost.bytes_per_second, cost.age_seconds + waited)
            for tier, cost in self.costs.items()
        }

    def undecided(self, req_id: str) -> bool:
        """Whether `decide` would still weigh this request (break_even on, no decision yet)."""
        return self.enabled and req_id not in self._cuts

    def has_cut(self, req_id: str) -> bool:
        """Whether the request decided to recompute from some chunk on (cheap: no position)."""
        return self._cuts.get(req_id) is not None

    def cut_before(self, req_id: str, position: int | None) -> bool:
        """Whether the request already decided to recompute from at or before `position`."""
        cut = self._cuts.get(req_id)
        return cut is not None and position is not None and position >= cut

    def decide(
        self,
        req_id: str,
        position: int | None,
        positions: Mapping[bytes, int] | None,
        mirror: Mapping[bytes, Collection[str]],
        anchor_groups: Collection[int],
        group_of: Callable[[bytes], int],
        now: float,
        waiting: Collection[bytes] = (),
    ) -> bool:
        """At a chunk that would come from a lower tier: True to recompute from here on.

        `positions`: every chunk of the request and the token its prefix ends at;
        `mirror`: key -> media the store holds it in; `group_of`: a key's KV group;
        `waiting`: chunks this engine already waits on the store to promote (its queue).
        """
        if not self.enabled or req_id in self._cuts:
            return self.cut_before(req_id, position)
        if position is None or not positions:
            return False  # not recorded: nothing is decided, so a later vLLM may decide
        anchors = sorted(
            (pos, key) for key, pos in positions.items() if (group_of(key) in anchor_groups or not anchor_groups)
        )
        start = max((pos for pos, _ in anchors if pos < position), default=0)
        end = position
        for pos, key in anchors:
            if pos < position:
                continue
            if key not in mirror:
                break  # the prefix any tier holds ends here
            end = pos
        bytes_by_tier: dict[str, int] = {}
        lower_keys: dict[str, list[bytes]] = {}
        for key, pos in positions.items():
            media = mirror.get(key)
            if not media or not position <= pos <= end or CPU in media:
                continue
            tier = source_tier(media)
            if tier is not None:
                bytes_by_tier[tier] = bytes_by_tier.get(tier, 0) + self.chunk_bytes
                lower_keys.setdefault(tier, []).append(key)
        costs = self.current_costs(now)
        rate = self.recompute_tokens_per_second
        unmeasured = rate is not None and rate > 0 and any(tier not in costs for tier in bytes_by_tier)
        if unmeasured:
            load = False  # no figure: recompute now, measure it in the background
        else:
            # Bytes the store promotes for this engine ahead of these, from the same tier.
            queued = dict(bytes_by_tier)
            own = {key for keys in lower_keys.values() for key in keys}
            for key in waiting:
                tier = source_tier(mirror.get(key, ())) if key not in own else None
                if tier in queued:
                    queued[tier] += self.chunk_bytes
            # What each tier delivered when last measured, however long ago: a stale
            # estimate that says load is loaded (which measures it), one that says
            # recompute is followed, and the tier is measured again in the background.
            load, _ = break_even(queued, end - start, costs, rate, self.safety_margin, math.inf)
        self._cuts[req_id] = None if load else position
        if load:
            return False
        for tier, keys in lower_keys.items():
            self.counters[f"loads_skipped_{tier}"] += len(keys)
            cost = costs.get(tier)
            every = UNMEASURED_PROBE_SECONDS if cost is None else self.stale_seconds
            unknown = cost is None or cost.age_seconds > self.stale_seconds
            if unknown and now - self._probed_at.get(tier, -math.inf) > every:
                self._probed_at[tier] = now
                self._probes.extend(keys)
                self.counters["chunks_probed"] += len(keys)
        return True

    def note_timed_out(self, req_id: str) -> None:
        """The request waited `lookup_wait_seconds` for chunks and recomputes: counted once."""
        if req_id not in self._timed_out:
            self._timed_out.add(req_id)
            self.counters["requests_waited_then_recomputed"] += 1

    def take_probes(self) -> list[bytes]:
        """Chunks to promote in the background, no request waiting on them (the manager
        asks the store for them like any pin, and unpins them once they arrive)."""
        probes, self._probes = self._probes, []
        return probes

    def forget(self, req_id: str) -> None:
        self._cuts.pop(req_id, None)
        self._timed_out.discard(req_id)
