"""The node store's view of the object tier, which all nodes share.

What the bucket holds is learned from this store's own uploads (cascade.py) and from a
sweep (one listing of the whole URL) every `index_refresh_seconds` and whenever a new
namespace registers, so chunks other nodes stored become hits here; the sweep also
deletes what `capacity` and `ttl_seconds` rule out.

Owns: the sweep's state (`_scanning`, `_scanned_at`, `_scanned`, `_swept`) and whether a
namespace counts as indexed.
Invariants: one sweep at a time, on the object I/O pool; the sweep covers every
namespace that has a change log when it starts, and records OBJECT presence only as
changes against a snapshot taken before the listing (an upload that lands meanwhile is
not "gone"), and only for namespaces neither purged since the snapshot nor being purged
in the bucket when it was taken (purge.py). A failed listing still marks its namespaces swept.
Must not: upload or download chunks (cascade.py, promotion.py).
"""

from __future__ import annotations

from kvstrata.store.purges import Purge
from kvstrata.store.context import logger
from kvstrata.tiers.changelog import OBJECT


class ObjectIndex(Purge):
    """Mixin of `NodeStore`: the periodic sweep of the object store."""

    def _init_object_index(self) -> None:
        self._scanned_at = float("-inf")  # when the last sweep of the object store started
        self._scanned: set[str] = set()  # namespaces the last complete sweep covered
        self._swept: set[str] = set()  # namespaces some sweep has finished with (listed or failed)
        self._scanning = False

    def _refresh_object_index(self, namespace: str) -> None:
        """Sweep the bucket now and then: learn what other nodes stored, keep capacity and TTL.

        A namespace no sweep has covered yet (a new engine) gets one at once.
        """
        if self.object is None:
            return
        self._retry_bucket_purges()  # purge.py: those that waited for the tier to answer
        if self._scanning:
            return
        now = self._clock()
        if namespace in self._scanned and now - self._scanned_at < self.config.tiers.object.index_refresh_seconds:
            return
        self._log(namespace)  # the sweep covers every namespace with a log
        self._scanning = True
        self._scanned_at = now
        self._object_io.submit(self._scan_job)

    def _scan_job(self) -> None:
        with self._lock:
            # Snapshot before listing: an upload that lands meanwhile is not "gone".
            before = {namespace: set(log.present(OBJECT)) for namespace, log in self._logs.items()}
            # A listing may show what a purge is deleting: such namespaces learn nothing from it.
            generations = {namespace: self._generation(namespace) for namespace in before}
            purging = self._bucket_busy()
        try:
            entries = self.object.scan()
            if entries is not None:
                entries = self.object.apply_limits(entries)
        except Exception:  # noqa: BLE001
            logger.exception("kvstrata node store: sweeping the object store failed")
            entries = None
        if entries is not None:
            listed: dict[str, set[bytes]] = {namespace: set() for namespace in before}
            for entry in entries:
                if entry.namespace in listed:
                    listed[entry.namespace].add(entry.key)
            for namespace, keys in listed.items():
                log = self._log(namespace)
                with self._lock:
                    if namespace in purging or self._purged_since(namespace, generations[namespace]):
                        continue
                    log.record_many(keys - before[namespace], OBJECT, True)
                    # Gone: swept, purged, a bucket lifecycle rule.
                    log.record_many(before[namespace] - keys, OBJECT, False)
        with self._lock:
            if entries is not None:
                self._scanned = set(before)
            # A failed listing counts too: waiting longer would not tell the engines more.
            self._swept.update(before)
            self._scanning = False
            self._io_done.notify_all()

    def _indexed(self, namespace: str) -> bool:
        """Whether this store's view of the namespace covers the object store (callers hold the lock)."""
        return self.object is None or namespace in self._swept
