"""The node store: owner of one node's tiers, shared by every engine on the node.

It is plain Python (no Ray, no vLLM) so it can be unit-tested, simulated and benchmarked
in-process; actors/node_actor.py runs it as a named, detached, node-pinned Ray actor
(with the cluster's secrets, the peer link and the metrics exporter). Ray serialises the
calls; I/O runs on small thread pools, so one lock guards the arena and the store's own
state (the disk tier and the change logs lock themselves). Every call first expires dead
engines' leases.

Between tiers (the tiers below the arena are `LowerTier`s, tiers/base.py, tried in order):
- cascade (cascade.py): a committed chunk is copied down in the background
  (`write_through`), or when the arena evicts it (`write_back`); the slot stays pinned
  until the copy is done. A full queue drops the copy (counted), never blocks.
- promotion (promotion.py): a pin asked for a chunk that is not in the arena reserves a
  slot, reads and verifies the chunk on the tier's I/O thread, and commits it; meanwhile
  the engine is told `pending` (it answers RETRY), and its next pin request finds the
  chunk in the arena. A failed or corrupt read leaves the chunk nowhere: a MISS.
- object tier (object_lower.py, object_index.py; shared by all nodes): what the bucket
  holds is learned from this store's own uploads and from a sweep every
  `index_refresh_seconds` and whenever a new namespace registers.

The store is assembled from parts, one module each, plain classes that own their fields
and are handed what they need (context.py: the `StoreContext` they share):
- control.py: the calls engines make (register, step, release_holder) and other stores
  make (export_chunks), and the order of a step;
- purges.py, admission.py, cascade.py, promotion.py, prefetch.py, hints.py,
  object_index.py: the parts behind a step; lower.py, object_lower.py: the tiers below;
- local_client.py: `LocalStoreClient`, the in-process client (re-exported here).
This module owns the assembly (building the context, the lower tiers and the parts, and
wiring the listeners: a purge tells hints, a landed promotion tells prefetch) and the
calls for tools and tests (read, locate, keys, purge, stats, wait_io, close), a few lines
each. It must not grow the parts' logic back.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from contextlib import AbstractContextManager
from typing import Any

from kvstrata.config import KvstrataConfig, load_config
from kvstrata.hint_owners import OPERATOR
from kvstrata.namespaces import check_namespace
from kvstrata.protocol import HintAction, Registration, StepReply, StepRequest
from kvstrata.store.admission import ReuseAdmission
from kvstrata.store.cascade import Cascade
from kvstrata.store.chunk_audit import ChunkAudit
from kvstrata.store.context import PROMOTION_SOURCES, StoreContext, logger
from kvstrata.store.control import StoreControl
from kvstrata.store.executors import ExecutorFactory, thread_pools
from kvstrata.store.hints import Hints
from kvstrata.store.local_client import LocalStoreClient
from kvstrata.store.lower import DiskLower, PeerLink, PeerLower
from kvstrata.store.object_index import ObjectIndex
from kvstrata.store.object_lower import ObjectLower
from kvstrata.store.prefetch import Prefetch
from kvstrata.store.promotion import Promotion
from kvstrata.store.purges import Purges
from kvstrata.store.report import store_report
from kvstrata.tiers.arena import Arena
from kvstrata.tiers.base import LowerTier, lower_tier_factory
from kvstrata.tiers.changelog import CPU
from kvstrata.tiers.disk import DiskTier
from kvstrata.tiers.object_store import ObjectTier
from kvstrata.url_credentials import redact_url

# What tests, benchmarks and the actor import from here.
__all__ = ["DEFAULT_LOWER_TIERS", "LocalStoreClient", "NodeStore"]
# The tiers below the arena, in promotion order: this node's disk, other nodes' stores
# (when a peer link is given), the bucket. A name is built by its registered factory.
DEFAULT_LOWER_TIERS = ("disk", "peer", "object")


def node_tag(node_id: str) -> str:
    """Short node tag used in shared-memory file names (simulated nodes share /dev/shm)."""
    return node_id[:12]


class NodeStore:
    """One node's store: the parts listed above, over the context built here."""

    def __init__(
        self,
        config: KvstrataConfig | Mapping[str, Any] | None,
        node_id: str,
        clock: Callable[[], float] = time.monotonic,
        executors: ExecutorFactory = thread_pools,
        *,
        peers: PeerLink | None = None,
        lower: Sequence[str | LowerTier] | None = None,
    ):
        """`peers`: the link to other nodes' stores (actors/peers.py), None on one node.
        `lower`: the tiers below the arena in promotion order, by registered name
        (tiers/base.py) or built; default `DEFAULT_LOWER_TIERS`, each where the config
        enables it."""
        config = load_config(config)
        cpu = config.tiers.cpu
        arena = Arena(
            shm_dir=cpu.shm_dir,
            node_tag=node_tag(node_id),
            capacity=cpu.capacity,
            segment_size=cpu.segment_size,
            lease_seconds=config.engine.lease_seconds,
            eviction_policy=cpu.eviction_policy,
            prefault=cpu.prefault,
            clock=clock,
            quotas=config.tier_quotas("cpu"),
        )
        ctx = self.ctx = StoreContext(config, node_id, clock, executors, arena, ChunkAudit() if cpu.audit_chunks else None)
        ctx.counters.update(
            {
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
        )
        # The tiers below the arena. The parts are handed this list; `attach_peers` adds
        # the peer tier to it in place (tests attach one to a built store).
        self.tiers: list[LowerTier] = []
        for entry in DEFAULT_LOWER_TIERS if lower is None else lower:
            if entry == "peer":
                if peers is not None:
                    self.tiers.append(PeerLower(ctx, peers, executors("peer", 2)))
                continue
            tier = lower_tier_factory(entry)(ctx) if isinstance(entry, str) else entry
            if tier is not None:
                self.tiers.append(tier)
        # The parts, each handed what it uses; listeners replace calls up a hierarchy.
        self.purges = Purges(ctx, self.tiers)
        self.admission = ReuseAdmission(ctx, self.tiers, retained=lambda ns, key: self.hints.retention_priority(ns, key) > 0)
        self.cascade = Cascade(ctx, self.admission, self.tiers)
        self.promotion = Promotion(ctx, self.tiers)
        self.prefetcher = Prefetch(ctx, self.promotion)  # listens to landed promotions
        self.hints = Hints(ctx, self.prefetcher, self.tiers)
        self.purges.on_purge.append(self.hints.forget)
        self.index = ObjectIndex(ctx, self.tiers)
        self.control = StoreControl(
            ctx,
            tiers=self.tiers,
            purges=self.purges,
            admission=self.admission,
            cascade=self.cascade,
            promotion=self.promotion,
            hints=self.hints,
            index=self.index,
        )
        if self.admission.estimate is not None:  # admission.store: reuse keeps a sketch: evict one-offs first
            for tier in self.tiers:
                tier.set_eviction_hints(reuse_of=self.admission.estimate)
        logger.info(
            "kvstrata node store up on node %s (pid %d, epoch %s, cpu capacity %d bytes, disk %s, object %s, peers %s)",
            node_id,
            os.getpid(),
            arena.epoch,
            cpu.capacity,
            config.tiers.disk.path if self.disk else "off",
            redact_url(config.tiers.object.url) if self.object else "off",
            "on" if peers is not None else "off",
        )

    # --- the calls engines, routers and other stores make (control.py, prefetch.py, hints.py)

    def ping(self) -> str:
        return self.control.ping()

    def register(
        self,
        holder: str,
        namespace: str,
        slot_bytes: int,
        layout: Mapping[str, object] | None = None,
        watch: bool = False,
        epoch: str = "",
        nonce: str = "",
    ) -> Registration:
        return self.control.register(holder, namespace, slot_bytes, layout, watch, epoch, nonce)

    def step(self, request: StepRequest) -> StepReply:
        return self.control.step(request)

    def release_holder(self, holder: str, epoch: str) -> None:
        self.control.release_holder(holder, epoch)

    def export_chunks(self, namespace: str, keys: list[bytes]) -> tuple[list[bytes], list[bytes], list[Any]]:
        return self.control.export_chunks(namespace, keys)

    def prefetch(
        self, namespace: str, keys: Sequence[bytes], deadline_s: float = 0.0, lease_s: float | None = None
    ) -> dict[str, int]:
        return self.prefetcher.prefetch(namespace, keys, deadline_s, lease_s)

    def prefetch_pending(self, namespace: str) -> int:
        return self.prefetcher.prefetch_pending(namespace)

    def prefetch_holds(self, namespace: str) -> dict[bytes, float]:
        return self.prefetcher.prefetch_holds(namespace)

    def retain(self, namespace: str, keys: Sequence[bytes], priority: int, ttl_s: float) -> dict[str, int]:
        return self.hints.retain(namespace, keys, priority, ttl_s)

    def pin_chunks(self, namespace: str, keys: Sequence[bytes], owner: str = OPERATOR) -> dict[str, int]:
        return self.hints.pin_chunks(namespace, keys, owner)

    def unpin_chunks(self, namespace: str, keys: Sequence[bytes], owner: str = OPERATOR) -> int:
        return self.hints.unpin_chunks(namespace, keys, owner)

    def apply_hints(self, namespace: str, actions: Sequence[HintAction | Mapping[str, Any]]) -> list[dict[str, Any]]:
        return self.hints.apply_hints(namespace, actions)

    def retention_priority(self, namespace: str, key: bytes) -> int:
        return self.hints.retention_priority(namespace, key)

    # --- what tools, reports and tests read -----------------------------------------------

    config = property(lambda self: self.ctx.config)
    node_id = property(lambda self: self.ctx.node_id)
    arena = property(lambda self: self.ctx.arena)
    counters = property(lambda self: self.ctx.counters)
    layouts = property(lambda self: self.ctx.layouts)
    io_meter = property(lambda self: self.ctx.io_meter)
    audit = property(lambda self: self.ctx.audit)
    tier_estimates = property(lambda self: self.ctx.tier_estimates)
    disk_error = property(lambda self: self.ctx.tier_errors.get("disk"))

    def tier(self, name: str) -> LowerTier | None:
        """The lower tier of that name, if this store has it."""
        return next((tier for tier in self.tiers if tier.name == name), None)

    @property
    def disk(self) -> DiskTier | None:
        tier = self.tier("disk")
        return tier.tier if isinstance(tier, DiskLower) else None

    @property
    def object(self) -> ObjectTier | None:
        tier = self.tier("object")
        return tier.tier if isinstance(tier, ObjectLower) else None

    @property
    def peers(self) -> PeerLink | None:
        tier = self.tier("peer")
        return tier.link if isinstance(tier, PeerLower) else None

    @peers.setter
    def peers(self, link: PeerLink | None) -> None:
        """Tests attach a peer link to a built store, and take it away (None: not closed)."""
        if link is None:
            for tier in [tier for tier in self.tiers if isinstance(tier, PeerLower)]:
                self.tiers.remove(tier)
                tier.io.shutdown(wait=True)
        else:
            self.attach_peers(link, self.ctx.executors("peer", 2))

    def attach_peers(self, link: PeerLink, io: Executor) -> None:
        """Add the peer tier (its link and pool) in promotion order: after this node's own
        tiers, before the shared ones."""
        with self.ctx.lock:
            self.tiers[:] = [tier for tier in self.tiers if tier.name != "peer"]
            where = next((i for i, tier in enumerate(self.tiers) if tier.shared), len(self.tiers))
            self.tiers.insert(where, PeerLower(self.ctx, link, io))

    # The simulation (kvstrata/_dev/sim) drives these seams of a built store.
    _lock = property(lambda self: self.ctx.lock)
    _holders = property(lambda self: self.control.holders)
    _io = property(lambda self: self._pool_of("disk"))
    _object_io = property(lambda self: self._pool_of("object"))

    def _pool_of(self, name: str) -> Executor | None:
        tier = self.tier(name)
        return getattr(tier, "io", None)

    def _expire(self) -> None:
        self.control.expire()

    # --- tools and tests (never on an engine's hot path) --------------------------------

    def serving(self) -> AbstractContextManager[None]:
        """Around a call that may stall the store: its time is given back to leases (control.py)."""
        return self.control.serving()

    def read(self, namespace: str, key: bytes) -> bytes | None:
        """Bytes of one chunk resident in the arena."""
        with self.ctx.lock:
            pool = self.arena.pools.get(namespace)
            slot = pool.lookup(key) if pool is not None else None
            return None if slot is None else pool.view(slot).tobytes()

    def locate(self, namespace: str, key: bytes) -> tuple[str, int, int] | None:
        """(segment path, offset, length) of a chunk resident in the arena."""
        with self.ctx.lock:
            pool = self.arena.pools.get(namespace)
            slot = pool.lookup(key) if pool is not None else None
            if slot is None:
                return None
            segment, offset = pool.geometry.locate(slot)
            return pool.geometry.segment_path(segment), offset, pool.geometry.slot_bytes

    def keys(self, namespace: str, medium: str = CPU) -> list[bytes]:
        """Keys of a namespace held by one tier (`CPU` arena or `STORAGE` disk)."""
        check_namespace(namespace)
        return self.ctx.log(namespace).present(medium)

    def purge(self, namespace: str | None = None) -> int:
        """Drop the chunks of one namespace (or all) from every tier; pinned ones go when unpinned.

        A namespace that is not valid (`kvstrata.namespaces`: empty, dotted, slash-bearing,
        ...) is a ValueError naming it, before anything is removed."""
        if namespace is not None:
            check_namespace(namespace)
        with self.control.serving(), self.ctx.lock:
            namespaces = list(self.ctx.logs) if namespace is None else [namespace]
            removed = sum(self.purges.purge(ns) for ns in namespaces)
        logger.info("kvstrata node store: purged %d chunks (namespace %s)", removed, namespace or "all")
        return removed

    def stats(self) -> dict[str, object]:
        with self.ctx.lock:
            self.arena.reclaim_due_orphans()
            disk = self.tier("disk")
            disk_stats = disk.stats() if disk is not None else None
            object_tier, peer = self.tier("object"), self.tier("peer")
            return {
                "object": object_tier.stats() if object_tier is not None else None,
                "peers": peer.stats() if peer is not None else None,
                "uploads_pending": self.cascade.pending("object"),
                "node_id": self.node_id,
                "pid": os.getpid(),
                "layouts": self.layouts,
                **self.arena.stats(),
                "disk": disk_stats or ({"error": self.disk_error} if self.disk_error else None),
                "writes_pending": self.cascade.pending("disk"),
                "gc_frozen_objects": gc.get_freeze_count(),
                **self.counters,
                "audit": dict(self.audit.counters) if self.audit is not None else None,
                "lower_tiers": [tier.name for tier in self.tiers],
                "report": store_report(self, disk_stats),
            }

    def wait_io(self, timeout_s: float = 30.0) -> bool:
        """Wait until no copy, promotion, sweep or bucket purge is in flight (tests, tools, benchmarks)."""
        with self.ctx.io_done:
            return self.ctx.io_done.wait_for(
                lambda: not (self.cascade.busy() or self.promotion.busy() or self.index.busy() or self.purges.busy()),
                timeout_s,
            )

    def close(self) -> None:
        """Unlink the arena; disk records stay for the next store. For taking the store down on purpose."""
        for tier in self.tiers:
            tier.shutdown()
        for tier in self.tiers:
            tier.close()
        with self.ctx.lock:
            self.arena.close()
        logger.info("kvstrata node store on node %s closed", self.node_id)
