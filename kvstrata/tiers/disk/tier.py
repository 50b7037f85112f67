"""The disk tier's public class, `DiskTier`: what callers see, and the lock around it.

Owns: opening a directory as a tier (one store per directory, held by a lock file), the
public calls (lookups, `write_many` = `begin_write` + `land`, `start_reads`, `remove`,
`purge`, `stats`, `close`), the digest threads and spare buffers the data path uses, and
admission.

Invariants:
- Each call does its index part under the lock and its I/O outside it: records are
  allocated and marked busy before `writes`/`reads` touch them, and settled (indexed,
  freed or dropped, announced, counted) under the lock when their I/O is over.
- Disk full or I/O errors stop admission (logged once, counted); reads go on.
- A chunk removed has its header wiped, and a namespace purged has its files unlinked, so
  a restart does not bring them back.
- One record per key: a key is written only if it is neither indexed nor being written,
  and a write indexes nothing if its namespace was purged after it was queued or begun.

Must not touch: the files' layout (`slab.py`), payload bytes or digests (`reads.py`,
`writes.py`), or allocation and recovery beyond calling the index (`index.py`).
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvstrata.keys import key_name
from kvstrata.namespaces import check_namespace
from kvstrata.tiers.disk.index import SlabIndex
from kvstrata.tiers.disk.reads import read_batch
from kvstrata.tiers.disk.slab import _aligned_buffer, _Slab, record_disk_bytes
from kvstrata.tiers.disk.staging import DIGEST_THREADS, _SpareBuffers
from kvstrata.tiers.disk.writes import write_batch
from kvstrata.tiers.policies import make_policy
from kvstrata.tiers.private_files import UnsafeFileError, open_private
from kvstrata.tiers.records import HEADER_BYTES

logger = logging.getLogger(__package__)  # the tier logs under one name, "kvstrata.tiers.disk"

WRITE_RETRY_MAX_S = 30.0  # a tier whose writes fail tries again at least this often


class DiskTierError(RuntimeError):
    """The disk tier cannot be used as configured; the message names the path and reason."""


@dataclass
class DiskWrite:
    """A batch of writes begun (`DiskTier.begin_write`: its records taken and busy) and not
    landed yet; `land()` writes and settles it, and returns what `write_many` returns."""

    tier: DiskTier
    namespace: str
    items: list[tuple[bytes, np.ndarray]]
    payloads: list[np.ndarray]
    stored: list[bool]  # per item: on disk (already, or once landed)
    slab: _Slab | None = None
    todo: list[tuple[int, int]] = field(default_factory=list)  # (item index, record), by record
    grow: tuple[int, int] | None = None  # records [start, end) to allocate on disk first

    def land(self) -> list[bool]:
        return self.tier._land(self)


class DiskTier(SlabIndex):
    def __init__(
        self,
        root: str | os.PathLike[str],
        capacity: int,
        direct_io: bool = True,
        eviction_policy: str = "lru",
        on_change: Callable[[str, list[bytes], bool], None] | None = None,
        quotas: Mapping[str, int] | None = None,
        digests: Executor | None = None,
    ):
        """`digests`: where checksums run (default: `DIGEST_THREADS` threads of the tier's
        own); a disk call waits on them, so another executor must run each job it is given
        on its own (a thread pool, or inline as a deterministic test does)."""
        if capacity <= 0:
            raise DiskTierError(f"tiers.disk.capacity must be positive, got {capacity}")
        root = Path(root)
        try:
            root.mkdir(parents=True, exist_ok=True)
            self._dir_lock = open_private(root / ".kvstrata.lock", os.O_RDWR | os.O_CREAT)
        except UnsafeFileError as exc:
            raise DiskTierError(f"tiers.disk.path: {exc}") from None
        except OSError as exc:
            raise DiskTierError(f"tiers.disk.path: {root} is not a writable directory ({exc.strerror or exc})") from None
        try:
            # One store per directory: two would hand out the same records.
            fcntl.flock(self._dir_lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._dir_lock)
            raise DiskTierError(f"tiers.disk.path: {root} is in use by another kvstrata store") from None
        make_policy(eviction_policy)
        previous_holder = _claim_lock_file(self._dir_lock)
        self._digests = digests or ThreadPoolExecutor(DIGEST_THREADS, thread_name_prefix="kvstrata-disk-digest")
        self._spare = _SpareBuffers()
        self.admitting = True
        # After a failed write the tier stops admitting, then tries one batch again after
        # `_retry_s` (doubling while writes keep failing, up to WRITE_RETRY_MAX_S): a disk
        # that was full or read-only for a while comes back without a store restart.
        self._retry_s = 0.0
        self._retry_at = 0.0
        super().__init__(root, capacity, direct_io, eviction_policy, on_change, quotas)  # recovers what is on disk
        self.counters["lock_taken_over"] = int(previous_holder is not None)
        if previous_holder:
            logger.warning(
                "kvstrata disk tier: took over %s from a store that died without closing it (%s); 0 bytes freed, "
                "its records are served again", root, previous_holder,
            )  # fmt: skip

    # --- public ----------------------------------------------------------------------

    def namespaces(self) -> list[str]:
        with self._lock:
            return list(self._slabs)

    def set_anchor_groups(self, namespace: str, groups: list[int] | tuple[int, ...] | None) -> None:
        """The full-attention groups of a namespace (see `Positions`), once an engine knows them."""
        with self._lock:
            slab = self._slabs.get(namespace)
            if slab is not None:
                slab.positions.set_anchor_groups(groups)
            elif groups is not None:
                self._anchor_groups.setdefault(namespace, groups)

    def set_tenant(self, namespace: str, tenant: str) -> None:
        """The tenant (`namespace_prefix`) a namespace belongs to, for its quota (`TenantQuotas`)."""
        with self._lock:
            self.quotas.assign(namespace, tenant)

    def contains(self, namespace: str, key: bytes) -> bool:
        with self._lock:
            slab = self._slabs.get(namespace)
            return slab is not None and key in slab.index

    def present(self, namespace: str, keys: list[bytes]) -> set[bytes]:
        """Which of these chunks the tier holds (one look under the lock for a whole request)."""
        with self._lock:
            slab = self._slabs.get(namespace)
            return set() if slab is None else {key for key in keys if key in slab.index}

    def keys(self, namespace: str) -> list[bytes]:
        check_namespace(namespace)
        with self._lock:
            slab = self._slabs.get(namespace)
            return [] if slab is None else list(slab.index)

    def generation(self, namespace: str) -> int:
        """How many times the namespace was purged: a writer that notes it when it queues a
        write and hands it to `write_many` writes nothing if a purge came in between."""
        with self._lock:
            return self._generations.get(namespace, 0)

    def purge(self, namespace: str) -> int:
        """Forget every chunk of a namespace at once and for good; returns how many.

        The slab's files are unlinked and a later write starts a new slab: no header is
        wiped one by one (the last design took ~109 us per chunk, half a minute for 276k
        chunks, under the node store's lock), and a restart finds nothing. I/O in flight
        on the old slab goes on over its open files: reads are served only to callers that
        checked their own purge generation, writes land in nothing (nothing indexed, see
        `_land`); the files' space is given back when the last of it ends.
        """
        check_namespace(namespace)
        with self._lock:
            self._generations[namespace] = self._generations.get(namespace, 0) + 1
            slab = self._slabs.pop(namespace, None)
            if slab is None:
                return 0
            keys = list(slab.index)
            if slab.positions.anchor_groups is not None:
                self._anchor_groups.setdefault(namespace, tuple(slab.positions.anchor_groups))
            self._unlink(slab)
            self._notify(namespace, keys, False)
            self.counters["purged"] += len(keys)
            slab.retired = True
            self._retired.append(slab)
            if self._drained(slab):
                self._closing.append(slab)
        return len(keys)

    def close_purged(self) -> int:
        """Close the files of purged slabs whose I/O has ended; returns how many.

        Why apart from `purge`: closing the last handle of an unlinked file frees its blocks,
        which takes the filesystem a while for a large slab (52 ms for 160 MB here), and
        `purge` runs under its caller's lock (the node store's). Call it off that lock.
        """
        with self._lock:
            closing, self._closing = self._closing, []
        for slab in closing:
            self._close_retired(slab)
        return len(closing)

    def write(self, namespace: str, key: bytes, payload: np.ndarray) -> bool:
        """Store one chunk; False (counted) if it was not stored. Never raises on I/O errors."""
        return self.write_many(namespace, [(key, payload)])[0]

    def write_many(
        self, namespace: str, items: list[tuple[bytes, np.ndarray]], generation: int | None = None
    ) -> list[bool]:
        """Store chunks of one namespace; per chunk, whether it is on disk now.

        Records that are neighbours on disk go out in runs of up to `WRITE_RUN_BYTES`: one
        `pwritev` of their payloads, then one write of their headers. Small chunks then cost
        two system calls per run, not one or two each, and the next run is sealed while this
        one is written.

        `generation`: the namespace's `generation` when the caller decided to write (when it
        queued the job): if the namespace was purged since, nothing is written.
        """
        return self.begin_write(namespace, items, generation).land()

    def begin_write(
        self, namespace: str, items: list[tuple[bytes, np.ndarray]], generation: int | None = None
    ) -> DiskWrite:
        """The first half of `write_many`: take and mark busy the records of a batch (under
        the lock); its `land()` writes and settles them. Split so that a test or a simulation
        lands writes in any order; every write begun must land, once.

        One record per key, by construction: a key already on disk is only touched, and a
        key with a write in flight (`_Slab.writing`) is not written again (False: not on
        disk yet; the write in flight stands for it).
        """
        check_namespace(namespace)  # before any file is named after it
        payloads = [np.ascontiguousarray(p).view(np.uint8).reshape(-1) for _, p in items]
        write = DiskWrite(self, namespace, items, payloads, [False] * len(items))
        evicted: list[bytes] = []
        with self._lock:
            if generation is not None and generation != self._generations.get(namespace, 0):
                self.counters["dropped_purged"] += len(items)
                return write
            if not items or (not self.admitting and time.monotonic() < self._retry_at):
                self.counters["dropped_not_admitting"] += len(items)
                return write
            slab = write.slab = self._slab(namespace, payloads[0].nbytes)
            reserved_before = slab.reserved_end
            for (key, _), payload in zip(items, payloads):
                if payload.nbytes != slab.payload_bytes:
                    raise ValueError(
                        f"chunk {key_name(key)}: {payload.nbytes} bytes, namespace {namespace} holds {slab.payload_bytes}"
                    )
            new: list[int] = []
            taken: set[bytes] = set()
            for i, (key, _) in enumerate(items):
                record = slab.index.get(key)
                if record is not None:
                    slab.policy.touch(record)
                    write.stored[i] = True
                elif key in slab.writing or key in taken:
                    self.counters["duplicate_writes"] += 1
                else:
                    new.append(i)
                    taken.add(key)
            records = self._allocate(slab, len(new), evicted)
            self.counters["dropped_not_admitting"] += len(new) - len(records)
            write.todo = sorted(zip(new, records), key=lambda item: item[1])
            slab.busy.update(dict.fromkeys(records, 1))
            slab.writing.update((items[i][0], record) for i, record in write.todo)
            self._notify(namespace, evicted, False)
            # Records this batch reserved are allocated on disk before any is written.
            if write.todo and slab.reserved_end > reserved_before:
                write.grow = (reserved_before, slab.reserved_end)
                slab.growing += 1
        return write

    def _land(self, write: DiskWrite) -> list[bool]:
        """The second half of `write_many`: the I/O of a begun write, then its settling."""
        slab, todo, items, stored = write.slab, write.todo, write.items, write.stored
        if not todo:
            return stored
        failed = set(range(len(todo)))  # every record, unless the batch's I/O returns
        error = None
        try:
            failed, error = write_batch(
                slab, write.namespace, items, write.payloads, todo, self._spare, self._digests, write.grow
            )
        finally:
            with self._lock:
                slab.growing -= write.grow is not None
                # A purge retired the slab meanwhile: nothing of this write is indexed (its
                # files are gone; a restart cannot find it either).
                live = self._slabs.get(write.namespace) is slab
                written: list[bytes] = []
                for n, (i, record) in enumerate(todo):
                    key = items[i][0]
                    del slab.busy[record]
                    del slab.writing[key]
                    if n in failed or not live:
                        slab.free.append(record)
                        continue
                    slab.index[key] = record
                    slab.key_of[record] = key
                    slab.policy.add(record)
                    written.append(key)
                    stored[i] = True
                slab.positions.add_many(written)
                self._notify(write.namespace, written, True)
                self.counters["dropped_purged"] += 0 if live else len(todo) - len(failed)
                drained = self._drained(slab)
            if drained:
                self._close_retired(slab)
        with self._lock:
            self.counters["stored"] += len(written)
            if error is not None:
                self.counters["write_errors"] += 1
                self._retry_s = min(WRITE_RETRY_MAX_S, max(1.0, 2 * self._retry_s))
                self._retry_at = time.monotonic() + self._retry_s
                if self.admitting:
                    self.admitting = False
                    logger.error(
                        "kvstrata disk tier: writing %s failed (%s); not admitting chunks (trying again in "
                        "%.0fs, up to every %.0fs), still serving reads",
                        slab.path, error.strerror or error, self._retry_s, WRITE_RETRY_MAX_S,
                    )  # fmt: skip
            elif not self.admitting and len(todo) > len(failed):
                self.admitting, self._retry_s = True, 0.0
                self.counters["write_recoveries"] += 1
                logger.warning("kvstrata disk tier: writing %s works again; admitting chunks", slab.path)
        return stored

    def read_into(self, namespace: str, key: bytes, out: np.ndarray) -> bool:
        """Read and verify one chunk into `out`; False (a miss) if absent, unreadable or corrupt."""
        return self.read_many(namespace, [(key, out)])[0]

    def read_many(self, namespace: str, items: list[tuple[bytes, np.ndarray]]) -> list[bool]:
        """Read and verify chunks into their buffers; per chunk, whether it is there now.

        A chunk that fails (absent, unreadable, corrupt) is a miss; a failed one is dropped
        from the index. The buffer of a failed chunk holds garbage and must not be used.
        """
        return self.start_reads(namespace, items).result()

    def start_reads(self, namespace: str, items: list[tuple[bytes, np.ndarray]]) -> Future[list[bool]]:
        """Read chunks into their buffers on the calling thread; verify them on the digest threads.

        Returns when the last read has returned, with a future of what `read_many` returns,
        done once every piece is verified; the buffers are not to be touched before. Why:
        an I/O thread that waited for its batch's last digests (and its caller's bookkeeping)
        before taking the next batch left the disk idle in between (measured at 256 KiB
        chunks, 64 MiB batches, 4 threads: 7-24 ms per thread per batch, with the disk moving
        ~3 GB/s).

        The batch's headers are read first; then neighbouring payloads in contiguous pieces of
        up to `READ_RUN_BYTES` (a piece may end inside a record), each verified on the digest
        threads while the next one is read.
        """
        outs = [out.view(np.uint8).reshape(-1) for _, out in items]
        todo: list[tuple[int, int]] = []  # (item index, record)
        with self._lock:
            slab = self._slabs.get(namespace)
            for i, (key, _) in enumerate(items):
                record = None if slab is None else slab.index.get(key)
                if record is None:
                    continue
                if outs[i].nbytes < slab.payload_bytes:
                    self._unbusy(slab, [record for _, record in todo])
                    raise ValueError(
                        f"buffer of {outs[i].nbytes} bytes cannot hold chunk {key_name(key)} ({slab.payload_bytes} bytes)"
                    )
                slab.busy[record] = slab.busy.get(record, 0) + 1
                slab.policy.touch(record)
                todo.append((i, record))
        if not todo:
            result: Future[list[bool]] = Future()
            result.set_result([False] * len(items))
            return result
        todo.sort(key=lambda item: item[1])

        def release() -> None:
            with self._lock:
                self._unbusy(slab, [record for _, record in todo])
                drained = self._drained(slab)
            if drained:
                self._close_retired(slab)

        return read_batch(
            slab, namespace, items, outs, todo, self._spare, self._digests,
            settle=lambda verified, corrupt, errors: self._settle_reads(slab, items, todo, verified, corrupt, errors),
            release=release,
        )  # fmt: skip

    def remove(self, namespace: str, key: bytes) -> bool:
        """Forget a chunk for good: its header is wiped so a restart does not bring it back."""
        check_namespace(namespace)
        with self._lock:
            slab = self._slabs.get(namespace)
            record = None if slab is None else slab.index.get(key)
            if record is None or record in slab.busy:
                return False
            try:
                os.pwrite(slab.header_fd, _aligned_buffer(HEADER_BYTES), slab.header_offset(record))
            except OSError as exc:
                logger.warning("kvstrata disk tier: could not wipe the record of %s: %s", key_name(key), exc)
            self._drop(slab, key, record)
            self._notify(namespace, [key], False)
        return True

    def stats(self) -> dict[str, object]:
        with self._lock:
            return {
                "path": str(self.root),
                "capacity": self.capacity,
                "allocated": self._allocated,  # record space set aside in the slab files
                "tenants": self.quotas.usage(),  # allocated bytes per tenant, against its quota
                # bytes the resident records take (what status calls `used`)
                "stored_bytes": sum(len(slab.index) * record_disk_bytes(slab.payload_bytes) for slab in self._slabs.values()),
                "admitting": self.admitting,
                "direct_io": {ns: slab.direct for ns, slab in self._slabs.items()},
                "resident": {ns: len(slab.index) for ns, slab in self._slabs.items()},
                **self.counters,
            }

    def close(self) -> None:
        """Close the files (their records stay on disk for the next store) and free the directory.

        Callers stop their own I/O first; the digest threads finish what they were given.
        """
        self._digests.shutdown(wait=True)
        self.close_purged()
        with self._lock:
            for slab in [*self._slabs.values(), *self._retired]:
                slab.close()
            self._slabs.clear()
            self._retired.clear()
            if self._dir_lock >= 0:
                os.ftruncate(self._dir_lock, 0)  # an empty lock file: its last store closed it
                os.close(self._dir_lock)
                self._dir_lock = -1


def _claim_lock_file(fd: int) -> str | None:
    """Write this store into the directory's lock file (whose flock it holds); returns the
    previous holder it names, or None if the last store closed the directory cleanly.

    Why: the flock itself is the kernel's and dies with its store, so a dead store never
    keeps a directory from the next one; what is written here only lets the next store say
    that it took over from a store that died (logged, counted as `lock_taken_over`).
    """
    previous = os.pread(fd, 512, 0).decode(errors="replace").strip()
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    return previous or None
