"""The copy engine alone (torch only): pages land where the slot layout says, and come
back bit-exact, for several tensors, groups, chunk sizes and ranks."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstrata.connector import copy_engine
from kvstrata.connector.copy_engine import CopyEngine, GroupRef, SlotLayout
from kvstrata.tiers.arena import Arena

PAGES = [256, 512]  # two KV tensors with different page sizes
NUM_BLOCKS = 16


def make_tensors(device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(-128, 127, (NUM_BLOCKS, p), dtype=torch.int8, generator=g).to(device) for p in PAGES]


@pytest.fixture
def pool(tmp_path):
    # On tmpfs, as the node arena is: Linux refuses to pin (cudaHostRegister) pages of a
    # shared file mapping on a disk filesystem (seen on an H200 host: cudaErrorInvalidValue).
    shm = tmp_path if not os.path.isdir("/dev/shm") else Path(tempfile.mkdtemp(prefix="kvstrata-test-", dir="/dev/shm"))
    arena = Arena(str(shm), "n", capacity=1 << 20, segment_size=4 * 8192, lease_seconds=10, prefault=False)
    rank_stride = sum(PAGES) * 2  # blocks_per_chunk = 2
    pool = arena.pool("ns", 2 * rank_stride)  # world size 2
    yield pool
    arena.close()
    if shm != tmp_path:
        shutil.rmtree(shm, ignore_errors=True)


# Group 0 uses both tensors; group 1 only the second (as hybrid models share tensors).
GROUPS = [[GroupRef(0, 256), GroupRef(1, 512)], [GroupRef(1, 400)]]


def engine(tensors, rank, native=None, gpu_copy="auto"):
    return CopyEngine(
        tensors, GROUPS, blocks_per_chunk=2, rank=rank, rank_stride=sum(PAGES) * 2, native=native, gpu_copy=gpu_copy
    )


NATIVE = pytest.param(
    True, marks=pytest.mark.skipif(copy_engine.native_copy_rows is None, reason="the native copy module is not built")
)


def test_slot_layout_places_ranks_tensors_and_sub_blocks():
    layout = SlotLayout([256, 512], blocks_per_chunk=2, rank=1, rank_stride=2000)
    assert layout.offset(0, 0) == 2000
    assert layout.offset(0, 1) == 2256
    assert layout.offset(1, 0) == 2512
    assert layout.offset(1, 1) == 3024
    with pytest.raises(ValueError, match="reserves 1000 bytes per rank"):
        SlotLayout([256, 512], blocks_per_chunk=2, rank=0, rank_stride=1000)


@pytest.mark.parametrize("native", [NATIVE, False], ids=["native", "numpy"])
def test_round_trip_is_bit_exact_across_groups_and_partial_chunks(pool, native):
    slots = np.array(pool.reserve("w", 6), dtype=np.int64)
    src = make_tensors(seed=1)
    # Group 0: 3 blocks starting one sub-block into a chunk -> 2 slots.
    # Group 1: 2 blocks starting at a chunk boundary -> 1 slot.
    block_ids = np.array([3, 7, 9, 11, 2], dtype=np.int32)
    group_sizes, block_indices = [3, 2], [1, 4]
    writer = engine(src, rank=1, native=native)
    writer.store(5, pool.geometry, block_ids, group_sizes, block_indices, slots[:3])
    assert [c.job_id for c in writer.finished()] == [5]

    dst = [torch.zeros_like(t) for t in src]
    reader = engine(dst, rank=1, native=native)
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


def test_an_empty_transfer_completes_at_once(pool):
    eng = engine(make_tensors(), rank=0)
    empty = np.zeros(0, dtype=np.int64)
    eng.store(4, pool.geometry, empty, [0, 0], [0, 0], empty)
    assert [(c.job_id, c.success, c.num_bytes) for c in eng.finished()] == [(4, True, 0)]


def test_a_block_id_outside_the_kv_cache_is_refused_before_any_copy(pool):
    slots = np.array(pool.reserve("w", 1), dtype=np.int64)
    eng = engine(make_tensors(), rank=0)
    with pytest.raises(ValueError, match=f"block id {NUM_BLOCKS} is outside this worker's KV cache of {NUM_BLOCKS} blocks"):
        eng.store(1, pool.geometry, np.array([1, NUM_BLOCKS], dtype=np.int32), [2, 0], [0, 0], slots)
    assert not pool.view(int(slots[0])).any()
    assert eng.finished() == []


def test_the_native_copy_module_is_built_by_the_install():
    """setup.py builds it wherever a C compiler exists, as on every machine kvstrata is tested on."""
    assert copy_engine.native_copy_rows is not None


@pytest.mark.parametrize("native", [NATIVE, False], ids=["native", "numpy"])
def test_a_transfer_split_over_copy_threads_lands_exactly_where_one_thread_puts_it(tmp_path, monkeypatch, native):
    """Large transfers are split over threads; every byte must still land in its place."""
    monkeypatch.setattr(copy_engine, "PARALLEL_MIN_BYTES", 1 << 20)
    pages, num_blocks, bpc = [4096, 8192, 12288], 96, 2
    refs = [[GroupRef(0, 4096), GroupRef(1, 8192), GroupRef(2, 12288)], [GroupRef(1, 8000)]]
    rank_stride = sum(pages) * bpc
    g = torch.Generator().manual_seed(7)
    src = [torch.randint(-128, 127, (num_blocks, p), dtype=torch.int8, generator=g) for p in pages]
    arena = Arena(str(tmp_path), "n", capacity=64 << 20, segment_size=4 << 20, lease_seconds=10, prefault=False)
    try:
        pool = arena.pool("ns", rank_stride)
        slots = np.array(pool.reserve("w", 2 * 48), dtype=np.int64)  # spans several segments
        block_ids = np.random.default_rng(0).permutation(num_blocks).astype(np.int32)
        sizes, first = [64, 32], [0, 0]
        assert sum(pages) * 64 + 8000 * 32 >= copy_engine.PARALLEL_MIN_BYTES  # really split
        engines = []
        arena_bytes = []
        for threads, job_slots in ((1, slots[:48]), (3, slots[48:])):
            eng = CopyEngine(src, refs, bpc, rank=0, rank_stride=rank_stride, copy_threads=threads, native=native)
            engines.append(eng)
            eng.store(threads, pool.geometry, block_ids, sizes, first, job_slots)
            arena_bytes.append(np.concatenate([pool.view(int(slot)).copy() for slot in job_slots]))
        assert np.array_equal(arena_bytes[0], arena_bytes[1])
        assert any(t.name.startswith("kvstrata-copy") for t in threading.enumerate())  # it was split

        dst = [torch.zeros_like(t) for t in src]
        reader = CopyEngine(dst, refs, bpc, rank=0, rank_stride=rank_stride, copy_threads=3, native=native)
        engines.append(reader)
        reader.load(9, pool.geometry, slots[48:], block_ids, sizes, first)
        assert [c.job_id for c in reader.finished()] == [9]
        full = block_ids[:64]
        for t in range(3):
            assert torch.equal(dst[t][full], src[t][full])
        window = block_ids[64:]
        assert torch.equal(dst[1][window, :8000], src[1][window, :8000])
        assert not dst[1][window, 8000:].any() and not dst[0][window].any()
        for eng in engines:
            eng.close()
        assert not any(t.name.startswith("kvstrata-copy") for t in threading.enumerate())
    finally:
        arena.close()


def test_bad_engine_arguments_are_refused_with_the_value_at_fault():
    args = dict(blocks_per_chunk=2, rank=0, rank_stride=sum(PAGES) * 2)
    with pytest.raises(ValueError, match="copy_threads must be at least 1, got 0"):
        CopyEngine(make_tensors(), GROUPS, copy_threads=0, **args)
    with pytest.raises(ValueError, match="KV group 1 copies 600 bytes per page of tensor 1, whose pages are 512 bytes"):
        CopyEngine(make_tensors(), [GROUPS[0], [GroupRef(1, 600)]], **args)
    with pytest.raises(ValueError, match="KV group 0 names tensor 2; there are 2"):
        CopyEngine(make_tensors(), [[GroupRef(2, 256)]], **args)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("gpu_copy", ["auto", "dma", "kernel"])
def test_cuda_round_trip_through_registered_arena(pool, gpu_copy):
    """The engine as a CUDA worker runs it: registered segments, the descriptor builder,
    the router's DMA or kernel, events; both groups (group 1 copies 400 of 512 bytes)."""
    slots = np.array(pool.reserve("w", 3), dtype=np.int64)
    src = make_tensors("cuda", seed=3)
    block_ids = np.array([3, 7, 9, 11, 2], dtype=np.int32)
    writer = engine(src, rank=0, gpu_copy=gpu_copy)
    writer.store(1, pool.geometry, block_ids, [3, 2], [1, 4], slots)
    writer.wait({1})
    assert writer.pinning.failures == 0 and writer.pinning.registered_bytes > 0
    dst = [torch.zeros_like(t) for t in src]
    reader = engine(dst, rank=0, gpu_copy=gpu_copy)
    reader.load(2, pool.geometry, slots, block_ids, [3, 2], [1, 4])
    reader.wait({2})
    assert [(c.job_id, c.success) for c in reader.finished()] == [(2, True)]
    for b in [3, 7, 9]:
        assert torch.equal(dst[0][b], src[0][b]) and torch.equal(dst[1][b], src[1][b])
    for b in [11, 2]:
        assert torch.equal(dst[1][b, :400], src[1][b, :400]) and not dst[1][b, 400:].any()
    writer.close()
    reader.close()


@pytest.mark.skipif(copy_engine.native_copy_rows is None, reason="the native copy module is not built")
def test_the_native_path_refuses_rows_outside_their_buffers_before_copying(pool):
    """The native loop trusts its addresses: a row past a page or a segment must never reach it."""
    (slot,) = pool.reserve("w", 1)
    eng = engine(make_tensors(), rank=0, native=True)
    plan = eng.plan(pool.geometry, np.array([1], dtype=np.int32), [1, 0], [0, 0], np.array([slot], dtype=np.int64))
    segments = {0: eng.arena.tensor(pool.geometry, 0)}
    past_segment = plan._replace(offset=plan.offset + pool.geometry.slots_per_segment * pool.geometry.slot_bytes)
    with pytest.raises(ValueError, match="lies outside arena segment 0"):
        eng.descriptors("store", past_segment, segments)
    past_page = plan._replace(num_bytes=plan.num_bytes + 1)
    with pytest.raises(ValueError, match="from block 1 of tensor 0 is longer than its 256-byte page"):
        eng.descriptors("load", past_page, segments)


def test_the_worker_log_line_says_how_it_copies(pool):
    engine_ = CopyEngine(make_tensors(), GROUPS, blocks_per_chunk=2, rank=0, rank_stride=sum(PAGES) * 2, copy_threads=3, native=False)
    try:
        assert engine_.describe() == "CPU copies (ctypes.memmove, 3 threads)"
        assert engine_.gpu_copy == "auto" and engine_.pinning is None  # CPU tensors: nothing to register
    finally:
        engine_.close()
