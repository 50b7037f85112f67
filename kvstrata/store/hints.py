"""The node store's side of KV hints: retain, pin and unpin, and one call that applies a batch.

Hints come from engines (a request's `kv_hints`, or its `kv_transfer_params` on a vLLM
without them: connector/hints.py turns them into chunk keys), from `kvstrata warm` and
from Python (`kvstrata.hints`). They are advice: a hint that is malformed, over its
tenant's quota or about a namespace this store does not know is refused with a reason and
counted, and nothing a hint does can fail an engine's request.

- `kv.prefetch` (prefetch.py): bring a prefix into the arena and hold it for its first use.
- `kv.retain`: a priority (0-100) and a TTL for chunks: until it runs out, the arena and
  the disk evict every chunk of lower priority first (tiers/retention.py). Kept by key, so
  chunks retained before they are stored are protected from their commit on.
- `pin` / `unpin`: hold chunks in the arena until unpinned, within the tenant's pin quota
  (`prefetch.pin_share`); chunks on a lower tier are promoted first. Each pin has an owner
  (hint_owners.py): an `unpin` ends only its owner's pin; `prefetch.pin_sources` says who
  may pin (requests may not, by default).

Bounds (what makes hints safe to take from HTTP clients): every number checked finite
(hint_bounds.py), TTLs, leases and deadlines cut to their configured longest (counted),
`MAX_HINT_KEYS` keys per batch of actions (one request's), a tenant's retentions within
`prefetch.retain_share` of the table; anything else a hint gets wrong is refused and
counted, never raised.

The action names and the typed action are the engine<->store contract's
(kvstrata/protocol.py: `HintAction`); this module applies them.

Owns: the retention table (`_retention`), the `hints_*` and `retain_*` counters, the
arena pools' and the lower tiers' retention-aware eviction orders (installed at a
namespace's first retention). Listens to purges (`forget`).
Invariants: every call here runs under the store lock; a hint never raises out of
`apply_hints`; a purge forgets the namespace's retentions, pins and prefetch holds.
Must not: move chunks itself (prefetch.py and promotion.py do), or import vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvstrata.hint_bounds import seconds
from kvstrata.hint_owners import OPERATOR, request_owner
from kvstrata.namespaces import check_namespace
from kvstrata.protocol import (
    ACTIONS,
    MAX_HINT_KEYS,
    PIN_ACTION,
    PREFETCH_ACTION,
    RETAIN_ACTION,
    UNPIN_ACTION,
    HintAction,
)
from kvstrata.store.context import StoreContext
from kvstrata.store.prefetch import Prefetch, _check_keys
from kvstrata.tiers.arena import SlotPool
from kvstrata.tiers.base import LowerTier
from kvstrata.tiers.retention import MAX_PRIORITY, RetentionOrder, RetentionTable

__all__ = ["ACTIONS", "MAX_HINT_KEYS", "Hints"]


class Hints:
    """Retention, pins and the hint batch call."""

    def __init__(self, ctx: StoreContext, prefetch: Prefetch, tiers: Sequence[LowerTier]):
        self._ctx = ctx
        self._prefetch = prefetch
        self._tiers = tiers
        limits = ctx.config.prefetch
        tenant_of = ctx.arena.quotas.tenant  # a tenant's retentions hold `retain_share` of the table at most
        self._retention = RetentionTable(ctx.clock, limits.max_retained_chunks, tenant_of, limits.retain_share)
        self._retention.listeners.append(self._retention_changed)
        ctx.counters.update(
            hints_applied=0,  # actions applied (some of their chunks may still be refused)
            hints_refused=0,  # actions refused whole: malformed, unknown action, bad namespace
            retain_chunks=0,  # chunks given a retention
            retain_refused_full=0,  # retentions refused: the table, or the tenant's `retain_share` of it, is full
            retain_ttl_cut=0,  # retentions whose TTL was cut to `max_retain_seconds`
            unpins=0,
        )

    # --- the calls ----------------------------------------------------------------------

    def retain(self, namespace: str, keys: Sequence[bytes], priority: int, ttl_s: float) -> dict[str, int]:
        """Keep `keys` for `ttl_s` seconds at `priority` (1-100; higher is evicted later): the
        arena and the disk evict every chunk of lower priority first; priority 0 ends their
        retention. A bad argument is a ValueError naming it; a TTL over
        `prefetch.max_retain_seconds` is cut to it."""
        check_namespace(namespace)
        keys = _check_keys(keys)
        if isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= MAX_PRIORITY:
            raise ValueError(f"retain priority must be an integer 0 to {MAX_PRIORITY}, got {priority!r}")
        ttl_s = seconds(ttl_s, "retain ttl", positive=True)
        report = {"retained": 0, "refused_full": 0, "ttl_cut": 0}
        longest = self._ctx.config.prefetch.max_retain_seconds
        if ttl_s > longest:
            ttl_s, report["ttl_cut"] = longest, len(keys)
        with self._ctx.lock:
            if priority == 0:
                self._retention.release(namespace, keys)
                return report
            self._install_retention(namespace)  # first: the orders hear this retention's keys
            refused = self._retention.retain(namespace, keys, priority, ttl_s)
            report["retained"], report["refused_full"] = len(keys) - refused, refused
            counters = self._ctx.counters
            counters["retain_chunks"] += report["retained"]
            counters["retain_refused_full"] += refused
            counters["retain_ttl_cut"] += report["ttl_cut"]
        return report

    def pin_chunks(self, namespace: str, keys: Sequence[bytes], owner: str = OPERATOR) -> dict[str, int]:
        """Hold `keys` in the arena until `owner` unpins them (or a purge), promoting those on
        a lower tier; within the tenant's pin quota (`refused_quota` past it), and only for
        the sources `prefetch.pin_sources` names (`refused_source` otherwise)."""
        check_namespace(namespace)
        return self._prefetch.pin(namespace, _check_keys(keys), owner)

    def unpin_chunks(self, namespace: str, keys: Sequence[bytes], owner: str = OPERATOR) -> int:
        """End `owner`'s pins of `keys` (chunks it did not pin are ignored; a chunk others
        pinned too stays held for them); how many of its pins ended."""
        check_namespace(namespace)
        ended = self._prefetch.unpin(namespace, _check_keys(keys), owner)
        with self._ctx.lock:
            self._ctx.counters["unpins"] += ended
        return ended

    def apply_hints(self, namespace: str, actions: Sequence[HintAction | Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Apply a batch of hint actions to one namespace; one outcome per action, in order.

        An action: a `HintAction` (kvstrata/protocol.py) or its wire form `{"action":
        "kv.prefetch" | "kv.retain" | "pin" | "unpin", "keys": [...], "priority": int,
        "ttl_seconds": float, "lease_seconds": float, "deadline_seconds": float, "owner":
        str}` (what each action needs; `owner`: the request's tag, its pins' owner is
        `request:<tag>`, hint_owners.py: whoever sends a batch, its pins are a request's).
        A malformed one gets `{"ok": False, "error": why}` and is counted
        (`hints_refused`); this call never raises for an action. The batch's actions name
        `MAX_HINT_KEYS` keys at most together."""
        outcomes: list[dict[str, Any]] = []
        counters = self._ctx.counters
        budget = [MAX_HINT_KEYS]
        for index, action in enumerate(actions if isinstance(actions, Sequence) else ()):
            try:
                outcomes.append({"ok": True, **self._apply(namespace, action, budget)})
                with self._ctx.lock:
                    counters["hints_applied"] += 1
            except Exception as exc:  # noqa: BLE001 - a hint is advice: refused and counted, never raised
                with self._ctx.lock:
                    counters["hints_refused"] += 1
                outcomes.append({"ok": False, "error": f"hint action {index}: {type(exc).__name__}: {exc}"[:500]})
        return outcomes

    def retention_priority(self, namespace: str, key: bytes) -> int:
        """A chunk's live retention priority, 0 if none (tools, tests)."""
        return self._retention.priority(namespace, key)

    # --- internals ----------------------------------------------------------------------

    def _apply(self, namespace: str, action: HintAction | Mapping[str, Any], budget: list[int]) -> dict[str, Any]:
        if not isinstance(action, HintAction):
            action = HintAction.from_wire(action)  # a ValueError naming what is wrong
        keys = action.keys
        if len(keys) > budget[0]:
            raise ValueError(f"{len(keys)} keys: over the {budget[0]} this batch may still name (at most {MAX_HINT_KEYS})")
        budget[0] -= len(keys)
        owner = request_owner(action.owner)  # a batch of hints is a request's: never the operator's
        if action.action == PREFETCH_ACTION:
            return self._prefetch.prefetch(namespace, keys, action.deadline_seconds, action.lease_seconds)
        if action.action == RETAIN_ACTION:
            return self.retain(namespace, keys, action.priority, action.ttl_seconds)
        if action.action == PIN_ACTION:
            return self.pin_chunks(namespace, keys, owner)
        if action.action == UNPIN_ACTION:
            return {"unpinned": self.unpin_chunks(namespace, keys, owner)}
        raise ValueError(f"unknown action {action.action!r:.40} (known: {', '.join(ACTIONS)})")

    def _install_retention(self, namespace: str, pool: SlotPool | None = None) -> None:
        """The namespace's pool (and the lower tiers) evict retained chunks last, from its
        first retention on (callers hold the lock)."""
        pool = pool or self._ctx.arena.pools.get(namespace)
        table = self._retention
        if pool is not None and not isinstance(pool.policy, RetentionOrder):
            pool.policy = RetentionOrder(pool.policy, pool.key_at, lambda key: table.entry(namespace, key), table.clock)
        for tier in self._tiers:
            tier.set_eviction_hints(retention=table)  # the disk wraps its order and listens to the table

    def _retention_changed(self, namespace: str, keys: list[bytes]) -> None:
        """A table listener: the arena's order moves the slots whose keys' retention changed
        (the lower tiers listen for themselves). Called under the store lock, by retain and purges."""
        pool = self._ctx.arena.pools.get(namespace)
        if pool is not None and isinstance(pool.policy, RetentionOrder):
            for key in keys:
                slot = pool.lookup(key)
                if slot is not None:
                    pool.policy.refresh(slot)

    def step(self, namespace: str, pool: SlotPool, used: list[bytes]) -> None:
        """Each engine step (control.py): held chunks it used end their prefetch hold;
        a pool made after its namespace's first retention gets the retention order."""
        self._prefetch.used(namespace, pool, used)
        if self._retention.has(namespace) and not isinstance(pool.policy, RetentionOrder):
            self._install_retention(namespace, pool)

    def forget(self, namespace: str) -> None:
        """A purge (purges.py): the namespace's chunks are gone, and so are its holds and retentions."""
        self._prefetch.purged(namespace)
        self._retention.forget_namespace(namespace)
