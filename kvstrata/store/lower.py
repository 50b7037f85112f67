"""The store's lower tiers: this node's disk and other nodes' stores, as `LowerTier`s.

tiers/base.py says what a lower tier is to the store; this module adapts the disk tier
(tiers/disk/) and a peer link (actors/peers.py's `PeerSync`, or any object with its
calls) to it, and registers `disk` with the tier registry (object_lower.py registers
`object`). Each adapter owns its tier's executor and the jobs it queues there; the
store's parts decide what to copy and promote (cascade.py, promotion.py) and keep the
bookkeeping (pins, counters, estimates).

Owns: `DiskLower` (the disk tier, its I/O pool, its jobs cut by disk_jobs.py) and
`PeerLower` (the peer link and its pool).
Invariants: a disk write notes the disk tier's own generation of its namespace when
queued, and the tier writes nothing if it changed (`DiskTier.purge` bumps it); every
job calls its `done` once, whatever happened.
Must not: import Ray (the peer link is handed in) or take a decision the parts own.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor, Future
from functools import partial
from typing import Any, Protocol

from kvstrata.store.context import StoreContext, logger
from kvstrata.store.disk_jobs import submit_disk_jobs
from kvstrata.tiers.arena import SlotPool
from kvstrata.tiers.base import Done, Items, LowerTierBase, register_lower_tier
from kvstrata.tiers.changelog import PEER, STORAGE
from kvstrata.tiers.disk import DIGEST_THREADS, DiskTier, DiskTierError
from kvstrata.tiers.retention import RetentionTable

# Internal pin holder of disk copies in flight: it holds no lease and never expires.
CASCADE = "kvstrata:cascade"


class DiskLower(LowerTierBase):
    """This node's disk (tiers/disk/) as a lower tier: the first promotion source."""

    name = "disk"
    local = True
    medium = STORAGE
    holder = CASCADE
    counter = "disk_writes"

    def __init__(self, ctx: StoreContext, tier: DiskTier):
        config = ctx.config.tiers.disk
        self.tier = tier
        self.write_policy = config.write_policy
        self.queue_depth = config.queue_depth
        self._threads = config.io_threads
        self._log = ctx.log
        self.io = ctx.executors("disk", config.io_threads)

    def present(self, namespace: str, keys: Sequence[bytes]) -> set[bytes]:
        return self.tier.present(namespace, keys) if keys else set()

    def start_reads(self, namespace: str, pool: SlotPool, items: Items, done: Done) -> None:
        submit_disk_jobs(self.io, self._threads, partial(self._promote_job, done=done), namespace, pool, items)

    def _promote_job(self, namespace: str, pool: SlotPool, items: Items, done: Done) -> None:
        """Read a batch; it is done when its last piece is verified, on a digest thread,
        while this I/O thread already reads the next batch."""
        started = time.perf_counter()

        def finish(reads: Future[list[bool]] | None) -> None:
            try:
                read = reads.result() if reads is not None else [False] * len(items)
            except Exception:  # noqa: BLE001
                logger.exception("kvstrata node store: promotion of %d chunks failed", len(items))
                read = [False] * len(items)
            done(items, read, time.perf_counter() - started)

        try:
            reads = self.tier.start_reads(namespace, [(key, pool.view(slot)) for key, slot in items])
        except Exception:  # noqa: BLE001
            logger.exception("kvstrata node store: promotion of %d chunks failed", len(items))
            finish(None)
            return
        reads.add_done_callback(finish)

    def discard(self, namespace: str, keys: Iterable[bytes]) -> None:
        for key in keys:
            self.tier.remove(namespace, key)

    def submit_writes(self, namespace: str, pool: SlotPool, items: Items, generation: int, done: Done) -> None:
        # Consecutive commits tend to get neighbouring disk records: one pwritev per run.
        # The disk tier writes nothing if the namespace is purged before a job lands (purges.py).
        job = partial(self._write_job, generation=self.tier.generation(namespace), done=done)
        submit_disk_jobs(self.io, self._threads, job, namespace, pool, items)

    def _write_job(self, namespace: str, pool: SlotPool, items: Items, generation: int, done: Done) -> None:
        started = time.perf_counter()
        written = [False] * len(items)
        try:
            # The slots are pinned by the cascade: their bytes are stable while we write.
            chunks = [(key, pool.view(slot)) for key, slot in items]
            written = list(self.tier.write_many(namespace, chunks, generation=generation))
        except Exception:  # noqa: BLE001 - a failed cascade is a lost copy, never a dead store
            logger.exception("kvstrata node store: disk write of %d chunks failed", len(items))
        finally:
            done(items, written, time.perf_counter() - started)

    def read_many(self, namespace: str, chunks: list[tuple[bytes, Any]]) -> list[bool]:
        return self.tier.read_many(namespace, chunks)

    def purge(self, namespace: str, generation: int) -> int:
        removed = self.tier.purge(namespace)
        self.io.submit(self.tier.close_purged)  # freeing a large file's blocks takes a while
        return removed

    def configure(self, namespace: str, anchors: Any, tenant: str | None) -> None:
        self.tier.set_anchor_groups(namespace, anchors)
        if tenant is not None:
            self.tier.set_tenant(namespace, tenant)

    def set_eviction_hints(self, reuse_of: Callable | None = None, retention: RetentionTable | None = None) -> None:
        if reuse_of is not None:  # admission.store: reuse keeps a sketch: evict one-offs first
            self.tier.reuse_of = reuse_of
        if retention is not None:  # kv.retain: retained records are evicted last (once: it keeps the first)
            self.tier.use_retention(retention)

    def stats(self) -> dict[str, object] | None:
        return self.tier.stats()

    def shutdown(self) -> None:
        """Stop its I/O pool (before `close`: jobs in flight end first)."""
        self.io.shutdown(wait=True)

    def close(self) -> None:
        # Outside the lock: the reads still being verified finish their promotions
        # (under the lock) before the disk tier's digest threads stop.
        self.tier.close()


def open_disk(ctx: StoreContext) -> DiskLower | None:
    """The disk tier of `tiers.disk`, its records announced in the change logs; None if
    it is off, or failed to open (the engine keeps serving from the arena; the operator
    sees why in the log and in stats: `tier_errors["disk"]`)."""
    disk = ctx.config.tiers.disk
    if disk is None:
        return None
    try:
        tier = DiskTier(
            disk.path,
            disk.capacity,
            direct_io=disk.direct_io,
            eviction_policy=ctx.config.tiers.cpu.eviction_policy,
            on_change=lambda namespace, keys, present: ctx.log(namespace).record_many(keys, STORAGE, present),
            quotas=ctx.config.tier_quotas("disk"),
            digests=ctx.executors("disk-digest", DIGEST_THREADS),
        )
    except Exception as exc:  # noqa: BLE001 - DiskTierError, or whatever a damaged directory raised
        ctx.tier_errors["disk"] = str(exc) if isinstance(exc, DiskTierError) else f"{type(exc).__name__}: {exc}"
        logger.error("kvstrata node store: disk tier disabled: %s", exc)
        return None
    for namespace in tier.namespaces():
        ctx.log(namespace).record_many(tier.keys(namespace), STORAGE, True)
    return DiskLower(ctx, tier)


register_lower_tier("disk", open_disk)


class PeerLink(Protocol):
    """What the store asks of its link to other nodes (actors/peers.py: `PeerSync`)."""

    def can_fetch(self, namespace: str, key: bytes) -> bool: ...

    def fetch(self, namespace: str, pool: SlotPool, items: Items, log: Any, estimates: Any, stale_s: float) -> list[bool]: ...

    def stats(self) -> dict[str, object]: ...

    def close(self) -> None: ...


class PeerLower(LowerTierBase):
    """Other nodes' stores as a lower tier: read only (each node writes its own tiers), and
    only for namespaces shared across nodes."""

    name = "peer"
    shared = True
    medium = PEER

    def __init__(self, ctx: StoreContext, link: PeerLink, io: Executor):
        self.link = link
        self.io = io
        self._ctx = ctx

    def present(self, namespace: str, keys: Sequence[bytes]) -> set[bytes]:
        log = self._ctx.log(namespace)
        return {key for key in keys if log.has(key, PEER) and self.link.can_fetch(namespace, key)}

    def start_reads(self, namespace: str, pool: SlotPool, items: Items, done: Done) -> None:
        self.io.submit(self._peer_promote_job, namespace, pool, items, done)

    def _peer_promote_job(self, namespace: str, pool: SlotPool, items: Items, done: Done) -> None:
        started = time.perf_counter()
        try:
            # Each chunk from its fastest holder; each peer's part observed as `peer:<node>`.
            ctx = self._ctx
            ok = self.link.fetch(namespace, pool, items, ctx.log(namespace), ctx.tier_estimates, ctx.config.admission.stale_seconds)
        except Exception:  # noqa: BLE001
            logger.exception("kvstrata node store: peer fetch of %d chunks failed", len(items))
            ok = [False] * len(items)
        done(items, ok, time.perf_counter() - started)

    def stats(self) -> dict[str, object] | None:
        return self.link.stats()

    def shutdown(self) -> None:
        self.link.close()
        self.io.shutdown(wait=True)
