"""Placement on a multi-node cluster: one store per node, the directory, a reconciler.

    from kvstrata.actors.cluster import up, down
    up(load_config("configs/multinode.yaml"))   # or: kvstrata up --config ...

`up` creates the directory shards, a store on every alive node (or every node offering
`cluster.node_resource`), and the reconciler: a small detached actor that, every
`cluster.reconcile_seconds`, creates stores on nodes that joined and drops the
directory entries of nodes that left. Everything is named in the `kvstrata` namespace
with `get_if_exists`, so calling `up` again (or from every node) is harmless.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from kvstrata.actors.client import RayStoreClient, StoreUnavailable, ensure_node_store, get_node_store, shutdown_node_store
from kvstrata.actors.directory import directory_actor_name, directory_shard
from kvstrata.actors.options import STORE_NAMESPACE, service_actor_options
from kvstrata.actors.secrets import stash_secrets
from kvstrata.config import ClusterConfig, KvstrataConfig, load_config

logger = logging.getLogger(__name__)
RECONCILER_NAME = "kvstrata-reconciler"


def store_nodes(config: ClusterConfig) -> list[str]:
    """Alive nodes that should run a store."""
    import ray

    resource, label = config.node_resource, config.node_label
    label_key, _, label_value = (label or "").partition("=")

    def wanted(node: dict) -> bool:
        if resource is not None and node.get("Resources", {}).get(resource, 0) <= 0:
            return False
        return label is None or (node.get("Labels") or {}).get(label_key) == label_value

    return sorted(node["NodeID"] for node in ray.nodes() if node["Alive"] and wanted(node))


def dead_nodes() -> set[str]:
    import ray

    return {node["NodeID"] for node in ray.nodes() if not node["Alive"]}


class Reconciler:
    """Keeps one store on every wanted node and the directory free of departed nodes."""

    def __init__(self, config: dict[str, Any]):
        self.config = load_config(config)
        self._known: set[str] = set()
        # Nodes whose entries this instance dropped. A reconciler restarted elsewhere (its
        # node died) starts empty and drops every dead node once more: idempotent.
        self._dropped: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstrata-reconciler", daemon=True)
        self._thread.start()

    def reconcile(self) -> dict[str, list[str]]:
        """One round: stores for new nodes, directory entries of gone nodes dropped."""
        import ray

        cluster = self.config.cluster
        alive = set(store_nodes(cluster))
        joined = sorted(alive - self._known)
        left = sorted((dead_nodes() | (self._known - alive)) - self._dropped - alive)
        for node_id in joined:
            ensure_node_store(self.config, node_id)
        if left:
            shards = [directory_shard(s) for s in range(cluster.directory_shards)]
            dropped = ray.get([shard.drop_nodes.remote(left) for shard in shards], timeout=cluster.call_timeout_seconds)
            self._dropped.update(left)
            logger.info("kvstrata reconciler: nodes %s left; %d directory entries dropped", left, sum(dropped))
        if joined:
            logger.info("kvstrata reconciler: stores ensured on %d new node(s)", len(joined))
        self._known = alive
        return {"joined": joined, "left": left}

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.wait(self.config.cluster.reconcile_seconds):
            try:
                self.reconcile()
            except Exception:  # noqa: BLE001 - a failed round is retried next period
                logger.exception("kvstrata reconciler: round failed")


def up(config: KvstrataConfig) -> dict[str, Any]:
    """Directory, a store on every wanted node, and the reconciler; returns what exists."""
    import ray

    if config.cluster is None:
        raise ValueError("kvstrata up for a cluster needs a `cluster` section in the config")
    shards = [directory_shard(s) for s in range(config.cluster.directory_shards)]
    ray.get([shard.ping.remote() for shard in shards], timeout=60)
    options = service_actor_options(RECONCILER_NAME, max_concurrency=4)  # `stop` while its loop runs
    reconciler = ray.remote(Reconciler).options(**options).remote(stash_secrets(config))
    ray.get(reconciler.reconcile.remote(), timeout=120)  # stores now, not one period from now
    nodes = store_nodes(config.cluster)
    epochs = [RayStoreClient(get_node_store(node), timeout_s=120).ping() for node in nodes]
    return {"nodes": nodes, "store_epochs": epochs, "directory_shards": len(shards)}


def down(config: KvstrataConfig) -> None:
    """Stop the reconciler, take every store down, end the directory (on purpose, by handle)."""
    import ray

    try:
        reconciler = ray.get_actor(RECONCILER_NAME, namespace=STORE_NAMESPACE)
        ray.get(reconciler.stop.remote(), timeout=60)
        ray.kill(reconciler, no_restart=True)
    except ValueError:
        pass
    cluster = config.cluster or ClusterConfig()
    for node_id in store_nodes(cluster):
        try:
            shutdown_node_store(get_node_store(node_id))
        except StoreUnavailable:
            pass
    for shard in range(cluster.directory_shards):
        try:
            ray.kill(ray.get_actor(directory_actor_name(shard), namespace=STORE_NAMESPACE), no_restart=True)
        except ValueError:
            pass
