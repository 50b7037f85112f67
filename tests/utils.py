"""Shared test helpers: a controllable clock, layouts, and in-process stores."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from typing import Any
from pathlib import Path

from kvstrata.keys import Layout, make_key
from kvstrata.tiers.disk import HEADERS_SUFFIX, PAYLOADS_SUFFIX
from kvstrata.tiers.records import HEADER_BYTES


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


@contextlib.contextmanager
def local_ray(namespace: str, **init_kwargs: Any) -> Iterator[None]:
    """A local Ray cluster on loopback for one test module; always shut down.

    RAY_ADDRESS points engine processes spawned meanwhile at this cluster: with
    `address="auto"` they would join whichever cluster on the machine started last.
    """
    import os

    import ray

    # address="local": always a new cluster, never one another process left on the machine.
    ray.init(
        address="local", num_cpus=2, include_dashboard=False, namespace=namespace, log_to_driver=False, **init_kwargs
    )
    previous = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("RAY_ADDRESS", None)
        else:
            os.environ["RAY_ADDRESS"] = previous
        ray.shutdown()


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


def flip_disk_payload_bytes(directory: str | Path, stride: int, at: int = 7, key: bytes | None = None) -> int:
    """Flip one payload byte (`at` bytes into it) of every record a disk tier's directory holds,
    or only of the record whose header names `key`. Returns how many records were hit."""
    flipped = 0
    for payloads in Path(directory).glob(f"*{PAYLOADS_SUFFIX}"):
        headers = payloads.with_suffix(HEADERS_SUFFIX).read_bytes()
        if key is None:
            records = range(len(headers) // HEADER_BYTES)
        else:
            records = [headers.index(key) // HEADER_BYTES] if key in headers else []
        with open(payloads, "r+b") as f:
            for record in records:
                f.seek(record * stride + at)
                byte = f.read(1)
                f.seek(record * stride + at)
                f.write(bytes([byte[0] ^ 0x5A]))
        flipped += len(records)
    return flipped
