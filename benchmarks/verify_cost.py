"""What checking every byte read costs an O_DIRECT read on this machine, and why.

The disk tier checks each chunk's xxh3-128 on digest threads while its I/O threads read
on, as `tier_throughput.py` measures. This takes the tier away and keeps the two
things that meet in memory: `--threads` threads pread() a file in `--piece-mib` pieces
into distinct memory of the arena's kind (shared memory, 2 MiB pages), and beside them
the tier's `DIGEST_THREADS` threads do one of:

  nothing          the raw read: the reference of every ratio
  hash landed      hash each piece as it lands (the tier's check: reads every byte from memory)
  hash elsewhere   hash as many bytes of other memory of the same kind, which no read
                   touches, one piece as each piece lands: the same memory traffic, not
                   of the landed bytes
  hash cached      the same number of hash calls over a 256 KiB buffer that stays in the
                   CPU's cache: the same work without the memory traffic of the landed bytes
  hash cached, cpu-matched
                   over the cached buffer as many times as it takes to spend the CPU time
                   "hash landed" spends (timed before the rounds)

If "hash landed" costs the read more than the cpu-matched one, what slows the disk is
the check's reads from memory, not its CPU time; if "hash elsewhere" costs as much as
"hash landed", it is any read from memory at that rate, not something of the landed bytes
(such as where they lie in the CPU's caches). Modes rotate order every round; each
ratio is the median over rounds of side-by-side ratios.

    python benchmarks/verify_cost.py [--path /mnt/nvme/bench] [--total-mib 1024] [--rounds 8] [--piece-mib 2,8] [--out DIR]

Besides the printed table it writes verify_cost.csv, .md and .png (GB/s against piece
size, one line per mode, "nothing" the reference) into --out (benchmarks/results/).
"""

from __future__ import annotations

import argparse
import mmap
import os
import queue
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import xxhash

from kvstrata.tiers.disk import DIGEST_THREADS

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tier_throughput as bench  # noqa: E402
from plotting import Line, Panel, Results, add_out_argument, run_title, write_results  # noqa: E402

CACHED_BYTES = 256 << 10
MODES = ("nothing", "hash landed", "hash elsewhere", "hash cached", "hash cached, cpu-matched")
LABELS = {"nothing": "do nothing (raw reads: the reference)"}


def hash_seconds(work: Callable[[], object]) -> float:
    """CPU seconds of this thread that `work` takes."""
    start = time.thread_time()
    work()
    return time.thread_time() - start


def read_beside(fd: int, view: memoryview, piece: int, threads: int, check: Callable[[int], object] | None) -> float:
    """Seconds to read the file into `view` on `threads` threads, `check(offset)` running on
    `DIGEST_THREADS` threads for each piece as it lands."""
    landed: queue.SimpleQueue[int | None] = queue.SimpleQueue()

    def digest() -> None:
        while (offset := landed.get()) is not None:
            check(offset)

    def read(offsets: list[int]) -> None:
        for offset in offsets:
            os.preadv(fd, [view[offset : offset + piece]], offset)
            if check is not None:
                landed.put(offset)

    def read_all() -> None:
        readers = [threading.Thread(target=read, args=(share,)) for share in shares]
        for thread in readers:
            thread.start()
        for thread in readers:
            thread.join()

    shares = bench.split(list(range(0, len(view), piece)), threads)
    digesters = [threading.Thread(target=digest) for _ in range(DIGEST_THREADS if check else 0)]
    for thread in digesters:
        thread.start()
    try:
        seconds = bench.timed(read_all)
    finally:
        for _ in digesters:
            landed.put(None)
        for thread in digesters:
            thread.join()
    return seconds


def measure_piece(
    fd: int, view: memoryview, other: memoryview, cached: mmap.mmap, piece: int, threads: int, rounds: int
) -> tuple[dict[str, list[float]], str]:
    """Seconds of each mode's reads over `rounds` rounds at one piece size, and a line on
    what xxh3-128 alone does at that size."""
    size = len(view)
    per_piece = piece // CACHED_BYTES

    def hash_pieces_of(memory: memoryview) -> Callable[[int], None]:
        def check(offset: int) -> None:
            xxhash.xxh3_128(memory[offset : offset + piece]).digest()

        return check

    landed, elsewhere = hash_pieces_of(view), hash_pieces_of(other)

    def cached_times(times: int) -> Callable[[int], None]:
        def check(_offset: int) -> None:
            for _ in range(times):
                xxhash.xxh3_128(cached).digest()

        return check

    memory_s = min(hash_seconds(lambda: [landed(o) for o in range(0, size, piece)]) for _ in range(3))
    cache_s = min(hash_seconds(lambda: cached_times(per_piece)(0)) for _ in range(3)) * (size // piece)
    matched = round(per_piece * memory_s / cache_s)
    alone = (f"  xxh3-128 alone: {size / memory_s / 1e9:.1f} GB/s from memory, {size / cache_s / 1e9:.1f} GB/s "
             f"from cache; cpu-matched = {matched} hashes of {CACHED_BYTES >> 10} KiB per piece")  # fmt: skip
    checks = {"nothing": None, "hash landed": landed, "hash elsewhere": elsewhere,
              "hash cached": cached_times(per_piece), "hash cached, cpu-matched": cached_times(matched)}  # fmt: skip
    seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
    for round_ in range(rounds):
        for mode in bench.rotated(list(MODES), round_):
            seconds[mode].append(read_beside(fd, view, piece, threads, checks[mode]))
    return seconds, alone


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", default=None, help="directory on the disk to measure (default: a temp dir in /var/tmp)")
    parser.add_argument("--total-mib", type=int, default=1024)
    parser.add_argument(
        "--piece-mib", default="8", help="bytes per pread (the tier's READ_RUN_BYTES), MiB; comma-separated for several"
    )
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=8)
    add_out_argument(parser)
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    size, pieces_mib = args.total_mib << 20, [int(piece) for piece in args.piece_mib.split(",")]
    columns = ["piece KiB", "mode", "GB/s", "ratio to nothing", "min ratio", "max ratio"]
    results = Results("verify_cost", run_title("verify_cost.py", args), columns, x_label="bytes per pread (piece)")
    with ExitStack() as stack:
        directory = tempfile.mkdtemp(prefix="kvstrata-bench-", dir=args.path or "/var/tmp")
        shm_dir = tempfile.mkdtemp(prefix="kvstrata-bench-", dir="/dev/shm")
        stack.callback(os.rmdir, shm_dir)
        stack.callback(os.rmdir, directory)
        view = stack.enter_context(bench.reference_memory(shm_dir, size, seed=3))
        other = stack.enter_context(bench.reference_memory(shm_dir, size, seed=4))
        path = os.path.join(directory, "verify-cost.bin")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o600)
        stack.callback(os.remove, path)
        stack.callback(os.close, fd)
        write_piece = 8 << 20
        for offset in range(0, size, write_piece):
            os.pwrite(fd, view[offset : offset + write_piece], offset)
        os.fsync(fd)
        cached = stack.enter_context(mmap.mmap(-1, CACHED_BYTES))
        cached.write(os.urandom(CACHED_BYTES))
        for piece_mib in pieces_mib:
            piece = piece_mib << 20
            seconds, alone = measure_piece(fd, view, other, cached, piece, args.threads, args.rounds)
            print(f"{args.total_mib} MiB read in {piece_mib} MiB pieces on {args.threads} threads, "
                  f"{DIGEST_THREADS} digest threads, {args.rounds} rounds, file in {directory}")  # fmt: skip
            print(alone)
            print(f"{'beside the reads':>26} {'GB/s':>6} {'÷ nothing':>10} {'range':>11}")
            for mode in MODES:
                ratios = [base / s for base, s in zip(seconds["nothing"], seconds[mode])]
                gbps = size / statistics.median(seconds[mode]) / 1e9
                print(f"{mode:>26} {gbps:>6.2f} {statistics.median(ratios):>10.3f} {min(ratios):>5.2f}-{max(ratios):.2f}")
                results.rows.append([piece >> 10, mode, gbps, statistics.median(ratios), min(ratios), max(ratios)])
    results.sizes_bytes = [piece << 20 for piece in pieces_mib]
    rates = {mode: [row[2] for row in results.rows if row[1] == mode] for mode in MODES}
    results.panels = [
        Panel(f"O_DIRECT reads beside {DIGEST_THREADS} digest threads...", [
            Line("hash landed (kvstrata's check)", rates["hash landed"]),
            *(Line(LABELS.get(mode, mode), rates[mode], reference=True) for mode in MODES if mode != "hash landed"),
        ])
    ]  # fmt: skip
    write_results(results, args.out)


if __name__ == "__main__":
    main()
