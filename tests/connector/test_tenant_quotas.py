"""Two tenants' engines on one in-process node store: tenant A floods the arena past its
quota (`quotas:`), tenant B's chunks stay hits, and status shows each tenant's share."""

from __future__ import annotations

import io

from rich.console import Console

from kvstrata.store.node_store import LocalStoreClient, NodeStore
from kvstrata.cli.status_view import render_status
from kvstrata.config import load_config
from kvstrata.connector.compat import LookupResult, ReqContext, ScheduleEndContext
from kvstrata.connector.manager import StrataManager
from tests.utils import FakeClock, key, layout, store_config

SLOT = 4096
ARENA_SLOTS = 32
QUOTA_SLOTS = 8


def config(tmp_path, quotas: bool) -> dict:
    cfg = store_config(tmp_path, capacity=ARENA_SLOTS * SLOT, segment_size=2 * SLOT, reserve_slots=4)
    if quotas:
        cfg["quotas"] = {"tenant-a": {"cpu": QUOTA_SLOTS * SLOT}}
    return cfg


def step(manager: StrataManager) -> None:
    manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
    assert manager.wait_idle(10)


def store_keys(manager: StrataManager, keys: list[bytes]) -> None:
    out = manager.prepare_store(keys, ReqContext(req_id="w"))
    if out is not None:
        manager.complete_store(out.keys_to_store, ReqContext(req_id="w"))
    step(manager)


def flood_then_count_b_hits(tmp_path, quotas: bool) -> tuple[int, NodeStore]:
    """B stores a working set in rounds while A floods between them; B's hits afterwards."""
    cfg = config(tmp_path, quotas)
    store = NodeStore(cfg, "node0", clock=FakeClock())
    parsed = load_config(cfg)
    managers = [
        StrataManager(LocalStoreClient(store), layout(worker_bytes=SLOT, prefix=prefix), parsed, holder, enable_events=False)
        for prefix, holder in (("tenant-a", "engine-a"), ("tenant-b", "engine-b"))
    ]
    a, b = managers
    try:
        assert a.wait_idle(10) and b.wait_idle(10)  # registered, with a stock of slots
        assert a.namespace != b.namespace
        b_keys = [key(1000 + i) for i in range(16)]
        for round_ in range(4):
            for i in range(0, 24, 2):  # A: 96 chunks in all, three times the whole arena
                store_keys(a, [key(round_ * 24 + i), key(round_ * 24 + i + 1)])
            for i in range(round_ * 4, round_ * 4 + 4, 2):
                store_keys(b, b_keys[i : i + 2])
        step(b)
        hits = sum(b.lookup(k, ReqContext(req_id="reader")) is LookupResult.HIT for k in b_keys)
        return hits, store
    finally:
        for manager in managers:
            manager.shutdown()


def test_a_flooding_tenant_over_its_quota_leaves_the_other_tenants_hits(tmp_path):
    hits, store = flood_then_count_b_hits(tmp_path, quotas=True)
    try:
        assert hits == 16
        tenants = store.stats()["report"]["tenants"]
        assert tenants["tenant-a"]["cpu"] == {"used": QUOTA_SLOTS * SLOT, "quota": QUOTA_SLOTS * SLOT}
        assert tenants["tenant-b"]["cpu"]["quota"] is None
        console = Console(file=io.StringIO(), width=160)
        console.print(render_status([store.stats()]))
        table = console.file.getvalue()
        assert "tenants (used / quota per tier)" in table
        assert "32.0 KiB / 32.0 KiB" in table  # tenant-a: its whole quota, and no more
    finally:
        store.close()


def test_without_quotas_the_flood_takes_the_other_tenants_room(tmp_path):
    """The reference: the same traffic without a quota cost B every hit (measured: 0 of 16)."""
    hits, store = flood_then_count_b_hits(tmp_path, quotas=False)
    try:
        assert hits < 8
        table = io.StringIO()
        Console(file=table, width=160).print(render_status([store.stats()]))
        assert "tenants (used / quota" not in table.getvalue()  # no quota anywhere: no table
    finally:
        store.close()


def test_the_store_tells_disk_and_bucket_each_namespaces_tenant_and_they_keep_its_quota(tmp_path, memory_bucket):
    """Through the store (registration assigns tenants): A's flood written through to disk
    and the bucket stays within A's quotas there; every chunk of B stays on disk and in the bucket."""
    record = 2 * SLOT  # a 4 KiB payload and its 4 KiB header, on disk and as an object
    cfg = config(tmp_path, quotas=True)  # with A's arena quota, so B's stores get slots
    cfg["tiers"]["disk"] = {"path": str(tmp_path / "disk"), "capacity": "64MiB", "direct_io": False}
    cfg["tiers"]["object"] = {"url": memory_bucket, "index_refresh_seconds": 60}
    cfg["quotas"]["tenant-a"].update(disk=6 * record, object=5 * record)
    clock = FakeClock()
    store = NodeStore(cfg, "node0", clock=clock)
    parsed = load_config(cfg)
    a, b = [
        StrataManager(LocalStoreClient(store), layout(worker_bytes=SLOT, prefix=prefix), parsed, holder, enable_events=False)
        for prefix, holder in (("tenant-a", "engine-a"), ("tenant-b", "engine-b"))
    ]
    try:
        assert a.wait_idle(10) and b.wait_idle(10)
        b_keys = [key(1000 + i) for i in range(8)]
        for i in range(0, 8, 2):
            store_keys(b, b_keys[i : i + 2])
            for j in range(0, 12, 2):
                store_keys(a, [key(i * 12 + j), key(i * 12 + j + 1)])
                assert store.wait_io(10)
        clock.advance(61)  # the next step sweeps the bucket
        step(a)
        assert store.wait_io(10)
        tenants = store.stats()["report"]["tenants"]
        assert tenants["tenant-a"]["disk"] == {"used": 6 * record, "quota": 6 * record}
        assert tenants["tenant-a"]["object"] == {"used": 5 * record, "quota": 5 * record}
        assert len(store.disk.keys(a.namespace)) == 6 and len(store.object.list_keys(a.namespace)) == 5
        assert set(store.disk.keys(b.namespace)) == set(b_keys)
        assert store.object.list_keys(b.namespace) == set(b_keys)
    finally:
        a.shutdown()
        b.shutdown()
        store.close()
