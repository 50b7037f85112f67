"""The disk tier's index: which chunk is in which record, allocation, eviction and recovery.

Owns: the open slabs of each namespace and, in each, the key of every record, the free
records, the records with an I/O in flight (`busy`), the keys being written (`writing`)
and the eviction order; each namespace's purge generation and the purged slabs whose I/O
is still in flight (closed when it ends); the disk bytes allocated against `capacity`; the tier's counters; the announcements of index
changes (`on_change`); rebuilding all of it from the header files at start-up.

Invariants:
- `_lock` guards everything here. The methods that do not take it themselves are called
  with it held (or from `__init__`, before any other thread knows the tier).
- Allocated records (payload and header) never exceed `capacity` bytes; evicted records make
  room (oldest first; with `reuse_of` set, the least reused of the oldest few first;
  with a retention table in use, retained records after all others, at O(1) per record
  read whatever is retained: tiers/retention_order.py).
  Records with an I/O in flight are never evicted or reused.
- A tenant's slabs never grow past its quota (`kvstrata.tiers.quotas`): at it a slab
  evicts its own records, never another tenant's.
- Every index change is announced while the lock is held, in the order of the changes.
- At start-up the index is what the header files say; a record whose header does not
  parse, or names another namespace or a key seen before, is free. Slab files of the
  one-file layout are removed, with one log line.

Must not touch: payload bytes, digests or the data path's threads (`reads.py`,
`writes.py`). Besides opening slabs, it reads only headers, at start-up, and changes
files only to give back reservations or to remove slab files of the one-file layout.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import numpy as np

from kvstrata.keys import key_name
from kvstrata.tiers.disk.damaged import log_set_aside, set_aside, unusable_reason
from kvstrata.tiers.disk.slab import (
    HEADERS_SUFFIX,
    OLD_SLAB_SUFFIX,
    PAYLOADS_SUFFIX,
    _aligned_buffer,
    _parse_slab_name,
    _read,
    _Slab,
    _slab_name,
    payload_alignment,
)
from kvstrata.tiers.policies import make_policy
from kvstrata.tiers.quotas import TenantQuotas
from kvstrata.tiers.records import HEADER_BYTES, RecordHeader
from kvstrata.tiers.reuse_eviction import REUSE_EVICTION_WINDOW  # noqa: F401 - tests read it here
from kvstrata.tiers.retention import RetentionTable
from kvstrata.tiers.retention_order import RetentionOrder
from kvstrata.tiers.reuse_eviction import ReuseOf, least_reused_first

logger = logging.getLogger(__package__)  # the tier logs under one name, "kvstrata.tiers.disk"

RECOVERY_READ_BYTES = 4 << 20  # headers read per call at start-up
# A slab's file grows by a quarter of its size, within these bounds (and the capacity).
GROW_MIN_BYTES = 1 << 30
GROW_MAX_BYTES = 8 << 30


class SlabIndex:
    """The records of every namespace on disk and their accounting, behind one lock.

    The base of `DiskTier`: the data path (`reads.py`, `writes.py`) moves bytes outside
    the lock, and the tier settles what it did here, under the lock.
    """

    def __init__(
        self,
        root: Path,
        capacity: int,
        direct_io: bool,
        eviction_policy: str,
        on_change: Callable[[str, list[bytes], bool], None] | None,
        quotas: Mapping[str, int] | None = None,
    ):
        """An index of what `root` holds (its directory is created and locked by the caller)."""
        self.root = root
        self.capacity = capacity
        self.direct_io = direct_io
        self.eviction_policy = eviction_policy
        self.on_change = on_change
        # (namespace, keys) -> each key's estimated recent uses; set by the node store when
        # it keeps a reuse sketch (admission.store: reuse), so evictions prefer one-offs.
        self.reuse_of: ReuseOf | None = None
        # kv.retain hints (tiers/retention.py), set by `use_retention`: retained records are
        # evicted after every unretained one, lowest priority first.
        self.retention: RetentionTable | None = None
        self._lock = threading.Lock()
        self._slabs: dict[str, _Slab] = {}
        self._anchor_groups: dict[str, list[int] | tuple[int, ...] | None] = {}  # for slabs not open yet
        self._generations: dict[str, int] = {}  # namespace -> purges so far (`DiskTier.purge`)
        self._retired: list[_Slab] = []  # purged slabs with I/O still in flight
        self._closing: list[_Slab] = []  # purged slabs with none, for `close_purged`
        self._allocated = 0
        # Allocated bytes per tenant: a slab at its tenant's quota evicts its own records.
        self.quotas = TenantQuotas(quotas)
        self.counters = {
            "stored": 0,
            "read": 0,
            "evicted": 0,
            "evicted_with_anchor": 0,
            "corrupt_chunks": 0,
            "write_errors": 0,
            "read_errors": 0,
            "dropped_not_admitting": 0,
            "write_recoveries": 0,  # failed writes, then a batch that worked: admitting again
            "damaged_files": 0,  # set aside into damaged/ at start-up (damaged.py)
            "damaged_records": 0,  # headers found unreadable at start-up: free records now
            "purged": 0,  # chunks forgotten by purges
            "dropped_purged": 0,  # chunks not written (or not indexed): their namespace was purged since
            "duplicate_writes": 0,  # chunks not written: a write of the same key was in flight
        }
        self._recover()

    def _settle_reads(
        self,
        slab: _Slab,
        items: list[tuple[bytes, np.ndarray]],
        todo: list[tuple[int, int]],
        verified: set[int],
        corrupt: set[int],
        errors: dict[int, str],
    ) -> list[bool]:
        """Count a read batch, drop the records that failed, and say which chunks arrived."""
        ok = [False] * len(items)
        for n, (i, _) in enumerate(todo):
            ok[i] = n in verified and n not in errors
        reasons: dict[str, list[bytes]] = {}
        with self._lock:
            self._unbusy(slab, [record for _, record in todo])
            for n, (i, record) in enumerate(todo):
                key = items[i][0]
                if ok[i]:
                    self.counters["read"] += 1
                elif slab.index.get(key) == record and not slab.retired:
                    self.counters["corrupt_chunks" if n in corrupt else "read_errors"] += 1
                    self._drop(slab, key, record)
                    reasons.setdefault(f"unreadable ({errors[n]})" if n in errors else "failed their checksum", []).append(key)
            for keys in reasons.values():
                self._notify(slab.namespace, keys, False)
            drained = self._drained(slab)
        if drained:
            self._close_retired(slab)
        for reason, keys in reasons.items():  # one line per batch and reason, not per chunk
            logger.warning(
                "kvstrata disk tier: %d chunks of namespace %s %s, e.g. %s; dropped (misses)",
                len(keys), slab.namespace, reason, key_name(keys[0]),
            )  # fmt: skip
        return ok

    def _reserve(self, slab: _Slab) -> bool:
        """Reserve the slab's next records on disk: a quarter of its size, within capacity.

        Reserved records count against `capacity` (they are blocks on disk). Growing
        ahead in steps of 1/4 of the slab (`GROW_MIN_BYTES` to `GROW_MAX_BYTES`) keeps
        allocations rare: each one waits for every write in flight to the file (measured:
        up to 73 ms per allocation at 32 MiB chunks). Another slab's unused reservation
        is given back before this one is refused. Callers hold the lock.
        """
        if self._allocated + slab.record_cost > self.capacity:
            self._reclaim_reserved(slab)
        room = self.quotas.room(slab.namespace)
        if room is not None and room < slab.record_cost:  # the tenant's own spare reservations first
            self._reclaim_reserved(slab, tenant=self.quotas.tenant(slab.namespace))
            room = self.quotas.room(slab.namespace)
        spare = (self.capacity - self._allocated) // slab.record_cost
        if room is not None:
            spare = min(spare, room // slab.record_cost)
        if spare < 1:
            return False
        step = min(max(GROW_MIN_BYTES, slab.reserved_end * slab.record_cost // 4), GROW_MAX_BYTES)
        extra = min(spare, max(1, step // slab.record_cost))
        slab.reserved_end += extra
        self._allocated += extra * slab.record_cost
        self.quotas.charge(slab.namespace, extra * slab.record_cost)
        return True

    def _reclaim_reserved(self, asking: _Slab, tenant: str | None = None) -> None:
        """Give back the never-used records other slabs reserved (truncating their files);
        with `tenant`, only that tenant's slabs'."""
        for slab in self._slabs.values():
            unused = slab.reserved_end - slab.num_records
            if slab is asking or unused <= 0 or slab.growing:
                continue
            if tenant is not None and self.quotas.tenant(slab.namespace) != tenant:
                continue
            try:
                slab.truncate(slab.num_records)
            except OSError as exc:
                logger.warning("kvstrata disk tier: could not give back reserved space of %s: %s", slab.path, exc)
                continue
            slab.reserved_end = slab.num_records
            self._allocated -= unused * slab.record_cost
            self.quotas.charge(slab.namespace, -unused * slab.record_cost)
            logger.info(
                "kvstrata disk tier: %d reserved records of namespace %s given back for namespace %s",
                unused, slab.namespace, asking.namespace,
            )  # fmt: skip

    def _drained(self, slab: _Slab) -> bool:
        """Whether a purged slab's last I/O just ended: the caller closes it, outside the lock
        (callers hold the lock)."""
        if slab.retired and not slab.busy and slab in self._retired:
            self._retired.remove(slab)
            return True
        return False

    def _close_retired(self, slab: _Slab) -> None:
        """Close a purged slab's files (their names are gone: the space is freed now) and stop
        counting them against `capacity`."""
        slab.close()
        with self._lock:
            self._allocated -= slab.reserved_end * slab.record_cost
            self.quotas.charge(slab.namespace, -slab.reserved_end * slab.record_cost)

    @staticmethod
    def _unlink(slab: _Slab) -> None:
        """Remove a purged slab's file names; its open files live on until closed (callers
        hold the lock). A name that cannot go (a read-only filesystem, where writes fail
        too) is logged: a restart would find its chunks again."""
        for path in (slab.path, slab.header_path):
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:
                logger.error("kvstrata disk tier: a purge could not remove %s (%s)", path, exc.strerror or exc)

    @staticmethod
    def _unbusy(slab: _Slab, records: list[int]) -> None:
        """One I/O operation on each of these records is over (callers hold the lock)."""
        for record in records:
            slab.busy[record] -= 1
            if not slab.busy[record]:
                del slab.busy[record]


    def _notify(self, namespace: str, keys: list[bytes], present: bool) -> None:
        """Announce an index change; callers hold the lock, so announcements (into the store's
        change log) keep the order of the changes: a write's announcement made after the
        lock was let go could land after a later eviction's and leave a chunk listed that
        the disk no longer holds."""
        if self.on_change is not None and keys:
            self.on_change(namespace, keys, present)

    def use_retention(self, table: RetentionTable) -> None:
        """Evict retained records last from now on: every slab's order is wrapped (its records
        already retained move behind), and the table tells this index of each change."""
        with self._lock:
            if self.retention is not None:
                return
            self.retention = table
            for slab in self._slabs.values():
                self._wrap(slab)
                for record in list(slab.key_of):
                    slab.policy.refresh(record)
        table.listeners.append(self.retention_changed)

    def retention_changed(self, namespace: str, keys: list[bytes]) -> None:
        """The retention of `keys` changed (a table listener; called outside the table's lock)."""
        with self._lock:
            slab = self._slabs.get(namespace)
            if slab is None or not isinstance(slab.policy, RetentionOrder):
                return
            for key in keys:
                record = slab.index.get(key)
                if record is not None:
                    slab.policy.refresh(record)

    def _wrap(self, slab: _Slab) -> None:
        table, namespace = self.retention, slab.namespace
        if table is not None and not isinstance(slab.policy, RetentionOrder):
            slab.policy = RetentionOrder(slab.policy, slab.key_of.get, lambda key: table.entry(namespace, key), table.clock)

    def _slab(self, namespace: str, payload_bytes: int, alignment: int | None = None) -> _Slab:
        slab = self._slabs.get(namespace)
        if slab is None:
            alignment = payload_alignment(payload_bytes) if alignment is None else alignment
            path = self.root / _slab_name(namespace, payload_bytes, alignment)
            slab = _Slab(path, namespace, payload_bytes, alignment, self.direct_io, make_policy(self.eviction_policy))
            self._wrap(slab)
            slab.positions.set_anchor_groups(self._anchor_groups.pop(namespace, None))
            self._slabs[namespace] = slab
        elif slab.payload_bytes != payload_bytes:
            raise ValueError(
                f"namespace {namespace}: chunk of {payload_bytes} bytes, the disk slab holds {slab.payload_bytes}-byte chunks"
            )
        return slab

    def _allocate(self, slab: _Slab, count: int, evicted: list[bytes]) -> list[int]:
        """Up to `count` records to write: free ones, then new ones within capacity, then LRU
        records evicted (with their dependents); the keys evicted are added to `evicted`, for
        the caller to announce under the lock. One pass for a whole batch: record by record,
        allocation was a third of a write's Python time at 256 KiB chunks."""
        records = slab.free[max(0, len(slab.free) - count) :]
        del slab.free[len(slab.free) - len(records) :]
        while len(records) < count and (slab.num_records < slab.reserved_end or self._reserve(slab)):
            end = min(slab.reserved_end, slab.num_records + count - len(records))
            records.extend(range(slab.num_records, end))
            slab.num_records = end
        if len(records) == count:
            return records
        for record in self._eviction_order(slab):
            key = slab.key_of[record]
            self._drop(slab, key, record, free=False)
            evicted.append(key)
            records.append(record)
            self.counters["evicted"] += 1
            for dependent in slab.positions.dependents(key):  # dead weight without their anchor
                dependent_record = slab.index[dependent]
                if dependent_record not in slab.busy:
                    self._drop(slab, dependent, dependent_record)
                    evicted.append(dependent)
                    self.counters["evicted"] += 1
                    self.counters["evicted_with_anchor"] += 1
            while slab.free and len(records) < count:
                records.append(slab.free.pop())
            if len(records) == count:
                break
        return records

    def _eviction_order(self, slab: _Slab) -> Iterator[int]:
        """Records to evict, first = first: the policy's order, or with `reuse_of` set, each
        window of `REUSE_EVICTION_WINDOW` oldest candidates least-reused first (ties: oldest
        first). Busy records are skipped; a record dropped meanwhile (a dependent of one
        evicted before it) is not yielded. The caller may drop what it was given."""
        # Checked as each is read, not when its window was: an anchor evicted just before drops
        # its dependents, whose records the policy's window may still hold (a KeyError here
        # once lost the batch's records and the namespace's disk tier for good).
        candidates = (record for record in slab.policy.candidates() if record in slab.key_of and record not in slab.busy)
        if self.reuse_of is None:
            yield from candidates
            return
        # Each record with the key it held when its window was read, to tell one dropped since.
        named = ((record, slab.key_of[record]) for record in candidates)
        for record, key in least_reused_first(named, lambda pair: (slab.namespace, pair[1]), self.reuse_of):
            if slab.key_of.get(record) == key and record not in slab.busy:
                yield record

    def _drop(self, slab: _Slab, key: bytes, record: int, free: bool = True) -> None:
        del slab.index[key]
        del slab.key_of[record]
        slab.positions.remove(key)
        slab.policy.remove(record)
        if free:
            slab.free.append(record)

    def _recover(self) -> None:
        """Rebuild the index from the record headers left by a previous store."""
        self._remove_old_slabs()
        damaged: list[tuple[str, str]] = []
        # Largest first: of two slabs of one namespace (a stray file named like ours), the
        # one holding the most records is kept and the other set aside.
        for path in sorted(self.root.glob(f"*{PAYLOADS_SUFFIX}"), key=lambda p: (-_size_of(p), p.name)):
            name = _parse_slab_name(path.name)
            if name is None:
                continue
            namespace = name[0]
            why = unusable_reason(path, namespace, name[1], set(self._slabs))
            slab = None
            try:
                slab = None if why else self._slab(*name)
            except (OSError, ValueError) as exc:  # unreadable, another user's, a symlinked header file
                why = str(exc)
            if slab is None:
                self.counters["damaged_files"] += set_aside(self.root, path, path.with_suffix(HEADERS_SUFFIX), why)
                damaged.append((path.name, why))
                continue
            empty = []
            last = -1
            for record, header in self._stored_headers(slab):
                parsed = None if header is None else RecordHeader.unpack(header)
                if parsed is None or parsed.namespace != namespace or parsed.key in slab.index:
                    empty.append(record)
                    # A header that holds anything but zeros (never written) is damage.
                    self.counters["damaged_records"] += header is not None and any(header.tobytes())
                    continue
                last = record
                slab.index[parsed.key] = record
                slab.key_of[record] = parsed.key
                slab.positions.add(parsed.key)
                slab.policy.add(record)
            slab.num_records = last + 1  # the empty records after the last chunk stay reserved
            slab.free = [record for record in empty if record < slab.num_records]
            self._allocated += slab.reserved_end * slab.record_cost
            self.quotas.charge(namespace, slab.reserved_end * slab.record_cost)
            if slab.index:
                logger.info("kvstrata disk tier: recovered %d chunks of namespace %s from %s", len(slab.index), namespace, path)
        log_set_aside(self.root, damaged)

    @staticmethod
    def _stored_headers(slab: _Slab) -> Iterator[tuple[int, memoryview | None]]:
        """Every record's header (None where the header file cannot give it), read in large blocks."""
        block = _aligned_buffer(RECOVERY_READ_BYTES)
        per_block = RECOVERY_READ_BYTES // HEADER_BYTES
        for first in range(0, slab.reserved_end, per_block):
            count = min(per_block, slab.reserved_end - first)
            got, _ = _read(slab.header_fd, [memoryview(block)[: count * HEADER_BYTES]], slab.header_offset(first))
            for n in range(count):
                if (n + 1) * HEADER_BYTES <= got:
                    yield first + n, memoryview(block)[n * HEADER_BYTES : (n + 1) * HEADER_BYTES]
                else:
                    yield first + n, None

    def _remove_old_slabs(self) -> None:
        """Slab files of the one-file layout hold nothing this store can serve; their space
        would count against nobody's capacity, so they go (one line says so)."""
        old = [path for path in self.root.glob(f"*{OLD_SLAB_SUFFIX}") if path.is_file()]
        if not old:
            return
        size = sum(path.stat().st_size for path in old)
        for path in old:
            path.unlink()
        logger.warning(
            "kvstrata disk tier: removed %d slab files of an earlier layout from %s (%.1f MiB); their chunks are misses",
            len(old), self.root, size / (1 << 20),
        )  # fmt: skip


def _size_of(path: Path) -> int:
    try:
        return path.lstat().st_size
    except OSError:
        return 0
