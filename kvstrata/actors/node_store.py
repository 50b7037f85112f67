"""The node store: owner of one node's tiers, shared by every engine on the node.

It is a plain class so it can be unit-tested and benchmarked without Ray; `client`
wraps it as a named, detached, node-pinned Ray actor. Calls are serialised by Ray
(max_concurrency 1), so the tiers need no locks. Every call first expires dead
engines' leases, so a crashed engine's pins are gone by the next call after its
lease ran out.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from kvstrata.actors.options import node_tag
from kvstrata.actors.protocol import Registration, StepReply, StepRequest
from kvstrata.config import KvstrataConfig, load_config
from kvstrata.tiers.arena import Arena, SlotError

logger = logging.getLogger(__name__)


class NodeStore:
    def __init__(
        self,
        config: KvstrataConfig | Mapping[str, Any] | None,
        node_id: str,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = load_config(config)
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
        )
        self.layouts: dict[str, dict[str, object]] = {}
        logger.info(
            "kvstrata node store up on node %s (pid %d, epoch %s, cpu capacity %d bytes)",
            node_id,
            os.getpid(),
            self.arena.epoch,
            cpu.capacity,
        )

    def ping(self) -> str:
        return self.arena.epoch

    def register(
        self, holder: str, namespace: str, slot_bytes: int, layout: Mapping[str, object] | None = None
    ) -> Registration:
        """Open (or create) the pool of a namespace for an engine and start its lease."""
        self.arena.expire()
        pool = self.arena.pool(namespace, slot_bytes)
        if layout is not None:
            self.layouts.setdefault(namespace, dict(layout))
        self.arena.renew(holder)
        return Registration(
            epoch=self.arena.epoch,
            node_id=self.node_id,
            geometry=pool.geometry,
            seq=pool.seq,
            keys=pool.keys(),
        )

    def step(self, request: StepRequest) -> StepReply:
        """Apply one (merged) control batch of an engine and answer it."""
        self.arena.expire()
        pool = self.arena.pools.get(request.namespace)
        if pool is None or (request.epoch and request.epoch != self.arena.epoch):
            # A restarted store forgot the namespace; the new epoch tells the engine to
            # register again and drop what it believed.
            return StepReply(epoch=self.arena.epoch, seq=0, rejected=[f"unknown namespace {request.namespace}"])
        self.arena.renew(request.holder)
        rejected: list[str] = []
        if request.purge:
            pool.purge()
        for slot, key in request.commit:
            try:
                pool.commit(request.holder, slot, key)
            except SlotError as exc:
                rejected.append(str(exc))
        pool.release(request.holder, request.release)
        pool.unpin(request.holder, request.unpin)
        pool.touch(request.touch)
        pinned = pool.pin(request.holder, request.pin)
        missing = [key for key in request.pin if key not in pinned]
        reserved = pool.reserve(request.holder, request.reserve) if request.reserve else []
        changes = pool.changes_since(request.known_seq)
        if rejected:
            logger.warning("kvstrata node store: rejected %d commits of %s: %s", len(rejected), request.holder, rejected[0])
        if changes is None:
            return StepReply(
                epoch=self.arena.epoch,
                seq=pool.seq,
                pinned=pinned,
                missing=missing,
                reserved=reserved,
                added=pool.keys(),
                snapshot=True,
                rejected=rejected,
            )
        return StepReply(
            epoch=self.arena.epoch,
            seq=changes.seq,
            pinned=pinned,
            missing=missing,
            reserved=reserved,
            added=changes.added,
            removed=changes.removed,
            rejected=rejected,
        )

    def release_holder(self, holder: str) -> None:
        """An engine shutting down cleanly returns its pins and reservations at once."""
        self.arena.release_holder(holder)

    def read(self, namespace: str, key: bytes) -> bytes | None:
        """Bytes of one resident chunk (tools and tests; never on an engine's hot path)."""
        pool = self.arena.pools.get(namespace)
        slot = pool.lookup(key) if pool is not None else None
        return None if slot is None else pool.view(slot).tobytes()

    def locate(self, namespace: str, key: bytes) -> tuple[str, int, int] | None:
        """(segment path, offset, length) of a resident chunk, for tools and tests."""
        pool = self.arena.pools.get(namespace)
        slot = pool.lookup(key) if pool is not None else None
        if slot is None:
            return None
        segment, offset = pool.geometry.locate(slot)
        return pool.geometry.segment_path(segment), offset, pool.geometry.slot_bytes

    def keys(self, namespace: str) -> list[bytes]:
        pool = self.arena.pools.get(namespace)
        return [] if pool is None else pool.keys()

    def purge(self, namespace: str | None = None) -> int:
        """Drop the chunks of one namespace (or all); pinned ones go when unpinned."""
        pools = self.arena.pools.values() if namespace is None else [self.arena.pools.get(namespace)]
        removed = sum(pool.purge() for pool in pools if pool is not None)
        logger.info("kvstrata node store: purged %d chunks (namespace %s)", removed, namespace or "all")
        return removed

    def stats(self) -> dict[str, object]:
        return {"node_id": self.node_id, "layouts": self.layouts, **self.arena.stats()}

    def close(self) -> None:
        """Unmap and unlink every segment; called when the store is taken down on purpose."""
        self.arena.close()
        logger.info("kvstrata node store on node %s closed", self.node_id)


class LocalStoreClient:
    """A store client that calls a NodeStore in this process (tests, benchmarks).

    It has the same surface as `client.RayStoreClient`, so the manager and worker never
    know which one they hold.
    """

    def __init__(self, store: NodeStore):
        self.store = store

    def register(
        self, holder: str, namespace: str, slot_bytes: int, layout: Mapping[str, object] | None = None
    ) -> Registration:
        return self.store.register(holder, namespace, slot_bytes, layout)

    def step(self, request: StepRequest) -> StepReply:
        return self.store.step(request)

    def release_holder(self, holder: str) -> None:
        self.store.release_holder(holder)
