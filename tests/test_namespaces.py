"""Namespaces, tenant prefixes and holder names from outside are checked before they name
a file, an object or a pin (issue #29: `kvstrata purge --namespace ""` deleted every
tenant's objects, the root directory with them)."""

from __future__ import annotations

import numpy as np
import pytest

from kvstrata.store.node_store import NodeStore
from kvstrata.protocol import StepRequest
from kvstrata.cli import main
from kvstrata.config import ConfigError, ObjectTierConfig, load_config
from kvstrata.namespaces import check_holder, check_namespace, check_tenant, holder_name
from kvstrata.tiers.disk import HEADER_BYTES, DiskTier
from kvstrata.tiers.object_store import ObjectTier
from kvstrata.tiers.quotas import TenantQuotas
from tests.utils import FakeClock, key, store_config

BAD_NAMESPACES = ["", ".", "..", "../x", "a/..", "/", "a/b", "/a", "a/", "a//b", ".hidden", "a b", "a\x00b", "é", "x" * 129]
SIZE = 8192


def chunk(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, SIZE, dtype=np.uint8)


@pytest.mark.parametrize("value", BAD_NAMESPACES + [None, 7, b"ns"])
def test_a_bad_namespace_is_a_value_error_naming_it(value):
    with pytest.raises(ValueError) as raised:
        check_namespace(value)
    assert repr(value)[:40] in str(raised.value)


@pytest.mark.parametrize("value", ["3fa9c0d2e1b4a5968778", "ns", "ns-a", "tenant_1.v2", "x" * 128])
def test_good_namespaces_pass_unchanged(value):
    assert check_namespace(value) == value


def test_tenants_may_be_empty_or_nested_but_not_escape():
    assert check_tenant("") == "" and check_tenant("org/team-a") == "org/team-a"
    for bad in ("/org", "org/", "org//a", "org/../a", "org/.a", "a b"):
        with pytest.raises(ValueError, match="namespace_prefix"):
            check_tenant(bad)


def test_holders_cannot_name_the_stores_own():
    assert check_holder("engine-1a2b-4242") == "engine-1a2b-4242"
    for bad in ("kvstrata:cascade", "kvstrata:upload", "kvstrata:promote", "", "a" * 201, "a b", None):
        with pytest.raises(ValueError, match="holder"):
            check_holder(bad)


def test_a_holder_is_bound_to_the_engine_that_registered_it_until_its_lease_ends(tmp_path):
    """A second engine naming a live holder is refused at registration; a step or a
    release carrying another epoch changes nothing (its pins stay); once the holder's
    lease ran out its old epoch is refused and the name can be registered afresh."""
    slot = 4096
    clock = FakeClock()
    store = NodeStore(load_config(store_config(tmp_path, capacity=16 * slot, lease_seconds=10)), "node0", clock=clock)
    try:
        first = store.register("engine", "ns", slot).epoch
        pool = store.arena.pools["ns"]
        slots = store.step(StepRequest("engine", "ns", epoch=first, reserve=2)).reserved
        store.step(StepRequest("engine", "ns", epoch=first, commit=[(slots[0], key(1)), (slots[1], key(2))]))
        assert pool.stats()["pinned"] == 2  # the writer keeps its pins at commit
        with pytest.raises(ValueError, match="'engine' is already registered by another engine"):
            store.register("engine", "ns", slot)
        for epoch in ("", store.arena.epoch, first + "x"):
            reply = store.step(StepRequest("engine", "ns", epoch=epoch, unpin=slots, purge=True, reserve=2))
            assert reply.rejected and not reply.reserved and reply.seq == 0
        with pytest.raises(ValueError, match="'engine' is not registered here"):
            store.release_holder("engine", "")
        assert pool.stats()["pinned"] == 2 and sorted(store.keys("ns")) == sorted([key(1), key(2)])
        assert store.stats()["holders_refused"] == 5
        assert store.register("engine", "ns", slot, epoch=first).epoch == first  # its own engine, again

        clock.advance(11)  # the engine fell silent for a whole lease
        reply = store.step(StepRequest("engine", "ns", epoch=first, unpin=slots))
        assert reply.epoch != first and reply.rejected  # it must register again, and drop its pins
        assert pool.stats()["pinned"] == 0
        second = store.register("engine", "ns", slot).epoch
        assert second != first and not store.step(StepRequest("engine", "ns", epoch=second)).rejected
    finally:
        store.close()


def test_an_engine_id_of_any_shape_becomes_a_valid_holder_that_keeps_its_pid():
    assert holder_name("3f1c-uuid-1234") == "3f1c-uuid-1234"
    assert holder_name("id-fe80::1-8000-4242") == "id-fe80--1-8000-4242"
    long = holder_name("x" * 300 + "-4242")
    assert len(long) == 200 and long.endswith("-4242")
    assert check_holder(holder_name(":::")) == "---"


@pytest.fixture(params=["memory", "file"])
def object_url(request, memory_bucket, tmp_path):
    return memory_bucket if request.param == "memory" else f"file://{tmp_path}/bucket/kv"


@pytest.mark.parametrize("bad", ["", ".", "..", "../kv", "ab/..", "/"])
def test_object_purge_of_a_bad_namespace_deletes_nothing(object_url, bad):
    tier = ObjectTier(ObjectTierConfig(url=object_url), clock=FakeClock())
    try:
        assert tier.put_many("ab", [(key(1), chunk(1))]) == [True]
        assert tier.put_many("cd", [(key(2), chunk(2))]) == [True]
        with pytest.raises(ValueError, match="namespace"):
            tier.purge(bad)
        assert tier.list_keys("ab") == {key(1)} and tier.list_keys("cd") == {key(2)}
        assert tier.available()  # the caller's error is no failure of the store
    finally:
        tier.close()


def test_object_purge_removes_exactly_one_namespace_not_those_starting_with_its_name(object_url):
    tier = ObjectTier(ObjectTierConfig(url=object_url), clock=FakeClock())
    try:
        for i, namespace in enumerate(["ab", "ab-c", "abc", "ab.d"]):
            assert tier.put_many(namespace, [(key(i), chunk(i))]) == [True]
        assert tier.purge("ab") == 1
        assert tier.list_keys("ab") == set()
        assert [tier.list_keys(ns) for ns in ("ab-c", "abc", "ab.d")] == [{key(1)}, {key(2)}, {key(3)}]
    finally:
        tier.close()


def test_disk_tier_refuses_a_bad_namespace_before_naming_a_file(tmp_path):
    root = tmp_path / "disk"
    tier = DiskTier(root, 16 * (SIZE + HEADER_BYTES))
    try:
        for bad in ("../escape", "a/b", ""):
            with pytest.raises(ValueError, match="namespace"):
                tier.write_many(bad, [(key(1), chunk(1))])
        assert not (tmp_path / "escape-8192.payloads").exists()
        assert sorted(p.name for p in root.iterdir() if p.suffix in (".payloads", ".headers")) == []
    finally:
        tier.close()


def test_config_and_tier_quota_keys_follow_the_tenant_rules():
    with pytest.raises(ConfigError, match=r"quotas key '\.\./b'"):
        load_config({"quotas": {"../b": {"cpu": "1MiB"}}})
    with pytest.raises(ConfigError, match="namespace_prefix"):
        load_config({"namespace_prefix": "a/"})
    with pytest.raises(ValueError, match="quotas key"):
        TenantQuotas({"a//b": 1})


def test_store_refuses_bad_names_at_its_control_surface_and_purges_nothing(tmp_path):
    slot = 4096
    store = NodeStore(load_config(store_config(tmp_path, capacity=16 * slot)), "node0")
    try:
        epoch = store.register("engine", "ns", slot).epoch
        pool = store.arena.pools["ns"]
        slots = pool.reserve("engine", 2)
        store.step(StepRequest("engine", "ns", epoch=epoch, commit=[(slots[0], key(1)), (slots[1], key(2))]))
        for call in (
            lambda: store.purge(""),
            lambda: store.purge(".."),
            lambda: store.register("engine", "../ns", slot),
            lambda: store.register("kvstrata:cascade", "ns", slot),
            lambda: store.register("engine", "ns2", slot, {"namespace_prefix": "../t"}),
            lambda: store.step(StepRequest("kvstrata:upload", "ns", unpin=[slots[0]])),
            lambda: store.step(StepRequest("engine", "", purge=True)),
            lambda: store.export_chunks("a/b", [key(1)]),
            lambda: store.release_holder("kvstrata:promote", epoch),
        ):
            with pytest.raises(ValueError, match="invalid"):
                call()
        assert sorted(store.keys("ns")) == sorted([key(1), key(2)])
        assert "../ns" not in store.arena.pools and "ns2" not in store.arena.pools
    finally:
        store.close()


@pytest.mark.parametrize("bad", ["", "..", "a/b"])
def test_cli_purge_of_a_bad_namespace_exits_non_zero_before_reaching_a_store(bad, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["purge", "--namespace", bad])
    assert exited.value.code == 2
    assert "invalid namespace" in capsys.readouterr().err


def test_a_step_purges_a_namespace_only_for_an_engine_that_registered_it(tmp_path):
    """A tenant empties its own namespace; an engine naming another's is refused (counted,
    said in the reply) and that namespace keeps every chunk."""
    slot = 4096
    store = NodeStore(load_config(store_config(tmp_path, capacity=16 * slot)), "node0")
    try:
        owner = store.register("owner", "tenant-a-ns", slot).epoch
        intruder = store.register("intruder", "tenant-b-ns", slot).epoch
        pool = store.arena.pools["tenant-a-ns"]
        slots = pool.reserve("owner", 2)
        store.step(StepRequest("owner", "tenant-a-ns", epoch=owner, commit=[(slots[0], key(1)), (slots[1], key(2))]))
        reply = store.step(StepRequest("intruder", "tenant-a-ns", epoch=intruder, purge=True))
        assert any("purge of tenant-a-ns refused" in reason for reason in reply.rejected)
        assert sorted(store.keys("tenant-a-ns")) == sorted([key(1), key(2)])
        assert store.stats()["purges_refused"] == 1
        store.step(StepRequest("owner", "tenant-a-ns", epoch=owner, purge=True))
        assert store.keys("tenant-a-ns") == []
    finally:
        store.close()
