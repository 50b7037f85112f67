"""The disk index against a model (hypothesis), under any order of writes begun and landed,
evictions, removals, purges and restarts (issue #37, findings 3 and 4).

Writes are begun (records taken) and landed (written, settled) as separate steps, in any
order, so two writes of one key, a write begun before a purge and landing after it, and
an eviction between a write's two halves all happen. A chunk's bytes are a function of its
key and of the namespace's purge generation (what a purge invalidates: KV of old weights),
so a pre-purge write that lands is caught by what a read returns.

After every step: one record per key (the index and the records agree), the change
announcements name exactly what is indexed, capacity holds, and every indexed chunk reads
back its current generation's bytes. A restart recovers exactly what was indexed.
"""

from __future__ import annotations

import shutil
import tempfile

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvstrata.tiers.disk import HEADER_BYTES, DiskTier
from tests.utils import key

SLOT = 4096
CAPACITY_RECORDS = 4
NS = "ns"
KEYS = [key(i) for i in range(8)]


def payload(k: bytes, generation: int) -> np.ndarray:
    seed = int.from_bytes(k[:4], "big") ^ (generation * 0x9E3779B1)
    return np.random.default_rng(seed).integers(0, 256, SLOT, dtype=np.uint8)


class DiskIndexMachine(RuleBasedStateMachine):
    @initialize()
    def open_tier(self):
        self.root = tempfile.mkdtemp(prefix="kvstrata-index-model-")
        self.generation = 0  # purges so far (the model's count; survives restarts)
        self.tier_offset = 0  # the tier counts purges from its own start
        self.pending: list = []
        self.announced: set[bytes] = set()
        self.tier = self._open()

    def _open(self) -> DiskTier:
        def on_change(namespace: str, keys: list[bytes], present: bool) -> None:
            assert namespace == NS
            (self.announced.update if present else self.announced.difference_update)(keys)

        tier = DiskTier(self.root, CAPACITY_RECORDS * (SLOT + HEADER_BYTES), direct_io=False, on_change=on_change)
        self.announced = set(tier.keys(NS))  # what a node store records of a recovered tier
        return tier

    def teardown(self):
        try:
            for write in self.pending:
                write.land()
            self.tier.close()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3), stale=st.booleans())
    def begin(self, keys, stale):
        """Begin a write of these chunks; `stale`: queued before the last purge."""
        tier_generation = self.generation - self.tier_offset
        if stale and tier_generation > 0:
            writer_generation = self.generation - 1
        else:
            writer_generation = self.generation
        items = [(k, payload(k, writer_generation)) for k in keys]
        self.pending.append(self.tier.begin_write(NS, items, generation=writer_generation - self.tier_offset))

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def land(self, data):
        write = self.pending.pop(data.draw(st.integers(0, len(self.pending) - 1)))
        write.land()

    @rule(k=st.sampled_from(KEYS))
    def remove(self, k):
        self.tier.remove(NS, k)

    @rule()
    def purge(self):
        self.tier.purge(NS)
        self.generation += 1
        assert self.tier.keys(NS) == [] and not self.announced

    @precondition(lambda self: not self.pending)
    @rule()
    def restart(self):
        before = set(self.tier.keys(NS))
        self.tier.close()
        self.tier = self._open()
        self.tier_offset = self.generation
        assert set(self.tier.keys(NS)) == before, "a restart brought back chunks or lost them"

    @invariant()
    def one_record_per_key_and_the_index_agrees(self):
        slab = self.tier._slabs.get(NS)
        if slab is None:
            assert not self.announced
            return
        assert {record: k for k, record in slab.index.items()} == slab.key_of
        assert len(set(slab.free)) == len(slab.free)
        assert not set(slab.free) & (set(slab.key_of) | set(slab.busy))
        assert not set(slab.writing) & set(slab.index)
        assert set(slab.writing.values()) <= set(slab.busy)
        assert set(slab.index) == self.announced
        assert self.tier.stats()["allocated"] <= self.tier.capacity

    @invariant()
    def every_indexed_chunk_reads_back_its_current_bytes(self):
        out = np.empty(SLOT, dtype=np.uint8)
        for k in self.tier.keys(NS):
            assert self.tier.read_into(NS, k, out), "an indexed chunk failed its read"
            assert np.array_equal(out, payload(k, self.generation)), "a chunk read back bytes of another generation"


DiskIndexMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=25, deadline=None)
test_disk_index_against_a_model = DiskIndexMachine.TestCase
