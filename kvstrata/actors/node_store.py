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
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from kvstrata.actors.directory import directory_shard
from kvstrata.actors.disk_jobs import submit_disk_jobs
from kvstrata.actors.options import node_tag
from kvstrata.actors.peers import PeerSync
from kvstrata.actors.protocol import Registration, StepReply, StepRequest
from kvstrata.config import KvstrataConfig, load_config
from kvstrata.tiers.arena import Arena, SlotPool
from kvstrata.tiers.changelog import CPU, OBJECT, PEER, STORAGE, ChangeLog
from kvstrata.tiers.disk import DiskTier, DiskTierError
from kvstrata.tiers.object_store import ObjectTier
from kvstrata.tiers.records import chunk_digest

logger = logging.getLogger(__name__)

# An engine's stock of free reserved slots is capped at this share of a pool: a larger
# stock evicts chunks only to keep slots empty.
MAX_RESERVED_SHARE = 4

# Internal pin holders: they hold no lease and never expire.
CASCADE = "kvstrata:cascade"
UPLOAD = "kvstrata:upload"
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
            "object_uploads_queued": 0,
            "object_uploads_dropped": 0,
            "object_promotions": 0,
            "engine_pins": 0,  # chunks pinned for engines to load: what kvstrata served
            "peer_promotions": 0,  # chunks brought from another node's store
            "chunks_exported": 0,  # chunks handed to another node's store
        }
        self._uploads_pending = 0
        self._scanned_at = float("-inf")  # when the last sweep of the object store started
        self._scanned: set[str] = set()  # namespaces the last complete sweep covered
        self._swept: set[str] = set()  # namespaces some sweep has finished with (listed or failed)
        self._scanning = False
        self._clock = clock
        self._promoting: set[tuple[str, bytes]] = set()
        self._writes_pending = 0
        # Notified whenever I/O in flight ends, so `wait_io` returns the moment the last
        # job does (polling added up to a poll interval to every measurement).
        self._io_done = threading.Condition(self._lock)
        self.disk: DiskTier | None = None
        self.disk_error: str | None = None
        self._io: ThreadPoolExecutor | None = None
        self._open_disk()
        self.object: ObjectTier | None = None
        self._object_io: ThreadPoolExecutor | None = None
        if self.config.tiers.object is not None:
            self.object = ObjectTier(self.config.tiers.object, clock=clock)
            # Batches queue here; each fans out over the tier's own max_concurrency threads.
            self._object_io = ThreadPoolExecutor(2, thread_name_prefix="kvstrata-object-jobs")
        self.peers: PeerSync | None = None
        self._peer_io: ThreadPoolExecutor | None = None
        if self.config.cluster is not None and _in_ray():
            self.peers = PeerSync(node_id, self.config.cluster, lambda: dict(self._logs), directory_shard).start()
            self._peer_io = ThreadPoolExecutor(2, thread_name_prefix="kvstrata-peer-fetch")
        if _in_ray_actor():
            freeze_startup_heap()
        logger.info(
            "kvstrata node store up on node %s (pid %d, epoch %s, cpu capacity %d bytes, disk %s, object %s, peers %s)",
            node_id,
            os.getpid(),
            self.arena.epoch,
            cpu.capacity,
            self.config.tiers.disk.path if self.disk else "off",
            self.config.tiers.object.url if self.object else "off",
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
            )
        except DiskTierError as exc:
            # The engine keeps serving from the arena; the operator sees why in the log and stats.
            self.disk_error = str(exc)
            logger.error("kvstrata node store: disk tier disabled: %s", exc)
            return
        for namespace in self.disk.namespaces():
            self._log(namespace).record_many(self.disk.keys(namespace), STORAGE, True)
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
            anchors = (layout or {}).get("anchor_groups")
            pool.positions.set_anchor_groups(anchors)
            if self.disk is not None:
                self.disk.set_anchor_groups(namespace, anchors)
            if self.object is not None:
                self.object.set_anchor_groups(namespace, anchors)
            if layout is not None and namespace not in self.layouts:
                self.layouts[namespace] = dict(layout)
                if self.object is not None:
                    self._object_io.submit(self.object.write_manifest, namespace, dict(layout))
            self._refresh_object_index(namespace)
            self.arena.renew(holder)
            seq, changes = self._log(namespace).snapshot()
            return Registration(
                epoch=self.arena.epoch,
                node_id=self.node_id,
                geometry=pool.geometry,
                seq=seq,
                changes=changes,
                indexed=self._indexed(namespace),
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
            if request.purge:
                self._purge(namespace)
            committed, rejected = pool.commit_many(request.holder, request.commit)
            if committed and self._write_through:
                pool.pin_slots(CASCADE, [slot for _, slot in committed])
                self._queue_writes(namespace, pool, committed)
            if committed and self._upload_through:
                pool.pin_slots(UPLOAD, [slot for _, slot in committed])
                self._queue_uploads(namespace, pool, committed)
            self._refresh_object_index(namespace)
            pool.release(request.holder, request.release)
            pool.unpin(request.holder, request.unpin)
            pool.touch(request.touch)
            pinned = pool.pin(request.holder, request.pin)
            self.counters["engine_pins"] += len(pinned)
            promoting = self._promote(namespace, pool, [key for key in request.pin if key not in pinned])
            pending = [key for key in request.pin if promoting.get(key)]
            missing = [key for key in request.pin if promoting.get(key) is False]
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
                indexed=self._indexed(namespace),
            )

    def export_chunks(self, namespace: str, keys: list[bytes]) -> tuple[list[bytes], list[bytes], list[np.ndarray]]:
        """Chunks another node's store asked for: (keys found, their xxh3-128, their bytes).

        From the arena, else the disk (verified on read); absent ones are left out. Arena
        chunks go out as views of their slots: Ray copies them into its object store when
        this call returns, before this (single-threaded) actor runs another call, and no
        background thread writes a committed slot -- the one copy on this side. The
        receiver verifies every chunk against its digest anyway.
        """
        found: list[bytes] = []
        chunks: list[np.ndarray] = []
        from_disk: list[bytes] = []
        with self._lock:
            pool = self.arena.pools.get(namespace)
            if pool is None:
                return [], [], []
            elsewhere: list[bytes] = []
            for key in keys:
                slot = pool.lookup(key)
                if slot is not None:
                    found.append(key)
                    chunks.append(pool.view(slot))
                else:
                    elsewhere.append(key)
            if self.disk is not None and elsewhere:
                on_disk = self.disk.present(namespace, elsewhere)
                from_disk = [key for key in elsewhere if key in on_disk]
            slot_bytes = pool.geometry.slot_bytes
        if from_disk:
            buffers = [np.empty(slot_bytes, dtype=np.uint8) for _ in from_disk]
            read = self.disk.read_many(namespace, list(zip(from_disk, buffers)))
            for key, buffer, ok in zip(from_disk, buffers, read):
                if ok:
                    found.append(key)
                    chunks.append(buffer)
        digests = [chunk_digest(namespace, key, chunk) for key, chunk in zip(found, chunks)]
        with self._lock:
            self.counters["chunks_exported"] += len(found)
        return found, digests, chunks

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
            }

    def wait_io(self, timeout_s: float = 30.0) -> bool:
        """Wait until no disk write or promotion is in flight (tests, tools, benchmarks)."""
        with self._io_done:
            return self._io_done.wait_for(
                lambda: not (self._writes_pending or self._promoting or self._uploads_pending or self._scanning),
                timeout_s,
            )

    def close(self) -> None:
        """Unlink the arena; disk records stay for the next store. For taking the store down on purpose."""
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

    # --- internals -----------------------------------------------------------------------

    @property
    def _write_through(self) -> bool:
        return self.disk is not None and self.config.tiers.disk.write_policy == "write_through"

    @property
    def _upload_through(self) -> bool:
        return self.object is not None and self.config.tiers.object.write_policy == "write_through"

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
            pool.on_change = lambda keys, present: log.record_many(keys, CPU, present)
            disk_back = self.disk is not None and self.config.tiers.disk.write_policy == "write_back"
            object_back = self.object is not None and self.config.tiers.object.write_policy == "write_back"
            if disk_back or object_back:
                pool.on_evict = lambda key, slot: self._write_back(namespace, pool, key, slot, disk_back, object_back)
        return pool

    def _purge(self, namespace: str) -> int:
        pool = self.arena.pools.get(namespace)
        removed = pool.purge() if pool is not None else 0
        if self.disk is not None:
            removed += sum(self.disk.remove(namespace, key) for key in self.disk.keys(namespace))
        if self.object is not None:
            log = self._log(namespace)
            for key in log.present(OBJECT):
                log.record(key, OBJECT, False)
            self._object_io.submit(self.object.purge, namespace)
        return removed

    def _write_back(
        self, namespace: str, pool: SlotPool, key: bytes, slot: int, to_disk: bool, to_object: bool
    ) -> list[str]:
        """Eviction hook: keep the evicted bytes pinned until they are on disk and uploaded."""
        # Each accepted copy pins the slot as soon as we return; the jobs' unpins wait for
        # the store lock this call runs under, so they come after.
        keepers = []
        if to_disk and self._queue_writes(namespace, pool, [(key, slot)], pinned=False):
            keepers.append(CASCADE)
        if to_object and self._queue_uploads(namespace, pool, [(key, slot)], pinned=False):
            keepers.append(UPLOAD)
        return keepers

    def _queue_writes(
        self, namespace: str, pool: SlotPool, items: list[tuple[bytes, int]], pinned: bool = True
    ) -> int:
        """Queue disk writes of slots the cascade pins, in up to `io_threads` batches.

        Items beyond the queue depth (or already on disk) are dropped and unpinned; the
        rest are written by batch jobs that unpin them when done. Returns how many were queued.
        """
        disk_config = self.config.tiers.disk
        accepted: list[tuple[bytes, int]] = []
        on_disk = self.disk.present(namespace, [key for key, _ in items])
        for key, slot in items:
            if key in on_disk:
                pass
            elif self._writes_pending + len(accepted) >= disk_config.queue_depth:
                self.counters["disk_writes_dropped"] += 1
            else:
                accepted.append((key, slot))
                continue
            if pinned:
                pool.unpin(CASCADE, [slot])
        self._writes_pending += len(accepted)
        self.counters["disk_writes_queued"] += len(accepted)
        # Consecutive commits tend to get neighbouring disk records: one pwritev per run.
        submit_disk_jobs(self._io, disk_config.io_threads, self._write_job, namespace, pool, accepted)
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
                self._io_done.notify_all()

    def _queue_uploads(
        self, namespace: str, pool: SlotPool, items: list[tuple[bytes, int]], pinned: bool = True
    ) -> int:
        """Queue uploads of slots pinned for UPLOAD; the same drop-never-block rule as disk writes."""
        log = self._log(namespace)
        accepted: list[tuple[bytes, int]] = []
        for key, slot in items:
            if log.has(key, OBJECT):
                pass  # another node (or an earlier life of this chunk) put it there
            elif not self.object.available() or (
                self._uploads_pending + len(accepted) >= self.config.tiers.object.queue_depth
            ):
                self.counters["object_uploads_dropped"] += 1
            else:
                accepted.append((key, slot))
                continue
            if pinned:
                pool.unpin(UPLOAD, [slot])
        if accepted:
            self._uploads_pending += len(accepted)
            self.counters["object_uploads_queued"] += len(accepted)
            self._object_io.submit(self._upload_job, namespace, pool, accepted)
        return len(accepted)

    def _upload_job(self, namespace: str, pool: SlotPool, items: list[tuple[bytes, int]]) -> None:
        try:
            ok = self.object.put_many(namespace, [(key, pool.view(slot)) for key, slot in items])
        except Exception:  # noqa: BLE001 - a failed upload is a lost copy, never a dead store
            logger.exception("kvstrata node store: upload of %d chunks failed", len(items))
            ok = [False] * len(items)
        log = self._log(namespace)
        for (key, _), uploaded in zip(items, ok):
            if uploaded:
                log.record(key, OBJECT, True)
        with self._lock:
            self._uploads_pending -= len(items)
            pool.unpin(UPLOAD, [slot for _, slot in items])
            self._io_done.notify_all()

    def _refresh_object_index(self, namespace: str) -> None:
        """Sweep the bucket now and then: learn what other nodes stored, keep capacity and TTL.

        A namespace no sweep has covered yet (a new engine) gets one at once.
        """
        if self.object is None or self._scanning:
            return
        now = self._clock()
        if namespace in self._scanned and now - self._scanned_at < self.config.tiers.object.index_refresh_seconds:
            return
        self._log(namespace)  # the sweep covers every namespace with a log
        self._scanning = True
        self._scanned_at = now
        self._object_io.submit(self._scan_job)

    def _scan_job(self) -> None:
        with self._lock:
            # Snapshot before listing: an upload that lands meanwhile is not "gone".
            before = {namespace: set(log.present(OBJECT)) for namespace, log in self._logs.items()}
        try:
            entries = self.object.scan()
            if entries is not None:
                entries = self.object.apply_limits(entries)
        except Exception:  # noqa: BLE001
            logger.exception("kvstrata node store: sweeping the object store failed")
            entries = None
        if entries is not None:
            listed: dict[str, set[bytes]] = {namespace: set() for namespace in before}
            for entry in entries:
                if entry.namespace in listed:
                    listed[entry.namespace].add(entry.key)
            for namespace, keys in listed.items():
                log = self._log(namespace)
                for key in keys - before[namespace]:
                    log.record(key, OBJECT, True)
                for key in before[namespace] - keys:  # gone: swept, purged, a bucket lifecycle rule
                    log.record(key, OBJECT, False)
        with self._lock:
            if entries is not None:
                self._scanned = set(before)
            # A failed listing counts too: waiting longer would not tell the engines more.
            self._swept.update(before)
            self._scanning = False
            self._io_done.notify_all()

    def _indexed(self, namespace: str) -> bool:
        """Whether this store's view of the namespace covers the object store (callers hold the lock)."""
        return self.object is None or namespace in self._swept

    def _promote(self, namespace: str, pool: SlotPool, keys: list[bytes]) -> dict[bytes, bool]:
        """Start (or join) bringing chunks into the arena: from this node's disk, else
        another node's arena or disk, else the object store.

        Per key, whether it is on its way (False: it cannot be had, the engine answers
        MISS). One lookup of the disk index and one reservation for the whole request:
        per key they cost a large request milliseconds before its first read.
        """
        on_disk = self.disk.present(namespace, keys) if self.disk is not None and keys else set()
        log = self._log(namespace)
        outcome: dict[bytes, bool] = {}
        wanted: list[tuple[bytes, list[tuple[bytes, int]]]] = []
        from_disk: list[tuple[bytes, int]] = []
        from_peer: list[tuple[bytes, int]] = []
        from_object: list[tuple[bytes, int]] = []
        for key in keys:
            if key in outcome:
                continue
            outcome[key] = True
            if (namespace, key) in self._promoting:
                continue
            if key in on_disk:
                wanted.append((key, from_disk))
            elif self.peers is not None and log.has(key, PEER) and self.peers.can_fetch(namespace, key):
                wanted.append((key, from_peer))
            elif self.object is not None and self.object.available() and log.has(key, OBJECT):
                wanted.append((key, from_object))
            else:
                outcome[key] = False
        slots = pool.reserve(PROMOTE, len(wanted)) if wanted else []
        for (key, batch), slot in zip(wanted, slots):
            self._promoting.add((namespace, key))
            batch.append((key, slot))
        for key, _ in wanted[len(slots) :]:
            # Slots held by write-backs free up in a moment: the engine asks again (its
            # wait is bounded). Every slot pinned otherwise: a miss now beats waiting on us.
            outcome[key] = pool.orphans > 0
        if from_disk:
            submit_disk_jobs(self._io, self.config.tiers.disk.io_threads, self._promote_job, namespace, pool, from_disk)
        if from_peer:
            self._peer_io.submit(self._peer_promote_job, namespace, pool, from_peer)
        if from_object:
            self._object_io.submit(self._object_promote_job, namespace, pool, from_object)
        return outcome

    def _promote_job(self, namespace: str, pool: SlotPool, items: list[tuple[bytes, int]]) -> None:
        """Read a batch; it is committed when its last piece is verified, on a digest thread,
        while this I/O thread already reads the next batch."""

        def finish(reads: Future[list[bool]] | None) -> None:
            try:
                ok = reads.result() if reads is not None else [False] * len(items)
            except Exception:  # noqa: BLE001
                logger.exception("kvstrata node store: promotion of %d chunks failed", len(items))
                ok = [False] * len(items)
            self._finish_promotions(namespace, pool, items, ok)

        try:
            reads = self.disk.start_reads(namespace, [(key, pool.view(slot)) for key, slot in items])
        except Exception:  # noqa: BLE001
            logger.exception("kvstrata node store: promotion of %d chunks failed", len(items))
            finish(None)
            return
        reads.add_done_callback(finish)

    def _peer_promote_job(self, namespace: str, pool: SlotPool, items: list[tuple[bytes, int]]) -> None:
        try:
            ok = self.peers.fetch(namespace, pool, items, self._log(namespace))
        except Exception:  # noqa: BLE001
            logger.exception("kvstrata node store: peer fetch of %d chunks failed", len(items))
            ok = [False] * len(items)
        with self._lock:
            self.counters["peer_promotions"] += sum(ok)
        self._finish_promotions(namespace, pool, items, ok)

    def _object_promote_job(self, namespace: str, pool: SlotPool, items: list[tuple[bytes, int]]) -> None:
        try:
            ok = self.object.get_many(namespace, [(key, pool.view(slot)) for key, slot in items])
        except Exception:  # noqa: BLE001
            logger.exception("kvstrata node store: download of %d chunks failed", len(items))
            ok = [False] * len(items)
        log = self._log(namespace)
        for (key, _), fetched in zip(items, ok):
            if not fetched and self.object.available():
                log.record(key, OBJECT, False)  # absent or corrupt, not just unreachable
        with self._lock:
            self.counters["object_promotions"] += sum(ok)
        self._finish_promotions(namespace, pool, items, ok)

    def _finish_promotions(
        self, namespace: str, pool: SlotPool, items: list[tuple[bytes, int]], ok: list[bool]
    ) -> None:
        promoted = [(slot, key) for (key, slot), arrived in zip(items, ok) if arrived]
        with self._lock:
            self._promoting.difference_update((namespace, key) for key, _ in items)
            _, refused = pool.commit_many(PROMOTE, promoted)
            if refused:  # a bug, not an I/O outcome: the slots stay reserved, and we say so
                logger.error("kvstrata node store: %d promotions not committed: %s", len(refused), refused[0])
            pool.unpin(PROMOTE, [slot for slot, _ in promoted])
            pool.release(PROMOTE, [slot for (_, slot), arrived in zip(items, ok) if not arrived])
            self.counters["promotions"] += len(promoted)
            self.counters["promotion_failures"] += len(items) - len(promoted)
            self._io_done.notify_all()


def freeze_startup_heap() -> None:
    """Keep the objects that exist now (modules, Ray's and the store's own set-up) out of every
    later garbage collection, as vLLM's engine core and Ray Serve's replicas do after start-up.

    Why: with Ray imported, a full collection walks ~70,000 objects and holds the GIL for
    ~50 ms; one fell inside a 2048-chunk commit, and every I/O thread waited on it. The
    store's own later objects are still collected.
    """
    gc.collect()
    gc.freeze()


def _in_ray_actor() -> bool:
    """Whether this is a Ray actor's process (the store's own), not a driver or a test."""
    import ray

    return _in_ray() and ray.get_runtime_context().get_actor_id() is not None


def _in_ray() -> bool:
    """Whether this store runs in a Ray process (the actor), not in-process in a test."""
    import ray

    return ray.is_initialized()


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
