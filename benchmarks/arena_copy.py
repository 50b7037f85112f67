"""Copy throughput KV cache <-> node arena, beside numpy memcpy measured in the same run.

A chunk is made of per-layer pages (like a real model's KV cache: one tensor per layer),
copied by kvstrata's copy engine into and out of arena slots in shared memory. The
reference is numpy copying the same bytes between two warm buffers, one chunk-sized
contiguous copy at a time. Figures are noisy here (±30-40% run to run); the ratio is
what to compare.

On the CPU the copy engine splits a large transfer over `--copy-threads` threads (the
config's `engine.copy_threads`, default 2); the reference is one thread's memcpy.

    python benchmarks/arena_copy.py [--layers 8] [--total-mib 512] [--device cpu|cuda] [--copy-threads 2] [--out DIR]

Besides the printed table it writes arena_copy.csv, .md and .png (GB/s against chunk
size, the reference beside kvstrata) into --out (benchmarks/results/).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np
import torch
from plotting import Line, Panel, Results, add_out_argument, run_title, write_results

from kvstrata.connector.copy_engine import CopyEngine, GroupRef
from kvstrata.tiers.arena import Arena

SIZES_KIB = [256, 1024, 2048, 8192, 32768]


def best_of(repeats: int, fn) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def memcpy_seconds(chunk_bytes: int, num_chunks: int, repeats: int) -> float:
    src = np.ones(chunk_bytes * num_chunks, dtype=np.uint8)
    dst = np.zeros_like(src)

    def run():
        for i in range(num_chunks):
            part = slice(i * chunk_bytes, (i + 1) * chunk_bytes)
            np.copyto(dst[part], src[part])

    return best_of(repeats, run)


def cuda_reference_seconds(chunk_bytes: int, num_chunks: int, repeats: int) -> tuple[float, float]:
    """Pinned host <-> device copies of whole chunks with torch (the DMA ceiling)."""
    host = torch.empty(chunk_bytes * num_chunks, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device="cuda")

    def to_host():
        for i in range(num_chunks):
            host[i * chunk_bytes : (i + 1) * chunk_bytes].copy_(dev[i * chunk_bytes : (i + 1) * chunk_bytes], non_blocking=True)
        torch.cuda.synchronize()

    def to_dev():
        for i in range(num_chunks):
            dev[i * chunk_bytes : (i + 1) * chunk_bytes].copy_(host[i * chunk_bytes : (i + 1) * chunk_bytes], non_blocking=True)
        torch.cuda.synchronize()

    return best_of(repeats, to_host), best_of(repeats, to_dev)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8, help="KV tensors (layers) per chunk")
    parser.add_argument("--total-mib", type=int, default=512, help="bytes moved per measurement")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--copy-threads", type=int, default=2, help="CPU copy threads (engine.copy_threads)")
    add_out_argument(parser)
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else ""
    columns = ["chunk KiB", "store GB/s", "load GB/s", "ref store GB/s", "ref load GB/s", "store/ref", "load/ref"]
    results = Results("arena_copy", run_title("arena_copy.py", args, extra=gpu), columns)

    print(
        f"device {args.device}, {args.layers} layers per chunk, {args.total_mib} MiB per measurement, "
        f"best of {args.repeats}, {args.copy_threads} copy threads"
    )
    print(f"{'chunk':>9} {'store GB/s':>11} {'load GB/s':>10} {'ref GB/s':>10} {'store/ref':>10} {'load/ref':>9}")
    for size_kib in SIZES_KIB:
        chunk_bytes = size_kib * 1024
        page = chunk_bytes // args.layers
        num_chunks = max(2, args.total_mib * 1024 * 1024 // chunk_bytes)
        with tempfile.TemporaryDirectory(dir="/dev/shm") as shm_dir:
            arena = Arena(shm_dir, "bench", capacity=chunk_bytes * num_chunks, segment_size=256 << 20, lease_seconds=60)
            try:
                pool = arena.pool("bench", chunk_bytes)
                slots = np.array(pool.reserve("bench", num_chunks), dtype=np.int64)
                tensors = [torch.ones((num_chunks, page), dtype=torch.int8, device=args.device) for _ in range(args.layers)]
                engine = CopyEngine(
                    tensors,
                    [[GroupRef(t, page) for t in range(args.layers)]],
                    blocks_per_chunk=1,
                    rank=0,
                    rank_stride=chunk_bytes,
                    copy_threads=args.copy_threads,
                )
                block_ids = np.arange(num_chunks, dtype=np.int32)
                job = iter(range(1 << 30))

                def store():
                    j = next(job)
                    engine.store(j, pool.geometry, block_ids, [num_chunks], [0], slots)
                    engine.wait({j})
                    engine.finished()

                def load():
                    j = next(job)
                    engine.load(j, pool.geometry, slots, block_ids, [num_chunks], [0])
                    engine.wait({j})
                    engine.finished()

                store()  # map segments once, outside the timing
                total = chunk_bytes * num_chunks
                store_s = best_of(args.repeats, store)
                load_s = best_of(args.repeats, load)
                if args.device == "cuda":
                    ref_store_s, ref_load_s = cuda_reference_seconds(chunk_bytes, num_chunks, args.repeats)
                else:
                    ref_store_s = ref_load_s = memcpy_seconds(chunk_bytes, num_chunks, args.repeats)
                engine.close()
            finally:
                arena.close()
        gbps = lambda seconds: total / seconds / 1e9  # noqa: E731
        print(
            f"{size_kib:>6}KiB {gbps(store_s):>11.2f} {gbps(load_s):>10.2f} {gbps(ref_store_s):>10.2f} "
            f"{ref_store_s / store_s:>10.2f} {ref_load_s / load_s:>9.2f}"
        )
        results.rows.append(
            [size_kib, gbps(store_s), gbps(load_s), gbps(ref_store_s), gbps(ref_load_s), ref_store_s / store_s,
             ref_load_s / load_s]
        )  # fmt: skip
        results.sizes_bytes.append(chunk_bytes)
    if args.device == "cuda":
        store_ref, load_ref = "torch pinned copy, device to host", "torch pinned copy, host to device"
    else:
        store_ref = load_ref = "numpy memcpy, 1 thread"
    results.panels = [
        Panel("store: KV cache -> arena slot", [
            Line("kvstrata", results.column("store GB/s")), Line(store_ref, results.column("ref store GB/s"), True)]),
        Panel("load: arena slot -> KV cache", [
            Line("kvstrata", results.column("load GB/s")), Line(load_ref, results.column("ref load GB/s"), True)]),
    ]  # fmt: skip
    write_results(results, args.out)


if __name__ == "__main__":
    main()
