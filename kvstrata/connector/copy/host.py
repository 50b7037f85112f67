"""Moves descriptors between host addresses: the executor for KV caches on the CPU.

The copies run at submit time (the CPU is the compute device; there is nothing to
overlap with), so `wait` has nothing to wait for. With the optional native module
(`_rowcopy`, built at install) one call copies every row without the GIL; without it,
one `ctypes.memmove` per row (also outside the GIL, but one interpreter round trip per
row). A transfer of at least `parallel_min_bytes` is cut into `copy_threads` stretches
of equal bytes (a merged row may be cut in two), copied at once by the calling thread
and `copy_threads - 1` helpers.

The addresses are trusted: they come from `build_descriptors`, which checked them.
"""

from __future__ import annotations

import ctypes
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_all

import numpy as np

from kvstrata.connector.copy import Completed
from kvstrata.connector.copy.descriptors import Descriptors

try:
    from kvstrata.connector._rowcopy import copy_rows as native_copy_rows
except ImportError:  # built at install where a C compiler exists; ctypes copies otherwise
    native_copy_rows = None

# A transfer smaller than this is copied on the calling thread: handing work to another
# thread costs tens of microseconds, a 2 MiB copy about a hundred.
PARALLEL_MIN_BYTES = 2 << 20


def memmove_rows(dst: np.ndarray, src: np.ndarray, sizes: np.ndarray) -> None:
    """The fallback without the native module: one memmove per row."""
    memmove = ctypes.memmove
    for d, s, n in zip(dst.tolist(), src.tolist(), sizes.tolist()):
        memmove(d, s, n)


def split_bytes(desc: Descriptors, parts: int) -> list[Descriptors]:
    """`desc` cut into at most `parts` pieces of (nearly) equal bytes, in row order.

    A row that straddles a cut is split in two at the cut, so one large merged row
    still spreads over every thread. Together the pieces copy exactly `desc`'s bytes.
    """
    keep = desc.sizes > 0
    dst, src, sizes = (np.ascontiguousarray(column[keep]) for column in desc)
    total = int(sizes.sum())
    parts = max(1, min(parts, total))
    if parts == 1:
        return [Descriptors(dst, src, sizes)]
    ends = np.cumsum(sizes)
    starts = ends - sizes
    cuts = [total * k // parts for k in range(parts + 1)]
    pieces = []
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        first = int(np.searchsorted(ends, lo, side="right"))  # first row ending past lo
        last = int(np.searchsorted(starts, hi, side="left"))  # rows starting before hi
        d, s, n = dst[first:last].copy(), src[first:last].copy(), sizes[first:last].copy()
        head = lo - int(starts[first])
        d[0] += head
        s[0] += head
        n[0] -= head
        n[-1] -= int(ends[last - 1]) - hi
        pieces.append(Descriptors(d, s, n))
    return pieces


class HostRowExecutor:
    """Copies host descriptors at submit, split over threads when large.

    Invariant: when `submit` returns, every byte of the transfer has moved (or it
    raised and the job is not reported); `finished` reports each job once.
    """

    def __init__(self, copy_threads: int = 1, native: bool | None = None, parallel_min_bytes: int = PARALLEL_MIN_BYTES):
        if copy_threads < 1:
            raise ValueError(f"copy_threads must be at least 1, got {copy_threads}")
        if native and native_copy_rows is None:
            raise RuntimeError("kvstrata's native copy module (_rowcopy) was not built; reinstall with a C compiler")
        self.copy_threads = copy_threads
        self.native = native_copy_rows is not None and native is not False
        self.parallel_min_bytes = parallel_min_bytes
        self._copy = native_copy_rows if self.native else memmove_rows
        self._helpers: ThreadPoolExecutor | None = None
        self._completed: list[Completed] = []

    def submit(self, job_id: int, direction: str, desc: Descriptors) -> None:
        """Copy every row of `desc` now; `direction` is only for the executors that queue."""
        start = time.perf_counter()
        num_bytes = desc.num_bytes
        parts = self.copy_threads if num_bytes >= self.parallel_min_bytes else 1
        pieces = split_bytes(desc, parts) if parts > 1 else [desc]
        if len(pieces) > 1:
            if self._helpers is None:
                self._helpers = ThreadPoolExecutor(self.copy_threads - 1, thread_name_prefix="kvstrata-copy")
            helped = [self._helpers.submit(self._copy, *piece) for piece in pieces[1:]]
            try:
                self._copy(*pieces[0])
            finally:
                wait_all(helped)  # never return while a helper still writes
            for future in helped:
                future.result()
        elif desc.rows:
            self._copy(*desc)
        self._completed.append(Completed(job_id, True, num_bytes, time.perf_counter() - start))

    def finished(self) -> list[Completed]:
        done, self._completed = self._completed, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        """Nothing to wait for: host copies are done when `submit` returns."""

    def close(self) -> None:
        if self._helpers is not None:
            self._helpers.shutdown(wait=True)
            self._helpers = None
