"""Weights changed in place while serving: after vLLM's connector reset, no chunk
computed before it is ever a HIT, here or from anywhere it was copied."""

from __future__ import annotations

import dataclasses

import pytest

from kvstrata.store.local_client import LocalStoreClient
from kvstrata.connector.compat import HAS_RESET_FLUSHED, LookupResult, ScheduleEndContext
from kvstrata.connector.manager import StrataManager
from kvstrata.connector.weight_updates import WeightGenerations
from tests.connector.harness import step
from tests.connector.test_manager import (  # noqa: F401 - fixtures
    SLOT,
    _close_managers,
    clock,
    ctx,
    make_manager,
    managers,
    new_store,
    store_and_config,
    store_keys,
)
from tests.utils import key, layout

HIT, MISS, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY
OLD = dataclasses.replace(layout(worker_bytes=SLOT), model_identity="weights-v1")


def settled(manager, k, req="reader") -> LookupResult:
    """The answer once the manager has heard from the store since now (RETRY means: ask next step)."""
    step(manager)
    for _ in range(20):
        answer = manager.lookup(k, ctx(req))
        if answer is not RETRY:
            return answer
        step(manager)
    raise AssertionError("still RETRY after 20 steps")


def generations(store, cfg, fail: bool = False) -> WeightGenerations:
    def start(generation: int):
        if fail:
            raise ConnectionError("node store unreachable")
        lay = dataclasses.replace(OLD, model_identity=f"weights-v1-updated-{generation}")
        return make_manager(store, cfg, holder=f"engine-a-g{generation}", lay=lay)

    return WeightGenerations(make_manager(store, cfg, holder="engine-a", lay=OLD), start)


def test_after_a_reset_old_weights_chunks_are_never_hits_even_when_stored_again(new_store):
    """Another engine still on the old weights (here, or on a node whose chunks reach this
    one by peer fetch, upload or a late commit) puts the old namespace's chunks back after
    this engine's reset. A purge alone then serves them; a new generation never does."""
    store, cfg = new_store(slots=64)  # four engines' stocks and their chunks, none evicted
    engine = generations(store, cfg)
    purge_only = make_manager(store, cfg, holder="engine-p", lay=OLD)  # the control: reset = purge
    store_keys(engine, [key(1)])
    assert settled(engine, key(1)) is HIT and settled(purge_only, key(1)) is HIT
    engine.on_new_request(ctx("across"))  # a request that goes on across the reset

    engine.reset_cache()
    purge_only.reset_cache()
    step(engine)
    step(purge_only)
    assert store.keys(purge_only.namespace) == []  # the old namespace is purged on this node, as before
    other = make_manager(store, cfg, holder="engine-b", lay=OLD)  # still serving the old weights
    store_keys(other, [key(1), key(2)])

    assert settled(purge_only, key(2)) is HIT  # what the reset alone would have served
    assert settled(engine, key(1)) is MISS and settled(engine, key(2)) is MISS
    assert engine.generation == 1 and engine.namespace != purge_only.namespace
    # The new weights' own chunks are hits; the request that spanned the reset stores none.
    assert engine.prepare_store([key(3)], ctx("across")).keys_to_store == []
    engine.on_request_finished(ctx("across"))
    store_keys(engine, [key(3)], req="after")
    assert settled(engine, key(3)) is HIT
    assert engine.wait_retired(10)


def generations_as(store, cfg, flush_signal: bool, async_scheduling: bool) -> WeightGenerations:
    """An engine whose first manager follows vLLM 0.33's reset order (`flush_signal`) or
    0.29-0.32's, with or without async scheduling, as kvstrata/_dev/sim/engine.py sets it."""

    def start(generation: int):
        lay = dataclasses.replace(OLD, model_identity=f"weights-v1-updated-{generation}")
        return make_manager(store, cfg, holder=f"engine-a-g{generation}", lay=lay)

    first = StrataManager(
        LocalStoreClient(store), OLD, cfg, "engine-a", enable_events=True, async_scheduling=async_scheduling
    )
    first._reset_flush_signal = flush_signal
    managers.append(first)
    assert first.wait_idle(10)
    return WeightGenerations(first, start)


@pytest.mark.parametrize(
    "flush_signal, async_scheduling", [(False, False), (False, True), (True, False)], ids=["0.32", "0.32-async", "0.33"]
)
def test_a_load_in_flight_at_the_reset_keeps_its_slot_until_vllm_flushed_it(
    store_and_config, flush_signal, async_scheduling
):
    """Issue 51, finding 1: on vLLM < 0.33 the old generation was retired (every slot
    released) right after the first step end, while vLLM flushes a pre-reset load only
    during the next execution: another engine could rewrite the slot under the load."""
    store, cfg = store_and_config
    engine = generations_as(store, cfg, flush_signal, async_scheduling)
    old = engine.current
    store_keys(engine, [key(1)])
    assert settled(engine, key(1)) is HIT
    pool = store.arena.pools[old.namespace]
    engine.prepare_load([key(1)], ctx())  # vLLM is reading the slot when the reset comes
    engine.reset_cache()
    # Steps whose end comes before vLLM's flush has run: the slot stays pinned (purged
    # from the index: an orphan whose bytes nobody may reuse).
    steps_before_flush = 3 if flush_signal else (2 if async_scheduling else 1)
    for _ in range(steps_before_flush):
        step(engine)
        assert old.wait_idle(10) and engine.wait_retired(10)
        assert store.keys(old.namespace) == []
        assert pool.stats()["pinned"] == 1 and pool.stats()["orphans"] == 1, pool.stats()
    if flush_signal:  # 0.33: only vLLM's word that the workers are done frees it
        engine.on_reset_flushed()
    step(engine)  # the first step end after the flush: its request carries the unpin, then the old one retires
    assert engine.wait_retired(10)
    assert pool.stats()["pinned"] == 0 and pool.stats()["orphans"] == 0


def test_a_request_running_across_a_reset_stores_nothing_in_the_new_generation(store_and_config):
    """Issue 51, finding 3: vLLM 0.32 re-offloads running requests from chunk 0 after a
    connector reset; their KV was computed (in part) with the old weights, so the new
    generation must not keep it. A request that starts after the reset stores as usual."""
    store, cfg = store_and_config
    engine = generations(store, cfg)
    engine.on_new_request(ctx("across"))
    engine.reset_cache()
    engine.on_reset_flushed()
    step(engine)
    out = engine.prepare_store([key(1), key(2)], ctx("across"))  # vLLM's re-offload from chunk 0
    assert out is not None and out.keys_to_store == []
    engine.on_request_finished(ctx("across"))
    assert settled(engine, key(1)) is MISS and settled(engine, key(2)) is MISS
    engine.on_new_request(ctx("after"))
    store_keys(engine, [key(3)], req="after")
    assert settled(engine, key(3)) is HIT
    assert engine.wait_retired(10)


def test_a_generation_that_cannot_start_recomputes_everything(store_and_config, caplog):
    store, cfg = store_and_config
    engine = generations(store, cfg, fail=True)
    store_keys(engine, [key(1)])
    engine.reset_cache()
    assert "could not start a new cache generation" in caplog.text
    assert engine.lookup(key(1), ctx()) is MISS
    assert engine.prepare_store([key(2)], ctx()) is None
    engine.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))  # retires the old one
    assert engine.wait_retired(10)


def test_counters_of_the_old_generation_are_reported_once(store_and_config):
    store, cfg = store_and_config
    engine = generations(store, cfg)
    engine.get_stats()
    store_keys(engine, [key(1), key(2)])
    engine.reset_cache()
    if HAS_RESET_FLUSHED:
        engine.on_reset_flushed()
    step(engine)
    step(engine)  # before 0.33 the old generation retires at the end of the step after the flush step
    stored = engine.get_stats().reduce()
    assert any(name.endswith("chunks_stored") and value == 2 for name, value in stored.items()), stored
    again = engine.get_stats().reduce()
    assert all(value == 0 for name, value in again.items() if name.endswith("chunks_stored")), again
    assert engine.wait_retired(10)
