"""The node store: owner of one node's tiers, shared by every engine on the node.

It is a plain class so it can be unit-tested and benchmarked without Ray; `client`
wraps it as a named, detached, node-pinned Ray actor. Ray serialises the calls; disk
I/O runs on a small thread pool, so a lock guards the arena and the store's own state
(the disk tier and the change logs lock themselves). Every call first expires dead
engines' leases.

Between tiers:
- cascade: a committed chunk is written to disk in the background (`write_through`),
  or when the arena evicts it (`write_back`); the slot stays pinned by the cascade
  until the write is done. A full queue drops the write (counted), never blocks.
- promotion: a pin asked for a chunk that is only on disk reserves an arena slot, reads
  and verifies the chunk on an I/O thread, and commits it; meanwhile the engine is told
  `pending` (it answers RETRY), and its next pin request finds the chunk in the arena.
  A failed or corrupt read leaves the chunk nowhere, so the next request is a MISS.
- object tier (shared by all nodes): committed chunks are uploaded in the background
  (`write_through`, skipped when the bucket already holds them) or when evicted
  (`write_back`), under the same bounded-queue rule. What the bucket holds is learned
  from this store's own uploads and from a sweep (one listing of the whole URL) every
  `index_refresh_seconds` and whenever a new namespace registers, so chunks other nodes
  stored become hits here; the sweep also deletes what `capacity` and `ttl_seconds` rule
  out. Promotion prefers the local disk and falls back to the object store.

The store is assembled from parts, one module each, mixins over the state they share
(store_state.py says why mixins):
- store_control.py: the calls engines make (register, step, release_holder) and other
  stores make (export_chunks);
- cascade.py: copies to disk and the object store; disk_jobs.py: how disk I/O is cut
  into jobs;
- promotion.py: reads from disk, peers and the object store into the arena;
- object_index.py: the sweep of the object store;
- local_client.py: `LocalStoreClient`, the in-process client (re-exported here).
This module owns the assembly: building the state and the tiers, the start-up of an
actor's process, and the calls for tools and tests (read, locate, keys, purge, stats,
wait_io, close). It must not grow the parts' logic back.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from kvstrata.store.chunk_audit import ChunkAudit
from kvstrata.actors.directory import directory_shard
from kvstrata.store.executors import ExecutorFactory, thread_pools
from kvstrata.store.io_meter import IoMeter
from kvstrata.store.local_client import LocalStoreClient
from kvstrata.actors.options import in_ray_actor, node_tag
from kvstrata.actors.peers import PeerSync
from kvstrata.actors.secrets import resolve_secrets
from kvstrata.store.control import StoreControl
from kvstrata.actors.store_metrics import MetricsExporter, metric_samples
from kvstrata.store.report import store_report
from kvstrata.store.context import PROMOTION_SOURCES, logger
from kvstrata.config import KvstrataConfig, load_config
from kvstrata.namespaces import check_namespace
from kvstrata.tiers.arena import Arena
from kvstrata.tiers.changelog import CPU, STORAGE
from kvstrata.tiers.disk import DIGEST_THREADS, DiskTier, DiskTierError
from kvstrata.tiers.object_store import ObjectTier
from kvstrata.url_credentials import redact_url

# What tests, benchmarks and `client` import from here.
__all__ = ["LocalStoreClient", "NodeStore", "freeze_startup_heap"]


class NodeStore(StoreControl):
    """One node's store: the parts listed above, over the state built here (declared in `StoreState`)."""

    def __init__(
        self,
        config: KvstrataConfig | Mapping[str, Any] | None,
        node_id: str,
        clock: Callable[[], float] = time.monotonic,
        executors: ExecutorFactory = thread_pools,
    ):
        self.config = load_config(resolve_secrets(config))  # credentials come by the cluster's KV store
        self.node_id = node_id
        cpu = self.config.tiers.cpu
        self.arena = Arena(
            shm_dir=cpu.shm_dir,
            node_tag=node_tag(node_id),
            capacity=cpu.capacity,
            segment_size=cpu.segment_size,
            lease_seconds=self.config.engine.lease_seconds,
            eviction_policy=cpu.eviction_policy,
            prefault=cpu.prefault,
            clock=clock,
            quotas=self.config.tier_quotas("cpu"),
        )
        self._lock = threading.RLock()
        self._logs = {}
        self.layouts = {}
        self._registered = set()
        self._holders = {}
        self._sessions = {}
        self._recompute_rates = {}
        self.counters = {
            "promotions": 0,
            "promotion_failures": 0,
            "disk_writes_queued": 0,
            "disk_writes_dropped": 0,
            "object_uploads_queued": 0,
            "object_uploads_dropped": 0,
            "engine_pins": 0,  # chunks pinned for engines to load: what kvstrata served
            "pins_missing": 0,  # chunks engines asked for that no tier could bring
            # Promotions by source: disk, another node's store (peer), the object store.
            **{f"{source}_{what}": 0 for source in PROMOTION_SOURCES for what in ("promotions", "promotion_failures")},
            "chunks_exported": 0,  # chunks handed to another node's store
            "holders_refused": 0,  # registrations, steps and releases naming another engine's holder
        }
        self.io_meter = IoMeter(clock)
        self.audit = ChunkAudit() if cpu.audit_chunks else None
        self._clock = clock
        self._executors = executors  # where background jobs run (executors.py: the seam tests replace)
        # Each part's own state (see its module).
        self._init_cascade()
        self._init_object_index()
        self._init_promotion()
        self._init_purge()
        # Notified whenever I/O in flight ends, so `wait_io` returns the moment the last
        # job does (polling added up to a poll interval to every measurement).
        self._io_done = threading.Condition(self._lock)
        self.disk = None
        self.disk_error = None
        self._io = None
        self._open_disk()
        self.object = None
        self._object_io = None
        if self.config.tiers.object is not None:
            self.object = ObjectTier(self.config.tiers.object, clock=clock, quotas=self.config.tier_quotas("object"))
            self.object.reuse_of = self._reuse.estimate if self._reuse is not None else None  # sweeps spare reused chunks
            # Batches queue here; each fans out over the tier's own max_concurrency threads.
            self._object_io = executors("object", 2)
        self.peers = None
        self._peer_io = None
        if self.config.cluster is not None and _in_ray():
            self.peers = PeerSync(node_id, self.config.cluster, lambda: dict(self._logs), directory_shard).start()
            self._peer_io = executors("peer", 2)
        self._metrics = None
        if in_ray_actor():
            freeze_startup_heap()
            self._metrics = MetricsExporter(lambda: metric_samples(self.stats()), name="kvstrata-store-metrics").start()
        logger.info(
            "kvstrata node store up on node %s (pid %d, epoch %s, cpu capacity %d bytes, disk %s, object %s, peers %s)",
            node_id,
            os.getpid(),
            self.arena.epoch,
            cpu.capacity,
            self.config.tiers.disk.path if self.disk else "off",
            redact_url(self.config.tiers.object.url) if self.object else "off",
            "on" if self.peers else "off",
        )

    def _open_disk(self) -> None:
        disk = self.config.tiers.disk
        if disk is None:
            return
        try:
            self.disk = DiskTier(
                disk.path,
                disk.capacity,
                direct_io=disk.direct_io,
                eviction_policy=self.config.tiers.cpu.eviction_policy,
                on_change=lambda namespace, keys, present: self._log(namespace).record_many(keys, STORAGE, present),
                quotas=self.config.tier_quotas("disk"),
                digests=self._executors("disk-digest", DIGEST_THREADS),
            )
        except Exception as exc:  # noqa: BLE001 - DiskTierError, or whatever a damaged directory raised
            # The engine keeps serving from the arena; the operator sees why in the log and stats.
            self.disk_error = str(exc) if isinstance(exc, DiskTierError) else f"{type(exc).__name__}: {exc}"
            logger.error("kvstrata node store: disk tier disabled: %s", exc)
            return
        if self._reuse is not None:  # admission.store: reuse keeps a sketch: evict one-offs first
            self.disk.reuse_of = self._reuse.estimate
        for namespace in self.disk.namespaces():
            self._log(namespace).record_many(self.disk.keys(namespace), STORAGE, True)
        self._io = self._executors("disk", disk.io_threads)

    # --- tools and tests (never on an engine's hot path) --------------------------------

    def read(self, namespace: str, key: bytes) -> bytes | None:
        """Bytes of one chunk resident in the arena."""
        with self._lock:
            pool = self.arena.pools.get(namespace)
            slot = pool.lookup(key) if pool is not None else None
            return None if slot is None else pool.view(slot).tobytes()

    def locate(self, namespace: str, key: bytes) -> tuple[str, int, int] | None:
        """(segment path, offset, length) of a chunk resident in the arena."""
        with self._lock:
            pool = self.arena.pools.get(namespace)
            slot = pool.lookup(key) if pool is not None else None
            if slot is None:
                return None
            segment, offset = pool.geometry.locate(slot)
            return pool.geometry.segment_path(segment), offset, pool.geometry.slot_bytes

    def keys(self, namespace: str, medium: str = CPU) -> list[bytes]:
        """Keys of a namespace held by one tier (`CPU` arena or `STORAGE` disk)."""
        check_namespace(namespace)
        return self._log(namespace).present(medium)

    def purge(self, namespace: str | None = None) -> int:
        """Drop the chunks of one namespace (or all) from every tier; pinned ones go when unpinned.

        A namespace that is not valid (`kvstrata.namespaces`: empty, dotted, slash-bearing,
        ...) is a ValueError naming it, before anything is removed."""
        if namespace is not None:
            check_namespace(namespace)
        with self._serving(), self._lock:
            namespaces = list(self._logs) if namespace is None else [namespace]
            removed = sum(self._purge(ns) for ns in namespaces)
        logger.info("kvstrata node store: purged %d chunks (namespace %s)", removed, namespace or "all")
        return removed

    def stats(self) -> dict[str, object]:
        with self._lock:
            self.arena.reclaim_due_orphans()
            disk_stats = self.disk.stats() if self.disk else None
            disk = disk_stats or ({"error": self.disk_error} if self.disk_error else None)
            return {
                "object": self.object.stats() if self.object else None,
                "peers": self.peers.stats() if self.peers else None,
                "uploads_pending": self._uploads_pending,
                "node_id": self.node_id,
                "pid": os.getpid(),
                "layouts": self.layouts,
                **self.arena.stats(),
                "disk": disk,
                "writes_pending": self._writes_pending,
                "gc_frozen_objects": gc.get_freeze_count(),
                **self.counters,
                "audit": dict(self.audit.counters) if self.audit is not None else None,
                "report": store_report(self, disk_stats),
            }

    def wait_io(self, timeout_s: float = 30.0) -> bool:
        """Wait until no disk write, promotion, upload, sweep or bucket purge is in flight (tests, tools, benchmarks)."""
        with self._io_done:
            return self._io_done.wait_for(
                lambda: not (
                    self._writes_pending or self._promoting or self._uploads_pending or self._scanning or self._purges_pending()
                ),
                timeout_s,
            )

    def close(self) -> None:
        """Unlink the arena; disk records stay for the next store. For taking the store down on purpose."""
        if self._metrics is not None:
            self._metrics.close()
        if self.peers is not None:
            self.peers.close()
            self._peer_io.shutdown(wait=True)
        if self._io is not None:
            self._io.shutdown(wait=True)
        if self._object_io is not None:
            self._object_io.shutdown(wait=True)
            self.object.close()
        if self.disk is not None:
            # Outside the lock: the reads still being verified finish their promotions
            # (under the lock) before the disk tier's digest threads stop.
            self.disk.close()
        with self._lock:
            self.arena.close()
        logger.info("kvstrata node store on node %s closed", self.node_id)


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
