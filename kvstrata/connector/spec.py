"""`StrataSpec`: what vLLM's OffloadingConnector instantiates from the extra config.

Built in the API server (class only, for metric definitions), in the scheduler and in
every worker. Construction parses the YAML (so a bad file fails at engine start with
its name, key and reason) and touches neither Ray nor the store; the scheduler joins
Ray when it first asks for its manager, the workers never do.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

from kvstrata.config import KvstrataConfig, load_config
from kvstrata.connector.compat import (
    CanonicalKVCaches,
    OffloadingConfig,
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
    anchor_groups,
    async_scheduling,
    cached_prefix_unsupported,
    check_vllm_version,
    engine_vllm_config,
    group_ids,
    model_download_dir,
    model_settings,
    override,
    prefix_hash_algo,
)
from kvstrata.connector.manager import COUNTER_NAMES, GAUGE_NAMES, StrataManager, metric_name
from kvstrata.connector.deferred_start import DeferredStart, Off, Starting
from kvstrata.connector.weight_updates import WeightGenerations
from kvstrata.identity import LongRead, ModelIdentity, resolve_model_identity
from kvstrata.keys import Layout
from kvstrata.namespaces import holder_name

logger = logging.getLogger(__name__)

# The most the weights' fingerprint may read on the engine's start path: 5-10 ms at the
# 0.9-1.8 GB/s measured for it (docs/model-identity.md). A restart, a labelled or a small
# checkpoint reads less; a node's first start of a large one is fingerprinted while the
# engine serves (deferred_start.py).
READ_AT_START_BYTES = 8 << 20


def build_layout(
    config: OffloadingConfig, kvstrata_config: KvstrataConfig, vllm_config: Any | None = None
) -> Layout:
    """The layout namespace of an engine: everything that makes its KV bytes what they are.

    The model's identity is not part of it yet: that reads the checkpoint, which only
    the scheduler needs (`StrataSpec.get_manager`); workers use the layout's geometry.
    """
    parallel = config.parallel
    return Layout(
        model=config.model.name,
        dtype=config.model.dtype,
        kv_cache_layout=str(getattr(config, "kv_cache_layout", None) or ""),
        tokens_per_block=tuple(group.tokens_per_block for group in config.groups),
        group_ids=group_ids(config),
        tokens_per_hash=config.cache.tokens_per_hash,
        blocks_per_chunk=config.cache.blocks_per_chunk,
        worker_kv_bytes_per_block=config.worker_kv_bytes_per_block,
        world_size=parallel.world_size,
        tp_size=parallel.tp_size,
        pp_size=parallel.pp_size,
        pcp_size=getattr(parallel, "pcp_size", 1),
        dcp_size=getattr(parallel, "dcp_size", 1),
        hash_algo=prefix_hash_algo(vllm_config),
        namespace_prefix=kvstrata_config.namespace_prefix,
        anchor_groups=anchor_groups(config),
    )


class StrataSpec(OffloadingSpec):
    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        definitions: dict[str, OffloadingMetricMetadata] = {
            metric_name(name): OffloadingCounterMetadata(documentation=doc) for name, doc in COUNTER_NAMES.items()
        }
        definitions.update(
            {metric_name(name): OffloadingGaugeMetadata(documentation=doc) for name, doc in GAUGE_NAMES.items()}
        )
        return definitions

    def __init__(self, config: OffloadingConfig):
        check_vllm_version()
        super().__init__(config)
        self.kvstrata_config = load_config(self.extra_config.get("config"))
        vllm_config = engine_vllm_config()
        self.layout = build_layout(config, self.kvstrata_config, vllm_config)
        # Read now (the connector's frame is on the stack only during construction), used
        # by the scheduler's get_manager: a handful of strings and the model's HF config.
        self._model_settings = None if vllm_config is None else model_settings(vllm_config)
        self._model_revision = None if vllm_config is None else vllm_config.model_config.revision
        self._download_dir = None if vllm_config is None else model_download_dir(vllm_config)
        self._async_scheduling = async_scheduling(vllm_config)
        self._cache_off = cached_prefix_unsupported(vllm_config)
        self.identity: ModelIdentity | None = None
        self._manager: WeightGenerations | Off | None = None
        self._worker: OffloadingWorker | None = None

    @override
    def get_manager(self) -> OffloadingManager:
        if self._manager is None and self._cache_off is not None:
            logger.warning("kvstrata is off for model %s: %s; every prompt is recomputed", self.config.model.name, self._cache_off)
            self._manager = Off(self._cache_off)
        if self._manager is None:
            from kvstrata.actors.client import RayStoreClient, ensure_node_store
            from kvstrata.connector.ray_join import join_cluster_keeping_signals

            cfg = self.kvstrata_config
            join_cluster_keeping_signals(cfg.ray.address)
            client = RayStoreClient(ensure_node_store(cfg), cfg.engine.control_timeout_seconds)
            holder = f"{self.config.engine_id}-{os.getpid()}"

            def start(layout: Layout, holder: str) -> StrataManager:
                return StrataManager(
                    client,
                    layout,
                    cfg,
                    holder=holder_name(holder),  # the store checks holders
                    enable_events=self.kv_events_config.enable_kv_cache_events,
                    async_scheduling=self._async_scheduling,
                )

            def start_first(read_limit: int | None) -> StrataManager:
                self._resolve_identity(read_limit)
                return start(self.layout, holder)

            def ready(manager: StrataManager) -> StrataManager:
                """Off the engine's thread: its first slots have landed, so it stores from its first request."""
                manager.wait_idle(cfg.engine.control_timeout_seconds)
                return manager

            def start_generation(generation: int) -> StrataManager:
                """After a connector reset: the weights may have changed in place (weight_updates.py)."""
                updated = self.identity.updated(generation)
                layout = dataclasses.replace(
                    self.layout, model_identity=updated.digest, identity_source=updated.source
                )
                logger.info(
                    "kvstrata: connector reset: model %s now has identity %s (weights may have changed in place; "
                    "unique to this engine): namespace %s",
                    updated.name, updated.short, layout.namespace,
                )  # fmt: skip
                return start(layout, f"{holder}-g{generation}")

            try:
                self._manager = WeightGenerations(start_first(READ_AT_START_BYTES), start_generation)
            except LongRead as long:
                logger.info(
                    "kvstrata: fingerprinting the weights of %s reads %.2f GiB; the engine serves now, recomputing "
                    "every prompt, and kvstrata turns on when the fingerprint is done",
                    self.config.model.name, long.read_bytes / (1 << 30),
                )  # fmt: skip
                pending = DeferredStart(lambda: ready(start_first(None)))
                self._manager = WeightGenerations(Starting(), start_generation, pending)
        return self._manager

    def _resolve_identity(self, read_limit: int | None) -> None:
        """The model's identity, and the layout namespace it makes (raises LongRead past `read_limit`)."""
        identity = resolve_model_identity(
            self.config.model.name,
            self.kvstrata_config.model_identity,
            self._model_settings,
            revision=self._model_revision,
            cache_dir=self._download_dir,
            read_limit=read_limit,
        )
        self.identity = identity
        self.layout = dataclasses.replace(self.layout, model_identity=identity.digest, identity_source=identity.source)
        logger.info(
            "kvstrata: model %s has identity %s (%s): namespace %s",
            identity.name, identity.short, identity.source, self.layout.namespace,
        )  # fmt: skip

    @override
    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            from kvstrata.connector.worker import StrataWorker

            engine = self.kvstrata_config.engine
            self._worker = StrataWorker(
                kv_caches, self.layout, self.config.parallel.rank, copy_threads=engine.copy_threads, gpu_copy=engine.gpu_copy
            )
        return self._worker
