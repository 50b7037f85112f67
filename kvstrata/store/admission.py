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

When the copy is made: a `write_through` tier gets a committed chunk at once if it is
already reused, else when a later use makes it reused while it is still in the arena
(a *late* copy); a `write_back` tier gets an evicted chunk only if it is reused. A chunk
not copied at commit or eviction is counted in `disk_writes_skipped_reuse` /
`object_uploads_skipped_reuse` (a late copy may still follow).

Also the store's side of `admission.load` (load or recompute): `tier_costs`, what each
lower tier delivered to promotions (the context's `tier_estimates`), sent to engines with
every step reply (connector/load_admission.py decides there).

With `chain` (tiers/chain_admission.py) a tier also gets, at once, every chunk whose
prefix ends within `head_tokens` of its request (the engine sends commits' positions): a
prefix is read back from its first chunk on, so its head is worth a write even before
any reuse shows (on Mooncake's chat trace: docs/real-traffic.md). A chunk under a live
retention (kv.retain) passes every test: the tier below is where it outlives the arena.

Tiers are asked by name: `admission.store.<tier name>: reuse` (or `chain`) puts a tier
under the test (a tier the config does not name admits everything).

Owns: `_reuse` (None when no tier uses `reuse`), the tiers under the test, the
`<counter>_skipped_reuse` counters. Called under the store lock (the sketch is not
thread-safe). Must not: queue copies itself (cascade.py does).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvstrata.store.context import StoreContext, logger
from kvstrata.tiers.arena import SlotPool
from kvstrata.tiers.base import LowerTier
from kvstrata.tiers.chain_admission import ChainAdmission
from kvstrata.tiers.estimates import peer_node
from kvstrata.tiers.frequency import ReuseCounter

Items = list[tuple[bytes, int]]


class ReuseAdmission:
    """The reuse test on the cascade's copies."""

    def __init__(
        self, ctx: StoreContext, tiers: Sequence[LowerTier], retained: Callable[[str, bytes], bool] | None = None
    ):
        """`retained(namespace, key)`: whether a live retention (kv.retain, hints.py) keeps
        the chunk: such a chunk passes every test."""
        self._ctx = ctx
        store = ctx.config.admission.store
        self._tested = {tier.name for tier in tiers if getattr(store, tier.name, None) in ("reuse", "chain")}
        self._chained = {tier.name for tier in tiers if getattr(store, tier.name, None) == "chain"}
        self._chain = ChainAdmission(store.head_tokens) if self._chained else None
        self._retained = retained or (lambda namespace, key: False)
        self._reuse = ReuseCounter(store.window, store.min_uses) if self._tested else None
        for counter in ["disk_writes", "object_uploads"] + [tier.counter for tier in tiers if tier.counter]:
            ctx.counters[f"{counter}_skipped_reuse"] = 0
        if self._reuse is not None:
            logger.info(
                "kvstrata node store: admission to disk %s, object %s (min_uses %d within %d uses per namespace)",
                store.disk, store.object, store.min_uses, store.window,
            )  # fmt: skip

    @property
    def estimate(self) -> Callable[[str, bytes], int] | None:
        """The sketch's estimate of a chunk's uses, for the tiers' eviction (None: no sketch)."""
        return self._reuse.estimate if self._reuse is not None else None

    def tier_costs(self) -> dict[str, tuple[float, float, float]]:
        """The tiers' estimates (`disk`, `object`, `peer`) for a step reply. Not the per-peer
        ones (`peer:<node>`): an engine's mirror does not say which peer holds a chunk."""
        return {
            tier: (cost.latency_seconds, cost.bytes_per_second, cost.age_seconds)
            for tier, cost in self._ctx.tier_estimates.costs().items()
            if peer_node(tier) is None
        }

    @property
    def chain(self) -> ChainAdmission | None:
        """Where committed chunks sit in their prefixes (`chain` admission; None without it)."""
        return self._chain

    def note_positions(self, positions: list[tuple[bytes, int]]) -> None:
        """Where committed chunks end in their requests (sent with the commits), for `chain`."""
        if self._chain is not None and positions:
            self._chain.note_positions(positions)

    def admit_commits(self, namespace: str, committed: Items, tiers: Sequence[LowerTier]) -> dict[str, Items]:
        """Count the commits as uses; per tier of `tiers` (those copying at commit), the
        (key, slot) pairs it admits now."""
        if self._reuse is None:
            return {tier.name: committed for tier in tiers}
        keys = [key for key, _ in committed]
        reused = [used or self._retained(namespace, key) for key, used in zip(keys, self._reuse.note(namespace, keys))]
        chained = self._chain.admit(keys, reused) if self._chain is not None else reused
        out = {}
        for tier in tiers:
            if tier.name in self._tested:
                ok = chained if tier.name in self._chained else reused
                admitted = [item for item, passed in zip(committed, ok) if passed]
                out[tier.name] = admitted
                self._ctx.counters[f"{tier.counter}_skipped_reuse"] += len(committed) - len(admitted)
            else:
                out[tier.name] = committed
        return out

    def note_reuse(self, namespace: str, pool: SlotPool, keys: list[bytes], tiers: Sequence[LowerTier]) -> dict[str, Items]:
        """Count HITs and pins as uses; the resident chunks that just became reused, to be
        copied late to the tiers of `tiers` (those copying at commit) that skipped them."""
        if self._reuse is None or not keys:
            return {}
        before = self._reuse.reused(namespace, keys)
        after = self._reuse.note(namespace, keys)
        late: dict[bytes, int] = {}
        for key, was, now in zip(keys, before, after):
            if now and not was and key not in late:
                slot = pool.lookup(key)  # a held slot may be an orphan: copy indexed chunks only
                if slot is not None:
                    late[key] = slot
        items = list(late.items())
        return {tier.name: items for tier in tiers if tier.name in self._tested and items}

    def admit_eviction(self, namespace: str, key: bytes, tiers: Sequence[LowerTier]) -> list[LowerTier]:
        """Of `tiers` (those copying at eviction), the ones an evicted chunk goes to."""
        if self._reuse is None or not tiers:
            return list(tiers)
        # A chunk kept by a live retention is written whatever its uses: the arena evicts
        # it only when it must, and the tier below is where it survives.
        reused = self._reuse.reused(namespace, [key])[0] or self._retained(namespace, key)
        head = self._chain is not None and self._chain.in_head(key)
        admitted = []
        for tier in tiers:
            if tier.name in self._tested and not (reused or (tier.name in self._chained and head)):
                self._ctx.counters[f"{tier.counter}_skipped_reuse"] += 1
            else:
                admitted.append(tier)
        return admitted
