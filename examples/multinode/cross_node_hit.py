"""One vLLM engine per node, and a prompt prefix computed on one node served on another.

On a real cluster (`ray start` on every node, then `kvstrata up --config configs/multinode.yaml`):

    python examples/multinode/cross_node_hit.py --config configs/multinode.yaml --model <hf id or path>

On one machine, with simulated nodes (a `ray.cluster_utils.Cluster`, loopback only, the
CPU build of vLLM and a tiny random model built here):

    python examples/multinode/cross_node_hit.py --simulate 2

Each engine runs in a Ray actor pinned to its node. The engine on the first node serves
the prompts (its node's store keeps their KV); the engine on the second node then serves
the same prompts after its own prefix cache is reset: every cached token it reports came
from the first node's store, fetched over Ray. The script prints both rounds and the
stores' counters; what vLLM, Ray and torch say goes to a log file named on the first line.

On a real cluster it leaves the stores, the directory and the reconciler that `kvstrata up`
made running (`kvstrata down --config ...` ends them); with `--simulate` it ends all it made.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import Any, TextIO

CPU_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


class EngineOnNode:
    """A vLLM engine with kvstrata, living on one node."""

    def __init__(self, model: str, config: Any):
        from kvstrata._dev.testing import make_llm

        self.llm = make_llm(model, config)

    def run(self, prompts: list[str]) -> list[dict[str, Any]]:
        from kvstrata._dev.testing import run_round

        return run_round(self.llm, prompts)

    def shutdown(self) -> None:
        from kvstrata._dev.testing import shutdown_llm

        shutdown_llm(self.llm)


def engine_on(node_id: str, model: str, config: Any) -> Any:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    env = dict(CPU_ENV, KVSTRATA_NODE_ID=node_id, RAY_ADDRESS=os.environ.get("RAY_ADDRESS", "auto"))
    return (
        ray.remote(EngineOnNode)
        .options(
            num_cpus=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            runtime_env={"env_vars": env},
        )
        .remote(model, config)
    )


def simulated_config(shm_dir: str) -> dict[str, Any]:
    return {
        "tiers": {"cpu": {"capacity": "256MiB", "segment_size": "64MiB", "shm_dir": shm_dir}},
        "cluster": {"directory_shards": 2, "sync_seconds": 0.1, "reconcile_seconds": 1},
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--simulate", type=int, default=0, help="simulate this many nodes on this machine")
    parser.add_argument("--config", default=None, help="kvstrata YAML with a `cluster` section (real clusters)")
    parser.add_argument("--model", default=None, help="model for every engine (default with --simulate: a tiny Llama)")
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    for name, value in CPU_ENV.items():
        os.environ.setdefault(name, value)
    from kvstrata.quiet import quiet_output

    # This process's messages go to a log file named on the first line; the engines run in
    # Ray workers, whose output stays in Ray's session logs.
    with quiet_output("cross_node_hit", note="; the engines': /tmp/ray/session_latest/logs") as terminal:
        run(args, terminal)


def run(args: argparse.Namespace, out: TextIO) -> None:
    """Serve the prompts on one node's engine, then on another's; print both rounds to `out`."""
    import ray

    from kvstrata.actors.cluster import down, store_nodes, up
    from kvstrata.config import load_config
    from kvstrata._dev.testing import build_tiny_llama, shared_prefix_prompts

    with tempfile.TemporaryDirectory(prefix="kvstrata-multinode-") as workdir:
        sim = None
        if args.simulate:
            from ray.cluster_utils import Cluster

            sim = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
            for _ in range(args.simulate - 1):
                sim.add_node(num_cpus=1)
            os.environ["RAY_ADDRESS"] = sim.address
            config_source: Any = simulated_config(workdir)
        else:
            config_source = args.config
        ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), log_to_driver=False)
        config = load_config(config_source)
        try:
            up(config)
            nodes = store_nodes(config.cluster)
            if len(nodes) < 2:
                raise SystemExit("needs at least two nodes with a kvstrata store")
            model = args.model or str(build_tiny_llama(os.path.join(workdir, "tiny-llama")))
            engine_config = config.model_dump(mode="json")
            prompts = shared_prefix_prompts()
            rounds = []
            for node_id in nodes[:2]:  # one after the other: two CPU engines do not fit on 2 cores
                engine = engine_on(node_id, model, engine_config)
                rounds.append(ray.get(engine.run.remote(prompts)))
                ray.get(engine.shutdown.remote())
                ray.kill(engine)
            for (node_id, results) in zip(nodes, rounds):
                prompt_tokens, cached = [r["prompt_tokens"] for r in results], [r["cached_tokens"] for r in results]
                print(f"node {node_id[:12]}: prompt tokens {prompt_tokens}, cached {cached}", file=out)
            same = all(a["token_ids"] == b["token_ids"] for a, b in zip(*rounds))
            print(f"same tokens on both nodes: {same}", file=out)
            from kvstrata.actors.client import get_node_store

            for node_id in nodes[:2]:
                stats = ray.get(get_node_store(node_id).stats.remote())
                counters = {k: stats[k] for k in ("engine_pins", "peer_promotions", "chunks_exported")}
                print(f"store on {node_id[:12]}: {json.dumps(counters)}", file=out)
        finally:
            if sim is not None:  # it made the stores, the directory and the reconciler: end them
                down(config)
            else:  # they are `kvstrata up`'s, serving other engines too: left running
                print(f"the stores stay up: `kvstrata down --config {args.config}` ends them", file=out)
            ray.shutdown()
            if sim is not None:
                sim.shutdown()


if __name__ == "__main__":
    main()
