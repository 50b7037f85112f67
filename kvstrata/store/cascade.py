"""The node store's cascade: copies of arena chunks to the disk and to the object store.

A committed chunk is written to disk and uploaded in the background when the tier's
policy is `write_through`, or when the arena evicts it under `write_back`. The slot stays
pinned by the copy (holder `CASCADE` for disk, `UPLOAD` for the object store) until the
copy is done. A full queue drops the copy (counted), never blocks. With
`admission.store: reuse` a tier gets only chunks used often enough (admission.py).

Owns: the holders `CASCADE` and `UPLOAD`, the counts of copies in flight
(`_writes_pending`, `_uploads_pending`), the tiers' write policies, and the arena's
eviction hook (`_attach_write_back`).
Invariants: every slot a copy pins is unpinned exactly once, by its job or at once when
the copy is dropped; a job's unpin takes the store lock, so it comes after the pin taken
when the eviction hook returns. Records OBJECT presence only for uploads that landed, and
only if their namespace was not purged since they were queued; a copy queued before a
purge writes nothing to disk (purge.py). A namespace kept to its node
(registration_check.py) is never uploaded.
Must not: read from the tiers into the arena (promotion.py) or decide what the object
store holds beyond its own uploads (object_index.py).
"""

from __future__ import annotations

import time
from functools import partial

from kvstrata.store.admission import ReuseAdmission
from kvstrata.store.disk_jobs import submit_disk_jobs
from kvstrata.store.purges import Purge
from kvstrata.store.registration_check import shared_across_nodes
from kvstrata.store.context import logger
from kvstrata.tiers.arena import SlotPool
from kvstrata.tiers.changelog import OBJECT

# Internal pin holders: they hold no lease and never expire.
CASCADE = "kvstrata:cascade"
UPLOAD = "kvstrata:upload"


class Cascade(ReuseAdmission, Purge):
    """Mixin of `NodeStore`: disk writes and object uploads of arena chunks."""

    def _init_cascade(self) -> None:
        self._uploads_pending = 0
        self._writes_pending = 0
        self._init_admission()

    @property
    def _write_through(self) -> bool:
        return self.disk is not None and self.config.tiers.disk.write_policy == "write_through"

    @property
    def _upload_through(self) -> bool:
        return self.object is not None and self.config.tiers.object.write_policy == "write_through"

    def _attach_write_back(self, namespace: str, pool: SlotPool) -> None:
        """Copy a new pool's evicted chunks to the tiers whose policy is `write_back`."""
        disk_back = self.disk is not None and self.config.tiers.disk.write_policy == "write_back"
        object_back = self.object is not None and self.config.tiers.object.write_policy == "write_back"
        if disk_back or object_back:
            pool.on_evict = lambda key, slot: self._write_back(namespace, pool, key, slot, disk_back, object_back)

    def _copy_commits(self, namespace: str, pool: SlotPool, committed: list[tuple[bytes, int]]) -> None:
        """Commit hook (under the lock): queue the `write_through` copies of committed chunks
        the tiers admit (admission.py: with `reuse`, only chunks already used enough)."""
        to_disk, to_object = self._admit_commits(namespace, committed, self._write_through, self._upload_through)
        self._copy_down(namespace, pool, to_disk, to_object)

    def _copy_reused(self, namespace: str, pool: SlotPool, keys: list[bytes]) -> None:
        """Use hook (under the lock, HITs and pins): late copies of chunks that just became reused."""
        to_disk, to_object = self._note_reuse(namespace, pool, keys, self._write_through, self._upload_through)
        self._copy_down(namespace, pool, to_disk, to_object)

    def _copy_down(
        self, namespace: str, pool: SlotPool, to_disk: list[tuple[bytes, int]], to_object: list[tuple[bytes, int]]
    ) -> None:
        if to_disk:
            pool.pin_slots(CASCADE, [slot for _, slot in to_disk])
            self._queue_writes(namespace, pool, to_disk)
        if to_object:
            pool.pin_slots(UPLOAD, [slot for _, slot in to_object])
            self._queue_uploads(namespace, pool, to_object)

    def _write_back(
        self, namespace: str, pool: SlotPool, key: bytes, slot: int, to_disk: bool, to_object: bool
    ) -> list[str]:
        """Eviction hook: keep the evicted bytes pinned until they are on disk and uploaded."""
        # Each accepted copy pins the slot as soon as we return; the jobs' unpins wait for
        # the store lock this call runs under, so they come after.
        to_disk, to_object = self._admit_eviction(namespace, key, to_disk, to_object)
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
        # The disk tier writes nothing if the namespace is purged before a job lands (purge.py).
        job = partial(self._write_job, generation=self.disk.generation(namespace))
        submit_disk_jobs(self._io, disk_config.io_threads, job, namespace, pool, accepted)
        return len(accepted)

    def _write_job(self, namespace: str, pool: SlotPool, items: list[tuple[bytes, int]], generation: int) -> None:
        started = time.perf_counter()
        try:
            # The slots are pinned by the cascade: their bytes are stable while we write.
            chunks = [(key, pool.view(slot)) for key, slot in items]
            written = sum(self.disk.write_many(namespace, chunks, generation=generation))
            self.io_meter.record("disk", "write", written * pool.geometry.slot_bytes, written, time.perf_counter() - started)
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
        """Queue uploads of slots pinned for UPLOAD; the same drop-never-block rule as disk writes.
        A namespace kept to this node (registration_check.py: a non-cryptographic block hash)
        uploads nothing."""
        if not shared_across_nodes(self.layouts.get(namespace)):
            if pinned:
                pool.unpin(UPLOAD, [slot for _, slot in items])
            return 0
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
            generation = self._generation(namespace)
            self._upload_queued(namespace, generation)  # a purge of the bucket waits for it (purge.py)
            self._object_io.submit(self._upload_job, namespace, pool, accepted, generation)
        return len(accepted)

    def _upload_job(self, namespace: str, pool: SlotPool, items: list[tuple[bytes, int]], generation: int) -> None:
        """Upload a batch and record what landed, unless its namespace was purged since it
        was queued (then the bucket's purge, which waits for this job, deletes it)."""
        started = time.perf_counter()
        ok = [False] * len(items)
        with self._lock:
            purged = self._purged_since(namespace, generation)
        try:
            if not purged:
                ok = self.object.put_many(namespace, [(key, pool.view(slot)) for key, slot in items])
        except Exception:  # noqa: BLE001 - a failed upload is a lost copy, never a dead store
            logger.exception("kvstrata node store: upload of %d chunks failed", len(items))
        self.io_meter.record("object", "write", sum(ok) * pool.geometry.slot_bytes, sum(ok), time.perf_counter() - started)
        with self._lock:
            if self._purged_since(namespace, generation):
                self.counters["object_uploads_purged"] += len(items)
            else:
                self._log(namespace).record_many([key for (key, _), uploaded in zip(items, ok) if uploaded], OBJECT, True)
            self._uploads_pending -= len(items)
            pool.unpin(UPLOAD, [slot for _, slot in items])
            self._upload_ended(namespace, generation)
            self._io_done.notify_all()
