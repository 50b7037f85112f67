"""Copies KV pages between an engine's KV cache tensors and node-arena slots.

Torch only (no vLLM, no Ray): it can be benchmarked on a GPU machine without vLLM.

Slot layout, fixed by the layout namespace so every engine agrees on it:
    slot = [rank 0 part | rank 1 part | ...], each part `rank_stride` bytes;
    rank part = [tensor 0 region | tensor 1 region | ...], region t = blocks_per_chunk
    pages of `page_bytes[t]`; sub-block j of tensor t sits at j * page_bytes[t].
Each (group, layer ref) copies `ref_bytes` (the un-padded page) of a block, as vLLM's
own CPU worker does, so groups that share a tensor never overwrite each other: they
have different keys and therefore different slots.

On CPU tensors the copies are plain memory copies done at submit time (the CPU is
the compute device; there is nothing to overlap with). On CUDA tensors each segment
is registered with cudaHostRegister and copies run on a dedicated stream per
direction; completion is an event, and `wait` returns only when the GPU blocks are
reusable.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from kvstrata.tiers.arena import PoolGeometry
from kvstrata.tiers.shm import SharedMemoryFile

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GroupRef:
    """One layer (or layer group) of a KV group: which tensor, and how many bytes per page."""

    tensor_idx: int
    ref_bytes: int


@dataclass
class Completed:
    job_id: int
    success: bool
    num_bytes: int
    seconds: float


class SlotLayout:
    """Where a rank's pages of one chunk sit inside a slot."""

    def __init__(self, page_bytes: Sequence[int], blocks_per_chunk: int, rank: int, rank_stride: int):
        self.page_bytes = list(page_bytes)
        self.blocks_per_chunk = blocks_per_chunk
        self.rank_bytes = sum(self.page_bytes) * blocks_per_chunk
        if self.rank_bytes > rank_stride:
            raise ValueError(
                f"this worker's KV pages need {self.rank_bytes} bytes per chunk but the layout "
                f"namespace reserves {rank_stride} bytes per rank"
            )
        base = rank * rank_stride
        self.tensor_offset: list[int] = []
        for size in self.page_bytes:
            self.tensor_offset.append(base)
            base += size * blocks_per_chunk

    def offset(self, tensor_idx: int, sub_block: int) -> int:
        return self.tensor_offset[tensor_idx] + sub_block * self.page_bytes[tensor_idx]


class ArenaMap:
    """Lazily maps the arena segments a transfer touches; never unlinks them."""

    def __init__(self, pin_for_cuda: bool = False):
        self.pin_for_cuda = pin_for_cuda
        self._segments: dict[str, SharedMemoryFile] = {}
        self._tensors: dict[str, torch.Tensor] = {}

    def tensor(self, geometry: PoolGeometry, segment: int) -> torch.Tensor:
        path = geometry.segment_path(segment)
        tensor = self._tensors.get(path)
        if tensor is None:
            mapped = SharedMemoryFile.attach(path)
            tensor = torch.from_numpy(mapped.array.view(np.int8))
            if self.pin_for_cuda:
                _host_register(tensor)
            self._segments[path] = mapped
            self._tensors[path] = tensor
        return tensor

    def close(self) -> None:
        for tensor in self._tensors.values():
            if self.pin_for_cuda:
                _host_unregister(tensor)
        self._tensors.clear()
        for segment in self._segments.values():
            segment.close()
        self._segments.clear()


def _host_register(tensor: torch.Tensor) -> None:
    cudart = torch.cuda.cudart()
    result = cudart.cudaHostRegister(tensor.data_ptr(), tensor.numel() * tensor.element_size(), 0)
    if int(result) != 0:
        raise RuntimeError(f"cudaHostRegister of a kvstrata arena segment failed with error {int(result)}")


def _host_unregister(tensor: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())


class CopyPlan(NamedTuple):
    """One row per page copy: tensor, block, arena segment, byte offset, length."""

    tensor_idx: np.ndarray
    block_id: np.ndarray
    segment: np.ndarray
    offset: np.ndarray
    num_bytes: np.ndarray


class CopyEngine:
    """Moves pages between KV cache tensors (`(num_blocks, page)` int8) and arena slots."""

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        group_refs: Sequence[Sequence[GroupRef]],
        blocks_per_chunk: int,
        rank: int,
        rank_stride: int,
    ):
        if not tensors:
            raise ValueError("no KV cache tensors to copy")
        self.tensors = [t.view(torch.int8).view(t.shape[0], -1) for t in tensors]
        self.group_refs = [list(refs) for refs in group_refs]
        self.layout = SlotLayout([t.shape[1] for t in self.tensors], blocks_per_chunk, rank, rank_stride)
        self.blocks_per_chunk = blocks_per_chunk
        self.is_cuda = self.tensors[0].is_cuda
        self.arena = ArenaMap(pin_for_cuda=self.is_cuda)
        self._completed: list[Completed] = []
        if self.is_cuda:
            self._streams = {"store": torch.cuda.Stream(), "load": torch.cuda.Stream()}
            self._pending: dict[int, tuple[torch.cuda.Event, torch.cuda.Event, int]] = {}
        else:
            self._numpy_tensors = [t.numpy() for t in self.tensors]

    # --- planning ----------------------------------------------------------------

    def plan(
        self,
        geometry: PoolGeometry,
        block_ids: np.ndarray,
        group_sizes: Sequence[int],
        block_indices: Sequence[int],
        slots: np.ndarray,
    ) -> CopyPlan:
        """Every page copy of one transfer, as parallel arrays (cheap to build and walk).

        Blocks come ordered by group; group g's first block sits `block_indices[g] %
        blocks_per_chunk` sub-blocks into its first chunk (a transfer may start in the
        middle of a chunk when GPU blocks are smaller than chunks).
        """
        if len(group_sizes) != len(self.group_refs):
            raise ValueError(f"transfer names {len(group_sizes)} KV groups, this worker has {len(self.group_refs)}")
        block_ids = np.asarray(block_ids, dtype=np.int64)
        slots = np.asarray(slots, dtype=np.int64)
        bpc = self.blocks_per_chunk
        parts: list[tuple[np.ndarray, ...]] = []
        block_pos = 0
        slot_pos = 0
        for group, (count, first_index) in enumerate(zip(group_sizes, block_indices)):
            if count == 0:
                continue
            skip = first_index % bpc
            num_slots = -(-(count + skip) // bpc)
            logical = np.arange(skip, skip + count, dtype=np.int64)
            group_slots = slots[slot_pos : slot_pos + num_slots][logical // bpc]
            sub = logical % bpc
            segment, index = np.divmod(group_slots, geometry.slots_per_segment)
            slot_base = index * geometry.slot_bytes
            blocks = block_ids[block_pos : block_pos + count]
            for ref in self.group_refs[group]:
                offsets = slot_base + self.layout.tensor_offset[ref.tensor_idx] + sub * self.layout.page_bytes[ref.tensor_idx]
                parts.append((np.full(count, ref.tensor_idx), blocks, segment, offsets, np.full(count, ref.ref_bytes)))
            block_pos += count
            slot_pos += num_slots
        if block_pos != len(block_ids) or slot_pos != len(slots):
            raise ValueError(
                f"transfer shape mismatch: used {block_pos}/{len(block_ids)} blocks and {slot_pos}/{len(slots)} slots"
            )
        if not parts:
            empty = np.zeros(0, dtype=np.int64)
            return CopyPlan(empty, empty, empty, empty, empty)
        return CopyPlan(*(np.concatenate(column).astype(np.int64) for column in zip(*parts)))

    # --- transfers ---------------------------------------------------------------

    def store(self, job_id: int, geometry: PoolGeometry, block_ids, group_sizes, block_indices, slots) -> None:
        """KV cache -> arena."""
        self._run(job_id, "store", self.plan(geometry, block_ids, group_sizes, block_indices, slots), geometry)

    def load(self, job_id: int, geometry: PoolGeometry, slots, block_ids, group_sizes, block_indices) -> None:
        """Arena -> KV cache."""
        self._run(job_id, "load", self.plan(geometry, block_ids, group_sizes, block_indices, slots), geometry)

    def _run(self, job_id: int, direction: str, plan: CopyPlan, geometry: PoolGeometry) -> None:
        num_bytes = int(plan.num_bytes.sum())
        segments = {int(seg): self.arena.tensor(geometry, int(seg)) for seg in np.unique(plan.segment)}
        rows = zip(plan.tensor_idx.tolist(), plan.block_id.tolist(), plan.segment.tolist(), plan.offset.tolist(), plan.num_bytes.tolist())
        if self.is_cuda:
            self._run_cuda(job_id, direction, rows, segments, num_bytes)
            return
        start = time.perf_counter()
        arrays = {seg: tensor.numpy() for seg, tensor in segments.items()}
        pages = self._numpy_tensors
        if direction == "store":
            for t, block, seg, off, n in rows:
                arrays[seg][off : off + n] = pages[t][block, :n]
        else:
            for t, block, seg, off, n in rows:
                pages[t][block, :n] = arrays[seg][off : off + n]
        self._completed.append(Completed(job_id, True, num_bytes, time.perf_counter() - start))

    def _run_cuda(self, job_id: int, direction: str, rows, segments: dict[int, torch.Tensor], num_bytes: int) -> None:
        stream = self._streams[direction]
        # Stores read KV the forward pass just wrote; loads must not overtake writes
        # (zeroing) still queued for their destination blocks.
        stream.wait_stream(torch.cuda.current_stream())
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        to_arena = direction == "store"
        with torch.cuda.stream(stream):
            start.record(stream)
            for t, block, seg, off, n in rows:
                host = segments[seg][off : off + n]
                page = self.tensors[t][block, :n]
                if to_arena:
                    host.copy_(page, non_blocking=True)
                else:
                    page.copy_(host, non_blocking=True)
            end.record(stream)
        self._pending[job_id] = (start, end, num_bytes)

    def finished(self) -> list[Completed]:
        if self.is_cuda:
            for job_id, (start, end, num_bytes) in list(self._pending.items()):
                if end.query():
                    del self._pending[job_id]
                    self._completed.append(Completed(job_id, True, num_bytes, start.elapsed_time(end) / 1000))
        done, self._completed = self._completed, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        """Return once the named transfers no longer touch their GPU blocks."""
        if not self.is_cuda:
            return
        for job_id in job_ids:
            pending = self._pending.get(job_id)
            if pending is not None:
                pending[1].synchronize()

    def close(self) -> None:
        if self.is_cuda:
            for stream in self._streams.values():
                stream.synchronize()
        self.arena.close()
