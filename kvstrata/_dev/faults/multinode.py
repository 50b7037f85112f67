"""The fault rows that need several nodes: a simulated three-node Ray cluster on loopback
(`ray.cluster_utils.Cluster`), one store per node, chunk probes standing in for engines
(the same step calls, the bytes checked against what was written: a simulated node
cannot host another vLLM engine on two cores)."""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import tempfile
import time
from pathlib import Path

from kvstrata._dev.faults.harness import RowResult
from kvstrata._dev.faults.probes import directory_files

NS = "fault-matrix-peers"
SLOT = 64 * 1024
CHUNKS = 16
MULTINODE_FAULTS = {
    "peer-node-removed": "a node removed while another fetches its chunks",
    "directory-shard-killed": "every directory shard killed while a node fetches peers' chunks",
}


def _key(i: int) -> bytes:
    from kvstrata.keys import make_key

    return make_key(hashlib.sha256(f"fault-{i}".encode()).digest(), 0)


def _wait_for(predicate, timeout_s: float) -> float | None:
    """Seconds until `predicate()` held, or None if it did not within `timeout_s`."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        with contextlib.suppress(Exception):
            if predicate():
                return round(time.monotonic() - started, 1)
        time.sleep(0.1)  # polling a remote condition, bounded above
    return None


def run_multinode_rows(names: list[str]) -> list[RowResult]:
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from kvstrata.actors.cluster import directory_shard, down, up
    from kvstrata.config import load_config
    from kvstrata._dev.testing import ChunkProbe
    from kvstrata.tiers.orphans import reclaim_orphans

    shm = Path(tempfile.mkdtemp(prefix="kvstrata-fault-peers-", dir="/dev/shm"))
    config = load_config(
        {
            "tiers": {"cpu": {"capacity": 96 * SLOT, "segment_size": 16 * SLOT, "shm_dir": str(shm)}},
            "cluster": {"directory_shards": 2, "sync_seconds": 0.1, "reconcile_seconds": 0.5, "call_timeout_seconds": 3},
        }
    )
    sim = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"node_a": 1}, "include_dashboard": False})
    results = []
    try:
        nodes = {"a": sim.head_node, "b": sim.add_node(num_cpus=1, resources={"node_b": 1})}
        nodes["c"] = sim.add_node(num_cpus=1, resources={"node_c": 1})
        ray.init(address=sim.address, namespace="kvstrata-fault-matrix", log_to_driver=False)
        sim.wait_for_nodes()
        up(config)

        def probe(node, holder):
            strategy = NodeAffinitySchedulingStrategy(node.node_id, soft=False)
            return ray.remote(ChunkProbe).options(num_cpus=0, scheduling_strategy=strategy).remote(holder, NS, SLOT)

        for offset, name in enumerate(names):
            result = RowResult(name, MULTINODE_FAULTS[name])
            try:
                writer_node = nodes["b"] if name == "peer-node-removed" else nodes["a"]
                writer, reader = probe(writer_node, f"writer-{offset}"), probe(nodes["c"], f"reader-{offset}")
                keys = [_key(100 * offset + i) for i in range(CHUNKS)]
                written = dict(zip(keys, ray.get(writer.store_chunks.remote(keys, offset))))
                if _wait_for(lambda: ray.get(reader.knows.remote(keys, "PEER")), 60) is None:
                    raise RuntimeError("the reader's store never learnt the writer's chunks")
                fetch = reader.load_chunks.remote(keys)
                if name == "peer-node-removed":
                    gone = nodes.pop("b")
                    sim.remove_node(gone)
                else:
                    for shard in range(config.cluster.directory_shards):
                        ray.kill(directory_shard(shard), no_restart=False)  # Ray restarts it, empty
                result.sent = len(keys)
                try:
                    loaded = ray.get(fetch, timeout=120)
                    result.completed = len(keys)
                    result.changed = sum(1 for k in keys if loaded[k] is not None and loaded[k] != written[k])
                    result.notes.append(f"hits={sum(1 for k in keys if loaded[k] is not None)}/{len(keys)}")
                except Exception as error:  # noqa: BLE001 - a failed fetch is lost requests
                    result.failed = len(keys)
                    result.notes.append(f"{type(error).__name__}: {error}"[:120])
                # Recovery: new chunks from a surviving node are peer hits again.
                fresh = [_key(100 * offset + 50 + i) for i in range(4)]
                fresh_written = dict(zip(fresh, ray.get(probe(nodes["a"], f"writer2-{offset}").store_chunks.remote(fresh, 99))))
                result.recovery_s = _wait_for(
                    lambda: ray.get(reader.load_chunks.remote(fresh)) == fresh_written, 90
                )
                result.sent += len(fresh)
                result.completed += len(fresh)
            except Exception as error:  # noqa: BLE001
                result.error = f"{type(error).__name__}: {error}"[:300]
            results.append(result)
    finally:
        with contextlib.suppress(Exception):
            down(config)
        ray.shutdown()
        sim.shutdown()
        # What `kvstrata down` does after taking the stores down: a removed node's store
        # died with its raylet and left its arena here (the simulated nodes share
        # /dev/shm); its lock is free, so it is reclaimed. A file still left is a leak.
        reclaimed = reclaim_orphans(shm, why="found after the multi-node rows")
        if reclaimed.files and results:
            results[0].notes.append(f"{len(reclaimed.files)} orphaned arena file(s) of a dead store reclaimed")
        left = directory_files(shm)
        if left and results:
            results[-1].leaks.append(f"{len(left)} arena files left in shm_dir after down")
        shutil.rmtree(shm, ignore_errors=True)
    return results
