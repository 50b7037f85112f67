"""GPU <-> pinned host throughput of kvstrata's CUDA copy executors, beside their references,
and what the copies cost a forward pass running beside them.

Per page size (8 KiB to 2 MiB), one transfer of scattered pages (no rows merge: the worst
case), capped at --max-total-mib; the CUDA measurement is in gpu_copy_cuda.py: one
contiguous `copy_` of the same bytes (the ceiling) and one raw `cuMemcpyBatchAsync` of the
same rows as references, the DMA executor, the Triton kernel (loads, and stores to compare),
the engine's own choice for loads (engine.gpu_copy=auto), both directions at once, a bf16
8192x8192 GEMM loop's slowdown while copies run and the copies' own, and the CPU time
`submit` takes per 256 MiB. It ends with the goals of docs/gpu-copy.md, met or not.

    python benchmarks/gpu_copy.py [--pages-kib 8,16,32,64,256,2048] [--max-total-mib 256]
                                  [--device cuda|cpu] [--repeats 3] [--out DIR]

`--device cpu` runs the CPU analogue (no GPU needed, what CI runs): "GPU" and host are CPU
buffers, ref is one memcpy of the contiguous bytes, dma is the descriptor row copy
(kvstrata's native copy_rows where built, else memmove per row), both runs a store and a
load in two threads; the batch, kernel and GEMM columns are not measured there.

Torch and Triton only (no vLLM, no Ray). Writes gpu_copy.csv/.md/.png/.json into --out.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import threading
from collections.abc import Callable

import numpy as np
import torch
from gpu_copy_cuda import best_of, half
from gpu_copy_cuda import descriptors as layout
from plotting import Line, Panel, Results, add_out_argument, run_title, write_results

from kvstrata.connector.copy.descriptors import Descriptors

KIB = 1024
MIB = 1 << 20
NAN = float("nan")
COLUMNS = [
    "page KiB", "pages", "MiB",
    "store ref", "store batch", "store dma", "store kernel", "store auto",
    "load ref", "load batch", "load dma", "load kernel", "load auto", "auto by",
    "both GB/s", "store/ref", "load/ref", "gemm +%", "gemm ms/GiB", "ref gemm +%", "ref ms/GiB", "copies -%",
    "submit ms/256MiB",
]  # fmt: skip

# The goals of docs/gpu-copy.md, on the engine's own path (both directions as auto routes them).
GOAL_LARGE_PAGES = 0.90  # x the contiguous copy, pages >= 64 KiB, both directions
GOAL_8K_PAGES = 0.85  # x the contiguous copy, 8 KiB pages, both directions
GOAL_GEMM_SLOWDOWN = 5.0  # % at most
GOAL_SUBMIT_MS = 1.0  # ms of CPU per 256 MiB submitted, at most


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


def measure_cpu(page: int, pages: int, args: argparse.Namespace) -> dict[str, object]:
    total = page * pages
    gpu = np.random.default_rng(1).integers(0, 256, (pages, page), dtype=np.uint8)
    host = np.full(total, 7, dtype=np.uint8)  # touched: a first touch is not a copy
    store_desc, load_desc, slots = layout(page, pages, gpu.ctypes.data, host.ctypes.data)
    copy, _ = row_copier()
    flat = gpu.reshape(-1)
    store_half, load_half = half(store_desc, True), half(load_desc, False)

    def both() -> None:
        helper = threading.Thread(target=copy, args=(store_half,))
        helper.start()
        try:
            copy(load_half)
        finally:
            helper.join()

    gbps = lambda seconds: total / seconds / 1e9  # noqa: E731
    r = args.repeats
    row: dict[str, object] = {"page KiB": page // KIB, "pages": pages, "MiB": total // MIB}
    row["store ref"] = gbps(best_of(r, lambda: np.copyto(host, flat)))
    row["store dma"] = gbps(best_of(r, lambda: copy(store_desc)))
    row["store auto"] = row["store dma"]
    if not np.array_equal(host.reshape(pages, page)[slots], gpu):
        raise RuntimeError("the CPU analogue stored wrong bytes")
    row["load ref"] = gbps(best_of(r, lambda: np.copyto(flat, host)))
    gpu[:] = 0
    row["load dma"] = gbps(best_of(r, lambda: copy(load_desc)))
    if not np.array_equal(host.reshape(pages, page)[slots], gpu):
        raise RuntimeError("the CPU analogue loaded wrong bytes")
    row["load auto"], row["auto by"] = row["load dma"], "rows"
    row["both GB/s"] = gbps(best_of(r, both))
    row["store/ref"] = row["store dma"] / row["store ref"]
    row["load/ref"] = row["load dma"] / row["load ref"]
    return row


# --- output ------------------------------------------------------------------------------


def fmt(value: object) -> str:
    if isinstance(value, float):
        return "-" if math.isnan(value) else f"{value:.2f}"
    return str(value)


def print_table(title: str, columns: list[str], rows: list[list[object]]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(c), *(len(fmt(row[i])) for row in rows)) for i, c in enumerate(columns)]
        print(title)
        print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
        for row in rows:
            print("  ".join(fmt(v).rjust(w) for v, w in zip(row, widths)))
        return
    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(*(fmt(v) for v in row))
    Console(width=max(Console().width, 220)).print(table)  # a pipe gets 80 columns otherwise


def goals(rows: list[dict[str, object]]) -> list[dict[str, object]]:
    """Each goal of docs/gpu-copy.md with its measured value (the worst row it covers)."""

    def worst(column: str, keep: Callable[[dict], bool], pick=min) -> float:
        values = [float(r[column]) for r in rows if keep(r) and not math.isnan(float(r.get(column, NAN)))]
        return pick(values) if values else NAN

    large = lambda r: r["page KiB"] >= 64  # noqa: E731
    small = lambda r: r["page KiB"] == 8  # noqa: E731
    every = lambda r: True  # noqa: E731
    table = [
        ("store >= 0.9x contiguous, pages >= 64 KiB", worst("store/ref", large), GOAL_LARGE_PAGES, ">="),
        ("load >= 0.9x contiguous, pages >= 64 KiB", worst("load/ref", large), GOAL_LARGE_PAGES, ">="),
        ("store >= 0.85x contiguous, 8 KiB pages", worst("store/ref", small), GOAL_8K_PAGES, ">="),
        ("load >= 0.85x contiguous, 8 KiB pages", worst("load/ref", small), GOAL_8K_PAGES, ">="),
        ("GEMMs beside copies <= 5 % slower", worst("gemm +%", every, max), GOAL_GEMM_SLOWDOWN, "<="),
        ("(reference) GEMMs beside contiguous copies <= 5 % slower", worst("ref gemm +%", every, max), GOAL_GEMM_SLOWDOWN, "<="),
        ("submit <= 1 ms CPU per 256 MiB", worst("submit ms/256MiB", every, max), GOAL_SUBMIT_MS, "<="),
    ]
    out = []
    for goal, value, target, sense in table:
        met = None if math.isnan(value) else (value >= target if sense == ">=" else value <= target)
        out.append({"goal": goal, "measured": None if math.isnan(value) else round(value, 3), "met": met})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--pages-kib", default="8,16,32,64,256,2048", help="page sizes, comma-separated KiB")
    parser.add_argument("--max-pages", type=int, default=100_000, help="pages per transfer at most")
    parser.add_argument("--max-total-mib", type=int, default=256, help="bytes per transfer at most")
    parser.add_argument("--repeats", type=int, default=3)
    add_out_argument(parser)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here; --device cpu runs the CPU analogue")
    cuda = args.device == "cuda"
    extra = torch.cuda.get_device_name() if cuda else ""
    title = run_title("gpu_copy.py", args, extra=extra)
    results = Results("gpu_copy", title, COLUMNS, x_label="page size")
    sizes = [int(p) * KIB for p in args.pages_kib.split(",")]
    plan = [(page, max(1, min(args.max_pages, args.max_total_mib * MIB // page))) for page in sizes]
    rows: list[dict[str, object]] = []
    if cuda:
        import gpu_copy_cuda

        buffers = gpu_copy_cuda.CudaBuffers.allocate(max(page * pages for page, pages in plan))
        measure = lambda page, pages: gpu_copy_cuda.measure(page, pages, buffers, args)  # noqa: E731
    else:
        buffers = None
        print(f"CPU analogue; descriptor rows copied by {row_copier()[1]}")
        measure = lambda page, pages: measure_cpu(page, pages, args)  # noqa: E731
    try:
        for page, pages in plan:
            row = measure(page, pages)
            rows.append(row)
            results.rows.append([row.get(c, NAN) for c in COLUMNS])
            results.sizes_bytes.append(page)
            print(f"  {page // KIB} KiB x {pages}: " + ", ".join(f"{c} {fmt(row.get(c, NAN))}" for c in COLUMNS[3:]), flush=True)
    finally:
        if buffers is not None:
            buffers.close()
    print_table(title, COLUMNS, results.rows)
    checked = goals(rows) if cuda else []
    for goal in checked:
        verdict = {True: "met", False: "MISSED", None: "not measured"}[goal["met"]]
        print(f"goal: {goal['goal']}: {goal['measured']} -> {verdict}")
    col = results.column
    results.panels = [
        Panel("store: GPU -> pinned host", [
            Line("engine (auto)", col("store auto")), Line("dma executor", col("store dma")),
            Line("kernel (Triton)", col("store kernel")),
            Line("one cuMemcpyBatchAsync", col("store batch"), True), Line("one contiguous copy_", col("store ref"), True)]),
        Panel("load: pinned host -> GPU", [
            Line("engine (auto)", col("load auto")), Line("dma executor", col("load dma")),
            Line("kernel (Triton)", col("load kernel")), Line("one cuMemcpyBatchAsync", col("load batch"), True),
            Line("one contiguous copy_", col("load ref"), True)]),
        Panel("store + load at once", [Line("auto store + auto load", col("both GB/s"))]),
    ]  # fmt: skip
    write_results(results, args.out)
    with open(args.out / "gpu_copy.json", "w") as file:
        json.dump({"title": title, "device": args.device, "rows": rows, "goals": checked}, file, indent=1, default=str)


if __name__ == "__main__":
    main()
