"""The object tier behind the manager: cross-node sharing through one bucket, write-back,
integrity and an unreachable store, with in-process node stores over fsspec's memory://."""

from __future__ import annotations

import threading
from datetime import datetime, timedelta, timezone

import numpy as np
import pytest

from kvstrata.store.node_store import LocalStoreClient, NodeStore
from kvstrata.config import load_config
from kvstrata.connector.compat import Locality, LookupResult, Medium, load_source
from kvstrata.connector.manager import StrataManager
from kvstrata.tiers.records import HEADER_BYTES
from tests.tiers.test_object_store import SwitchableFS, written
from tests.connector.harness import SLOT, ctx, step
from tests.connector.harness import store_chunks as store_settled
from tests.utils import FakeClock, key, layout, store_config

HIT, MISS, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def env(tmp_path, memory_bucket, clock):
    """Builds node stores (one per simulated node) and managers; closes them all afterwards."""
    made = {"stores": [], "managers": []}

    def store(node="a", slots=8, reserve_slots=2, audit=False, **object_extra):
        cfg = store_config(tmp_path / node, capacity=slots * SLOT, reserve_slots=reserve_slots)
        cfg["tiers"]["cpu"]["audit_chunks"] = audit
        cfg["tiers"]["object"] = {"url": memory_bucket, "index_refresh_seconds": 0.001, **object_extra}
        (tmp_path / node).mkdir(exist_ok=True)
        node_store = NodeStore(load_config(cfg), f"node-{node}", clock=clock)
        made["stores"].append(node_store)
        return node_store, load_config(cfg)

    def manager(node_store, cfg, holder="engine"):
        m = StrataManager(LocalStoreClient(node_store), layout(worker_bytes=SLOT), cfg, holder, enable_events=True)
        made["managers"].append(m)
        assert m.wait_idle(10)
        return m

    yield store, manager
    for m in made["managers"]:
        m.shutdown()
    for s in made["stores"]:
        s.close()


def store_chunks(store, manager, keys, seed=0):
    return store_settled(store, manager, keys, seed=seed, settle=True)


def load(store, manager, keys, req="reader"):
    """Drive lookups to an answer (RETRY -> step -> ...) and return the loaded bytes or the miss."""
    for _ in range(10):
        answers = [manager.lookup(k, ctx(req)) for k in keys]
        if RETRY not in answers:
            break
        step(manager, store)
    if answers != [HIT] * len(keys):
        return answers
    spec = manager.prepare_load(keys, ctx(req))
    pool = store.arena.pools[manager.namespace]
    loaded = {k: pool.view(int(slot)).copy() for k, slot in zip(keys, spec.block_ids)}
    manager.complete_load(keys, ctx(req))
    return loaded


def test_a_chunk_stored_on_one_node_is_a_hit_on_another(env):
    new_store, new_manager = env
    store_a, cfg = new_store("a", slots=16, reserve_slots=4)
    writer = new_manager(store_a, cfg, holder="writer")
    keys = [key(i, group=i % 2) for i in range(4)]
    data = store_chunks(store_a, writer, keys)
    assert store_a.stats()["object"]["puts"] == 4

    store_b, cfg_b = new_store("b", slots=16, reserve_slots=4)  # another node: its arena never saw these
    reader = new_manager(store_b, cfg_b, holder="reader")
    step(reader, store_b)  # its store listed the bucket
    loaded = load(store_b, reader, keys)
    assert all(np.array_equal(loaded[k], data[k]) for k in keys)
    assert store_b.stats()["object_promotions"] == 4
    assert reader.counters()["chunks_promoted"] == 4
    if load_source("OBJECT") is not None:  # vLLM 0.32+: the shared store is "external"
        assert {reader.get_load_source(k, ctx("reader")) for k in keys} == {load_source("OBJECT")}
        assert load_source("OBJECT") not in (load_source("CPU"), load_source("STORAGE"))
    remote = [e for e in reader.take_events() if e.medium == Medium.STORAGE and not e.removed]
    assert {k for e in remote for k in e.keys} == set(keys)
    if Locality is not None:
        assert all(e.locality == Locality.REMOTE for e in remote)


def test_a_new_node_never_misses_a_chunk_in_the_bucket_while_it_is_still_listing_it(env, monkeypatch):
    """Until a store's first sweep of the bucket is done, its view lacks what other nodes
    uploaded: lookups must RETRY (bounded by lookup_wait_seconds), not answer MISS."""
    new_store, new_manager = env
    store_a, cfg = new_store("a", slots=16, reserve_slots=4)
    writer = new_manager(store_a, cfg, holder="writer")
    data = store_chunks(store_a, writer, [key(1)])

    store_b, cfg_b = new_store("b", slots=16, reserve_slots=4)
    listed = threading.Event()
    real_find = store_b.object.fs.find

    def slow_find(*args, **kwargs):
        assert listed.wait(10), "the test never let the listing finish"
        return real_find(*args, **kwargs)

    monkeypatch.setattr(store_b.object.fs, "find", slow_find)
    reader = new_manager(store_b, cfg_b, holder="reader")  # registers: the first sweep starts
    try:
        assert reader.lookup(key(1), ctx("reader")) is RETRY
        step(reader)  # a fresh view, but the sweep is still listing
        assert reader.lookup(key(1), ctx("reader")) is RETRY
    finally:
        listed.set()
    assert store_b.wait_io(10)
    assert np.array_equal(load(store_b, reader, [key(1)])[key(1)], data[key(1)])


def test_chunks_already_in_the_bucket_are_not_stored_again(env):
    new_store, new_manager = env
    store_a, cfg = new_store("a")
    store_chunks(store_a, new_manager(store_a, cfg, holder="a"), [key(1)])
    store_b, cfg_b = new_store("b")
    writer_b = new_manager(store_b, cfg_b, holder="b")
    step(writer_b, store_b)  # returns once store b's sweep of the bucket is done ...
    step(writer_b)  # ... and the next reply brings what it found to the engine's mirror
    out = writer_b.prepare_store([key(1), key(2)], ctx("w"))
    assert out.keys_to_store == [key(2)]  # no GPU->arena copy, no second upload


def test_write_back_uploads_what_the_arena_evicts(env):
    new_store, new_manager = env
    # A stock of two (a slot evicted for a refill is reusable one step later: deferred
    # reuse), within the cap of a quarter of the arena.
    store, cfg = new_store("a", slots=8, reserve_slots=2, write_policy="write_back")
    manager = new_manager(store, cfg)
    first = store_chunks(store, manager, [key(0)])
    assert store.stats()["object"]["puts"] == 0  # nothing evicted yet
    for i in range(1, 16):
        store_chunks(store, manager, [key(i)], seed=i)
        step(manager, store)
    assert store.arena.pools[manager.namespace].lookup(key(0)) is None
    loaded = load(store, manager, [key(0)])
    assert np.array_equal(loaded[key(0)], first[key(0)])


def test_a_corrupt_object_is_a_miss_and_counted(env):
    new_store, new_manager = env
    store_a, cfg = new_store("a")
    store_chunks(store_a, new_manager(store_a, cfg, holder="a"), [key(1)])
    tier = store_a.object
    path = tier.object_path(new_manager(store_a, cfg, holder="x").namespace, key(1))
    raw = bytearray(tier.fs.cat_file(path))
    raw[-1] ^= 1
    tier.fs.pipe_file(path, bytes(raw))

    store_b, cfg_b = new_store("b")
    reader = new_manager(store_b, cfg_b, holder="reader")
    step(reader, store_b)
    assert load(store_b, reader, [key(1)]) == [MISS]
    assert store_b.stats()["object"]["corrupt_chunks"] == 1


def test_an_unreachable_store_drops_uploads_misses_loads_and_recovers(env, clock):
    new_store, new_manager = env
    # A stock of two (a slot evicted for a refill is reusable one step later: deferred
    # reuse), within the cap of a quarter of the arena.
    store, cfg = new_store("a", slots=8, reserve_slots=2, backoff_max_seconds=0.05)
    manager = new_manager(store, cfg)
    assert store.wait_io(10)  # the first sweep is done: the outage starts with the uploads
    switch = SwitchableFS.install(store.object)
    switch.down = True
    store_chunks(store, manager, [key(0)])
    for i in range(1, 16):  # push key(0) out of the arena: it was never uploaded
        store_chunks(store, manager, [key(i)], seed=i)
    stats = store.stats()
    assert stats["object"]["put_failures"] >= 1
    assert stats["object"]["put_failures"] + stats["object_uploads_dropped"] + stats["object"]["skipped_while_paused"] >= 16
    assert load(store, manager, [key(0)]) == [MISS]
    switch.down = False
    clock.advance(1)  # past the (at most 0.05 s) pause
    assert store.object.available()
    data = store_chunks(store, manager, [key(50)], seed=50)
    assert store.stats()["object"]["puts"] >= 1
    for i in range(51, 66):
        store_chunks(store, manager, [key(i)], seed=i)
    assert np.array_equal(load(store, manager, [key(50)], req="again")[key(50)], data[key(50)])


def test_the_sweep_keeps_the_bucket_within_capacity_and_forgets_what_it_deleted(env, clock):
    new_store, new_manager = env
    record = HEADER_BYTES + SLOT
    store_a, cfg = new_store("a", slots=16, reserve_slots=4, capacity=2 * record)
    writer = new_manager(store_a, cfg, holder="writer")
    keys = [key(i) for i in range(4)]
    data = store_chunks(store_a, writer, keys)
    base = datetime(2026, 1, 1, tzinfo=timezone.utc)
    for age, k in enumerate(keys):  # written in this order, a minute apart
        written(store_a.object, writer.namespace, k, base + timedelta(minutes=age))
    writer.take_events()
    clock.advance(1)  # a sweep is due
    step(writer, store_a)
    assert store_a.wait_io(10)
    assert store_a.object.list_keys(writer.namespace) == set(keys[2:])
    assert store_a.stats()["object"]["evicted"] == 2
    step(writer, store_a)
    removed = [e for e in writer.take_events() if e.medium == Medium.STORAGE and e.removed]
    assert {k for e in removed for k in e.keys} == set(keys[:2])

    store_b, cfg_b = new_store("b", slots=16, reserve_slots=4, capacity=2 * record)
    reader = new_manager(store_b, cfg_b, holder="reader")
    step(reader, store_b)
    assert load(store_b, reader, keys[:2]) == [MISS, MISS]
    loaded = load(store_b, reader, keys[2:], req="newest")
    assert all(np.array_equal(loaded[k], data[k]) for k in keys[2:])


def _push_out_of_the_arena(store, manager, count: int = 15) -> None:
    for i in range(100, 100 + count):
        store_chunks(store, manager, [key(i)], seed=i)
        step(manager, store)


def test_the_chunk_audit_passes_a_faithful_object_and_refuses_one_written_with_other_bytes(env):
    """`tiers.cpu.audit_chunks`: an object whose record is valid (its digest matches its
    bytes) but whose bytes no engine committed under its key (what a slot read after its
    reuse would upload) is refused as a miss; a faithful one is checked and served."""
    new_store, new_manager = env
    store, cfg = new_store("a", audit=True)
    manager = new_manager(store, cfg)
    good = store_chunks(store, manager, [key(0)])
    store_chunks(store, manager, [key(1)], seed=1)
    other = np.random.default_rng(99).integers(0, 256, SLOT, dtype=np.uint8)
    tier, namespace = store.object, manager.namespace
    assert tier.put_many(namespace, [(key(1), other)]) == [True]  # a valid record, the wrong bytes
    _push_out_of_the_arena(store, manager)
    pool = store.arena.pools[namespace]
    assert pool.lookup(key(0)) is None and pool.lookup(key(1)) is None

    loaded = load(store, manager, [key(0)])
    assert np.array_equal(loaded[key(0)], good[key(0)])
    assert load(store, manager, [key(1)], req="second") == [MISS]
    audit = store.stats()["audit"]
    assert audit["audit_promotions_checked"] == 2 and audit["audit_mismatches"] == 1
    assert audit["audit_commits"] == 17 and audit["audit_recommits_differing"] == 0


def test_without_the_audit_a_valid_record_of_other_bytes_is_served(env):
    """The reason the audit exists: the tier's own digest cannot tell (this test fails
    if that changes, and the audit's docstring with it)."""
    new_store, new_manager = env
    store, cfg = new_store("a")
    manager = new_manager(store, cfg)
    store_chunks(store, manager, [key(1)], seed=1)
    other = np.random.default_rng(99).integers(0, 256, SLOT, dtype=np.uint8)
    assert store.object.put_many(manager.namespace, [(key(1), other)]) == [True]
    _push_out_of_the_arena(store, manager)
    loaded = load(store, manager, [key(1)])
    assert np.array_equal(loaded[key(1)], other) and store.stats()["audit"] is None


def test_a_chunk_missed_while_the_bucket_was_down_is_loaded_once_it_is_back(env, clock):
    """A pin the store answers `missing` (its object tier paused) is a miss for
    `lookup_wait_seconds`, then asked for again. The engine must not forget that the bucket
    holds the chunk: the store's log sends changes only, so that was never corrected, and
    the fault matrix's object-slow row never got its hits back (#29)."""
    new_store, new_manager = env
    store, cfg = new_store("a", slots=8, reserve_slots=2, backoff_max_seconds=0.05)
    writer = new_manager(store, cfg, holder="writer")
    data = store_chunks(store, writer, [key(0)])  # write-through: in the bucket too
    for i in range(1, 16):
        store_chunks(store, writer, [key(i)], seed=i)
    assert store.arena.pools[writer.namespace].lookup(key(0)) is None
    reader = StrataManager(LocalStoreClient(store), layout(worker_bytes=SLOT), cfg, "reader", clock=clock)

    def answer(req: str) -> LookupResult:
        for _ in range(10):
            result = reader.lookup(key(0), ctx(req))
            if result is not RETRY:
                return result
            step(reader, store)
            step(writer, store)  # engines acknowledge every step: evicted slots free up
        return result

    try:
        assert reader.wait_idle(10)
        step(reader, store)
        switch = SwitchableFS.install(store.object)
        switch.down = True
        assert answer("r1") is MISS
        assert reader.counters()["pins_missed"] >= 1
        switch.down = False
        clock.advance(cfg.engine.lookup_wait_seconds + 1)  # past the tier's pause and the miss
        assert answer("r2") is HIT
        spec = reader.prepare_load([key(0)], ctx("r2"))
        assert np.array_equal(store.arena.pools[reader.namespace].view(int(spec.block_ids[0])), data[key(0)])
    finally:
        reader.shutdown()
