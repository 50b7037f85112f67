"""How the memory shape of one O_DIRECT `pwritev`/`preadv` changes what this disk moves.

The disk tier wrote a run of records as one `pwritev` of [header, payload, header,
payload, ...] until 0d6d5a5; since then it uses the `split files` shape below (payloads in
one file, each run's headers as one block in a second). This measures the same bytes to the same file offsets in three shapes, 4 threads, each a
contiguous share of the file, `--per-call` records per call:

  chunk per call   one payload per call, no headers: the shape of tier_throughput.py's raw
                   O_DIRECT reference (a), the reference of the ratios here
  one piece        one contiguous buffer per call (headers and payloads already side by side)
  headers between  the tier's former shape: a 4 KiB header iovec before every payload iovec
  payloads only    the payloads alone, one iovec each (the file holds no headers)
  split files      payloads alone in one file, then the run's headers as one block in a
                   second file: two calls per run (the tier's shape since 0d6d5a5)

Writes are cold (a freshly `posix_fallocate`d file, as a new slab) and warm (the same file
again); reads follow the warm write. Shapes rotate order every round; medians (of the ratios: side by side).

    python benchmarks/iovec_shape.py [--sizes 256,1024] [--per-call 128] [--rounds 4] [--out DIR]

Besides the printed table it writes iovec_shape.csv, .md and .png (GB/s against payload
size, one panel per phase, one line per shape) into --out (benchmarks/results/).
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tier_throughput as bench  # noqa: E402
from plotting import Line, Panel, Results, add_out_argument, run_title, write_results  # noqa: E402

HEADER = 4096
TOTAL = 512 << 20
THREADS = 4
SHAPES = ("chunk per call", "one piece", "headers between", "payloads only", "split files")
LABELS = {"chunk per call": "chunk per call (raw reference)", "split files": "split files (the tier's shape)"}


def measure(directory: str, shm_dir: str, payload: int, per_call: int, rounds: int) -> dict[str, list[float]]:
    """Seconds per (shape, phase) over `rounds` rounds."""
    count = TOTAL // payload
    share = count // THREADS
    seconds: dict[str, list[float]] = {}
    with bench.reference_memory(shm_dir, TOTAL + count * HEADER, seed=5) as memory, \
            ThreadPoolExecutor(THREADS) as pool:  # fmt: skip
        headers = mmap.mmap(-1, HEADER * count)
        try:
            with memoryview(headers) as header_view:

                def pieces(shape: str, first: int, end: int) -> tuple[list[memoryview], int]:
                    """The iovecs of records [first, end) and their file offset."""
                    if shape == "one piece":
                        stride = HEADER + payload
                        return [memory[first * stride : end * stride]], first * stride
                    if shape in ("chunk per call", "payloads only", "split files"):
                        return [memory[r * payload : (r + 1) * payload] for r in range(first, end)], first * payload
                    return [
                        view
                        for r in range(first, end)
                        for view in (header_view[r * HEADER : (r + 1) * HEADER], memory[r * payload : (r + 1) * payload])
                    ], first * (HEADER + payload)

                def timed(fds: tuple[int, int], shape: str, call) -> float:
                    def thread(t: int) -> None:
                        step = 1 if shape == "chunk per call" else per_call
                        for first in range(t * share, (t + 1) * share, step):
                            end = min(first + step, (t + 1) * share)
                            iovecs, offset = pieces(shape, first, end)
                            call(fds[0], iovecs, offset)
                            if shape == "split files":
                                call(fds[1], [header_view[first * HEADER : end * HEADER]], first * HEADER)

                    return bench.timed(lambda: list(pool.map(thread, range(THREADS))))

                for r in range(rounds):
                    turn = r % len(SHAPES)
                    for shape in SHAPES[turn:] + SHAPES[:turn]:
                        paths = [os.path.join(directory, name) for name in ("shape.slab", "shape.headers")]
                        fds = tuple(os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600) for path in paths)
                        try:
                            os.posix_fallocate(fds[0], 0, count * (HEADER + payload))
                            os.posix_fallocate(fds[1], 0, count * HEADER)
                            for phase, call in (("cold write", os.pwritev), ("warm write", os.pwritev), ("read", os.preadv)):
                                seconds.setdefault(f"{shape}: {phase}", []).append(timed(fds, shape, call))
                        finally:
                            for fd, path in zip(fds, paths):
                                os.close(fd)
                                os.remove(path)
        finally:
            headers.close()
    return seconds


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="256,1024", help="payload sizes in KiB, comma-separated")
    parser.add_argument("--per-call", type=int, default=128, help="records per call (the tier: up to 32 MiB, 256 at most)")
    parser.add_argument("--rounds", type=int, default=4)
    add_out_argument(parser)
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    sizes_kib = [int(size) for size in args.sizes.split(",")]
    columns = ["chunk KiB", "records per call", "phase"]
    columns += [f"{shape} GB/s" for shape in SHAPES] + [f"{shape} ratio" for shape in SHAPES]
    results = Results("iovec_shape", run_title("iovec_shape.py", args), columns, x_label="payload size")
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="kvstrata-shape-") as directory, \
            tempfile.TemporaryDirectory(dir="/dev/shm", prefix="kvstrata-shape-") as shm_dir:  # fmt: skip
        print(f"512 MiB per measurement, {THREADS} threads, {args.rounds} rounds; GB/s (medians), ratio to chunk per call")
        for size in sizes_kib:
            per_call = min(args.per_call, max(1, (32 << 20) // (size << 10)))
            seconds = measure(directory, shm_dir, size << 10, per_call, args.rounds)
            print(f"{size} KiB payloads, {per_call} records per call")
            for phase in ("cold write", "warm write", "read"):
                reference = seconds[f"chunk per call: {phase}"]
                cells, rates, ratios = [], [], []
                for shape in SHAPES:
                    mine = seconds[f"{shape}: {phase}"]
                    rates.append(statistics.median(TOTAL / s / 1e9 for s in mine))
                    ratios.append(statistics.median(a / b for a, b in zip(reference, mine)))
                    cells.append(f"{shape} {rates[-1]:5.2f} ({ratios[-1]:.2f}x)")
                print(f"  {phase:10s}  " + "  ".join(cells), flush=True)
                results.rows.append([size, per_call, phase, *rates, *ratios])
    results.sizes_bytes = [size << 10 for size in sizes_kib]
    results.panels = [
        Panel(phase, [
            Line(LABELS.get(shape, shape), [row[3 + i] for row in results.rows if row[2] == phase],
                 reference=shape != "split files")
            for i, shape in enumerate(SHAPES)
        ])
        for phase in ("cold write", "warm write", "read")
    ]  # fmt: skip
    write_results(results, args.out)


if __name__ == "__main__":
    main()
