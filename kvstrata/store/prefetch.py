"""The node store's prefetch: a prefix's chunks brought into the arena before a request asks.

Why: vLLM loads a request's offloaded KV only once the request is scheduled, so a request
queued behind a full batch starts nothing, and its first lookup of a chunk on disk or in
the bucket answers RETRY while the chunk is promoted. A router that knows where a request
is going (or a client that knows what it will ask: `kvstrata warm`, a `kv.prefetch` hint)
can start the move while the request waits, so the engine's first lookup is a HIT.

What a prefetch does, for keys in prefix order: the chunks already in the arena are held
there; the others, up to the first chunk no tier holds (the engine could use nothing past
it), are promoted from disk, a peer or the bucket (promotion.py) and held once they land.
A chunk is held -- pinned by the internal holder `PREFETCH`, which eviction never takes --
until the first engine step that holds or pins it (its first lookup), or until its lease
runs out (`deadline_s + lease_s` after the prefetch was asked), then it is left to normal
eviction. Hint pins (`pin`) are holds with no lease and no release on use, each with its
owners (hint_owners.py): an `unpin` ends only its own owner's pin, the hold ends with its
last owner's unpin (or a purge). Pinning a chunk held for a prefetch takes a pin of the
quota like any other pin: a lease never turns into a pin for free.

Bounds: a lease is at most `prefetch.max_lease_seconds`, a deadline at most
`prefetch.max_deadline_seconds` (longer ones cut, `prefetch_lease_cut`); held and in-flight
chunks of one namespace never exceed `prefetch.max_share` of its pool (`budget`); pins of
one tenant never exceed its pin quota (`quota`), and only `prefetch.pin_sources` may pin
(`source`); a chunk whose source is slower than recomputing it (`admission.load: break_even`, from the tier
estimates and the engines' prefill rates) is not moved (`break_even`); a promotion never
evicts a pinned chunk, so never a held one. Two prefetches of one prefix move it once:
the second finds it held or on its way and extends its lease.

Owns: the holder `PREFETCH`, the holds (`_held`), the chunks on their way for a prefetch
(`_wanted`; `_waiting`: those whose slot is still settling, started at a later engine
step), the `prefetch_*` counters. Listens to promotion.py (`landed`) and is told of each
engine step's uses (`used`, by hints.py) and of purges (`purged`).
Invariants (under the store lock): every hold is exactly one `PREFETCH` pin of its slot,
undone exactly once (used, expired, unpinned, or the namespace purged); a chunk is in at
most one of `_held` and `_wanted`; a purge forgets the namespace's holds and wants.
Must not: read or write a tier itself (promotion.py moves chunks), or block on I/O.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from statistics import median

from kvstrata.hint_bounds import capped, seconds
from kvstrata.hint_owners import may_pin
from kvstrata.keys import key_group
from kvstrata.namespaces import check_namespace
from kvstrata.store.context import StoreContext, logger
from kvstrata.store.promotion import Promotion
from kvstrata.tiers.arena import SlotPool
from kvstrata.tiers.estimates import break_even

PREFETCH = "kvstrata:prefetch"  # internal pin holder: no lease in the arena's table, never expires there
# Why a prefetch left a chunk where it was (`prefetch_refused_<reason>`).
REFUSALS = ("unknown_namespace", "absent", "budget", "quota", "break_even", "no_slot", "failed", "source")


@dataclass
class Hold:
    """A chunk held in the arena for a prefetch or a pin."""

    slot: int
    until: float  # on the store's clock; inf for a pin
    moved: bool  # brought from a lower tier for a prefetch (not already resident)
    owners: set[str] = field(default_factory=set)  # who pinned it: ends with the last one's unpin, or a purge

    @property
    def pinned(self) -> bool:
        return bool(self.owners)


@dataclass
class Want:
    """A chunk on its way into the arena that a prefetch (or pin) holds once it lands."""

    until: float
    owners: set[str] = field(default_factory=set)
    started: bool = True  # False: no slot yet, the ones its promotion evicted are settling (deferred reuse)

    @property
    def pinned(self) -> bool:
        return bool(self.owners)


def _check_keys(keys: object) -> list[bytes]:
    if isinstance(keys, (bytes, str)) or not isinstance(keys, Sequence):
        raise ValueError(f"prefetch keys must be a list of chunk keys (bytes), got {type(keys).__name__}")
    for index, key in enumerate(keys):
        if not isinstance(key, bytes) or len(key) <= 4:
            raise ValueError(f"prefetch key {index} is not a chunk key (block hash + 4-byte group): {key!r:.40}")
    return list(keys)


class Prefetch:
    """Prefetch with a lease, and hint pins, over promotion.py."""

    def __init__(self, ctx: StoreContext, promotion: Promotion):
        self._ctx = ctx
        self._promotion = promotion
        promotion.on_landed.append(self.landed)
        self._held: dict[str, dict[bytes, Hold]] = {}
        self._wanted: dict[tuple[str, bytes], Want] = {}
        self._waiting: dict[str, set[bytes]] = {}  # namespace -> wanted keys with no slot yet (not started)
        self._hold_expiries: list[tuple[float, str, bytes]] = []  # heap over leased holds
        ctx.counters.update(
            prefetch_lease_cut=0,  # prefetches whose lease or deadline was cut to the configured longest
            prefetch_asked=0,  # keys prefetches named
            prefetch_resident=0,  # held where they were: already in the arena
            prefetch_joined=0,  # already held or on their way for an earlier prefetch: lease extended
            prefetch_moved=0,  # brought in from disk, a peer or the bucket, and held
            prefetch_moved_bytes=0,
            prefetch_used=0,  # held chunks an engine held or pinned before their lease ran out
            prefetch_expired_unused=0,  # moved chunks whose lease ran out with no engine using them
            prefetch_expired_unused_bytes=0,
            prefetch_expired_resident=0,  # resident chunks held in vain
            **{f"prefetch_refused_{reason}": 0 for reason in REFUSALS},
        )

    # --- the calls (routers, `kvstrata warm`, hints) ------------------------------------

    def prefetch(
        self, namespace: str, keys: Sequence[bytes], deadline_s: float = 0.0, lease_s: float | None = None
    ) -> dict[str, int]:
        """Bring a prefix's chunks into the arena and hold them for its first lookup.

        `keys`: the prefix's chunk keys in order (a hybrid model's groups in any order,
        each group's in prefix order). `deadline_s`: when the request that will use them is
        expected (seconds from now); `lease_s` (default `prefetch.lease_seconds`): how long
        after that they are held waiting for it. Returns counts of what happened to the
        keys: `resident`, `joined`, `moving`, and `refused_<reason>`; never raises for a
        chunk it cannot bring (a bad argument is a ValueError naming it).
        """
        check_namespace(namespace)
        keys = _check_keys(keys)
        limits = self._ctx.config.prefetch
        deadline_s, deadline_cut = capped(seconds(deadline_s, "prefetch deadline_s"), limits.max_deadline_seconds)
        lease_s = limits.lease_seconds if lease_s is None else seconds(lease_s, "prefetch lease_s", positive=True)
        lease_s, lease_cut = capped(lease_s, limits.max_lease_seconds)
        with self._ctx.lock:
            self._ctx.counters["prefetch_lease_cut"] += deadline_cut or lease_cut
            self.expire_holds()
            return self._prefetch(namespace, keys, self._ctx.clock() + deadline_s + lease_s, owner=None)

    def pin(self, namespace: str, keys: Sequence[bytes], owner: str) -> dict[str, int]:
        """Hold `keys` for `owner` (hint_owners.py) with no lease until it unpins them (or a
        purge), within the tenant's pin quota (`refused_quota` past it), and only for the
        sources `prefetch.pin_sources` names (`refused_source` otherwise). hints.py:
        `pin_chunks` checks the arguments."""
        keys = list(keys)
        with self._ctx.lock:
            if not may_pin(owner, self._ctx.config.prefetch.pin_sources):
                return dict(self._refuse(Counter(), "source", len(keys)))
            self.expire_holds()
            return self._prefetch(namespace, keys, math.inf, owner=owner)

    def unpin(self, namespace: str, keys: Sequence[bytes], owner: str) -> int:
        """End `owner`'s pins of `keys` (chunks it did not pin are ignored; a chunk others
        pinned too stays held for them); how many of its pins ended."""
        ended = 0
        with self._ctx.lock:
            held = self._held.get(namespace, {})
            for key in keys:
                hold = held.get(key)
                if hold is not None and owner in hold.owners:
                    hold.owners.discard(owner)
                    if not hold.owners:
                        self._release(namespace, key)
                    ended += 1
                want = self._wanted.get((namespace, key))
                if want is not None and owner in want.owners:
                    want.owners.discard(owner)
                    if not want.owners:
                        del self._wanted[(namespace, key)]  # on its way: it lands unheld
                        self._waiting.get(namespace, set()).discard(key)
                    ended += 1
        return ended

    def prefetch_pending(self, namespace: str) -> int:
        """Chunks of the namespace on their way for a prefetch or pin, or waiting for a slot."""
        with self._ctx.lock:
            pool = self._ctx.arena.pools.get(namespace)
            if pool is not None:
                self._retry_waiting(namespace, pool)
            return sum(1 for ns, _ in self._wanted if ns == namespace)

    def prefetch_holds(self, namespace: str) -> dict[bytes, float]:
        """Chunks held for a prefetch or pin, with the seconds left on each hold (tools, tests)."""
        with self._ctx.lock:
            self.expire_holds()
            now = self._ctx.clock()
            return {key: hold.until - now for key, hold in self._held.get(namespace, {}).items()}

    # --- internals ----------------------------------------------------------------------

    def _prefetch(self, namespace: str, keys: list[bytes], until: float, owner: str | None) -> dict[str, int]:
        """Hold or start moving `keys` (callers hold the lock); the report `prefetch` returns.
        `owner`: who pins them (hint_owners.py), None for a leased prefetch."""
        pinned = owner is not None
        report: Counter[str] = Counter()
        self._ctx.counters["prefetch_asked"] += len(keys)
        pool = self._ctx.arena.pools.get(namespace)
        if pool is None:
            return self._refuse(report, "unknown_namespace", len(keys))
        held = self._held.setdefault(namespace, {})
        room = self._pin_room(namespace, pool) if pinned else self._prefetch_room(namespace, pool)
        sources = self._promotion.sources(namespace, [key for key in keys if pool.lookup(key) is None])
        to_move: dict[bytes, str] = {}
        for index, key in enumerate(keys):
            hold = held.get(key)
            want = self._wanted.get((namespace, key))
            if hold is not None or want is not None:
                entry = hold or want
                if pinned and not entry.pinned:  # a leased hold becomes a pin: it takes quota like any pin
                    if room <= 0:
                        started = self._start(namespace, pool, to_move, until, owner, report)
                        return self._refuse(started, "quota", len(keys) - index)
                    room -= 1
                self._extend(namespace, key, entry, until, owner)
                report["joined"] += 1
                continue
            if key in to_move:
                continue
            slot = pool.lookup(key)
            source = None
            if slot is None:
                tier = sources.get(key)
                if tier is not None:
                    source = tier.name
                else:
                    started = self._start(namespace, pool, to_move, until, owner, report)
                    return self._refuse(started, "absent", len(keys) - index)
            if room <= 0:
                reason = "quota" if pinned else "budget"
                return self._refuse(self._start(namespace, pool, to_move, until, owner, report), reason, len(keys) - index)
            room -= 1
            if source is None:
                self._hold(namespace, pool, key, slot, until, moved=False, owner=owner)
                report["resident"] += 1
            else:
                to_move[key] = source
        return dict(self._start(namespace, pool, to_move, until, owner, report))

    def _start(
        self,
        namespace: str,
        pool: SlotPool,
        to_move: dict[bytes, str],
        until: float,
        owner: str | None,
        report: Counter[str],
    ) -> Counter[str]:
        """Start the promotions of `to_move` (key -> source tier) unless recomputing them is cheaper."""
        if not to_move:
            return report
        owners = set() if owner is None else {owner}
        if owner is None and not self._worth_loading(namespace, pool, to_move):
            return self._refuse(report, "break_even", len(to_move))
        keys = list(to_move)
        self._promotion.promote(namespace, pool, keys)  # joins any promotion in flight
        for key in keys:
            if self._promotion.in_flight(namespace, key):
                self._wanted[(namespace, key)] = Want(until, set(owners))
                report["moving"] += 1
            elif pool.settling:  # the slots it evicted free at the engines' next acknowledgement
                self._wanted[(namespace, key)] = Want(until, set(owners), started=False)
                self._waiting.setdefault(namespace, set()).add(key)
                report["waiting"] += 1
            else:  # every slot pinned
                self._refuse(report, "no_slot", 1)
        return report

    def _retry_waiting(self, namespace: str, pool: SlotPool) -> None:
        """Start the moves that waited for slots once the pool has free ones (each engine
        step acknowledges evictions: deferred reuse); give up on those whose lease ended
        or for which no slot is on its way (callers hold the lock)."""
        waiting = self._waiting.get(namespace)
        if not waiting or not pool.stats()["free"]:
            return
        keys = list(waiting)
        self._promotion.promote(namespace, pool, keys)
        now = self._ctx.clock()
        for key in keys:
            want = self._wanted.get((namespace, key))
            if want is None:
                waiting.discard(key)
            elif self._promotion.in_flight(namespace, key):
                want.started = True
                waiting.discard(key)
            elif not pool.settling or want.until <= now:
                del self._wanted[(namespace, key)]
                waiting.discard(key)
                self._refuse(Counter(), "no_slot", 1)
        if not waiting:
            del self._waiting[namespace]

    def _refuse(self, report: Counter[str], reason: str, count: int) -> Counter[str]:
        if count > 0:
            report[f"refused_{reason}"] += count
            self._ctx.counters[f"prefetch_refused_{reason}"] += count
        return report

    def _worth_loading(self, namespace: str, pool: SlotPool, to_move: dict[bytes, str]) -> bool:
        """Whether loading these chunks beats recomputing them, as `admission.load:
        break_even` decides in the engines (estimates.break_even), with the node's engines'
        median prefill rate; True where anything is unknown (loading measures a tier)."""
        ctx = self._ctx
        admission = ctx.config.admission
        if admission.load != "break_even":
            return True
        rates = [rate for rate in ctx.recompute_rates.values() if rate > 0]
        rate = median(rates) if rates else ctx.config.engine.recompute_tokens_per_second
        layout = ctx.layouts.get(namespace) or {}
        try:
            per_group = dict(zip(layout["group_ids"], layout["tokens_per_block"]))
            blocks = int(layout["blocks_per_chunk"])
        except (KeyError, TypeError, ValueError):
            return True
        by_tier: Counter[str] = Counter()
        by_group: Counter[int] = Counter()
        for key, source in to_move.items():
            by_tier[source] += pool.geometry.slot_bytes
            by_group[key_group(key)] += 1
        tokens = max((count * int(per_group.get(group, 0)) * blocks for group, count in by_group.items()), default=0)
        load, _ = break_even(
            dict(by_tier), tokens, ctx.tier_estimates.costs(), rate, admission.safety_margin, admission.stale_seconds
        )
        return load

    def _prefetch_room(self, namespace: str, pool: SlotPool) -> int:
        """Chunks a prefetch may still hold or move in this namespace (`prefetch.max_share`)."""
        cap = int(pool.max_slots * self._ctx.config.prefetch.max_share)
        leased = sum(1 for hold in self._held.get(namespace, {}).values() if not hold.pinned)
        leased += sum(1 for (ns, _), want in self._wanted.items() if ns == namespace and not want.pinned)
        return cap - leased

    def _pin_room(self, namespace: str, pool: SlotPool) -> int:
        """Chunks pins may still hold for this namespace's tenant (`prefetch.pin_share` of its
        arena quota, else of the arena), over all the tenant's namespaces."""
        arena = self._ctx.arena
        quotas = arena.quotas
        tenant = quotas.tenant(namespace)
        share = quotas.limit(namespace) or arena.capacity
        cap = int(share * self._ctx.config.prefetch.pin_share) // pool.geometry.slot_bytes
        pinned = 0
        for ns, holds in self._held.items():
            if quotas.tenant(ns) == tenant:
                pinned += sum(1 for hold in holds.values() if hold.pinned)
        pinned += sum(1 for (ns, _), want in self._wanted.items() if want.pinned and quotas.tenant(ns) == tenant)
        return cap - pinned

    def _hold(
        self, namespace: str, pool: SlotPool, key: bytes, slot: int, until: float, moved: bool, owner: str | set[str] | None
    ) -> None:
        owners = set(owner) if isinstance(owner, set) else set() if owner is None else {owner}
        pool.pin_slots(PREFETCH, [slot])
        self._held.setdefault(namespace, {})[key] = Hold(slot, math.inf if owners else until, moved, owners)
        if not owners:
            heapq.heappush(self._hold_expiries, (until, namespace, key))

    def _extend(self, namespace: str, key: bytes, entry: Hold | Want, until: float, owner: str | None) -> None:
        """A second prefetch (or a pin) of a chunk held or on its way: the later end wins; a
        pin adds its owner (the caller charged the quota if the entry was not pinned yet)."""
        if owner is not None:
            entry.owners.add(owner)
            entry.until = math.inf
        elif not entry.pinned and until > entry.until:
            entry.until = until
            if isinstance(entry, Hold):
                heapq.heappush(self._hold_expiries, (until, namespace, key))

    def _release(self, namespace: str, key: bytes) -> Hold | None:
        """End a hold: its `PREFETCH` pin is undone, the chunk is left to normal eviction."""
        hold = self._held.get(namespace, {}).pop(key, None)
        pool = self._ctx.arena.pools.get(namespace)
        if hold is not None and pool is not None:
            pool.unpin(PREFETCH, [hold.slot])
        return hold

    def expire_holds(self) -> None:
        """Release the holds whose lease ran out (callers hold the lock)."""
        now = self._ctx.clock()
        while self._hold_expiries and self._hold_expiries[0][0] <= now:
            until, namespace, key = heapq.heappop(self._hold_expiries)
            hold = self._held.get(namespace, {}).get(key)
            if hold is None or hold.pinned or hold.until != until:
                continue  # used, pinned or extended since
            self._release(namespace, key)
            counters = self._ctx.counters
            if hold.moved:
                slot_bytes = self._ctx.arena.pools[namespace].geometry.slot_bytes
                counters["prefetch_expired_unused"] += 1
                counters["prefetch_expired_unused_bytes"] += slot_bytes
            else:
                counters["prefetch_expired_resident"] += 1

    # --- hooks: called by the store's other parts, under the lock -------------------------

    def landed(self, namespace: str, pool: SlotPool, items: Iterable[tuple[bytes, int]], ok: Iterable[bool]) -> None:
        """Promotions ended (promotion.py, before it lets go of their slots): the chunks a
        prefetch wanted are held where the index now has them."""
        if not self._wanted:
            return
        for (key, _), arrived in zip(items, ok):
            want = self._wanted.get((namespace, key))
            if want is None or not want.started:
                continue
            del self._wanted[(namespace, key)]
            slot = pool.lookup(key) if arrived else None
            if slot is None:
                self._refuse(Counter(), "failed", 1)
                continue
            self._hold(namespace, pool, key, slot, want.until, moved=True, owner=want.owners)
            self._ctx.counters["prefetch_moved"] += 1
            self._ctx.counters["prefetch_moved_bytes"] += pool.geometry.slot_bytes

    def used(self, namespace: str, pool: SlotPool, keys: Iterable[bytes]) -> None:
        """An engine step held or pinned `keys` (control.py, after the step's pins):
        their leased holds end, the engine's own pins keep them now. Moves that waited for
        a slot are tried again (the step acknowledged the evictions that free one)."""
        self.expire_holds()
        self._retry_waiting(namespace, pool)
        held = self._held.get(namespace)
        if not held:
            return
        for key in keys:
            hold = held.get(key)
            if hold is not None and not hold.pinned:
                self._release(namespace, key)
                self._ctx.counters["prefetch_used"] += 1

    def purged(self, namespace: str) -> None:
        """The namespace was purged (purges.py): its holds and wants are forgotten."""
        for key in list(self._held.get(namespace, {})):
            self._release(namespace, key)
        self._held.pop(namespace, None)
        for name in [name for name in self._wanted if name[0] == namespace]:
            del self._wanted[name]
        self._waiting.pop(namespace, None)
        logger.debug("kvstrata node store: prefetch holds of namespace %s dropped by a purge", namespace)
