"""Deferred slot reuse: a slot whose chunk left the index waits until every engine saw it go.

Why: an engine answers HIT for a chunk resident in the arena straight from its mirror of
the store's index, with no call to the store on the scheduler's path (as vLLM's
in-process offloader does). Its pin reaches the store with the engine's next control
call, a step later. Between the two the store may evict the chunk; its slot must then
keep the chunk's bytes until the engine's load has read them (rule 1: a HIT's bytes stay
put until its load completes).

How: each engine that answers from a mirror (a *watcher*) acknowledges, in every control
call, the change-log sequence its mirror has applied, and sends in the same call the
pins (key, slot) of every HIT it answered from that mirror. A slot retired when the log
stood at `seq` is handed out again only once every watcher acknowledged `seq` or later:
such a watcher has seen the removal (it answers no new HIT from that slot) and has
already sent the pins of the HITs it answered before (the store took them before the
acknowledgement, so those loads hold the slot). A watcher whose lease ran out is
forgotten, which releases what waited on it.

Invariants:
- A waiting slot keeps the bytes of exactly one former chunk (`former`) and is in no
  other state (free, reserved, indexed, orphaned) until it is claimed or released.
- `claim` gives a waiting slot to a pin only for that former chunk's key.
- Entries leave in order of the sequence they wait for (a heap: an orphan retires with
  the older sequence of its chunk's removal); a slot retired again after a claim waits
  for its new sequence (a stale entry of an older retirement is skipped).

Plain Python, no locks: the arena's pool calls it under the node store's lock.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable


class DeferredReuse:
    def __init__(self, seq: Callable[[], int] = lambda: 0):
        self.seq = seq  # the namespace's change-log sequence, read at each retirement
        self._acked: dict[str, int] = {}
        self._queue: list[tuple[int, int]] = []  # heap of (sequence waited for, slot)
        self._waiting: dict[int, int] = {}  # slot -> the sequence its live entry waits for
        self.former: dict[int, bytes] = {}  # waiting slot -> key whose bytes it still holds
        self.peak = 0

    def __len__(self) -> int:
        return len(self._waiting)

    @property
    def watchers(self) -> int:
        return len(self._acked)

    def watch(self, holder: str, seq: int) -> None:
        """`holder` answers HITs from a mirror taken at `seq` (its registration snapshot)."""
        self._acked[holder] = max(seq, self._acked.get(holder, seq))

    def acknowledge(self, holder: str, seq: int) -> list[int]:
        """`holder` applied the log up to `seq` and sent the pins of every HIT it answered
        before; returns the slots that may now be reused."""
        if holder not in self._acked or seq <= self._acked[holder]:
            return []
        self._acked[holder] = seq
        return self._release()

    def forget(self, holder: str) -> list[int]:
        """A watcher that is gone (lease expired, released): its acknowledgement is waived."""
        if self._acked.pop(holder, None) is None:
            return []
        return self._release()

    def retire(self, slot: int, key: bytes | None, removed_at: int | None = None) -> bool:
        """A slot leaves every index and pin; True if it must wait (the caller must not free it).

        `removed_at`: the log sequence at which `key` left the index, when that was before
        now (an orphan freed by the end of its copy to another tier): a watcher that
        acknowledged it answers no HIT from the slot since, and its earlier HITs' holds pin
        the orphan. Default: the sequence now.
        """
        if key is None or not self._acked:
            return False
        seq = self.seq() if removed_at is None else removed_at
        if min(self._acked.values()) >= seq:
            return False
        self._waiting[slot] = seq
        self.former[slot] = key
        heapq.heappush(self._queue, (seq, slot))
        self.peak = max(self.peak, len(self._waiting))
        return True

    def claim(self, slot: int, key: bytes) -> bool:
        """Take a waiting slot out for a pin on its former chunk; False if it is not one."""
        if self.former.get(slot) != key:
            return False
        del self.former[slot], self._waiting[slot]
        return True

    def _release(self) -> list[int]:
        floor = min(self._acked.values(), default=None)
        released: list[int] = []
        queue, waiting = self._queue, self._waiting
        while queue and (floor is None or queue[0][0] <= floor):
            seq, slot = heapq.heappop(queue)
            if waiting.get(slot) == seq:
                del waiting[slot], self.former[slot]
                released.append(slot)
        return released
