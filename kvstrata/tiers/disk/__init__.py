"""The local-disk tier: fixed-size records in one payload file and one header file per namespace.

Why this layout (rather than one file per chunk): a chunk store or eviction is a
positioned write into a preallocated record, with no file creation, rename or
directory update, so the tier is bounded by construction and its metadata cost does
not grow with the number of chunks.

Why headers in a file of their own: a run of neighbouring records then goes out as one
`pwritev` of payloads alone and one write of their headers, instead of one call
alternating 4 KiB headers and payloads. Measured on this VM's disk (O_DIRECT, same
bytes, `benchmarks/iovec_shape.py`): headers between payloads wrote 256 KiB chunks at
0.91-0.94x one call per chunk, 1 MiB at 0.74-0.82x; payloads with their headers in a
second file at 1.09-1.15x and 1.06-1.11x.

Invariants:
- Record r's payload is at r * stride of `<namespace>-<bytes>[-a<alignment>].payloads`,
  its 4 KiB header at r * 4 KiB of the `.headers` file beside it. Payloads of chunks under
  1 MiB are packed; larger ones start on 64 KiB boundaries (the `-a65536` in the name).
  The header names the key, the namespace and the payload length, and carries an
  xxh3-128 digest of namespace ‖ key ‖ payload.
- A run's payloads are written before its headers (O_DIRECT where the filesystem supports
  it, buffered otherwise): a crash in between leaves old headers over new payloads, which
  fail their digests. A header is never written before its payload.
- Every read is verified against that digest (and the key and namespace). A mismatch
  (a flipped bit, a torn write) is never served: it is a miss, a counter and a
  quarantine of the record.
- The index lives in memory and is rebuilt at start-up from the header files, so a store
  restarted after a crash, or after a reboot, serves what is on disk. A record torn by
  a crash fails its digest on first read and is dropped then. Slab files of the earlier
  one-file layout (`.slab`) are removed at start-up, with one log line.
- Allocated records (payload and header) never exceed `capacity` bytes; LRU records make
  room. Records with an I/O in flight are never evicted or reused.
- Disk full or I/O errors stop admission (logged once, counted); reads go on.
- Digests are computed and checked on the tier's own digest threads, one run of records
  at a time, while the calling I/O thread moves the next run: the disk never waits on a
  checksum (measured: verifying on the I/O thread cost 10-15% of read and rewrite speed).
  A read batch is settled on the digest thread that verifies its last piece
  (`start_reads`), while its I/O thread already reads the next batch.

No Ray and no vLLM in here; calls may come from several I/O threads.

The package: issue #23 split the one module of 964 lines by responsibility, with no
change of behaviour. Each module imports only those before it in this list:
- `slab`: a slab's files: record layout, file names, opening, growing and cutting them,
  staging a batch's memory, the one-call preadv/pwritev helpers.
- `staging`: the digest thread count, aligned buffers lent per batch, waiting for jobs.
- `index`: `SlabIndex`: which chunk is in which record, allocation within capacity,
  eviction, announcements, counters, recovery at start-up.
- `reads`: a batch's reads cut into pieces and verified on the digest threads.
- `writes`: a batch's records sealed and written in runs, payloads before headers.
- `tier`: `DiskTier`, the public calls.

Why these seams: the index's state (the lock, the slabs, the capacity accounting, the
counters) is shared by every call, so it is one class, which `DiskTier` builds on. The
data path shares none of it: `read_batch` and `write_batch` work on one slab and one
batch outside the lock, and hand back what happened for the tier to settle under the
lock. Why a package rather than sibling `disk_*.py` modules: `kvstrata.tiers.disk` stays
the one name to import and the one logger name ("kvstrata.tiers.disk") it always was,
and the pieces read as parts of one tier.

Re-exported here: the names imported from `kvstrata.tiers.disk` before the split. The
tunables (`READ_RUN_BYTES`, `GROW_MIN_BYTES`, ...) are not: each lives in the module that
reads it, and is patched there.
"""

from kvstrata.tiers.disk.slab import HEADERS_SUFFIX, PAYLOADS_SUFFIX, payload_alignment, record_disk_bytes
from kvstrata.tiers.disk.staging import DIGEST_THREADS
from kvstrata.tiers.disk.tier import DiskTier, DiskTierError
from kvstrata.tiers.records import HEADER_BYTES

__all__ = [
    "DIGEST_THREADS",
    "HEADER_BYTES",
    "HEADERS_SUFFIX",
    "PAYLOADS_SUFFIX",
    "DiskTier",
    "DiskTierError",
    "payload_alignment",
    "record_disk_bytes",
]
