"""The node store's promotion: bringing chunks an engine asked for into the arena.

A pin asked for a chunk that is not in the arena reserves a slot (holder `PROMOTE`) and
fills it from this node's disk, else another node's arena or disk, else the object
store, on a background thread; meanwhile the engine is told `pending` (it answers
RETRY), and its next pin request finds the chunk in the arena. A failed or corrupt read
leaves the chunk nowhere, so the next request is a MISS.

Owns: the holder `PROMOTE` and the promotions in flight (`_promoting`).
Invariants: a (namespace, key) is promoted once at a time; every slot reserved for a
promotion is committed and unpinned, or released, exactly once, by
`_finish_promotions` under the store lock, which commits nothing if the namespace was
purged since the promotion began (purge.py). Records OBJECT absence only when the object
store answered (absent or corrupt, not unreachable). A namespace kept to its node
(registration_check.py) is never promoted from the object store or a peer.
Must not: copy arena chunks out to the tiers (cascade.py) or sweep the object store
(object_index.py).
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from functools import partial

from kvstrata.store.disk_jobs import submit_disk_jobs
from kvstrata.store.hints import Hints
from kvstrata.store.purges import Purge
from kvstrata.store.registration_check import shared_across_nodes
from kvstrata.store.context import logger
from kvstrata.tiers.arena import SlotPool
from kvstrata.tiers.changelog import OBJECT, PEER

# Internal pin holder: it holds no lease and never expires.
PROMOTE = "kvstrata:promote"


class Promotion(Hints, Purge):
    """Mixin of `NodeStore`: disk, peer and object reads into reserved arena slots (and,
    over them, prefetch and KV hints: prefetch.py, hints.py)."""

    def _init_promotion(self) -> None:
        self._promoting: set[tuple[str, bytes]] = set()
        self._init_hints()

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
        shared = shared_across_nodes(self.layouts.get(namespace))  # registration_check.py
        for key in keys:
            if key in outcome:
                continue
            outcome[key] = True
            if (namespace, key) in self._promoting:
                continue
            if key in on_disk:
                wanted.append((key, from_disk))
            elif shared and self.peers is not None and log.has(key, PEER) and self.peers.can_fetch(namespace, key):
                wanted.append((key, from_peer))
            elif shared and self.object is not None and self.object.available() and log.has(key, OBJECT):
                wanted.append((key, from_object))
            else:
                outcome[key] = False
        slots = pool.reserve(PROMOTE, len(wanted)) if wanted else []
        generation = self._generation(namespace)  # a purge before they land: nothing is committed
        for (key, batch), slot in zip(wanted, slots):
            self._promoting.add((namespace, key))
            batch.append((key, slot))
        for key, _ in wanted[len(slots) :]:
            # Slots held by write-backs, or waiting for an engine to see their chunk go,
            # free up in a moment: the engine asks again (its wait is bounded). Every slot
            # pinned otherwise: a miss now beats waiting on us.
            outcome[key] = pool.settling > 0
        if from_disk:
            job = partial(self._promote_job, generation=generation)
            submit_disk_jobs(self._io, self.config.tiers.disk.io_threads, job, namespace, pool, from_disk)
        if from_peer:
            self._peer_io.submit(self._peer_promote_job, namespace, pool, from_peer, generation)
        if from_object:
            self._object_io.submit(self._object_promote_job, namespace, pool, from_object, generation)
        return outcome

    def _promote_job(self, namespace: str, pool: SlotPool, items: list[tuple[bytes, int]], generation: int) -> None:
        """Read a batch; it is committed when its last piece is verified, on a digest thread,
        while this I/O thread already reads the next batch."""
        started = time.perf_counter()

        def finish(reads: Future[list[bool]] | None) -> None:
            try:
                read = reads.result() if reads is not None else [False] * len(items)
            except Exception:  # noqa: BLE001
                logger.exception("kvstrata node store: promotion of %d chunks failed", len(items))
                read = [False] * len(items)
            ok = self._audited("disk", namespace, pool, items, read)
            for (key, _), was_read, passed in zip(items, read, ok):
                if was_read and not passed and not self._purged_since(namespace, generation):
                    self.disk.remove(namespace, key)  # the audit refused this copy: it is wrong, drop it
            self._finish_promotions("disk", namespace, pool, items, ok, time.perf_counter() - started, generation)

        try:
            reads = self.disk.start_reads(namespace, [(key, pool.view(slot)) for key, slot in items])
        except Exception:  # noqa: BLE001
            logger.exception("kvstrata node store: promotion of %d chunks failed", len(items))
            finish(None)
            return
        reads.add_done_callback(finish)

    def _peer_promote_job(self, namespace: str, pool: SlotPool, items: list[tuple[bytes, int]], generation: int) -> None:
        started = time.perf_counter()
        try:
            # Each chunk from its fastest holder; each peer's part observed as `peer:<node>`.
            estimates, stale = self.tier_estimates, self.config.admission.stale_seconds
            ok = self.peers.fetch(namespace, pool, items, self._log(namespace), estimates, stale)
        except Exception:  # noqa: BLE001
            logger.exception("kvstrata node store: peer fetch of %d chunks failed", len(items))
            ok = [False] * len(items)
        self._finish_promotions("peer", namespace, pool, items, ok, time.perf_counter() - started, generation)

    def _object_promote_job(self, namespace: str, pool: SlotPool, items: list[tuple[bytes, int]], generation: int) -> None:
        started = time.perf_counter()
        try:
            ok = self.object.get_many(namespace, [(key, pool.view(slot)) for key, slot in items])
        except Exception:  # noqa: BLE001
            logger.exception("kvstrata node store: download of %d chunks failed", len(items))
            ok = [False] * len(items)
        ok = self._audited("object", namespace, pool, items, ok)
        log = self._log(namespace)
        for (key, _), fetched in zip(items, ok):
            if not fetched and self.object.available():
                log.record(key, OBJECT, False)  # absent or corrupt, not just unreachable
        self._finish_promotions("object", namespace, pool, items, ok, time.perf_counter() - started, generation)

    def _audited(self, source: str, namespace: str, pool: SlotPool, items: list[tuple[bytes, int]], ok: list[bool]) -> list[bool]:
        """`ok` less the chunks the chunk audit refuses (`tiers.cpu.audit_chunks`)."""
        if self.audit is None:
            return ok
        return [arrived and self.audit.promoted(source, namespace, key, pool.view(slot)) for (key, slot), arrived in zip(items, ok)]

    def _finish_promotions(
        self,
        source: str,
        namespace: str,
        pool: SlotPool,
        items: list[tuple[bytes, int]],
        ok: list[bool],
        seconds: float,
        generation: int,
    ) -> None:
        """Commit what arrived from `source` (disk, peer, object), release the rest, count both;
        commit nothing if the namespace was purged since the promotion began (its bytes may
        be from before the purge).

        The batch is observed as `source`: for peers, the aggregate `peer` estimate engines
        weigh (the batch's time is its slowest peer's); peers.py observes each peer apart."""
        promoted = [(slot, key) for (key, slot), arrived in zip(items, ok) if arrived]
        self.io_meter.record(source, "read", len(promoted) * pool.geometry.slot_bytes, len(promoted), seconds)
        self.tier_estimates.observe(source, len(promoted) * pool.geometry.slot_bytes, seconds)  # admission.load
        with self._lock:
            if self._purged_since(namespace, generation):
                self.counters["promotions_purged"] += len(promoted)
                ok, promoted = [False] * len(items), []
            self._promoting.difference_update((namespace, key) for key, _ in items)
            _, refused = pool.commit_many(PROMOTE, promoted)
            if refused:  # a bug, not an I/O outcome: the slots stay reserved, and we say so
                logger.error("kvstrata node store: %d promotions not committed: %s", len(refused), refused[0])
            self._prefetch_landed(namespace, pool, items, ok)  # prefetch.py: held before PROMOTE lets go
            pool.unpin(PROMOTE, [slot for slot, _ in promoted])
            pool.release(PROMOTE, [slot for (_, slot), arrived in zip(items, ok) if not arrived])
            self.counters["promotions"] += len(promoted)
            self.counters["promotion_failures"] += len(items) - len(promoted)
            self.counters[f"{source}_promotions"] += len(promoted)
            self.counters[f"{source}_promotion_failures"] += len(items) - len(promoted)
            self._io_done.notify_all()
