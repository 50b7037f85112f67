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
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvstrata.actors.options import node_tag
from kvstrata.actors.protocol import Registration, StepReply, StepRequest
from kvstrata.config import KvstrataConfig, load_config
from kvstrata.tiers.arena import Arena, SlotError, SlotPool
from kvstrata.tiers.changelog import CPU, STORAGE, ChangeLog
from kvstrata.tiers.disk import DiskTier, DiskTierError

logger = logging.getLogger(__name__)

# An engine's stock of free reserved slots is capped at this share of a pool: a larger
# stock evicts chunks only to keep slots empty.
MAX_RESERVED_SHARE = 4

# Internal pin holders: they hold no lease and never expire.
CASCADE = "kvstrata:cascade"
PROMOTE = "kvstrata:promote"


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
        self._lock = threading.RLock()
        self._logs: dict[str, ChangeLog] = {}
        self.layouts: dict[str, dict[str, object]] = {}
        self.counters = {
            "promotions": 0,
            "promotion_failures": 0,
            "disk_writes_queued": 0,
            "disk_writes_dropped": 0,
        }
        self._promoting: set[tuple[str, bytes]] = set()
        self._writes_pending = 0
        self.disk: DiskTier | None = None
        self.disk_error: str | None = None
        self._io: ThreadPoolExecutor | None = None
        self._open_disk()
        logger.info(
            "kvstrata node store up on node %s (pid %d, epoch %s, cpu capacity %d bytes, disk %s)",
            node_id,
            os.getpid(),
            self.arena.epoch,
            cpu.capacity,
            self.config.tiers.disk.path if self.disk else "off",
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
                on_change=lambda namespace, key, present: self._log(namespace).record(key, STORAGE, present),
            )
        except DiskTierError as exc:
            # The engine keeps serving from the arena; the operator sees why in the log and stats.
            self.disk_error = str(exc)
            logger.error("kvstrata node store: disk tier disabled: %s", exc)
            return
        for namespace in self.disk.namespaces():
            for key in self.disk.keys(namespace):
                self._log(namespace).record(key, STORAGE, True)
        self._io = ThreadPoolExecutor(disk.io_threads, thread_name_prefix="kvstrata-disk")

    # --- engine calls ------------------------------------------------------------------

    def ping(self) -> str:
        return self.arena.epoch

    def register(
        self, holder: str, namespace: str, slot_bytes: int, layout: Mapping[str, object] | None = None
    ) -> Registration:
        """Open (or create) the pool of a namespace for an engine and start its lease."""
        with self._lock:
            self.arena.expire()
            pool = self._pool(namespace, slot_bytes)
            if layout is not None:
                self.layouts.setdefault(namespace, dict(layout))
            self.arena.renew(holder)
            seq, changes = self._log(namespace).snapshot()
            return Registration(
                epoch=self.arena.epoch, node_id=self.node_id, geometry=pool.geometry, seq=seq, changes=changes
            )

    def step(self, request: StepRequest) -> StepReply:
        """Apply one (merged) control batch of an engine and answer it."""
        with self._lock:
            self.arena.expire()
            pool = self.arena.pools.get(request.namespace)
            if pool is None or (request.epoch and request.epoch != self.arena.epoch):
                # A restarted store forgot the namespace; the new epoch tells the engine to
                # register again and drop what it believed.
                return StepReply(epoch=self.arena.epoch, seq=0, rejected=[f"unknown namespace {request.namespace}"])
            namespace = request.namespace
            self.arena.renew(request.holder)
            rejected: list[str] = []
            if request.purge:
                self._purge(namespace)
            cascade: list[tuple[bytes, int]] = []
            for slot, key in request.commit:
                try:
                    if pool.commit(request.holder, slot, key) and self._write_through:
                        cascade.append((key, pool.pin(CASCADE, [key])[key]))
                except SlotError as exc:
                    rejected.append(str(exc))
            if cascade:
                self._queue_writes(namespace, pool, cascade)
            pool.release(request.holder, request.release)
            pool.unpin(request.holder, request.unpin)
            pool.touch(request.touch)
            pinned = pool.pin(request.holder, request.pin)
            missing: list[bytes] = []
            pending: list[bytes] = []
            promotions: list[tuple[bytes, int]] = []
            for key in request.pin:
                if key not in pinned:
                    (pending if self._promote(namespace, pool, key, promotions) else missing).append(key)
            self._submit_batches(self._promote_job, namespace, pool, promotions)
            reserve_cap = max(1, pool.max_slots // MAX_RESERVED_SHARE)
            # The engine keeps its stock at or under the cap; slots it is still writing
            # are not counted, so a busy engine's refill is never refused.
            reserved = pool.reserve(request.holder, min(request.reserve, reserve_cap)) if request.reserve else []
            if rejected:
                logger.warning(
                    "kvstrata node store: rejected %d commits of %s: %s", len(rejected), request.holder, rejected[0]
                )
            log = self._log(namespace)
            since = log.since(request.known_seq)
            snapshot = since is None
            seq, changes = log.snapshot() if since is None else since
            return StepReply(
                epoch=self.arena.epoch,
                seq=seq,
                pinned=pinned,
                missing=missing,
                pending=pending,
                reserved=reserved,
                reserve_cap=reserve_cap,
                changes=changes,
                snapshot=snapshot,
                rejected=rejected,
            )

    def release_holder(self, holder: str) -> None:
        """An engine shutting down cleanly returns its pins and reservations at once."""
        with self._lock:
            self.arena.release_holder(holder)

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
        return self._log(namespace).present(medium)

    def purge(self, namespace: str | None = None) -> int:
        """Drop the chunks of one namespace (or all) from every tier; pinned ones go when unpinned."""
        with self._lock:
            namespaces = list(self._logs) if namespace is None else [namespace]
            removed = sum(self._purge(ns) for ns in namespaces)
        logger.info("kvstrata node store: purged %d chunks (namespace %s)", removed, namespace or "all")
        return removed

    def stats(self) -> dict[str, object]:
        with self._lock:
            disk = self.disk.stats() if self.disk else {"error": self.disk_error} if self.disk_error else None
            return {
                "node_id": self.node_id,
                "pid": os.getpid(),
                "layouts": self.layouts,
                **self.arena.stats(),
                "disk": disk,
                "writes_pending": self._writes_pending,
                **self.counters,
            }

    def wait_io(self, timeout_s: float = 30.0) -> bool:
        """Wait until no disk write or promotion is in flight (tests, tools, benchmarks)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if not self._writes_pending and not self._promoting:
                    return True
            time.sleep(0.005)
        return False

    def close(self) -> None:
        """Unlink the arena; disk records stay for the next store. For taking the store down on purpose."""
        if self._io is not None:
            self._io.shutdown(wait=True)
        with self._lock:
            self.arena.close()
            if self.disk is not None:
                self.disk.close()
        logger.info("kvstrata node store on node %s closed", self.node_id)

    # --- internals -----------------------------------------------------------------------

    @property
    def _write_through(self) -> bool:
        return self.disk is not None and self.config.tiers.disk.write_policy == "write_through"

    def _log(self, namespace: str) -> ChangeLog:
        log = self._logs.get(namespace)
        if log is None:
            log = self._logs.setdefault(namespace, ChangeLog())
        return log

    def _pool(self, namespace: str, slot_bytes: int) -> SlotPool:
        known = namespace in self.arena.pools
        pool = self.arena.pool(namespace, slot_bytes)
        if not known:
            log = self._log(namespace)
            pool.on_change = lambda key, present: log.record(key, CPU, present)
            if self.disk is not None and self.config.tiers.disk.write_policy == "write_back":
                pool.on_evict = lambda key, slot: self._write_back(namespace, pool, key, slot)
        return pool

    def _purge(self, namespace: str) -> int:
        pool = self.arena.pools.get(namespace)
        removed = pool.purge() if pool is not None else 0
        if self.disk is not None:
            removed += sum(self.disk.remove(namespace, key) for key in self.disk.keys(namespace))
        return removed

    def _write_back(self, namespace: str, pool: SlotPool, key: bytes, slot: int) -> str | None:
        """Eviction hook: keep the evicted bytes pinned until they are on disk."""
        # If accepted, the pool pins the slot for CASCADE as soon as we return; the write
        # job's unpin waits for the store lock this call runs under, so it comes after.
        return CASCADE if self._queue_writes(namespace, pool, [(key, slot)]) else None

    def _queue_writes(self, namespace: str, pool: SlotPool, items: list[tuple[bytes, int]]) -> int:
        """Queue disk writes of slots the cascade pins, in up to `io_threads` batches.

        Items beyond the queue depth (or already on disk) are dropped and unpinned; the
        rest are written by batch jobs that unpin them when done. Returns how many were queued.
        """
        disk_config = self.config.tiers.disk
        accepted: list[tuple[bytes, int]] = []
        for key, slot in items:
            if self.disk.contains(namespace, key):
                pool.unpin(CASCADE, [slot])
            elif self._writes_pending + len(accepted) >= disk_config.queue_depth:
                self.counters["disk_writes_dropped"] += 1
                pool.unpin(CASCADE, [slot])
            else:
                accepted.append((key, slot))
        self._writes_pending += len(accepted)
        self.counters["disk_writes_queued"] += len(accepted)
        # Consecutive commits tend to get neighbouring disk records: one pwritev per run.
        self._submit_batches(self._write_job, namespace, pool, accepted)
        return len(accepted)

    def _write_job(self, namespace: str, pool: SlotPool, items: list[tuple[bytes, int]]) -> None:
        try:
            # The slots are pinned by the cascade: their bytes are stable while we write.
            self.disk.write_many(namespace, [(key, pool.view(slot)) for key, slot in items])
        except Exception:  # noqa: BLE001 - a failed cascade is a lost copy, never a dead store
            logger.exception("kvstrata node store: disk write of %d chunks failed", len(items))
        finally:
            with self._lock:
                self._writes_pending -= len(items)
                pool.unpin(CASCADE, [slot for _, slot in items])

    def _promote(self, namespace: str, pool: SlotPool, key: bytes, batch: list[tuple[bytes, int]]) -> bool:
        """Start (or join) bringing a disk chunk into the arena; False if it cannot be had."""
        if (namespace, key) in self._promoting:
            return True
        if self.disk is None or not self.disk.contains(namespace, key):
            return False
        slots = pool.reserve(PROMOTE, 1)
        if not slots:
            return False  # every slot is pinned: a miss now beats an engine waiting on us
        self._promoting.add((namespace, key))
        batch.append((key, slots[0]))
        return True

    def _submit_batches(self, job: Callable, namespace: str, pool: SlotPool, items: list[tuple[bytes, int]]) -> None:
        """Split I/O into up to `io_threads` contiguous batches (neighbouring records share a call)."""
        batches = min(self.config.tiers.disk.io_threads, len(items)) if items else 0
        size = -(-len(items) // batches) if batches else 0
        for b in range(batches):
            self._io.submit(job, namespace, pool, items[b * size : (b + 1) * size])

    def _promote_job(self, namespace: str, pool: SlotPool, items: list[tuple[bytes, int]]) -> None:
        try:
            ok = self.disk.read_many(namespace, [(key, pool.view(slot)) for key, slot in items])
        except Exception:  # noqa: BLE001
            logger.exception("kvstrata node store: promotion of %d chunks failed", len(items))
            ok = [False] * len(items)
        with self._lock:
            for (key, slot), promoted in zip(items, ok):
                self._promoting.discard((namespace, key))
                if promoted:
                    pool.commit(PROMOTE, slot, key)
                    pool.unpin(PROMOTE, [slot])
                    self.counters["promotions"] += 1
                else:
                    pool.release(PROMOTE, [slot])
                    self.counters["promotion_failures"] += 1


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
