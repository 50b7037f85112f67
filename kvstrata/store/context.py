"""The state every part of the node store shares, declared in one place.

`NodeStore` (node_store.py) is one object assembled from parts, each a mixin in its own
module: the control surface engines call (store_control.py), the cascade to disk and
the object store (cascade.py), promotion into the arena (promotion.py) and the sweep of
the object store (object_index.py). They are mixins over this one state, not
collaborators holding their own references, because the parts share more than they
own: one lock guards the arena and every part's bookkeeping, one condition tells
`wait_io` that any part's I/O ended, the counters and change logs are the store's, and
tests replace `peers` and `_peer_io` on a built store (a collaborator would keep the
old ones).

Owns: nothing at run time; `NodeStore.__init__` builds the fields declared here, and each
part builds its own (in its `_init_*`).
Invariants: `_lock` (re-entrant) guards the arena, `layouts`, `counters` and each part's
own state; the disk tier, the object tier and the change logs lock themselves. Every
background job that ends notifies `_io_done` under the lock.
Must not: import a part or node_store.py (they import this), or do any I/O.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from kvstrata.store.chunk_audit import ChunkAudit
from kvstrata.store.io_meter import IoMeter
from kvstrata.actors.peers import PeerSync
from kvstrata.config import KvstrataConfig
from kvstrata.tiers.arena import Arena
from kvstrata.tiers.changelog import ChangeLog
from kvstrata.tiers.disk import DiskTier
from kvstrata.tiers.object_store import ObjectTier

# One logger for every part of the store, named as it was before the store was split, so
# logging configuration that names it keeps working.
logger = logging.getLogger("kvstrata.store.node_store")
# Where a promotion brings a chunk from: this node's disk, another node's store, the bucket.
PROMOTION_SOURCES = ("disk", "peer", "object")


class StoreState:
    """Fields built by `NodeStore.__init__` and shared by all parts of the store."""

    config: KvstrataConfig
    node_id: str
    arena: Arena
    _lock: threading.RLock
    _logs: dict[str, ChangeLog]  # namespace -> where its chunks are (CPU, STORAGE, OBJECT, PEER)
    layouts: dict[str, dict[str, object]]
    _registered: set[tuple[str, str]]  # (holder, namespace) registered with this store: who may purge
    _holders: dict[str, str]  # live holder -> the epoch its registration returned (store epoch + token)
    _recompute_rates: dict[str, float]  # live holder -> its last reported prefill rate (status only)
    counters: dict[str, int]
    io_meter: IoMeter  # bytes, chunks and seconds each tier moved (status, metrics)
    audit: ChunkAudit | None  # `tiers.cpu.audit_chunks`: commits' digests checked on promotion
    _clock: Callable[[], float]
    _io_done: threading.Condition  # on `_lock`; notified whenever I/O in flight ends
    disk: DiskTier | None  # None: no disk tier configured, or it failed to open (`disk_error`)
    disk_error: str | None
    _io: ThreadPoolExecutor | None  # disk jobs, `tiers.disk.io_threads` of them
    object: ObjectTier | None
    _object_io: ThreadPoolExecutor | None  # object-store batches, sweeps, manifests, purges
    peers: PeerSync | None  # None unless a `cluster` section and a Ray process
    _peer_io: ThreadPoolExecutor | None

    def _log(self, namespace: str) -> ChangeLog:
        log = self._logs.get(namespace)
        if log is None:
            log = self._logs.setdefault(namespace, ChangeLog())
        return log
