"""The node store's reuse-aware admission: which chunks the cascade writes down.

Why: with `admission.store.disk/object: reuse`, a chunk is copied to that tier only once
its prefix has been used `min_uses` times within the namespace's window (a count-min
sketch per namespace, tiers/frequency.py). A trace of mostly one-off prompts then costs
few disk writes and PUTs, and its one-offs do not evict the chunks that are read again.
The arena keeps admitting everything: it is the staging tier every copy is made from.

What counts as a use of a chunk: its commit (the engine computed and stored it), a HIT
an engine answered from its mirror (`hold`) and a pin (a HIT that needs the arena copy,
or a promotion). Touches do not count: an engine touches every chunk a request used,
stored ones included, so a one-off would count twice.

With `chain` (tiers/chain_admission.py) a tier also gets, at once, every chunk whose
prefix ends within `head_tokens` of its request (the engine sends commits' positions): a
prefix is read back from its first chunk on, so its head is worth a write even before
any reuse shows (on Mooncake's chat trace: docs/real-traffic.md). A chunk under a live
retention (kv.retain) passes every test: the tier below is where it outlives the arena.

When the copy is made: a `write_through` tier gets a committed chunk at once if it is
already reused, else when a later use makes it reused while it is still in the arena
(a *late* copy); a `write_back` tier gets an evicted chunk only if it is reused. A chunk
not copied at commit or eviction is counted in `disk_writes_skipped_reuse` /
`object_uploads_skipped_reuse` (a late copy may still follow).

Also owns the store's side of `admission.load` (load or recompute): `tier_estimates`,
what each lower tier delivered to promotions, sent to engines with every step reply
(connector/load_admission.py decides there).

Owns: `_reuse` (None when no tier uses `reuse`), the two counters, `tier_estimates`. Called under the
store lock (the sketch is not thread-safe). Must not: queue copies itself (cascade.py
does: `_copy_down`).
"""

from __future__ import annotations

from kvstrata.actors.store_state import StoreState, logger
from kvstrata.tiers.arena import SlotPool
from kvstrata.tiers.chain_admission import ChainAdmission
from kvstrata.tiers.estimates import TierEstimates, peer_node
from kvstrata.tiers.frequency import ReuseCounter


class ReuseAdmission(StoreState):
    """Mixin of `NodeStore` (through `Cascade`): the reuse test on the cascade's copies."""

    def _init_admission(self) -> None:
        store = self.config.admission.store
        self._reuse_disk = store.disk in ("reuse", "chain")
        self._reuse_object = store.object in ("reuse", "chain")
        # `chain`: also the head of every prefix, at once (tiers/chain_admission.py).
        self._chain_disk, self._chain_object = store.disk == "chain", store.object == "chain"
        self._chain = ChainAdmission(store.head_tokens) if self._chain_disk or self._chain_object else None
        self._reuse = ReuseCounter(store.window, store.min_uses) if self._reuse_disk or self._reuse_object else None
        self.counters["disk_writes_skipped_reuse"] = 0
        self.counters["object_uploads_skipped_reuse"] = 0
        # What each lower tier delivered to promotions (promotion.py observes), for engines'
        # `admission.load: break_even`; the estimates ride on every step reply.
        self.tier_estimates = TierEstimates(self._clock)
        if self._reuse is not None:
            logger.info(
                "kvstrata node store: admission to disk %s, object %s (min_uses %d within %d uses per namespace)",
                store.disk, store.object, store.min_uses, store.window,
            )  # fmt: skip

    def _tier_costs(self) -> dict[str, tuple[float, float, float]]:
        """The tiers' estimates (`disk`, `object`, `peer`) for a step reply. Not the per-peer
        ones (`peer:<node>`): an engine's mirror does not say which peer holds a chunk."""
        return {
            tier: (cost.latency_seconds, cost.bytes_per_second, cost.age_seconds)
            for tier, cost in self.tier_estimates.costs().items()
            if peer_node(tier) is None
        }

    def _note_positions(self, positions: list[tuple[bytes, int]]) -> None:
        """Where committed chunks end in their requests (sent with the commits), for `chain`."""
        if self._chain is not None and positions:
            self._chain.note_positions(positions)

    def _admit_commits(
        self, namespace: str, committed: list[tuple[bytes, int]], to_disk: bool, to_object: bool
    ) -> tuple[list[tuple[bytes, int]], list[tuple[bytes, int]]]:
        """Count the commits as uses; the (key, slot) pairs the write_through disk and
        object tiers admit now (`to_disk`/`to_object`: whether the tier copies at commit)."""
        if self._reuse is None:
            return (committed if to_disk else []), (committed if to_object else [])
        keys = [key for key, _ in committed]
        reused = [
            used or self._retention.priority(namespace, key) > 0  # retained: kept below too
            for key, used in zip(keys, self._reuse.note(namespace, keys))
        ]
        chained = self._chain.admit(keys, reused) if self._chain is not None else reused
        to_disk_ok = chained if self._chain_disk else reused
        to_object_ok = chained if self._chain_object else reused
        disk = ([item for item, ok in zip(committed, to_disk_ok) if ok] if self._reuse_disk else committed) if to_disk else []
        upload = (
            ([item for item, ok in zip(committed, to_object_ok) if ok] if self._reuse_object else committed)
            if to_object
            else []
        )
        if to_disk and self._reuse_disk:
            self.counters["disk_writes_skipped_reuse"] += len(committed) - len(disk)
        if to_object and self._reuse_object:
            self.counters["object_uploads_skipped_reuse"] += len(committed) - len(upload)
        return disk, upload

    def _note_reuse(
        self, namespace: str, pool: SlotPool, keys: list[bytes], to_disk: bool, to_object: bool
    ) -> tuple[list[tuple[bytes, int]], list[tuple[bytes, int]]]:
        """Count HITs and pins as uses; the resident chunks that just became reused, to be
        copied late to the write_through tiers that skipped them at commit."""
        if self._reuse is None or not keys:
            return [], []
        before = self._reuse.reused(namespace, keys)
        after = self._reuse.note(namespace, keys)
        late: dict[bytes, int] = {}
        for key, was, now in zip(keys, before, after):
            if now and not was and key not in late:
                slot = pool.lookup(key)  # a held slot may be an orphan: copy indexed chunks only
                if slot is not None:
                    late[key] = slot
        items = list(late.items())
        return (items if to_disk and self._reuse_disk else []), (items if to_object and self._reuse_object else [])

    def _admit_eviction(self, namespace: str, key: bytes, to_disk: bool, to_object: bool) -> tuple[bool, bool]:
        """Whether an evicted chunk goes to the write_back disk and object tiers."""
        if self._reuse is None or not (to_disk or to_object):
            return to_disk, to_object
        # A chunk kept by a live retention (kv.retain) is written whatever its uses: the
        # arena evicts it only when it must, and the tier below is where it survives.
        reused = self._reuse.reused(namespace, [key])[0] or self._retention.priority(namespace, key) > 0
        head = self._chain is not None and self._chain.in_head(key)
        if to_disk and self._reuse_disk and not (reused or (self._chain_disk and head)):
            to_disk = False
            self.counters["disk_writes_skipped_reuse"] += 1
        if to_object and self._reuse_object and not (reused or (self._chain_object and head)):
            to_object = False
            self.counters["object_uploads_skipped_reuse"] += 1
        return to_disk, to_object
