"""The router names a prompt's chunks exactly as the engine does: the keys here come from
vLLM's own request path (a `Request` with the engine core's block hasher, and the
offloading scheduler's `RequestOffloadState.update_offload_keys`) and the router's
(`chunks_of_prompt`) for the same prompt -- plain, with a `cache_salt`, with a LoRA
adapter, and for a hybrid model whose groups have different chunk sizes."""

from __future__ import annotations

import pytest

from kvstrata.keys import key_group
from kvstrata.routing.keys import KeyScheme, chunks_of_prompt
from tests.utils import layout

TOKENS_PER_HASH = 32


def engine_keys(token_ids, tokens_per_block, blocks_per_chunk, lora=None, cache_salt=None) -> list[bytes]:
    """The keys vLLM 0.32's scheduler gives the manager for this prompt."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        GroupOffloadConfig,
        RequestOffloadState,
        SchedulerOffloadConfig,
    )
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_offload.base import ReqContext, RequestOffloadingContext
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)  # what the engine core does at start
    lora_request = None if lora is None else LoRARequest(lora_name=lora[0], lora_int_id=1, lora_path=lora[1])
    request = Request(
        "r", list(token_ids), SamplingParams(max_tokens=1), None, lora_request=lora_request,
        cache_salt=cache_salt, block_hasher=get_request_block_hasher(TOKENS_PER_HASH, hash_fn),
    )  # fmt: skip
    groups = tuple(
        GroupOffloadConfig(
            group_idx=g, tokens_per_block=t, tokens_per_chunk=t * blocks_per_chunk,
            hashes_per_chunk=t * blocks_per_chunk // TOKENS_PER_HASH, kv_event_group_spec=None,
            sliding_window_size_in_chunks=None, kv_cache_spec=None, manager_cls=None,
        )  # fmt: skip
        for g, t in enumerate(tokens_per_block)
    )
    config = SchedulerOffloadConfig(groups, blocks_per_chunk, TOKENS_PER_HASH, 1, True, False)
    state = RequestOffloadState(config, request, ReqContext(req_id="r"), RequestOffloadingContext())
    state.update_offload_keys()
    return [bytes(k) for group in state.group_states for k in group.offload_keys]


def scheme(tokens_per_block=(32,), blocks_per_chunk=4) -> KeyScheme:
    return KeyScheme(
        namespace="ns", tokens_per_hash=TOKENS_PER_HASH, chunk_tokens=tuple(t * blocks_per_chunk for t in tokens_per_block),
        group_ids=tuple(range(len(tokens_per_block))), anchor_groups=None, hash_algo="sha256", slot_bytes=4096,
    )  # fmt: skip


PROMPT = [(i * 7919) % 30000 for i in range(1000)]  # 1000 tokens: 7 whole 128-token chunks and a tail


@pytest.mark.parametrize(
    "case",
    [
        {},
        {"cache_salt": "tenant-7"},
        {"lora": ("sql-adapter", "/adapters/sql/v3")},
        {"lora": ("sql-adapter", "/adapters/sql/v3"), "cache_salt": "tenant-7"},
    ],
    ids=["plain", "cache_salt", "lora", "lora+cache_salt"],
)
def test_the_router_names_chunks_as_the_engine_does(case):
    mine = chunks_of_prompt(scheme(), PROMPT, **case)
    theirs = engine_keys(PROMPT, (32,), 4, **case)
    assert len(theirs) == 1000 // 128 == len(mine.keys)
    assert list(mine.keys) == theirs
    assert list(mine.ends) == [128 * (c + 1) for c in range(7)]
    if case:  # each extra key changes every chunk's name: leaving one out would find nothing
        plain = chunks_of_prompt(scheme(), PROMPT)
        assert not set(plain.keys) & set(mine.keys)


def test_a_hybrid_model_s_groups_have_their_own_chunk_sizes_and_keys():
    mine = chunks_of_prompt(scheme(tokens_per_block=(32, 64)), PROMPT)
    theirs = engine_keys(PROMPT, (32, 64), 4)
    assert list(mine.keys) == theirs
    assert [key_group(k) for k in mine.keys] == [0] * 7 + [1] * 3  # 128- and 256-token chunks
    assert list(mine.ends) == [128 * (c + 1) for c in range(7)] + [256 * (c + 1) for c in range(3)]
    # A position both groups end at shares the block hash, not the key.
    assert mine.keys[1][:-4] == mine.keys[7][:-4] and mine.keys[1] != mine.keys[7]


def test_the_scheme_is_read_from_the_layout_engines_register():
    described = layout().describe()  # what a store reports under `layouts`
    read = KeyScheme.from_layout(described["namespace"], {**described, "models": ["tiny"]})
    assert read.chunk_tokens == (32,) and read.hash_algo == described["hash_algo"]
    assert read.slot_bytes == described["slot_bytes"] and read.namespace == described["namespace"]
    with pytest.raises(ValueError, match="layout of namespace bad is unusable"):
        KeyScheme.from_layout("bad", {"tokens_per_block": [32]})


def test_keys_that_cannot_be_reproduced_are_refused_not_guessed(monkeypatch):
    from kvstrata.connector.compat import prefix_block_hashes

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with pytest.raises(ValueError, match="random seed"):  # vLLM seeds xxhash engines at random
        prefix_block_hashes(PROMPT, TOKENS_PER_HASH, "xxhash")
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    seeded = prefix_block_hashes(PROMPT, TOKENS_PER_HASH, "sha256")
    assert seeded != prefix_block_hashes(PROMPT, TOKENS_PER_HASH, "sha256", seed="vllm-none-hash")
