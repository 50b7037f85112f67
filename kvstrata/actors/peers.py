"""A node store's link to the rest of the cluster: directory sync and peer fetch.

Runs inside the NodeStore actor when the config has a `cluster` section.

- Sync (one thread, every `cluster.sync_seconds`): one call per directory shard carries
  every namespace's changes of what this node holds (arena or disk) and of what its
  object index says the bucket holds (for routers), and brings back what other nodes hold. Chunks held elsewhere enter this store's change log as medium
  `PEER`, so engines mirror them like any other tier: a lookup answers `RETRY`, the
  store fetches the chunk from a peer, and the next lookup is a `HIT`.
- Fetch: chunks go from the peer store's arena (or disk) to this arena in one Ray call
  per peer and batch (`fetch_batch_bytes`, all calls in flight at once), as numpy
  arrays through Ray's object store and transfer -- never through the engine or the
  scheduler. Each chunk travels with the
  xxh3-128 its holder computed and is verified here before it is committed.
- Which peer: a chunk several nodes hold is asked of the one whose estimate
  (`peer:<node id>` in the store's `TierEstimates`) says it delivers the request's bytes
  soonest; a node not measured yet, or not lately, is asked first (that measures it);
  among equals, one holding it in RAM. Each fetch observes every peer it asked apart:
  the bytes that arrived verified from it, and the seconds from its first call's send
  to its last answer's arrival (answers are taken as they arrive, `ray.wait`, so a
  fast peer is not charged a slow one's wait; peers answering at once share the link,
  and each is charged the time it took while sharing it).

A dead peer, a stale entry or a directory that does not answer is a miss, counted and
logged once per outage; nothing here blocks the store's control calls.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from kvstrata.actors.directory import PUBLISHED, TIERS, shard_of, split_holder
from kvstrata.actors.options import STORE_NAMESPACE, store_actor_name
from kvstrata.actors.store_client import RayStoreClient
from kvstrata.config import ClusterConfig
from kvstrata.keys import key_name
from kvstrata.tiers.changelog import CPU, PEER
from kvstrata.tiers.estimates import fastest_first, peer_node, peer_tier
from kvstrata.tiers.records import chunk_digest

if TYPE_CHECKING:
    from kvstrata.tiers.arena import SlotPool
    from kvstrata.tiers.estimates import TierEstimates

logger = logging.getLogger(__name__)


class PeerSync:
    def __init__(
        self,
        node_id: str,
        config: ClusterConfig,
        logs: Callable[[], dict],
        directory: Callable[[int], Any],
        timer: Callable[[], float] = time.perf_counter,
    ):
        """`logs()`: the store's namespace -> ChangeLog; `directory(shard)`: that shard's actor
        handle; `timer`: what fetches are timed with (seconds)."""
        self.node_id = node_id
        self._timer = timer
        self._measured: set[str] = set()  # peers whose first estimate was logged
        self.config = config
        self._logs = logs
        self._make_directory = directory
        self._directory_handles: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._epochs: list[str | None] = [None] * config.directory_shards  # None: send everything again
        self._published: dict[str, int] = {}  # namespace -> own log seq already sent
        self._pulled: dict[tuple[int, str], int] = {}  # (shard, namespace) -> directory seq seen
        # namespace -> key -> other node holding it -> its tiers holding it (CPU, STORAGE)
        self._peers: dict[str, dict[bytes, dict[str, set[str]]]] = {}
        self._stores: dict[str, Any] = {}
        # Peers whose fetch just failed: not asked again until the reconciler has had time
        # to drop a dead node (a slow one is tried again after that).
        self._suspect: dict[str, float] = {}
        self._suspect_seconds = max(10.0, 2 * config.reconcile_seconds)
        self._failing = False
        self.counters = {
            "syncs": 0,
            "sync_failures": 0,
            "fetch_calls": 0,
            "fetch_failures": 0,
            "chunks_fetched": 0,
            "bytes_fetched": 0,
            "stale_entries": 0,
            "corrupt_transfers": 0,
        }
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstrata-peer-sync", daemon=True)

    def start(self) -> PeerSync:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.config.call_timeout_seconds + 5)

    def holders(self, namespace: str, key: bytes) -> list[str]:
        """Other nodes holding a chunk that are worth asking now, those with it in RAM first."""
        now = time.monotonic()
        with self._lock:
            nodes = self._peers.get(namespace, {}).get(key, {})
            ready = [node for node in nodes if self._suspect.get(node, 0.0) <= now]
            return sorted(ready, key=lambda node: (CPU not in nodes[node], node))

    def can_fetch(self, namespace: str, key: bytes) -> bool:
        return bool(self.holders(namespace, key))

    def stats(self) -> dict[str, object]:
        with self._lock:
            return {
                "directory_reachable": not self._failing,
                "peer_chunks": sum(len(keys) for keys in self._peers.values()),
                **self.counters,
            }

    # --- sync -------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(self.config.sync_seconds):
            try:
                self.sync_once()
            except Exception:  # noqa: BLE001 - the next period tries again
                logger.exception("kvstrata peers: directory sync failed")

    def sync_once(self) -> None:
        import ray

        shards = self.config.directory_shards
        logs = dict(self._logs())
        batches: list[dict[str, tuple[list[tuple[bytes, str, bool]], int, bool]]] = [{} for _ in range(shards)]
        published: dict[str, int] = {}
        for namespace, log in logs.items():
            since = log.since(self._published.get(namespace, -1)) if namespace in self._published else None
            seq, changes = since if since is not None else log.snapshot()
            published[namespace] = seq
            updates: list[list[tuple[bytes, str, bool]]] = [[] for _ in range(shards)]
            for key, medium, present in changes:
                if medium in PUBLISHED:
                    updates[shard_of(key, shards)].append((key, medium, present))
            for shard in range(shards):
                full = self._epochs[shard] is None or since is None
                if full:  # the shard forgot us (or never knew us): our whole holding
                    shard_updates = [
                        (key, tier, True)
                        for tier in PUBLISHED
                        for key in log.present(tier)
                        if shard_of(key, shards) == shard
                    ]
                else:
                    shard_updates = updates[shard]
                known = self._pulled.get((shard, namespace), -1) if self._epochs[shard] is not None else -1
                batches[shard][namespace] = (shard_updates, known, full)
        calls = {}
        for shard in range(shards):
            try:
                calls[shard] = self._directory(shard).sync.remote(self.node_id, batches[shard])
            except Exception as exc:  # noqa: BLE001 - e.g. the shard's actor cannot be created now
                self._shard_failed(shard, exc)
        if calls:
            ray.wait(list(calls.values()), num_returns=len(calls), timeout=self.config.call_timeout_seconds)
        answered = 0
        for shard, ref in calls.items():
            try:
                epoch, replies = ray.get(ref, timeout=0)
            except Exception as exc:  # noqa: BLE001 - a dead, restarting or slow shard
                self._shard_failed(shard, exc)
                continue
            answered += 1
            self._apply(shard, epoch, replies, logs)
        with self._lock:
            self._published.update(published)
            self.counters["syncs"] += 1
            if answered == shards and self._failing:
                self._failing = False
                logger.info("kvstrata peers: the directory answers again")

    def _directory(self, shard: int) -> Any:
        handle = self._directory_handles.get(shard)
        if handle is None:
            handle = self._directory_handles[shard] = self._make_directory(shard)
        return handle

    def _shard_failed(self, shard: int, exc: Exception) -> None:
        self._directory_handles.pop(shard, None)  # look it up (or create it) again next time
        with self._lock:
            self._epochs[shard] = None
            self.counters["sync_failures"] += 1
            first = not self._failing
            self._failing = True
        if first:
            logger.warning(
                "kvstrata peers: directory shard %d did not answer (%s); serving local tiers and known peers "
                "until it does",
                shard,
                type(exc).__name__,
            )

    def _apply(self, shard: int, epoch: str, replies: dict, logs: dict) -> None:
        shards = self.config.directory_shards
        with self._lock:
            previous, self._epochs[shard] = self._epochs[shard], epoch
            if previous is not None and previous != epoch:
                # Restarted between two syncs: it holds only the changes we just sent.
                # Send it everything next time (and take its snapshot then).
                self._epochs[shard] = None
            for namespace, (seq, changes, snapshot) in replies.items():
                self._pulled[(shard, namespace)] = seq
                peers = self._peers.setdefault(namespace, {})
                touched: set[bytes] = set()
                if snapshot:  # this shard's keys are exactly what it lists
                    for key in [k for k in peers if shard_of(k, shards) == shard]:
                        del peers[key]
                        touched.add(key)
                for key, holder, present in changes:
                    node_id, tier = split_holder(holder)
                    if node_id == self.node_id or tier not in TIERS:
                        continue
                    touched.add(key)
                    if present:
                        peers.setdefault(key, {}).setdefault(node_id, set()).add(tier)
                    elif node_id in peers.get(key, {}):
                        tiers = peers[key][node_id]
                        tiers.discard(tier)
                        if not tiers:
                            del peers[key][node_id]
                        if not peers[key]:
                            del peers[key]
                log = logs.get(namespace)
                if log is not None:
                    for key in touched:
                        log.record(key, PEER, key in peers)

    def _forget(self, namespace: str, key: bytes, node_id: str, log: Any) -> None:
        with self._lock:
            holders = self._peers.get(namespace, {}).get(key)
            if holders is not None:
                holders.pop(node_id, None)
                if not holders:
                    del self._peers[namespace][key]
                    log.record(key, PEER, False)
            self.counters["stale_entries"] += 1

    # --- fetch --------------------------------------------------------------------------

    def fetch(
        self,
        namespace: str,
        pool: SlotPool,
        items: list[tuple[bytes, int]],
        log: Any,
        estimates: TierEstimates | None = None,
        stale_seconds: float = 30.0,
    ) -> list[bool]:
        """Copy chunks from peers into reserved slots, verified; False for each one not had.

        With `estimates`: each chunk comes from its fastest holder by them, and what each
        peer delivered is observed there as `peer:<node id>` (the caller observes the
        batch as a whole as `peer`)."""
        import ray

        ok = dict.fromkeys(range(len(items)), False)
        slot_bytes = pool.geometry.slot_bytes
        costs = {}
        if estimates is not None:
            costs = {node: cost for tier, cost in estimates.costs().items() if (node := peer_node(tier)) is not None}
        by_peer: dict[str, list[int]] = {}
        for index, (key, _) in enumerate(items):
            holders = self.holders(namespace, key)
            if len(holders) > 1:
                holders = fastest_first(holders, costs, len(items) * slot_bytes, stale_seconds)
            if holders:
                by_peer.setdefault(holders[0], []).append(index)
        per_call = max(1, self.config.fetch_batch_bytes // slot_bytes)
        calls: list[tuple[str, list[int], Any]] = []
        sent: dict[str, float] = {}  # peer -> when its first call went out
        for node_id, indices in by_peer.items():  # every call in flight at once: transfers overlap
            for start in range(0, len(indices), per_call):
                batch = indices[start : start + per_call]
                try:
                    store = self._store(node_id)
                    sent.setdefault(node_id, self._timer())
                    ref = store.export_chunks_async(namespace, [items[i][0] for i in batch])
                except Exception as exc:  # noqa: BLE001 - no such peer store (any more)
                    self._fetch_failed(node_id, len(batch), exc)
                    continue
                calls.append((node_id, batch, ref))
        delivered: dict[str, list[float]] = {}  # peer -> [verified bytes, when its last answer arrived]
        deadline = time.monotonic() + self.config.call_timeout_seconds
        for call in _in_arrival_order([ref for _, _, ref in calls], deadline):
            node_id, batch, ref = calls[call]
            arrived = self._timer()
            try:
                found, digests, chunks = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except Exception as exc:  # noqa: BLE001 - a dead or slow peer is a miss
                self._fetch_failed(node_id, len(batch), exc)
                continue
            position = {key: n for n, key in enumerate(found)}
            with self._lock:
                self.counters["fetch_calls"] += 1
            from_peer = delivered.setdefault(node_id, [0, arrived])
            from_peer[1] = arrived
            for i in batch:
                key, slot = items[i]
                n = position.get(key)
                if n is None:  # evicted there since the directory heard of it
                    self._forget(namespace, key, node_id, log)
                    continue
                view = pool.view(slot)
                # A chunk that arrives damaged is that peer's copy no more: forgotten here
                # (the next lookup is a MISS), or the engine would be told RETRY forever.
                if chunks[n].nbytes != slot_bytes:
                    logger.warning("kvstrata peers: chunk %s from node %s has the wrong size", key_name(key), node_id[:12])
                    self._forget(namespace, key, node_id, log)
                    continue
                view[:] = chunks[n]
                if chunk_digest(namespace, key, view) != digests[n]:
                    with self._lock:
                        self.counters["corrupt_transfers"] += 1
                    logger.warning("kvstrata peers: chunk %s from node %s failed its checksum", key_name(key), node_id[:12])
                    self._forget(namespace, key, node_id, log)
                    continue
                ok[i] = True
                from_peer[0] += slot_bytes
                with self._lock:
                    self.counters["chunks_fetched"] += 1
                    self.counters["bytes_fetched"] += slot_bytes
        if estimates is not None:
            for node_id, (nbytes, arrived) in delivered.items():
                estimates.observe(peer_tier(node_id), int(nbytes), arrived - sent[node_id])
            self._log_first_estimates(estimates, delivered)
        return [ok[i] for i in range(len(items))]

    def _log_first_estimates(self, estimates: TierEstimates, peers: dict[str, list[float]]) -> None:
        """One line per peer, when it is first measured (status and metrics follow it after)."""
        costs = estimates.costs()
        with self._lock:
            new = [node for node in peers if node not in self._measured and peer_tier(node) in costs]
            self._measured.update(new)
        for node_id in new:
            cost = costs[peer_tier(node_id)]
            logger.info(
                "kvstrata peers: node %s measured: %.0f MB/s after %.1f ms per fetch",
                node_id[:12], cost.bytes_per_second / 1e6, cost.latency_seconds * 1000,
            )  # fmt: skip

    def _fetch_failed(self, node_id: str, count: int, exc: Exception) -> None:
        with self._lock:
            self.counters["fetch_failures"] += 1
            self._stores.pop(node_id, None)
            self._suspect[node_id] = time.monotonic() + self._suspect_seconds
        logger.warning(
            "kvstrata peers: fetch of %d chunks from node %s failed (%s); they miss", count, node_id[:12], type(exc).__name__
        )

    def _store(self, node_id: str) -> Any:
        """The client of a peer's store (`RayStoreClient`: the only code that calls a store handle)."""
        with self._lock:
            client = self._stores.get(node_id)
        if client is None:
            import ray

            handle = ray.get_actor(store_actor_name(node_id), namespace=STORE_NAMESPACE)
            client = RayStoreClient(handle, self.config.call_timeout_seconds)
            with self._lock:
                self._stores[node_id] = client
        return client


def _in_arrival_order(refs: list[Any], deadline: float) -> Iterator[int]:
    """Positions in `refs` in the order their answers arrive here (`ray.wait`: the object is
    on this node), then those not answered by `deadline` (`time.monotonic`), whose `ray.get`
    then times out. A `concurrent.futures.Future` (an answer made in-process, not through
    Ray) counts as arrived."""
    import ray

    pending: dict[Any, int] = {}
    for n, ref in enumerate(refs):
        if isinstance(ref, Future):
            yield n
        else:
            pending[ref] = n
    while pending:
        timeout = deadline - time.monotonic()
        if timeout <= 0:
            break
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=timeout)
        if not ready:
            break
        for ref in ready:
            yield pending.pop(ref)
    yield from pending.values()
