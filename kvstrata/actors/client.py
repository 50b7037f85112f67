"""Joining the Ray cluster and reaching this node's store from any process.

Inside vLLM processes (scheduler, workers) Ray may or may not be initialised already:
Ray Serve LLM initialises it in an anonymous namespace, a plain `vllm serve` does not.
We join with `address="auto"` only when needed, and always name the kvstrata
namespace when looking the store up. The store's client (`RayStoreClient`) lives in
store_client.py and is importable from here.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from kvstrata import ray_address
from kvstrata.actors.node_actor import NodeStoreActor
from kvstrata.actors.options import STORE_NAMESPACE, node_store_options, store_actor_name
from kvstrata.actors.secrets import stash_secrets
from kvstrata.actors.store_client import RayStoreClient, StoreUnavailable
from kvstrata.config import KvstrataConfig

__all__ = [
    "RayStoreClient", "StoreUnavailable", "current_node_id", "ensure_node_store", "get_node_store",
    "join_cluster", "named_actors", "shutdown_node_store", "store_client",
]  # fmt: skip

logger = logging.getLogger(__name__)


def join_cluster(address: str = "auto", logging_level: int = logging.INFO) -> None:
    """Connect this process to the Ray cluster unless it already is connected.

    `logging_level`: Ray's own log lines in this process (the CLI passes WARNING: its
    output is kvstrata's answer, not Ray's connection chatter)."""
    import ray

    if ray.is_initialized():
        return
    try:
        ray_address.check(address)  # a dead address fails in seconds, not minutes in ray.init
        ray.init(address=address, namespace=STORE_NAMESPACE, log_to_driver=False, logging_level=logging_level)
    except ray_address.Unreachable as exc:
        raise StoreUnavailable(f"kvstrata needs a running Ray cluster: {exc}") from None
    except ConnectionError as exc:
        raise StoreUnavailable(
            f"kvstrata needs a running Ray cluster on this node and found none at address "
            f"{address!r} ({exc}). Start one with `ray start --head` (or run "
            f"examples/quickstart.py, which starts a local one), or set `ray.address` in the "
            f"kvstrata config / RAY_ADDRESS."
        ) from None
    logger.info("kvstrata joined the Ray cluster (address %s)", address)


def current_node_id() -> str:
    """This process's Ray node. `KVSTRATA_NODE_ID` overrides it: simulated nodes on one
    machine share an IP, and a process that joins the cluster there may be attached to
    another simulated node's raylet than the one it stands for."""
    import ray

    return os.environ.get("KVSTRATA_NODE_ID") or ray.get_runtime_context().get_node_id()


def ensure_node_store(config: KvstrataConfig, node_id: str | None = None) -> Any:
    """The store actor of a node (this one by default), created if it does not exist."""
    import ray

    node_id = node_id or current_node_id()
    actor_cls = ray.remote(NodeStoreActor)
    options = node_store_options(node_id, config.ray.store_num_cpus)
    return actor_cls.options(**options).remote(stash_secrets(config), node_id)  # credentials: not as arguments


def get_node_store(node_id: str | None = None) -> Any:
    """The existing store actor of a node; raises StoreUnavailable if there is none."""
    import ray

    node_id = node_id or current_node_id()
    try:
        return ray.get_actor(store_actor_name(node_id), namespace=STORE_NAMESPACE)
    except ValueError:
        raise StoreUnavailable(f"no kvstrata node store on node {node_id}; run `kvstrata up`") from None


def store_client(node_id: str | None = None, timeout_s: float = 30.0) -> RayStoreClient:
    """A client of a node's existing store (this node's by default); StoreUnavailable if none."""
    return RayStoreClient(get_node_store(node_id), timeout_s)


def named_actors(prefix: str) -> dict[str, Any]:
    """Live kvstrata actors whose name starts with `prefix`, by the rest of their name
    (node ids for stores, shard numbers for the directory)."""
    import ray
    from ray.util import list_named_actors

    found: dict[str, Any] = {}
    for actor in list_named_actors(all_namespaces=True):
        if actor["namespace"] == STORE_NAMESPACE and actor["name"].startswith(prefix):
            try:
                found[actor["name"][len(prefix) :]] = ray.get_actor(actor["name"], namespace=STORE_NAMESPACE)
            except ValueError:
                pass  # ended between the listing and the lookup
    return found


def shutdown_node_store(handle: Any, timeout_s: float = 30.0) -> None:
    """Take a store down on purpose: unlink its segments, then end the actor."""
    import ray

    try:
        ray.get(handle.close.remote(), timeout=timeout_s)
    finally:
        ray.kill(handle, no_restart=True)
