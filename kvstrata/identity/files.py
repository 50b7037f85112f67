"""A checkpoint's files, and the exact digest of every byte of each.

A file's digest is xxh3-128 over the xxh3-128 digests of its consecutive
`PIECE_BYTES` pieces and its size (a two-level tree), so the pieces of one large
file are hashed by several threads at once: a checkpoint of one 16 GiB file reads
as fast as one of eight shards. `os.preadv` and xxhash both release the GIL.

Invariant: a digest is returned only for bytes that did not change while they were
read. Each file is opened once; what identifies its content -- (device, inode, size,
mtime_ns, ctime_ns), see `content_key` -- is taken from the open descriptor before
the first read, and again from the descriptor and from the path after the last one.
Any difference (a write, a truncation, the path replaced by a rename) raises
`FileChanged`: the bytes read may mix two versions. No Ray, no vLLM.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import xxhash

PIECE_BYTES = 64 << 20
READ_BYTES = 1 << 20  # fits in L2: the hash reads what the copy just wrote (measured +10-20 % warm)
# Threads that read and hash at once: enough to keep an NVMe queue busy, never more
# than a few per core (xxh3 runs at ~9 GB/s per core, faster than one disk).
MAX_THREADS = 8
# Files that never change a KV byte; left out so a README edit does not split a cache.
IGNORED_NAMES = ("README", "LICENSE", "NOTICE", "USE_POLICY")
IGNORED_SUFFIXES = (".md", ".png", ".jpg", ".jpeg", ".gif", ".pdf")

ContentKey = tuple[int, int, int, int, int]


class FileChanged(OSError):
    """A file changed (or was replaced) while it was being hashed."""


def content_key(st: os.stat_result) -> ContentKey:
    """What changes whenever a file's bytes change: (device, inode, size, mtime_ns, ctime_ns).

    ctime cannot be set from user space (`touch -d`, `cp -p` and rsync set mtime only),
    so a rewrite that restores the old mtime still changes the key.
    """
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def checkpoint_files(root: Path) -> list[Path]:
    """The files whose content is the checkpoint, in a stable order (relative names sorted).

    Hidden files and directories (`.git`, `.cache`, lock files) and documentation are
    left out; symbolic links are followed (a Hugging Face snapshot links to its blobs).
    """
    if root.is_file():
        return [root]
    files = []
    for directory, subdirs, names in os.walk(root, followlinks=True):
        subdirs[:] = sorted(d for d in subdirs if not d.startswith("."))
        for name in names:
            if name.startswith(".") or name.startswith(IGNORED_NAMES) or name.lower().endswith(IGNORED_SUFFIXES):
                continue
            path = Path(directory, name)
            if path.is_file():
                files.append(path)
    return sorted(files, key=lambda path: path.relative_to(root).as_posix())


@dataclass(frozen=True)
class FileDigest:
    """The exact digest of one file's bytes, and the key of the version that was read."""

    key: ContentKey
    digest: str

    @property
    def size(self) -> int:
        return self.key[2]


def hash_files(
    paths: Iterable[Path],
    threads: int | None = None,
    read_piece: Callable[[int, int, int], bytes] | None = None,
) -> dict[Path, FileDigest]:
    """Every byte of each of `paths`, hashed by up to `threads` threads (pieces of all
    files in one queue). Raises OSError if a file cannot be read, FileChanged if one
    changed while it was read. `read_piece(fd, offset, length)` is the seam that reads
    and hashes one piece (tests count or interleave what it does)."""
    paths = list(paths)
    if not paths:
        return {}
    read_piece = read_piece or hash_piece
    opened: dict[Path, tuple[int, os.stat_result]] = {}
    try:
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            opened[path] = (fd, os.fstat(fd))
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        jobs = [
            (path, fd, offset, min(PIECE_BYTES, st.st_size - offset))
            for path, (fd, st) in opened.items()
            for offset in range(0, st.st_size, PIECE_BYTES)
        ]
        workers = min(threads or min(MAX_THREADS, max(2, os.cpu_count() or 1)), max(1, len(jobs)))
        if workers > 1:
            with ThreadPoolExecutor(workers, thread_name_prefix="kvstrata-identity") as pool:
                pieces = list(pool.map(lambda job: read_piece(*job[1:]), jobs))
        else:
            pieces = [read_piece(*job[1:]) for job in jobs]
        per_file: dict[Path, list[bytes]] = {path: [] for path in paths}
        for (path, *_), piece in zip(jobs, pieces):
            per_file[path].append(piece)
        digests = {}
        for path, (fd, before) in opened.items():
            after, now = os.fstat(fd), os.stat(path)
            if not content_key(before) == content_key(after) == content_key(now):
                raise FileChanged(f"{path} changed while it was fingerprinted")
            tree = xxhash.xxh3_128(b"".join(per_file[path]))
            tree.update(before.st_size.to_bytes(8, "little"))
            digests[path] = FileDigest(content_key(before), tree.hexdigest())
        return digests
    finally:
        for fd, _ in opened.values():
            os.close(fd)


def hash_piece(fd: int, offset: int, length: int) -> bytes:
    """xxh3-128 of `length` bytes of `fd` from `offset`; FileChanged if the file ends first."""
    digest = xxhash.xxh3_128()
    buffer = memoryview(bytearray(min(READ_BYTES, length)))
    end = offset + length
    while offset < end:
        count = os.preadv(fd, [buffer[: min(len(buffer), end - offset)]], offset)
        if count == 0:
            raise FileChanged(f"file shrank while being fingerprinted (read ended at byte {offset})")
        digest.update(buffer[:count])
        offset += count
    return digest.digest()
