"""Tier configs the end-to-end modules share."""

from __future__ import annotations

from pathlib import Path

from kvstrata.tiers.disk import HEADER_BYTES


def arena_and_disk(disk_dir: Path, slot_bytes: int, arena_slots: int, disk_slots: int) -> dict:
    """A small arena in front of a disk tier: what does not fit the arena comes back from disk."""
    return {
        "tiers": {
            "cpu": {"capacity": arena_slots * slot_bytes, "segment_size": 8 * slot_bytes},
            "disk": {"path": str(disk_dir), "capacity": disk_slots * (slot_bytes + HEADER_BYTES)},
        },
        # Disk writes finish in the background, after this engine last heard from its
        # store: with no tolerated view age, the next round finds every chunk already on disk.
        "engine": {"reserve_slots": 12, "max_view_age_seconds": 0},
        # These tests exercise the load path: the tiny model recomputes a prompt faster
        # than a promotion's latency, so break_even (the default) would rightly skip it.
        "admission": {"load": "always"},
    }
