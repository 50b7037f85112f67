"""kvstrata quickstart: a local Ray cluster, a tiny random Llama on the CPU build of vLLM,
and prompts sharing a long prefix.

Round 1 and 2 run on one engine with its own prefix cache reset before every prompt,
so every cached token was served by kvstrata's node store. The engine is then shut
down and a second engine runs round 3: the node store outlived the first engine.

    python examples/quickstart.py            # a plain Llama
    python examples/quickstart.py --hybrid   # sliding-window + full-attention layers

It prints its results only; what vLLM, Ray and torch say goes to a log file named on
its first line (`/tmp/kvstrata-examples/quickstart.log`, see `kvstrata.quiet`).
"""

import os

# Loopback only: every Ray listener binds 127.0.0.1. No downloads: the model is built here.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import argparse  # noqa: E402
import functools  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import TextIO  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "local.yaml"


def show(say: Callable[[str], None], round_name: str, results: list[dict], node_id: str) -> None:
    say(f"\n== {round_name}")
    for i, result in enumerate(results):
        source = f"kvstrata CPU arena on node {node_id[:12]}" if result["cached_tokens"] else "computed"
        say(
            f"  prompt {i}: {result['cached_tokens']:4d}/{result['prompt_tokens']} prompt tokens from kvstrata "
            f"({source}); output {result['text']!r}"
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--hybrid",
        action="store_true",
        help="a hybrid model: 64-token sliding window on even layers, full attention on odd ones",
    )
    return parser


def main() -> int:
    parser = build_parser()
    args = parser.parse_args()
    from kvstrata.quiet import quiet_output

    # vLLM's, Ray's and torch's messages go to a log file named on the first line.
    with quiet_output("quickstart-hybrid" if args.hybrid else "quickstart") as terminal:
        return run(args.hybrid, terminal)


def run(hybrid: bool, out: TextIO) -> int:
    """The three rounds; prints to `out`."""
    import ray

    import kvstrata
    from kvstrata.actors.client import current_node_id, shutdown_node_store
    from kvstrata.keys import key_group
    from kvstrata._dev.testing import build_tiny_llama, make_llm, run_round, shared_prefix_prompts, shutdown_llm

    say = functools.partial(print, file=out)
    ray.init(address="local", namespace="kvstrata", include_dashboard=False, log_to_driver=False)
    # The engine's processes join this cluster, not another one that may run on the machine.
    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    store = None
    try:
        store = kvstrata.up(CONFIG)
        node_id = current_node_id()
        with tempfile.TemporaryDirectory(prefix="kvstrata-quickstart-") as tmp:
            shape = {"num_layers": 4, "sliding_window": 64} if hybrid else {}
            model = build_tiny_llama(Path(tmp) / "tiny-llama", seed=0, **shape)
            prompts = shared_prefix_prompts(count=3)

            llm = make_llm(model, CONFIG)
            round1 = run_round(llm, prompts)
            show(say, "round 1 (engine 1, cold: the first prompt computes, the others reuse its prefix)", round1, node_id)
            round2 = run_round(llm, prompts)
            show(say, "round 2 (engine 1, after a prefix-cache reset)", round2, node_id)
            shutdown_llm(llm)
            del llm

            llm = make_llm(model, CONFIG)
            round3 = run_round(llm, prompts)
            show(say, "round 3 (engine 2, started after engine 1 was shut down)", round3, node_id)
            shutdown_llm(llm)
            del llm

        stats = ray.get(store.stats.remote())
        for namespace, pool in stats["pools"].items():
            say(f"\nnode store: namespace {namespace}: {pool['resident']} chunks resident, {pool['slot_bytes']} bytes each")
            groups: dict[int, int] = {}
            for key in ray.get(store.keys.remote(namespace)):
                groups[key_group(key)] = groups.get(key_group(key), 0) + 1
            say("  chunks per KV group: " + ", ".join(f"group {g}: {n}" for g, n in sorted(groups.items())))
        same = all(a["token_ids"] == b["token_ids"] == c["token_ids"] for a, b, c in zip(round1, round2, round3))
        hits = all(r["cached_tokens"] > 0 for r in round2 + round3)
        say(f"\noutputs identical across rounds: {same}; rounds 2 and 3 served from kvstrata: {hits}")
        return 0 if same and hits else 1
    finally:
        if store is not None:
            shutdown_node_store(store)
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
