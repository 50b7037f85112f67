"""Shared-memory files mapped with raw mmap.

`multiprocessing.shared_memory` is deliberately not used: in Python 3.11 its resource
tracker unlinks a segment when a process that merely attached to it exits, which would
delete the node arena under every other engine. Here only the creator unlinks.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np


class SharedMemoryFile:
    """One mapped file; the creating side owns it and is the only one that unlinks it."""

    def __init__(self, path: str | os.PathLike[str], size: int, buffer: mmap.mmap, owner: bool):
        self.path = Path(path)
        self.size = size
        self._mmap: mmap.mmap | None = buffer
        self.owner = owner
        self.array = np.frombuffer(buffer, dtype=np.uint8)

    @classmethod
    def create(cls, path: str | os.PathLike[str], size: int, prefault: bool = True) -> "SharedMemoryFile":
        """Create a new file (mode 0600, fails if it exists) and map it."""
        if size <= 0:
            raise ValueError(f"shared-memory file {path}: size must be positive, got {size}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            buffer = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        segment = cls(path, size, buffer, owner=True)
        if prefault:
            # First touch of fresh memory runs at ~0.4 GB/s here; pay it once at creation
            # instead of inside the first engine's copies.
            segment.array[::mmap.PAGESIZE] = 0
        return segment

    @classmethod
    def attach(cls, path: str | os.PathLike[str]) -> "SharedMemoryFile":
        """Map an existing file without taking ownership of it."""
        fd = os.open(path, os.O_RDWR)
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
