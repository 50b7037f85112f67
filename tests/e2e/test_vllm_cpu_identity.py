"""End to end: a chunk is served only to the weights that computed it, down to the
embedding rows of the prompt's own tokens rewritten in place.

The failure this guards against (issue #38): an in-place edit that keeps every file's
size kept the sampled fingerprint, and the edited checkpoint was served the old one's
KV. Here only the embedding rows of the prompts' tokens change, in place, and the
prompts are written with characters whose rows the old `sampled` default never read
(so it would have shared the old KV: the test checks that too): the next
engine must take 0 tokens from kvstrata and answer as the edited checkpoint does
alone, while the original checkpoint copied to another path (another node's disk)
shares every chunk, bit for bit. Then that engine's weights are reloaded in place
from the edited checkpoint while it serves (`collective_rpc("reload_weights")`, as RL
frameworks do) and vLLM's connector reset is called: nothing computed before it is
served after it.
"""

from __future__ import annotations

import gc
import json
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import ray

from kvstrata.actors.client import get_node_store
from kvstrata.identity import EXACT, SAMPLED, fingerprint_checkpoint, sampled_ranges
from kvstrata._dev.testing import VOCAB, build_tiny_llama, make_llm, run_round, shutdown_llm
from tests.e2e.expect import assert_close_logprobs, assert_served_by_kvstrata

pytestmark = pytest.mark.slow

CONFIG = {"tiers": {"cpu": {"capacity": "64MiB", "segment_size": "16MiB"}}, "engine": {"lease_seconds": 20}}


def embedding_rows(checkpoint: Path) -> tuple[Path, int, int]:
    """The weights file, where its embedding's first row starts, and the bytes of a row."""
    weights = checkpoint / "model.safetensors"
    with open(weights, "rb") as handle:
        header_bytes = int.from_bytes(handle.read(8), "little")
        entry = json.loads(handle.read(header_bytes))["model.embed_tokens.weight"]
    assert entry["dtype"] == "F32"
    return weights, 8 + header_bytes + entry["data_offsets"][0], entry["shape"][1] * 4


def unsampled_prompts(checkpoint: Path) -> list[str]:
    """Two prompts (no common prefix, three chunks each) written only with characters
    whose embedding rows hold no byte that `sampled` reads."""
    weights, start, row = embedding_rows(checkpoint)
    ranges = sampled_ranges(weights.stat().st_size)
    unread = [
        token for token in VOCAB[3:]
        if token.isalnum() and not any(a < start + (VOCAB.index(token) + 1) * row and start + VOCAB.index(token) * row < a + n
                                       for a, n in ranges)
    ]  # fmt: skip
    assert len(unread) >= 12, f"too few unsampled rows to write prompts with: {unread}"
    words = ["".join(unread[i : i + 6]) for i in (0, 6)]
    return [(word + word[::-1]) * 9 for word in words]


def rewrite_embedding_rows(checkpoint: Path, token_ids: set[int], seed: int = 99) -> None:
    """New values for the embedding rows of `token_ids`, written in place: every other
    byte of the weights file, and its size, stay as they were."""
    weights, start, row = embedding_rows(checkpoint)
    size = weights.stat().st_size
    rng = np.random.default_rng(seed)
    with open(weights, "r+b") as handle:
        for token in sorted(token_ids):
            handle.seek(start + token * row)
            handle.write(rng.normal(0.0, 0.08, row // 4).astype("<f4").tobytes())
    assert weights.stat().st_size == size


def prompt_token_ids(checkpoint: Path, prompts: list[str]) -> set[int]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    return {token for prompt in prompts for token in tokenizer.encode(prompt).ids}


def stop(llm) -> None:
    shutdown_llm(llm)
    gc.collect()


def one_round(checkpoint: Path, prompts: list[str]) -> list[dict]:
    """The prompts once, by an engine of `checkpoint` started for them and stopped after."""
    llm = make_llm(checkpoint, CONFIG)
    try:
        return run_round(llm, prompts)
    finally:
        stop(llm)


def test_an_embedding_edit_in_place_is_another_model_and_a_copy_is_the_same(cluster, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine cores in this process: quicker starts
    served = build_tiny_llama(tmp_path / "served", seed=11)
    prompts = unsampled_prompts(served)
    first = one_round(served, prompts)
    assert [r["cached_tokens"] for r in first] == [0, 0]

    copy = shutil.copytree(served, tmp_path / "other-node" / "copy-of-served")
    before = {mode: fingerprint_checkpoint(served, mode) for mode in (EXACT, SAMPLED)}
    rewrite_embedding_rows(served, prompt_token_ids(served, prompts))
    assert fingerprint_checkpoint(served, SAMPLED) == before[SAMPLED]  # the old default saw nothing
    assert fingerprint_checkpoint(served, EXACT) != before[EXACT]

    # The edited checkpoint, same path, same file sizes: nothing from kvstrata, so every
    # token is its own computation; the edit matters (control), so a shared chunk would show.
    edited = one_round(served, prompts)
    assert [r["cached_tokens"] for r in edited] == [0, 0]
    assert [r["token_ids"] for r in edited] != [r["token_ids"] for r in first]

    # The original under another path and name: every chunk shared, bit-exact. Then its
    # weights are reloaded in place from the edited checkpoint while it serves.
    llm = make_llm(copy, CONFIG)
    try:
        assert_served_by_kvstrata(first, run_round(llm, prompts))
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(served)})
        assert llm.reset_prefix_cache(reset_connector=True)
        reloaded = run_round(llm, prompts)
    finally:
        stop(llm)
    assert [r["cached_tokens"] for r in reloaded] == [0, 0]
    assert [r["token_ids"] for r in reloaded] == [r["token_ids"] for r in edited]
    for ref, result in zip(edited, reloaded):
        assert_close_logprobs(ref["logprobs"], result["logprobs"])

    # What an operator sees: the two checkpoints at one path have two identities; the
    # copy shares the original's; the reloaded engine's own chunks have an identity of their own.
    layouts = list(ray.get(get_node_store().stats.remote())["layouts"].values())
    assert len({layout["identity"] for layout in layouts if str(served) in layout["models"]}) == 2
    assert any({str(served), str(copy)} <= set(layout["models"]) for layout in layouts)
    assert any(layout.get("identity_source") == "updated" for layout in layouts)


def test_an_engine_serves_while_its_weights_are_fingerprinted_then_caches(cluster, tmp_path, monkeypatch):
    """Issue #50, item 4: a fingerprint that would read more than the start-up limit is
    computed while the engine serves. Until it lands every prompt is computed, right, and
    nothing is stored; then kvstrata is on: a prompt computed afterwards is served from
    it, bit for bit."""
    from kvstrata.connector import spec as spec_module

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process: patchable
    monkeypatch.setattr(spec_module, "READ_AT_START_BYTES", 0)  # any checkpoint is a long read
    release, pending = threading.Event(), []
    resolve = spec_module.resolve_model_identity

    def slow_resolve(*args, read_limit=None, **kwargs):
        if read_limit is None:  # the deferred build: held until the test lets it finish
            assert release.wait(120)
        return resolve(*args, read_limit=read_limit, **kwargs)

    class Recorded(spec_module.DeferredStart):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            pending.append(self)

    monkeypatch.setattr(spec_module, "resolve_model_identity", slow_resolve)
    monkeypatch.setattr(spec_module, "DeferredStart", Recorded)
    served = build_tiny_llama(tmp_path / "served", seed=12)
    prompts = unsampled_prompts(served)
    llm = make_llm(served, CONFIG)
    try:
        assert len(pending) == 1 and not pending[0].done
        before = run_round(llm, prompts)  # served while the fingerprint is "read"
        assert [r["cached_tokens"] for r in before] == [0, 0]
        release.set()
        assert pending[0].wait(120) and not pending[0].failed
        computed = run_round(llm, prompts)  # nothing was stored before: computed again, stored now
        assert [r["cached_tokens"] for r in computed] == [0, 0]
        assert [r["token_ids"] for r in computed] == [r["token_ids"] for r in before]
        third = run_round(llm, prompts)
        assert_served_by_kvstrata(computed, third)
    finally:
        release.set()
        stop(llm)
