"""Which CUDA executor moves one transfer: the DMA engines or the Triton copy kernel.

The rule (engine.gpu_copy), from the GPU check on an H200 (PCIe Gen5 x16, 26 Nov 2026,
docs/gpu-copy.md), scattered pages against one contiguous copy of the same bytes
(~55 GB/s each way):
  * one cuMemcpyBatchAsync pays per descriptor: 8 KiB rows moved 16-19 GB/s to host and
    2-4 GB/s from host, 64 KiB rows 33-40 GB/s, and the call held the worker's thread
    12-16 ms per 256 MiB of 8 KiB rows (3 ms at 64 KiB); from 256 KiB rows it is within
    10-15 % of the contiguous copy;
  * the copy kernel (2 programs, 16 rows each at a time) moved 43-49 GB/s both ways at
    8-256 KiB rows, its submit only fills a table; but it holds its SMs for the copy's
    duration: a bf16 GEMM loop beside kernel copies lost 4.5 ms per GiB moved, beside
    DMA of 256 KiB+ rows 1.5-1.7, beside one contiguous copy 1.2-1.8 (DMA of smaller
    rows is no cheaper per byte: it runs longer).
So, under "auto", a transfer goes by kernel, either way, when every row is under 256 KiB
(where DMA stays below 0.75x of the link and its submit holds the worker's thread for
milliseconds), there are at least 16 rows (below that a launch costs more than it saves),
every size and address is a multiple of 8 (the kernel moves int64 words) and host memory
is registered (a kernel can only reach host memory that is registered; DMA also works
from pageable memory, slower); otherwise by DMA.
"kernel" forces the kernel both ways, except where it cannot move the bytes at all
(unaligned rows or pageable host memory): those still go by DMA, since a forced setting
must not turn into a wrong copy or an illegal-address fault. "dma" never uses it (no SM
is ever taken from the forward pass).

A row here is one descriptor after contiguous pages were merged, which is what one DMA
descriptor or one kernel row moves: a run of small pages that merged into a large row is,
for this choice, a large row.

No torch import at module level: the rule is plain arithmetic on the descriptor arrays;
the executors are imported only by `make_cuda_executor`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Literal

import numpy as np

from kvstrata.connector.copy.descriptors import DIRECTIONS, WORD_BYTES, Descriptors

logger = logging.getLogger(__name__)

KERNEL_MAX_ROW_BYTES = {"load": 256 * 1024, "store": 256 * 1024}
KERNEL_MIN_ROWS = 16

GpuCopy = Literal["auto", "dma", "kernel"]
Method = Literal["dma", "kernel"]


def kernel_can_move(desc: Descriptors, host_pinned: bool) -> bool:
    """Whether the Triton kernel can copy these rows at all (not whether it is faster)."""
    if not host_pinned or desc.rows == 0:
        return False
    unaligned = np.bitwise_or.reduce(desc.sizes) | np.bitwise_or.reduce(desc.dst) | np.bitwise_or.reduce(desc.src)
    return int(unaligned) % WORD_BYTES == 0


def choose(gpu_copy: GpuCopy, direction: str, desc: Descriptors, host_pinned: bool) -> Method:
    """"dma" or "kernel" for one transfer; see the module docstring for the rule."""
    if gpu_copy not in ("auto", "dma", "kernel"):
        raise ValueError(f"gpu_copy must be auto, dma or kernel, not {gpu_copy!r}")
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be store or load, not {direction!r}")
    if gpu_copy == "dma" or not kernel_can_move(desc, host_pinned):
        return "dma"
    if gpu_copy == "kernel":
        return "kernel"
    if desc.rows >= KERNEL_MIN_ROWS and int(desc.sizes.max()) < KERNEL_MAX_ROW_BYTES[direction]:
        return "kernel"
    return "dma"


class CudaCopyRouter:
    """The executor interface over a DMA and (optionally) a kernel executor that share
    one JobLedger: each transfer goes where `choose` says, and because both queue on the
    same per-direction streams, loads still complete in submission order whichever way
    each one went."""

    def __init__(self, gpu_copy: GpuCopy, dma: Any, kernel: Any | None, host_pinned: Callable[[], bool]):
        if kernel is not None and kernel.ledger is not dma.ledger:
            raise ValueError("the DMA and kernel executors must share one JobLedger")
        self.gpu_copy = gpu_copy
        self.dma = dma
        self.kernel = kernel
        self.host_pinned = host_pinned
        self.counts = {"dma": 0, "kernel": 0}

    def submit(self, job_id: int, direction: str, desc: Descriptors) -> None:
        method = choose(self.gpu_copy, direction, desc, self.host_pinned()) if self.kernel is not None else "dma"
        self.counts[method] += 1
        (self.kernel if method == "kernel" else self.dma).submit(job_id, direction, desc)

    def finished(self) -> list:
        return self.dma.ledger.finished()

    def wait(self, job_ids: set[int]) -> None:
        self.dma.ledger.wait(job_ids)

    def close(self) -> None:
        self.dma.ledger.close()


def make_cuda_executor(gpu_copy: GpuCopy, device: Any = None, host_pinned: Callable[[], bool] = lambda: True) -> CudaCopyRouter:
    """The CUDA executor for engine.gpu_copy on `device`; without Triton, DMA only (logged)."""
    from kvstrata.connector.copy.cuda_dma import CudaDmaExecutor

    dma = CudaDmaExecutor(device)
    kernel = None
    if gpu_copy != "dma":
        try:
            from kvstrata.connector.copy.triton_copy import KernelExecutor

            kernel = KernelExecutor(device, ledger=dma.ledger, directions=("load", "store"))
        except RuntimeError as exc:
            logger.warning("gpu_copy %s: %s; every transfer goes by DMA", gpu_copy, exc)
    return CudaCopyRouter(gpu_copy, dma, kernel, host_pinned)
