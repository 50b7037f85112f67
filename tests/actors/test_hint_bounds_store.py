"""Hints made safe to take from HTTP clients, on the node store (issue #51, findings 4, 5, 8,
11): numbers beyond a double's range refused, never raised; a leased prefetch hold pinned
only within the pin quota; pins owned (an unpin ends only its owner's pin); which sources
may pin; leases and deadlines cut to the configured longest."""

from __future__ import annotations

import pytest

from kvstrata.store.node_store import NodeStore
from kvstrata.protocol import StepRequest
from kvstrata.config import load_config
from kvstrata.hint_owners import OPERATOR, request_owner
from tests.utils import FakeClock, key, layout, store_config

SLOT = 4096
HUGE = 10**400  # an int no double holds: float() and math.isfinite() raise OverflowError


@pytest.fixture
def store(tmp_path):
    made = []

    def make(capacity_slots: int = 16, prefetch: dict | None = None):
        raw = store_config(tmp_path, capacity=capacity_slots * SLOT, segment_size=capacity_slots * SLOT)
        raw["prefetch"] = prefetch or {}
        clock = FakeClock()
        made.append(NodeStore(load_config(raw), "node0", clock=clock))
        return made[-1], clock

    yield make
    for node in made:
        node.close()


def commit(node: NodeStore, keys: list[bytes], holder: str = "engine-a") -> None:
    """An engine stores `keys`, then lets them go (resident, unpinned)."""
    ns = layout().namespace
    epoch = node.register(holder, ns, SLOT, layout().describe()).epoch
    pool = node.arena.pools[ns]
    slots = pool.reserve(holder, len(keys))
    node.step(StepRequest(holder, ns, epoch=epoch, commit=list(zip(slots, keys))))
    node.step(StepRequest(holder, ns, epoch=epoch, unpin=slots))


def pinned_keys(node: NodeStore) -> int:
    return sum(1 for hold in node.prefetcher._held.get(layout().namespace, {}).values() if hold.pinned)


@pytest.mark.parametrize(
    "action",
    [
        {"action": "kv.prefetch", "keys": [key(1)], "deadline_seconds": HUGE},
        {"action": "kv.prefetch", "keys": [key(1)], "lease_seconds": HUGE},
        {"action": "kv.prefetch", "keys": [key(1)], "lease_seconds": float("nan")},
        {"action": "kv.retain", "keys": [key(1)], "priority": 50, "ttl_seconds": HUGE},
        {"action": "kv.retain", "keys": [key(1)], "priority": 50, "ttl_seconds": "60"},
        {"action": "kv.prefetch", "keys": [key(1)], "deadline_seconds": [1]},
    ],
)
def test_a_number_no_double_holds_is_refused_and_counted_never_raised(store, action):
    node, _ = store()
    ns = layout().namespace
    commit(node, [key(1)])
    outcomes = node.apply_hints(ns, [action, {"action": "kv.retain", "keys": [key(1)], "priority": 7, "ttl_seconds": 60}])
    assert outcomes[0]["ok"] is False and ("range" in outcomes[0]["error"] or "seconds" in outcomes[0]["error"])
    assert outcomes[1]["ok"] is True and node.retention_priority(ns, key(1)) == 7  # the batch goes on
    assert node.counters["hints_refused"] == 1
    with pytest.raises(ValueError, match="out of range"):  # the direct call names it, as a ValueError
        node.prefetch(ns, [key(1)], 0.0, HUGE)


def test_pinning_a_prefetched_prefix_takes_quota_like_any_pin(store):
    node, _ = store(capacity_slots=16, prefetch={"pin_share": 0.25, "max_share": 1.0})  # 4 slots of pins
    ns = layout().namespace
    keys = [key(i) for i in range(8)]
    commit(node, keys)
    assert node.prefetch(ns, keys) == {"resident": 8}  # leased holds
    report = node.pin_chunks(ns, keys)
    assert report == {"joined": 4, "refused_quota": 4}
    assert pinned_keys(node) == 4
    assert node.pin_chunks(ns, keys[:4]) == {"joined": 4}  # pinned already: no more quota taken


def test_an_unpin_ends_only_its_owners_pin(store):
    node, _ = store(prefetch={"pin_sources": ["operator", "request"]})
    ns = layout().namespace
    commit(node, [key(1), key(2)])
    node.pin_chunks(ns, [key(1), key(2)])  # the operator's (kvstrata warm --pin)
    assert node.apply_hints(ns, [{"action": "pin", "keys": [key(2)], "owner": "tenant-a"}])[0]["ok"]
    out = node.apply_hints(ns, [{"action": "unpin", "keys": [key(1), key(2)], "owner": "tenant-b"}])
    assert out[0] == {"ok": True, "unpinned": 0} and pinned_keys(node) == 2  # not its pins
    out = node.apply_hints(ns, [{"action": "unpin", "keys": [key(1), key(2)]}])  # a request with no salt
    assert out[0]["unpinned"] == 0 and pinned_keys(node) == 2
    assert node.unpin_chunks(ns, [key(1), key(2)]) == 2  # the operator's pins end ...
    assert pinned_keys(node) == 1  # ... key(2) stays pinned for tenant-a
    assert node.unpin_chunks(ns, [key(2)], request_owner("tenant-a")) == 1 and pinned_keys(node) == 0


def test_requests_may_not_pin_unless_the_config_says_so(store):
    node, _ = store()
    ns = layout().namespace
    commit(node, [key(1)])
    out = node.apply_hints(ns, [{"action": "pin", "keys": [key(1)]}])
    assert out[0] == {"ok": True, "refused_source": 1} and pinned_keys(node) == 0
    assert node.counters["prefetch_refused_source"] == 1
    assert node.pin_chunks(ns, [key(1)], OPERATOR) == {"resident": 1}


def test_a_prefetch_lease_of_years_is_cut_to_the_longest_allowed(store):
    node, clock = store(prefetch={"max_lease_seconds": 60, "max_deadline_seconds": 30, "max_share": 1.0})
    ns = layout().namespace
    commit(node, [key(1), key(2)])
    years = {"action": "kv.prefetch", "keys": [key(1), key(2)], "lease_seconds": 3e7, "deadline_seconds": 3e7}
    out = node.apply_hints(ns, [years])
    assert out[0]["ok"] and node.counters["prefetch_lease_cut"] == 1
    assert max(node.prefetch_holds(ns).values()) <= 90
    clock.advance(91)
    assert node.prefetch_holds(ns) == {}  # the namespace's prefetch budget is free again


def test_a_batch_names_a_bounded_number_of_keys(store):
    node, _ = store()
    ns = layout().namespace
    many = [key(i) for i in range(40000)]
    out = node.apply_hints(ns, [{"action": "kv.retain", "keys": many, "priority": 5, "ttl_seconds": 60}] * 2)
    assert out[0]["ok"] and not out[1]["ok"] and "over the" in out[1]["error"]


def test_one_tenant_cannot_fill_the_retention_table_for_the_others(store):
    node, _ = store(prefetch={"max_retained_chunks": 100, "retain_share": 0.5})
    spaces = {}
    for tenant in ("a", "b"):
        lay = layout(prefix=tenant)
        node.register(f"engine-{tenant}", lay.namespace, SLOT, lay.describe())
        spaces[tenant] = lay.namespace
    made_up = [key(100_000 + i) for i in range(100)]  # in no tier
    flood = node.apply_hints(spaces["a"], [{"action": "kv.retain", "keys": made_up, "priority": 90, "ttl_seconds": 3600}])
    assert flood[0]["retained"] == 50 and flood[0]["refused_full"] == 50  # its own share, no more
    theirs = node.retain(spaces["b"], [key(i) for i in range(30)], 50, 60)
    assert theirs["retained"] == 30 and theirs["refused_full"] == 0


def test_retentions_made_before_a_namespace_tenant_is_known_count_in_its_share(store):
    """Found by the simulation (kvstrata/_dev/sim/hints.py): a store learns a namespace's
    tenant at its first registration, so retentions that reach it before (a restarted
    store, hints arriving before the engine registered again) were counted under no
    tenant, and the tenant then got a whole share more on top."""
    node, _ = store(prefetch={"max_retained_chunks": 100, "retain_share": 0.5})
    lay = layout(prefix="a")
    early = node.retain(lay.namespace, [key(i) for i in range(40)], 50, 60)  # no engine registered yet
    node.register("engine-a", lay.namespace, SLOT, lay.describe())
    late = node.retain(lay.namespace, [key(100 + i) for i in range(40)], 50, 60)
    assert early["retained"] + late["retained"] == 50  # the tenant's share, no more
    assert len(node.hints._retention) == 50


def test_retentions_of_a_namespace_whose_tenant_is_not_known_leave_room_in_every_share(store):
    """Found by the simulation's 10^7-event run (seed 124): a restarted store knew one of a
    tenant's namespaces (its engine had registered again) and not yet another (that
    engine's hints came first). The unknown namespace's retentions were admitted against
    no tenant's share, and once it registered the tenant held 13 of a share of 12."""
    node, _ = store(prefetch={"max_retained_chunks": 100, "retain_share": 0.5})
    known, unknown = layout(model="tiny-a", prefix="a"), layout(model="tiny-b", prefix="a")
    node.register("engine-1", known.namespace, SLOT, known.describe())
    assert node.retain(known.namespace, [key(i) for i in range(40)], 50, 60)["retained"] == 40
    early = node.retain(unknown.namespace, [key(100 + i) for i in range(40)], 50, 60)  # not registered yet
    assert early["retained"] == 10  # what the busiest known tenant leaves of a share
    node.register("engine-2", unknown.namespace, SLOT, unknown.describe())
    assert node.hints._retention.tenant_count(known.namespace) == 50  # the tenant's share, no more
    other = layout(model="tiny-c", prefix="b")  # another tenant still gets its own share
    node.register("engine-3", other.namespace, SLOT, other.describe())
    assert node.retain(other.namespace, [key(200 + i) for i in range(60)], 50, 60)["retained"] == 50
