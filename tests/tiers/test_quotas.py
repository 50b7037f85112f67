"""Tenant quotas per tier: a tenant (a `namespace_prefix`) over its quota loses its own
chunks, never another tenant's, and its bytes never exceed the quota after any operation."""

from __future__ import annotations

import tempfile
import uuid
from datetime import datetime, timedelta, timezone

import fsspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstrata.config import ConfigError, ObjectTierConfig, load_config
from kvstrata.tiers.arena import Arena
from kvstrata.tiers.disk import DiskTier
from kvstrata.tiers.object_store import ObjectTier
from kvstrata.tiers.quotas import TenantQuotas
from kvstrata.tiers.records import HEADER_BYTES
from tests.utils import FakeClock, key

SLOT = 4096
# namespace -> (tenant, slot bytes); "c" has no quota and shares the rest.
NAMESPACES = {"a1": ("a", SLOT), "a2": ("a", 2 * SLOT), "b1": ("b", SLOT), "c1": ("c", SLOT)}


# --- the config and the accounting ---------------------------------------------------------


def test_quotas_parse_per_tenant_and_tier_and_refuse_what_they_cannot_mean():
    cfg = load_config({"quotas": {"tenant-a": {"cpu": "1GiB", "object": "2GB"}, "": {"disk": "5MiB"}}})
    assert cfg.tier_quotas("cpu") == {"tenant-a": 1 << 30}
    assert cfg.tier_quotas("disk") == {"": 5 << 20}
    assert cfg.tier_quotas("object") == {"tenant-a": 2 * 10**9}
    assert load_config(None).tier_quotas("cpu") == {}
    assert load_config(cfg.model_dump()) == cfg  # how `kvstrata up` hands the store actor its config
    for bad, named in [
        ({"quotas": {"a": {"gpu": "1GiB"}}}, "quotas.a.gpu: unknown key"),
        ({"quotas": {"a": {"cpu": 0}}}, "quotas.a.cpu"),
        ({"quotas": {"a": {"disk": "lots"}}}, "quotas.a.disk"),
        ({"quotas": ["a"]}, "quotas"),
        ({"quotas": {"x" * 129: {"cpu": 1}}}, "quotas.xxx"),
    ]:
        with pytest.raises(ConfigError, match=named):
            load_config(bad)


def test_bytes_charged_before_a_namespace_has_a_tenant_move_to_it_once():
    quotas = TenantQuotas({"a": 100})
    quotas.charge("ns", 30)  # e.g. a disk slab recovered before any engine registered
    assert quotas.room("ns") is None  # no tenant yet: no quota
    quotas.assign("ns", "a")
    quotas.assign("ns", "b")  # the first assignment stands
    assert quotas.used("a") == 30 and quotas.room("ns") == 70
    quotas.charge("ns", 80)
    assert quotas.room("ns") == 0 and quotas.usage() == {"a": {"used": 110, "quota": 100}}


def test_over_quota_picks_only_the_tenants_over_their_quota_oldest_first():
    quotas = TenantQuotas({"a": 3, "b": 10})
    for namespace, tenant in [("a1", "a"), ("a2", "a"), ("b1", "b"), ("c1", "c")]:
        quotas.assign(namespace, tenant)
    entries = [("a1", 1), ("c1", 9), ("b1", 2), ("a2", 1), ("a1", 1), ("a2", 1), ("b1", 2)]  # oldest first
    victims = quotas.over_quota(entries, lambda e: e[0], lambda e: e[1])
    assert victims == [entries[0]]  # a held 4 of 3: its oldest goes; b fits; c has no quota


# --- the arena --------------------------------------------------------------------------------


def open_arena(shm_dir: str, quotas: dict[str, int]) -> Arena:
    arena = Arena(shm_dir, "node0", capacity=24 * SLOT, segment_size=4 * SLOT, lease_seconds=30,
                  prefault=False, clock=FakeClock(), quotas=quotas)  # fmt: skip
    for namespace, (tenant, _) in NAMESPACES.items():
        arena.quotas.assign(namespace, tenant)
    return arena


def store(pool, holder: str, keys: list[bytes]) -> int:
    """Reserve, write and commit what the pool grants; the engine's pins end at once."""
    slots = pool.reserve(holder, len(keys))
    for k, slot in zip(keys, slots):
        pool.view(slot)[:1] = 1
        pool.commit(holder, slot, k)
    pool.unpin(holder, slots)
    return len(slots)


def arena_bytes(arena: Arena, tenant: str) -> int:
    """What the tenant's pools really hold: their segments' slots."""
    return sum(pool.num_slots * pool.geometry.slot_bytes for ns, pool in arena.pools.items() if NAMESPACES[ns][0] == tenant)


def test_a_tenant_at_its_arena_quota_evicts_its_own_chunks_and_leaves_room_for_others(tmp_path):
    arena = open_arena(str(tmp_path), {"a": 6 * SLOT})
    try:
        a, b = arena.pool("a1", SLOT), arena.pool("b1", SLOT)
        assert store(b, "eng-b", [key(1000 + i) for i in range(4)]) == 4
        for i in range(0, 60, 3):  # tenant a floods: ten times its quota
            assert store(a, "eng-a", [key(i), key(i + 1), key(i + 2)]) == 3
        assert arena_bytes(arena, "a") == arena.quotas.used("a") == 6 * SLOT  # its quota, not the arena
        assert set(a.keys()) == {key(i) for i in range(54, 60)}  # its own most recent chunks
        assert set(b.keys()) == {key(1000 + i) for i in range(4)}
        # Tenant b still grows after the flood: the arena's rest was not taken.
        for i in range(0, 12, 3):
            assert store(b, "eng-b", [key(2000 + i), key(2001 + i), key(2002 + i)]) == 3
        assert len(b) == 16
    finally:
        arena.close()


def test_without_a_quota_the_flooding_tenant_takes_the_whole_arena(tmp_path):
    """The behaviour quotas exist to bound (and the reference the test above differs from)."""
    arena = open_arena(str(tmp_path), {})
    try:
        a, b = arena.pool("a1", SLOT), arena.pool("b1", SLOT)
        a.watch("eng-a", 0)  # both engines live: neither pool is drained for the other (giveback.py)
        b.watch("eng-b", 0)
        store(b, "eng-b", [key(1000 + i) for i in range(4)])
        for i in range(0, 60, 3):
            store(a, "eng-a", [key(i), key(i + 1), key(i + 2)])
        assert arena_bytes(arena, "a") == 20 * SLOT
        for i in range(0, 12, 3):
            assert store(b, "eng-b", [key(2000 + i), key(2001 + i), key(2002 + i)]) == 3
        assert len(b) == 4  # b could only recycle its own first segment
    finally:
        arena.close()


def test_a_pools_reserve_cap_follows_its_tenants_quota(tmp_path):
    arena = open_arena(str(tmp_path), {"a": 6 * SLOT})
    try:
        assert arena.pool("a1", SLOT).max_slots == 6
        assert arena.pool("c1", SLOT).max_slots == 24
    finally:
        arena.close()


ARENA_OPS = st.lists(
    st.tuples(st.sampled_from(sorted(NAMESPACES)), st.sampled_from(["store", "touch", "purge"]), st.integers(1, 5)),
    min_size=1,
    max_size=40,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ARENA_OPS, quota_a=st.integers(1, 10), quota_b=st.integers(1, 10))
def test_random_operations_keep_every_tenant_within_its_arena_quota_and_off_others_chunks(ops, quota_a, quota_b):
    limits = {"a": quota_a * SLOT, "b": quota_b * SLOT}
    with tempfile.TemporaryDirectory() as shm_dir:
        arena = open_arena(shm_dir, limits)
        try:
            counter = 0
            for namespace, op, count in ops:
                tenant, slot_bytes = NAMESPACES[namespace]
                pool = arena.pool(namespace, slot_bytes)
                others = {ns: set(p.keys()) for ns, p in arena.pools.items() if NAMESPACES[ns][0] != tenant}
                if op == "store":
                    store(pool, f"eng-{namespace}", [key(counter + i) for i in range(count)])
                    counter += count
                elif op == "touch":
                    pool.touch(pool.keys()[:count])
                else:
                    pool.purge()
                assert {ns: set(p.keys()) for ns, p in arena.pools.items() if ns in others} == others
                for name, limit in limits.items():
                    assert arena_bytes(arena, name) == arena.quotas.used(name) <= limit
                assert sum(arena_bytes(arena, name) for name in "abc") == arena.allocated_bytes <= arena.capacity
        finally:
            arena.close()


# --- the disk ---------------------------------------------------------------------------------

CHUNK = 8192
RECORD = HEADER_BYTES + CHUNK  # what one chunk costs on disk (a packed record and its header)


def payload(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, CHUNK, dtype=np.uint8)


def open_disk(path, quotas: dict[str, int], capacity: int = 64 * RECORD) -> DiskTier:
    tier = DiskTier(path, capacity, direct_io=False, quotas=quotas)
    for namespace, (tenant, _) in NAMESPACES.items():
        tier.set_tenant(namespace, tenant)
    return tier


def disk_bytes(tier: DiskTier, tenant: str) -> int:
    return sum(slab.reserved_end * slab.record_cost for ns, slab in tier._slabs.items() if NAMESPACES[ns][0] == tenant)


def test_a_tenant_at_its_disk_quota_evicts_its_own_records_oldest_first(tmp_path):
    tier = open_disk(tmp_path, {"a": 5 * RECORD})
    try:
        tier.write_many("b1", [(key(1000 + i), payload(i)) for i in range(3)])
        for i in range(0, 30, 2):
            assert all(tier.write_many("a1", [(key(i), payload(i)), (key(i + 1), payload(i + 1))]))
        assert disk_bytes(tier, "a") == tier.quotas.used("a") == 5 * RECORD
        kept = set(tier.keys("a1"))  # its own recent chunks (a batch's order on disk breaks ties)
        assert len(kept) == 5 and {key(28), key(29)} <= kept <= {key(i) for i in range(22, 30)}
        assert set(tier.keys("b1")) == {key(1000 + i) for i in range(3)}
        out = np.empty(CHUNK, dtype=np.uint8)
        assert tier.read_into("a1", key(29), out) and np.array_equal(out, payload(29))
        assert tier.stats()["tenants"]["a"] == {"used": 5 * RECORD, "quota": 5 * RECORD}
    finally:
        tier.close()


def test_a_restarted_disk_counts_recovered_records_against_their_tenant(tmp_path):
    tier = open_disk(tmp_path, {"a": 8 * RECORD})
    tier.write_many("a1", [(key(i), payload(i)) for i in range(6)])
    held = tier.quotas.used("a")
    tier.close()
    again = DiskTier(tmp_path, 64 * RECORD, direct_io=False, quotas={"a": 8 * RECORD})
    try:
        assert again.quotas.used("a") == 0  # no engine said whose "a1" is yet
        again.set_tenant("a1", "a")
        assert again.quotas.used("a") == held == disk_bytes(again, "a")
        for i in range(6, 20):
            again.write_many("a1", [(key(i), payload(i))])
        assert disk_bytes(again, "a") == again.quotas.used("a") <= 8 * RECORD
    finally:
        again.close()


DISK_OPS = st.lists(st.tuples(st.sampled_from(["a1", "b1", "c1"]), st.integers(1, 6)), min_size=1, max_size=25)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=DISK_OPS, quota_a=st.integers(1, 12), quota_b=st.integers(1, 12))
def test_random_writes_keep_every_tenant_within_its_disk_quota_and_off_others_records(ops, quota_a, quota_b):
    limits = {"a": quota_a * RECORD, "b": quota_b * RECORD}
    with tempfile.TemporaryDirectory() as root:
        tier = open_disk(root, limits, capacity=30 * RECORD)
        try:
            counter = 0
            for namespace, count in ops:
                tenant = NAMESPACES[namespace][0]
                others = {ns: set(tier.keys(ns)) for ns in ("a1", "b1", "c1") if NAMESPACES[ns][0] != tenant}
                tier.write_many(namespace, [(key(counter + i), payload(i)) for i in range(count)])
                counter += count
                assert {ns: set(tier.keys(ns)) for ns in others} == others
                for name, limit in limits.items():
                    assert disk_bytes(tier, name) == tier.quotas.used(name) <= limit
                assert tier._allocated <= tier.capacity
        finally:
            tier.close()


# --- the object store ---------------------------------------------------------------------------

SIZE = 8192
OBJECT = HEADER_BYTES + SIZE


def chunk(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, SIZE, dtype=np.uint8)


@pytest.fixture
def bucket():
    url = f"memory://kvstrata-quotas-{uuid.uuid4().hex[:8]}/kv"
    yield url
    fs, path = fsspec.core.url_to_fs(url)
    if fs.exists(path):
        fs.rm(path, recursive=True)


def put(tier: ObjectTier, namespace: str, keys: list[int], first_minute: int) -> None:
    tier.put_many(namespace, [(key(i), chunk(i)) for i in keys])
    base = datetime(2026, 1, 1, tzinfo=timezone.utc)
    for n, i in enumerate(keys):  # backdate: the memory:// listing reports `created`
        tier.fs.store[tier.object_path(namespace, key(i))].created = base + timedelta(minutes=first_minute + n)


def test_a_sweep_deletes_a_tenants_own_oldest_objects_beyond_its_quota(bucket):
    tier = ObjectTier(ObjectTierConfig(url=bucket), clock=FakeClock(), quotas={"a": 3 * OBJECT, "b": 3 * OBJECT})
    try:
        tier.set_tenant("ns-a", "a")
        tier.set_tenant("ns-b", "b")
        put(tier, "ns-b", [100, 101], first_minute=0)  # b is the oldest writer, and within its quota
        put(tier, "ns-a", [0, 1, 2, 3, 4], first_minute=10)
        put(tier, "ns-c", [200, 201, 202, 203], first_minute=5)  # c: no quota
        assert tier.quotas.used("a") == 5 * OBJECT  # this node's uploads count before any sweep
        kept = tier.apply_limits(tier.scan())
        assert tier.list_keys("ns-a") == {key(2), key(3), key(4)}
        assert tier.list_keys("ns-b") == {key(100), key(101)}
        assert len(tier.list_keys("ns-c")) == 4
        assert len(kept) == 9 and tier.counters["evicted_over_quota"] == 2
        assert tier.quotas.usage()["a"] == {"used": 3 * OBJECT, "quota": 3 * OBJECT}
        assert tier.apply_limits(tier.scan()) == kept  # within quota: nothing more goes
        tier.purge("ns-a")
        assert tier.quotas.used("a") == 0 and tier.quotas.used("b") == 2 * OBJECT
    finally:
        tier.close()


def test_a_sweep_learns_the_tenant_of_another_nodes_namespace_from_its_manifest(bucket):
    other_node = ObjectTier(ObjectTierConfig(url=bucket), clock=FakeClock())
    this_node = ObjectTier(ObjectTierConfig(url=bucket), clock=FakeClock(), quotas={"a": 2 * OBJECT})
    try:
        other_node.write_manifest("ns-a", {"namespace_prefix": "a", "model": "m"})
        put(other_node, "ns-a", [0, 1, 2, 3], first_minute=0)
        put(other_node, "ns-x", [10, 11, 12], first_minute=0)  # no manifest: no tenant, no quota
        this_node.apply_limits(this_node.scan())
        assert this_node.list_keys("ns-a") == {key(2), key(3)}
        assert len(this_node.list_keys("ns-x")) == 3
    finally:
        other_node.close()
        this_node.close()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(batches=st.lists(st.tuples(st.sampled_from(["ns-a", "ns-b", "ns-c"]), st.integers(1, 4)), min_size=1, max_size=12),
       quota_a=st.integers(1, 6), quota_b=st.integers(1, 6))  # fmt: skip
def test_after_every_sweep_each_tenant_fits_its_bucket_quota_and_keeps_its_newest(bucket, batches, quota_a, quota_b):
    limits = {"a": quota_a * OBJECT, "b": quota_b * OBJECT}
    url = f"{bucket}/{uuid.uuid4().hex[:8]}"
    tier = ObjectTier(ObjectTierConfig(url=url), clock=FakeClock(), quotas=limits)
    try:
        for namespace, tenant in (("ns-a", "a"), ("ns-b", "b"), ("ns-c", "c")):
            tier.set_tenant(namespace, tenant)
        written: dict[str, list[int]] = {"ns-a": [], "ns-b": [], "ns-c": []}
        minute = counter = 0
        for namespace, count in batches:
            keys = list(range(counter, counter + count))
            put(tier, namespace, keys, first_minute=minute)
            counter, minute = counter + count, minute + count
            written[namespace] += keys
            tier.apply_limits(tier.scan())
            for ns, tenant in (("ns-a", "a"), ("ns-b", "b")):
                expected = written[ns][-(limits[tenant] // OBJECT) :]  # the newest that fit
                assert tier.list_keys(ns) == {key(i) for i in expected}
                assert tier.quotas.used(tenant) == len(expected) * OBJECT <= limits[tenant]
            assert tier.list_keys("ns-c") == {key(i) for i in written["ns-c"]}
    finally:
        tier.close()
