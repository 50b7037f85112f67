"""The node store's promotion: bringing chunks an engine asked for into the arena.

A pin asked for a chunk that is not in the arena reserves a slot (holder `PROMOTE`) and
fills it from the first lower tier that has it, in the tiers' order (tiers/base.py: this
node's disk, else another node's arena or disk, else the object store), on the tier's
background thread; meanwhile the engine is told `pending` (it answers
RETRY), and its next pin request finds the chunk in the arena. A failed or corrupt read
leaves the chunk nowhere, so the next request is a MISS.

Owns: the holder `PROMOTE`, the promotions in flight (`_promoting`), the listeners told
when promotions land (`on_landed`: prefetch.py holds what it wanted before `PROMOTE` lets
go of the slot).
Invariants: a (namespace, key) is promoted once at a time; every slot reserved for a
promotion is committed and unpinned, or released, exactly once, by `_finish` under the
store lock, which commits nothing if the namespace was purged since the promotion began
(purges.py). A copy the chunk audit refuses is discarded by its tier. A namespace kept to
its node (registration_check.py) is never promoted from a shared tier (peers, the bucket).
Must not: copy arena chunks out to the tiers (cascade.py) or sweep the object store
(object_index.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

from kvstrata.store.context import StoreContext, logger
from kvstrata.store.registration_check import shared_across_nodes
from kvstrata.tiers.arena import SlotPool
from kvstrata.tiers.base import Items, LowerTier

# Internal pin holder: it holds no lease and never expires.
PROMOTE = "kvstrata:promote"
# A listener of landed promotions: (namespace, pool, items, arrived per item), under the lock.
Landed = Callable[[str, SlotPool, Items, list[bool]], None]


class Promotion:
    """Reads from the lower tiers into reserved arena slots."""

    def __init__(self, ctx: StoreContext, tiers: Sequence[LowerTier]):
        self._ctx = ctx
        self._tiers = tiers
        self._promoting: set[tuple[str, bytes]] = set()
        self.on_landed: list[Landed] = []
        for tier in tiers:
            ctx.counters.setdefault(f"{tier.name}_promotions", 0)
            ctx.counters.setdefault(f"{tier.name}_promotion_failures", 0)

    def in_flight(self, namespace: str, key: bytes) -> bool:
        return (namespace, key) in self._promoting

    def busy(self) -> bool:
        """Whether a promotion is in flight (`wait_io`; callers hold the lock)."""
        return bool(self._promoting)

    def sources(self, namespace: str, keys: Sequence[bytes]) -> dict[bytes, LowerTier]:
        """The tier each key would be promoted from: the first, in order, that answers and
        holds it (shared tiers only for namespaces shared across nodes). Keys no tier
        holds are left out. One index lookup per tier for all keys (callers hold the lock)."""
        shared = shared_across_nodes(self._ctx.layouts.get(namespace))  # registration_check.py
        found: dict[bytes, LowerTier] = {}
        left = list(dict.fromkeys(keys))
        for tier in self._tiers:
            if not left:
                break
            if (tier.shared and not shared) or not tier.available():
                continue
            present = tier.present(namespace, left)
            if present:
                found.update((key, tier) for key in left if key in present)
                left = [key for key in left if key not in present]
        return found

    def promote(self, namespace: str, pool: SlotPool, keys: list[bytes]) -> dict[bytes, bool]:
        """Start (or join) bringing chunks into the arena from the first tier that has them.

        Per key, whether it is on its way (False: it cannot be had, the engine answers
        MISS). One lookup of each tier's index and one reservation for the whole request:
        per key they cost a large request milliseconds before its first read.
        """
        outcome: dict[bytes, bool] = {}
        todo: list[bytes] = []
        for key in keys:
            if key in outcome:
                continue
            outcome[key] = True
            if (namespace, key) not in self._promoting:
                todo.append(key)
        found = self.sources(namespace, todo) if todo else {}
        wanted: list[tuple[bytes, LowerTier]] = []
        for key in todo:
            tier = found.get(key)
            if tier is None:
                outcome[key] = False
            else:
                wanted.append((key, tier))
        slots = pool.reserve(PROMOTE, len(wanted)) if wanted else []
        generation = self._ctx.generations.current(namespace)  # a purge before they land: nothing is committed
        batches: dict[str, Items] = {}
        for (key, tier), slot in zip(wanted, slots):
            self._promoting.add((namespace, key))
            batches.setdefault(tier.name, []).append((key, slot))
        for key, _ in wanted[len(slots) :]:
            # Slots held by write-backs, or waiting for an engine to see their chunk go,
            # free up in a moment: the engine asks again (its wait is bounded). Every slot
            # pinned otherwise: a miss now beats waiting on us.
            outcome[key] = pool.settling > 0
        for tier in self._tiers:
            items = batches.get(tier.name)
            if items:
                tier.start_reads(namespace, pool, items, partial(self._read, tier, namespace, pool, generation))
        return outcome

    def _read(
        self, tier: LowerTier, namespace: str, pool: SlotPool, generation: int, items: Items, read: list[bool], seconds: float
    ) -> None:
        """A batch of reads ended (any thread): what the audit refuses is wrong, and its
        tier drops it; the rest is committed."""
        ok = self._audited(tier.name, namespace, pool, items, read)
        refused = [key for (key, _), was_read, passed in zip(items, read, ok) if was_read and not passed]
        if refused:
            with self._ctx.lock:
                if not self._ctx.generations.purged_since(namespace, generation):
                    tier.discard(namespace, refused)
        self._finish(tier.name, namespace, pool, items, ok, seconds, generation)

    def _audited(self, source: str, namespace: str, pool: SlotPool, items: Items, ok: list[bool]) -> list[bool]:
        """`ok` less the chunks the chunk audit refuses (`tiers.cpu.audit_chunks`)."""
        audit = self._ctx.audit
        if audit is None:
            return ok
        return [arrived and audit.promoted(source, namespace, key, pool.view(slot)) for (key, slot), arrived in zip(items, ok)]

    def _finish(
        self, source: str, namespace: str, pool: SlotPool, items: Items, ok: list[bool], seconds: float, generation: int
    ) -> None:
        """Commit what arrived from `source` (disk, peer, object), release the rest, count both;
        commit nothing if the namespace was purged since the promotion began (its bytes may
        be from before the purge).

        The batch is observed as `source`: for peers, the aggregate `peer` estimate engines
        weigh (the batch's time is its slowest peer's); peers.py observes each peer apart."""
        ctx = self._ctx
        promoted = [(slot, key) for (key, slot), arrived in zip(items, ok) if arrived]
        ctx.io_meter.record(source, "read", len(promoted) * pool.geometry.slot_bytes, len(promoted), seconds)
        ctx.tier_estimates.observe(source, len(promoted) * pool.geometry.slot_bytes, seconds)  # admission.load
        with ctx.lock:
            counters = ctx.counters
            if ctx.generations.purged_since(namespace, generation):
                counters["promotions_purged"] += len(promoted)
                ok, promoted = [False] * len(items), []
            self._promoting.difference_update((namespace, key) for key, _ in items)
            _, refused = pool.commit_many(PROMOTE, promoted)
            if refused:  # a bug, not an I/O outcome: the slots stay reserved, and we say so
                logger.error("kvstrata node store: %d promotions not committed: %s", len(refused), refused[0])
            for listener in self.on_landed:  # prefetch.py: held before PROMOTE lets go
                listener(namespace, pool, items, ok)
            pool.unpin(PROMOTE, [slot for slot, _ in promoted])
            pool.release(PROMOTE, [slot for (_, slot), arrived in zip(items, ok) if not arrived])
            counters["promotions"] += len(promoted)
            counters["promotion_failures"] += len(items) - len(promoted)
            counters[f"{source}_promotions"] += len(promoted)
            counters[f"{source}_promotion_failures"] += len(items) - len(promoted)
            ctx.io_done.notify_all()
