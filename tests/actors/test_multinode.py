"""Many nodes as one cache, on a simulated three-node cluster (`ray.cluster_utils.Cluster`,
loopback only): `up` places a store per node, chunks stored on one node are loaded on
another through peer fetch (bit-exact, counted as remote), a node that leaves turns into
misses and the reconciler notices nodes that come and go, and a directory that restarts
costs nothing but a sync period."""

from __future__ import annotations

import contextlib
import time

import pytest
import ray
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from kvstrata.actors.client import StoreUnavailable, get_node_store
from kvstrata.actors.cluster import directory_shard, down, up
from kvstrata.config import load_config
from kvstrata._dev.testing import ChunkProbe
from tests.utils import key

NS = "multinode-ns"
SLOT = 64 * 1024
SHARDS = 2


def wait_for(predicate, timeout_s=60.0, what="condition"):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {timeout_s}s")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    shm = tmp_path_factory.mktemp("shm")
    config = load_config(
        {
            "tiers": {"cpu": {"capacity": 64 * SLOT, "segment_size": 16 * SLOT, "shm_dir": str(shm)}},
            "cluster": {"directory_shards": SHARDS, "sync_seconds": 0.1, "reconcile_seconds": 0.5, "call_timeout_seconds": 3},
        }
    )
    sim = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"node_a": 1}, "include_dashboard": False})
    try:
        nodes = {"a": sim.head_node}
        nodes["b"] = sim.add_node(num_cpus=1, resources={"node_b": 1})
        nodes["c"] = sim.add_node(num_cpus=1, resources={"node_c": 1})
        ray.init(address=sim.address, namespace="kvstrata-tests-multinode", log_to_driver=False)
        sim.wait_for_nodes()
        placed = up(config)
        assert len(placed["nodes"]) == 3
        yield sim, nodes, config
    finally:
        with contextlib.suppress(Exception):
            down(config)
        ray.shutdown()
        sim.shutdown()


def node_id(sim_node) -> str:
    return sim_node.node_id


def probe(sim_node, holder: str):
    actor = (
        ray.remote(ChunkProbe)
        .options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id(sim_node), soft=False))
        .remote(holder, NS, SLOT)
    )
    return actor


def stored_and_known(writer, reader, keys, seed, what):
    """Store chunks through `writer`'s node and wait until `reader`'s store knows them as a peer's."""
    written = ray.get(writer.store_chunks.remote(keys, seed))
    wait_for(lambda: ray.get(reader.knows.remote(keys, "PEER")), what=what)
    return written


def test_up_places_one_store_per_node(cluster):
    _, nodes, _ = cluster
    for name, sim_node in nodes.items():
        stats = ray.get(get_node_store(node_id(sim_node)).stats.remote(), timeout=30)
        assert stats["node_id"] == node_id(sim_node) and stats["peers"] is not None, name


def test_status_shows_every_node_and_the_directory_and_peer_hits(cluster, capsys):
    from kvstrata.cli import main

    _, nodes, _ = cluster
    writer, reader = probe(nodes["a"], "status-writer-a"), probe(nodes["b"], "status-reader-b")
    keys = [key(300 + i) for i in range(3)]  # keys no other test of the module stores
    stored_and_known(writer, reader, keys, 7, what="node B learning node A's chunks")
    ray.get(reader.load_chunks.remote(keys))
    assert main(["status"]) == 0
    out = capsys.readouterr().out
    assert all(f"node {node_id(n)}" in out for n in nodes.values()), out
    assert "cluster directory" in out and NS in out
    assert main(["status", "--json", "--node", node_id(nodes["b"])]) == 0
    import json

    peer = json.loads(capsys.readouterr().out)["report"]["tiers"]["peer"]
    assert peer["state"] == "on" and peer["hits"] >= 3 and peer["read_bytes"] >= 3 * SLOT


def test_chunks_stored_on_one_node_are_loaded_on_another_bit_exact(cluster):
    _, nodes, _ = cluster
    writer, reader = probe(nodes["a"], "writer-a"), probe(nodes["c"], "reader-c")
    keys = [key(i, group=i % 2) for i in range(6)]
    written = stored_and_known(writer, reader, keys, 1, what="node C learning node A's chunks")
    loaded = ray.get(reader.load_chunks.remote(keys))
    assert [loaded[k] for k in keys] == written
    reader_stats, writer_stats = ray.get(reader.stats.remote()), ray.get(writer.stats.remote())
    assert reader_stats["peer_promotions"] == 6 and reader_stats["peers"]["chunks_fetched"] == 6
    assert reader_stats["peers"]["corrupt_transfers"] == 0
    assert writer_stats["chunks_exported"] >= 6
    # Now resident on C too: a second load is a local hit, no new fetch.
    assert ray.get(reader.load_chunks.remote(keys)) == loaded
    assert ray.get(reader.stats.remote())["peers"]["fetch_calls"] == reader_stats["peers"]["fetch_calls"]


def test_a_node_that_leaves_becomes_misses_and_the_reconciler_follows_joins(cluster):
    sim, nodes, _ = cluster
    writer, reader = probe(nodes["b"], "writer-b"), probe(nodes["c"], "reader-c2")
    keys = [key(100 + i) for i in range(4)]
    stored_and_known(writer, reader, keys, 2, what="node C learning node B's chunks")
    gone = node_id(nodes.pop("b"))
    sim.remove_node(sim.list_all_nodes()[[n.node_id for n in sim.list_all_nodes()].index(gone)])
    started = time.monotonic()
    assert ray.get(reader.load_chunks.remote(keys), timeout=60) == dict.fromkeys(keys)  # misses, not errors
    assert time.monotonic() - started < 3 + 5  # one call timeout, plus scheduling
    wait_for(lambda: not any(ray.get(reader.knows.remote([k], "PEER")) for k in keys), what="B's entries dropped")
    # The survivors keep serving their own chunks.
    own = [key(200)]
    stored = ray.get(reader.store_chunks.remote(own, 3))
    assert [ray.get(reader.load_chunks.remote(own))[own[0]]] == stored
    # A node that joins gets a store from the reconciler.
    nodes["d"] = sim.add_node(num_cpus=1, resources={"node_d": 1})
    sim.wait_for_nodes()

    def has_store() -> bool:
        try:
            return bool(ray.get(get_node_store(node_id(nodes["d"])).ping.remote(), timeout=10))
        except StoreUnavailable:
            return False

    wait_for(has_store, timeout_s=60, what="a store on the new node")


def test_a_directory_restart_degrades_to_local_then_recovers(cluster):
    _, nodes, config = cluster
    writer, reader = probe(nodes["a"], "writer-a3"), probe(nodes["c"], "reader-c3")
    before = [key(300 + i) for i in range(3)]
    stored_and_known(writer, reader, before, 4, what="node C learning the first chunks")
    for shard in range(SHARDS):
        ray.kill(directory_shard(shard), no_restart=False)  # Ray restarts it, empty, new epoch
    own = [key(400)]  # local hits never needed the directory
    stored = ray.get(reader.store_chunks.remote(own, 5))
    assert [ray.get(reader.load_chunks.remote(own))[own[0]]] == stored
    after = [key(500 + i) for i in range(3)]
    written = ray.get(writer.store_chunks.remote(after, 6))
    # Every store sends its whole holding to the restarted shards: old and new chunks are known again.
    wait_for(lambda: ray.get(reader.knows.remote(before + after, "PEER")), what="the directory recovering")
    loaded = ray.get(reader.load_chunks.remote(after))
    assert [loaded[k] for k in after] == written
    assert ray.get(reader.stats.remote())["peers"]["directory_reachable"]
