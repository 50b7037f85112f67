"""GPU <-> pinned host throughput of kvstrata's CUDA copy executors, beside their references.

One transfer = N scattered pages (GPU block i <-> a random host slot, so no rows merge),
N from 1,000 to 100,000, total bytes capped (--max-total-mib). Per page size it measures,
wall clock from submit to `wait` (the driver call for 100,000 descriptors is part of the
cost), best of --repeats:

  * ref:    one plain `copy_` of a contiguous buffer of the same bytes (the ceiling);
  * loop:   one `copy_` per page on a side stream (the copy engine's path before #25),
            timed on at most --loop-pages pages;
  * dma:    CudaDmaExecutor, one cuMemcpyBatchAsync per transfer (stores and loads);
  * kernel: KernelExecutor, the Triton copy kernel (loads; every size, forced);
  * both:   a store of half the pages and a load of the other half at once (the load by
            the engine.gpu_copy=auto rule), GB/s of both together.

Host memory is a plain tensor registered with cudaHostRegister, as the arena is.

    python benchmarks/gpu_copy.py [--pages-kib 8,16,32,64,256,2048] [--max-total-mib 4096]
                                  [--device cuda|cpu] [--repeats 3] [--out DIR]

`--device cpu` runs the CPU analogue (no GPU needed): "GPU" and host are CPU buffers, ref
is one memcpy of the contiguous bytes, loop is a numpy copy per page, dma is the
descriptor row copy (kvstrata's native copy_rows where built, else memmove per row),
kernel is not measured, both runs a store and a load in two threads.

Torch and Triton only (no vLLM, no Ray). Writes gpu_copy.csv/.md/.png into --out.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import math
import threading
import time
from collections.abc import Callable

import numpy as np
import torch
from plotting import Line, Panel, Results, add_out_argument, run_title, write_results

from kvstrata.connector.copy.choice import choose
from kvstrata.connector.copy.descriptors import Descriptors

KIB = 1024
MIB = 1 << 20
NAN = float("nan")
COLUMNS = [
    "page KiB", "pages", "MiB",
    "store ref", "store loop", "store dma", "dma/ref",
    "load ref", "load loop", "load dma", "load kernel", "best/ref",
    "both GB/s", "both load by",
]  # fmt: skip


def best_of(repeats: int, fn: Callable[[], None]) -> float:
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def page_descriptors(dst_addr: np.ndarray, src_addr: np.ndarray, page: int) -> Descriptors:
    return Descriptors(
        np.ascontiguousarray(dst_addr, dtype=np.int64),
        np.ascontiguousarray(src_addr, dtype=np.int64),
        np.full(len(dst_addr), page, dtype=np.int64),
    )


def layout(page: int, pages: int, base_gpu: int, base_host: int, seed: int = 0):
    """(store, load) descriptors: block i <-> host slot perm[i], both as full transfers."""
    slots = np.random.default_rng(seed).permutation(pages).astype(np.int64)
    gpu_addr = base_gpu + np.arange(pages, dtype=np.int64) * page
    host_addr = base_host + slots * page
    return page_descriptors(host_addr, gpu_addr, page), page_descriptors(gpu_addr, host_addr, page), slots


def half(desc: Descriptors, first: bool) -> Descriptors:
    cut = len(desc.sizes) // 2
    part = slice(0, cut) if first else slice(cut, None)
    return Descriptors(*(np.ascontiguousarray(a[part]) for a in desc))


# --- CUDA ------------------------------------------------------------------------------


def measure_cuda(page: int, pages: int, args: argparse.Namespace) -> list[object]:
    from kvstrata.connector.copy.cuda_dma import CudaDmaExecutor
    from kvstrata.connector.copy.pinning import Pinning

    try:
        from kvstrata.connector.copy.triton_copy import KernelExecutor
    except ImportError:
        KernelExecutor = None  # noqa: N806

    total = page * pages
    gpu = torch.ones((pages, page), dtype=torch.int8, device="cuda")
    host = torch.empty(total, dtype=torch.int8)
    host.fill_(2)
    pins = Pinning()
    pinned = pins.register(host)
    store_desc, load_desc, slots = layout(page, pages, gpu.data_ptr(), host.data_ptr())
    dma = CudaDmaExecutor()
    kernel = KernelExecutor(ledger=dma.ledger) if KernelExecutor is not None and pinned else None
    ids = itertools.count()
    side = torch.cuda.Stream()
    sync = torch.cuda.synchronize

    def executor_run(jobs: list[tuple[object, str, Descriptors]]) -> Callable[[], None]:
        def run() -> None:
            sync()
            started = []
            for ex, direction, desc in jobs:
                job = next(ids)
                ex.submit(job, direction, desc)
                started.append(job)
            dma.ledger.wait(started)
            done = dma.ledger.finished()
            if not all(c.success for c in done):
                raise RuntimeError("a copy failed")

        return run

    def ref(to_host: bool) -> Callable[[], None]:
        flat = gpu.view(-1)

        def run() -> None:
            sync()
            (host.copy_(flat, non_blocking=True) if to_host else flat.copy_(host, non_blocking=True))
            sync()

        return run

    loop_pages = min(pages, args.loop_pages)
    host_pages = host.view(pages, page)
    slot_list = slots[:loop_pages].tolist()

    def loop(to_host: bool) -> Callable[[], None]:
        def run() -> None:
            sync()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for i, s in enumerate(slot_list):
                    if to_host:
                        host_pages[s].copy_(gpu[i], non_blocking=True)
                    else:
                        gpu[i].copy_(host_pages[s], non_blocking=True)
            side.synchronize()

        return run

    loop_bytes = page * loop_pages
    gbps = lambda seconds, nbytes=total: nbytes / seconds / 1e9  # noqa: E731
    r = args.repeats
    executor_run([(dma, "store", store_desc)])()  # warm: resolve the backend, touch the pages
    if kernel is not None:
        executor_run([(kernel, "load", load_desc)])()  # warm: compile the kernel
    store_ref = gbps(best_of(r, ref(True)))
    store_loop = gbps(best_of(r, loop(True)), loop_bytes)
    store_dma = gbps(best_of(r, executor_run([(dma, "store", store_desc)])))
    load_ref = gbps(best_of(r, ref(False)))
    load_loop = gbps(best_of(r, loop(False)), loop_bytes)
    load_dma = gbps(best_of(r, executor_run([(dma, "load", load_desc)])))
    load_kernel = gbps(best_of(r, executor_run([(kernel, "load", load_desc)]))) if kernel is not None else NAN
    store_half, load_half = half(store_desc, True), half(load_desc, False)
    method = choose("auto", "load", load_half, pinned) if kernel is not None else "dma"
    loader = kernel if method == "kernel" else dma
    both = gbps(best_of(r, executor_run([(dma, "store", store_half), (loader, "load", load_half)])))
    dma.close()
    pins.close()
    del gpu
    torch.cuda.empty_cache()
    best_load = np.nanmax([load_dma, load_kernel])
    return [page // KIB, pages, total // MIB, store_ref, store_loop, store_dma, store_dma / store_ref,
            load_ref, load_loop, load_dma, load_kernel, best_load / load_ref, both, method]  # fmt: skip


# --- the CPU analogue --------------------------------------------------------------------


def row_copier() -> tuple[Callable[[Descriptors], None], str]:
    try:
        from kvstrata.connector._rowcopy import copy_rows
    except ImportError:

        def memmove_rows(desc: Descriptors) -> None:
            for d, s, n in zip(desc.dst.tolist(), desc.src.tolist(), desc.sizes.tolist()):
                ctypes.memmove(d, s, n)

        return memmove_rows, "memmove per row (native copy_rows not built)"
    return (lambda desc: copy_rows(desc.dst, desc.src, desc.sizes)), "native copy_rows"


def measure_cpu(page: int, pages: int, args: argparse.Namespace) -> list[object]:
    total = page * pages
    gpu = np.random.default_rng(1).integers(0, 256, (pages, page), dtype=np.uint8)
    host = np.zeros(total, dtype=np.uint8)
    store_desc, load_desc, slots = layout(page, pages, gpu.ctypes.data, host.ctypes.data)
    copy, _ = row_copier()
    flat = gpu.reshape(-1)
    host_pages = host.reshape(pages, page)
    loop_pages = min(pages, args.loop_pages)
    slot_list = slots[:loop_pages].tolist()

    def loop(to_host: bool) -> Callable[[], None]:
        def run() -> None:
            for i, s in enumerate(slot_list):
                if to_host:
                    host_pages[s] = gpu[i]
                else:
                    gpu[i] = host_pages[s]

        return run

    store_half, load_half = half(store_desc, True), half(load_desc, False)

    def both() -> None:
        helper = threading.Thread(target=copy, args=(store_half,))
        helper.start()
        try:
            copy(load_half)
        finally:
            helper.join()

    gbps = lambda seconds, nbytes=total: nbytes / seconds / 1e9  # noqa: E731
    r = args.repeats
    store_ref = gbps(best_of(r, lambda: np.copyto(host, flat)))
    store_loop = gbps(best_of(r, loop(True)), page * loop_pages)
    store_dma = gbps(best_of(r, lambda: copy(store_desc)))
    load_ref = gbps(best_of(r, lambda: np.copyto(flat, host)))
    load_loop = gbps(best_of(r, loop(False)), page * loop_pages)
    load_dma = gbps(best_of(r, lambda: copy(load_desc)))
    both_gbps = gbps(best_of(r, both))
    if not (np.array_equal(host_pages[slots], gpu)):
        raise RuntimeError("the CPU analogue copied wrong bytes")
    return [page // KIB, pages, total // MIB, store_ref, store_loop, store_dma, store_dma / store_ref,
            load_ref, load_loop, load_dma, NAN, load_dma / load_ref, both_gbps, "rows"]  # fmt: skip


# --- output ------------------------------------------------------------------------------


def fmt(value: object) -> str:
    if isinstance(value, float):
        return "-" if math.isnan(value) else f"{value:.2f}"
    return str(value)


def print_table(title: str, rows: list[list[object]]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(c), *(len(fmt(row[i])) for row in rows)) for i, c in enumerate(COLUMNS)]
        print(title)
        print("  ".join(c.rjust(w) for c, w in zip(COLUMNS, widths)))
        for row in rows:
            print("  ".join(fmt(v).rjust(w) for v, w in zip(row, widths)))
        return
    table = Table(title=title)
    for column in COLUMNS:
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(*(fmt(v) for v in row))
    Console(width=max(Console().width, 200)).print(table)  # a pipe gets 80 columns otherwise


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--pages-kib", default="8,16,32,64,256,2048", help="page sizes, comma-separated KiB")
    parser.add_argument("--max-pages", type=int, default=100_000, help="pages per transfer at most")
    parser.add_argument("--max-total-mib", type=int, default=4096, help="bytes per transfer at most")
    parser.add_argument("--loop-pages", type=int, default=20_000, help="pages the per-page loop is timed on")
    parser.add_argument("--repeats", type=int, default=3)
    add_out_argument(parser)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here; --device cpu runs the CPU analogue")
    extra = torch.cuda.get_device_name() if args.device == "cuda" else ""
    title = run_title("gpu_copy.py", args, extra=extra)
    results = Results("gpu_copy", title, COLUMNS, x_label="page size")
    measure = measure_cuda if args.device == "cuda" else measure_cpu
    if args.device == "cpu":
        print(f"CPU analogue; descriptor rows copied by {row_copier()[1]}")
    for page_kib in (int(p) for p in args.pages_kib.split(",")):
        page = page_kib * KIB
        pages = max(1, min(args.max_pages, args.max_total_mib * MIB // page))
        row = measure(page, pages, args)
        results.rows.append(row)
        results.sizes_bytes.append(page)
        print(f"  {page_kib} KiB x {pages}: " + ", ".join(f"{c} {fmt(v)}" for c, v in zip(COLUMNS[3:], row[3:])), flush=True)
    print_table(title, results.rows)
    col = results.column
    results.panels = [
        Panel("store: GPU -> pinned host", [
            Line("dma (batched)", col("store dma")), Line("copy_ per page", col("store loop"), True),
            Line("one contiguous copy_", col("store ref"), True)]),
        Panel("load: pinned host -> GPU", [
            Line("dma (batched)", col("load dma")), Line("kernel (Triton)", col("load kernel")),
            Line("copy_ per page", col("load loop"), True), Line("one contiguous copy_", col("load ref"), True)]),
        Panel("store + load at once", [Line("dma store + auto load", col("both GB/s"))]),
    ]  # fmt: skip
    write_results(results, args.out)


if __name__ == "__main__":
    main()
