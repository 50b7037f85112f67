"""One record per key in the disk index, whatever order writes, evictions and purges land in
(issue #37, finding 4), and a purge that forgets a namespace at once and for good.

Two writes of one key used to run side by side (write_back: evicted, recomputed, evicted
again before the first write landed; write_through: purged with its write queued, then
recomputed): the second settle overwrote `index[K]`, two records named K, evicting one
deleted the other's entry, and every later write of the namespace raised KeyError.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvstrata._dev.executors import ManualExecutor
from kvstrata.tiers.disk import HEADER_BYTES, DiskTier
from kvstrata.tiers.disk import tier as tier_module
from tests.utils import key

SLOT = 4096
RECORD = SLOT + HEADER_BYTES
NS = "ns"


def chunk(value: int) -> np.ndarray:
    return np.full(SLOT, value % 256, dtype=np.uint8)


def records_naming(tier: DiskTier, k: bytes) -> list[int]:
    slab = tier._slabs[NS]
    return [record for record, named in slab.key_of.items() if named == k]


@pytest.fixture
def tier(tmp_path):
    made = DiskTier(tmp_path / "disk", 4 * RECORD, direct_io=False)
    yield made
    made.close()


def test_two_writes_of_one_key_in_flight_leave_one_record_and_later_writes_work(tier, monkeypatch):
    """The first write of K is held inside its I/O (after it took a record) while a second
    write of K runs whole; then the first lands. One record names K, and filling the tier
    past its capacity (evicting K) and writing on works."""
    inside, release = threading.Event(), threading.Event()
    real_write_batch = tier_module.write_batch
    held = []

    def gated(*args, **kwargs):
        if not held:
            held.append(True)
            inside.set()
            assert release.wait(10), "the test never let the first write land"
        return real_write_batch(*args, **kwargs)

    monkeypatch.setattr(tier_module, "write_batch", gated)
    k = key(0)
    outcome: list[list[bool]] = []
    first = threading.Thread(target=lambda: outcome.append(tier.write_many(NS, [(k, chunk(1))])))
    first.start()
    try:
        assert inside.wait(10)
        tier.write_many(NS, [(k, chunk(1))])  # the same chunk, again, while the first is in flight
    finally:
        release.set()
        first.join(10)
    assert not first.is_alive() and outcome == [[True]]
    assert len(records_naming(tier, k)) == 1
    for i in range(1, 12):  # 3x the capacity: K and everything after it is evicted in turn
        assert tier.write_many(NS, [(key(i), chunk(i))]) == [True]
    out = np.empty(SLOT, dtype=np.uint8)
    assert tier.read_into(NS, key(11), out) and np.array_equal(out, chunk(11))
    slab = tier._slabs[NS]
    assert {record: k for k, record in slab.index.items()} == slab.key_of


def test_a_purge_forgets_at_once_and_gives_the_space_back_when_reads_in_flight_end(tmp_path):
    """A purge unlinks the namespace's files (no header is wiped one by one); a read already
    in flight still ends (its caller checks its own purge generation); the space counts
    against capacity until then, and a restart finds nothing."""
    digests = ManualExecutor("disk-digest", hold=False)
    tier = DiskTier(tmp_path / "disk", 4 * RECORD, direct_io=False, digests=digests)
    try:
        for i in range(3):
            tier.write_many(NS, [(key(i), chunk(i))])
        generation = tier.generation(NS)
        digests.hold = True
        out = np.empty(SLOT, dtype=np.uint8)
        reading = tier.start_reads(NS, [(key(0), out)])  # read; its checksum waits
        digests.hold = False
        assert tier.purge(NS) == 3
        assert tier.keys(NS) == [] and tier.generation(NS) == generation + 1
        assert not list((tmp_path / "disk").glob("ns-*")), "the purged slab's files are still there"
        assert tier.stats()["allocated"] > 0  # the read in flight still holds the old files
        digests.run_all()
        assert reading.result() == [True] and np.array_equal(out, chunk(0))
        assert tier.stats()["allocated"] == 0
        assert tier.write_many(NS, [(key(5), chunk(5))], generation=generation) == [False]  # queued before it
        assert tier.write_many(NS, [(key(6), chunk(6))], generation=generation + 1) == [True]
    finally:
        tier.close()
    reopened = DiskTier(tmp_path / "disk", 4 * RECORD, direct_io=False)
    try:
        assert reopened.keys(NS) == [key(6)]
    finally:
        reopened.close()
