"""The Python equivalent of serve_config.yaml: a Serve LLM app with kvstrata, and a demo.

    python examples/serve/serve_app.py [--model DIR_OR_HF_ID]

Without --model it builds a tiny random Llama (CPU build of vLLM, no download), starts a
local Ray cluster, serves the app on 127.0.0.1, sends the same long-prefix chat request
twice with vLLM's own prefix cache reset in between, and prints how many prompt tokens
the second one got from kvstrata. It leaves nothing in /dev/shm: Ray Serve 2.60 does not
shut the replica's engine down, so the demo removes the queues that engine left.
What this process's vLLM, Ray and torch say goes to a log file named on the first line.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any, TextIO

from kvstrata._dev.testing import cached_tokens, chat, wait_until_serving

TIER_CONFIG = {"tiers": {"cpu": {"capacity": "256MiB", "segment_size": "64MiB"}}}
APP_NAME = "kvstrata-llm"
CPU_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def kvstrata_llm_config(
    model_source: str, model_id: str = "tiny-llama", tier_config: Any = None, ray_address: str | None = None
):
    """An LLMConfig with kvstrata as its KV connector and the node-store callback.

    `ray_address`: the cluster the engine's scheduler joins (it calls `ray.init` itself).
    Without it, `auto`: the cluster started last on the machine, right where one runs.
    """
    from ray.serve.llm import LLMConfig

    env_vars = dict(CPU_ENV, **({"RAY_ADDRESS": ray_address} if ray_address else {}))

    return LLMConfig(
        model_loading_config={"model_id": model_id, "model_source": model_source},
        engine_kwargs={
            "block_size": 32,
            "max_model_len": 1024,
            "dtype": "float32",
            "enforce_eager": True,
            "enable_prompt_tokens_details": True,
            "kv_transfer_config": {
                "kv_connector": "OffloadingConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {
                    "spec_name": "StrataSpec",
                    "spec_module_path": "kvstrata.connector",
                    "config": tier_config or TIER_CONFIG,
                },
            },
        },
        callback_config={"callback_class": "kvstrata.actors.serve:NodeStoreCallback"},
        placement_group_config={"bundles": [{"CPU": 1}]},
        runtime_env={"env_vars": env_vars},
    )


def build_app(llm_config):
    from ray.serve.llm import build_openai_app

    return build_openai_app(
        {"llm_configs": [llm_config], "ingress_deployment_config": {"ray_actor_options": {"num_cpus": 0}}}
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model directory or Hugging Face id (default: a tiny random Llama)")
    parser.add_argument("--port", type=int, default=8000)
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    for name, value in CPU_ENV.items():
        os.environ.setdefault(name, value)
    from kvstrata.quiet import quiet_output

    # This process's messages go to a log file named on the first line; the replica's and
    # its engine's stay in Ray's session logs.
    with quiet_output("serve_app", note="; the replica's: /tmp/ray/session_latest/logs") as terminal:
        serve_demo(args.model, args.port, terminal)


def serve_demo(model: str | None, port: int, out: TextIO) -> None:
    """Serve the app on a local Ray cluster, send the request twice, print the result to `out`."""
    import ray
    from ray import serve

    from kvstrata.actors.client import get_node_store, shutdown_node_store
    from kvstrata._dev.testing import serve_engine_shared_memory

    with tempfile.TemporaryDirectory(prefix="kvstrata-serve-") as workdir:
        if model is None:
            from kvstrata._dev.testing import build_tiny_llama

            model = str(build_tiny_llama(os.path.join(workdir, "tiny-llama")))
        ray.init(address="local", include_dashboard=False, log_to_driver=False)
        # The engine joins this cluster, not another one started on the machine meanwhile.
        llm_config = kvstrata_llm_config(model, ray_address=ray.get_runtime_context().gcs_address)
        left_by_serve: set[Path] = set()
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            serve.run(build_app(llm_config), name=APP_NAME, route_prefix="/")
            base_url = f"http://127.0.0.1:{port}"
            wait_until_serving(base_url, "tiny-llama")
            left_by_serve = serve_engine_shared_memory(APP_NAME)
            prompt = "kvstrata keeps the KV cache of a long shared system prompt. " * 12 + "What comes next?"
            first = chat(base_url, "tiny-llama", prompt)
            server = serve.get_deployment_handle("LLMServer:tiny-llama", APP_NAME)
            server.reset_prefix_cache.remote().result(timeout_s=60)  # vLLM's own cache only
            second = chat(base_url, "tiny-llama", prompt)
            print(f"prompt tokens {second['usage']['prompt_tokens']}: first request {cached_tokens(first)} cached, "
                  f"second {cached_tokens(second)} cached (from kvstrata); "
                  f"same answer: {first['choices'][0]['message'] == second['choices'][0]['message']}",
                  file=out)  # fmt: skip
        finally:
            serve.shutdown()
            # Ray Serve LLM 2.60 stops the replica without shutting its engine down, so vLLM
            # never unlinks its queues: remove exactly those the replica's processes mapped.
            for segment in left_by_serve:
                segment.unlink(missing_ok=True)
            shutdown_node_store(get_node_store())
            ray.shutdown()


if __name__ == "__main__":
    main()
