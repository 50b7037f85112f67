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
    """One look at a process: resident bytes, open descriptors, threads; `arena_fds`: how
    many of the descriptors are files of the arena's shm_dir (its segments)."""

    pid: int
    rss_bytes: int
    fds: int
    threads: int
    arena_fds: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def sample_process(pid: int, arena_dir: str | Path | None = None) -> ProcessSample | None:
    """The figures of `pid` now, or None if it is gone."""
    try:
        process = psutil.Process(pid)
        with process.oneshot():
            sample = ProcessSample(pid, process.memory_info().rss, process.num_fds(), process.num_threads())
    except psutil.NoSuchProcess:
        return None
    if arena_dir is None:
        return sample
    arena = f"file {Path(arena_dir)}"
    return ProcessSample(**{**sample.as_dict(), "arena_fds": fd_kinds(pid).get(arena, 0)})


def arena_fd_bound(capacity: int, segment_size: int) -> int:
    """The most descriptors an arena of `capacity` bytes holds open: its segments open on
    first use, up to capacity / segment_size of them, and each keeps two (the file, held
    open so a reclaimer sees a live store's segment, and the one `mmap` duplicates)."""
    return 2 * -(-capacity // segment_size)


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


# A pooled connection of the object client (pyarrow's S3 client: the AWS SDK over libcurl)
# holds its TCP socket and two anonymous inodes (its handle's eventfd and epoll). Measured
# in the full matrix of 28 Nov 2026 at max_concurrency 16: +8 to +17 connections to the
# endpoint and +18 to +32 anonymous inodes per object row, kept after the row (the pool).
OBJECT_POOL_FDS_PER_CONNECTION = 3


def object_pool_growth(before: dict[str, int], after: dict[str, int], endpoint_port: int) -> int:
    """Descriptors the object client's connection pool added between two `fd_kinds`: its
    connections to the endpoint, and anonymous inodes up to two per such connection."""

    def grown(match) -> int:
        return sum(after.get(k, 0) - before.get(k, 0) for k in set(before) | set(after) if match(k))

    connections = max(0, grown(lambda kind: kind.startswith(f"tcp 127.0.0.1:{endpoint_port} ")))
    inodes = max(0, grown(lambda kind: kind.startswith("anon_inode")))
    return connections + min(inodes, 2 * connections)


def object_pool_fd_bound(max_concurrency: int) -> int:
    """The most descriptors the object client's pool may hold: a connection per request in
    flight (`max_concurrency`) and one for listing, each with its inodes."""
    return OBJECT_POOL_FDS_PER_CONNECTION * (max_concurrency + 1)


def growth_problems(
    before: ProcessSample,
    after: ProcessSample,
    limits: GrowthLimits = GrowthLimits(),
    arena_fds_bound: int | None = None,
    object_pool: tuple[int, int] | None = None,
) -> list[str]:
    """Why `after` looks like a leak compared with `before` (empty when it does not).

    The arena's segment descriptors are held to their own exact bound (`arena_fd_bound`),
    not to the growth tolerance: an arena opens its segments as it fills, whenever a row
    fills it (two engines racing fill a doubled arena in round 1 or only in recovery).
    So is the object client's connection pool: `object_pool` is (descriptors it added,
    `object_pool_fd_bound`); it fills up to the tier's concurrency when a row is busy
    enough, and keeps its connections."""
    problems = []
    pool_growth = 0
    if object_pool is not None:
        pool_growth, pool_bound = object_pool
        if pool_growth > pool_bound:
            problems.append(f"object client pool descriptors +{pool_growth} over its bound {pool_bound}")
    if after.rss_bytes - before.rss_bytes > limits.rss_bytes:
        problems.append(f"store RSS +{(after.rss_bytes - before.rss_bytes) >> 20} MiB")
    if arena_fds_bound is not None and after.arena_fds > arena_fds_bound:
        problems.append(f"store arena descriptors {after.arena_fds} over the arena's bound {arena_fds_bound}")
    if arena_fds_bound is not None:
        before_other, after_other = before.fds - before.arena_fds, after.fds - after.arena_fds - pool_growth
        if after_other - before_other > limits.fds:
            problems.append(f"store fds besides the arena's{' and the object pool' if pool_growth else ''} "
                            f"{before_other}->{after_other}")  # fmt: skip
    elif after.fds - pool_growth - before.fds > limits.fds:
        problems.append(f"store fds {before.fds}->{after.fds - pool_growth}")
    if after.threads - before.threads > limits.threads:
        problems.append(f"store threads {before.threads}->{after.threads}")
    return problems


def fd_kinds(pid: int) -> dict[str, int]:
    """What `pid`'s open descriptors are, counted by kind: a TCP socket by its remote end
    (``tcp 127.0.0.1:9000``) or ``tcp listen``, ``unix``, ``pipe``, an anonymous inode by
    its type (``anon_inode:[eventfd]``), a file by its directory (``file /dev/shm/x``).
    Empty if the process is gone. For reading a leak of descriptors, not for a verdict."""
    import os
    from collections import Counter

    try:
        process = psutil.Process(pid)
        sockets = {c.fd: c for c in process.net_connections(kind="all") if c.fd >= 0}
        fds = os.listdir(f"/proc/{pid}/fd")
    except (psutil.NoSuchProcess, OSError):
        return {}
    kinds: Counter[str] = Counter()
    for name in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue  # closed meanwhile
        fd = int(name)
        if fd in sockets:
            conn = sockets[fd]
            if not isinstance(conn.laddr, tuple):
                kinds["unix"] += 1
            elif conn.raddr:
                kinds[f"tcp {conn.raddr.ip}:{conn.raddr.port} {conn.status}"] += 1
            else:
                kinds[f"tcp {conn.status}"] += 1
        elif target.startswith(("socket:", "pipe:")):
            kinds[target.split(":")[0]] += 1
        elif target.startswith("anon_inode:"):
            kinds[target] += 1
        else:
            kinds[f"file {os.path.dirname(target)}"] += 1
    return dict(kinds)


def kinds_growth(before: dict[str, int], after: dict[str, int]) -> str:
    """The kinds whose count changed, largest change first: ``unix +20, pipe -2``."""
    changes = {k: after.get(k, 0) - before.get(k, 0) for k in set(before) | set(after)}
    moved = sorted(((n, k) for k, n in changes.items() if n), key=lambda item: -abs(item[0]))
    return ", ".join(f"{k} {n:+d}" for n, k in moved) or "no change"
