"""Copies KV pages between an engine's KV cache tensors and node-arena slots.

Torch only (no vLLM, no Ray): it can be benchmarked on a GPU machine without vLLM.

Slot layout, fixed by the layout namespace so every engine agrees on it:
    slot = [rank 0 part | rank 1 part | ...], each part `rank_stride` bytes;
    rank part = [tensor 0 region | tensor 1 region | ...], region t = blocks_per_chunk
    pages of `page_bytes[t]`; sub-block j of tensor t sits at j * page_bytes[t].
Each (group, layer ref) copies `ref_bytes` (the un-padded page) of a block, as vLLM's
own CPU worker does, so groups that share a tensor never overwrite each other: they
have different keys and therefore different slots.

Every transfer becomes a `CopyPlan` (one row per page) and then, through
`copy.descriptors.build_descriptors`, three int64 address arrays checked against the
KV cache rows and arena segments before anything moves; contiguous rows are merged.
On CPU tensors `copy.host.HostRowExecutor` copies them at submit time (the CPU is the
compute device; there is nothing to overlap with): natively (`_rowcopy`, one call for
the whole transfer, without the GIL) or one `ctypes.memmove` per row, split over
`copy_threads` threads when large. On CUDA tensors each segment
is registered with cudaHostRegister and copies run on a dedicated stream per
direction; completion is an event, and `wait` returns only when the GPU blocks are
reusable.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvstrata.connector.copy import Completed
from kvstrata.connector.copy.descriptors import CopyPlan, Descriptors, PageSpace, SlotSpace, build_descriptors
from kvstrata.connector.copy.host import PARALLEL_MIN_BYTES, HostRowExecutor, native_copy_rows
from kvstrata.tiers.arena import PoolGeometry
from kvstrata.tiers.shm import SharedMemoryFile

__all__ = ["PARALLEL_MIN_BYTES", "Completed", "CopyEngine", "CopyPlan", "GroupRef", "SlotLayout", "native_copy_rows"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GroupRef:
    """One layer (or layer group) of a KV group: which tensor, and how many bytes per page."""

    tensor_idx: int
    ref_bytes: int


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


def _rows(plan: CopyPlan):
    """(tensor, block, segment, offset, bytes) per page copy, as Python ints."""
    return zip(plan.tensor_idx.tolist(), plan.block_id.tolist(), plan.segment.tolist(), plan.offset.tolist(), plan.num_bytes.tolist())


class CopyEngine:
    """Moves pages between KV cache tensors (`(num_blocks, page)` int8) and arena slots."""

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        group_refs: Sequence[Sequence[GroupRef]],
        blocks_per_chunk: int,
        rank: int,
        rank_stride: int,
        copy_threads: int = 1,
        native: bool | None = None,
        merge: bool = True,
    ):
        """`merge=False` keeps one copy per page (tests compare both); merging is always safe."""
        if not tensors:
            raise ValueError("no KV cache tensors to copy")
        if copy_threads < 1:
            raise ValueError(f"copy_threads must be at least 1, got {copy_threads}")
        self.tensors = [t.view(torch.int8).view(t.shape[0], -1) for t in tensors]
        self.group_refs = [list(refs) for refs in group_refs]
        for group, refs in enumerate(self.group_refs):
            for ref in refs:
                if not 0 <= ref.tensor_idx < len(self.tensors):
                    raise ValueError(f"KV group {group} names tensor {ref.tensor_idx}; there are {len(self.tensors)}")
                if not 0 < ref.ref_bytes <= self.tensors[ref.tensor_idx].shape[1]:
                    raise ValueError(
                        f"KV group {group} copies {ref.ref_bytes} bytes per page of tensor {ref.tensor_idx}, "
                        f"whose pages are {self.tensors[ref.tensor_idx].shape[1]} bytes"
                    )
        self.layout = SlotLayout([t.shape[1] for t in self.tensors], blocks_per_chunk, rank, rank_stride)
        self.blocks_per_chunk = blocks_per_chunk
        self.is_cuda = self.tensors[0].is_cuda
        self.arena = ArenaMap(pin_for_cuda=self.is_cuda)
        self._completed: list[Completed] = []
        self.copy_threads = copy_threads
        self.merge = merge
        # Integers only: the same builder serves host and device pointers.
        self.pages = PageSpace.of(
            [t.data_ptr() for t in self.tensors],
            [t.stride(0) for t in self.tensors],
            self.layout.page_bytes,
            [t.shape[0] for t in self.tensors],
        )
        if native and native_copy_rows is None:
            raise RuntimeError("kvstrata's native copy module (_rowcopy) was not built; reinstall with a C compiler")
        self._host: HostRowExecutor | None = None
        if self.is_cuda:
            self._streams = {"store": torch.cuda.Stream(), "load": torch.cuda.Stream()}
            self._pending: dict[int, tuple[torch.cuda.Event, torch.cuda.Event, int]] = {}
            self.native = False
        else:
            # Read the threshold now (not at import) so tests can lower it.
            self._host = HostRowExecutor(copy_threads, native, parallel_min_bytes=PARALLEL_MIN_BYTES)
            self.native = self._host.native

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
        num_blocks = min(t.shape[0] for t in self.tensors)
        bad = block_ids[(block_ids < 0) | (block_ids >= num_blocks)]
        if bad.size:
            raise ValueError(f"block id {int(bad[0])} is outside this worker's KV cache of {num_blocks} blocks")
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
        segments = {int(seg): self.arena.tensor(geometry, int(seg)) for seg in np.unique(plan.segment)}
        if self._host is not None:
            self._host.submit(job_id, direction, self.descriptors(direction, plan, segments))
            return
        num_bytes = int(plan.num_bytes.sum())
        if not num_bytes:
            self._completed.append(Completed(job_id, True, 0, 0.0))
            return
        self._run_cuda(job_id, direction, _rows(plan), segments, num_bytes)

    def descriptors(self, direction: str, plan: CopyPlan, segments: dict[int, torch.Tensor]) -> Descriptors:
        """The plan's (dst, src, sizes), every row checked to lie inside its page and segment.

        Executors trust their addresses, so a row that would reach past a KV cache row or
        an arena segment is refused here (ValueError naming the row), before any copy.
        """
        slot_space = SlotSpace.of({seg: (t.data_ptr(), t.numel()) for seg, t in segments.items()})
        return build_descriptors(direction, plan, self.pages, slot_space, merge=self.merge)

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
        if self._host is not None:
            return self._host.finished()
        for job_id, (start, end, num_bytes) in list(self._pending.items()):
            if end.query():
                del self._pending[job_id]
                self._completed.append(Completed(job_id, True, num_bytes, start.elapsed_time(end) / 1000))
        done, self._completed = self._completed, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        """Return once the named transfers no longer touch their GPU blocks."""
        if self._host is not None:
            self._host.wait(job_ids)
            return
        for job_id in job_ids:
            pending = self._pending.get(job_id)
            if pending is not None:
                pending[1].synchronize()

    def close(self) -> None:
        if self._host is not None:
            self._host.close()
        if self.is_cuda:
            for stream in self._streams.values():
                stream.synchronize()
        self.arena.close()
