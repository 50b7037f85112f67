"""End to end through the disk tier: an arena far too small for the working set, so
round 2 is served from local disk (promoted into the arena), bit-exact; corrupt disk
records become misses and the engine recomputes the same output."""

from __future__ import annotations

import pytest
import ray

from kvstrata.actors.client import get_node_store
from kvstrata._dev.testing import build_tiny_llama, make_llm, run_round, shutdown_llm
from tests.e2e.configs import arena_and_disk
from tests.e2e.expect import assert_served_by_kvstrata, expected_hit
from tests.utils import flip_disk_payload_bytes

pytestmark = pytest.mark.slow

SLOT = 64 * 1024  # the tiny model's KV per 32-token block


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("nvme")


@pytest.fixture(scope="module")
def engine(cluster, tmp_path_factory, disk_dir):
    model = build_tiny_llama(tmp_path_factory.mktemp("model") / "tiny", seed=5)
    llm = make_llm(model, arena_and_disk(disk_dir, SLOT, arena_slots=48, disk_slots=200))
    try:
        yield llm
    finally:
        shutdown_llm(llm)


# Six prompts of 12 chunks each: 72 chunks for a 48-slot arena.
PROMPTS = [f"Conversation {i}: " + f"topic {i} keeps coming back in this long shared prefix. " * 7 for i in range(6)]


def test_round_two_comes_back_from_disk_bit_exact(engine):
    round1 = run_round(engine, PROMPTS)
    store = get_node_store()
    assert ray.get(store.wait_io.remote(30))
    before = ray.get(store.stats.remote())
    round2 = run_round(engine, PROMPTS)
    after = ray.get(store.stats.remote())
    assert_served_by_kvstrata(round1, round2)
    # The working set never fit the arena: the first prompts' hits came from disk.
    assert after["promotions"] - before["promotions"] >= 12
    assert after["disk"]["corrupt_chunks"] == 0


def test_corrupt_disk_chunks_are_misses_and_the_output_stays_right(engine, disk_dir):
    reference = run_round(engine, PROMPTS[:1])
    store = get_node_store()
    assert ray.get(store.wait_io.remote(30))
    # Push prompt 0 out of the arena, then flip one byte in every record on disk.
    run_round(engine, PROMPTS[1:])
    assert ray.get(store.wait_io.remote(30))
    assert flip_disk_payload_bytes(disk_dir, stride=SLOT) >= 1
    result = run_round(engine, PROMPTS[:1])
    stats = ray.get(store.stats.remote())
    assert stats["disk"]["corrupt_chunks"] >= 1
    assert result[0]["cached_tokens"] < expected_hit(result[0]["prompt_tokens"])
    assert result[0]["token_ids"] == reference[0]["token_ids"]
    assert result[0]["logprobs"] == reference[0]["logprobs"]
