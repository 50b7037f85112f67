"""The copy engine alone (torch only): pages land where the slot layout says, and come
back bit-exact, for several tensors, groups, chunk sizes and ranks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstrata.connector.copy_engine import CopyEngine, GroupRef, SlotLayout
from kvstrata.tiers.arena import Arena

PAGES = [256, 512]  # two KV tensors with different page sizes
NUM_BLOCKS = 16


def make_tensors(device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(-128, 127, (NUM_BLOCKS, p), dtype=torch.int8, generator=g).to(device) for p in PAGES]


@pytest.fixture
def pool(tmp_path):
    arena = Arena(str(tmp_path), "n", capacity=1 << 20, segment_size=4 * 8192, lease_seconds=10, prefault=False)
    rank_stride = sum(PAGES) * 2  # blocks_per_chunk = 2
    pool = arena.pool("ns", 2 * rank_stride)  # world size 2
    yield pool
    arena.close()


# Group 0 uses both tensors; group 1 only the second (as hybrid models share tensors).
GROUPS = [[GroupRef(0, 256), GroupRef(1, 512)], [GroupRef(1, 400)]]


def engine(tensors, rank):
    return CopyEngine(tensors, GROUPS, blocks_per_chunk=2, rank=rank, rank_stride=sum(PAGES) * 2)


def test_slot_layout_places_ranks_tensors_and_sub_blocks():
    layout = SlotLayout([256, 512], blocks_per_chunk=2, rank=1, rank_stride=2000)
    assert layout.offset(0, 0) == 2000
    assert layout.offset(0, 1) == 2256
    assert layout.offset(1, 0) == 2512
    assert layout.offset(1, 1) == 3024
    with pytest.raises(ValueError, match="reserves 1000 bytes per rank"):
        SlotLayout([256, 512], blocks_per_chunk=2, rank=0, rank_stride=1000)


def test_round_trip_is_bit_exact_across_groups_and_partial_chunks(pool):
    slots = np.array(pool.reserve("w", 6), dtype=np.int64)
    src = make_tensors(seed=1)
    # Group 0: 3 blocks starting one sub-block into a chunk -> 2 slots.
    # Group 1: 2 blocks starting at a chunk boundary -> 1 slot.
    block_ids = np.array([3, 7, 9, 11, 2], dtype=np.int32)
    group_sizes, block_indices = [3, 2], [1, 4]
    writer = engine(src, rank=1)
    writer.store(5, pool.geometry, block_ids, group_sizes, block_indices, slots[:3])
    assert [c.job_id for c in writer.finished()] == [5]

    dst = [torch.zeros_like(t) for t in src]
    reader = engine(dst, rank=1)
    reader.load(6, pool.geometry, slots[:3], block_ids, group_sizes, block_indices)
    (done,) = reader.finished()
    assert done.success and done.num_bytes == 3 * (256 + 512) + 2 * 400
    for b in [3, 7, 9]:
        assert torch.equal(dst[0][b], src[0][b]) and torch.equal(dst[1][b], src[1][b])
    for b in [11, 2]:
        assert torch.equal(dst[1][b, :400], src[1][b, :400])
        assert not dst[1][b, 400:].any()  # only the ref's un-padded page moves
    # Rank 1 never writes rank 0's half of a slot.
    for slot in slots[:3]:
        assert not pool.view(int(slot))[: sum(PAGES) * 2].any()
    # Block 3 is sub-block 1 of the first slot.
    first = pool.view(int(slots[0]))
    base = sum(PAGES) * 2
    assert np.array_equal(first[base + 256 : base + 512], src[0][3].numpy().view(np.uint8))


def test_transfer_shape_mismatch_is_an_error(pool):
    slots = np.array(pool.reserve("w", 2), dtype=np.int64)
    eng = engine(make_tensors(), rank=0)
    with pytest.raises(ValueError, match="transfer shape mismatch"):
        eng.store(1, pool.geometry, np.array([1], dtype=np.int32), [1, 0], [0, 0], slots)
    with pytest.raises(ValueError, match="names 1 KV groups, this worker has 2"):
        eng.store(1, pool.geometry, np.array([1], dtype=np.int32), [1], [0], slots[:1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_round_trip_through_registered_arena(pool):
    slots = np.array(pool.reserve("w", 3), dtype=np.int64)
    src = make_tensors("cuda", seed=3)
    block_ids = np.array([3, 7, 9, 11, 2], dtype=np.int32)
    writer = engine(src, rank=0)
    writer.store(1, pool.geometry, block_ids, [3, 2], [1, 4], slots)
    writer.wait({1})
    dst = [torch.zeros_like(t) for t in src]
    reader = engine(dst, rank=0)
    reader.load(2, pool.geometry, slots, block_ids, [3, 2], [1, 4])
    reader.wait({2})
    assert [c.job_id for c in reader.finished()] == [2]
    for b in [3, 7, 9]:
        assert torch.equal(dst[0][b], src[0][b]) and torch.equal(dst[1][b], src[1][b])
    writer.close()
    reader.close()
