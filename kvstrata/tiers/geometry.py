"""Where a pool's slots live in its shared-memory segments: the arena sends this to workers."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PoolGeometry:
    """What a worker needs to find slot bytes: pure data, sent over Ray."""

    namespace: str
    slot_bytes: int
    slots_per_segment: int
    path_template: str  # format() with segment=<int>

    def segment_path(self, segment: int) -> str:
        return self.path_template.format(segment=segment)

    def locate(self, slot: int) -> tuple[int, int]:
        """(segment index, byte offset in that segment) of a slot."""
        segment, index = divmod(slot, self.slots_per_segment)
        return segment, index * self.slot_bytes
