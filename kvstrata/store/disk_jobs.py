"""How the node store cuts a request's disk I/O into jobs for its I/O threads.

Owns: the job sizes (`DISK_JOB_BYTES`, `EDGE_JOB_BYTES`, `disk_job_sizes`) and
`submit_disk_jobs`, which both the cascade (writes) and promotion (reads) queue their
batches with.
Invariants: the jobs of a request cover its items once each, in order, contiguous (so
neighbouring records share a call); none moves more than `DISK_JOB_BYTES` unless one
chunk is larger.
Must not: touch the store's state; it is handed the executor and the job to run.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstrata.tiers.arena import SlotPool

# Bytes one disk job (a batch of writes or promotions on one I/O thread) moves at most,
# unless one chunk is larger. Measured (benchmarks/tier_throughput.py, 1-8 MiB chunks,
# rotated rounds): 64 MiB jobs reached raw O_DIRECT speed; one-chunk jobs and 16 MiB jobs
# were 10-25% slower (too little in flight per thread).
DISK_JOB_BYTES = 64 << 20
# Bytes of a request's first and last jobs on each I/O thread (see `disk_job_sizes`).
EDGE_JOB_BYTES = 8 << 20


def submit_disk_jobs(
    io: ThreadPoolExecutor,
    io_threads: int,
    job: Callable,
    namespace: str,
    pool: SlotPool,
    items: list[tuple[bytes, int]],
) -> None:
    """Split I/O into contiguous batches (neighbouring records share a call) over `io_threads`.

    A batch moves at most `DISK_JOB_BYTES`, so the first promoted chunks are ready
    before a request's last ones are read. (Checksums are the disk tier's digest
    threads' work, one run at a time, while the I/O thread moves the next run.)
    """
    if not items:
        return
    start = 0
    for size in disk_job_sizes(len(items), pool.geometry.slot_bytes, io_threads):
        io.submit(job, namespace, pool, items[start : start + size])
        start += size


def disk_job_sizes(count: int, item_bytes: int, threads: int) -> list[int]:
    """Chunks per disk job, in the order the jobs are queued, for `count` chunks over `threads`.

    The first and the last `threads` jobs move about `EDGE_JOB_BYTES`, the ones between up
    to `DISK_JOB_BYTES`. Why: a job's set-up holds the GIL in proportion to its chunks, so
    with equal 64 MiB jobs the fourth thread's first read started 16 ms after the request
    (256 KiB chunks, 512 MiB; now 5-6 ms); and a thread that finishes its share early
    takes the small jobs at the end instead of idling while the others finish (threads
    ended up to 20 ms apart at 8 MiB chunks; now within 4 ms).
    """
    big = max(1, min(-(-count // threads), DISK_JOB_BYTES // item_bytes))
    edge = max(1, min(big, EDGE_JOB_BYTES // item_bytes))
    middle = count - 2 * threads * edge
    if middle <= 0:
        return _even_split(count, -(-count // edge))
    # Whole rounds of middle jobs, one per thread each: with 7 jobs of 64 MiB over 4
    # threads, one thread read 104 chunks of a 512 MiB request and the others 136, and sat
    # idle for the last 15% of it (1 MiB chunks; the last `threads` small jobs cannot even
    # out a whole job).
    rounds = -(-middle // (big * threads))
    between = [size for size in _even_split(middle, rounds * threads) if size]
    return [edge] * threads + between + [edge] * threads


def _even_split(count: int, parts: int) -> list[int]:
    return [count // parts + (i < count % parts) for i in range(parts)]
