"""The node store as a Ray actor: one per node, named, detached, restarted by Ray, and
reachable from a manager through the batched control call. One Ray cluster per module.
"""

from __future__ import annotations

import time

import pytest
import ray

from kvstrata.actors.client import (
    RayStoreClient,
    StoreUnavailable,
    current_node_id,
    ensure_node_store,
    get_node_store,
    shutdown_node_store,
)
from kvstrata.actors.options import STORE_NAMESPACE, store_actor_name
from kvstrata.config import load_config
from kvstrata.connector.compat import LookupResult, ReqContext, ScheduleEndContext
from kvstrata.connector.manager import StrataManager
from tests.utils import key, layout, local_ray, store_config

SLOT = 4096


@pytest.fixture(scope="module")
def cluster():
    with local_ray("kvstrata-tests"):
        yield


@pytest.fixture
def store(cluster, tmp_path):
    cfg = load_config(store_config(tmp_path, capacity=64 * SLOT))
    handle = ensure_node_store(cfg)
    try:
        yield handle, cfg
    finally:
        shutdown_node_store(handle)


def wait_for(predicate, timeout_s=60.0, interval_s=0.2):
    """Poll a condition with a deadline (Ray restarts have no event to wait on)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except Exception:  # noqa: BLE001 - the actor may be restarting
            pass
        time.sleep(interval_s)
    raise AssertionError("condition not met in time")


def test_one_named_detached_store_per_node(store):
    handle, cfg = store
    node_id = current_node_id()
    found = ray.get_actor(store_actor_name(node_id), namespace=STORE_NAMESPACE)
    assert ray.get(found.ping.remote()) == ray.get(handle.ping.remote())
    again = ensure_node_store(cfg)  # get_if_exists: the same actor, not a second store
    assert ray.get(again.ping.remote()) == ray.get(handle.ping.remote())
    assert ray.get(get_node_store().ping.remote()) == ray.get(handle.ping.remote())


def test_the_store_actor_keeps_its_start_up_heap_out_of_garbage_collections(store, tmp_path):
    """A full collection of the actor's start-up heap held the GIL for ~50 ms (every I/O thread
    waited); the actor freezes it. A store made in a test's own process leaves that process alone."""
    import gc

    from kvstrata.store.node_store import NodeStore

    handle, _ = store
    assert ray.get(handle.stats.remote())["gc_frozen_objects"] > 10_000
    frozen = gc.get_freeze_count()
    (tmp_path / "local").mkdir()
    local = NodeStore(store_config(tmp_path / "local", capacity=4 * SLOT), "local-node")
    try:
        assert gc.get_freeze_count() == frozen
    finally:
        local.close()


def test_store_is_detached_from_the_process_that_created_it(store):
    handle, cfg = store
    epoch = ray.get(handle.ping.remote())
    created = ensure_node_store(cfg)
    del created  # a non-detached actor would die with its creator's last reference
    import gc

    gc.collect()
    assert ray.get(get_node_store().ping.remote()) == epoch


def test_missing_store_is_a_clear_error(cluster):
    with pytest.raises(StoreUnavailable, match="no kvstrata node store on node nonexistent"):
        get_node_store("nonexistent")


def step(manager):
    manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
    assert manager.wait_idle(30)


def store_one(manager, k, req="w"):
    out = manager.prepare_store([k], ReqContext(req_id=req))
    assert out is not None and out.keys_to_store == [k]
    manager.complete_store(out.keys_to_store, ReqContext(req_id=req))
    step(manager)


def test_two_engines_share_chunks_through_the_actor(store):
    handle, cfg = store
    lay = layout(worker_bytes=SLOT)
    writer = StrataManager(RayStoreClient(handle, 30), lay, cfg, "writer")
    reader = StrataManager(RayStoreClient(handle, 30), lay, cfg, "reader")
    try:
        assert writer.wait_idle(30)
        out = writer.prepare_store([key(1), key(2)], ReqContext(req_id="w"))
        writer.complete_store(out.keys_to_store, ReqContext(req_id="w"))
        step(writer)
        step(reader)
        calls = reader._channel.calls
        assert reader.lookup(key(1), ReqContext(req_id="r")) is LookupResult.HIT  # at once, from its mirror
        assert reader.lookup(key(3), ReqContext(req_id="r")) is LookupResult.MISS
        assert reader._channel.calls == calls and reader.counters()["hits_without_round_trip"] == 1
        step(reader)  # the hold reaches the store through Ray
        assert ray.get(handle.stats.remote())["pools"][reader.namespace]["holds"] == 1
    finally:
        writer.shutdown()
        reader.shutdown()


def test_ray_restarts_a_dead_store_and_engines_recover(store):
    handle, cfg = store
    lay = layout(worker_bytes=SLOT)
    manager = StrataManager(RayStoreClient(handle, 30), lay, cfg, "engine")
    try:
        assert manager.wait_idle(30)
        store_one(manager, key(1))
        old_epoch = ray.get(handle.ping.remote())
        ray.kill(handle, no_restart=False)
        wait_for(lambda: ray.get(handle.ping.remote(), timeout=5) != old_epoch)
        # The engine keeps serving: first misses (the chunks died with the store) ...
        for _ in range(3):
            step(manager)
        assert manager.lookup(key(1), ReqContext(req_id="r")) is LookupResult.MISS
        # ... then stores and hits again against the new store.
        store_one(manager, key(2), req="w2")
        assert ray.get(handle.keys.remote(lay.namespace)) == [key(2)]
    finally:
        manager.shutdown()


def test_cli_status_purge_and_down(cluster, tmp_path, capsys):
    """status shows the store; purge drops the chunks it holds; down ends the actor and
    unlinks its segments (once a test named this and never called down)."""
    import yaml

    from kvstrata.protocol import StepRequest
    from kvstrata.cli import main

    raw = store_config(tmp_path, capacity=64 * SLOT)
    (tmp_path / "kvstrata.yaml").write_text(yaml.safe_dump(raw))
    handle = ensure_node_store(load_config(raw))
    try:
        assert main(["status", "--json"]) == 0
        status = capsys.readouterr().out
        assert '"epoch"' in status and '"capacity"' in status
        epoch = ray.get(handle.register.remote("engine", "ns", SLOT), timeout=30).epoch
        slots = ray.get(handle.step.remote(StepRequest("engine", "ns", epoch=epoch, reserve=2)), timeout=30).reserved
        ray.get(handle.step.remote(StepRequest("engine", "ns", epoch=epoch, commit=[(slots[0], key(1)), (slots[1], key(2))])), timeout=30)
        ray.get(handle.release_holder.remote("engine", epoch), timeout=30)
        segments = list(tmp_path.glob("kvstrata-*"))
        assert segments, "the store made no segment in its shm_dir"
        assert main(["purge", "--namespace", "ns"]) == 0
        assert "purged 2 chunks" in capsys.readouterr().out
        assert main(["down", "--config", str(tmp_path / "kvstrata.yaml")]) == 0
        assert "kvstrata node store down" in capsys.readouterr().out
        assert not [path for path in segments if path.exists()]
        with pytest.raises(StoreUnavailable):
            get_node_store()
    finally:
        try:
            ray.kill(ray.get_actor(store_actor_name(current_node_id()), namespace=STORE_NAMESPACE), no_restart=True)
        except ValueError:
            pass  # down took it (the test's subject)


def test_cli_rejects_a_bad_config_with_its_name(cluster, tmp_path, capsys):
    from kvstrata.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("tiers:\n  nvme: {}\n")
    assert main(["up", "--config", str(bad)]) == 2
    assert f"{bad}: tiers.nvme: unknown key" in capsys.readouterr().err


def test_a_sigkilled_store_comes_back_and_serves_its_disk_chunks(cluster, tmp_path):
    import os
    import signal

    disk = {"path": str(tmp_path / "nvme"), "capacity": 1 << 20}
    cfg = load_config(store_config(tmp_path, capacity=64 * SLOT, disk=disk))
    handle = ensure_node_store(cfg)
    lay = layout(worker_bytes=SLOT)
    manager = StrataManager(RayStoreClient(handle, 30), lay, cfg, "engine")
    try:
        assert manager.wait_idle(30)
        store_one(manager, key(1))
        payload = ray.get(handle.read.remote(lay.namespace, key(1)))
        wait_for(lambda: ray.get(handle.keys.remote(lay.namespace, "STORAGE")) == [key(1)])
        old = ray.get(handle.stats.remote())
        os.kill(old["pid"], signal.SIGKILL)  # a crash: nothing gets to clean up
        wait_for(lambda: ray.get(handle.ping.remote(), timeout=5) != old["epoch"])
        result = None
        for _ in range(50):
            step(manager)
            result = manager.lookup(key(1), ReqContext(req_id="r"))
            if result is LookupResult.HIT:
                break
        assert result is LookupResult.HIT
        assert ray.get(handle.read.remote(lay.namespace, key(1))) == payload
    finally:
        manager.shutdown()
        shutdown_node_store(handle)
