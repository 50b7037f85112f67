"""End to end on the CPU build of vLLM with a tiny random Llama built at test time.

One Ray cluster for the module; engines run with vLLM's default multiprocessing, so
the scheduler and the worker are separate processes that join the cluster and map
the arena like they would in production.
"""

from __future__ import annotations

import gc

import pytest
import ray

from kvstrata.actors.client import get_node_store
from kvstrata._dev.testing import (
    build_tiny_llama,
    make_llm,
    run_round,
    shared_prefix_prompts,
    shutdown_llm,
)
from tests.e2e.expect import assert_served_by_kvstrata, expected_hit
from tests.e2e.tamper import corrupt_chunks

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {"a": build_tiny_llama(root / "model-a", seed=1), "b": build_tiny_llama(root / "model-b", seed=2)}


@pytest.fixture(scope="module")
def config_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "kvstrata.yaml"
    path.write_text("tiers:\n  cpu:\n    capacity: 64MiB\n    segment_size: 16MiB\nengine:\n  lease_seconds: 20\n")
    return path


def namespaces():
    return list(ray.get(get_node_store().stats.remote())["pools"])


@pytest.fixture(scope="module")
def first_engine_rounds(cluster, models, config_path):
    """Rounds 1 and 2 on engine A, which is then shut down for good."""
    prompts = shared_prefix_prompts()
    llm = make_llm(models["a"], config_path)
    try:
        round1 = run_round(llm, prompts)
        round2 = run_round(llm, prompts)
    finally:
        shutdown_llm(llm)
        del llm
        gc.collect()
    return prompts, round1, round2


def test_round_two_is_served_by_kvstrata_with_identical_tokens_and_logprobs(first_engine_rounds):
    _, round1, round2 = first_engine_rounds
    # Round 1: the first prompt computes everything; the others already find the
    # shared prefix in kvstrata although the engine's own prefix cache was reset.
    assert round1[0]["cached_tokens"] == 0
    assert all(r["cached_tokens"] > 0 for r in round1[1:])
    assert_served_by_kvstrata(round1, round2)


def test_a_new_engine_hits_after_the_first_is_gone_and_corrupt_bytes_change_output(
    first_engine_rounds, models, config_path
):
    prompts, round1, _ = first_engine_rounds
    llm = make_llm(models["a"], config_path)
    try:
        round3 = run_round(llm, prompts)
        assert_served_by_kvstrata(round1, round3, same_engine=False)  # engine A is gone

        # Control: the same loads from corrupted arena bytes must change the output,
        # which proves the output above really came from the bytes kvstrata stored.
        (namespace,) = namespaces()
        assert corrupt_chunks(namespace) > 0
        corrupted = run_round(llm, prompts[:1])
        assert corrupted[0]["cached_tokens"] == expected_hit(corrupted[0]["prompt_tokens"])
        assert corrupted[0]["logprobs"] != round1[0]["logprobs"]
        ray.get(get_node_store().purge.remote(namespace))
    finally:
        shutdown_llm(llm)
        del llm
        gc.collect()


def test_engines_of_different_models_never_see_each_others_chunks(first_engine_rounds, models, config_path):
    prompts, _, _ = first_engine_rounds
    before = set(namespaces())
    llm = make_llm(models["b"], config_path)
    try:
        results = run_round(llm, prompts[:1])
        assert results[0]["cached_tokens"] == 0  # same prompt, same hashes, other model
        # And it stored its own chunks under its own namespace.
        assert len(set(namespaces()) - before) == 1
        again = run_round(llm, prompts[:1])
        assert again[0]["cached_tokens"] == expected_hit(again[0]["prompt_tokens"])
        assert again[0]["token_ids"] == results[0]["token_ids"]
    finally:
        shutdown_llm(llm)
        del llm
        gc.collect()
