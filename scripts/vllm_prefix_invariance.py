"""Does vLLM alone (no kvstrata) change greedy outputs when part of a prefix comes from
its own prefix cache, and requests join the running batch at different steps?

The fault matrix compares every request with a cold full-prefill reference. This is the
check that such a comparison is fair on the matrix's model and prompts: the reference is
one batch with nothing cached; each trial resets vLLM's prefix cache, warms a random
number of leading blocks per prompt (0-10), then runs all prompts, adding each at a
random scheduler step (with `--join-steps 0`, all at once). Prints one JSON line.

    .venv/bin/python scripts/vllm_prefix_invariance.py --trials 1200 --join-steps 30

25 Nov 2026, this machine: 1,500 trials all at once and 1,200 trials joining within 30
steps, 32,400 requests: 0 changed (docs/fault-matrix.md).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run_trial(llm, prompts: list[str], cached_blocks: list[int], joins: list[int], params, warm) -> list[list[int]]:
    """One trial's tokens per prompt (in prompt order)."""
    llm.reset_prefix_cache()
    warm_prompts = [p[: k * 32 + 1] for p, k in zip(prompts, cached_blocks) if k]
    if warm_prompts:
        llm.generate(warm_prompts, warm, use_tqdm=False)
    engine = llm.llm_engine
    pending = sorted((join, i) for i, join in enumerate(joins))
    done: dict[int, list[int]] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and not engine.has_unfinished_requests():
            step = max(step, pending[0][0])  # nothing running: the next request joins now
        while pending and pending[0][0] <= step:
            _, i = pending.pop(0)
            engine.add_request(f"p{i}-{time.monotonic_ns()}", prompts[i], params)
        for out in engine.step():
            if out.finished:
                done[int(out.request_id[1:].split("-")[0])] = list(out.outputs[0].token_ids)
        step += 1
    return [done[i] for i in range(len(prompts))]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--join-steps", type=int, default=30, help="requests join within this many steps (0: all at once)")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main() -> int:
    parser = build_parser()
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    from kvstrata._dev.faults import load
    from kvstrata._dev.faults.harness import PROMPTS
    from kvstrata._dev.testing import build_tiny_llama, shutdown_llm

    with tempfile.TemporaryDirectory(prefix="kvstrata-invariance-") as scratch:
        model = build_tiny_llama(Path(scratch) / "tiny", seed=11)  # the fault matrix's model
        llm = LLM(model=str(model), block_size=32, max_model_len=1024, dtype="float32", enforce_eager=True, seed=0)
        params = SamplingParams(max_tokens=load.MAX_TOKENS, temperature=0.0, ignore_eos=True)
        warm = SamplingParams(max_tokens=1, temperature=0.0)
        prompts = load.prompts(PROMPTS)
        llm.reset_prefix_cache()
        reference = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        rng = random.Random(args.seed)
        changed, started = [], time.monotonic()
        try:
            for trial in range(args.trials):
                cached = [rng.randint(0, 10) for _ in prompts]
                joins = [rng.randint(0, args.join_steps) for _ in prompts]
                tokens = run_trial(llm, prompts, cached, joins, params, warm)
                changed += [
                    {"trial": trial, "prompt": i, "cached_blocks": cached[i]}
                    for i in range(len(prompts))
                    if tokens[i] != reference[i]
                ]
        finally:
            shutdown_llm(llm)
        print(json.dumps({
            "requests": args.trials * len(prompts),
            "changed": len(changed),
            "seconds": round(time.monotonic() - started, 1),
            "first_changed": changed[:10],
        }))  # fmt: skip
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
