"""The CUDA half of benchmarks/gpu_copy.py: one page size, every path, its references,
and the cost to a forward pass running beside it.

Per page size, one transfer of `pages` scattered pages (GPU block i <-> host slot perm[i],
so no rows merge: the worst case), host memory registered with cudaHostRegister as the
arena is. Wall clock from the first submit to `wait`, best of --repeats:

  * ref:    one `copy_` of a contiguous buffer of the same bytes (the link's ceiling);
  * batch:  one raw `cuMemcpyBatchAsync` of the same rows on a stream (no executor);
  * dma:    CudaDmaExecutor (stores and loads), what the engine's stores use;
  * kernel: KernelExecutor, the Triton copy kernel (loads; stores too, to measure them);
  * auto:   the transfer as engine.gpu_copy=auto routes it (kernel or DMA), what a worker runs;
  * both:   an auto store of half the pages and an auto load of the other half at once.

Then the forward pass's view: a loop of bf16 8192x8192 GEMMs on a compute stream, alone
and while `rounds` of `both` run (sized so the copies last ~40 ms), giving the GEMMs'
slowdown and the copies' own, beside the GEMMs' slowdown under contiguous copies of the
same bytes on the copy engines (the reference: what moving bytes at all costs them); and
the CPU time `submit` holds its thread per 256 MiB.
"""

from __future__ import annotations

import argparse
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kvstrata.connector.copy.choice import choose
from kvstrata.connector.copy.cuda_dma import CudaDmaExecutor, resolve_batch_copy
from kvstrata.connector.copy.descriptors import Descriptors
from kvstrata.connector.copy.pinning import Pinning

try:
    from kvstrata.connector.copy.triton_copy import KernelExecutor, triton
except ImportError:  # pragma: no cover - the GPU image has Triton
    KernelExecutor, triton = None, None  # type: ignore[assignment]

NAN = float("nan")
MIB = 1 << 20
GEMM_N = 8192
COPY_SECONDS = 0.04  # how long the copies beside the GEMMs run, about
INTERFERENCE_REPEATS = 5  # a GEMM loop's time varies a few % run to run: the best of 5


@dataclass
class CudaBuffers:
    """One GPU buffer and one registered host buffer, reused by every page size."""

    gpu: torch.Tensor
    host: torch.Tensor
    pins: Pinning
    pinned: bool

    @classmethod
    def allocate(cls, nbytes: int) -> CudaBuffers:
        gpu = torch.ones(nbytes, dtype=torch.int8, device="cuda")
        host = torch.empty(nbytes, dtype=torch.int8)
        host.fill_(2)
        pins = Pinning()
        return cls(gpu, host, pins, pins.register(host))

    def close(self) -> None:
        torch.cuda.synchronize()
        self.pins.close()


def best_of(repeats: int, fn: Callable[[], None]) -> float:
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def descriptors(page: int, pages: int, base_gpu: int, base_host: int, seed: int = 0) -> tuple[Descriptors, Descriptors, np.ndarray]:
    """(store, load, perm): GPU block i <-> host slot perm[i], so no rows merge."""
    slots = np.random.default_rng(seed).permutation(pages).astype(np.int64)
    gpu = base_gpu + np.arange(pages, dtype=np.int64) * page
    host = base_host + slots * page
    sizes = np.full(pages, page, dtype=np.int64)
    return Descriptors(host, gpu, sizes), Descriptors(gpu.copy(), host.copy(), sizes), slots


def half(desc: Descriptors, first: bool) -> Descriptors:
    cut = len(desc.sizes) // 2
    part = slice(0, cut) if first else slice(cut, None)
    return Descriptors(*(np.ascontiguousarray(a[part]) for a in desc))


class Runner:
    """Submits jobs to executors sharing one ledger, waits, and keeps the CPU time of submit."""

    def __init__(self, dma: CudaDmaExecutor):
        self.dma = dma
        self.ids = itertools.count()
        self.submit_cpu: dict[str, float] = {}

    def jobs(self, jobs: list[tuple[object, str, Descriptors]], rounds: int = 1, label: str = "") -> Callable[[], None]:
        def run() -> None:
            torch.cuda.synchronize()
            started, cpu = [], 0.0
            for _ in range(rounds):
                for ex, direction, desc in jobs:
                    job = next(self.ids)
                    before = time.thread_time()
                    ex.submit(job, direction, desc)
                    cpu += time.thread_time() - before
                    started.append(job)
            self.dma.ledger.wait(started)
            if not all(c.success for c in self.dma.ledger.finished()):
                raise RuntimeError("a copy failed")
            if label:
                self.submit_cpu[label] = min(self.submit_cpu.get(label, math.inf), cpu)

        return run


def measure(page: int, pages: int, buffers: CudaBuffers, args: argparse.Namespace) -> dict[str, object]:
    total = page * pages
    gpu, host = buffers.gpu[:total], buffers.host[:total]
    store_desc, load_desc, _ = descriptors(page, pages, gpu.data_ptr(), host.data_ptr())
    dma = CudaDmaExecutor()
    kernel = None
    if KernelExecutor is not None and triton is not None and buffers.pinned:
        kernel = KernelExecutor(ledger=dma.ledger, directions=("load", "store"))
    load_by = choose("auto", "load", load_desc, buffers.pinned) if kernel is not None else "dma"
    store_by = choose("auto", "store", store_desc, buffers.pinned) if kernel is not None else "dma"
    loader = kernel if load_by == "kernel" else dma
    storer = kernel if store_by == "kernel" else dma
    run = Runner(dma)
    r = args.repeats
    gbps = lambda seconds: total / seconds / 1e9  # noqa: E731
    sync = torch.cuda.synchronize

    def ref(to_host: bool) -> Callable[[], None]:
        def go() -> None:
            sync()
            (host.copy_(gpu, non_blocking=True) if to_host else gpu.copy_(host, non_blocking=True))
            sync()

        return go

    try:
        batch, _ = resolve_batch_copy("batch")
    except RuntimeError:
        batch = None
    side = torch.cuda.Stream()

    def raw_batch(desc: Descriptors, any_order: bool) -> Callable[[], None]:
        def go() -> None:
            sync()
            batch(desc.dst, desc.src, desc.sizes, int(side.cuda_stream), any_order)
            side.synchronize()

        return go

    run.jobs([(dma, "store", store_desc)])()  # warm: backend resolved, pages touched
    if kernel is not None:
        run.jobs([(kernel, "load", load_desc)])()  # warm: the kernel compiled
        run.jobs([(kernel, "store", store_desc)])()
    row: dict[str, object] = {"page KiB": page // 1024, "pages": pages, "MiB": total // MIB}
    row["store ref"] = gbps(best_of(r, ref(True)))
    row["store batch"] = gbps(best_of(r, raw_batch(store_desc, False))) if batch else NAN
    row["store dma"] = gbps(best_of(r, run.jobs([(dma, "store", store_desc)], label="store dma")))
    row["store kernel"] = gbps(best_of(r, run.jobs([(kernel, "store", store_desc)], label="store kernel"))) if kernel else NAN
    row["store auto"] = row["store kernel"] if store_by == "kernel" else row["store dma"]
    row["load ref"] = gbps(best_of(r, ref(False)))
    row["load batch"] = gbps(best_of(r, raw_batch(load_desc, True))) if batch else NAN
    row["load dma"] = gbps(best_of(r, run.jobs([(dma, "load", load_desc)], label="load dma")))
    row["load kernel"] = gbps(best_of(r, run.jobs([(kernel, "load", load_desc)], label="load kernel"))) if kernel else NAN
    row["load auto"] = row["load kernel"] if load_by == "kernel" else row["load dma"]
    row["auto by"] = f"{store_by}/{load_by}"
    both_jobs = [(storer, "store", half(store_desc, True)), (loader, "load", half(load_desc, False))]
    both_seconds = best_of(r, run.jobs(both_jobs))
    row["both GB/s"] = gbps(both_seconds)
    row["store/ref"] = row["store auto"] / row["store ref"]
    row["load/ref"] = row["load auto"] / row["load ref"]
    rounds = max(1, min(16, math.ceil(COPY_SECONDS / both_seconds)))
    engine = gemm_interference(*job_copies(run, both_jobs, rounds), INTERFERENCE_REPEATS)
    row["gemm +%"] = 100 * engine.gemm_slowdown
    row["gemm ms/GiB"] = engine.lost_ms_per_gib(rounds * sum(desc.num_bytes for _, _, desc in both_jobs))
    row["copies -%"] = 100 * engine.copy_slowdown
    ref_round_seconds = total / 2 / (row["store ref"] * 1e9)  # half the bytes each way, at once
    ref_rounds = max(1, min(64, math.ceil(COPY_SECONDS / ref_round_seconds)))
    reference = gemm_interference(*contiguous_copies(gpu, host, ref_rounds), INTERFERENCE_REPEATS)
    row["ref gemm +%"] = 100 * reference.gemm_slowdown
    row["ref ms/GiB"] = reference.lost_ms_per_gib(ref_rounds * total)
    cpu = max(run.submit_cpu.get(f"store {store_by}", NAN), run.submit_cpu.get(f"load {load_by}", NAN))
    row["submit ms/256MiB"] = 1000 * cpu * (256 * MIB / total)
    dma.close()
    return row


@dataclass
class Interference:
    gemm_slowdown: float  # the GEMM loop's time beside the copies / alone - 1
    copy_slowdown: float  # the copies' time beside the GEMMs / alone - 1
    gemm_lost_ms: float  # GEMM milliseconds lost, for the bytes the copies moved

    def lost_ms_per_gib(self, nbytes: int) -> float:
        return self.gemm_lost_ms / (nbytes / 2**30)


def gemm_interference(alone: Callable[[], None], beside: Callable[[], None], repeats: int) -> Interference:
    """What copies and a GEMM loop running side by side cost each other.

    `alone` runs the copies from an idle device and waits for them; `beside` queues the
    same copies without synchronizing the device first and waits for them only. The
    GEMMs run on their own stream, queued first; the copies are submitted from this
    thread, whose current stream is idle, so they wait for nothing (a worker's copies
    wait only for work queued before them) and the two overlap on the device. The loop
    is sized to last as long as the copies alone.
    """
    a = torch.randn(GEMM_N, GEMM_N, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(GEMM_N, GEMM_N, dtype=torch.bfloat16, device="cuda")
    c = torch.empty(GEMM_N, GEMM_N, dtype=torch.bfloat16, device="cuda")
    compute = torch.cuda.Stream()

    def gemms(count: int) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(compute):
            start.record()
            for _ in range(count):
                torch.mm(a, b, out=c)
            end.record()
        return start, end

    torch.cuda.synchronize()
    start, end = gemms(5)  # warm
    end.synchronize()
    start, end = gemms(10)
    end.synchronize()
    per_gemm = start.elapsed_time(end) / 1000 / 10
    copy_alone = best_of(repeats, alone)
    count = max(10, math.ceil(copy_alone / per_gemm) + 2)
    gemm_alone = math.inf
    for _ in range(repeats):
        start, end = gemms(count)
        end.synchronize()
        gemm_alone = min(gemm_alone, start.elapsed_time(end))
    gemm_with, copy_with = math.inf, math.inf
    for _ in range(repeats):
        torch.cuda.synchronize()
        start, end = gemms(count)
        began = time.perf_counter()
        beside()
        copy_with = min(copy_with, time.perf_counter() - began)
        end.synchronize()
        gemm_with = min(gemm_with, start.elapsed_time(end))
    del a, b, c
    return Interference(gemm_with / gemm_alone - 1, copy_with / copy_alone - 1, gemm_with - gemm_alone)


def job_copies(run: Runner, jobs: list, rounds: int) -> tuple[Callable[[], None], Callable[[], None]]:
    """(alone, beside) for gemm_interference: `rounds` of the executors' jobs."""
    return run.jobs(jobs, rounds), lambda: copies_no_sync(run, jobs, rounds)


def contiguous_copies(gpu: torch.Tensor, host: torch.Tensor, rounds: int) -> tuple[Callable[[], None], Callable[[], None]]:
    """(alone, beside): the reference, `rounds` of one contiguous copy each way (half the
    bytes each), on two streams of their own: the copy engines alone, no descriptors."""
    cut = gpu.numel() // 2
    out_stream, in_stream = torch.cuda.Stream(), torch.cuda.Stream()

    def beside() -> None:
        for _ in range(rounds):
            with torch.cuda.stream(out_stream):
                host[:cut].copy_(gpu[:cut], non_blocking=True)
            with torch.cuda.stream(in_stream):
                gpu[cut:].copy_(host[cut:], non_blocking=True)
        out_stream.synchronize()
        in_stream.synchronize()

    def alone() -> None:
        torch.cuda.synchronize()
        beside()

    return alone, beside


def copies_no_sync(run: Runner, jobs: list, rounds: int) -> None:
    """`run.jobs` without the device-wide synchronize at its start (the GEMMs are queued)."""
    started = []
    for _ in range(rounds):
        for ex, direction, desc in jobs:
            job = next(run.ids)
            ex.submit(job, direction, desc)
            started.append(job)
    run.dma.ledger.wait(started)
    if not all(c.success for c in run.dma.ledger.finished()):
        raise RuntimeError("a copy failed")
