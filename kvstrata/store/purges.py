"""The node store's purge: a namespace leaves every tier, and so does the work in flight for it.

A purge (an engine's `reset_prefix_cache(reset_connector=True)`, `kvstrata purge`) is how
users invalidate KV, e.g. after an in-place weight update or an RL weight sync: once it
returns, no engine may be served a byte stored before it. I/O already queued for the
namespace must not bring such bytes back, so a purge starts a new *generation* of its
namespace. Every background job notes the generation when it is queued (under the store
lock) and commits nothing if it changed by the time it lands:
- a disk write (cascade.py) hands the disk tier's generation to `write_many`, which
  checks it under the tier's lock (`DiskTier.purge` bumps it);
- a promotion (promotion.py) releases its slots instead of committing them;
- an upload (cascade.py) records nothing, and the bucket's purge starts only once the
  uploads queued before it have ended, so it deletes what they put;
- a sweep (object_index.py) records nothing for a namespace purged since its snapshot, or
  whose bucket purge had not ended when it began to list.

Long purges stay off the store lock: the arena drops its index (memory only), the disk
tier unlinks the namespace's files (`DiskTier.purge`: no I/O per chunk; the last design
wiped one header per chunk under the lock, ~109 us each; the files are closed, which frees
their blocks, on the disk I/O pool), and the bucket is emptied on the object I/O pool.

Owns: `_generations`, the uploads in flight per (namespace, generation) (`_uploads_of`),
the bucket purges due (`_bucket_purges_due`) and running (`_bucket_purging`).
Invariants: a namespace's generation only grows, under the store lock; a job queued under
generation g commits only if the generation is still g, checked under the lock it commits
under; a bucket purge for generation g starts after every upload of an older generation
of its namespace has ended. After a purge's in-flight work settles, nothing of the
namespace stored before it is in the arena, on disk, in the bucket or in the change log.
Must not: do the parts' I/O itself; it calls the tiers' own purges.
"""

from __future__ import annotations

from kvstrata.store.context import StoreState, logger
from kvstrata.tiers.changelog import OBJECT


class Purge(StoreState):
    """Mixin of `NodeStore`: purging a namespace from every tier, work in flight included."""

    def _init_purge(self) -> None:
        self._generations: dict[str, int] = {}
        self._uploads_of: dict[tuple[str, int], int] = {}  # (namespace, generation) -> upload jobs in flight
        self._bucket_purges_due: dict[str, int] = {}  # namespace -> generation whose bucket purge waits on uploads
        self._bucket_purging: dict[str, int] = {}  # namespace -> bucket purge jobs queued or running
        # Work in flight that a purge kept from landing: chunks of promotions, of uploads.
        self.counters.update(promotions_purged=0, object_uploads_purged=0)

    def _generation(self, namespace: str) -> int:
        """Purges of the namespace so far (callers hold the lock)."""
        return self._generations.get(namespace, 0)

    def _purged_since(self, namespace: str, generation: int) -> bool:
        """Whether the namespace was purged after a job noted `generation` (callers hold the lock)."""
        return self._generations.get(namespace, 0) != generation

    def _purge(self, namespace: str) -> int:
        """Drop a namespace from every tier; returns the arena and disk chunks dropped (under the lock)."""
        generation = self._generations[namespace] = self._generation(namespace) + 1
        pool = self.arena.pools.get(namespace)
        removed = pool.purge() if pool is not None else 0
        self._forget_hints(namespace)  # hints.py: its prefetch holds, pins and retentions
        if self.disk is not None:
            removed += self.disk.purge(namespace)
            self._io.submit(self.disk.close_purged)  # freeing a large file's blocks takes a while
        if self.object is not None:
            log = self._log(namespace)
            log.record_many(log.present(OBJECT), OBJECT, False)
            self._bucket_purges_due[namespace] = generation
            self._start_bucket_purge(namespace)
        return removed

    def _bucket_busy(self) -> set[str]:
        """Namespaces whose bucket purge is due or running: a listing may still show their
        old objects (callers hold the lock)."""
        return set(self._bucket_purges_due) | set(self._bucket_purging)

    def _upload_queued(self, namespace: str, generation: int) -> None:
        """An upload job of the namespace was queued under `generation` (callers hold the lock)."""
        self._uploads_of[(namespace, generation)] = self._uploads_of.get((namespace, generation), 0) + 1

    def _upload_ended(self, namespace: str, generation: int) -> None:
        """An upload job ended, landed or not; a bucket purge waiting on it may start (callers hold the lock)."""
        left = self._uploads_of.pop((namespace, generation)) - 1
        if left:
            self._uploads_of[(namespace, generation)] = left
        self._start_bucket_purge(namespace)

    def _start_bucket_purge(self, namespace: str) -> None:
        """Queue the bucket purge due for the namespace once no upload queued before it is in
        flight and the object tier is not paused (callers hold the lock)."""
        due = self._bucket_purges_due.get(namespace)
        if due is None or not self.object.available():
            return
        if any(ns == namespace and generation < due for ns, generation in self._uploads_of):
            return
        del self._bucket_purges_due[namespace]
        self._bucket_purging[namespace] = self._bucket_purging.get(namespace, 0) + 1
        try:
            self._object_io.submit(self._object_purge_job, namespace, due)
        except RuntimeError:  # the store is closing: its pool takes no new job
            self._bucket_purges_due[namespace] = due
            self._ended_bucket_purge(namespace)
            logger.warning("kvstrata node store: closing before namespace %s was purged from the object store", namespace)

    def _retry_bucket_purges(self) -> None:
        """Start the bucket purges that waited for the object tier to answer again (each step; callers hold the lock)."""
        for namespace in list(self._bucket_purges_due):
            self._start_bucket_purge(namespace)

    def _object_purge_job(self, namespace: str, generation: int) -> None:
        """Empty the namespace in the bucket; if that fails, it is due again (tried once the
        tier answers), and sweeps record nothing of the namespace until it is done."""
        try:
            done = self.object.purge(namespace) is not None
        except Exception:  # noqa: BLE001 - logged; tried again
            logger.exception("kvstrata node store: purging namespace %s from the object store failed", namespace)
            done = False
        with self._lock:
            self._ended_bucket_purge(namespace)
            if not done:
                self._bucket_purges_due[namespace] = max(generation, self._bucket_purges_due.get(namespace, 0))
            self._io_done.notify_all()

    def _ended_bucket_purge(self, namespace: str) -> None:
        left = self._bucket_purging.pop(namespace) - 1
        if left:
            self._bucket_purging[namespace] = left

    def _purges_pending(self) -> bool:
        """Whether a bucket purge is due or running (`wait_io`; callers hold the lock)."""
        return bool(self._bucket_purges_due or self._bucket_purging)
