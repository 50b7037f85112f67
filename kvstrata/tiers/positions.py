"""Which chunks of a tier share a position, so a hybrid model's position leaves together.

A hybrid model stores one chunk per KV group at a position, all under the same block
hash. vLLM loads a sliding-window or Mamba chunk only together with the full-attention
(anchor) chunk that ends at the same position; once a tier drops that anchor, the other
groups' chunks there can never be loaded from that tier again. Tiers ask
`dependents(key)` when they evict, and evict those too.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvstrata.keys import key_group, key_hash


class Positions:
    def __init__(self) -> None:
        self._keys: dict[bytes, set[bytes]] = {}  # block hash -> resident keys
        # None: the groups' kinds are unknown, nothing depends on anything.
        self.anchor_groups: frozenset[int] | None = None

    def set_anchor_groups(self, groups: Iterable[int] | None) -> None:
        """Learn the anchor groups once (the first engine that knows them tells)."""
        if groups is not None and self.anchor_groups is None:
            self.anchor_groups = frozenset(groups)

    def add(self, key: bytes) -> None:
        self.add_many((key,))

    def add_many(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            block_hash = key_hash(key)
            resident = self._keys.get(block_hash)
            if resident is None:
                self._keys[block_hash] = {key}
            else:
                resident.add(key)

    def remove(self, key: bytes) -> None:
        position = self._keys.get(key_hash(key))
        if position is not None:
            position.discard(key)
            if not position:
                del self._keys[key_hash(key)]

    def dependents(self, key: bytes) -> list[bytes]:
        """Resident chunks that become dead weight when `key` leaves this tier."""
        anchors = self.anchor_groups
        if anchors is None or key_group(key) not in anchors:
            return []
        return [other for other in self._keys.get(key_hash(key), ()) if key_group(other) not in anchors]
