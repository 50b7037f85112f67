"""An eviction policy with retained chunks evicted last, at O(1) per candidate whatever is retained.

Why: the first retention-aware order read the tier's whole order and set the retained
candidates aside, so each eviction read every retained chunk older than the first
unretained one -- `reserve(32)` on a 65,536-slot pool with all of it retained took 1.2 s
under the store's lock (issue #51). Here retained slots leave the inner policy: the inner
order holds only unretained slots, and the retained ones sit in one recency order per
priority. An eviction reads the inner order first, then the priorities lowest first, and
never reads a retained slot before an unretained one.

How a slot moves: `add` asks its key's retention (a chunk retained before it is stored is
retained from its commit on); `refresh(slot)` is called when a key's retention changes
(the table's listeners: retain, release, purge); an expiry is found from this order's own
heap of ends, at the next `candidates`. A slot whose retention ended goes back to the inner
order as its newest if it was used while retained, as its oldest if not (it was the
oldest then: nothing used it since it was retained) -- exact recency for the cases that
matter, O(1) always.

Invariants: every slot the order was given is in exactly one of the inner policy and the
priority orders; `candidates` yields each slot at most once, tolerates the caller
removing what it was given, and reads `visited` candidates, no more.
Must not: import Ray or vLLM; evict anything itself.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterator
from itertools import islice

from kvstrata.tiers.policies.base import EvictionPolicy

Entry = tuple[int, float]  # (priority, expires_at on the table's clock)


class RetentionOrder(EvictionPolicy):
    """`inner` (the tier's own policy, for unretained slots) with retained slots evicted after
    every unretained one, lowest priority first, each priority in recency order.

    `key_at(slot)`: the key a committed slot holds; `entry(key)`: its live retention
    (priority, expiry) or None; `clock`: the retention table's clock."""

    def __init__(
        self,
        inner: EvictionPolicy,
        key_at: Callable[[int], bytes | None],
        entry: Callable[[bytes], Entry | None],
        clock: Callable[[], float],
    ):
        self.inner = inner
        self._key_at = key_at
        self._entry = entry
        self._clock = clock
        self._priority: dict[int, int] = {}  # retained slot -> its priority order
        self._orders: dict[int, OrderedDict[int, None]] = {}  # priority -> retained slots, oldest first
        self._used: set[int] = set()  # retained slots used since they were retained
        self._ends: list[tuple[float, int]] = []  # heap of (expiry, slot); stale ones skipped
        self.visited = 0  # candidates read so far (tests count them)

    # --- EvictionPolicy -----------------------------------------------------------------

    def add(self, slot: int) -> None:
        key = self._key_at(slot)
        entry = None if key is None else self._entry(key)
        if entry is None:
            self.inner.add(slot)
        else:
            self._retain(slot, entry)

    def touch(self, slot: int) -> None:
        priority = self._priority.get(slot)
        if priority is None:
            self.inner.touch(slot)
        else:
            self._orders[priority].move_to_end(slot)
            self._used.add(slot)

    def remove(self, slot: int) -> None:
        priority = self._priority.pop(slot, None)
        if priority is None:
            self.inner.remove(slot)
            return
        self._drop_from(priority, slot)
        self._used.discard(slot)

    def candidates(self) -> Iterator[int]:
        self._expire()
        for slot in self.inner.candidates():
            self.visited += 1
            yield slot
        for priority in sorted(self._orders):
            given: set[int] = set()
            size = 8
            while (order := self._orders.get(priority)) is not None:
                window = list(islice(order, size))
                for slot in window:
                    if slot not in given and self._priority.get(slot) == priority:
                        given.add(slot)
                        self.visited += 1
                        yield slot
                if len(window) < size:
                    break
                size *= 2

    # --- retention changes ----------------------------------------------------------------

    def refresh(self, slot: int) -> None:
        """The retention of the key at `slot` changed (retained, renewed, released)."""
        key = self._key_at(slot)
        entry = None if key is None else self._entry(key)
        priority = self._priority.get(slot)
        if entry is None:
            if priority is not None:
                self._unretain(slot)
            return
        if priority is None:
            self.inner.remove(slot)
            self._retain(slot, entry)
        elif priority != entry[0]:
            self._drop_from(priority, slot)
            self._retain(slot, entry)
        else:
            heapq.heappush(self._ends, (entry[1], slot))

    def retained(self) -> int:
        return len(self._priority)

    # --- internals --------------------------------------------------------------------

    def _retain(self, slot: int, entry: Entry) -> None:
        priority, ends = entry
        self._priority[slot] = priority
        self._orders.setdefault(priority, OrderedDict())[slot] = None
        heapq.heappush(self._ends, (ends, slot))
        if len(self._ends) > 4 * len(self._priority) + 64:  # renewals left stale ends behind
            self._ends = [end for end in self._ends if end[1] in self._priority]
            heapq.heapify(self._ends)

    def _unretain(self, slot: int) -> None:
        priority = self._priority.pop(slot)
        self._drop_from(priority, slot)
        if slot in self._used:
            self._used.discard(slot)
            self.inner.add(slot)
        else:
            getattr(self.inner, "add_oldest", self.inner.add)(slot)

    def _drop_from(self, priority: int, slot: int) -> None:
        order = self._orders[priority]
        del order[slot]
        if not order:
            del self._orders[priority]

    def _expire(self) -> None:
        """Retentions whose end passed go back to the inner order (or to their new priority)."""
        now = self._clock()
        ends = self._ends
        while ends and ends[0][0] <= now:
            _, slot = heapq.heappop(ends)
            if slot in self._priority:
                self.refresh(slot)
