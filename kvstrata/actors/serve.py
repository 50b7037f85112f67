"""Ray Serve LLM: the node stores of a replica's nodes exist before its engine starts.

    LLMConfig(
        ...,
        engine_kwargs={"kv_transfer_config": {... kvstrata ...}},
        callback_config={"callback_class": "kvstrata.actors.serve:NodeStoreCallback"},
    )

Serve LLM runs a replica's callback before it starts vLLM (`on_before_node_init`). This
one creates (or finds) the kvstrata store of every node in the replica's placement
group -- with tensor or pipeline parallelism over several nodes, each of them -- and
waits until each answers, so the engine's first scheduler step finds its store.

It also tells the engine which node it stands for (`KVSTRATA_NODE_ID`, inherited by the
engine's processes, unless already set): the replica's own node. On a real cluster that
is where the engine's scheduler runs anyway; on simulated nodes (several raylets on one
machine) the scheduler's own `ray.init` may attach to another node's raylet, and the
engine would use that node's store, hiding from routers where its chunks are.

The tier config is the one the engine will use: `kv_transfer_config`'s
`kv_connector_extra_config.config` (a path or an inline mapping), unless the callback
is given its own with `callback_kwargs: {config: ...}`. Stores are looked up in the
`kvstrata` namespace by name: Serve's processes run in other (anonymous) namespaces.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from typing import Any

from ray.llm._internal.common.callbacks.base import CallbackBase

from kvstrata.actors.client import RayStoreClient, current_node_id, ensure_node_store
from kvstrata.actors.options import in_ray_actor
from kvstrata.config import load_config

logger = logging.getLogger(__name__)


def placement_group_nodes(placement_group: Any) -> list[str]:
    """The nodes a placement group's bundles were placed on (none for no group)."""
    if placement_group is None:
        return []
    import ray.util

    table = ray.util.placement_group_table(placement_group)
    return sorted(set((table.get("bundles_to_node_id") or {}).values()))


def engine_tier_config(engine_kwargs: Mapping[str, Any]) -> Any:
    """The kvstrata config named in a Serve LLM `engine_kwargs` (None: the built-in default)."""
    transfer = engine_kwargs.get("kv_transfer_config") or {}
    if not isinstance(transfer, Mapping):  # a vLLM KVTransferConfig object
        transfer = {"kv_connector_extra_config": getattr(transfer, "kv_connector_extra_config", {})}
    return (transfer.get("kv_connector_extra_config") or {}).get("config")


class NodeStoreCallback(CallbackBase):
    def __init__(self, llm_config: Any, raise_error_on_callback: bool = True, ctx_kwargs: Any = None, **kwargs: Any):
        self.tier_config = kwargs.pop("config", None)
        super().__init__(llm_config, raise_error_on_callback, ctx_kwargs, **kwargs)

    async def on_before_node_init(self) -> None:
        source = self.tier_config
        if source is None:
            source = engine_tier_config(self.llm_config.engine_kwargs)
        config = load_config(source)
        if in_ray_actor():  # the replica: its engine, started after this, inherits it
            os.environ.setdefault("KVSTRATA_NODE_ID", current_node_id())
        nodes = placement_group_nodes(self.ctx.placement_group) or [current_node_id()]
        timeout_s = config.engine.control_timeout_seconds * 3  # a new store maps its arena first
        stores = [RayStoreClient(ensure_node_store(config, node), timeout_s) for node in nodes]
        epochs = await asyncio.wait_for(
            asyncio.gather(*(store.ping_async() for store in stores)),
            timeout=timeout_s,
        )
        logger.info(
            "kvstrata: node stores ready on %d node(s) of this replica (epochs %s)", len(nodes), ", ".join(epochs)
        )
