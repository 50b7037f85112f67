"""The worker-side adapter: vLLM transfer specs in, copy-engine calls out.

The worker never talks to the store: each transfer spec carries the arena geometry,
and the bytes move through shared memory only. Every rank reports every job, as
vLLM requires. Copy failures are not caught: vLLM asserts every transfer succeeds,
and a half-written chunk must never be published, so a broken layout fails loudly at
the first transfer rather than serving wrong KV.
"""

from __future__ import annotations

import logging

from kvstrata.connector.compat import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
    override,
)
from kvstrata.connector.copy_engine import CopyEngine
from kvstrata.connector.manager import ArenaSlotsSpec
from kvstrata.keys import Layout

logger = logging.getLogger(__name__)


class StrataWorker(OffloadingWorker):
    def __init__(
        self, kv_caches: CanonicalKVCaches, layout: Layout, rank: int, copy_threads: int = 1, gpu_copy: str = "auto"
    ):
        self.engine = CopyEngine.from_canonical(
            kv_caches,
            blocks_per_chunk=layout.blocks_per_chunk,
            rank=rank,
            rank_stride=layout.rank_bytes,
            copy_threads=copy_threads,
            gpu_copy=gpu_copy,
        )
        logger.info(
            "kvstrata worker rank %d: %d KV tensors, %d groups filling %s of a slot, %s copies",
            rank,
            len(self.engine.tensors),
            len(self.engine.group_refs),
            "/".join(f"{share:.0%}" for share in self.engine.slot_fill()),
            self.engine.describe(),
        )

    @override
    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        assert isinstance(dst_spec, ArenaSlotsSpec)
        self.engine.store(
            job_id, dst_spec.geometry, src_spec.block_ids, src_spec.group_sizes, src_spec.block_indices, dst_spec.block_ids
        )
        return True

    @override
    def submit_load(
        self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec, expedited: bool = False
    ) -> bool:
        assert isinstance(src_spec, ArenaSlotsSpec)
        self.engine.load(
            job_id, src_spec.geometry, src_spec.block_ids, dst_spec.block_ids, dst_spec.group_sizes, dst_spec.block_indices
        )
        return True

    @override
    def get_finished(self) -> list[TransferResult]:
        return [
            TransferResult(job_id=c.job_id, success=c.success, transfer_size=c.num_bytes, transfer_time=c.seconds)
            for c in self.engine.finished()
        ]

    @override
    def wait(self, job_ids: set[int]) -> None:
        self.engine.wait(job_ids)

    @override
    def shutdown(self) -> None:
        self.engine.close()
