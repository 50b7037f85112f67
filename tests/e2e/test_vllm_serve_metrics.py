"""kvstrata's engine-side metrics on a real `vllm serve` process's `/metrics`.

One OpenAI server (`python -m vllm.entrypoints.openai.api_server`: the CPU wheel's
`vllm` script is broken) on 127.0.0.1 with kvstrata as its OffloadingConnector, on the
tiny test model, joined to this module's Ray cluster. The same long-prefix prompt goes
through `/v1/completions` twice with vLLM's own prefix cache reset in between, so the
second is served from kvstrata; then `/metrics` must show every kvstrata name, with the
chunks stored and loaded counted. What an operator scraping vLLM relies on.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstrata.connector.metrics import COUNTER_NAMES, GAUGE_NAMES, metric_name
from kvstrata._dev.testing import ENGINE_EXIT_TIMEOUT_S, build_tiny_llama
from tests.e2e.expect import BLOCK, expected_hit

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
MODEL_ID = "tiny-llama"
START_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 120.0
PROMPT = "kvstrata keeps the KV cache of a long shared system prompt. " * 8 + "What comes next?"
KVSTRATA_CONFIG = {
    "tiers": {"cpu": {"capacity": 64 * 2**20, "segment_size": 16 * 2**20}},
    "engine": {"lease_seconds": 20},
}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def shared_memory_of(processes: list[psutil.Process]) -> set[Path]:
    """The /dev/shm files these processes map: vLLM's queues and semaphores, the arena."""
    found: set[Path] = set()
    for process in processes:
        try:
            maps = process.memory_maps()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        found.update(Path(m.path.removesuffix(" (deleted)")) for m in maps if m.path.startswith("/dev/shm/"))
    return found


def process_tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def server_command(model: Path, port: int) -> list[str]:
    transfer = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "StrataSpec",
            "spec_module_path": "kvstrata.connector",
            "config": KVSTRATA_CONFIG,
        },
    }
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--served-model-name", MODEL_ID,
        "--host", "127.0.0.1", "--port", str(port),
        "--block-size", str(BLOCK), "--max-model-len", "1024", "--dtype", "float32",
        "--enforce-eager", "--seed", "0", "--enable-prompt-tokens-details",
        "--kv-transfer-config", json.dumps(transfer),
    ]  # fmt: skip


def http(method: str, url: str, body: dict | None = None, timeout_s: float = REQUEST_TIMEOUT_S) -> bytes:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"}, method=method)
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return response.read()


def wait_until_healthy(base_url: str, process: subprocess.Popen, log: Path) -> None:
    """Poll `/health` until it answers 200, the server exits, or the deadline passes."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}:\n{log.read_text()[-4000:]}")
        try:
            http("GET", f"{base_url}/health", timeout_s=5)
            return
        except OSError:  # not listening yet, or the engine not ready (503)
            if time.monotonic() > deadline:
                raise TimeoutError(f"no healthy server after {START_TIMEOUT_S}s:\n{log.read_text()[-4000:]}") from None
            time.sleep(1)


def stop(process: subprocess.Popen) -> None:
    """SIGTERM the server (vLLM shuts its engine down on it), then kill by pid whatever of
    its process tree is still alive after the grace period."""
    tree = process_tree(process.pid)
    process.terminate()
    _, alive = psutil.wait_procs(tree, timeout=2 * ENGINE_EXIT_TIMEOUT_S)
    for leftover in alive:
        try:
            leftover.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=ENGINE_EXIT_TIMEOUT_S)
    process.wait(timeout=ENGINE_EXIT_TIMEOUT_S)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[str]:
    """A `vllm serve` process on loopback with kvstrata, in this module's own Ray cluster.

    Teardown stops the server by its handle, then the node store and the cluster, and
    checks that every /dev/shm file the server's processes mapped (vLLM's queues, the
    arena) is gone, and every segment of that arena. Only those: other runs on the
    machine may be using /dev/shm meanwhile.
    """
    import contextlib

    from kvstrata.actors.client import StoreUnavailable, get_node_store, shutdown_node_store
    from tests.utils import local_ray

    model = build_tiny_llama(tmp_path_factory.mktemp("models") / MODEL_ID, seed=4)
    log = tmp_path_factory.mktemp("server") / "vllm-serve.log"
    port = free_port()
    used: set[Path] = set()
    with local_ray("kvstrata-e2e-serve-metrics"):  # sets RAY_ADDRESS, which the engine inherits
        try:
            # The server imports this checkout's kvstrata, whatever is installed; dev mode
            # serves /reset_prefix_cache.
            pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
            env = dict(os.environ, PYTHONPATH=pythonpath, VLLM_SERVER_DEV_MODE="1")
            with open(log, "wb") as out:
                process = subprocess.Popen(server_command(model, port), env=env, stdout=out, stderr=subprocess.STDOUT)
            try:
                base_url = f"http://127.0.0.1:{port}"
                wait_until_healthy(base_url, process, log)
                yield base_url
                used |= shared_memory_of(process_tree(process.pid))
            finally:
                stop(process)
        finally:
            with contextlib.suppress(StoreUnavailable):
                shutdown_node_store(get_node_store())
    # Arena segments are `kvstrata-<node tag>-<epoch>-<namespace>-<segment>`: the store's
    # segments the engine did not map share the prefix of those it did.
    arenas = {"-".join(path.name.split("-")[:3]) + "-" for path in used if path.name.startswith("kvstrata-")}
    assert arenas, f"the engine mapped no arena segment: {sorted(used)}"
    left = {path for path in used if path.exists()}
    left |= {path for prefix in arenas for path in Path("/dev/shm").glob(f"{prefix}*")}
    assert not left, f"left in /dev/shm: {sorted(map(str, left))}"


def complete(base_url: str, prompt: str) -> dict:
    body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": 8, "temperature": 0.0}
    return json.loads(http("POST", f"{base_url}/v1/completions", body))


def reset_prefix_cache(base_url: str, timeout_s: float = 60.0) -> None:
    """Empty vLLM's own prefix cache (not kvstrata's). vLLM refuses while offload transfers
    are in flight and says to retry: retry until it succeeds or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    while not json.loads(http("POST", f"{base_url}/reset_prefix_cache"))["success"]:
        assert time.monotonic() < deadline, f"vLLM refused to reset its prefix cache for {timeout_s}s"
        time.sleep(0.2)


def cached_tokens(reply: dict) -> int:
    return ((reply.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def parse(exposition: str) -> dict[str, dict]:
    """Prometheus text parsed: family name -> {"type": ..., "samples": {sample name: value}}.

    Values are summed over label sets (engine, model_name): one engine here.
    """
    families: dict[str, dict] = {}
    for family in text_string_to_metric_families(exposition):
        samples: dict[str, float] = {}
        for sample in family.samples:
            samples[sample.name] = samples.get(sample.name, 0.0) + sample.value
        families[family.name] = {"type": family.type, "samples": samples}
    return families


def test_kvstrata_counters_and_gauges_are_on_the_metrics_endpoint(server):
    base_url = server
    first = complete(base_url, PROMPT)
    reset_prefix_cache(base_url)
    second = complete(base_url, PROMPT)

    # The second prompt's prefix came from kvstrata, not from vLLM's own cache.
    prompt_tokens = second["usage"]["prompt_tokens"]
    assert cached_tokens(first) == 0
    assert cached_tokens(second) == expected_hit(prompt_tokens) > 0
    assert second["choices"][0]["text"] == first["choices"][0]["text"]

    exposition = http("GET", f"{base_url}/metrics").decode()
    families = parse(exposition)
    # The Prometheus form: the declared name as is (a colon is legal in a metric name),
    # counters with the `_total` suffix, gauges without; labels engine and model_name.
    assert f'\nkvstrata:chunks_loaded_total{{engine="0",model_name="{MODEL_ID}"}} ' in exposition
    for name in COUNTER_NAMES:
        family = families.get(metric_name(name))
        assert family is not None and family["type"] == "counter", f"{metric_name(name)} is not on /metrics"
        # Zero counters too: a series that is missing cannot be rated or alerted on.
        assert f"{metric_name(name)}_total" in family["samples"], f"{metric_name(name)}_total has no sample"
    for name in GAUGE_NAMES:
        family = families.get(metric_name(name))
        assert family is not None and family["type"] == "gauge", f"{metric_name(name)} is not on /metrics"
        assert metric_name(name) in family["samples"], f"{metric_name(name)} has no sample"

    counters = {name: families[metric_name(name)]["samples"][f"{metric_name(name)}_total"] for name in COUNTER_NAMES}
    # The first request stored each of its whole prompt blocks once (prompt KV only, one
    # block per chunk); the second loaded exactly the chunks it was served.
    assert counters["chunks_stored"] == prompt_tokens // BLOCK
    assert counters["chunks_loaded"] == cached_tokens(second) // BLOCK
    assert counters["stores_failed"] == counters["control_failures"] == counters["holds_refused"] == 0
