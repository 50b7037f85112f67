"""Actor names and options, built in one place so every call site agrees."""

from __future__ import annotations

from typing import Any

STORE_NAMESPACE = "kvstrata"
STORE_NAME_PREFIX = "kvstrata-node-"


def in_ray_actor() -> bool:
    """Whether this process is a Ray actor's (a store's, a directory shard's), not a driver
    or a test building the class in-process: only actors export metrics and freeze their heap."""
    import ray

    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


def store_actor_name(node_id: str) -> str:
    return f"{STORE_NAME_PREFIX}{node_id}"


def service_actor_options(name: str, **extra: Any) -> dict[str, Any]:
    """Options every kvstrata actor shares: named in the kvstrata namespace, outliving the
    job that created it, found instead of duplicated, restarted by Ray when it dies."""
    return {
        "name": name,
        "namespace": STORE_NAMESPACE,
        "lifetime": "detached",
        "get_if_exists": True,
        "max_restarts": -1,
        "max_task_retries": 0,
        "num_cpus": 0,
        **extra,
    }


def node_store_options(node_id: str, num_cpus: float = 0.0) -> dict[str, Any]:
    """Options for the detached, node-pinned, self-restarting store of one node."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return service_actor_options(
        store_actor_name(node_id),
        num_cpus=num_cpus,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
    )
