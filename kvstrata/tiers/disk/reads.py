"""The disk tier's reads: how a batch is cut into reads, and how every byte is verified.

Owns: planning a batch's payload reads as bounded, aligned pieces (`_read_pieces`);
reading its headers and pieces on the calling I/O thread; checking each piece on the
digest threads while the next one is read; copying staged payloads out once verified.

Invariants:
- Every read is verified against the digest in its header (and the key and namespace).
  A record is good only at its last byte: a mismatch, a short read or a verification
  that fails to run is never served; it is a miss, settled by the index.
- A record's pieces are hashed in order: each piece's check waits for the one before,
  queued first on a FIFO pool. A read error is recorded before its piece's check is queued.
- The batch is settled (`settle`) on the digest thread that verifies its last piece, after
  its staging memory is given back; the I/O thread has already moved on.

Must not touch: the index or the tier's lock (the tier passes `settle` and `release`),
nor any record outside the batch it is given.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable
from concurrent.futures import Executor, Future

import numpy as np

from kvstrata.keys import align_down
from kvstrata.tiers.disk.slab import MAX_RUN, _read, _runs, _Slab
from kvstrata.tiers.disk.staging import _SpareBuffers, _wait_all_quietly
from kvstrata.tiers.records import HEADER_BYTES, payload_hasher, recorded_digest

# Bytes one pwritev/preadv moves at most (at least one record). Reads then keep a few
# requests queued per thread instead of hundreds (measured with 4 threads on this VM's
# disk: reads went from 1.5-1.8 to 2.0-2.4 GB/s at 1-8 MiB chunks, rotated A/B rounds),
# and the digests of the next run are computed while this one is on its way.
READ_RUN_BYTES = 8 << 20
# A batch's last reads halve down to about this size: the I/O thread waits for the digest
# of its last read before it takes its next job, and that digest should be short
# (measured at 32 MiB chunks: waiting for whole-record digests cost ~10% of read speed).
LAST_READ_BYTES = 1 << 20


Segment = tuple[int, int, int]  # (index in the batch, first byte, end byte) of one record


def _read_pieces(
    records: list[int], record_bytes: int, piece_bytes: int, last_bytes: int, packed: bool = True
) -> list[list[Segment]]:
    """How to read sorted `records`: contiguous byte ranges of at most `piece_bytes` (and
    `MAX_RUN` records), each given as the segments of the records it covers. Only a
    `packed` slab's neighbouring records touch on disk; otherwise a range stays in one record.

    A range may end inside a record (its digest is then fed piece by piece), and the last
    ranges halve down to `last_bytes`, so the digest left to compute after the last read
    is short. A range never leaves less than `last_bytes` of a record to the next one: an
    8 MiB record and its 4 KiB header were read as 8 MiB, then a 4 KiB call of its own.
    Every boundary stays 4 KiB aligned, as O_DIRECT requires.
    """
    pieces: list[list[Segment]] = []
    remaining = len(records) * record_bytes
    n, first = 0, 0  # the next byte to read: `first` of record n
    while n < len(records):
        size = remaining if remaining < 2 * last_bytes else max(last_bytes, align_down(remaining // 2))
        size = min(size, piece_bytes)
        piece: list[Segment] = []
        while size > 0 and n < len(records) and len(piece) < MAX_RUN:
            if piece and (not packed or records[n] != records[n - 1] + 1):
                break  # not touching on disk: the next range starts there
            end = min(record_bytes, first + size)
            if record_bytes - end < last_bytes:
                end = record_bytes
            piece.append((n, first, end))
            size -= end - first
            remaining -= end - first
            n, first = (n + 1, 0) if end == record_bytes else (n, end)
        pieces.append(piece)
    return pieces


def read_batch(
    slab: _Slab,
    namespace: str,
    items: list[tuple[bytes, np.ndarray]],
    outs: list[np.ndarray],
    todo: list[tuple[int, int]],
    spare: _SpareBuffers,
    digest_threads: Executor,
    settle: Callable[[set[int], set[int], dict[int, str]], list[bool]],
    release: Callable[[], None],
) -> Future[list[bool]]:
    """Read the records of `todo` ((item index, record), sorted by record, each marked busy)
    into `outs` on the calling thread; verify them on `digest_threads`.

    The batch's headers are read first, one call per run of neighbours; then the payloads,
    in the pieces `_read_pieces` plans, each verified while the next one is read. Returns
    when the last read has returned, with a future of `settle(verified, corrupt, errors)`
    (batch positions), called once every piece is verified. On an exception (a bug, not an
    I/O error), `release()` is called once nothing touches the buffers, then it propagates.
    """
    result: Future[list[bool]] = Future()
    lent: list[mmap.mmap] = []
    header_block, headers, bodies, bounced = slab.stage(
        [outs[i] for i, _ in todo], lambda size: spare.lend(size, lent)
    )
    errors: dict[int, str] = {}  # written before the verification of the piece that failed is queued
    corrupt: set[int] = set()
    verified: set[int] = set()
    digests: dict[int, tuple[bytes, object]] = {}  # record -> (digest on disk, digest so far)

    def verify(piece: list[Segment], previous: Future | None) -> None:
        """Check one piece's records as far as it reaches; a record is good at its last byte."""
        if previous is not None:
            # The pieces of a record are hashed in order. The previous piece was queued
            # first (the pool is FIFO), so it is running or done: this wait ends.
            previous.exception()
        try:
            for n, first, end in piece:
                if n in errors or n in corrupt:
                    continue
                key = items[todo[n][0]][0]
                if first == 0:
                    recorded = recorded_digest(headers[n], namespace, key, slab.payload_bytes)
                    if recorded is None:
                        corrupt.add(n)
                        continue
                    digests[n] = (recorded, payload_hasher(namespace, key))
                expected, hasher = digests[n]
                if first < slab.payload_bytes:  # the padding after the payload is not hashed
                    hasher.update(bodies[n][first : min(end, slab.payload_bytes)])
                if end < slab.body_bytes:
                    continue
                del digests[n]
                if hasher.digest() != expected:
                    corrupt.add(n)
                    continue
                if bounced[n]:
                    outs[todo[n][0]][: slab.payload_bytes] = bodies[n][: slab.payload_bytes]
                verified.add(n)
        except Exception as exc:  # noqa: BLE001 - never served unverified: a miss, logged below
            for n, _, _ in piece:
                errors.setdefault(n, f"not verified ({exc!r})")

    def finish() -> None:
        """Runs once the last piece is verified (on that digest thread)."""
        spare.give(lent)
        try:
            result.set_result(settle(verified, corrupt, errors))
        except BaseException as exc:  # noqa: BLE001 - the caller's future carries it
            result.set_exception(exc)

    checks: list[Future] = []
    records = [record for _, record in todo]
    try:
        # Headers first, one call per run of neighbours: the digest threads check each
        # record's header when its first piece has landed.
        for start, end in _runs(records):
            block = header_block[start * HEADER_BYTES : end * HEADER_BYTES]
            got, reason = _read(slab.header_fd, [block], slab.header_offset(records[start]))
            for n in range(start + got // HEADER_BYTES, end):
                errors.setdefault(n, reason)
        for piece in _read_pieces(records, slab.body_bytes, READ_RUN_BYTES, LAST_READ_BYTES, slab.packed):
            iovecs = [memoryview(bodies[n])[first:end] for n, first, end in piece]
            n, first, _ = piece[0]
            got, reason = _read(slab.fd, iovecs, slab.offset(records[n]) + first)
            # A record cut short (a torn tail) fails alone, not with its whole piece.
            for n, first, end in piece:
                got -= end - first
                if got < 0:
                    errors.setdefault(n, reason)
            checks.append(digest_threads.submit(verify, piece, checks[-1] if checks else None))
    except BaseException as exc:  # a bug, not an I/O error: the records stay, the caller gets the error
        _wait_all_quietly(checks)  # nothing touches the buffers once we return
        spare.give(lent)
        release()
        result.set_exception(exc)
        raise
    # The pieces are chained: the last one is verified after all the others.
    checks[-1].add_done_callback(lambda _: finish())
    return result
