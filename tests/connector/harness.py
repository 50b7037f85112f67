"""Driving a StrataManager the way vLLM's scheduler does, over in-process node stores:
the request context, the end of a step, and chunk stores with known bytes."""

from __future__ import annotations

import numpy as np

from kvstrata.connector.compat import ReqContext, ScheduleEndContext

SLOT = 4096


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
