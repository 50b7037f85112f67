"""The Serve LLM callback on a simulated two-node cluster (`ray.cluster_utils.Cluster`):
before a replica's engine starts, every node of its placement group has a store, made
from the tier config the engine itself will use."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import ray
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group, remove_placement_group

from kvstrata.actors.client import StoreUnavailable, get_node_store, shutdown_node_store
from kvstrata.actors.serve import NodeStoreCallback, engine_tier_config, placement_group_nodes


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address, namespace="kvstrata-tests-serve", log_to_driver=False)
        cluster.wait_for_nodes()
        yield [node["NodeID"] for node in ray.nodes() if node["Alive"]]
    finally:
        ray.shutdown()
        cluster.shutdown()


def tier_config(tmp_path) -> dict:
    return {"tiers": {"cpu": {"capacity": "1MiB", "segment_size": "1MiB", "shm_dir": str(tmp_path)}}}


def engine_kwargs(config) -> dict:
    extra = {"spec_name": "StrataSpec", "spec_module_path": "kvstrata.connector", "config": config}
    return {"kv_transfer_config": {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}}


def test_every_node_of_the_replica_placement_group_gets_a_store_before_the_engine(two_nodes, tmp_path):
    group = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="STRICT_SPREAD")
    ray.get(group.ready(), timeout=60)
    assert sorted(placement_group_nodes(group)) == sorted(two_nodes)
    for node in two_nodes:
        with pytest.raises(StoreUnavailable):
            get_node_store(node)
    callback = NodeStoreCallback(
        llm_config=SimpleNamespace(engine_kwargs=engine_kwargs(tier_config(tmp_path))),
        ctx_kwargs={"placement_group": group},
    )
    try:
        callback.run_callback_sync("on_before_node_init")
        stats = [ray.get(get_node_store(node).stats.remote(), timeout=30) for node in two_nodes]
        assert sorted(s["node_id"] for s in stats) == sorted(two_nodes)
        assert all(s["capacity"] == 1024**2 for s in stats)  # the engine's own tier config
    finally:
        for node in two_nodes:
            with contextlib.suppress(StoreUnavailable):
                shutdown_node_store(get_node_store(node))
        remove_placement_group(group)


def test_a_config_given_to_the_callback_wins_and_a_bad_one_fails_the_replica_start(two_nodes, tmp_path):
    assert engine_tier_config({}) is None  # no kvstrata connector: the built-in default
    assert engine_tier_config(engine_kwargs("/etc/kv.yaml")) == "/etc/kv.yaml"
    bad = NodeStoreCallback(
        llm_config=SimpleNamespace(engine_kwargs=engine_kwargs(tier_config(tmp_path))),
        config={"tiers": {"cpu": {"capacity": "lots"}}},
    )
    with pytest.raises(Exception, match=r"tiers\.cpu\.capacity"):
        bad.run_callback_sync("on_before_node_init")
