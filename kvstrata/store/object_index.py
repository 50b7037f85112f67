"""The node store's view of the object tier, which all nodes share.

What the bucket holds is learned from this store's own uploads (cascade.py) and from a
sweep (one listing of the whole URL) every `index_refresh_seconds` and whenever a new
namespace registers, so chunks other nodes stored become hits here; the sweep also
deletes what `capacity` and `ttl_seconds` rule out.

Every lower tier that lists what it holds (`ListedTier`: the bucket, object_lower.py) is
swept so; the index loops over them and names none.

Owns: each sweep's state (`_Sweep`: scanning, scanned at, scanned, swept) and whether a
namespace counts as indexed.
Invariants: one sweep of a tier at a time, on the tier's pool; the sweep covers every
namespace that has a change log when it starts, and records OBJECT presence only as
changes against a snapshot taken before the listing (an upload that lands meanwhile is
not "gone"), and only for namespaces neither purged since the snapshot nor being purged
in the bucket when it was taken (object_lower.py). A failed listing still marks its namespaces swept.
Must not: upload or download chunks (cascade.py, promotion.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from kvstrata.store.context import StoreContext, logger
from kvstrata.tiers.base import LowerTier


@runtime_checkable
class ListedTier(Protocol):
    """A lower tier whose holdings are learned by listing it (object_lower.py)."""

    name: str
    medium: str
    refresh_seconds: float

    def listing(self) -> list[Any] | None: ...

    def purging(self) -> set[str]: ...

    def retry_purges(self) -> None: ...

    def submit(self, job: Callable[..., Any], *args: Any) -> None: ...


@dataclass
class _Sweep:
    tier: ListedTier
    scanned_at: float = float("-inf")  # when the last sweep started
    scanned: set[str] = field(default_factory=set)  # namespaces the last complete sweep covered
    swept: set[str] = field(default_factory=set)  # namespaces some sweep has finished with (listed or failed)
    scanning: bool = False


class ObjectIndex:
    """The periodic sweep of each listed lower tier."""

    def __init__(self, ctx: StoreContext, tiers: Sequence[LowerTier]):
        self._ctx = ctx
        self._sweeps = [_Sweep(tier) for tier in tiers if isinstance(tier, ListedTier)]

    def refresh(self, namespace: str) -> None:
        """Sweep now and then: learn what other nodes stored, keep capacity and TTL.

        A namespace no sweep has covered yet (a new engine) gets one at once (callers hold the lock).
        """
        for sweep in self._sweeps:
            sweep.tier.retry_purges()  # those that waited for the tier to answer
            if sweep.scanning:
                continue
            now = self._ctx.clock()
            if namespace in sweep.scanned and now - sweep.scanned_at < sweep.tier.refresh_seconds:
                continue
            self._ctx.log(namespace)  # the sweep covers every namespace with a log
            sweep.scanning = True
            sweep.scanned_at = now
            sweep.tier.submit(self._scan_job, sweep)

    def _scan_job(self, sweep: _Sweep) -> None:
        ctx, medium = self._ctx, sweep.tier.medium
        with ctx.lock:
            # Snapshot before listing: an upload that lands meanwhile is not "gone".
            before = {namespace: set(log.present(medium)) for namespace, log in ctx.logs.items()}
            # A listing may show what a purge is deleting: such namespaces learn nothing from it.
            generations = {namespace: ctx.generations.current(namespace) for namespace in before}
            purging = sweep.tier.purging()
        try:
            entries = sweep.tier.listing()
        except Exception:  # noqa: BLE001
            logger.exception("kvstrata node store: sweeping the %s tier failed", sweep.tier.name)
            entries = None
        if entries is not None:
            listed: dict[str, set[bytes]] = {namespace: set() for namespace in before}
            for entry in entries:
                if entry.namespace in listed:
                    listed[entry.namespace].add(entry.key)
            for namespace, keys in listed.items():
                log = ctx.log(namespace)
                with ctx.lock:
                    if namespace in purging or ctx.generations.purged_since(namespace, generations[namespace]):
                        continue
                    log.record_many(keys - before[namespace], medium, True)
                    # Gone: swept, purged, a bucket lifecycle rule.
                    log.record_many(before[namespace] - keys, medium, False)
        with ctx.lock:
            if entries is not None:
                sweep.scanned = set(before)
            # A failed listing counts too: waiting longer would not tell the engines more.
            sweep.swept.update(before)
            sweep.scanning = False
            ctx.io_done.notify_all()

    def indexed(self, namespace: str) -> bool:
        """Whether this store's view of the namespace covers every listed tier (callers hold the lock)."""
        return all(namespace in sweep.swept for sweep in self._sweeps)

    def busy(self) -> bool:
        """Whether a sweep is running (`wait_io`; callers hold the lock)."""
        return any(sweep.scanning for sweep in self._sweeps)
