"""The contract between a slot pool and its eviction policy."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator


class EvictionPolicy(ABC):
    """Orders *committed* slots for eviction.

    The policy never sees pins: the pool skips pinned slots while walking the order, so
    recency is kept independent of transfer pinning and a slot that was pinned for a
    long load is not unfairly young or old when it is released.
    """

    @abstractmethod
    def add(self, slot: int) -> None: ...

    @abstractmethod
    def touch(self, slot: int) -> None: ...

    @abstractmethod
    def remove(self, slot: int) -> None: ...

    @abstractmethod
    def candidates(self) -> Iterator[int]:
        """Slots in eviction order (first = evict first)."""
