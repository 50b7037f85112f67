"""Idle pools give their segments back to the arena's budget when another pool needs it.

Why: a pool grows segment by segment out of one budget shared by every namespace, and
kept its segments for as long as the arena lived. A purged namespace (every connector
reset purges the old cache generation's; a model or tenant that left) then held budget
it would never use again, and once the budget was handed out a new namespace got no
slot: its engine stored nothing until the store restarted (issue 50).

Rule: a pool gives its segments back only when it is wholly idle (`is_idle`):
every slot free, so none is indexed, reserved, pinned, an orphan held by a copy, or
waiting for a watcher's acknowledgement (deferred reuse). No engine may then read or
write any of its bytes: a HIT answered from a mirror names a slot that is indexed,
orphaned or awaiting reuse until the engine's hold or acknowledgement reaches the store.
The files are unlinked; a worker that still maps one keeps a mapping of a file no one
writes again. The pool's later segments take new segment numbers (never reused), so
their files have new names and their slots new numbers: an engine still watching the
namespace, with the same geometry, resolves a new slot to the new file, never to a
mapping it cached of an old one.

When: only when a pool needs budget and the arena (or its tenant's quota) has none left
(`Arena.grant_slots`), under the store's lock like every arena call; O(pools) checks,
O(segments) unlinks.

Abandoned pools are drained first. A pool that holds chunks but that no engine watches
(every engine of its namespace stopped or lost its lease) and no engine reserved in used
to keep its budget for good: the matrix's TP 2 engine filled the 4 MiB arena, stopped,
and every TP 1 engine after it stored nothing (issue 50; the same for a model that left
a node, then another model). Now, when the budget is short after idle pools gave theirs
back, such a pool evicts its unpinned chunks (down the cascade, as any eviction:
write-back to disk or the bucket where configured), at most `DRAIN_PER_CALL` a call to
bound the lock's hold; once it is wholly idle (write-backs finished, pins let go) it
gives its segments back like any idle pool, at that call or a later one. No watcher
means no engine answers a HIT from a mirror of it (rule 3: an engine whose lease ended
was dropped as a watcher, and trusts its mirror for half a lease at most), and pinned
slots are never evicted. Pools that an engine watches keep their chunks: between live
namespaces the budget is first come, first served (tenant quotas divide it:
docs/config.md).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

logger = logging.getLogger(__name__)


def make_room(arena: Any, needy: str, wanted_bytes: int) -> None:
    """Before `needy`'s pool grows by `wanted_bytes`: if the arena's budget is short, idle
    pools of any namespace give theirs back; if its tenant's quota is short, idle pools of
    the same tenant do (a tenant's purged generations hold its quota)."""
    short = wanted_bytes - (arena.capacity - arena.allocated_bytes)
    if short > 0:
        reclaim(arena.pools.values(), needy, short)
    room = arena.quotas.room(needy)
    if room is not None and room < wanted_bytes:
        tenant = arena.quotas.tenant(needy)
        same = [pool for pool in arena.pools.values() if arena.quotas.tenant(pool.namespace) == tenant]
        reclaim(same, needy, wanted_bytes - room)


def reclaim(pools: Iterable[Any], needy: str, wanted_bytes: int) -> int:
    """Idle pools give back; if that is short, abandoned pools drain (module docstring) and
    those that became idle at once give back too. Returns the bytes given back."""
    pools = list(pools)
    freed = take_back_idle(pools, needy, wanted_bytes)
    if freed < wanted_bytes and drain_abandoned(pools, needy):
        freed += take_back_idle(pools, needy, wanted_bytes - freed)
    return freed


# Chunks an abandoned pool evicts per call at most: the store's lock is held meanwhile.
DRAIN_PER_CALL = 1024


def is_abandoned(pool: Any) -> bool:
    """Chunks but no engine: no watcher (no mirror answers HITs from it) and no reservation."""
    return bool(pool._slot_of) and pool.reuse.watchers == 0 and not pool._reserved


def drain_abandoned(pools: Iterable[Any], needy: str, limit: int | None = None) -> int:
    """Evict up to `limit` (default `DRAIN_PER_CALL`) unpinned chunks of abandoned pools
    other than `needy`'s, least recently used first within a pool; returns how many."""
    limit = DRAIN_PER_CALL if limit is None else limit
    evicted = 0
    for pool in pools:
        if pool.namespace == needy or not is_abandoned(pool):
            continue
        before = evicted
        while evicted < limit and pool._evict_one():
            evicted += 1
        if evicted > before:
            logger.info(
                "kvstrata arena: namespace %s has no engine; evicted %d chunks to make room for namespace %s",
                pool.namespace, evicted - before, needy,
            )  # fmt: skip
        if evicted >= limit:
            break
    return evicted


def take_back_idle(pools: Iterable[Any], needy: str, wanted_bytes: int) -> int:
    """Give back the segments of idle pools other than `needy`'s until `wanted_bytes`
    came back (whole pools, so possibly more); returns the bytes given back."""
    freed = 0
    for pool in list(pools):
        if freed >= wanted_bytes:
            break
        if pool.namespace == needy:
            continue
        got = give_back(pool)
        if got:
            logger.info("kvstrata arena: idle namespace %s gave back %d bytes for namespace %s", pool.namespace, got, needy)
        freed += got
    return freed


def is_idle(pool: Any) -> bool:
    """Every slot of the pool free: nothing indexed, reserved, pinned, orphaned or awaiting
    an acknowledgement (deferred reuse), so no engine may still read or write a slot."""
    return (
        len(pool._free) == pool.num_slots
        and not pool._slot_of and not pool._reserved and not pool._pins
        and not pool._orphans and not len(pool.reuse)
    )  # fmt: skip


def give_back(pool: Any) -> int:
    """Unlink every segment of an idle pool and return its budget; the bytes given back.
    Its segment numbers are not reused (`SlotPool._next_segment`)."""
    if not pool.segments or not is_idle(pool):
        return 0
    slots = pool.num_slots
    pool.close()
    pool._free = []
    pool.num_slots = 0
    pool.given_back += 1
    pool.arena.return_slots(pool.geometry.slot_bytes, slots, pool.namespace)
    return slots * pool.geometry.slot_bytes
