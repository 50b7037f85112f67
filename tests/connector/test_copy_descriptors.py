"""The descriptor builder against a page-by-page reference.

The reference below computes every page's two addresses on its own, from the slot
layout rules in copy_engine's docstring (slot = rank parts of `rank_stride` bytes; a rank
part = one region of `blocks_per_chunk` pages per tensor; sub-block j of tensor t at
j * page_bytes[t]), and copies each with ctypes.memmove. The engine (plan -> descriptors
-> host executor) must leave exactly the same bytes, on random layouts: several KV
groups, a Mamba-like group copying less than its padded page, groups sharing a tensor,
1/2/4 ranks writing their own parts of shared slots, transfers starting inside a chunk,
merged and unmerged runs, native and fallback copies, one and several threads.
"""

from __future__ import annotations

import ctypes
import re
from collections import Counter

import numpy as np
import pytest
import torch

from kvstrata.connector import copy_engine
from kvstrata.connector.copy.descriptors import (
    CopyPlan,
    Descriptors,
    PageSpace,
    SlotSpace,
    build_descriptors,
    merge_runs,
)
from kvstrata.connector.copy.host import HostRowExecutor, split_bytes
from kvstrata.connector.copy_engine import CopyEngine, GroupRef
from kvstrata.tiers.arena import Arena

CASES = 30

NATIVE = pytest.param(
    True, marks=pytest.mark.skipif(copy_engine.native_copy_rows is None, reason="the native copy module is not built")
)


def as_descriptors(dst, src, sizes) -> Descriptors:
    return Descriptors(*(np.asarray(column, dtype=np.int64) for column in (dst, src, sizes)))


def rows_of(desc: Descriptors) -> list[tuple[int, int, int]]:
    return list(zip(desc.dst.tolist(), desc.src.tolist(), desc.sizes.tolist()))


# --- merge_runs ------------------------------------------------------------------


def test_merge_runs_joins_exactly_the_rows_that_continue_on_both_sides():
    desc = as_descriptors(
        dst=[0, 10, 20, 100, 110, 200, 210],
        src=[1000, 1010, 1020, 2000, 3000, 3010, 3020],
        sizes=[10, 10, 10, 10, 10, 10, 5],
    )
    # rows 0-2 continue on both sides; row 4 continues row 3's dst only; row 5 neither;
    # row 6 continues row 5 on both sides.
    assert rows_of(merge_runs(desc)) == [(0, 1000, 30), (100, 2000, 10), (110, 3000, 10), (200, 3010, 15)]
    # A buffer boundary between rows 1 and 2 keeps them apart even though they touch.
    keyed = merge_runs(desc, buffer_key=np.array([0, 0, 1, 1, 1, 1, 1]))
    assert rows_of(keyed) == [(0, 1000, 20), (20, 1020, 10), (100, 2000, 10), (110, 3000, 10), (200, 3010, 15)]
    assert merge_runs(desc).num_bytes == desc.num_bytes
    single = as_descriptors([5], [6], [7])
    assert rows_of(merge_runs(single)) == [(5, 6, 7)]
    apart = as_descriptors([0, 20], [0, 20], [10, 10])
    assert rows_of(merge_runs(apart)) == [(0, 0, 10), (20, 20, 10)]


class Buffers:
    """A KV cache of one or more numpy tensors and a few 'segments', addressed by integers."""

    def __init__(self, pages, num_blocks, segment_bytes, num_segments, row_pad=0, seed=0, unmapped=()):
        rng = np.random.default_rng(seed)
        self.tensors = [rng.integers(0, 256, (num_blocks, p + row_pad), dtype=np.uint8) for p in pages]
        self.segments = [rng.integers(0, 256, segment_bytes, dtype=np.uint8) for _ in range(num_segments)]
        self.pages = PageSpace.of(
            [t.ctypes.data for t in self.tensors],
            [t.strides[0] for t in self.tensors],
            pages,
            [num_blocks] * len(pages),
        )
        self.slots = SlotSpace.of({i: (s.ctypes.data, s.nbytes) for i, s in enumerate(self.segments) if i not in unmapped})

    def snapshot(self):
        return [a.copy() for a in self.tensors + self.segments]

    def unchanged(self, snapshot) -> bool:
        return all(np.array_equal(a, b) for a, b in zip(self.tensors + self.segments, snapshot))


def plan_of(rows) -> CopyPlan:
    """rows: (tensor, block, segment, offset, bytes)."""
    return CopyPlan(*(np.array(column, dtype=np.int64) for column in zip(*rows)))


def test_the_builder_merges_consecutive_whole_pages_of_one_tensor_and_one_segment():
    buf = Buffers(pages=[64, 64], num_blocks=8, segment_bytes=1024, num_segments=2)
    rows = [
        (0, 2, 0, 0, 64), (0, 3, 0, 64, 64), (0, 4, 0, 128, 64),  # one run of three pages
        (0, 5, 0, 320, 64),  # next block, but not the next page of the slot
        (1, 0, 1, 0, 64), (1, 1, 1, 64, 64),  # a run in the other tensor and segment
        (0, 6, 1, 128, 64),  # tensor 0 block 6 right after tensor 1's run: another buffer
    ]
    merged = build_descriptors("store", plan_of(rows), buf.pages, buf.slots)
    base0, base1 = buf.pages.base.tolist()
    seg0, seg1 = buf.slots.base.tolist()
    assert rows_of(merged) == [
        (seg0, base0 + 2 * 64, 192),
        (seg0 + 320, base0 + 5 * 64, 64),
        (seg1, base1, 128),
        (seg1 + 128, base0 + 6 * 64, 64),
    ]
    unmerged = build_descriptors("store", plan_of(rows), buf.pages, buf.slots, merge=False)
    assert unmerged.rows == len(rows) and unmerged.num_bytes == merged.num_bytes
    load = build_descriptors("load", plan_of(rows), buf.pages, buf.slots)
    assert rows_of(load) == [(s, d, n) for d, s, n in rows_of(merged)]


def test_padded_pages_and_padded_rows_never_merge():
    # A Mamba-like ref copies 48 of a 64-byte page: consecutive blocks are not contiguous.
    buf = Buffers(pages=[64], num_blocks=4, segment_bytes=1024, num_segments=1)
    rows = [(0, b, 0, 48 * b, 48) for b in range(4)]
    assert build_descriptors("store", plan_of(rows), buf.pages, buf.slots).rows == 4
    # Whole 64-byte pages of rows 80 bytes apart (a strided KV view): no merge either.
    strided = Buffers(pages=[64], num_blocks=4, segment_bytes=1024, num_segments=1, row_pad=16)
    rows = [(0, b, 0, 64 * b, 64) for b in range(4)]
    assert build_descriptors("load", plan_of(rows), strided.pages, strided.slots).rows == 4


def test_split_bytes_cuts_rows_at_equal_byte_marks_and_covers_every_byte_once():
    desc = as_descriptors(dst=[0, 1000, 5000], src=[10000, 20000, 30000], sizes=[7, 100, 3])
    for parts in (1, 2, 3, 7, 200):
        pieces = split_bytes(desc, parts)
        assert len(pieces) == min(parts, desc.num_bytes)
        sizes = [p.num_bytes for p in pieces]
        assert max(sizes) - min(sizes) <= 1
        covered = [(d + i, s + i) for p in pieces for d, s, n in rows_of(p) for i in range(n)]
        expected = [(d + i, s + i) for d, s, n in rows_of(desc) for i in range(n)]
        assert covered == expected


# --- bounds ----------------------------------------------------------------------

GOOD = [(0, 1, 0, 0, 64), (1, 2, 1, 128, 64)]
BAD_ROWS = [
    ((0, 3, 0, 256, 65), "a copy of 65 bytes from block 3 of tensor 0 is longer than its 64-byte page"),
    ((1, 8, 0, 256, 64), "block 8 of tensor 1 is outside its 8 blocks"),
    ((1, -1, 0, 256, 64), "block -1 of tensor 1 is outside its 8 blocks"),
    ((0, 3, 1, 1000, 64), r"a copy of 64 bytes at offset 1000 lies outside arena segment 1 \(1024 bytes\)"),
    ((0, 3, 1, -8, 64), r"a copy of 64 bytes at offset -8 lies outside arena segment 1 \(1024 bytes\)"),
    ((0, 3, 2, 0, 64), "arena segment 2 is not mapped"),  # a hole between mapped segments
    ((0, 3, 4, 0, 64), "arena segment 4 is not mapped"),  # past the last
    ((0, 3, -1, 0, 64), "arena segment -1 is not mapped"),
    ((2, 3, 0, 0, 64), "tensor 2 does not exist; there are 2"),
    ((0, 3, 0, 0, -1), "a copy of a negative byte count"),
]


@pytest.mark.parametrize("direction", ["store", "load"])
@pytest.mark.parametrize("native", [NATIVE, False], ids=["native", "memmove"])
@pytest.mark.parametrize("bad,message", BAD_ROWS, ids=[m.split(" (")[0][:40] for _, m in BAD_ROWS])
def test_a_bad_row_is_named_and_nothing_is_copied(bad, message, direction, native):
    buf = Buffers(pages=[64, 64], num_blocks=8, segment_bytes=1024, num_segments=4, unmapped={2})
    before = buf.snapshot()
    executor = HostRowExecutor(copy_threads=2, native=native, parallel_min_bytes=1)
    tensor, block, segment, offset, nbytes = bad
    row = re.escape(f"(row 2: tensor {tensor}, block {block}, segment {segment}, offset {offset}, {nbytes} bytes)")
    try:
        with pytest.raises(ValueError, match=f"{message} {row}"):
            executor.submit(1, direction, build_descriptors(direction, plan_of(GOOD + [bad]), buf.pages, buf.slots))
        assert buf.unchanged(before)
        assert executor.finished() == []
        # The good rows alone do copy (the check is not refusing everything).
        executor.submit(2, direction, build_descriptors(direction, plan_of(GOOD), buf.pages, buf.slots))
        assert not buf.unchanged(before)
        assert [(c.job_id, c.num_bytes) for c in executor.finished()] == [(2, 128)]
    finally:
        executor.close()


def test_an_empty_plan_builds_empty_descriptors():
    buf = Buffers(pages=[64], num_blocks=2, segment_bytes=128, num_segments=1)
    empty = np.zeros(0, dtype=np.int64)
    desc = build_descriptors("store", CopyPlan(empty, empty, empty, empty, empty), buf.pages, SlotSpace.of({}))
    assert desc.rows == 0 and desc.num_bytes == 0
    with pytest.raises(ValueError, match="direction must be one of"):
        build_descriptors("both", CopyPlan(empty, empty, empty, empty, empty), buf.pages, buf.slots)


# --- engines on random layouts against the page-by-page reference ----------------


class Layout:
    """One random case: tensors, KV groups, chunking, world size, and one transfer."""

    def __init__(self, rng: np.random.Generator, case: int):
        self.num_tensors = int(rng.integers(1, 4))
        self.page_bytes = [int(rng.integers(1, 9)) * 40 + int(rng.integers(0, 3)) * 8 for _ in range(self.num_tensors)]
        self.bpc = int(rng.choice([1, 2, 4]))
        self.world = [1, 2, 4][case % 3]
        num_groups = 1 + case % 3 if self.num_tensors > 1 else 1 + int(rng.integers(0, 3))
        self.groups: list[list[GroupRef]] = []
        for g in range(num_groups):
            if g == num_groups - 1 and g > 0 and case % 2:
                # Mamba-like: one state per block, smaller than the (padded) page.
                t = int(rng.integers(self.num_tensors))
                self.groups.append([GroupRef(t, int(rng.integers(1, self.page_bytes[t])))])
            else:
                chosen = rng.choice(self.num_tensors, size=int(rng.integers(1, self.num_tensors + 1)), replace=False)
                self.groups.append([GroupRef(int(t), self.page_bytes[t]) for t in chosen])
        self.rank_bytes = sum(self.page_bytes) * self.bpc
        self.rank_stride = self.rank_bytes + int(rng.choice([0, 0, 24]))
        self.slot_bytes = self.world * self.rank_stride
        self.counts = [int(rng.integers(0, 7)) for _ in self.groups]
        if not sum(self.counts):
            self.counts[0] = 3
        self.first_index = [int(rng.integers(0, 3 * self.bpc)) for _ in self.groups]
        self.num_slots = [-(-(c + f % self.bpc) // self.bpc) if c else 0 for c, f in zip(self.counts, self.first_index)]
        total = sum(self.counts)
        self.num_blocks = total + int(rng.integers(1, 6))
        if rng.random() < 0.5:  # consecutive GPU blocks: runs to merge
            start = int(rng.integers(0, self.num_blocks - total + 1))
            self.block_ids = np.arange(start, start + total, dtype=np.int32)
        else:
            self.block_ids = rng.permutation(self.num_blocks)[:total].astype(np.int32)

    def shared_tensor(self) -> bool:
        used = [t for refs in self.groups for t in {ref.tensor_idx for ref in refs}]
        return len(used) != len(set(used))

    def padded(self) -> bool:
        return any(ref.ref_bytes < self.page_bytes[ref.tensor_idx] for refs in self.groups for ref in refs)

    def mid_chunk(self) -> bool:
        return any(c and f % self.bpc for c, f in zip(self.counts, self.first_index))

    def pages(self, slots: list[int]):
        """(slot, byte offset in the slot for rank 0, tensor, block, bytes) of every page copy."""
        block_pos = slot_pos = 0
        for refs, count, first, num_slots in zip(self.groups, self.counts, self.first_index, self.num_slots):
            group_slots = slots[slot_pos : slot_pos + num_slots]
            for j in range(count):
                logical = first % self.bpc + j
                slot, sub = group_slots[logical // self.bpc], logical % self.bpc
                block = int(self.block_ids[block_pos + j])
                for ref in refs:
                    region = sum(self.page_bytes[: ref.tensor_idx]) * self.bpc
                    yield slot, region + sub * self.page_bytes[ref.tensor_idx], ref.tensor_idx, block, ref.ref_bytes
            block_pos += count
            slot_pos += num_slots


def reference_store(layout: Layout, rank: int, tensors, shadow: dict[int, np.ndarray], slots) -> None:
    for slot, offset, t, block, nbytes in layout.pages(slots):
        dst = shadow[slot].ctypes.data + rank * layout.rank_stride + offset
        ctypes.memmove(dst, tensors[t].data_ptr() + block * tensors[t].stride(0), nbytes)


def reference_load(layout: Layout, rank: int, tensors, arena_bytes: dict[int, np.ndarray], slots) -> None:
    for slot, offset, t, block, nbytes in layout.pages(slots):
        src = arena_bytes[slot].ctypes.data + rank * layout.rank_stride + offset
        ctypes.memmove(tensors[t].data_ptr() + block * tensors[t].stride(0), src, nbytes)


def random_tensors(layout: Layout, rng: np.random.Generator) -> list[torch.Tensor]:
    return [
        torch.from_numpy(rng.integers(-128, 128, (layout.num_blocks, p), dtype=np.int8)) for p in layout.page_bytes
    ]


@pytest.mark.parametrize("merge", [True, False], ids=["merged", "unmerged"])
@pytest.mark.parametrize("native", [NATIVE, False], ids=["native", "memmove"])
def test_every_rank_stores_and_loads_exactly_what_the_page_by_page_reference_does(tmp_path, monkeypatch, native, merge):
    monkeypatch.setattr(copy_engine, "PARALLEL_MIN_BYTES", 1)  # every multi-thread engine splits
    seen = Counter()
    for case in range(CASES):
        rng = np.random.default_rng(case)
        layout = Layout(rng, case)
        shm = tmp_path / f"case{case}"
        shm.mkdir()
        segment_size = layout.slot_bytes * int(rng.integers(1, 4))  # transfers cross segments
        arena = Arena(str(shm), "n", capacity=64 << 20, segment_size=segment_size, lease_seconds=10, prefault=False)
        engines: list[CopyEngine] = []
        try:
            pool = arena.pool("ns", layout.slot_bytes)
            slots = [int(s) for s in pool.reserve("w", sum(layout.num_slots))]
            if case % 4 == 3:
                slots = [int(s) for s in rng.permutation(slots)]
            for slot in slots:
                pool.view(slot)[:] = rng.integers(0, 256, layout.slot_bytes, dtype=np.uint8)
            shadow = {slot: pool.view(slot).copy() for slot in slots}
            slot_array = np.array(slots, dtype=np.int64)
            sources = [random_tensors(layout, rng) for _ in range(layout.world)]

            def engine(tensors, rank):
                threads = 1 + 2 * (case % 2)
                eng = CopyEngine(
                    tensors, layout.groups, layout.bpc, rank, layout.rank_stride, copy_threads=threads, native=native, merge=merge
                )
                engines.append(eng)
                return eng

            for rank in range(layout.world):
                eng = engine(sources[rank], rank)
                eng.store(rank, pool.geometry, layout.block_ids, layout.counts, layout.first_index, slot_array)
                assert [c.job_id for c in eng.finished()] == [rank]
                reference_store(layout, rank, sources[rank], shadow, slots)
                # This rank's pages landed; every other byte of the slots (other ranks'
                # parts, padding, the tail of padded pages) is as it was.
                for slot in slots:
                    assert np.array_equal(pool.view(slot), shadow[slot]), f"case {case} rank {rank} slot {slot}"
                plan = eng.plan(pool.geometry, layout.block_ids, layout.counts, layout.first_index, slot_array)
                segments = {int(s): eng.arena.tensor(pool.geometry, int(s)) for s in np.unique(plan.segment)}
                rows = eng.descriptors("store", plan, segments).rows
                seen["merged rows"] += rows < len(plan.block_id)
                assert merge or rows == len(plan.block_id)

            for rank in range(layout.world):
                loaded = random_tensors(layout, rng)
                expected = [t.clone() for t in loaded]
                eng = engine(loaded, rank)
                eng.load(10 + rank, pool.geometry, slot_array, layout.block_ids, layout.counts, layout.first_index)
                assert [c.job_id for c in eng.finished()] == [10 + rank]
                reference_load(layout, rank, expected, shadow, slots)
                for t, (got, want) in enumerate(zip(loaded, expected)):
                    assert torch.equal(got, want), f"case {case} rank {rank} tensor {t}"
        finally:
            for eng in engines:
                eng.close()
            arena.close()
        seen[f"world {layout.world}"] += 1
        seen["groups"] = max(seen["groups"], len(layout.groups))
        seen["shared tensor"] += layout.shared_tensor()
        seen["padded page"] += layout.padded()
        seen["mid-chunk start"] += layout.mid_chunk()
        seen["several segments"] += segment_size < layout.slot_bytes * len(slots)
    # The random cases really cover what they claim to.
    for feature in ("world 1", "world 2", "world 4", "shared tensor", "padded page", "mid-chunk start", "several segments"):
        assert seen[feature], f"no case with {feature}: {seen}"
    assert seen["groups"] == 3
    assert (seen["merged rows"] > 0) == merge
