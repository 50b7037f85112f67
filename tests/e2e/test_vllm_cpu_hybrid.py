"""End to end with a hybrid model on the CPU build of vLLM: a tiny Llama whose even layers
use a 64-token sliding window and odd layers full attention. vLLM splits its KV cache
into a sliding-window group and a full-attention group; kvstrata must store and load
both, through the arena and through disk, and the output must be bit-exact."""

from __future__ import annotations

import pytest
import ray

from kvstrata.actors.client import get_node_store
from kvstrata.keys import key_group
from kvstrata._dev.testing import build_tiny_llama, make_llm, run_round, shared_prefix_prompts, shutdown_llm
from tests.e2e.configs import arena_and_disk
from tests.e2e.expect import assert_served_by_kvstrata, expected_hit
from tests.e2e.tamper import corrupt_chunks

pytestmark = pytest.mark.slow

SLOT = 64 * 1024  # the model's KV per 32-token block in one group: two layers of 32 KiB
PROMPTS = shared_prefix_prompts(3, repeat=8)  # about 500 tokens: 15 chunks each
OTHERS = [f"Unrelated {i}: " + f"filler text number {i} pushes older chunks out. " * 10 for i in range(4)]


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("nvme")


@pytest.fixture(scope="module")
def engine(cluster, tmp_path_factory, disk_dir):
    model = build_tiny_llama(tmp_path_factory.mktemp("model") / "hybrid", seed=7, num_layers=4, sliding_window=64)
    llm = make_llm(model, arena_and_disk(disk_dir, SLOT, arena_slots=40, disk_slots=400))
    try:
        yield llm
    finally:
        shutdown_llm(llm)


@pytest.fixture(scope="module")
def reference(engine):
    """Round 1 (computed, stored) and the namespace it was stored under."""
    round1 = run_round(engine, PROMPTS)
    (namespace,) = ray.get(get_node_store().stats.remote())["pools"]
    return round1, namespace


def chunks_per_group(namespace: str, medium: str = "CPU") -> dict[int, int]:
    counts: dict[int, int] = {}
    for key in ray.get(get_node_store().keys.remote(namespace, medium)):
        counts[key_group(key)] = counts.get(key_group(key), 0) + 1
    return counts


def test_both_groups_are_stored_and_round_two_is_bit_exact(engine, reference):
    round1, namespace = reference
    counts = chunks_per_group(namespace)
    assert len(counts) == 2
    full, window = max(counts, key=counts.get), min(counts, key=counts.get)
    # Full attention keeps the whole prefix; the window group only what a load can use.
    assert counts[window] < counts[full]
    round2 = run_round(engine, PROMPTS)
    assert_served_by_kvstrata(round1, round2)


def test_corrupt_window_chunks_change_the_output(engine, reference):
    """Control: the window group's bytes really are loaded and used."""
    round1, namespace = reference
    counts = chunks_per_group(namespace)
    window = min(counts, key=counts.get)
    assert corrupt_chunks(namespace, groups={window}) > 0
    corrupted = run_round(engine, PROMPTS[:1])
    assert corrupted[0]["cached_tokens"] == expected_hit(corrupted[0]["prompt_tokens"])
    assert corrupted[0]["logprobs"] != round1[0]["logprobs"]
    ray.get(get_node_store().purge.remote(namespace))  # arena and disk: start clean


def test_the_prefix_and_its_window_come_back_from_disk_bit_exact(engine, reference):
    round1, namespace = reference
    store = get_node_store()
    run_round(engine, PROMPTS)  # computed again after the purge, stored, written to disk
    assert ray.get(store.wait_io.remote(30))
    run_round(engine, OTHERS)  # the arena cannot hold both
    assert ray.get(store.wait_io.remote(30))
    assert set(chunks_per_group(namespace, "STORAGE")) == set(chunks_per_group(namespace))
    before = ray.get(store.stats.remote())
    round3 = run_round(engine, PROMPTS)
    after = ray.get(store.stats.remote())
    assert_served_by_kvstrata(round1, round3)
    assert after["promotions"] > before["promotions"]
    assert after["disk"]["corrupt_chunks"] == 0
