"""The per-replica view of vLLM's own prefix cache: bounded by the engine's cache size in
LRU order (a finished prompt's tail goes first, as vLLM frees it), forgotten when unused
for long, replaced by the engine's KV events where they come, per replica."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from kvstrata.routing.engine_cache import EngineCacheView
from tests.utils import FakeClock


def blocks(name: str, n: int) -> list[bytes]:
    return [f"{name}-{i}".encode() for i in range(n)]


def test_the_view_holds_what_fits_the_engines_cache_and_evicts_the_oldest_prompt_first():
    view = EngineCacheView(capacity_tokens=10 * 16, max_age_seconds=60, clock=FakeClock())
    a, b = blocks("a", 6), blocks("b", 6)
    view.add("r1", a, 16)
    assert view.prefix_blocks("r1", a) == 6 and view.prefix_blocks("r2", a) == 0  # per replica
    view.add("r1", b, 16)  # 12 blocks > 10: two of a's go, its tail first (vLLM frees tails first)
    assert view.prefix_blocks("r1", b) == 6 and view.prefix_blocks("r1", a) == 4
    assert view.tokens("r1") == 10 * 16 and view.evicted == 2
    view.add("r1", a[:4], 16)  # a's prefix used again: now b is the oldest
    view.add("r1", blocks("c", 4), 16)
    assert view.prefix_blocks("r1", a) == 4 and view.prefix_blocks("r1", b) == 2


def test_a_prompt_unused_for_max_age_is_forgotten():
    clock = FakeClock()
    view = EngineCacheView(capacity_tokens=None, max_age_seconds=60, clock=clock)
    view.add("r1", blocks("a", 3), 16)
    clock.advance(61)
    assert view.prefix_blocks("r1", blocks("a", 3)) == 0
    view.add("r1", blocks("b", 1), 16)  # the next add drops the expired entries
    assert view.tokens("r1") == 16


@dataclass
class BlockStored:  # the fields of vLLM 0.32's event (vllm/distributed/kv_events.py)
    block_hashes: list
    block_size: int = 16
    medium: str | None = "GPU"


@dataclass
class BlockRemoved:
    block_hashes: list
    medium: str | None = "GPU"


@dataclass
class AllBlocksCleared:
    medium: str | None = field(default=None)


def test_kv_events_replace_the_guess():
    view = EngineCacheView(capacity_tokens=None, clock=FakeClock())
    a = blocks("a", 4)
    view.apply_events("r1", [BlockStored(a), BlockRemoved(a[2:3])], 16)
    assert view.prefix_blocks("r1", a) == 2  # a hole at block 2: the prefix ends there
    view.apply_events("r1", [BlockStored(blocks("x", 2), medium="CPU")], 16)  # an offloaded copy: not this cache
    assert view.prefix_blocks("r1", blocks("x", 2)) == 0
    view.apply_events("r1", [BlockStored([7, 8])], 16)  # vLLM may send int hashes
    assert view.prefix_blocks("r1", [b"\x07", b"\x08"]) == 2
    view.apply_events("r1", [AllBlocksCleared()], 16)
    assert view.tokens("r1") == 0 and view.prefix_blocks("r1", a) == 0


def test_a_cache_size_that_cannot_be_is_refused():
    with pytest.raises(ValueError, match="engine_cache_tokens must be > 0, not 0"):
        EngineCacheView(capacity_tokens=0)


def test_the_router_credits_a_replicas_own_cache_only_while_the_prompt_fits_there():
    import asyncio

    from kvstrata.actors.directory import DirectoryShard
    from kvstrata.routing.keys import chunks_of_prompt
    from tests.routing.test_router import PROMPT, SCHEME, choose, request, router

    async def run(evicted: bool) -> int:
        shard = DirectoryShard(0)
        shared = chunks_of_prompt(SCHEME, PROMPT[:400]).keys  # the system prompt: 3 chunks on both nodes
        for node in ("node-a", "node-b"):
            shard.sync(node, {"ns": ([(k, "CPU", True) for k in shared], -1, False)})
        made = router(shard, engine_cache_tokens=1024)  # 32 blocks of 32 tokens
        await choose(made, request(1, tokens=PROMPT[:500]))
        decision, first = made._decisions["i1"]
        made.on_request_completed(first, "i1")
        if evicted:  # other prompts sent there since: 32 blocks, the engine's whole cache
            made._engine_caches.add(first, [f"other-{i}".encode() for i in range(32)], 32)
        await choose(made, request(2, tokens=PROMPT[:700]))
        decision, _ = made._decisions["i2"]
        return decision.coverage[first].recent

    assert asyncio.run(run(evicted=False)) == 480  # the first turn's 15 blocks: in that engine's cache
    assert asyncio.run(run(evicted=True)) == 0  # pushed out: only the directory's chunks count
