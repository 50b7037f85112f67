"""Driving a StrataManager the way vLLM's scheduler does, over in-process node stores:
the request context, the end of a step, and chunk stores with known bytes."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np

from kvstrata.store.local_client import LocalStoreClient
from kvstrata.connector.compat import OffloadingConfig, ReqContext, ScheduleEndContext

SLOT = 4096


class HangingClient(LocalStoreClient):
    """A store that stops answering until released (a wedged actor, a partitioned node)."""

    def __init__(self, store):
        super().__init__(store)
        self.release = threading.Event()
        self.release.set()

    def step(self, request):
        assert self.release.wait(30)
        return super().step(request)


def ctx(req: str = "r") -> ReqContext:
    return ReqContext(req_id=req)


def step(manager, store=None) -> None:
    """End a step and wait for its control call; with `store`, also for the store's I/O."""
    manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
    assert manager.wait_idle(10)
    if store is not None:
        assert store.wait_io(10)


def store_chunks(store, manager, keys, seed: int = 0, settle: bool = False) -> dict[bytes, np.ndarray]:
    """Write random bytes for each key through prepare_store/complete_store; returns them.

    `settle` also waits for the store's background I/O (cascades, uploads).
    """
    out = manager.prepare_store(keys, ctx("w"))
    assert out is not None and out.keys_to_store == list(keys)
    pool = store.arena.pools[manager.namespace]
    data = {}
    for i, (k, slot) in enumerate(zip(keys, out.store_spec.block_ids)):
        data[k] = np.random.default_rng(seed + i).integers(0, 256, SLOT, dtype=np.uint8)
        pool.view(int(slot))[:] = data[k]
    manager.complete_store(keys, ctx("w"))
    step(manager, store if settle else None)
    return data


def offloading_config(
    extra: dict,
    model: str = "tiny",
    dtype: str = "float32",
    world_size: int = 1,
    windows: tuple[int | None, ...] = (None,),
    worker_bytes: int = 16384,
    blocks_per_chunk: int = 2,
) -> OffloadingConfig:
    """vLLM's offloading config of an engine with one KV group per entry of `windows`
    (None: full attention; n: a sliding window of n chunks, 1 for a Mamba state).
    Fields a vLLM version lacks (0.29: group_id; < 0.33: the window) are left out."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    known = {f.name for f in dataclasses.fields(OffloadingGroupConfig)}
    groups = []
    for gid, window in enumerate(windows):
        group = {"tokens_per_block": 32, "layer_names": (f"g{gid}.l0", f"g{gid}.l1"), "group_id": gid,
                 "sliding_window_size_in_chunks": window}  # fmt: skip
        groups.append(OffloadingGroupConfig(**{k: v for k, v in group.items() if k in known}))
    return OffloadingConfig(
        groups=tuple(groups),
        worker_kv_bytes_per_block=worker_bytes,
        enable_kv_cache_events=False,
        extra_config=extra,
        engine_id="engine-test",
        model=OffloadingModelConfig(name=model, dtype=dtype),
        cache=OffloadingCacheConfig(tokens_per_hash=32, blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=world_size,
            tp_size=world_size,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )
