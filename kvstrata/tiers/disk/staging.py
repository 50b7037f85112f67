"""What a batch holds while the digest threads work on it: staging memory and their futures.

Owns: the number of digest threads (the tier runs the pool), the aligned staging buffers
lent to one batch at a time, and waiting for a batch's digest jobs.

Invariants:
- A buffer lent to a batch is given to no other batch until that batch gives it back,
  after its last digest job is done: a read is verified after its I/O thread has moved on.
- `_wait_all` waits for every job before it raises the first failure, so nothing still
  runs on a batch's buffers once its caller has returned.

Must not touch: slabs, the index, or the tier's lock; it knows nothing of records.
"""

from __future__ import annotations

import mmap
import threading
from concurrent.futures import Future

import numpy as np

from kvstrata.keys import SLOT_ALIGNMENT
from kvstrata.tiers.disk.slab import _aligned_buffer

# Threads hashing runs for the I/O threads (xxhash releases the GIL): one hashes at
# ~10 GB/s, several times what a disk moves; two keep an I/O thread from queueing
# behind another's run.
DIGEST_THREADS = 2


class _SpareBuffers:
    """Aligned staging memory (headers, unaligned bodies) lent to one batch at a time.

    Why not one buffer per I/O thread: a read batch is verified on the digest threads after
    its I/O thread has moved on to the next batch, which would overwrite a per-thread
    buffer under a verification still running.
    """

    KEEP = 8  # buffers kept for reuse; more in flight at once are left to the collector

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spare: list[mmap.mmap] = []

    def lend(self, size: int, lent: list[mmap.mmap]) -> np.ndarray:
        """`size` aligned bytes; the buffer behind them is added to `lent`, to be given back."""
        with self._lock:
            buffer = next((b for b in self._spare if len(b) >= size), None)
            if buffer is not None:
                self._spare.remove(buffer)
        if buffer is None:
            buffer = _aligned_buffer(max(size, SLOT_ALIGNMENT))
        lent.append(buffer)
        return np.frombuffer(buffer, dtype=np.uint8, count=size)

    def give(self, buffers: list[mmap.mmap]) -> None:
        with self._lock:
            self._spare.extend(buffers[: max(0, self.KEEP - len(self._spare))])


def _wait_all(futures: list[Future]) -> None:
    """Wait for every future, then raise the first failure, if any."""
    _wait_all_quietly(futures)
    for future in futures:
        future.result()


def _wait_all_quietly(futures: list[Future]) -> None:
    for future in futures:
        future.exception()

