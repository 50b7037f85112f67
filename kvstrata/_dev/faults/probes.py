"""What a fault may leave behind, measured from outside: a store process's RSS, open file
descriptors and threads, the files of an arena's shm_dir and a disk tier's bytes.

Read from /proc through psutil, so it works on a store that another process started
(a Ray actor) and never asks the store itself, which may be the thing that broke.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import psutil


@dataclass(frozen=True)
class ProcessSample:
    """One look at a process: resident bytes, open descriptors, threads."""

    pid: int
    rss_bytes: int
    fds: int
    threads: int

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def sample_process(pid: int) -> ProcessSample | None:
    """The figures of `pid` now, or None if it is gone."""
    try:
        process = psutil.Process(pid)
        with process.oneshot():
            return ProcessSample(pid, process.memory_info().rss, process.num_fds(), process.num_threads())
    except psutil.NoSuchProcess:
        return None


def directory_files(directory: str | Path, pattern: str = "*") -> list[Path]:
    """Files under `directory` matching `pattern` (none if it does not exist)."""
    root = Path(directory)
    return sorted(p for p in root.glob(pattern) if p.is_file()) if root.is_dir() else []


def directory_bytes(directory: str | Path) -> int:
    """Bytes the files under `directory` occupy on their filesystem (allocated blocks,
    what a full disk counts, not their apparent size)."""
    root = Path(directory)
    if not root.is_dir():
        return 0
    return sum(p.stat().st_blocks * 512 for p in root.rglob("*") if p.is_file())


def disk_tier_bytes(directory: str | Path) -> int:
    """Bytes of records the disk tier holds: the lengths of its payload and header files,
    what its capacity counts (not its lock file, nor files it set aside as damaged).

    Lengths, not allocated blocks: a file written in many places gets an extent tree on
    ext4, whose blocks `st_blocks` counts too (measured: 4-8 KiB over a full tier)."""
    return sum(p.stat().st_size for p in directory_files(directory, "*.payloads") + directory_files(directory, "*.headers"))


@dataclass(frozen=True)
class GrowthLimits:
    """How much a store may grow between two samples before it counts as a leak.

    Generous on purpose: RSS moves with Python's allocator and Ray's buffers, threads
    with Ray's pools; a leak per request or per fault grows past these within a row.
    """

    rss_bytes: int = 96 << 20
    fds: int = 24
    threads: int = 8


def growth_problems(before: ProcessSample, after: ProcessSample, limits: GrowthLimits = GrowthLimits()) -> list[str]:
    """Why `after` looks like a leak compared with `before` (empty when it does not)."""
    problems = []
    if after.rss_bytes - before.rss_bytes > limits.rss_bytes:
        problems.append(f"store RSS +{(after.rss_bytes - before.rss_bytes) >> 20} MiB")
    if after.fds - before.fds > limits.fds:
        problems.append(f"store fds {before.fds}->{after.fds}")
    if after.threads - before.threads > limits.threads:
        problems.append(f"store threads {before.threads}->{after.threads}")
    return problems
