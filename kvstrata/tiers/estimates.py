"""What a tier delivers, and whether loading the rest of a prefix beats recomputing it.

Why: a slow tier (a throttled bucket, a busy disk, a far peer) can make a "hit" slower
than prefilling the same tokens again. The node store measures each tier's reads (one
observation per finished batch: bytes and seconds) and hands the estimates to its
engines; an engine with `admission.load: break_even` answers MISS from the first chunk
whose tier would deliver the rest of the prefix later than its own prefill would
recompute it.

Model: a batch of `b` bytes takes `latency + b / bandwidth` seconds. `TierEstimate` fits
it by exponentially weighted least squares over the observations (each new one weighs
`1 / half_life` of the total), so it follows a tier that slows down or recovers within a
few batches. While every batch had the same size the two terms cannot be told apart: the
fit then charges everything to bandwidth (latency 0), which over-estimates large loads'
speed never, and small loads' only by the latency.

Peers: besides the aggregate `peer` (every remote node's deliveries together: what
engines weigh, as their mirror only knows a chunk is on *some* peer), the store keeps one
estimate per remote node, `peer:<node id>` (`peer_tier`), to choose among a chunk's
holders (`fastest_first`). Those are forgotten `forget_seconds` after their last
observation, so there are never more than the nodes seen lately.

Invariants: an estimate exists only after `min_batches` observations; `bytes_per_second`
> 0 and `latency_seconds` >= 0 whenever it exists; `break_even` and `fastest_first` are
pure functions of their arguments. Must not: import Ray or vLLM; callers pass plain numbers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

PEER = "peer"  # every remote node together: the estimate engines receive
PEER_PREFIX = "peer:"  # one remote node: `peer:<node id>`, kept by the store for itself


def peer_tier(node_id: str) -> str:
    """The estimate key of what one remote node delivers."""
    return PEER_PREFIX + node_id


def peer_node(tier: str) -> str | None:
    """The node id of a per-peer estimate key; None for a tier (`disk`, `object`, `peer`)."""
    return tier[len(PEER_PREFIX) :] if tier.startswith(PEER_PREFIX) else None


@dataclass(frozen=True)
class Cost:
    """One tier's current estimate, as the store hands it to engines."""

    latency_seconds: float
    bytes_per_second: float
    age_seconds: float = 0.0  # since the last observation: an old estimate may be stale

    def load_seconds(self, nbytes: int) -> float:
        return self.latency_seconds + nbytes / self.bytes_per_second


class TierEstimate:
    """Exponentially weighted least-squares fit of seconds = latency + bytes / bandwidth."""

    def __init__(self, half_life: float = 8.0, min_batches: int = 2):
        self._decay = 0.5 ** (1.0 / half_life)
        self.min_batches = min_batches
        self.batches = 0
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, nbytes: int, seconds: float) -> None:
        """One finished batch; empty or instant batches teach nothing and are ignored."""
        if nbytes <= 0 or seconds <= 0:
            return
        d, x, y = self._decay, float(nbytes), float(seconds)
        self._w = self._w * d + 1.0
        self._x = self._x * d + x
        self._y = self._y * d + y
        self._xx = self._xx * d + x * x
        self._xy = self._xy * d + x * y
        self.batches += 1

    def cost(self) -> tuple[float, float] | None:
        """(latency seconds, bytes per second), or None before `min_batches` observations."""
        if self.batches < self.min_batches:
            return None
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var_x = self._xx / self._w - mean_x * mean_x
        cov = self._xy / self._w - mean_x * mean_y
        if var_x > 1e-6 * mean_x * mean_x and cov > 0:
            per_byte = cov / var_x
            latency = mean_y - per_byte * mean_x
            if latency >= 0:
                return latency, 1.0 / per_byte
        # Sizes too alike (or noise made the fit absurd): all of it is transfer time.
        return 0.0, mean_x / mean_y


class TierEstimates:
    """A node store's estimates, one per tier read from (`disk`, `object`, `peer`) and one
    per remote node (`peer:<node id>`). Thread-safe."""

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, half_life: float = 8.0, forget_seconds: float = 600.0
    ):
        """`forget_seconds`: a per-peer estimate not observed for this long is dropped (the
        node may have left; long before, it was stale). Tiers' estimates are kept."""
        self._clock = clock
        self._half_life = half_life
        self._forget_seconds = forget_seconds
        self._lock = threading.Lock()
        self._tiers: dict[str, TierEstimate] = {}
        self._last: dict[str, float] = {}

    def observe(self, tier: str, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._tiers.setdefault(tier, TierEstimate(self._half_life)).observe(nbytes, seconds)
            self._last[tier] = self._clock()

    def costs(self) -> dict[str, Cost]:
        """Every tier and peer with an estimate."""
        now = self._clock()
        with self._lock:
            gone = [t for t, last in self._last.items() if peer_node(t) is not None and now - last > self._forget_seconds]
            for tier in gone:
                del self._tiers[tier], self._last[tier]
            out = {}
            for tier, estimate in self._tiers.items():
                fitted = estimate.cost()
                if fitted is not None:
                    out[tier] = Cost(fitted[0], fitted[1], now - self._last[tier])
            return out


def break_even(
    bytes_by_tier: dict[str, int],
    tokens: int,
    costs: dict[str, Cost],
    recompute_tokens_per_second: float | None,
    safety_margin: float,
    stale_seconds: float,
) -> tuple[bool, str | None]:
    """Whether to load `bytes_by_tier` (the rest of a prefix, by the tier each chunk would
    come from) rather than recompute its `tokens`; and the slowest tier when not.

    Loads when anything is unknown (no recompute rate, a tier with no estimate or one
    older than `stale_seconds`): loading is what measures a tier again. Tiers are read
    in parallel, so the load takes as long as its slowest tier. Recomputes only when the
    load would take longer than recomputing by more than `safety_margin` (0.2: 20 %).
    """
    if not recompute_tokens_per_second or tokens <= 0 or not bytes_by_tier:
        return True, None
    slowest, load_s = None, 0.0
    for tier, nbytes in bytes_by_tier.items():
        cost = costs.get(tier)
        if cost is None or cost.age_seconds > stale_seconds:
            return True, None
        seconds = cost.load_seconds(nbytes)
        if seconds >= load_s:
            slowest, load_s = tier, seconds
    recompute_s = tokens / recompute_tokens_per_second
    if load_s > recompute_s * (1.0 + safety_margin):
        return False, slowest
    return True, None


def fastest_first(sources: Sequence[str], costs: Mapping[str, Cost], nbytes: int, stale_seconds: float) -> list[str]:
    """`sources` in the order to read `nbytes` from, by `costs` (source -> its estimate).

    Sources with no estimate or one older than `stale_seconds` come first: reading from
    them is what measures them (a slow one is read again once per staleness period, then
    left as soon as that read renews its estimate). Then the rest, soonest delivery of
    `nbytes` first. Stable: ties keep the order given.
    """

    def rank(source: str) -> tuple[int, float]:
        cost = costs.get(source)
        if cost is None or cost.age_seconds > stale_seconds:
            return 0, 0.0
        return 1, cost.load_seconds(nbytes)

    return sorted(sources, key=rank)
