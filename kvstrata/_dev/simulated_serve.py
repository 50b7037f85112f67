"""A Ray Serve LLM app over kvstrata on simulated nodes, one replica per node: what the
routing test, the routing benchmark and the routing example start.

    with simulated_serve_app(model_dir, tier_config, router=ROUTER) as app:
        chat(app.base_url, app.model_id, "...")

Each simulated node is a raylet of a `ray.cluster_utils.Cluster` on loopback with two
logical CPUs, and each replica takes two (its actor's and its engine's bundle, which
Serve LLM merges), so Serve puts one replica on each node. The tier
config should have a `cluster` section: each node's store then syncs with the directory
(creating its shards), which is what a router reads. Like tests/e2e and kvstrata._dev.testing,
it stands outside the package's layers: a helper for tests, examples and benchmarks.

Owns everything it starts and takes it down on exit, also on failure, by handle: Serve
(and the ledger and prefix-tree actors its routers made), each node's store, the
directory shards, the cluster, and the shared-memory queues Ray Serve 2.60 leaves behind
(`testing.serve_engine_shared_memory`).
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ray.llm._internal.common.callbacks.base import CallbackBase

from kvstrata.actors.serve import NodeStoreCallback
from kvstrata._dev.testing import kvstrata_transfer, serve_engine_shared_memory, wait_until_serving

CPU_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
DEPLOYMENT = "LLMServer"
NODE_CPUS = 2  # logical: a Serve LLM replica takes 1 for its actor + its engine's bundle of 1


class LocalModelCallback(NodeStoreCallback):
    """kvstrata's node-store callback, and no model download: on one machine every
    simulated node reads the model from the same local directory. (Serve LLM otherwise
    runs a download task on each node first: ~20 s per replica on a busy 2-core machine.)"""

    async def on_before_node_init(self) -> None:
        await super().on_before_node_init()
        self.ctx.run_init_node = False


class LocalModelOnly(CallbackBase):
    """No kvstrata, and no model download (as `LocalModelCallback`): the systems kvstrata is compared with."""

    async def on_before_node_init(self) -> None:
        self.ctx.run_init_node = False


@dataclass
class ServedApp:
    base_url: str
    model_id: str
    app_name: str
    nodes: list[str]  # node ids, the head's first
    handle: Any  # the LLM deployment's handle (reset_prefix_cache, ...)
    shared_memory: set[Path] = field(default_factory=set)

    @property
    def deployment(self) -> str:
        return f"{DEPLOYMENT}:{self.model_id}"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def llm_config(
    model_source: str,
    model_id: str,
    tier_config: Any,
    replicas: int,
    ray_address: str,
    router: Mapping[str, Any] | None = None,
    engine_kwargs: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    connector: Mapping[str, Any] | None = None,
    kv_transfer: Mapping[str, Any] | None = None,
) -> Any:
    """The Serve LLM config: kvstrata as KV connector (`connector`: more of its extra config,
    e.g. `block_size`, tokens per chunk), its node-store callback, `replicas` replicas, and
    `router` as `request_router_config` (None: Serve's default).

    `tier_config` None: no kvstrata and no node store; the engines get `kv_transfer` as
    their `kv_transfer_config` (None: no offloading) -- the systems kvstrata is compared with."""
    from ray.serve.llm import LLMConfig

    deployment: dict[str, Any] = {"num_replicas": replicas}
    if router is not None:
        deployment["request_router_config"] = dict(router)
    if tier_config is not None:
        kv_transfer = kvstrata_transfer(tier_config, **(connector or {}))
    callback = "LocalModelCallback" if tier_config is not None else "LocalModelOnly"
    return LLMConfig(
        model_loading_config={"model_id": model_id, "model_source": model_source},
        engine_kwargs={
            "block_size": 32,
            "max_model_len": 4096,
            "dtype": "float32",
            "enforce_eager": True,
            "enable_prompt_tokens_details": True,
            **(engine_kwargs or {}),
            **({"kv_transfer_config": dict(kv_transfer)} if kv_transfer is not None else {}),
        },
        callback_config={"callback_class": f"kvstrata._dev.simulated_serve:{callback}"},
        placement_group_config={"bundles": [{"CPU": 1}]},
        deployment_config=deployment,
        runtime_env={"env_vars": {**CPU_ENV, "RAY_ADDRESS": ray_address, **(env or {})}},
    )


@contextlib.contextmanager
def simulated_cluster(nodes: int, namespace: str) -> Iterator[list[str]]:
    """`nodes` simulated nodes of `NODE_CPUS` logical CPUs each, this process connected; node ids, head first."""
    import ray
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": NODE_CPUS, "include_dashboard": False})
    previous = os.environ.get("RAY_ADDRESS")
    try:
        for _ in range(nodes - 1):
            cluster.add_node(num_cpus=NODE_CPUS)
        ray.init(address=cluster.address, namespace=namespace, log_to_driver=False)
        cluster.wait_for_nodes()
        os.environ["RAY_ADDRESS"] = cluster.address
        head = ray.get_runtime_context().get_node_id()
        others = sorted(node["NodeID"] for node in ray.nodes() if node["Alive"] and node["NodeID"] != head)
        yield [head, *others]
    finally:
        if previous is None:
            os.environ.pop("RAY_ADDRESS", None)
        else:
            os.environ["RAY_ADDRESS"] = previous
        ray.shutdown()
        cluster.shutdown()


def take_down_kvstrata(nodes: list[str], app: ServedApp | None = None) -> None:
    """Every node's store, the directory shards and the app's routing ledger, by name."""
    import ray

    from kvstrata.actors.client import StoreUnavailable, get_node_store, shutdown_node_store
    from kvstrata.actors.directory import directory_actor_name
    from kvstrata.actors.options import STORE_NAMESPACE
    from kvstrata.routing.ledger import drop_ledger

    if app is not None:
        drop_ledger(app.app_name, app.deployment)
    for node in nodes:
        with contextlib.suppress(StoreUnavailable):
            shutdown_node_store(get_node_store(node))
    for shard in range(256):
        try:
            ray.kill(ray.get_actor(directory_actor_name(shard), namespace=STORE_NAMESPACE), no_restart=True)
        except ValueError:
            break


@contextlib.contextmanager
def serve_app(
    nodes: list[str],
    model_source: str,
    tier_config: Any,
    app_name: str = "kvstrata-routing",
    model_id: str = "tiny-llama",
    router: Mapping[str, Any] | None = None,
    engine_kwargs: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    connector: Mapping[str, Any] | None = None,
    timeout_s: float = 300,
    kv_transfer: Mapping[str, Any] | None = None,
) -> Iterator[ServedApp]:
    """The app served on an already connected cluster (`simulated_cluster`), one replica per
    node; on exit Serve, the stores (also ones the caller made before), the directory and
    Serve's leftovers are gone."""
    import ray
    from ray import serve
    from ray.serve.llm import build_openai_app

    config = llm_config(
        model_source, model_id, tier_config, len(nodes), os.environ["RAY_ADDRESS"], router, engine_kwargs, env, connector,
        kv_transfer,
    )  # fmt: skip
    port = free_port()
    app: ServedApp | None = None
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        built = build_openai_app({"llm_configs": [config], "ingress_deployment_config": {"ray_actor_options": {"num_cpus": 0}}})
        # Not `serve.run`: it waits for the app without a bound.
        serve.run_many([serve.RunTarget(built, name=app_name, route_prefix="/")], wait_for_applications_running=False)
        base_url = f"http://127.0.0.1:{port}"
        try:
            wait_until_serving(base_url, model_id, timeout_s=timeout_s)
            _wait_until_running(app_name, timeout_s)  # every replica up: its engine's queues exist
        except (OSError, TimeoutError) as exc:
            raise RuntimeError(f"the Serve app did not serve within {timeout_s} s: {serve.status()}") from exc
        handle = serve.get_deployment_handle(f"{DEPLOYMENT}:{model_id}", app_name)
        app = ServedApp(base_url, model_id, app_name, nodes, handle, serve_engine_shared_memory(app_name))
        yield app
    finally:
        leaked = app.shared_memory if app is not None else set()
        serve.shutdown()
        for path in leaked:
            path.unlink(missing_ok=True)
        if ray.is_initialized():
            take_down_kvstrata(nodes, app or ServedApp("", model_id, app_name, nodes, None))


def _wait_until_running(app_name: str, timeout_s: float) -> None:
    """Until Serve reports the app RUNNING (all replicas started); a request can be served
    by the first replica while the others' engines are still starting."""
    import time

    from ray import serve

    deadline = time.monotonic() + timeout_s
    while str(serve.status().applications[app_name].status).rsplit(".", 1)[-1] != "RUNNING":
        if time.monotonic() > deadline:
            raise TimeoutError(f"Serve app {app_name} not RUNNING within {timeout_s} s: {serve.status()}")
        time.sleep(0.5)


def stream_chat(
    base_url: str,
    model_id: str,
    messages: list[dict[str, str]],
    max_tokens: int = 8,
    request_id: str | None = None,
    timeout_s: float = 300,
) -> dict[str, Any]:
    """One greedy, streamed chat completion: its text, usage (with `cached_tokens`) and
    time to first token (seconds from sending to the first streamed chunk)."""
    body = {"model": model_id, "messages": messages, "max_tokens": max_tokens}
    return _stream(f"{base_url}/v1/chat/completions", body, request_id, timeout_s)


def stream_completion(
    base_url: str,
    model_id: str,
    prompt: str,
    max_tokens: int = 8,
    request_id: str | None = None,
    timeout_s: float = 300,
) -> dict[str, Any]:
    """One greedy, streamed completion of a raw prompt (no chat template): as `stream_chat`."""
    body = {"model": model_id, "prompt": prompt, "max_tokens": max_tokens}
    return _stream(f"{base_url}/v1/completions", body, request_id, timeout_s)


def _stream(url: str, body: dict[str, Any], request_id: str | None, timeout_s: float) -> dict[str, Any]:
    import json
    import time
    import urllib.request

    body = {**body, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    headers = {"Content-Type": "application/json", **({"x-request-id": request_id} if request_id else {})}
    request = urllib.request.Request(url, json.dumps(body).encode(), headers)
    started = time.perf_counter()
    first: float | None = None
    text: list[str] = []
    usage: dict[str, Any] = {}
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            if first is None:
                first = time.perf_counter() - started
            chunk = json.loads(line[len("data:") :])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                text.append((choice.get("delta") or {}).get("content") or choice.get("text") or "")
    return {"ttft": first, "text": "".join(text), "usage": usage}
