"""The object store (shared by all nodes) as the store's last lower tier, and its purges.

Adapts tiers/object_store.py's `ObjectTier` to tiers/base.py's `LowerTier` and registers it
as `object`. Beyond reads and uploads on its own pool, it owns what only the bucket needs:
- a purge of the bucket (one listing and deletion per namespace, slow) runs on the
  object pool and starts only once the uploads queued before the purge have ended, so it
  deletes what they put (an upload queued before a purge records nothing: purges.py);
- a failed bucket purge is due again, tried each step once the tier answers;
- the listing the object index sweeps (object_index.py), and which namespaces a listing
  cannot be trusted for (their bucket purge is due or running).

Owns: the object tier, its I/O pool, the uploads in flight per (namespace, generation)
(`_uploads_of`), the bucket purges due (`_purges_due`) and running (`_purging`).
Invariants (under the store lock): a bucket purge for generation g starts after every
upload of an older generation of its namespace has ended; an upload records OBJECT
presence only if its namespace was not purged since it was queued; OBJECT absence is
recorded only when the bucket answered (absent or corrupt, not unreachable).
Must not: decide what to upload or promote (cascade.py, promotion.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvstrata.store.context import StoreContext, logger
from kvstrata.tiers.arena import SlotPool
from kvstrata.tiers.base import Done, Items, LowerTierBase, register_lower_tier
from kvstrata.tiers.changelog import OBJECT
from kvstrata.tiers.object_store import ObjectEntry, ObjectTier
from kvstrata.tiers.retention import RetentionTable

# Internal pin holder of uploads in flight: it holds no lease and never expires.
UPLOAD = "kvstrata:upload"


class ObjectLower(LowerTierBase):
    """The bucket as a lower tier: the last promotion source, shared by all nodes."""

    name = "object"
    shared = True
    medium = OBJECT
    holder = UPLOAD
    counter = "object_uploads"

    def __init__(self, ctx: StoreContext, tier: ObjectTier):
        config = ctx.config.tiers.object
        self.tier = tier
        self.write_policy = config.write_policy
        self.queue_depth = config.queue_depth
        self.refresh_seconds = config.index_refresh_seconds
        self._ctx = ctx
        # Batches queue here; each fans out over the tier's own max_concurrency threads.
        self.io = ctx.executors("object", 2)
        self._uploads_of: dict[tuple[str, int], int] = {}  # (namespace, generation) -> upload jobs in flight
        self._purges_due: dict[str, int] = {}  # namespace -> generation whose bucket purge waits on uploads
        self._purging: dict[str, int] = {}  # namespace -> bucket purge jobs queued or running
        ctx.counters.update(object_uploads_purged=0)  # uploads a purge kept from landing

    def available(self) -> bool:
        return self.tier.available()

    def present(self, namespace: str, keys: Sequence[bytes]) -> set[bytes]:
        log = self._ctx.log(namespace)
        return {key for key in keys if log.has(key, OBJECT)}

    # --- reads and uploads ---------------------------------------------------------------

    def start_reads(self, namespace: str, pool: SlotPool, items: Items, done: Done) -> None:
        self.io.submit(self._object_promote_job, namespace, pool, items, done)

    def _object_promote_job(self, namespace: str, pool: SlotPool, items: Items, done: Done) -> None:
        started = time.perf_counter()
        try:
            ok = self.tier.get_many(namespace, [(key, pool.view(slot)) for key, slot in items])
        except Exception:  # noqa: BLE001
            logger.exception("kvstrata node store: download of %d chunks failed", len(items))
            ok = [False] * len(items)
        self.discard(namespace, [key for (key, _), fetched in zip(items, ok) if not fetched])
        done(items, ok, time.perf_counter() - started)

    def discard(self, namespace: str, keys: Iterable[bytes]) -> None:
        if self.tier.available():  # absent or corrupt, not just unreachable
            self._ctx.log(namespace).record_many(list(keys), OBJECT, False)

    def submit_writes(self, namespace: str, pool: SlotPool, items: Items, generation: int, done: Done) -> None:
        """Queue an upload (under the lock): a purge of the bucket waits for it."""
        self._uploads_of[(namespace, generation)] = self._uploads_of.get((namespace, generation), 0) + 1
        self.io.submit(self._upload_job, namespace, pool, items, generation, done)

    def _upload_job(self, namespace: str, pool: SlotPool, items: Items, generation: int, done: Done) -> None:
        """Upload a batch and record what landed, unless its namespace was purged since it
        was queued (then the bucket's purge, which waits for this job, deletes it)."""
        ctx = self._ctx
        started = time.perf_counter()
        ok = [False] * len(items)
        with ctx.lock:
            purged = ctx.generations.purged_since(namespace, generation)
        try:
            if not purged:
                ok = self.tier.put_many(namespace, [(key, pool.view(slot)) for key, slot in items])
        except Exception:  # noqa: BLE001 - a failed upload is a lost copy, never a dead store
            logger.exception("kvstrata node store: upload of %d chunks failed", len(items))
        with ctx.lock:
            if ctx.generations.purged_since(namespace, generation):
                ctx.counters["object_uploads_purged"] += len(items)
            else:
                ctx.log(namespace).record_many([key for (key, _), uploaded in zip(items, ok) if uploaded], OBJECT, True)
            left = self._uploads_of.pop((namespace, generation)) - 1
            if left:
                self._uploads_of[(namespace, generation)] = left
            self._start_purge(namespace)
            done(items, ok, time.perf_counter() - started)

    # --- purges of the bucket ------------------------------------------------------------

    def purge(self, namespace: str, generation: int) -> int:
        """The namespace leaves the bucket (under the lock): at once in the change log, in
        the bucket once the uploads queued before have ended. Counts no chunk."""
        log = self._ctx.log(namespace)
        log.record_many(log.present(OBJECT), OBJECT, False)
        self._purges_due[namespace] = generation
        self._start_purge(namespace)
        return 0

    def _start_purge(self, namespace: str) -> None:
        """Queue the bucket purge due for the namespace once no upload queued before it is in
        flight and the tier is not paused (callers hold the lock)."""
        due = self._purges_due.get(namespace)
        if due is None or not self.tier.available():
            return
        if any(ns == namespace and generation < due for ns, generation in self._uploads_of):
            return
        del self._purges_due[namespace]
        self._purging[namespace] = self._purging.get(namespace, 0) + 1
        try:
            self.io.submit(self._object_purge_job, namespace, due)
        except RuntimeError:  # the store is closing: its pool takes no new job
            self._purges_due[namespace] = due
            self._purge_ended(namespace)
            logger.warning("kvstrata node store: closing before namespace %s was purged from the object store", namespace)

    def retry_purges(self) -> None:
        """Start the bucket purges that waited for the tier to answer again (each step; callers hold the lock)."""
        for namespace in list(self._purges_due):
            self._start_purge(namespace)

    def _object_purge_job(self, namespace: str, generation: int) -> None:
        """Empty the namespace in the bucket; if that fails, it is due again (tried once the
        tier answers), and sweeps record nothing of the namespace until it is done."""
        try:
            done = self.tier.purge(namespace) is not None
        except Exception:  # noqa: BLE001 - logged; tried again
            logger.exception("kvstrata node store: purging namespace %s from the object store failed", namespace)
            done = False
        with self._ctx.lock:
            self._purge_ended(namespace)
            if not done:
                self._purges_due[namespace] = max(generation, self._purges_due.get(namespace, 0))
            self._ctx.io_done.notify_all()

    def _purge_ended(self, namespace: str) -> None:
        left = self._purging.pop(namespace) - 1
        if left:
            self._purging[namespace] = left

    def purging(self) -> set[str]:
        """Namespaces whose bucket purge is due or running: a listing may still show their
        old objects (callers hold the lock)."""
        return set(self._purges_due) | set(self._purging)

    def busy(self) -> bool:
        return bool(self._purges_due or self._purging)

    # --- the listing the object index sweeps -----------------------------------------------

    def listing(self) -> list[ObjectEntry] | None:
        """Every chunk in the bucket, less what `capacity` and `ttl_seconds` delete now;
        None if the bucket did not answer (runs on the object pool, off the lock)."""
        entries = self.tier.scan()
        return self.tier.apply_limits(entries) if entries is not None else None

    def submit(self, job: Callable[..., Any], *args: Any) -> None:
        self.io.submit(job, *args)

    # --- registration, hints, life -------------------------------------------------------

    def configure(self, namespace: str, anchors: Any, tenant: str | None) -> None:
        self.tier.set_anchor_groups(namespace, anchors)
        if tenant is not None:
            self.tier.set_tenant(namespace, tenant)

    def describe(self, namespace: str, layout: dict[str, object]) -> None:
        self.io.submit(self.tier.write_manifest, namespace, dict(layout))

    def set_eviction_hints(self, reuse_of: Callable | None = None, retention: RetentionTable | None = None) -> None:
        if reuse_of is not None:  # sweeps spare reused chunks
            self.tier.reuse_of = reuse_of

    def stats(self) -> dict[str, object] | None:
        return self.tier.stats()

    def shutdown(self) -> None:
        self.io.shutdown(wait=True)

    def close(self) -> None:
        self.tier.close()


def open_object(ctx: StoreContext) -> ObjectLower | None:
    config = ctx.config.tiers.object
    if config is None:
        return None
    return ObjectLower(ctx, ObjectTier(config, clock=ctx.clock, quotas=ctx.config.tier_quotas("object")))


register_lower_tier("object", open_object)
