"""The node store's cascade: copies of arena chunks to the tiers below it (disk, object store).

A committed chunk is copied in the background to each lower tier whose policy is
`write_through`, or when the arena evicts it, to each whose policy is `write_back`, in
the tiers' order (tiers/base.py; it names none). The slot stays pinned by the copy (the
tier's holder: `CASCADE` for disk, `UPLOAD` for the object store) until the copy is done.
A full queue drops the copy (counted), never blocks. With `admission.store: reuse` a tier
gets only chunks used often enough (admission.py).

Owns: the copies in flight per tier (`_in_flight`, by namespace, generation and key) and
the arena's eviction hook (`attach_write_back`).
Invariants: every slot a copy pins is unpinned exactly once, by its job or at once when
the copy is dropped; a chunk is copied to a tier at most once at a time (a late copy of
a chunk that became reused while its commit's copy is still queued is no second write:
CI on a loaded machine counted 5 disk writes for 4 chunks); a job's unpin takes the
store lock, so it comes after the pin taken when the eviction hook returns. Records OBJECT presence only for uploads that landed, and
only if their namespace was not purged since they were queued; a copy queued before a
purge writes nothing (purges.py). A namespace kept to its node (registration_check.py)
is never copied to a shared tier.
Must not: read from the tiers into the arena (promotion.py) or decide what the object
store holds beyond its own uploads (object_index.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

from kvstrata.store.admission import Items, ReuseAdmission
from kvstrata.store.context import StoreContext
from kvstrata.store.lower import CASCADE
from kvstrata.store.object_lower import UPLOAD
from kvstrata.store.registration_check import shared_across_nodes
from kvstrata.tiers.arena import SlotPool
from kvstrata.tiers.base import LowerTier

__all__ = ["CASCADE", "UPLOAD", "Cascade"]


class Cascade:
    """Copies of arena chunks to the lower tiers that take them."""

    def __init__(self, ctx: StoreContext, admission: ReuseAdmission, tiers: Sequence[LowerTier]):
        self._ctx = ctx
        self._admission = admission
        self._through = [tier for tier in tiers if tier.write_policy == "write_through"]
        self._back = [tier for tier in tiers if tier.write_policy == "write_back"]
        self._in_flight: dict[str, set[tuple[str, int, bytes]]] = {tier.name: set() for tier in tiers}
        for tier in tiers:
            if tier.counter:
                ctx.counters.setdefault(f"{tier.counter}_queued", 0)
                ctx.counters.setdefault(f"{tier.counter}_dropped", 0)

    def pending(self, tier: str) -> int:
        """Copies to `tier` in flight (status)."""
        return len(self._in_flight.get(tier, ()))

    def busy(self) -> bool:
        """Whether a copy is in flight (`wait_io`; callers hold the lock)."""
        return any(self._in_flight.values())

    def attach_write_back(self, namespace: str, pool: SlotPool) -> None:
        """Copy a new pool's evicted chunks to the tiers whose policy is `write_back`."""
        if self._back:
            pool.on_evict = lambda key, slot: self._write_back(namespace, pool, key, slot)

    def copy_commits(self, namespace: str, pool: SlotPool, committed: Items) -> None:
        """Commit hook (under the lock): queue the `write_through` copies of committed chunks
        the tiers admit (admission.py: with `reuse`, only chunks already used enough)."""
        self._copy_down(namespace, pool, self._admission.admit_commits(namespace, committed, self._through))

    def copy_reused(self, namespace: str, pool: SlotPool, keys: list[bytes]) -> None:
        """Use hook (under the lock, HITs and pins): late copies of chunks that just became reused."""
        self._copy_down(namespace, pool, self._admission.note_reuse(namespace, pool, keys, self._through))

    def _copy_down(self, namespace: str, pool: SlotPool, admitted: dict[str, Items]) -> None:
        for tier in self._through:
            items = admitted.get(tier.name)
            if items:
                pool.pin_slots(tier.holder, [slot for _, slot in items])
                self._queue(tier, namespace, pool, items)

    def _write_back(self, namespace: str, pool: SlotPool, key: bytes, slot: int) -> list[str]:
        """Eviction hook: keep the evicted bytes pinned until every copy of them is done."""
        # Each accepted copy pins the slot as soon as we return; the jobs' unpins wait for
        # the store lock this call runs under, so they come after.
        tiers = self._admission.admit_eviction(namespace, key, self._back)
        return [tier.holder for tier in tiers if self._queue(tier, namespace, pool, [(key, slot)], pinned=False)]

    def _queue(self, tier: LowerTier, namespace: str, pool: SlotPool, items: Items, pinned: bool = True) -> int:
        """Queue copies of slots pinned for the tier; items beyond its queue depth (or that
        it holds already, or while it does not answer) are dropped and unpinned. A namespace
        kept to this node (registration_check.py: a non-cryptographic block hash) is never
        copied to a shared tier. Returns how many were queued."""
        if tier.shared and not shared_across_nodes(self._ctx.layouts.get(namespace)):
            if pinned:
                pool.unpin(tier.holder, [slot for _, slot in items])
            return 0
        counters = self._ctx.counters
        generation = self._ctx.generations.current(namespace)
        in_flight = self._in_flight[tier.name]
        held = tier.present(namespace, [key for key, _ in items])
        available = tier.available()
        accepted: Items = []
        for key, slot in items:
            if key in held or (namespace, generation, key) in in_flight:
                pass  # already there (another node, or an earlier life of this chunk, put it there) or on its way
            elif not available or len(in_flight) >= tier.queue_depth:
                counters[f"{tier.counter}_dropped"] += 1
            else:
                in_flight.add((namespace, generation, key))
                accepted.append((key, slot))
                continue
            if pinned:
                pool.unpin(tier.holder, [slot])
        if accepted:
            counters[f"{tier.counter}_queued"] += len(accepted)
            done = partial(self._copied, tier, namespace, generation, pool)
            tier.submit_writes(namespace, pool, accepted, generation, done)
        return len(accepted)

    def _copied(
        self, tier: LowerTier, namespace: str, generation: int, pool: SlotPool, items: Items, ok: list[bool], seconds: float
    ) -> None:
        """A batch of copies ended, landed or not: its slots are let go."""
        landed = sum(ok)
        self._ctx.io_meter.record(tier.name, "write", landed * pool.geometry.slot_bytes, landed, seconds)
        with self._ctx.lock:
            self._in_flight[tier.name].difference_update((namespace, generation, key) for key, _ in items)
            pool.unpin(tier.holder, [slot for _, slot in items])
            self._ctx.io_done.notify_all()
