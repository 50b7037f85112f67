"""The disk tier behind the manager: cascade, promotion (RETRY then HIT), integrity,
restart, write-back, and failures that turn into misses. In-process node stores."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvstrata.store import disk_jobs
from kvstrata.store.node_store import LocalStoreClient, NodeStore
from kvstrata.protocol import StepRequest
from kvstrata.config import load_config
from kvstrata.connector.compat import LookupResult, Medium, load_source
from kvstrata.connector.manager import StrataManager
from kvstrata.tiers.disk import HEADER_BYTES
from kvstrata.tiers.disk import reads as disk_reads
from tests.connector.harness import SLOT, ctx, step, store_chunks
from tests.utils import flip_disk_payload_bytes, key, layout, store_config

HIT, MISS, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY


@pytest.fixture
def env(tmp_path):
    """Builds stores and managers for a test; closes all of them afterwards."""
    made = {"stores": [], "managers": []}

    def store(slots=8, reserve_slots=2, disk=None, write_policy="write_through", disk_dir="disk", audit=False, **disk_extra):
        disk = disk or {"path": str(tmp_path / disk_dir), "capacity": 64 * (SLOT + HEADER_BYTES), "write_policy": write_policy, **disk_extra}
        raw = store_config(tmp_path, capacity=slots * SLOT, reserve_slots=reserve_slots, disk=disk)
        raw["tiers"]["cpu"]["audit_chunks"] = audit
        cfg = load_config(raw)
        node_store = NodeStore(cfg, "node0")
        made["stores"].append(node_store)
        return node_store, cfg

    def manager(node_store, cfg, holder="engine", client=None):
        m = StrataManager(client or LocalStoreClient(node_store), layout(worker_bytes=SLOT), cfg, holder, enable_events=True)
        made["managers"].append(m)
        assert m.wait_idle(10)
        return m

    yield store, manager
    for m in made["managers"]:
        m.shutdown()
    for s in made["stores"]:
        s.close()


def push_out_of_arena(store, manager, keys, start=100):
    """Store other chunks until `keys` are no longer in the arena."""
    i = start
    while any(store.arena.pools[manager.namespace].lookup(k) is not None for k in keys):
        store_chunks(store, manager, [key(i), key(i + 1)], seed=i)
        step(manager)
        i += 2
        assert i < start + 200


def on_disk_only(env, keys):
    """A store whose `keys` were written by a writer and pushed out of the arena to its
    disk, and a fresh reader: (store, writer, reader, the bytes written per key)."""
    make_store, make_manager = env
    store, cfg = make_store()
    writer = make_manager(store, cfg, "writer")
    data = store_chunks(store, writer, keys)
    assert store.wait_io(10)
    push_out_of_arena(store, writer, keys)
    assert store.wait_io(10)
    return store, writer, make_manager(store, cfg, "reader"), data


def test_chunks_evicted_from_the_arena_come_back_from_disk_bit_exact(env):
    store, writer, reader, data = on_disk_only(env, [key(1), key(2)])
    assert {key(1), key(2)} <= set(store.keys(writer.namespace, "STORAGE"))
    assert reader.lookup(key(1), ctx()) is RETRY  # on disk only: promotion starts
    for _ in range(20):
        step(reader)
        step(writer)  # engines acknowledge every step: the slots the promotion evicts free up
        store.wait_io(10)
        if reader.lookup(key(1), ctx()) is HIT:
            break
    assert reader.lookup(key(1), ctx()) is HIT
    spec = reader.prepare_load([key(1)], ctx())
    assert np.array_equal(store.arena.pools[reader.namespace].view(int(spec.block_ids[0])), data[key(1)])
    assert store.stats()["promotions"] >= 1
    assert reader.counters()["chunks_promoted"] == 1
    assert reader.lookup(key(999), ctx()) is MISS
    if load_source("STORAGE") is not None:  # vLLM 0.32+ asks where each hit came from
        assert reader.get_load_source(key(1), ctx()) == load_source("STORAGE")  # it waited on the disk
        assert reader.lookup(key(1), ctx("later")) is HIT
        assert reader.get_load_source(key(1), ctx("later")) == load_source("CPU")  # already in the arena


def test_a_request_that_ends_while_its_promotion_runs_leaves_no_pin_behind(env):
    """vLLM aborts a request that is waiting (RETRY) for a chunk the store promotes from
    disk. The promotion still lands; nobody waits for it any more, so its pin is released
    at the next step instead of holding an arena slot for good."""
    store, writer, reader, _ = on_disk_only(env, [key(1)])
    assert reader.lookup(key(1), ctx("aborted")) is RETRY  # on disk only: promotion starts
    reader.on_request_finished(ctx("aborted"))
    pool = store.arena.pools[reader.namespace]
    for _ in range(20):  # the promotion lands and is collected; then its pin goes
        step(reader)
        step(writer)  # engines acknowledge every step: the slots the promotion evicts free up
        assert store.wait_io(10)
        if pool.lookup(key(1)) is not None and not reader._pin_waiters:
            break
    step(reader)
    step(reader)
    assert pool.lookup(key(1)) is not None  # promoted
    assert pool.stats()["pinned"] == 0 and key(1) not in reader._pinned


def test_disk_events_carry_the_storage_medium_and_group(env):
    make_store, make_manager = env
    store, cfg = make_store()
    manager = make_manager(store, cfg)
    store_chunks(store, manager, [key(1, group=2)])
    assert store.wait_io(10)
    step(manager)
    events = list(manager.take_events())
    storage = [e for e in events if e.medium == Medium.STORAGE and not e.removed]
    assert storage and storage[0].keys == [key(1, group=2)]
    assert any(e.medium == Medium.CPU and not e.removed and key(1, group=2) in e.keys for e in events)


def test_a_corrupt_disk_chunk_is_a_miss_and_counted(env, tmp_path):
    store, writer, reader, _ = on_disk_only(env, [key(1)])
    assert flip_disk_payload_bytes(tmp_path / "disk", stride=SLOT, key=key(1)) == 1
    results = []
    for _ in range(10):
        results.append(reader.lookup(key(1), ctx()))
        if results[-1] is not RETRY:
            break
        step(reader)
        step(writer)  # engines acknowledge every step: the slots the promotion evicts free up
        store.wait_io(10)
    assert results[0] is RETRY and results[-1] is MISS
    assert store.stats()["disk"]["corrupt_chunks"] == 1
    assert store.stats()["promotion_failures"] == 1


def test_the_chunk_audit_refuses_a_valid_disk_record_of_other_bytes_and_drops_it(env):
    """`tiers.cpu.audit_chunks`: a record whose digest matches its bytes, but whose bytes no
    engine committed under its key, is a miss, counted, and gone from the disk tier; a
    faithful record of the same store is checked and served."""
    make_store, make_manager = env
    store, cfg = make_store(audit=True)
    writer = make_manager(store, cfg, "writer")
    data = store_chunks(store, writer, [key(1), key(2)])
    assert store.wait_io(10)
    other = np.random.default_rng(99).integers(0, 256, SLOT, dtype=np.uint8)
    assert store.disk.remove(writer.namespace, key(2))  # a record is never rewritten in place
    assert store.disk.write_many(writer.namespace, [(key(2), other)]) == [True]
    push_out_of_arena(store, writer, [key(1), key(2)])
    assert store.wait_io(10)

    reader = make_manager(store, cfg, "reader")
    answers = {}
    for _ in range(20):
        answers = {k: reader.lookup(k, ctx(k.hex())) for k in (key(1), key(2))}
        if RETRY not in answers.values():
            break
        step(reader)
        step(writer)  # engines acknowledge every step: the slots the promotion evicts free up
        store.wait_io(10)
    assert answers == {key(1): HIT, key(2): MISS}
    spec = reader.prepare_load([key(1)], ctx(key(1).hex()))
    assert np.array_equal(store.arena.pools[reader.namespace].view(int(spec.block_ids[0])), data[key(1)])
    audit = store.stats()["audit"]
    assert audit["audit_promotions_checked"] == 2 and audit["audit_mismatches"] == 1
    assert store.disk.present(writer.namespace, [key(1), key(2)]) == {key(1)}


def test_a_new_store_serves_what_the_previous_one_left_on_disk(env):
    make_store, make_manager = env
    store, cfg = make_store()
    client = LocalStoreClient(store)
    manager = make_manager(store, cfg, client=client)
    data = store_chunks(store, manager, [key(1), key(2)])
    assert store.wait_io(10)
    store.close()  # the store went away; its arena with it, its disk records did not
    client.store, _ = make_store()
    step(manager)  # new epoch: the manager re-registers and learns what is on disk
    for k in (key(1), key(2)):
        for _ in range(20):
            if manager.lookup(k, ctx()) is HIT:
                break
            step(manager)
            client.store.wait_io(10)
        spec = manager.prepare_load([k], ctx())
        assert np.array_equal(client.store.arena.pools[manager.namespace].view(int(spec.block_ids[0])), data[k])


def test_write_back_writes_only_what_the_arena_evicts(env):
    make_store, make_manager = env
    store, cfg = make_store(write_policy="write_back")
    manager = make_manager(store, cfg)
    store_chunks(store, manager, [key(1)])
    assert store.wait_io(10)
    assert store.keys(manager.namespace, "STORAGE") == []
    push_out_of_arena(store, manager, [key(1)])
    assert store.wait_io(10)
    assert key(1) in store.keys(manager.namespace, "STORAGE")


def test_an_unusable_disk_path_leaves_the_arena_serving(env, tmp_path):
    make_store, make_manager = env
    blocker = tmp_path / "file"
    blocker.write_text("x")
    store, cfg = make_store(disk={"path": str(blocker / "disk"), "capacity": 1 << 20})
    assert "not a writable directory" in store.stats()["disk"]["error"]
    manager = make_manager(store, cfg)
    data = store_chunks(store, manager, [key(1)])
    step(manager)  # its commit answered, the writer's own pin goes: the next HIT is the mirror's
    calls = manager._channel.calls
    assert manager.lookup(key(1), ctx()) is HIT  # the arena serves on its own, with no store call
    spec = manager.prepare_load([key(1)], ctx())
    assert manager._channel.calls == calls
    pool = store.arena.pools[manager.namespace]
    assert np.array_equal(pool.view(int(spec.block_ids[0])), data[key(1)])
    step(manager)  # the load is in flight: its hold reaches the store
    assert pool.stats()["holds"] == 1
    manager.complete_load([key(1)], ctx())
    assert store.stats()["disk_writes_queued"] == 0


def test_a_full_write_queue_drops_disk_writes_without_blocking(env):
    """The store's disk writes go through `write_many` (the call patched here: patching
    `write` once tested nothing). The one queued write is held inside the disk tier while
    the commits return; it sees them returned, and the three beyond the queue are dropped."""
    make_store, make_manager = env
    store, cfg = make_store(queue_depth=1, slots=16, reserve_slots=8)
    entered, release, commits_returned = threading.Event(), threading.Event(), threading.Event()
    seen_commits_returned = []
    real_write_many = store.disk.write_many

    def slow_write_many(namespace, items, **kwargs):
        entered.set()
        release.wait(10)  # bounded: a write the commits waited for sees them not returned
        seen_commits_returned.append(commits_returned.is_set())
        return real_write_many(namespace, items, **kwargs)

    store.disk.write_many = slow_write_many
    manager = make_manager(store, cfg)
    store_chunks(store, manager, [key(i) for i in range(4)])  # commits return at once
    commits_returned.set()
    assert entered.wait(10), "the queued disk write never reached the disk tier"
    assert store.stats()["disk_writes_dropped"] == 3
    release.set()
    assert store.wait_io(10)
    assert seen_commits_returned == [True]
    assert len(store.keys(manager.namespace, "STORAGE")) == 1


@pytest.mark.parametrize("chunk_kib", [256, 1024, 8192, 32768])
@pytest.mark.parametrize("total_mib", [1, 40, 512, 4096])
@pytest.mark.parametrize("threads", [1, 4, 7])
def test_a_request_is_split_into_small_first_and_last_jobs_and_even_rounds_of_bounded_ones_between(chunk_kib, total_mib, threads):
    chunk = chunk_kib << 10
    count = max(1, (total_mib << 20) // chunk)
    sizes = disk_jobs.disk_job_sizes(count, chunk, threads)
    assert sum(sizes) == count and min(sizes) >= 1
    largest = max(1, disk_jobs.DISK_JOB_BYTES // chunk)
    edge = max(1, disk_jobs.EDGE_JOB_BYTES // chunk)
    assert max(sizes) <= largest
    if count >= 2 * threads * edge + 1:  # enough for small jobs at both ends and some between
        assert sizes[:threads] == sizes[-threads:] == [edge] * threads
        between = sizes[threads:-threads]
        # Every thread gets as many jobs between as the others, of sizes one chunk apart, so
        # no thread idles while another reads a whole job more (the last jobs are too small
        # to even that out); and no more of them than that needs.
        if len(between) >= threads:
            assert len(between) % threads == 0
            assert len(between) // threads == -(-sum(between) // (largest * threads))
        assert max(between) - min(between) <= 1
    else:
        assert max(sizes) <= edge


def test_a_large_cascade_and_its_promotion_go_to_disk_in_bounded_jobs(env, monkeypatch):
    """Each disk job moves at most DISK_JOB_BYTES, so I/O threads checksum a little and go
    back to the disk, and the first promoted chunks are ready before the last are read.
    Each thread's first and last jobs are one chunk (EDGE_JOB_BYTES)."""
    monkeypatch.setattr(disk_jobs, "DISK_JOB_BYTES", 3 * SLOT)
    monkeypatch.setattr(disk_jobs, "EDGE_JOB_BYTES", SLOT)
    make_store, _ = env
    store, _ = make_store(slots=24, io_threads=2)
    calls = []
    for name in ("write_many", "start_reads"):
        real = getattr(store.disk, name)

        def counted(namespace, items, real=real, name=name, **kwargs):
            calls.append((name, len(items)))
            return real(namespace, items, **kwargs)

        monkeypatch.setattr(store.disk, name, counted)
    epoch = store.register("bulk", "ns", SLOT).epoch
    pool = store.arena.pools["ns"]
    slots = pool.reserve("bulk", 20)
    keys = [key(i) for i in range(20)]
    data = {}
    for i, (k, slot) in enumerate(zip(keys, slots)):
        data[k] = np.random.default_rng(i).integers(0, 256, SLOT, dtype=np.uint8)
        pool.view(slot)[:] = data[k]
    store.step(StepRequest("bulk", "ns", epoch=epoch, commit=list(zip(slots, keys))))
    assert store.wait_io(10)
    pool.drop_holder("bulk")
    pool.purge()  # only the disk has them now
    reply = store.step(StepRequest("bulk", "ns", epoch=epoch, pin=keys))
    assert len(reply.pending) == 20
    assert store.wait_io(10)

    writes = [n for name, n in calls if name == "write_many"]
    reads = [n for name, n in calls if name == "start_reads"]
    # 2 threads: 1, 1, then 16 chunks in jobs of at most 3, then 1, 1.
    assert sorted(writes) == sorted(reads) == [1, 1, 1, 1, 2, 2, 3, 3, 3, 3]
    for k in keys:
        slot = pool.lookup(k)
        assert slot is not None and np.array_equal(pool.view(slot), data[k])
    assert store.stats()["promotions"] == 20


def test_closing_the_store_lets_promotions_being_verified_finish(env, monkeypatch):
    """Promotions are committed on the disk tier's digest threads once verified; closing the
    store waits for them before it takes the lock they need (no deadlock, no lost chunk)."""
    make_store, _ = env
    store, _ = make_store(slots=8)
    epoch = store.register("bulk", "ns", SLOT).epoch
    pool = store.arena.pools["ns"]
    slots = pool.reserve("bulk", 4)
    keys = [key(i) for i in range(4)]
    for i, slot in enumerate(slots):
        pool.view(slot)[:] = i + 1
    store.step(StepRequest("bulk", "ns", epoch=epoch, commit=list(zip(slots, keys))))
    assert store.wait_io(10)
    pool.drop_holder("bulk")
    pool.purge()
    release, closing = threading.Event(), threading.Event()
    real_hasher, real_close = disk_reads.payload_hasher, store.disk.close

    def held(namespace, chunk_key):
        assert release.wait(10)
        return real_hasher(namespace, chunk_key)

    def close_disk():
        closing.set()
        real_close()

    monkeypatch.setattr(disk_reads, "payload_hasher", held)
    monkeypatch.setattr(store.disk, "close", close_disk)
    assert len(store.step(StepRequest("bulk", "ns", epoch=epoch, pin=keys)).pending) == 4
    closer = threading.Thread(target=store.close)
    closer.start()
    assert closing.wait(10)  # the store is closing its disk tier with the reads unverified
    release.set()
    closer.join(20)
    assert not closer.is_alive(), "closing the store deadlocked with a verification"
    assert store.counters["promotions"] == 4 and not store.promotion.busy()


def test_a_prefetched_chunk_is_a_hit_at_its_requests_first_lookup_bit_exact(env):
    # What route-time prefetch and `kvstrata warm` are judged by (issue #41): the engine's
    # first lookup of a prefetched chunk answers HIT, with the bytes stored. The control,
    # a chunk on disk that nobody prefetched, waits (RETRY) at its request's first lookup.
    store, writer, reader, data = on_disk_only(env, [key(1), key(2)])
    assert store.prefetch(reader.namespace, [key(1)]) in ({"moving": 1}, {"waiting": 1})
    for _ in range(20):  # engines acknowledge evictions every step: the slot the move takes frees up
        step(writer)
        step(reader)
        store.wait_io(10)
        if store.prefetch_holds(reader.namespace):
            break
    assert set(store.prefetch_holds(reader.namespace)) == {key(1)}
    step(reader)  # the reader's view learns it landed (as a serving engine's every step does)
    assert reader.lookup(key(1), ctx("warm")) is HIT
    assert reader.lookup(key(2), ctx("cold")) is RETRY
    counted = reader.counters()
    assert counted["requests_hit_at_first_lookup"] == 1 and counted["requests_retried_at_first_lookup"] == 1
    spec = reader.prepare_load([key(1)], ctx("warm"))
    assert np.array_equal(store.arena.pools[reader.namespace].view(int(spec.block_ids[0])), data[key(1)])
    step(reader)  # its pin reaches the store: the hold ends, counted as used
    assert store.stats()["prefetch_used"] == 1 and not store.prefetch_holds(reader.namespace)
