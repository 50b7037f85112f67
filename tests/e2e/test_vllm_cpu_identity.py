"""End to end: a chunk is served only to the weights that computed it.

The failure this guards against was measured on the landed code: an engine on a
model directory whose weights file had been replaced by another checkpoint took the
old checkpoint's chunks from kvstrata and produced a different output than the new
checkpoint computes. Here the same replacement must give 0 tokens from kvstrata and
the new checkpoint's own output, while the same checkpoint copied to another path
(another node's disk) shares every chunk, bit for bit.
"""

from __future__ import annotations

import gc
import shutil

import pytest
import ray

from kvstrata.actors.client import get_node_store
from kvstrata.testing import build_tiny_llama, make_llm, run_round, shutdown_llm
from tests.e2e.expect import assert_served_by_kvstrata

pytestmark = pytest.mark.slow

CONFIG = {"tiers": {"cpu": {"capacity": "64MiB", "segment_size": "16MiB"}}, "engine": {"lease_seconds": 20}}
# Prompts with no common prefix: each one's chunks are stored by the first engine only.
PROMPTS = [f"{word} is the first word of a prompt that is long enough to fill chunks. " * 3 for word in ("Alpha", "Bravo")]


def rounds(model_dir, **engine_kwargs) -> list[dict]:
    llm = make_llm(model_dir, CONFIG, **engine_kwargs)
    try:
        return run_round(llm, PROMPTS)
    finally:
        shutdown_llm(llm)
        del llm
        gc.collect()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("identity")
    served = build_tiny_llama(root / "served", seed=11)
    copy = shutil.copytree(served, root / "other-node" / "copy-of-served")
    replacement = build_tiny_llama(root / "replacement-build", seed=12)
    return served, copy, replacement


def test_a_replaced_checkpoint_gets_nothing_and_a_copied_one_gets_everything(cluster, checkpoints):
    served, copy, replacement = checkpoints
    first = rounds(served)
    assert [r["cached_tokens"] for r in first] == [0, 0]

    # The same checkpoint under another path and name: every chunk shared, bit-exact.
    assert_served_by_kvstrata(first, rounds(copy))

    # A fine-tune redeployed in place: same directory, same architecture, other weights.
    shutil.copyfile(replacement / "model.safetensors", served / "model.safetensors")
    after = rounds(served)
    assert [r["cached_tokens"] for r in after] == [0, 0]
    own = rounds(served, kv_transfer_config=None)
    assert [r["token_ids"] for r in after] == [r["token_ids"] for r in own]
    assert [r["logprobs"] for r in after] == [r["logprobs"] for r in own]
    # Control: the two checkpoints answer differently, so a shared chunk would have shown.
    assert [r["token_ids"] for r in after] != [r["token_ids"] for r in first]

    # What an operator sees: one namespace per checkpoint, each with its model names and identity.
    layouts = ray.get(get_node_store().stats.remote())["layouts"].values()
    at_served = {layout["identity"] for layout in layouts if str(served) in layout["models"]}
    assert len(at_served) == 2
    assert any({str(served), str(copy)} <= set(layout["models"]) for layout in layouts)

