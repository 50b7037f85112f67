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
            tensor = torch.from_numpy(mapped.array)
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


@dataclass
class _Copy:
    tensor_idx: int
    block_id: int
    segment: int
    offset: int
    num_bytes: int


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
    ) -> list[_Copy]:
        """Every page copy of one transfer, in order.

        Blocks come ordered by group; group g's first block sits `block_indices[g] %
        blocks_per_chunk` sub-blocks into its first chunk (a transfer may start in the
        middle of a chunk when GPU blocks are smaller than chunks).
        """
        if len(group_sizes) != len(self.group_refs):
            raise ValueError(f"transfer names {len(group_sizes)} KV groups, this worker has {len(self.group_refs)}")
        copies: list[_Copy] = []
        block_pos = 0
        slot_pos = 0
        bpc = self.blocks_per_chunk
        for group, (count, first_index) in enumerate(zip(group_sizes, block_indices)):
            if count == 0:
                continue
            skip = first_index % bpc
            group_slots = slots[slot_pos : slot_pos + -(-(count + skip) // bpc)]
            for i in range(count):
                block_id = int(block_ids[block_pos + i])
                slot = int(group_slots[(skip + i) // bpc])
                sub = (skip + i) % bpc
                segment, slot_offset = geometry.locate(slot)
                for ref in self.group_refs[group]:
                    copies.append(
                        _Copy(ref.tensor_idx, block_id, segment, slot_offset + self.layout.offset(ref.tensor_idx, sub), ref.ref_bytes)
                    )
            block_pos += count
            slot_pos += len(group_slots)
        if block_pos != len(block_ids) or slot_pos != len(slots):
            raise ValueError(
                f"transfer shape mismatch: used {block_pos}/{len(block_ids)} blocks and {slot_pos}/{len(slots)} slots"
            )
        return copies

    # --- transfers ---------------------------------------------------------------

    def store(self, job_id: int, geometry: PoolGeometry, block_ids, group_sizes, block_indices, slots) -> None:
        """KV cache -> arena."""
        self._run(job_id, "store", self.plan(geometry, block_ids, group_sizes, block_indices, slots), geometry)

    def load(self, job_id: int, geometry: PoolGeometry, slots, block_ids, group_sizes, block_indices) -> None:
        """Arena -> KV cache."""
        self._run(job_id, "load", self.plan(geometry, block_ids, group_sizes, block_indices, slots), geometry)

    def _run(self, job_id: int, direction: str, copies: list[_Copy], geometry: PoolGeometry) -> None:
        num_bytes = sum(c.num_bytes for c in copies)
        if self.is_cuda:
            self._run_cuda(job_id, direction, copies, geometry, num_bytes)
            return
        start = time.perf_counter()
        to_arena = direction == "store"
        for c in copies:
            segment = self.arena.tensor(geometry, c.segment).numpy()
            page = self._numpy_tensors[c.tensor_idx][c.block_id]
            if to_arena:
                segment[c.offset : c.offset + c.num_bytes] = page[: c.num_bytes].view(np.uint8)
            else:
                page[: c.num_bytes] = segment[c.offset : c.offset + c.num_bytes].view(np.int8)
        self._completed.append(Completed(job_id, True, num_bytes, time.perf_counter() - start))

    def _run_cuda(self, job_id: int, direction: str, copies: list[_Copy], geometry: PoolGeometry, num_bytes: int) -> None:
        stream = self._streams[direction]
        # Stores read KV the forward pass just wrote; loads must not overtake writes
        # (zeroing) still queued for their destination blocks.
        stream.wait_stream(torch.cuda.current_stream())
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        to_arena = direction == "store"
        with torch.cuda.stream(stream):
            start.record(stream)
            for c in copies:
                host = self.arena.tensor(geometry, c.segment)[c.offset : c.offset + c.num_bytes]
                page = self.tensors[c.tensor_idx][c.block_id, : c.num_bytes]
                if to_arena:
                    host.copy_(page.view(torch.uint8), non_blocking=True)
                else:
                    page.copy_(host.view(torch.int8), non_blocking=True)
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
