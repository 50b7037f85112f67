"""How the Triton copy kernel should run: GB/s of kernel loads and stores, and a GEMM
loop's slowdown beside them, per variant (programs, rows a program moves at once, words
per row per step, warps), beside the DMA executor and the contiguous copy of the same run.

The programs are the SMs the kernel takes from the forward pass (FIELD_NOTES: 8 programs
33-37 GB/s, 16 programs 46-50 GB/s on an H100 with one row per program at a time). A load
from host memory waits on the link for each read, so what a program keeps in flight
(rows x words) matters as much as how many programs run. This finds the variant closest
to the link at the smallest cost to the GEMMs.

    python benchmarks/gpu_kernel_sweep.py [--variants P:R:W:warps,...] [--pages-kib 8,64]

CUDA only; torch and Triton (no vLLM, no Ray). Prints one table.
"""

from __future__ import annotations

import argparse
import math

import torch
from gpu_copy import print_table
from gpu_copy_cuda import COPY_SECONDS, CudaBuffers, Runner, best_of, descriptors, gemm_interference, half, job_copies

from kvstrata.connector.copy.cuda_dma import CudaDmaExecutor
from kvstrata.connector.copy.triton_copy import KernelExecutor

MIB = 1 << 20
COLUMNS = ["page KiB", "variant", "load GB/s", "store GB/s", "both GB/s", "gemm +%", "dma load", "dma store", "ref"]
VARIANTS = "12:1:512:4,8:4:1024:4,4:8:1024:8,4:16:1024:8,2:16:1024:8,12:4:1024:4,16:8:1024:8"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=VARIANTS, help="programs:rows_per_step:chunk_words:warps, comma-separated")
    parser.add_argument("--pages-kib", default="8,64")
    parser.add_argument("--total-mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    variants = [tuple(int(x) for x in v.split(":")) for v in args.variants.split(",")]
    total = args.total_mib * MIB
    buffers = CudaBuffers.allocate(total)
    rows = []
    try:
        for page in (int(p) * 1024 for p in args.pages_kib.split(",")):
            pages = total // page
            gpu, host = buffers.gpu[: page * pages], buffers.host[: page * pages]
            store, load, _ = descriptors(page, pages, gpu.data_ptr(), host.data_ptr())
            dma = CudaDmaExecutor()
            run = Runner(dma)
            gbps = lambda s: page * pages / s / 1e9  # noqa: E731

            def ref() -> None:
                torch.cuda.synchronize()
                gpu.copy_(host, non_blocking=True)
                torch.cuda.synchronize()

            run.jobs([(dma, "store", store)])()
            dma_load = gbps(best_of(args.repeats, run.jobs([(dma, "load", load)])))
            dma_store = gbps(best_of(args.repeats, run.jobs([(dma, "store", store)])))
            reference = gbps(best_of(args.repeats, ref))
            for programs, per_step, words, warps in variants:
                kernel = KernelExecutor(
                    ledger=dma.ledger, programs=programs, chunk_words=words, rows_per_step=per_step, warps=warps,
                    directions=("load", "store"),
                )  # fmt: skip
                run.jobs([(kernel, "load", load)])()  # compiled once, then cached
                run.jobs([(kernel, "store", store)])()
                k_load = gbps(best_of(args.repeats, run.jobs([(kernel, "load", load)])))
                k_store = gbps(best_of(args.repeats, run.jobs([(kernel, "store", store)])))
                both_jobs = [(kernel, "store", half(store, True)), (kernel, "load", half(load, False))]
                both_seconds = best_of(args.repeats, run.jobs(both_jobs))
                rounds = max(1, min(16, math.ceil(COPY_SECONDS / both_seconds)))
                gemm = gemm_interference(*job_copies(run, both_jobs, rounds), args.repeats).gemm_slowdown
                name = f"{programs}p x{per_step} {words}w {warps}warps"
                rows.append([page // 1024, name, k_load, k_store, gbps(both_seconds), 100 * gemm, dma_load, dma_store, reference])
                print("  " + ", ".join(f"{c} {v:.2f}" if isinstance(v, float) else f"{c} {v}" for c, v in zip(COLUMNS, rows[-1])), flush=True)
            dma.close()
    finally:
        buffers.close()
    print_table(f"Triton copy kernel variants, {torch.cuda.get_device_name()}", COLUMNS, rows)


if __name__ == "__main__":
    main()
