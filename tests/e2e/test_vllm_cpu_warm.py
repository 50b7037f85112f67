"""End to end (issue #41): `kvstrata warm` and `kv.retain` on a real vLLM CPU engine.

- A prompt whose chunks are only in the bucket (an arena too small for the working set,
  no disk), warmed from outside the engine, is a HIT at the request's first lookup: no
  RETRY, every prefix chunk from the arena, output bit-exact. The same request without
  the warm waits a step per promotion (RETRY): the control.
- A prompt whose request carried a `kv.retain` hint (in `kv_transfer_params`) outlives a
  flood of one-off prompts ten times the arena, still a HIT at its first lookup; a
  prompt that was not retained is gone from the arena.

The engine core runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) so the test
reads the manager's own counters of what it answered.
"""

from __future__ import annotations

import gc
import threading
import time

import pytest
import ray
from vllm import SamplingParams

from kvstrata.actors.client import get_node_store
from kvstrata.connector.compat import ScheduleEndContext
from kvstrata._dev.testing import build_tiny_llama, make_llm, run_round, shutdown_llm
from kvstrata.warm import warm
from tests.e2e.expect import assert_served_by_kvstrata, expected_hit

pytestmark = pytest.mark.slow

BLOCK = 32
ARENA_SLOTS = 24
PROMPTS = [f"Agent {i} tool result: " + f"record {i} of the shared workspace, kept warm. " * 4 for i in range(2)]


def manager_of(llm):
    """The StrataManager inside an in-process engine core."""
    return llm.llm_engine.engine_core.engine_core.scheduler.connector.connector_scheduler.manager


def one_offs(count: int, start: int) -> list[str]:
    return [f"One-off {n}: " + f"unrelated question number {n} about nothing. " * 2 for n in range(start, start + count)]


@pytest.fixture(scope="module")
def engine(cluster, tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    model = build_tiny_llama(tmp_path_factory.mktemp("model") / "tiny", seed=11)
    bucket = tmp_path_factory.mktemp("bucket")
    config = {
        "tiers": {
            "cpu": {"capacity": ARENA_SLOTS * 64 * 1024, "segment_size": 8 * 64 * 1024},
            "object": {"url": f"file://{bucket}/kv", "write_policy": "write_through", "index_refresh_seconds": 1},
        },
        "engine": {"reserve_slots": 6, "max_view_age_seconds": 0},
        "admission": {"load": "always"},
    }
    llm = make_llm(model, config)
    try:
        store = get_node_store()
        reference = []
        for prompt in PROMPTS:  # stored, then in the bucket
            reference += run_round(llm, [prompt])
            assert ray.get(store.wait_io.remote(60))
        yield llm, model, store, reference
    finally:
        shutdown_llm(llm)
        del llm
        gc.collect()
        mp.undo()


def flood(llm, store, chunks: int, start: int) -> None:
    """One-off prompts worth `chunks` arena chunks (3 whole chunks each)."""
    for prompt in one_offs(chunks // 3 + 1, start):
        run_round(llm, [prompt], max_tokens=1)
    assert ray.get(store.wait_io.remote(60))


def refresh_view(llm) -> None:
    """One control call of the idle engine, answered: its view of the store now shows what
    landed meanwhile. A serving engine makes one every scheduler step; an idle offline
    engine only every `refresh_seconds`, and its next request would find the warmed
    chunks one step late (a RETRY)."""
    manager = manager_of(llm)
    manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
    assert manager.wait_idle(10)


def wait_for_retained(store, chunks: int, timeout_s: float = 30.0) -> None:
    """Poll the store until it retains `chunks` chunks (bounded)."""
    deadline = time.monotonic() + timeout_s
    while ray.get(store.stats.remote())["retain_chunks"] < chunks:
        assert time.monotonic() < deadline, f"the store never retained {chunks} chunks"
        threading.Event().wait(0.05)  # a poll period, bounded by the deadline


def serve_counted(llm, prompt: str) -> tuple[dict, dict]:
    manager = manager_of(llm)
    before = manager.counters()
    result = run_round(llm, [prompt])[0]
    after = manager.counters()
    return result, {name: after[name] - before[name] for name in after}


def test_a_warmed_prompt_from_the_bucket_is_a_hit_at_its_first_lookup(engine):
    llm, model, store, reference = engine
    flood(llm, store, 2 * ARENA_SLOTS, start=0)  # both prompts now only in the bucket
    namespace = manager_of(llm).namespace
    assert not any(ray.get(store.prefetch_holds.remote(namespace)))
    [report] = warm(str(model), PROMPTS[0])
    chunks = expected_hit(reference[0]["prompt_tokens"]) // BLOCK
    moved = report["prefetch"].get("moving", 0) + report["prefetch"].get("waiting", 0)  # waiting: for a settling slot
    assert report["held"] >= chunks and moved >= chunks, report

    refresh_view(llm)
    warmed, counted = serve_counted(llm, PROMPTS[0])
    assert_served_by_kvstrata(reference[:1], [warmed])  # every prefix chunk from kvstrata, bit-exact
    assert counted["lookups_retried"] == 0 and counted["hits_without_round_trip"] >= chunks
    assert counted["requests_hit_at_first_lookup"] == 1
    stats = ray.get(store.stats.remote())
    assert stats["prefetch_used"] >= chunks and stats["object_promotions"] >= chunks

    cold, counted = serve_counted(llm, PROMPTS[1])  # the control: no warm, the same bucket
    assert_served_by_kvstrata(reference[1:], [cold])
    assert counted["lookups_retried"] > 0 and counted["requests_retried_at_first_lookup"] == 1


def test_a_prompt_retained_by_its_requests_hint_outlives_a_flood_ten_times_the_arena(engine):
    llm, model, store, reference = engine
    run_round(llm, PROMPTS[1:])  # resident now, not retained
    # The request itself asks for its prompt to be kept (kv_transfer_params: what the
    # OpenAI server takes); the engine sends the hint to the store through Ray.
    retain = {"action_id": "r", "action_type": "kv.retain", "action_version": "1.0", "payload": {"priority": 80, "ttl": "1h"}}
    params = SamplingParams(max_tokens=16, temperature=0.0, extra_args={
        "kv_transfer_params": {"kv_hints": {"protocol_version": "1.0", "message_id": "m", "actions": [retain]}}})  # fmt: skip
    llm.reset_prefix_cache()
    llm.generate([PROMPTS[0]], params, use_tqdm=False)
    # vLLM tells the manager that a request finished at its next scheduler step: take one.
    run_round(llm, one_offs(1, start=999), max_tokens=1)
    assert manager_of(llm).counters()["hints_sent"] >= 1
    retained = expected_hit(reference[0]["prompt_tokens"]) // BLOCK
    wait_for_retained(store, retained)  # the hint is an actor call the engine does not wait for
    flood(llm, store, 10 * ARENA_SLOTS, start=1000)
    assert ray.get(store.stats.remote())["retain_chunks"] >= retained
    refresh_view(llm)
    kept, counted = serve_counted(llm, PROMPTS[0])
    assert_served_by_kvstrata(reference[:1], [kept])
    assert counted["lookups_retried"] == 0  # still in the arena: a HIT at the first lookup
    lost, counted = serve_counted(llm, PROMPTS[1])  # not retained: LRU lost it to the flood
    assert_served_by_kvstrata(reference[1:], [lost])
    assert counted["lookups_retried"] > 0
