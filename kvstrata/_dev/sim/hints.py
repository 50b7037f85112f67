"""KV hints in the simulation (issue #51, item 3): what changes who holds a slot besides the
engines -- prefetch holds and their leases, pins and unpins with their owners, retentions --
from requests of two tenants and from an operator, and purges of one tenant's namespace.

Two ways in, both the product's own:
- a request's hints: an engine's request arrives with `kv_transfer_params["kv_hints"]`
  (the envelope an HTTP client sends), the real `StrataManager.on_new_request` parses and
  bounds it (connector/hints.py) and sends it with its client's `apply_hints`, an
  asynchronous call in production: queued here (`HintCall`) and applied by the store at a
  later event (`act_hints`), in the order sent;
- an operator's calls (`kvstrata warm [--pin]`, the store's Python and Ray calls):
  `NodeStore.prefetch`, `pin_chunks`, `unpin_chunks`, `retain` (`act_warm`), whose bad
  arguments (a number beyond a double's range among them) must be a ValueError naming them.

What must hold (`check_hints`, after every event, and at each hint call):
- a tenant's pins (held or on their way) never exceed its pin quota: `prefetch.pin_share`
  of its `quotas` cpu bytes, else of the arena (read from the config, not the code);
- a tenant's retentions never exceed `prefetch.retain_share` of `max_retained_chunks`, the
  node's never `max_retained_chunks`, and none outlives `max_retain_seconds`;
- no prefetch hold (leased) outlives `max_deadline_seconds + max_lease_seconds` from now;
- an `unpin` (a request's or the operator's) ends only its own owner's pins;
- what one request's hints send to the store is within `hint_max_actions` actions and
  `hint_max_tokens` keys (the engine's bounds, checked before any hashing);
- a hint never raises into vLLM (an exception out of `on_new_request`: `World.apply`);
- the arena evicts a retained chunk only when none of a lower priority could go
  (`watch_evictions`);
- a purge of one namespace leaves every other namespace's pins and retentions as they were.

Owns: the queued hint calls' delivery and the checks above; the world (world.py) mixes it in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvstrata.hint_owners import OPERATOR, request_owner
from kvstrata.keys import key_hash
from kvstrata.protocol import UNPIN_ACTION
from kvstrata._dev.sim.disturbances import PurgeWatch

HUGE = 10**400  # an integer beyond a double's range: float() of it raises OverflowError
EPSILON = 1e-6
LEASES = (0.5, 2.0, 6.0, 1e7)  # seconds a prefetch asks; past `max_lease_seconds` it is cut
DEADLINES = (0.0, 0.5, 50.0)
TTLS = (1.0, 5.0, 1e6)
SALTS = ("", "a", "b")  # a request's `cache_salt`: its pins' owner on the store


@dataclass
class HintCall:
    """An engine's `apply_hints` call on its way to the store."""

    engine: int
    namespace: str
    actions: list[Any]  # protocol.HintAction


class HintActions:
    """Mixin of `World` (world.py): the hint actions and their checks."""

    config: Any
    store: Any
    hint_calls: list[HintCall]

    # --- a request's hints (the connector's path) --------------------------------------------

    def act_hint(self, e: int, kind: int, p: int, arg: int) -> bool:
        """A request of prompt `p` arrives at engine `e` with KV hints about its own prompt
        (and, one time in seven, more actions than a request may carry, about the next prompts,
        whole or their first position):
        prefetch with a lease, pin, unpin or retain; numbers drawn from `arg`, sometimes
        out of every bound (a lease of 10**400 seconds)."""
        if not self.config.hints:
            return False
        engine = self._engine(e)
        if engine is None or len(engine.waiting) >= 6:
            return False
        count = 4 if arg % 7 == 0 else 1
        whole = (arg >> 3) & 1  # the further actions name whole prompts (many hashes), or one position each
        actions = [self._hint_action(kind + i, p + i, arg >> i, i, i == 0 or whole) for i in range(count)]
        engine.arrive(self.prompts[p % len(self.prompts)], {"kv_hints": {"protocol_version": 1, "actions": actions}})
        return True

    def _hint_action(self, kind: int, p: int, arg: int, n: int, whole: bool) -> dict:
        hashes = self.block_hashes(p)
        payload: dict[str, Any] = {"block_hashes": hashes if whole else hashes[:1], "cache_salt": SALTS[arg % 3]}
        action_type = ("kv.prefetch", "pin", "unpin", "kv.retain")[kind % 4]
        if action_type == "kv.prefetch":
            payload["lease_seconds"] = HUGE if arg % 13 == 0 else LEASES[(arg >> 2) % 4]
            payload["deadline_seconds"] = DEADLINES[(arg >> 4) % 3]
        elif action_type == "kv.retain":
            payload["priority"] = 1 + arg % 100
            payload["ttl_seconds"] = HUGE if arg % 11 == 0 else TTLS[(arg >> 3) % 3]
        return {"action_id": f"h{n}", "action_type": action_type, "action_version": "1", "payload": payload}

    def send_hints(self, engine: Any, namespace: str, actions: list[Any]) -> None:
        """An engine's manager sends one request's hints (SimClient.apply_hints): within the
        engine's bounds, else the bound was not applied before hashing."""
        limits = self.kv_config.prefetch
        hashes = sum(len({key_hash(key) for key in action.keys}) for action in actions)  # (a key per KV group)
        if len(actions) > limits.hint_max_actions or hashes > limits.hint_max_tokens:
            self.violation(
                f"{engine.holder}: one request's hints sent {len(actions)} actions naming {hashes} block hashes "
                f"(at most {limits.hint_max_actions}, {limits.hint_max_tokens})"
            )
        self.hint_calls.append(HintCall(engine.index, namespace, actions))

    def act_hints(self) -> bool:
        """The store applies the oldest hint call on its way (a hint call ends no lease)."""
        if not self.hint_calls:
            return False
        call = self.hint_calls.pop(0)
        unpinning = {request_owner(a.owner) for a in call.actions if a.action == UNPIN_ACTION}
        before = pins_by_owner(self.store, call.namespace)
        outcomes = self.store.apply_hints(call.namespace, call.actions)
        for action, outcome in zip(call.actions, outcomes):
            if not outcome.get("ok", False):
                self.violation(f"hint {action.action} of engine {call.engine} refused: {outcome.get('error')}")
        self._check_unpins(call.namespace, before, unpinning, "a request's hints")
        return True

    # --- the operator -----------------------------------------------------------------------------

    def act_warm(self, t: int, kind: int, p: int, arg: int) -> bool:
        """`kvstrata warm` (and the store's Python calls) on tenant `t`'s namespace: prefetch,
        pin, unpin or retain prompt `p`; one time in eleven with a number beyond a double's
        range, which must be refused with a ValueError (what the CLI prints)."""
        if not self.config.hints:
            return False
        namespace = self.namespaces[t % len(self.namespaces)]
        if namespace not in self.store.arena.pools:
            return False
        keys = self.prompts[p % len(self.prompts)]
        bad = arg % 11 == 0
        store, kind = self.store, kind % 4
        calls = (
            lambda: store.prefetch(namespace, keys, DEADLINES[arg % 3], HUGE if bad else LEASES[(arg >> 2) % 4]),
            lambda: store.pin_chunks(namespace, keys),
            lambda: store.unpin_chunks(namespace, keys),
            lambda: store.retain(namespace, keys, 1 + arg % 100, HUGE if bad else TTLS[(arg >> 3) % 3]),
        )
        bad = bad and kind in (0, 3)
        before = pins_by_owner(store, namespace)
        try:
            calls[kind]()
        except ValueError:
            if not bad:
                self.violation(f"an operator's {('prefetch', 'pin', 'unpin', 'retain')[kind]} refused good arguments")
        except Exception as exc:  # noqa: BLE001 - bad input must be a ValueError naming it
            self.violation(f"an operator's call raised {exc!r} (bad input must be a ValueError naming it)")
        else:
            if bad:
                self.violation("an operator's call with a number beyond a double's range was not refused")
        self._check_unpins(namespace, before, {OPERATOR} if kind == 2 else set(), "the operator")
        return True

    def act_purge_tenant(self, t: int) -> bool:
        """`kvstrata purge --namespace` of one tenant's namespace while its engines serve it:
        its holds, pins and retentions go; every other namespace's stay (checked)."""
        namespace = self.namespaces[t % len(self.namespaces)]
        before = self._others(namespace)
        self.store.purge(namespace)
        if self._others(namespace) != before:
            self.violation(f"a purge of {namespace[:8]} changed other namespaces' pins or retentions")
        # (Not a call that expires leases: `served_at` stays. Seed 578 of the 10^7-event run:
        # a crashed engine's slot, a lease after the store last heard of it, was a "leak"
        # because this action claimed the store had just run a call.)
        self.purges.append(PurgeWatch(namespace, set(self.jobs.pending)))
        return True

    def _others(self, namespace: str) -> tuple[dict, dict]:
        """Every other namespace's pins (by owner) and retentions."""
        store = self.store
        pins = {ns: pins_by_owner(store, ns) for ns in store.prefetcher._held if ns != namespace}
        retained = {name: entry for name, entry in store.hints._retention._entries.items() if name[0] != namespace}
        return {ns: owners for ns, owners in pins.items() if owners}, retained

    def _check_unpins(self, namespace: str, before: dict[str, set[bytes]], unpinning: set[str], who: str) -> None:
        after = pins_by_owner(self.store, namespace)
        for owner, keys in before.items():
            if owner not in unpinning and keys - after.get(owner, set()):
                lost = len(keys - after.get(owner, set()))
                self.violation(f"{who} ended {lost} pins of {owner} in {namespace[:8]} (an unpin ends only its owner's)")


def pins_by_owner(store: Any, namespace: str) -> dict[str, set[bytes]]:
    """Owner -> the keys it holds pinned in the arena for `namespace` (not those on their way)."""
    found: dict[str, set[bytes]] = {}
    for key, hold in store.prefetcher._held.get(namespace, {}).items():
        for owner in hold.owners:
            found.setdefault(owner, set()).add(key)
    return found


def watch_evictions(world: Any, store: Any) -> None:
    """Every arena eviction of `store` checked: a retained chunk leaves only when no chunk of
    a lower retention priority could (the pool's unpinned chunks; one evicted with its
    anchor counts as the anchor's), in O(1) per eviction as retention_order.py keeps it."""
    table = store.hints._retention
    for namespace, pool in store.arena.pools.items():
        if "_evict_one" in pool.__dict__:
            continue

        def checked(pool=pool, namespace=namespace, evict_one=pool._evict_one) -> bool:
            def priority(key: bytes) -> int:
                entry = table.entry(namespace, key)
                return 0 if entry is None else entry[0]

            evictable = {slot: priority(key) for slot, key in pool._key_of.items() if slot not in pool._pins}
            before = set(pool._key_of)
            done = evict_one()
            gone = [evictable.get(slot, 0) for slot in before if slot not in pool._key_of]
            if gone and evictable and min(gone) > min(evictable.values()):
                world.violation(
                    f"the arena evicted a chunk retained at priority {min(gone)} of {namespace[:8]} while one "
                    f"at {min(evictable.values())} could go"
                )
            return done

        pool._evict_one = checked


def check_hints(world: Any) -> None:
    """The tenants' shares of pins and retentions, and the caps on leases and TTLs."""
    if not world.config.hints:
        return
    watch_evictions(world, world.store)
    store, config = world.store, world.kv_config
    limits, now = config.prefetch, world.clock()
    prefetch = store.prefetcher
    pins: dict[str, int] = {}
    longest = now + limits.max_deadline_seconds + limits.max_lease_seconds + EPSILON
    for namespace, holds in prefetch._held.items():
        tenant = world.tenant_of.get(namespace)
        for key, hold in holds.items():
            if hold.owners:
                pins[tenant] = pins.get(tenant, 0) + 1
            elif hold.until > longest:
                world.violation(f"a prefetch hold of {namespace[:8]} ends in {hold.until - now:.0f} s, past the longest lease")
    for (namespace, _), want in prefetch._wanted.items():
        tenant = world.tenant_of.get(namespace)
        if want.owners:
            pins[tenant] = pins.get(tenant, 0) + 1
        elif want.until > longest:
            world.violation(f"a prefetch on its way to {namespace[:8]} is held until {want.until - now:.0f} s from now")
    capacity = config.tiers.cpu.capacity
    for tenant, count in pins.items():
        quota = config.quotas.get(tenant)
        share = quota.cpu if quota is not None and quota.cpu is not None else capacity
        cap = int(share * limits.pin_share) // world.slot_bytes
        if count > cap:
            world.violation(f"tenant {tenant!r} holds {count} pins, over its quota of {cap}")
    table = store.hints._retention
    entries: dict[str, int] = {}
    ttl_end = now + limits.max_retain_seconds + EPSILON
    for (namespace, _), (_, until) in table._entries.items():
        tenant = world.tenant_of.get(namespace, namespace)
        entries[tenant] = entries.get(tenant, 0) + 1
        if until > ttl_end:
            world.violation(f"a retention of {namespace[:8]} ends in {until - now:.0f} s, past max_retain_seconds")
    share = int(limits.max_retained_chunks * limits.retain_share)
    for tenant, count in entries.items():
        if count > share:
            world.violation(f"tenant {tenant!r} holds {count} retentions, over its share of {share}")
    if sum(entries.values()) > limits.max_retained_chunks:
        world.violation(f"{sum(entries.values())} retentions, over max_retained_chunks {limits.max_retained_chunks}")
