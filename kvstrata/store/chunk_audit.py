"""Chunk audit: proof that a chunk brought back into the arena carries bytes that an
engine committed under its key (`tiers.cpu.audit_chunks`, off by default).

Why: the tiers verify each record against the digest written beside it, which catches
damage at rest but not a chunk whose bytes were wrong when they were written down (a slot
read after it was reused, a record filed under another key). When a run's outputs change,
this tells the two remaining explanations apart: wrong bytes served (a promotion whose
digest matches no commit of its key), or the same key committed with different bytes
(the KV an engine computes for one prefix depends on what else ran in its batch).

How: the xxh3-128 digest of every chunk an engine commits is kept per (namespace, key),
up to `MAX_DIGESTS_PER_KEY` distinct digests (a key recommitted after its eviction may
differ); every promotion from disk or the object store is hashed before it is committed
and refused, as a miss, when its digest is none of them. A promotion from another node
is not checked (its commit happened there). Costs one hash per commit and per promotion
on the store's threads: for fault hunts and acceptance runs, not for production.

Invariants: memory is bounded by `max_keys` (oldest keys forgotten first; a forgotten
key's promotions count as `audit_unknown`, never as mismatches); the counters only grow.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

from kvstrata.keys import key_name
from kvstrata.tiers.records import chunk_digest

logger = logging.getLogger(__name__)

MAX_DIGESTS_PER_KEY = 4
CHECKED_SOURCES = ("disk", "object")  # peers' chunks were committed on their own node


class ChunkAudit:
    """Digests of committed chunks, checked against every promotion from this node's tiers."""

    def __init__(self, max_keys: int = 1 << 20):
        self.max_keys = max_keys
        self._digests: OrderedDict[tuple[str, bytes], tuple[bytes, ...]] = OrderedDict()
        self._lock = threading.Lock()  # commits come under the store lock, promotions off it
        self.counters = {
            "audit_commits": 0,
            "audit_recommits_differing": 0,  # same key committed again with other bytes
            "audit_promotions_checked": 0,
            "audit_unknown": 0,  # promoted, but no commit of the key is remembered here
            "audit_mismatches": 0,  # promoted bytes that no commit of the key had: refused
        }

    def committed(self, namespace: str, key: bytes, payload) -> None:
        """Remember the bytes an engine committed under `key`."""
        digest = chunk_digest(namespace, key, payload)
        with self._lock:
            self.counters["audit_commits"] += 1
            known = self._digests.pop((namespace, key), ())
            if known and digest not in known:
                self.counters["audit_recommits_differing"] += 1
                logger.warning(
                    "kvstrata chunk audit: chunk %s of namespace %s committed again with other bytes",
                    key_name(key), namespace,
                )  # fmt: skip
            if digest not in known:
                known = (known + (digest,))[-MAX_DIGESTS_PER_KEY:]
            self._digests[(namespace, key)] = known
            while len(self._digests) > self.max_keys:
                self._digests.popitem(last=False)

    def promoted(self, source: str, namespace: str, key: bytes, payload) -> bool:
        """Whether a chunk promoted from `source` may be committed: False only when its
        bytes are none that were ever committed under its key here."""
        if source not in CHECKED_SOURCES:
            return True
        digest = chunk_digest(namespace, key, payload)
        with self._lock:
            self.counters["audit_promotions_checked"] += 1
            known = self._digests.get((namespace, key))
            if known is None:
                self.counters["audit_unknown"] += 1
                return True
            if digest in known:
                return True
            self.counters["audit_mismatches"] += 1
        logger.error(
            "kvstrata chunk audit: chunk %s of namespace %s came back from %s with bytes no commit had; "
            "treated as a miss",
            key_name(key), namespace, source,
        )  # fmt: skip
        return False
