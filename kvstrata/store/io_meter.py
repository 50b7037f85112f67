"""What each tier of a node store moved: bytes, chunks and busy seconds, in total and over
the last minute.

An operator asks "which tier serves my hits, and how fast" of `kvstrata status` and of
the store's Prometheus metrics; both read this meter. The store records one event per
finished batch (a disk write job, a promotion batch, an upload batch, a peer fetch, an
engine step's commits or holds), never per chunk, so the meter costs nothing on the paths
it measures.

Tiers are `cpu` (the arena: engines' stores into it and loads from it, copied by the
engines' workers, so it has bytes but no seconds), `disk`, `object` and `peer`.
Directions are `read` (out of the tier, towards an engine) and `write` (into the tier).

Invariants: totals only grow; a rate is bytes recorded in the last `window_seconds`
divided by the time the window covers (the meter's age while it is younger than the
window), so a store that just started does not report a diluted rate.
Must not: import Ray or touch a tier; callers pass plain numbers.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

TIERS = ("cpu", "disk", "object", "peer")
DIRECTIONS = ("read", "write")
WINDOW_SECONDS = 60.0


@dataclass
class IoTotals:
    bytes: int = 0
    chunks: int = 0
    seconds: float = 0.0


class IoMeter:
    """Totals and a sliding window of bytes per (tier, direction). Thread-safe."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, window_seconds: float = WINDOW_SECONDS):
        self._clock = clock
        self.window_seconds = window_seconds
        self._started = clock()
        self._lock = threading.Lock()
        self._totals = {(tier, way): IoTotals() for tier in TIERS for way in DIRECTIONS}
        self._recent: dict[tuple[str, str], deque[tuple[float, int]]] = {key: deque() for key in self._totals}

    def record(self, tier: str, direction: str, nbytes: int, chunks: int, seconds: float = 0.0) -> None:
        """One finished batch. A tier not in `TIERS` (a lower tier plugged in by registration,
        tiers/base.py) is metered from its first batch; a direction not in `DIRECTIONS` is a KeyError."""
        if direction not in DIRECTIONS:
            raise KeyError((tier, direction))
        key = (tier, direction)
        now = self._clock()
        with self._lock:
            if key not in self._totals:
                self._totals[key] = IoTotals()
                self._recent[key] = deque()
            totals = self._totals[key]
            totals.bytes += nbytes
            totals.chunks += chunks
            totals.seconds += seconds
            if nbytes:
                recent = self._recent[key]
                recent.append((now, nbytes))
                self._trim(recent, now)

    def totals(self, tier: str, direction: str) -> IoTotals:
        with self._lock:
            totals = self._totals[(tier, direction)]
            return IoTotals(totals.bytes, totals.chunks, totals.seconds)

    def rate(self, tier: str, direction: str) -> float:
        """Bytes per second over the last window (or the meter's life, if shorter)."""
        now = self._clock()
        with self._lock:
            recent = self._recent[(tier, direction)]
            self._trim(recent, now)
            moved = sum(nbytes for _, nbytes in recent)
        span = min(self.window_seconds, now - self._started)
        return moved / span if span > 0 else 0.0

    def _trim(self, recent: deque[tuple[float, int]], now: float) -> None:
        horizon = now - self.window_seconds
        while recent and recent[0][0] < horizon:
            recent.popleft()
