"""`benchmarks/trace_replay.py engines` without engines: a block id's text is stable and
shared ids give shared token prefixes (what makes the trace's reuse real reuse for
vLLM), long prompts are cut to whole blocks, and the policy mode's prediction counts
whole chunks the way vLLM caches them."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvstrata._dev.testing import VOCAB

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def engines(monkeypatch):
    """benchmarks/trace_engines.py, loaded from its file (benchmarks/ is scripts, not a package)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    loaded = {}
    for name in ("trace_replay", "trace_engines"):
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, name, module)  # dataclasses look their module up there
        spec.loader.exec_module(module)
        loaded[name] = module
    return loaded["trace_engines"]


def request(engines, line: int, ids: list[int], input_length: int, stamp_ms: int = 0, output_length: int = 0):
    return sys.modules["trace_replay"].Request(line, stamp_ms, input_length, tuple(ids), output_length)


def options(**overrides) -> argparse.Namespace:
    values = {"block_tokens": 8, "max_output": 8, "compress": 1.0}
    return argparse.Namespace(**(values | overrides))


def test_a_block_has_the_same_text_in_every_process(engines):
    here = [engines.block_text(block, 8) for block in (0, 46, 2353, 10**9)]
    code = (f"import sys; sys.path.insert(0, {str(BENCHMARKS)!r}); import trace_engines as t; "
            "print(','.join(t.block_text(b, 8) for b in (0, 46, 2353, 10**9)))")  # fmt: skip
    for seed in ("1", "2"):  # Python's own hash() would differ between these
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
        there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60, check=True)
        assert there.stdout.strip().split(",") == here
    assert len(set(here)) == 4 and all(len(text) == 8 for text in here)
    assert set("".join(here)) <= set(VOCAB)  # one token per character with the test model's tokenizer


def test_shared_ids_give_shared_token_prefixes_and_no_more(engines):
    a = request(engines, 1, [1, 2, 3], 3 * 512)
    b = request(engines, 2, [1, 2, 4, 5], 4 * 512)
    c = request(engines, 3, [6, 2, 3], 3 * 512)  # id 2 again, but after another first block: not shared
    pa, pb, pc = engines.build_prompts([a, b, c], options())
    assert pa.text[:16] == pb.text[:16] and pa.text[16:24] != pb.text[16:24]
    assert pa.text[:8] != pc.text[:8]
    assert len(pa.text) == 24 and len(pb.text) == 32


def test_the_last_block_keeps_its_share_and_long_prompts_are_cut_to_whole_blocks(engines):
    short = request(engines, 1, [1, 2], 512 + 128)  # the last block is a quarter full: 2 of 8 tokens
    assert engines.scaled_tokens(short, 8) == [8, 2]
    long = request(engines, 2, list(range(100, 400)), 300 * 512)  # 2,400 tokens at 8 a block
    kept, = engines.build_prompts([long], options())
    assert kept.cut and len(kept.text) == 8 * len(kept.block_ids) <= engines.MAX_MODEL_LEN - 9
    assert kept.block_ids == tuple(range(100, 100 + len(kept.block_ids)))


def test_outputs_are_the_traces_lengths_scaled_and_capped(engines):
    rows = [request(engines, 1, [1], 512, output_length=128), request(engines, 2, [2], 512, output_length=10_000),
            request(engines, 3, [3], 512)]  # fmt: skip
    prompts = engines.build_prompts(rows, options())
    assert [p.max_tokens for p in prompts] == [2, 8, 1]


def test_the_prediction_counts_whole_chunks_as_vllm_caches_them(engines):
    # 4 blocks of 8 tokens are one 32-token chunk. The second request shares the first
    # chunk (blocks 1-4) and adds one; the third shares 3 blocks (24 tokens): no whole chunk.
    rows = [request(engines, 1, [1, 2, 3, 4], 4 * 512, 0), request(engines, 2, [1, 2, 3, 4, 5, 6, 7, 8], 8 * 512, 1000),
            request(engines, 3, [1, 2, 3, 9, 10, 11, 12], 7 * 512, 2000)]  # fmt: skip
    args = options()
    prompts = engines.build_prompts(rows, args)
    chunked = engines.chunk_requests(prompts, rows, 8)
    assert [len(r.hash_ids) for r in chunked] == [1, 2, 1]
    assert chunked[0].hash_ids[0] == chunked[1].hash_ids[0] != chunked[2].hash_ids[0]
    predicted = engines.predicted_hit_ratio(prompts, rows, args, arena_chunks=64, disk_chunks=64)
    assert predicted == {"hit_ratio": 32 / (32 + 64 + 56), "ceiling": 32 / (32 + 64 + 56)}


def test_the_benchmarks_stores_are_the_actor_with_its_cluster(engines):
    """routing.py's SlowStore (also trace_replay.py engines' store) runs as a Ray actor: it
    must be the actor's class, which resolves the bucket's credentials and links the
    peers. Extending the in-process core instead ran every store with neither."""
    from kvstrata.actors.node_actor import NodeStoreActor

    routing = importlib.import_module("routing")
    assert issubclass(routing.SlowStore, NodeStoreActor)
