"""Shared test helpers: a controllable clock, layouts, and in-process stores."""

from __future__ import annotations

import hashlib
from pathlib import Path

from kvstrata.keys import Layout, make_key
from kvstrata._dev.faults.damage import flip_disk_payload_bytes  # noqa: F401 - re-exported for the tests
from kvstrata._dev.testing import local_ray  # noqa: F401 - re-exported for the tests


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def key(i: int, group: int = 0) -> bytes:
    return make_key(hashlib.sha256(str(i).encode()).digest(), group)


def layout(model: str = "tiny", worker_bytes: int = 4096, world_size: int = 1, prefix: str = "") -> Layout:
    return Layout(
        model=model,
        dtype="float32",
        kv_cache_layout="",
        tokens_per_block=(32,),
        group_ids=(0,),
        tokens_per_hash=32,
        blocks_per_chunk=1,
        worker_kv_bytes_per_block=worker_bytes,
        world_size=world_size,
        tp_size=world_size,
        pp_size=1,
        pcp_size=1,
        dcp_size=1,
        hash_algo="sha256",
        namespace_prefix=prefix,
    )


def store_config(
    shm_dir,
    capacity: int,
    segment_size: int | None = None,
    lease_seconds: float = 30.0,
    reserve_slots: int = 4,
    disk: dict | None = None,
):
    return {
        "tiers": {
            "cpu": {"capacity": capacity, "segment_size": segment_size or max(1, capacity // 4), "shm_dir": str(shm_dir), "prefault": False},
            **({"disk": disk} if disk else {}),
        },
        "engine": {"lease_seconds": lease_seconds, "reserve_slots": reserve_slots, "control_timeout_seconds": 5, "refresh_seconds": 0},
    }


def crowd_out(pool, evict: int, holder: str = "another-engine") -> list[int]:
    """Another engine reserves every free slot a pool has or can still grow, and `evict`
    more: that many least-recently-used chunks leave the arena. Returns its slots (the
    evicted ones among them only where no engine watches the pool: with watchers, they
    wait for the engines' next acknowledgement, deferred reuse)."""
    stats = pool.stats()
    wanted = stats["free"] + pool.max_slots - stats["slots"] + evict
    taken = pool.reserve(holder, wanted)
    on_their_way = pool.stats()["awaiting_reuse"] - stats["awaiting_reuse"]
    assert len(taken) + on_their_way == wanted, f"reserved {len(taken)} of {wanted} slots: too many pinned"
    return taken


def reuse_estimate(reused: set[bytes] | list[bytes], asked: list) -> object:
    """A `reuse_of` hook for eviction tests: 5 uses for `reused` keys, 1 for the rest; each
    call is recorded in `asked` as (namespace, keys)."""

    def reuse_of(namespace: str, keys: list[bytes]) -> list[int]:
        asked.append((namespace, list(keys)))
        return [5 if k in reused else 1 for k in keys]

    return reuse_of
