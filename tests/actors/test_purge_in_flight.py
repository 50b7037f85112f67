"""A purge purges the work in flight too (issue #37, finding 3).

A disk write, a promotion or an upload queued before a purge and landing after it must not
bring the namespace's pre-purge bytes back: after the purge's in-flight work settles,
nothing of the namespace is in any tier, a new engine asking for the chunk gets a MISS,
and a restarted store does not find it on disk. The store's I/O runs on `ManualExecutor`s
(the executor seam), so each test picks the order in which jobs land: no threads, no sleeps.
"""

from __future__ import annotations

import os

import pytest

from kvstrata._dev.executors import ManualExecutors
from kvstrata.store.node_store import NodeStore
from kvstrata.protocol import StepRequest
from kvstrata.config import load_config
from kvstrata.tiers.changelog import CPU, OBJECT, STORAGE
from kvstrata.tiers.disk import HEADER_BYTES
from tests.utils import FakeClock, key, store_config

SLOT = 4096
NS = "ns-purged"
K = key(1)
OLD = 0x11  # the pre-purge bytes (KV of the weights before an in-place update)


def build(tmp_path, disk: bool = True, bucket: bool = False, clock=None):
    disk_config = {"path": str(tmp_path / "disk"), "capacity": 64 * (SLOT + HEADER_BYTES), "write_policy": "write_through"}
    raw = store_config(tmp_path, capacity=16 * SLOT, disk=disk_config if disk else None)
    if bucket:
        raw["tiers"]["object"] = {
            "url": f"file://{tmp_path}/bucket/kv", "write_policy": "write_through", "index_refresh_seconds": 5,
        }  # fmt: skip
    executors = ManualExecutors("disk", "object")
    store = NodeStore(load_config(raw), "node0", **({"clock": clock} if clock else {}), executors=executors)
    return store, executors


@pytest.fixture
def built(tmp_path):
    made = []

    def make(**kwargs):
        made.append(build(tmp_path, **kwargs))
        return made[-1]

    yield make
    for store, executors in made:
        executors.run_all()
        store.close()


def commit_old_bytes(store: NodeStore, executors: ManualExecutors, holder: str = "engine-a") -> str:
    """Register (its first sweep done), write K's pre-purge bytes into a reserved slot and
    commit it; returns the epoch. The copies of K to the lower tiers are queued, not run."""
    epoch = store.register(holder, NS, SLOT).epoch
    executors.run_all()
    pool = store.arena.pools[NS]
    [slot] = pool.reserve(holder, 1)
    pool.view(slot)[:] = OLD
    store.step(StepRequest(holder, NS, epoch=epoch, commit=[(slot, K)]))
    return epoch


def only_below_the_arena(store: NodeStore, holder: str = "engine-a") -> None:
    """The arena forgets K (its engine let go); the lower tiers still hold it."""
    pool = store.arena.pools[NS]
    pool.drop_holder(holder)
    pool.purge()


def purge(store: NodeStore, epoch: str, holder: str = "engine-a") -> None:
    """What vLLM's reset_prefix_cache(reset_connector=True) sends."""
    reply = store.step(StepRequest(holder, NS, epoch=epoch, purge=True))
    assert not reply.rejected


def run_first(executors: ManualExecutors, role: str, names: tuple[str, ...]) -> None:
    """Land the queued jobs of these names first (in the worst order for the purge), then the rest."""
    for job in [job for job in executors[role].pending if job.name in names]:
        executors[role].run(job)
    executors.run_all()


def assert_nothing_left(store: NodeStore, k: bytes = K) -> None:
    """Nothing of the namespace in any tier, and a new engine's request for `k` is a MISS."""
    assert store.read(NS, k) is None
    assert store.keys(NS, CPU) == []
    assert store.keys(NS, STORAGE) == []
    assert store.keys(NS, OBJECT) == []
    if store.disk is not None:
        assert store.disk.keys(NS) == []
    if store.object is not None:
        assert not store.object.list_keys(NS)
    epoch = store.register("engine-b", NS, SLOT).epoch
    reply = store.step(StepRequest("engine-b", NS, epoch=epoch, pin=[k]))
    for executor in (store._io, store._object_io):  # a promotion started now would land here
        if executor is not None:
            executor.run_all()
    again = store.step(StepRequest("engine-b", NS, epoch=epoch, pin=[k]))
    assert k not in reply.pinned and k not in again.pinned, "a new engine was served pre-purge bytes"
    assert again.missing == [k]


def test_a_disk_write_queued_before_a_purge_does_not_land_after_it(tmp_path):
    store, executors = build(tmp_path)
    try:
        epoch = commit_old_bytes(store, executors)
        assert [job.name for job in executors["disk"].pending] == ["_write_job"]
        purge(store, epoch)
        executors.run_all()  # the write lands after the purge
        assert_nothing_left(store)
    finally:
        store.close()
    restarted = NodeStore(load_config(store.config.model_dump()), "node0")
    try:
        assert restarted.keys(NS, STORAGE) == [], "a restart brought pre-purge bytes back from disk"
    finally:
        restarted.close()


def test_commits_sent_with_the_purge_are_purged_too(built):
    """A manager sends the commits it had (stored before the reset) with its purge: they
    hold pre-reset bytes, so the purge covers them."""
    store, executors = built(disk=False)
    epoch = store.register("engine-a", NS, SLOT).epoch
    pool = store.arena.pools[NS]
    [slot] = pool.reserve("engine-a", 1)
    pool.view(slot)[:] = OLD
    store.step(StepRequest("engine-a", NS, epoch=epoch, commit=[(slot, K)], purge=True))
    assert_nothing_left(store)


@pytest.mark.parametrize("source,when", [("disk", "queued"), ("disk", "reading"), ("object", "queued")])
def test_a_promotion_in_flight_at_a_purge_does_not_commit_after_it(built, source, when):
    """`queued`: the purge comes before the promotion's job starts; `reading`: after its
    read, before the read is verified and committed (the record is busy meanwhile)."""
    store, executors = built(disk=source == "disk", bucket=source == "object")
    epoch = commit_old_bytes(store, executors)
    executors.run_all()  # K reached the lower tier
    only_below_the_arena(store)
    reply = store.step(StepRequest("engine-a", NS, epoch=epoch, pin=[K]))
    assert reply.pending == [K]
    [job] = executors[source].named("_promote_job" if source == "disk" else "_object_promote_job")
    if when == "reading":
        executors["disk-digest"].hold = True
        executors[source].run(job)  # read; its checksum waits
        executors["disk-digest"].hold = False
        assert executors["disk-digest"].pending
    purge(store, epoch)
    executors.run_all()  # the promotion lands after the purge
    pool = store.arena.pools[NS]
    assert pool.stats()["reserved"] == 0, "the promotion's slot leaked"
    assert_nothing_left(store)


@pytest.mark.parametrize("first", ["upload", "purge"])
def test_an_upload_in_flight_at_a_purge_does_not_record_the_object_after_it(built, first):
    store, executors = built(disk=False, bucket=True)
    epoch = commit_old_bytes(store, executors)
    assert [job.name for job in executors["object"].pending] == ["_upload_job"]
    purge(store, epoch)
    if first == "purge":  # the bucket is emptied, then the upload lands
        run_first(executors, "object", ("purge", "_object_purge_job"))
    else:
        run_first(executors, "object", ("_upload_job",))
    assert_nothing_left(store)


def test_a_sweep_listing_before_the_purge_deleted_the_objects_records_none_of_them(built):
    clock = FakeClock()
    store, executors = built(disk=False, bucket=True, clock=clock)
    epoch = commit_old_bytes(store, executors)
    executors.run_all()  # K is in the bucket
    assert store.object.list_keys(NS) == {K}
    only_below_the_arena(store)
    purge(store, epoch)
    clock.advance(store.config.tiers.object.index_refresh_seconds + 1)
    store.step(StepRequest("engine-a", NS, epoch=epoch))  # a sweep is due
    assert executors["object"].named("_scan_job")
    run_first(executors, "object", ("_scan_job",))  # it lists the bucket before the purge empties it
    assert_nothing_left(store)


def test_a_purge_writes_nothing_per_chunk_under_the_store_lock(built, monkeypatch):
    """A purge of a namespace with many chunks on disk must not stall every engine's
    control call: it wipes no record header one by one while it holds the store lock."""
    store, executors = built()
    epoch = store.register("engine-a", NS, SLOT).epoch
    pool = store.arena.pools[NS]
    for i in range(32):
        [slot] = pool.reserve("engine-a", 1)
        pool.view(slot)[:] = i
        store.step(StepRequest("engine-a", NS, epoch=epoch, commit=[(slot, key(100 + i))], unpin=[slot]))
        executors.run_all()
    assert len(store.disk.keys(NS)) == 32
    writes = []
    real_pwrite = os.pwrite

    def counted(fd, data, offset):
        writes.append(offset)
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr("kvstrata.tiers.disk.tier.os.pwrite", counted)
    purge(store, epoch)
    assert writes == [], f"{len(writes)} header writes under the store lock"
    executors.run_all()
    assert store.disk.keys(NS) == []


def test_a_bucket_purge_that_fails_is_tried_again_and_sweeps_record_nothing_meanwhile(built, monkeypatch):
    clock = FakeClock()
    store, executors = built(disk=False, bucket=True, clock=clock)
    epoch = commit_old_bytes(store, executors)
    executors.run_all()  # K is in the bucket
    only_below_the_arena(store)
    real_purge = store.object.purge
    monkeypatch.setattr(store.object, "purge", lambda namespace: None)  # the bucket did not answer
    purge(store, epoch)
    executors.run_all()
    assert store.object.list_keys(NS) == {K}  # still there
    clock.advance(store.config.tiers.object.index_refresh_seconds + 1)
    monkeypatch.setattr(store.object, "purge", real_purge)
    store.step(StepRequest("engine-a", NS, epoch=epoch))  # a sweep is due, and the purge again
    run_first(executors, "object", ("_scan_job",))  # the sweep lists K before the purge deletes it
    assert_nothing_left(store)
