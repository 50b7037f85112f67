"""A disk slab's files: where each record lies, what the files are called, and record I/O.

Owns: the layout of one namespace's records (payloads in one file, 4 KiB headers in
another beside it), the file names that carry that layout, opening the files (O_DIRECT
where the filesystem allows it), growing and cutting them, staging a batch's memory for
aligned I/O, and the one-call `preadv`/`pwritev` helpers.

Invariants:
- Record r's payload is at r * stride of its payload file, its header at r * 4 KiB of
  the header file. The stride comes from the payload size and the alignment in the file
  name, never from the current settings: a slab keeps the layout it was created with.
- Every offset and length handed to the kernel is a multiple of 4 KiB, and memory given
  to O_DIRECT is page aligned (or staged through memory that is).
- A failed read is reported (bytes read, reason), never raised: a miss, not a crash.
  A short write is an I/O error.

Must not touch: which key is in which record, capacity, counters or eviction (the index,
`index.py`). `_Slab` holds that state for the index but takes no lock of its own: callers
hold the tier's lock, except for the I/O itself and `grow`.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kvstrata.keys import SLOT_ALIGNMENT, align_up
from kvstrata.namespaces import check_namespace
from kvstrata.tiers.policies import EvictionPolicy
from kvstrata.tiers.positions import Positions
from kvstrata.tiers.private_files import open_private
from kvstrata.tiers.records import HEADER_BYTES

logger = logging.getLogger(__package__)  # the tier logs under one name, "kvstrata.tiers.disk"

PAYLOADS_SUFFIX = ".payloads"
HEADERS_SUFFIX = ".headers"
OLD_SLAB_SUFFIX = ".slab"  # the one-file layout: `[header | payload]` records
# Records per pwritev/preadv (one iovec each), within Linux's IOV_MAX of 1024.
MAX_RUN = 256

# Payloads of at least ALIGNED_FROM_BYTES start on a PAYLOAD_ALIGNMENT boundary of their
# file (a stride of whole alignments; no gap when the payload is a multiple). Measured on this VM's
# disk through the node store, same memory, same rounds, 2-32 MiB chunks: packed records
# (each 4 KiB further off the last) wrote at 0.62-0.76x raw O_DIRECT and read at
# 0.75-0.83x; 64 KiB-aligned payloads wrote at 0.85-0.95x and read at 0.83-0.88x. Below
# 1 MiB the gap would cost more than 6% of the disk, so small chunks stay packed.
# (Measured in the one-file layout, where every payload was 4 KiB further off the last.)
PAYLOAD_ALIGNMENT = 64 << 10
ALIGNED_FROM_BYTES = 1 << 20


def _aligned_buffer(size: int) -> mmap.mmap:
    """Anonymous mappings are page aligned, as O_DIRECT requires."""
    return mmap.mmap(-1, size)


def _runs(records: list[int], max_records: int = MAX_RUN, first_records: int | None = None) -> list[tuple[int, int]]:
    """[start, end) index ranges of sorted `records` that are neighbours on disk.

    With `first_records`, runs start that long and double up to `max_records`.
    """
    runs = []
    start = 0
    limit = max_records if first_records is None else max(1, min(first_records, max_records))
    while start < len(records):
        end = start + 1
        while end < len(records) and end - start < limit and records[end] == records[end - 1] + 1:
            end += 1
        runs.append((start, end))
        start = end
        limit = min(2 * limit, max_records)
    return runs


def _read(fd: int, iovecs: list[memoryview], offset: int) -> tuple[int, str]:
    """One `preadv`: the bytes it read, and why it read fewer than asked, if it did.
    An I/O error reads nothing: the records it touched are misses, not a crash."""
    try:
        return os.preadv(fd, iovecs, offset), "short read"
    except OSError as exc:
        return 0, exc.strerror or str(exc)


def _write_fully(fd: int, iovecs: list[memoryview], offset: int) -> None:
    """One `pwritev`; a short write is an I/O error."""
    written = os.pwritev(fd, iovecs, offset)
    if written != sum(v.nbytes for v in iovecs):
        raise OSError(errno.EIO, f"short write ({written} bytes)")


def _is_aligned(array: np.ndarray) -> bool:
    return array.ctypes.data % SLOT_ALIGNMENT == 0 and array.nbytes % SLOT_ALIGNMENT == 0


class _Slab:
    """The records of one namespace: payloads in one file, headers in another. Callers hold the tier's lock."""

    def __init__(
        self, path: Path, namespace: str, payload_bytes: int, alignment: int, direct_io: bool, policy: EvictionPolicy
    ):
        self.path = path  # the payload file
        self.header_path = path.with_suffix(HEADERS_SUFFIX)
        self.namespace = namespace
        self.payload_bytes = payload_bytes
        self.body_bytes = align_up(payload_bytes)  # what one record's payload I/O moves
        # Record r's payload starts at r * stride, on an `alignment` boundary; records of a
        # packed slab touch, so neighbours share a call.
        self.stride = _payload_stride(payload_bytes, alignment)
        self.packed = self.stride == self.body_bytes
        self.record_cost = HEADER_BYTES + self.stride  # disk bytes per record: what `capacity` counts
        self.policy = policy
        self.fd, self.direct = _open(path, direct_io)
        try:
            self.header_fd, _ = _open(self.header_path, self.direct)
        except OSError:
            os.close(self.fd)
            raise
        # Records [0, num_records) have been handed out at least once; the files hold
        # reserved_end records (those beyond num_records are reserved: allocated, never used).
        # A record cut short by a crash at the end of the file still counts: its read fails.
        self.reserved_end = -(-os.fstat(self.fd).st_size // self.stride)
        if os.fstat(self.header_fd).st_size > self.header_offset(self.reserved_end):
            os.ftruncate(self.header_fd, self.header_offset(self.reserved_end))  # headers of no payload
        self.num_records = self.reserved_end
        self.growing = 0  # allocations in flight (outside the lock)
        self.preallocate = True  # until the filesystem says it cannot
        self.free: list[int] = []
        self.index: dict[bytes, int] = {}
        self.key_of: dict[int, bytes] = {}
        self.busy: dict[int, int] = {}  # record -> I/O operations in flight
        self.writing: dict[bytes, int] = {}  # key -> the record its write in flight took (one per key)
        self.retired = False  # purged: its names are gone, it lives until its I/O in flight ends
        self.positions = Positions()

    def offset(self, record: int) -> int:
        """Where the record's payload starts in the payload file (and where `record` records end)."""
        return record * self.stride

    @staticmethod
    def header_offset(record: int) -> int:
        """Where the record's header starts in the header file."""
        return record * HEADER_BYTES

    def stage(
        self, buffers: list[np.ndarray], take: Callable[[int], np.ndarray]
    ) -> tuple[memoryview, list[memoryview], list[np.ndarray], list[bool]]:
        """The header block and its views, record bodies and which bodies are staged, for one
        batch of records (a run's headers are one slice of the block, as they are on disk).

        A body is the caller's buffer itself when it spans the whole record body (and is
        aligned, for O_DIRECT); otherwise an aligned staging slice the caller copies
        through (`bounced`). `take(size)` gives aligned staging memory.
        """
        header_block = memoryview(take(HEADER_BYTES * len(buffers)))
        headers = [header_block[n * HEADER_BYTES : (n + 1) * HEADER_BYTES] for n in range(len(buffers))]
        bounced = [b.nbytes < self.body_bytes or (self.direct and not _is_aligned(b)) for b in buffers]
        staging = take(self.body_bytes * sum(bounced)) if any(bounced) else None
        bodies = []
        staged = 0
        for buffer, bounce in zip(buffers, bounced):
            if bounce:
                bodies.append(staging[staged * self.body_bytes : (staged + 1) * self.body_bytes])
                staged += 1
            else:
                bodies.append(buffer[: self.body_bytes])
        return header_block, headers, bodies, bounced

    def grow(self, start: int, end: int) -> None:
        """Allocate the blocks of reserved records [start, end) (payloads and headers) before they are written.

        Why: ext4 serialises O_DIRECT writes that extend a file (4 threads writing new
        records measured 1.91 GB/s), while writes into allocated blocks run side by side
        (2.15 GB/s, as fast as 4 separate files). Where the filesystem cannot allocate
        ahead, records are written as before. Raises OSError when the disk is full.
        Called outside the tier's lock, by the writer that reserved the records.
        """
        if not self.preallocate:
            return
        try:
            os.posix_fallocate(self.fd, self.offset(start), self.offset(end) - self.offset(start))
            os.posix_fallocate(self.header_fd, self.header_offset(start), self.header_offset(end - start))
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
            self.preallocate = False
            logger.info("kvstrata disk tier: %s cannot allocate ahead (%s); new records are written as they come", self.path, exc.strerror)

    def truncate(self, records: int) -> None:
        """Cut both files to `records` records (giving back what was reserved beyond)."""
        os.ftruncate(self.fd, self.offset(records))
        os.ftruncate(self.header_fd, self.header_offset(records))

    def close(self) -> None:
        os.close(self.fd)
        os.close(self.header_fd)


def _open(path: Path, direct_io: bool) -> tuple[int, bool]:
    """A slab file, created 0600; a symlink or another user's file is `UnsafeFileError`."""
    flags = os.O_RDWR | os.O_CREAT
    if direct_io and hasattr(os, "O_DIRECT"):
        try:
            return open_private(path, flags | os.O_DIRECT), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            logger.info("kvstrata disk tier: %s does not support O_DIRECT; using buffered I/O", path.parent)
    return open_private(path, flags), False


def payload_alignment(payload_bytes: int) -> int:
    """Where a new slab for chunks of this size starts their payloads (see `PAYLOAD_ALIGNMENT`)."""
    return PAYLOAD_ALIGNMENT if payload_bytes >= ALIGNED_FROM_BYTES else SLOT_ALIGNMENT


def _payload_stride(payload_bytes: int, alignment: int) -> int:
    """Bytes from one payload's start to the next one's in a payload file."""
    return align_up(align_up(payload_bytes), alignment)


def record_disk_bytes(payload_bytes: int) -> int:
    """Disk bytes one chunk takes in a new slab (what `capacity` counts): its header and its payload's stride."""
    return HEADER_BYTES + _payload_stride(payload_bytes, payload_alignment(payload_bytes))


def _slab_name(namespace: str, payload_bytes: int, alignment: int) -> str:
    """`<namespace>-<payload bytes>[-a<alignment>].payloads` (the header file swaps the suffix)."""
    suffix = "" if alignment == SLOT_ALIGNMENT else f"-a{alignment}"
    return f"{check_namespace(namespace)}-{payload_bytes}{suffix}{PAYLOADS_SUFFIX}"


def _parse_slab_name(name: str) -> tuple[str, int, int] | None:
    """(namespace, payload bytes, alignment) of a payload file name, or None for other files."""
    stem = name.removesuffix(PAYLOADS_SUFFIX)
    alignment = SLOT_ALIGNMENT
    rest, _, last = stem.rpartition("-")
    if last.startswith("a") and last[1:].isdigit():
        alignment = int(last[1:])
        stem = rest
    namespace, _, size = stem.rpartition("-")
    if not namespace or not size.isdigit() or alignment < SLOT_ALIGNMENT or alignment % SLOT_ALIGNMENT:
        return None
    return namespace, int(size), alignment
