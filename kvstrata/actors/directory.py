"""One shard of the cluster directory: which nodes hold which chunk of a namespace, and
in which of their tiers (arena or disk); and which chunks the shared bucket holds.

Keys are spread over `cluster.directory_shards` shards by the first byte of their hash
(block hashes are uniform). Each node store syncs with every shard every
`cluster.sync_seconds` in one call: it sends what it started or stopped holding (in
its arena or on its disk) for each namespace, and gets back every change other nodes
made since the sequence number it last saw -- so the traffic is batched per store and
period, never per chunk.

Routers ask it too (`coverage`, kvstrata.routing): for a request's chunk keys, which
holders have which, as one bitmask per holder, so a router can tell per node how much of
a prompt's prefix sits in its arena, on its disk, on another node or in the bucket. The
bucket is one holder for the whole cluster (`BUCKET_HOLDER`): every store publishes what
its object index learned (its uploads and its sweeps of the bucket), and the shard keeps
the latest word; it is never sent back to stores, which index the bucket themselves.

The directory is a hint, never the truth: an entry may name a node that has since
evicted the chunk or died, and a peer fetch from it is then a miss. A shard that
restarts comes back empty with a new epoch; stores notice the epoch and send it their
whole holdings again, so nothing is lost for longer than one sync period.

The actor is `DirectoryShard` under `ray.remote`, created (or found) by `directory_shard`,
the one function here that imports Ray. Both the node store (its peer sync) and the
cluster placement (cluster.py) reach the shards through it, so this module imports
neither of them.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from kvstrata.actors.options import in_ray_actor, service_actor_options
from kvstrata.tiers.changelog import CPU, OBJECT, STORAGE, ChangeLog

# (key, tier, present) as a store sends it; (key, "<node id>/<tier>", present) as it comes back.
Update = tuple[bytes, str, bool]
NodeChange = tuple[bytes, str, bool]
DIRECTORY_NAME_PREFIX = "kvstrata-directory-"
TIERS = (CPU, STORAGE)  # what a node can hand to a peer: its arena, its disk
PUBLISHED = TIERS + (OBJECT,)  # what stores tell the directory: also what the bucket holds
BUCKET_HOLDER = "*/OBJECT"  # the shared object store: any node reads it


def holder_label(node_id: str, tier: str) -> str:
    return f"{node_id}/{tier}"


def split_holder(label: str) -> tuple[str, str]:
    node_id, _, tier = label.rpartition("/")
    return node_id, tier


def directory_actor_name(shard: int) -> str:
    return f"{DIRECTORY_NAME_PREFIX}{shard}"


def shard_of(key: bytes, shards: int) -> int:
    return key[0] % shards


class DirectoryShard:
    def __init__(self, shard: int):
        self.shard = shard
        self.epoch = uuid.uuid4().hex[:12]
        self._lock = threading.Lock()
        # One change log per namespace; its "medium" is the holder: "<node id>/<tier>".
        self._logs: dict[str, ChangeLog] = {}
        # namespace -> key -> holders (labels, BUCKET_HOLDER included): what `coverage` reads.
        self._holders: dict[str, dict[bytes, set[str]]] = {}
        self._bucket_chunks: dict[str, int] = {}  # namespace -> keys BUCKET_HOLDER holds
        self._metrics = None
        if in_ray_actor():
            from kvstrata.actors.store_metrics import MetricsExporter, directory_samples

            name = f"kvstrata-directory-{shard}-metrics"
            self._metrics = MetricsExporter(lambda: directory_samples(self.stats()), name=name).start()

    def ping(self) -> str:
        return self.epoch

    def sync(
        self, node_id: str, batches: dict[str, tuple[list[Update], int, bool]]
    ) -> tuple[str, dict[str, tuple[int, list[NodeChange], bool]]]:
        """Apply one store's updates and answer, per namespace, what changed since it last looked.

        `batches`: namespace -> (updates, the seq it saw last, whether `updates` is its
        whole holding in this shard: anything else of this node's is then dropped).
        Answers namespace -> (seq, changes, whether the changes are a full snapshot).
        """
        replies: dict[str, tuple[int, list[NodeChange], bool]] = {}
        with self._lock:
            for namespace, (updates, known_seq, full) in batches.items():
                log = self._logs.setdefault(namespace, ChangeLog())
                if full:
                    holding = {(key, tier) for key, tier, present in updates if present}
                    for tier in TIERS:
                        for key in log.present(holder_label(node_id, tier)):
                            if (key, tier) not in holding:
                                self._record(namespace, key, holder_label(node_id, tier), False)
                for key, tier, present in updates:
                    if tier == OBJECT:  # the bucket: its own holder, not this node's
                        self._index(namespace, key, BUCKET_HOLDER, present)
                    elif tier in TIERS:
                        self._record(namespace, key, holder_label(node_id, tier), present)
                since = log.since(known_seq) if known_seq >= 0 else None
                if since is None:
                    seq, changes = log.snapshot()
                    replies[namespace] = (seq, changes, True)
                else:
                    replies[namespace] = (since[0], since[1], False)
        return self.epoch, replies

    def coverage(self, namespace: str, keys: Sequence[bytes]) -> dict[str, int]:
        """Which holders have which of `keys`: holder label (`<node id>/CPU`,
        `<node id>/STORAGE`, `BUCKET_HOLDER`) -> bitmask, bit i set when it holds `keys[i]`.

        Holders of none of the keys are left out, so the answer grows with the holders a
        prompt's chunks actually have, not with the cluster. Read-only."""
        masks: dict[str, int] = {}
        with self._lock:
            index = self._holders.get(namespace)
            if not index:
                return masks
            for bit, key in enumerate(keys):
                for holder in index.get(key, ()):
                    masks[holder] = masks.get(holder, 0) | (1 << bit)
        return masks

    def _record(self, namespace: str, key: bytes, holder: str, present: bool) -> None:
        """A node's holding changed: into its change log (what stores sync) and the index."""
        self._logs[namespace].record(key, holder, present)
        self._index(namespace, key, holder, present)

    def _index(self, namespace: str, key: bytes, holder: str, present: bool) -> None:
        index = self._holders.setdefault(namespace, {})
        holders = index.get(key)
        if present == (holders is not None and holder in holders):
            return
        if holder == BUCKET_HOLDER:
            self._bucket_chunks[namespace] = self._bucket_chunks.get(namespace, 0) + (1 if present else -1)
        if present:
            index.setdefault(key, set()).add(holder)
            return
        holders.discard(holder)
        if not holders:
            del index[key]

    def drop_nodes(self, node_ids: Iterable[str]) -> int:
        """Forget every entry of nodes that left the cluster; returns how many went."""
        dropped = 0
        node_ids = list(node_ids)
        with self._lock:
            for namespace, log in self._logs.items():
                for node_id in node_ids:
                    for tier in TIERS:
                        for key in log.present(holder_label(node_id, tier)):
                            self._record(namespace, key, holder_label(node_id, tier), False)
                            dropped += 1
        return dropped

    def stats(self) -> dict[str, object]:
        with self._lock:
            return {
                "shard": self.shard,
                "epoch": self.epoch,
                "namespaces": {ns: log.count() for ns, log in self._logs.items()},
                "bucket": dict(self._bucket_chunks),
            }


def directory_shard(shard: int) -> Any:
    """The actor of one directory shard, created if it does not exist (restarted by Ray if it dies)."""
    import ray

    return ray.remote(DirectoryShard).options(**service_actor_options(directory_actor_name(shard))).remote(shard)
