"""Least-recently-used order over committed slots."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from kvstrata.tiers.policies.base import EvictionPolicy


class LRUPolicy(EvictionPolicy):
    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()

    def add(self, slot: int) -> None:
        self._order[slot] = None
        self._order.move_to_end(slot)

    def touch(self, slot: int) -> None:
        if slot in self._order:
            self._order.move_to_end(slot)

    def remove(self, slot: int) -> None:
        self._order.pop(slot, None)

    def candidates(self) -> Iterator[int]:
        return iter(list(self._order))

    def __len__(self) -> int:
        return len(self._order)
