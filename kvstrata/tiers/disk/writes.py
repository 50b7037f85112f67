"""The disk tier's writes: a batch of new records sealed and written in runs of neighbours.

Owns: cutting a batch's records into runs that are neighbours on disk (the first short,
each next one twice as long, up to `WRITE_RUN_BYTES`), sealing each run's headers (and
copying payloads that cannot go out as they are into staging) on the digest threads one
run ahead, and writing each run's payloads in one `pwritev`, then its headers in one call.

Invariants:
- A run's payloads are written before its headers: a crash in between leaves old headers
  over new payloads, which fail their digests. A header is never written before its payload.
- A record counts as written only once its run's headers are on disk. After an I/O error
  nothing more of the batch is written.
- Nothing touches a batch's staging memory once `write_batch` has returned or raised.

Must not touch: the index, the tier's lock, its counters or admission: the tier settles
what `write_batch` returns. It writes only the records it is given.
"""

from __future__ import annotations

import mmap
from concurrent.futures import Executor, Future

import numpy as np

from kvstrata.tiers.disk.slab import MAX_RUN, _runs, _Slab, _write_fully
from kvstrata.tiers.disk.staging import _SpareBuffers, _wait_all, _wait_all_quietly
from kvstrata.tiers.records import HEADER_BYTES, seal_header

WRITE_RUN_BYTES = 32 << 20
FIRST_WRITE_RUN_BYTES = 1 << 20


def _per_run(slab: _Slab, run_bytes: int) -> int:
    """Records per write run: neighbours share a call only where they touch on disk."""
    return max(1, min(MAX_RUN, run_bytes // slab.body_bytes)) if slab.packed else 1


def write_batch(
    slab: _Slab,
    namespace: str,
    items: list[tuple[bytes, np.ndarray]],
    payloads: list[np.ndarray],
    todo: list[tuple[int, int]],
    spare: _SpareBuffers,
    digest_threads: Executor,
    grow: tuple[int, int] | None,
) -> tuple[set[int], OSError | None]:
    """Seal and write the records of `todo` ((item index, record), sorted by record, each
    allocated to this batch and marked busy) from `payloads`: the calling thread writes,
    `digest_threads` seal.

    With `grow`, the reserved records [start, end) are allocated on disk first. Returns the
    batch positions that are not on disk, and the I/O error that stopped the batch, if any.
    On any other exception (a bug) it waits for its seals, gives its staging back and
    raises: every record of the batch is then the caller's to give back.
    """
    error: OSError | None = None
    sealed: list[Future] = []
    lent: list[mmap.mmap] = []
    runs: list[tuple[int, int]] = []
    written_runs: list[int] = []  # runs whose payloads and headers are both on disk
    try:
        header_block, headers, bodies, bounced = slab.stage(
            [payloads[i] for i, _ in todo], lambda size: spare.lend(size, lent)
        )

        def seal(start: int, end: int) -> None:
            for n in range(start, end):
                i = todo[n][0]
                payload = payloads[i]
                seal_header(headers[n], namespace, items[i][0], payload)
                if bounced[n]:
                    bodies[n][: payload.nbytes] = payload
                    bodies[n][payload.nbytes :] = 0

        def write_headers(run: int) -> None:
            start, end = runs[run]
            sealed[run].result()
            block = header_block[start * HEADER_BYTES : end * HEADER_BYTES]
            _write_fully(slab.header_fd, [block], slab.header_offset(todo[start][1]))
            written_runs.append(run)

        # The first run is short and each doubles: a first run of staged records waits
        # for its seal (which copies it), and every later seal hides behind the write before it.
        runs = _runs(
            [record for _, record in todo],
            _per_run(slab, WRITE_RUN_BYTES),
            first_records=_per_run(slab, FIRST_WRITE_RUN_BYTES),
        )
        # One run sealed ahead: queued all at once, one job's first run would wait behind
        # every run of the jobs before it (measured: 40-60 ms per job at 256 KiB chunks).
        sealed.append(digest_threads.submit(seal, *runs[0]))
        behind: int | None = None  # the run whose payloads are on disk and headers not yet
        try:
            if grow is not None:
                slab.grow(*grow)  # the disk is full: nothing of this batch is written
            for n_run, (start, end) in enumerate(runs):
                if n_run + 1 < len(runs):
                    sealed.append(digest_threads.submit(seal, *runs[n_run + 1]))
                if any(bounced[start:end]):
                    sealed[n_run].result()  # the seal copies these payloads into staging
                try:
                    iovecs = [memoryview(bodies[n]) for n in range(start, end)]
                    _write_fully(slab.fd, iovecs, slab.offset(todo[start][1]))
                finally:
                    # The headers of a run go out after the payloads of the next: the disk
                    # does not wait for a digest still queued behind other jobs' seals
                    # (measured at 256 KiB chunks: a job's first seal came 5-26 ms late).
                    if behind is not None:
                        write_headers(behind)
                behind = n_run
            write_headers(behind)
        except OSError as exc:  # the disk is full or failing: the rest of the batch is not written
            error = exc
        _wait_all(sealed)  # nothing touches the staging buffers once we return
    except BaseException:  # a bug, not an I/O error: the caller gives every record back
        _wait_all_quietly(sealed)
        raise
    finally:
        spare.give(lent)
    return set(range(len(todo))).difference(*(range(*runs[run]) for run in written_runs)), error
