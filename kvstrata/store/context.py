"""What the node store's parts truly share, handed to each part's constructor.

`NodeStore` (node_store.py) is assembled from parts, each a plain class in its own module
that owns its fields and offers public methods: the sessions and the order of a step
(control.py), purges (purges.py), reuse admission (admission.py), the cascade
(cascade.py), promotion (promotion.py), prefetch and hints (prefetch.py, hints.py), the
object index (object_index.py), and the tiers below the arena (lower.py, over
tiers/base.py's `LowerTier`). What they share is here, and only that: one lock guards the
arena and every part's bookkeeping, one condition tells `wait_io` that any part's I/O
ended, the counters and change logs are the store's, and so are the tiers' estimates and
the engines' prefill rates that several parts read.

Owns: the `StoreContext` record (built once by `NodeStore`, never replaced).
Invariants: `lock` (re-entrant) guards the arena, `layouts`, `counters`, `recompute_rates`
and each part's own state; the disk tier, the object tier and the change logs lock
themselves. Every background job that ends notifies `io_done` under the lock.
Must not: import a part or node_store.py (they import this), or do any I/O.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from kvstrata.config import KvstrataConfig
from kvstrata.store.chunk_audit import ChunkAudit
from kvstrata.store.executors import ExecutorFactory
from kvstrata.store.io_meter import IoMeter
from kvstrata.tiers.arena import Arena
from kvstrata.tiers.changelog import ChangeLog
from kvstrata.tiers.estimates import TierEstimates

# One logger for every part of the store, named as it was before the store was split, so
# logging configuration that names it keeps working.
logger = logging.getLogger("kvstrata.actors.node_store")
# Where a promotion brings a chunk from, in order: this node's disk, another node's store,
# the bucket (the default lower tiers; their counters exist even where one is off).
PROMOTION_SOURCES = ("disk", "peer", "object")


class Generations:
    """Purges of each namespace so far: every background job notes its namespace's
    generation when queued and commits nothing if it changed (purges.py says why).
    Read and bumped under the store lock."""

    def __init__(self) -> None:
        self._of: dict[str, int] = {}

    def current(self, namespace: str) -> int:
        return self._of.get(namespace, 0)

    def purged_since(self, namespace: str, generation: int) -> bool:
        """Whether the namespace was purged after a job noted `generation`."""
        return self._of.get(namespace, 0) != generation

    def bump(self, namespace: str) -> int:
        generation = self._of[namespace] = self.current(namespace) + 1
        return generation


@dataclass(eq=False)
class StoreContext:
    """What every part of the store is handed (see the module docstring)."""

    config: KvstrataConfig
    node_id: str
    clock: Callable[[], float]
    executors: ExecutorFactory  # where background jobs run (executors.py: the seam tests replace)
    arena: Arena
    audit: ChunkAudit | None  # `tiers.cpu.audit_chunks`: commits' digests checked on promotion
    lock: threading.RLock = field(default_factory=threading.RLock)
    logs: dict[str, ChangeLog] = field(default_factory=dict)  # namespace -> where its chunks are
    layouts: dict[str, dict[str, object]] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)
    recompute_rates: dict[str, float] = field(default_factory=dict)  # live holder -> its prefill rate
    generations: Generations = field(default_factory=Generations)
    tier_errors: dict[str, str] = field(default_factory=dict)  # lower tier -> why it is off
    io_meter: IoMeter = field(init=False)  # bytes, chunks and seconds each tier moved
    tier_estimates: TierEstimates = field(init=False)  # what each lower tier delivered (admission.load)
    io_done: threading.Condition = field(init=False)  # on `lock`; notified whenever I/O in flight ends

    def __post_init__(self) -> None:
        self.io_meter = IoMeter(self.clock)
        self.tier_estimates = TierEstimates(self.clock)
        self.io_done = threading.Condition(self.lock)

    def log(self, namespace: str) -> ChangeLog:
        log = self.logs.get(namespace)
        if log is None:
            log = self.logs.setdefault(namespace, ChangeLog())
        return log
