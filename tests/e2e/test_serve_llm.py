"""Ray Serve LLM on the CPU build of vLLM: the app of examples/serve/serve_config.yaml,
served on 127.0.0.1 with a tiny model built at test time. The same long-prefix chat
request twice, vLLM's own prefix cache reset in between: the second is served from
kvstrata (the store pinned its chunks for the engine) with the same answer."""

from __future__ import annotations

import contextlib
import importlib.util
import socket
from pathlib import Path

import pytest
import yaml

from kvstrata.actors.client import (
    StoreUnavailable,
    current_node_id,
    get_node_store,
    shutdown_node_store,
)
from kvstrata._dev.testing import build_tiny_llama, cached_tokens, chat, serve_engine_shared_memory, wait_until_serving
from tests.e2e.expect import BLOCK, expected_hit
from tests.utils import local_ray

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
APP = "kvstrata-llm"
MODEL_ID = "tiny-llama"


def serve_yaml() -> dict:
    return yaml.safe_load((REPO / "examples" / "serve" / "serve_config.yaml").read_text())


def yaml_llm_config(model_source: str):
    from ray.serve.llm import LLMConfig

    (application,) = serve_yaml()["applications"]
    settings = application["args"]["llm_configs"][0]
    settings["model_loading_config"]["model_source"] = model_source
    return LLMConfig(**settings), application


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The YAML's app, served by Serve LLM on loopback; everything taken down afterwards."""
    import ray
    from ray import serve
    from ray.serve.llm import build_openai_app

    model = build_tiny_llama(tmp_path_factory.mktemp("models") / MODEL_ID, seed=3)
    llm_config, application = yaml_llm_config(str(model))
    args = dict(application["args"], llm_configs=[llm_config])
    with local_ray("kvstrata-e2e-serve"):
        # The engine's scheduler joins this cluster, not one another process started since.
        llm_config.runtime_env["env_vars"]["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
        port = free_port()
        leaked_by_serve: set[Path] = set()
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            serve.run(build_openai_app(args), name=APP, route_prefix=application["route_prefix"])
            base_url = f"http://127.0.0.1:{port}"
            wait_until_serving(base_url, MODEL_ID, timeout_s=300)
            leaked_by_serve = serve_engine_shared_memory(APP)
            assert leaked_by_serve, "no shared memory of the LLMServer replica's engine was found"
            yield base_url, serve.get_deployment_handle(f"LLMServer:{MODEL_ID}", APP), ray
        finally:
            serve.shutdown()
            for segment in leaked_by_serve:
                segment.unlink(missing_ok=True)
            with contextlib.suppress(StoreUnavailable):
                shutdown_node_store(get_node_store())


def test_the_yaml_and_the_python_example_build_the_same_llm_config(tmp_path):
    spec = importlib.util.spec_from_file_location("serve_app", REPO / "examples" / "serve" / "serve_app.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    from_yaml, _ = yaml_llm_config(str(tmp_path))
    from_python = example.kvstrata_llm_config(str(tmp_path))
    assert from_python.model_dump() == from_yaml.model_dump()
    extra = from_yaml.engine_kwargs["kv_transfer_config"]["kv_connector_extra_config"]
    assert (extra["spec_name"], extra["spec_module_path"]) == ("StrataSpec", "kvstrata.connector")


def test_a_repeated_chat_request_is_served_from_kvstrata_with_the_same_answer(served):
    base_url, server, ray = served
    # The callback created this node's store before the engine started.
    store = get_node_store(current_node_id())
    prompt = "kvstrata keeps the KV cache of a long shared system prompt. " * 8 + "What comes next?"
    first = chat(base_url, MODEL_ID, prompt)
    pins_before = ray.get(store.stats.remote())["engine_pins"]
    server.reset_prefix_cache.remote().result(timeout_s=60)  # vLLM's own prefix cache only
    second = chat(base_url, MODEL_ID, prompt)

    prompt_tokens = second["usage"]["prompt_tokens"]
    assert cached_tokens(first) == 0
    assert cached_tokens(second) == expected_hit(prompt_tokens) > 0
    assert second["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    served_chunks = ray.get(store.stats.remote())["engine_pins"] - pins_before
    assert served_chunks >= cached_tokens(second) // BLOCK
