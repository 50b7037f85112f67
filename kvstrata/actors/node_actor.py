"""The node store under Ray: what only an actor's process adds to `kvstrata.store.NodeStore`.

`client.ensure_node_store` starts this class as the named, detached, node-pinned actor
of a node. It adds, around the plain store (kvstrata/store/node_store.py): the object
store's credentials, which come by the cluster's KV store and never as arguments
(secrets.py); the link to other nodes' stores (peers.py), which the store uses as its
`peer` lower tier; the metrics exporter (store_metrics.py); and the frozen start-up heap.

Owns: the peer link's start, the metrics exporter.
Must not: hold store logic: every call is the plain store's.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Mapping
from typing import Any

from kvstrata.actors.directory import directory_shard
from kvstrata.actors.options import in_ray_actor
from kvstrata.actors.peers import PeerSync
from kvstrata.actors.secrets import resolve_secrets
from kvstrata.actors.store_metrics import MetricsExporter, metric_samples
from kvstrata.config import KvstrataConfig, load_config
from kvstrata.store.executors import ExecutorFactory, thread_pools
from kvstrata.store.node_store import NodeStore


class NodeStoreActor(NodeStore):
    """A node store with its cluster: secrets resolved, peers linked, metrics exported."""

    def __init__(
        self,
        config: KvstrataConfig | Mapping[str, Any] | None,
        node_id: str,
        clock: Callable[[], float] = time.monotonic,
        executors: ExecutorFactory = thread_pools,
    ):
        config = load_config(resolve_secrets(config))  # credentials come by the cluster's KV store
        peers = None
        if config.cluster is not None and _in_ray():
            peers = PeerSync(node_id, config.cluster, lambda: dict(self.ctx.logs), directory_shard)
        super().__init__(config, node_id, clock, executors, peers=peers)
        if peers is not None:
            peers.start()
        self._metrics = None
        if in_ray_actor():
            freeze_startup_heap()
            self._metrics = MetricsExporter(lambda: metric_samples(self.stats()), name="kvstrata-store-metrics").start()

    def close(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
        super().close()


def freeze_startup_heap() -> None:
    """Keep the objects that exist now (modules, Ray's and the store's own set-up) out of every
    later garbage collection, as vLLM's engine core and Ray Serve's replicas do after start-up.

    Why: with Ray imported, a full collection walks ~70,000 objects and holds the GIL for
    ~50 ms; one fell inside a 2048-chunk commit, and every I/O thread waited on it. The
    store's own later objects are still collected.
    """
    gc.collect()
    gc.freeze()


def _in_ray() -> bool:
    """Whether this store runs in a Ray process (the actor), not in-process in a test."""
    import ray

    return ray.is_initialized()
