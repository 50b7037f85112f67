"""End to end: a prefix resident in the arena is a HIT at its first lookup, as in vLLM's
own CPU offloader, with no RETRY and no store call on the scheduler's path.

Before deferred slot reuse, every arena-resident chunk that no running request of the
engine held pinned answered RETRY, was pinned through the next control call and became
a HIT a scheduler step later: on a GPU, tens of milliseconds added to the first token of
exactly the requests the cache is meant to speed up. Each prompt here runs alone after
a prefix-cache reset, so no running request holds its prefix.

The engine core runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) so the test
can read the manager's own counters of what it answered.
"""

from __future__ import annotations

import gc

import pytest

from kvstrata._dev.testing import build_tiny_llama, make_llm, run_round, shared_prefix_prompts, shutdown_llm
from tests.e2e.expect import assert_served_by_kvstrata, expected_hit

pytestmark = pytest.mark.slow

BLOCK = 32


def manager_of(llm):
    """The StrataManager inside an in-process engine core."""
    core = llm.llm_engine.engine_core.engine_core
    return core.scheduler.connector.connector_scheduler.manager


def test_an_arena_resident_prefix_is_served_with_no_retry_and_bit_exact(cluster, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    model = build_tiny_llama(tmp_path / "model", seed=5)
    config = {"tiers": {"cpu": {"capacity": "64MiB", "segment_size": "16MiB"}}, "engine": {"lease_seconds": 20}}
    prompts = shared_prefix_prompts()
    llm = make_llm(model, config)
    try:
        manager = manager_of(llm)
        first = run_round(llm, prompts)
        before = manager.counters()
        second = run_round(llm, prompts)
        after = manager.counters()
    finally:
        shutdown_llm(llm)
        del llm
        gc.collect()

    assert_served_by_kvstrata(first, second)  # every prefix from kvstrata, outputs bit-exact
    chunks = sum(expected_hit(r["prompt_tokens"]) // BLOCK for r in second)
    # No RETRY and every expected chunk loaded: each was a HIT at its first lookup, from
    # local state. Most come from the mirror (resident, no pin yet); a chunk whose pin the
    # engine still held from round one (its release waits for the commit's answer, later
    # on a loaded machine: 34 of 36 in one run beside other engines) is a HIT from that pin.
    assert after["lookups_retried"] - before["lookups_retried"] == 0
    assert after["chunks_loaded"] - before["chunks_loaded"] == chunks
    assert after["hits_without_round_trip"] - before["hits_without_round_trip"] > chunks // 2
    assert after["holds_refused"] == 0
