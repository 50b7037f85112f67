"""Shared-memory files mapped with raw mmap.

`multiprocessing.shared_memory` is deliberately not used: in Python 3.11 its resource
tracker unlinks a segment when a process that merely attached to it exits, which would
delete the node arena under every other engine. Here only the creator unlinks.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import sys
from pathlib import Path

import numpy as np

from kvstrata.tiers.orphans import hold_new_file
from kvstrata.tiers.private_files import open_private

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
# Linux values Python 3.11's mmap module does not export.
_MADV_COLLAPSE = 25  # Linux 6.1+
_PROT_NONE = 0
_MAP_FIXED = 0x10
_MAP_FAILED = ctypes.c_void_p(-1).value


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def collapse_into_huge_pages(fd: int, size: int) -> str | None:
    """Back a new shared-memory file with 2 MiB pages; None if done, else why not.

    Why: O_DIRECT disk I/O (and GPU DMA) into the arena is split into requests of at most
    `max_segments` physically contiguous pieces. A segment faulted in 4 KiB at a time gets
    whatever pages the allocator has at hand: measured here, a median of 65-128 physical
    pieces per 4 MiB (up to 1024), which cut the disk's requests to 1.1-2.7 MiB and its
    reads into the arena to 0.5-0.9x of reads into other memory. With 2 MiB pages it is 2.

    `madvise(MADV_COLLAPSE)` works whatever the system's THP settings say (only
    `shmem_enabled=deny` refuses), but only on pages that exist, through a mapping whose
    address is 2 MiB aligned: so one byte per 2 MiB is touched through a temporary aligned
    mapping, and the collapse allocates the rest (zeroed). Best effort: an older kernel, a
    file outside tmpfs or a machine short of free 2 MiB blocks keeps 4 KiB pages.
    """
    length = size // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if not sys.platform.startswith("linux"):
        return "not Linux"
    if not length:
        return "smaller than one huge page"
    libc = _libc()
    reservation = libc.mmap(None, length + HUGE_PAGE_BYTES, _PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if reservation in (None, _MAP_FAILED):
        return os.strerror(ctypes.get_errno())
    try:
        aligned = -(-reservation // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
        address = libc.mmap(aligned, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | _MAP_FIXED, fd, 0)
        if address != aligned:
            return os.strerror(ctypes.get_errno())
        for offset in range(0, length, HUGE_PAGE_BYTES):
            ctypes.memset(address + offset, 0, 1)
        if libc.madvise(address, length, _MADV_COLLAPSE) != 0:
            return f"madvise(MADV_COLLAPSE): {os.strerror(ctypes.get_errno())}"
        return None
    finally:
        libc.munmap(reservation, length + HUGE_PAGE_BYTES)


class SharedMemoryFile:
    """One mapped file; the creating side owns it and is the only one that unlinks it."""

    def __init__(self, path: str | os.PathLike[str], size: int, buffer: mmap.mmap, owner: bool, huge_pages: bool = False):
        self.lock_fd = -1  # the creator's: holds the file's flock while it lives (`kvstrata.tiers.orphans`)
        self.path = Path(path)
        self.size = size
        self._mmap: mmap.mmap | None = buffer
        self.owner = owner
        self.huge_pages = huge_pages  # backed by 2 MiB pages (set by the creator)
        self.array = np.frombuffer(buffer, dtype=np.uint8)

    @classmethod
    def create(cls, path: str | os.PathLike[str], size: int, prefault: bool = True) -> "SharedMemoryFile":
        """Create a new file (mode 0600, fails if it exists), lock it for as long as it lives, and map it.

        With `prefault`, its memory is allocated now, in 2 MiB pages where the kernel
        allows (`collapse_into_huge_pages`), and mapped.
        """
        if size <= 0:
            raise ValueError(f"shared-memory file {path}: size must be positive, got {size}")
        _check_room(Path(path).parent, size)
        fd = hold_new_file(path)
        refused = "not prefaulted"
        try:
            os.ftruncate(fd, size)
            if prefault:
                refused = collapse_into_huge_pages(fd, size)
                # Every page allocated now (those a collapse made cost nothing): a page the
                # filesystem cannot give is an error here, not a SIGBUS in whichever
                # process (an engine's worker) first touches it.
                os.posix_fallocate(fd, 0, size)
            buffer = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.unlink(path)
            os.close(fd)
            raise
        segment = cls(path, size, buffer, owner=True, huge_pages=refused is None)
        segment.lock_fd = fd  # kept open: a reclaimer must see this file as a live store's
        if prefault:
            # First touch of fresh 4 KiB pages runs at ~0.4 GB/s here; pay it once at
            # creation instead of inside the first engine's copies (after a collapse this
            # only maps pages that exist).
            segment.array[::mmap.PAGESIZE] = 0
            if refused is not None and size >= HUGE_PAGE_BYTES:
                _log_no_huge_pages(Path(path).parent, refused)
        return segment

    @classmethod
    def attach(cls, path: str | os.PathLike[str]) -> "SharedMemoryFile":
        """Map an existing file without taking ownership of it.

        Only a regular file of this process's user, not through a symlink: a segment of
        another user (who could read or rewrite every chunk an engine loads from it) is
        `UnsafeFileError` naming the path and its owner."""
        fd = open_private(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            buffer = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(path, size, buffer, owner=False)

    @property
    def closed(self) -> bool:
        return self._mmap is None

    def close(self) -> None:
        """Unmap; the owner also unlinks. Views handed out earlier must be dropped first."""
        if self._mmap is None:
            return
        self.array = np.empty(0, dtype=np.uint8)
        try:
            self._mmap.close()
        except BufferError:
            # A caller still holds a view (e.g. a torch tensor over the arena); the
            # mapping is released when that view dies. Unlinking is still safe.
            pass
        self._mmap = None
        if self.owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        if self.lock_fd >= 0:
            os.close(self.lock_fd)  # after the unlink: the file is never seen unlocked by its name
            self.lock_fd = -1


def _check_room(directory: Path, size: int) -> None:
    """Refuse a file the filesystem has no room for, before any of it is touched.

    Why: memory of a tmpfs file beyond the filesystem's free space is a SIGBUS on first
    touch, which kills the process (the store, or an engine's worker) instead of failing
    a call. Raises OSError(ENOSPC) naming the directory and both sizes.
    """
    stats = os.statvfs(directory)
    free = stats.f_bavail * stats.f_frsize
    if free < size:
        raise OSError(
            errno.ENOSPC,
            f"{directory} has {free} bytes free, a new shared-memory segment needs {size} "
            "(lower tiers.cpu.capacity or enlarge the filesystem, e.g. docker --shm-size)",
        )


_logged_no_huge_pages: set[Path] = set()


def _log_no_huge_pages(directory: Path, reason: str) -> None:
    """One line per directory: an operator may want to know, but it is no error."""
    if directory not in _logged_no_huge_pages:
        _logged_no_huge_pages.add(directory)
        logger.info("kvstrata shared memory in %s stays in 4 KiB pages (%s); disk I/O into it is split finer", directory, reason)
