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
`copy_threads` threads when large. On CUDA tensors each segment is registered with
cudaHostRegister once (`copy.pinning`; a refusal is logged, counted and copies go by
pageable DMA) and each transfer is one submission (`copy.choice`, `engine.gpu_copy`):
one batched `cuMemcpyBatchAsync` (`copy.cuda_dma`) or, for many small rows, a Triton
copy kernel (`copy.triton_copy`), on a stream per direction that first waits for
the compute stream; completion is an event, and `wait` returns only when the GPU blocks
are reusable.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvstrata.connector.copy import Completed, Executor
from kvstrata.connector.copy.choice import GpuCopy, make_cuda_executor
from kvstrata.connector.copy.descriptors import CopyPlan, Descriptors, PageSpace, SlotSpace, build_descriptors
from kvstrata.connector.copy.host import PARALLEL_MIN_BYTES, HostRowExecutor, native_copy_rows
from kvstrata.connector.copy.pinning import Pinning
from kvstrata.tiers.arena import PoolGeometry
from kvstrata.tiers.shm import SharedMemoryFile

__all__ = ["PARALLEL_MIN_BYTES", "Completed", "CopyEngine", "CopyPlan", "GroupRef", "SlotLayout", "native_copy_rows"]

logger = logging.getLogger(__name__)


_HOW = {
    "auto": "the Triton kernel where every row is under 256 KiB, batched DMA otherwise",
    "dma": "batched DMA both ways",
    "kernel": "the Triton kernel both ways",
}


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
    """Lazily maps the arena segments a transfer touches; never unlinks them.

    With `pinning` (CUDA workers), each segment is registered with CUDA when first mapped
    and unregistered before it is unmapped.
    """

    def __init__(self, pinning: Pinning | None = None):
        self.pinning = pinning
        self._segments: dict[str, SharedMemoryFile] = {}
        self._tensors: dict[str, torch.Tensor] = {}

    def tensor(self, geometry: PoolGeometry, segment: int) -> torch.Tensor:
        path = geometry.segment_path(segment)
        tensor = self._tensors.get(path)
        if tensor is None:
            mapped = SharedMemoryFile.attach(path)
            tensor = torch.from_numpy(mapped.array.view(np.int8))
            if self.pinning is not None:
                self.pinning.register(tensor)  # False: logged and counted; DMA still works
            self._segments[path] = mapped
            self._tensors[path] = tensor
        return tensor

    def close(self) -> None:
        if self.pinning is not None:
            self.pinning.close()
        self._tensors.clear()
        for segment in self._segments.values():
            segment.close()
        self._segments.clear()


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
        gpu_copy: GpuCopy = "auto",
    ):
        """`merge=False` keeps one copy per page (tests compare both); merging is always safe.
        `gpu_copy` (engine.gpu_copy) picks DMA or the Triton kernel on CUDA (`copy.choice`)."""
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
        self.pinning = Pinning() if self.is_cuda else None
        self.arena = ArenaMap(self.pinning)
        self.copy_threads = copy_threads
        self.merge = merge
        self.gpu_copy = gpu_copy
        # Integers only: the same builder serves host and device pointers.
        self.pages = PageSpace.of(
            [t.data_ptr() for t in self.tensors],
            [t.stride(0) for t in self.tensors],
            self.layout.page_bytes,
            [t.shape[0] for t in self.tensors],
        )
        if native and native_copy_rows is None:
            raise RuntimeError("kvstrata's native copy module (_rowcopy) was not built; reinstall with a C compiler")
        self.executor: Executor
        if self.is_cuda:
            pinning = self.pinning
            # The kernel reads host memory only if every segment is registered; one refusal
            # sends every later load by DMA, which also works from pageable memory.
            self.executor = make_cuda_executor(gpu_copy, self.tensors[0].device, host_pinned=lambda: pinning.failures == 0)
            self.native = False
        else:
            # Read the threshold now (not at import) so tests can lower it.
            self.executor = HostRowExecutor(copy_threads, native, parallel_min_bytes=PARALLEL_MIN_BYTES)
            self.native = self.executor.native

    @classmethod
    def from_canonical(
        cls,
        kv_caches: Any,
        blocks_per_chunk: int,
        rank: int,
        rank_stride: int,
        copy_threads: int = 1,
        gpu_copy: GpuCopy = "auto",
    ) -> CopyEngine:
        """The engine for vLLM's `CanonicalKVCaches`, exactly as `StrataWorker` builds it.

        Duck-typed (`kv_caches.tensors[i].tensor / .page_size_bytes`,
        `kv_caches.group_data_refs[g][j].tensor_idx / .page_size_bytes`), so the GPU check
        (`kvstrata._dev.gpucheck`) drives the worker's own path on a machine without vLLM.
        Each canonical tensor becomes `(num_blocks, page_size_bytes)` int8 rows; a group
        copies each ref's un-padded `page_size_bytes` of a page.
        """
        tensors = [entry.tensor.view(torch.int8).view(-1, entry.page_size_bytes) for entry in kv_caches.tensors]
        group_refs = [
            [GroupRef(ref.tensor_idx, ref.page_size_bytes) for ref in refs] for refs in kv_caches.group_data_refs
        ]
        return cls(
            tensors,
            group_refs,
            blocks_per_chunk=blocks_per_chunk,
            rank=rank,
            rank_stride=rank_stride,
            copy_threads=copy_threads,
            gpu_copy=gpu_copy,
        )

    def slot_fill(self) -> list[float]:
        """Per group, the share of a slot's rank part its pages fill (for the start-up log).

        A slot holds every tensor's page of a block (as vLLM sizes its CPU slots); a group
        that spans fewer tensors, or un-padded pages, leaves part of it unused."""
        block_bytes = sum(self.layout.page_bytes)
        return [sum(ref.ref_bytes for ref in refs) / block_bytes for refs in self.group_refs]

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
        self.executor.submit(job_id, direction, self.descriptors(direction, plan, segments))

    def descriptors(self, direction: str, plan: CopyPlan, segments: dict[int, torch.Tensor]) -> Descriptors:
        """The plan's (dst, src, sizes), every row checked to lie inside its page and segment.

        Executors trust their addresses, so a row that would reach past a KV cache row or
        an arena segment is refused here (ValueError naming the row), before any copy.
        """
        slot_space = SlotSpace.of({seg: (t.data_ptr(), t.numel()) for seg, t in segments.items()})
        return build_descriptors(direction, plan, self.pages, slot_space, merge=self.merge)

    def describe(self) -> str:
        """How this worker copies, for its start-up log line."""
        if self.is_cuda:
            return f"CUDA copies (engine.gpu_copy {self.gpu_copy}: {_HOW[self.gpu_copy]})"
        return f"CPU copies ({'native' if self.native else 'ctypes.memmove'}, {self.copy_threads} threads)"

    def finished(self) -> list[Completed]:
        """Transfers completed since the last call, each reported once."""
        return self.executor.finished()

    def wait(self, job_ids: set[int]) -> None:
        """Return once the named transfers no longer touch their GPU blocks."""
        self.executor.wait(job_ids)

    def close(self) -> None:
        """Finish what is in flight, then unregister and unmap the arena segments."""
        self.executor.close()
        self.arena.close()
