"""What a router reads of a node store's report, and the example YAML that selects it."""

from __future__ import annotations

from pathlib import Path

import yaml

from kvstrata.routing.coverage import BUCKET, DISK, PEER
from kvstrata.routing.figures import ClusterFigures, NodeFigures, names_model, node_figures
from kvstrata.tiers.estimates import Cost
from tests.utils import layout

REPO = Path(__file__).resolve().parents[2]


def test_a_store_report_gives_the_engines_layouts_rates_and_tier_costs():
    described = layout(model="/models/m").describe()
    stats = {
        "layouts": {described["namespace"]: {**described, "models": ["/models/m"]}, "broken": {"models": ["x"]}},
        "report": {
            "admission": {"estimates": {
                "disk": {"latency_seconds": 0.001, "bytes_per_second": 2e9, "age_seconds": 3.0},
                "object": {"latency_seconds": 0.02, "bytes_per_second": 1e8, "age_seconds": 1.0},
                "peer": {"latency_seconds": 0.002, "bytes_per_second": 5e9, "age_seconds": 2.0},
            }},  # fmt: skip
            "engines": {"e1": {"recompute_tokens_per_second": 3000.0}, "e2": {"recompute_tokens_per_second": None},
                        "e3": {"recompute_tokens_per_second": 5000.0}},  # fmt: skip
        },
    }
    figures = node_figures("n1", stats)
    assert list(figures.schemes) == [described["namespace"]]  # the unreadable layout is left out
    assert figures.namespaces("/models/m") == [described["namespace"]] and figures.namespaces("other") == []
    assert figures.costs[DISK].bytes_per_second == 2e9 and figures.costs[BUCKET].latency_seconds == 0.02
    assert figures.costs[PEER].age_seconds == 2.0
    assert figures.prefill_tokens_per_second == 4000.0  # the median of the engines that measured one
    cluster = ClusterFigures({"n1": figures, "n2": NodeFigures("n2")})
    assert cluster.prefill_rate("n2", 1.0) == 4000.0 and cluster.prefill_rate("n3", 1.0) == 4000.0
    assert ClusterFigures().prefill_rate("n1", 1234.0) == 1234.0
    # A node that never fetched from a peer is priced as the others measured it, not as the default.
    defaults = {DISK: Cost(0.0, 1.0), PEER: Cost(0.0, 1.0), BUCKET: Cost(0.0, 1.0)}
    assert cluster.costs("n2", defaults)[PEER] == figures.costs[PEER]
    assert cluster.costs("n1", defaults)[DISK] == figures.costs[DISK]
    assert ClusterFigures().costs("n1", defaults) == defaults


def test_a_hugging_face_id_names_the_copy_serve_downloaded():
    snapshot = "/root/.cache/huggingface/hub/models--meta-llama--Llama-3.1-8B/snapshots/0e9e39f/"
    assert names_model("meta-llama/Llama-3.1-8B", snapshot) and names_model("/m", "/m")
    assert not names_model("meta-llama/Llama-3.1-70B", snapshot)


def test_the_example_yaml_selects_the_router_with_a_directory_to_read():
    from ray.serve.config import RequestRouterConfig

    from kvstrata.routing import TierAwareRouter

    (application,) = yaml.safe_load((REPO / "examples/serve/tier_aware_router.yaml").read_text())["applications"]
    (llm,) = application["args"]["llm_configs"]
    routing = RequestRouterConfig(**llm["deployment_config"]["request_router_config"])
    assert routing.get_request_router_class() is TierAwareRouter
    assert routing.request_router_kwargs["model"] == llm["model_loading_config"]["model_source"]
    tiers = llm["engine_kwargs"]["kv_transfer_config"]["kv_connector_extra_config"]["config"]
    assert "cluster" in tiers  # without it no store publishes to the directory
