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
Pools holding chunks keep them: taking budget from another namespace's cache would be
cross-namespace eviction, a policy this arena does not have.
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
        take_back_idle(arena.pools.values(), needy, short)
    room = arena.quotas.room(needy)
    if room is not None and room < wanted_bytes:
        tenant = arena.quotas.tenant(needy)
        same = [pool for pool in arena.pools.values() if arena.quotas.tenant(pool.namespace) == tenant]
        take_back_idle(same, needy, wanted_bytes - room)


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
