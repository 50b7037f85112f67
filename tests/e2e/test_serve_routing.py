"""TierAwareRouter under Ray Serve LLM on the CPU build of vLLM, two simulated nodes with one
replica each: a conversation's second turn goes to the node whose arena holds its first
turn's chunks (the router's decision, read from its ledger), and the engine there serves
that prefix from cache (`cached_tokens`)."""

from __future__ import annotations

import time

import pytest

from kvstrata.actors.client import get_node_store
from kvstrata.routing.ledger import read_ledger
from kvstrata._dev.simulated_serve import serve_app, simulated_cluster, stream_chat
from kvstrata._dev.testing import build_tiny_llama

pytestmark = pytest.mark.slow

CHUNK = 32  # tokens per kvstrata chunk: one vLLM block (the default)
TIERS = {
    "tiers": {"cpu": {"capacity": "32MiB", "segment_size": "8MiB"}},
    "cluster": {"directory_shards": 2, "sync_seconds": 0.1},
}
ROUTER = {
    "request_router_class": "kvstrata.routing:TierAwareRouter",
    "request_router_kwargs": {"refresh_seconds": 0.5, "ledger_flush_seconds": 0.2},
}


def wait_for(probe, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while True:
        found = probe()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        time.sleep(0.1)


def holding_node(nodes: list[str], before: dict[str, int]) -> str | None:
    """The one node whose arena gained chunks since `before` (None while the stores sync)."""
    import ray

    gained = []
    for node in nodes:
        stats = ray.get(get_node_store(node).stats.remote(), timeout=30)
        if stats["report"]["tiers"]["cpu"]["chunks"] > before[node]:
            gained.append(node)
    return gained[0] if len(gained) == 1 else None


def arena_chunks(nodes: list[str]) -> dict[str, int]:
    import ray

    return {node: ray.get(get_node_store(node).stats.remote(), timeout=30)["report"]["tiers"]["cpu"]["chunks"]
            for node in nodes}  # fmt: skip


@pytest.mark.xfail(
    strict=False,
    reason="flaky since the wave-3 merges (26 Nov 2026: 3 of 6 runs routed c0's second turn to the node "
    "without its chunks). Cause found (#48, finding 4: the readiness probe counted as load, figures read "
    "from the first request on) and fixed, checked by tests/routing/test_startup.py; this test itself could "
    "not be run on 27 Nov (4 tries on a machine shared by 7 sessions: Ray or the app did not start within "
    "their timeouts). Since: passed 3 of 3 (CI on 27 Nov, and two full runs here on 27-28 Nov at load 2-10). "
    "Remove this mark once it passes 20 of 20.",
)
def test_a_second_turn_is_routed_to_the_node_holding_the_first(tmp_path_factory):
    model = build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama", seed=5)
    router = {**ROUTER, "request_router_kwargs": {**ROUTER["request_router_kwargs"], "model": str(model)}}
    with simulated_cluster(2, "kvstrata-e2e-routing") as nodes, serve_app(
        nodes, str(model), TIERS, router=router, engine_kwargs={"max_model_len": 1024}
    ) as app:  # fmt: skip
        for conversation in range(2):
            system = f"Conversation {conversation}: kvstrata keeps each turn's KV where the next turn finds it. " * 4
            messages = [{"role": "system", "content": system}, {"role": "user", "content": "What comes first?"}]
            before = arena_chunks(nodes)
            first = stream_chat(app.base_url, app.model_id, messages, request_id=f"c{conversation}-t1")
            holder = wait_for(lambda: holding_node(nodes, before), 30, "the first turn's chunks in one arena")
            messages += [{"role": "assistant", "content": first["text"]}, {"role": "user", "content": "And next?"}]
            second = stream_chat(app.base_url, app.model_id, messages, request_id=f"c{conversation}-t2")

            def decided():
                entries = (read_ledger(app.app_name, app.deployment) or {}).get("recent", [])
                return next((e for e in entries if e.get("request_id") == f"c{conversation}-t2"), None)

            entry = wait_for(decided, 30, "the second turn's decision in the ledger")
            assert entry["decision"] == "estimate", entry
            assert entry["node"] == holder and entry["first_choice"], (entry, holder)
            stored = first["usage"]["prompt_tokens"] // CHUNK * CHUNK
            assert entry["covered_tokens"] >= stored - CHUNK > 0  # the directory saw turn 1's chunks there
            assert entry["sources"].get("arena", 0) >= stored - CHUNK
            cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= entry["covered_tokens"], (cached, entry)
