"""`admission.store: reuse` behind the manager: a chunk used once never reaches the disk
tier, one used again does (at once under write_through, at eviction under write_back),
and the skipped copies are counted. In-process node stores."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from kvstrata.store.node_store import LocalStoreClient, NodeStore
from kvstrata.actors.store_metrics import metric_samples
from kvstrata.cli.status_view import render_store
from kvstrata.config import load_config
from kvstrata.connector.compat import LookupResult
from kvstrata.connector.manager import StrataManager
from kvstrata.tiers.disk import HEADER_BYTES
from tests.connector.harness import SLOT, ctx, step, store_chunks
from tests.utils import key, layout, store_config

HIT = LookupResult.HIT


@pytest.fixture
def env(tmp_path):
    made = {"stores": [], "managers": []}

    def store(write_policy: str, disk_admission: str = "reuse", slots: int = 8):
        disk = {"path": str(tmp_path / "disk"), "capacity": 64 * (SLOT + HEADER_BYTES), "write_policy": write_policy}
        raw = store_config(tmp_path, capacity=slots * SLOT, reserve_slots=2, disk=disk)
        raw["admission"] = {"store": {"disk": disk_admission, "min_uses": 2, "window": 4096}}
        cfg = load_config(raw)
        node_store = NodeStore(cfg, "node0")
        made["stores"].append(node_store)
        return node_store, cfg

    def manager(node_store, cfg, holder):
        m = StrataManager(LocalStoreClient(node_store), layout(worker_bytes=SLOT), cfg, holder, enable_events=True)
        made["managers"].append(m)
        assert m.wait_idle(10)
        return m

    yield store, manager
    for m in made["managers"]:
        m.shutdown()
    for s in made["stores"]:
        s.close()


def reuse(store, reader, keys) -> None:
    """A second request hits `keys` and loads them, as vLLM's steps go: the HITs' holds go
    out with the step that scheduled the load, the load completes in a later one."""
    for k in keys:
        assert reader.lookup(k, ctx("again")) is HIT
    assert reader.prepare_load(list(keys), ctx("again")) is not None
    step(reader, store)
    reader.complete_load(list(keys), ctx("again"))
    reader.on_request_finished(ctx("again"))
    step(reader, store)


@pytest.mark.parametrize("disk_admission", ["reuse", "always"])
def test_write_through_writes_only_what_is_used_again(env, disk_admission):
    make_store, make_manager = env
    store, cfg = make_store("write_through", disk_admission)
    writer = make_manager(store, cfg, "writer")
    store_chunks(store, writer, [key(1), key(2)], settle=True)
    reader = make_manager(store, cfg, "reader")
    reuse(store, reader, [key(1)])
    on_disk = set(store.keys(writer.namespace, "STORAGE"))
    if disk_admission == "always":
        assert on_disk == {key(1), key(2)}
        assert store.counters["disk_writes_skipped_reuse"] == 0
        assert store.disk.reuse_of is None  # no sketch kept: the disk tier evicts by age alone
        return
    # The chunk used again was written on its second use; the one-off never was.
    assert on_disk == {key(1)}
    assert store.counters["disk_writes_skipped_reuse"] == 2  # both skipped at commit
    # The disk tier's evictions weigh the same counts: the one-off would go first.
    uses = store.disk.reuse_of(writer.namespace, [key(1), key(2)])
    assert uses[0] > uses[1] >= 1
    stats = store.stats()
    assert stats["report"]["admission"]["disk_writes_skipped_reuse"] == 2
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(render_store(stats))
    assert "writes skipped as not reused: disk 2, object 0" in console.export_text()
    samples = {(name, labels.get("tier")): value for name, labels, value in metric_samples(stats)}
    assert samples[("kvstrata_admission_writes_skipped", "disk")] == 2


def test_write_back_keeps_a_one_off_off_disk_when_the_arena_evicts_it(env):
    make_store, make_manager = env
    store, cfg = make_store("write_back", slots=8)
    writer = make_manager(store, cfg, "writer")
    store_chunks(store, writer, [key(1), key(2)], settle=True)
    reader = make_manager(store, cfg, "reader")
    reuse(store, reader, [key(1)])
    assert store.keys(writer.namespace, "STORAGE") == []  # write_back: nothing until eviction
    i = 100
    pool = store.arena.pools[writer.namespace]
    while pool.lookup(key(1)) is not None or pool.lookup(key(2)) is not None:
        store_chunks(store, writer, [key(i)], seed=i)
        step(writer, store)
        step(reader, store)  # the reader's pins end, so the arena may evict
        i += 1
        assert i < 200
    assert store.wait_io(10)
    on_disk = set(store.keys(writer.namespace, "STORAGE"))
    assert key(1) in on_disk and key(2) not in on_disk
    assert store.counters["disk_writes_skipped_reuse"] >= 1
