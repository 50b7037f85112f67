"""The node store's purge: a namespace leaves every tier, and so does the work in flight for it.

A purge (an engine's `reset_prefix_cache(reset_connector=True)`, `kvstrata purge`) is how
users invalidate KV, e.g. after an in-place weight update or an RL weight sync: once it
returns, no engine may be served a byte stored before it. I/O already queued for the
namespace must not bring such bytes back, so a purge starts a new *generation* of its
namespace. Every background job notes the generation when it is queued (under the store
lock) and commits nothing if it changed by the time it lands:
- a disk write (lower.py) hands the disk tier's generation to `write_many`, which
  checks it under the tier's lock (`DiskTier.purge` bumps it);
- a promotion (promotion.py) releases its slots instead of committing them;
- an upload (object_lower.py) records nothing, and the bucket's purge starts only once the
  uploads queued before it have ended, so it deletes what they put;
- a sweep (object_index.py) records nothing for a namespace purged since its snapshot, or
  whose bucket purge had not ended when it began to list.

Long purges stay off the store lock: the arena drops its index (memory only), the disk
tier unlinks the namespace's files (`DiskTier.purge`: no I/O per chunk; the last design
wiped one header per chunk under the lock, ~109 us each; the files are closed, which frees
their blocks, on the disk I/O pool), and the bucket is emptied on the object I/O pool.

Owns: the order of a purge (generation, arena, listeners, each lower tier in turn) and the
listeners told of one (`on_purge`: hints.py forgets the namespace's holds and
retentions). The generations themselves are the store's (context.py: `Generations`),
since every background job reads them; the bucket's purge machinery is the object
tier's (object_lower.py).
Invariants: a namespace's generation only grows, under the store lock; a job queued under
generation g commits only if the generation is still g, checked under the lock it commits
under. After a purge's in-flight work settles, nothing of the namespace stored before it
is in the arena, on disk, in the bucket or in the change log.
Must not: do the tiers' I/O itself; it calls the tiers' own purges.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvstrata.store.context import StoreContext
from kvstrata.tiers.base import LowerTier


class Purges:
    """Purging a namespace from every tier, work in flight included."""

    def __init__(self, ctx: StoreContext, tiers: Sequence[LowerTier]):
        self._ctx = ctx
        self._tiers = tiers
        self.on_purge: list[Callable[[str], None]] = []  # told of each purge, under the lock
        # Work in flight that a purge kept from landing: chunks of promotions.
        ctx.counters.update(promotions_purged=0)

    def purge(self, namespace: str) -> int:
        """Drop a namespace from every tier; returns the arena and disk chunks dropped (under the lock)."""
        generation = self._ctx.generations.bump(namespace)
        pool = self._ctx.arena.pools.get(namespace)
        removed = pool.purge() if pool is not None else 0
        for listener in self.on_purge:  # hints.py: its prefetch holds, pins and retentions
            listener(namespace)
        for tier in self._tiers:
            removed += tier.purge(namespace, generation)
        return removed

    def busy(self) -> bool:
        """Whether a tier's purge work is due or running (`wait_io`; callers hold the lock)."""
        return any(tier.busy() for tier in self._tiers)
