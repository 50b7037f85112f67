"""Leases: pins and reservations belong to an engine only while it keeps renewing.

vLLM kills nothing on our behalf: an engine that crashes never unpins. Every holder
therefore has a deadline, renewed by each control call (and a heartbeat when idle);
a holder past its deadline loses everything it held, so no slot is wedged forever.

A lease measures the engine's silence, not the store's: time the store spent stalled in
one call (a purge wiping a large disk tier under its lock, a hung disk read) is given
back to every lease (`discount`), since no engine could renew meanwhile. Engines, for
their part, stop answering HIT from their own state once their last answer is older
than half a lease (connector/pins.py), so a lease that runs out never frees a slot an
engine still reads.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class LeaseTable:
    def __init__(self, duration_s: float, clock: Callable[[], float] = time.monotonic):
        if duration_s <= 0:
            raise ValueError(f"lease duration must be positive, got {duration_s}")
        self.duration_s = duration_s
        self._clock = clock
        self._deadlines: dict[str, float] = {}

    def renew(self, holder: str, duration_s: float | None = None) -> None:
        self._deadlines[holder] = self._clock() + (duration_s or self.duration_s)

    def discount(self, seconds: float) -> None:
        """The store was stalled for `seconds`: no holder could renew meanwhile."""
        for holder in self._deadlines:
            self._deadlines[holder] += seconds

    def release(self, holder: str) -> None:
        self._deadlines.pop(holder, None)

    def alive(self, holder: str) -> bool:
        deadline = self._deadlines.get(holder)
        return deadline is not None and deadline > self._clock()

    def take_expired(self) -> list[str]:
        """Holders whose lease ran out; they are forgotten here and must be dropped by the caller."""
        now = self._clock()
        expired = [holder for holder, deadline in self._deadlines.items() if deadline <= now]
        for holder in expired:
            del self._deadlines[holder]
        return expired

    def holders(self) -> list[str]:
        return list(self._deadlines)

    def remaining(self) -> dict[str, float]:
        """Seconds left on each live lease (for status; expiry is `take_expired`'s job)."""
        now = self._clock()
        return {holder: max(0.0, deadline - now) for holder, deadline in self._deadlines.items()}
