"""Retention: chunks a client asked to keep, with a priority and a time to live.

Why: an API's prompt cache promises a prefix for a while (Anthropic's `ttl: "1h"`, OpenAI's
`prompt_cache_retention: "24h"`); plain LRU loses a system prompt to a burst of one-off
prompts. A `kv.retain` hint names chunks, a priority (0-100) and a TTL: until it runs out,
eviction in the arena and on disk takes every chunk of lower priority first, unretained
ones (priority 0) first of all, in each tier's own order among equals.

How: a `RetentionTable` per node store, (namespace, key) -> (priority, expiry on the
store's clock). It is kept by key, present or not: a chunk retained before it is stored
(the request's own prompt, stored as it is computed) is protected from its commit on.
Eviction orders are wrapped, never rewritten: `RetentionOrder` (retention_order.py) wraps
an arena pool's policy and each disk slab's once retention is in use, and hears every
change of a key's retention through the table's `listeners`, so an eviction costs O(1)
per candidate whatever is retained.

Shares: one tenant's retentions hold at most `tenant_share` of the table, so no tenant
fills it for the others; a retention of a key no tier holds counts against its own
tenant's share only. Retentions of a namespace whose tenant is not known yet (None)
count against every tenant's share until it is, so none exceeds its share once known.

Invariants: a retention protects only while it lives (`expires_at` > now): an expired
one is forgotten at the next read, and its chunk is evicted like any other; among
candidates of one priority the tier's own order is kept; `retained_last` yields every
candidate it is given exactly once. The table is bounded (`max_entries`, and per tenant
`tenant_share` of it): a retention beyond it is refused, never makes room by forgetting
another. Listeners are called after a change, outside the table's lock.
Must not: import Ray or vLLM; evict anything itself.
"""

from __future__ import annotations

import heapq
import math
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

from kvstrata.tiers.retention_order import RetentionOrder  # noqa: F401 - the order's home before issue #51

T = TypeVar("T")
MAX_PRIORITY = 100
Name = tuple[str, bytes]  # (namespace, key)
_TTL = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_ttl(value: object) -> float:
    """Seconds from a number or a duration as APIs write them: "300s", "5m", "1h", "24h", "2d"
    (a ValueError naming the value otherwise)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            seconds = float(value)
        except OverflowError:  # an integer beyond a double's range
            raise ValueError(f"ttl {value!r:.40} is out of range") from None
    elif isinstance(value, str) and (match := _TTL.match(value)):
        seconds = float(match.group(1)) * _UNITS[match.group(2)]
    else:
        raise ValueError(f"ttl {value!r} is not seconds or a duration like '5m', '1h', '24h'")
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"ttl must be positive, got {value!r}")
    return seconds


class RetentionTable:
    """(namespace, key) -> (priority, expiry). Thread-safe: the disk tier's eviction reads
    it on I/O threads while the store writes it under its own lock."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        max_entries: int = 1_000_000,
        tenant_of: Callable[[str], str] | None = None,
        tenant_share: float = 1.0,
    ):
        self.clock = self._clock = clock
        self._lock = threading.RLock()
        self.max_entries = max_entries
        self._tenant_of = tenant_of or (lambda namespace: namespace)
        self.tenant_entries = int(max_entries * tenant_share)  # one tenant's most
        self._entries: dict[Name, tuple[int, float]] = {}
        self._by_namespace: dict[str, int] = {}  # namespace -> live entries (a fast "none here")
        self._expiries: list[tuple[float, str, bytes]] = []  # heap: forget expired entries in order
        # (namespace, keys) -> None, after their retention changed; outside the lock.
        self.listeners: list[Callable[[str, list[bytes]], None]] = []

    def retain(self, namespace: str, keys: Iterable[bytes], priority: int, ttl_seconds: float) -> int:
        """Keep `keys` at `priority` for `ttl_seconds` from now; a key already retained keeps
        the higher priority and the later expiry of the two. Returns how many keys were
        refused because the table is full."""
        if not 0 <= priority <= MAX_PRIORITY:
            raise ValueError(f"retention priority must be 0 to {MAX_PRIORITY}, got {priority!r}")
        if not ttl_seconds > 0:
            raise ValueError(f"retention ttl must be positive seconds, got {ttl_seconds!r}")
        changed: list[bytes] = []
        with self._lock:
            self._expire()
            until = self._clock() + ttl_seconds
            refused = 0
            held = self._share_used(self._tenant_of(namespace))
            for key in keys:
                name = (namespace, key)
                known = self._entries.get(name)
                if known is None:
                    if len(self._entries) >= self.max_entries or held >= self.tenant_entries:
                        refused += 1
                        continue
                    held += 1
                    self._by_namespace[namespace] = self._by_namespace.get(namespace, 0) + 1
                    entry = (priority, until)
                else:
                    entry = (max(priority, known[0]), max(until, known[1]))
                    if entry == known:
                        continue
                self._entries[name] = entry
                changed.append(key)
                heapq.heappush(self._expiries, (entry[1], namespace, key))
        self._tell(namespace, changed)
        return refused

    def release(self, namespace: str, keys: Iterable[bytes]) -> None:
        """Stop retaining `keys` before their TTL runs out."""
        changed: list[bytes] = []
        with self._lock:
            for key in keys:
                if self._entries.pop((namespace, key), None) is not None:
                    self._forgot(namespace)
                    changed.append(key)
        self._tell(namespace, changed)

    def forget_namespace(self, namespace: str) -> None:
        """Drop every retention of a namespace (it was purged: its chunks are gone)."""
        with self._lock:
            count = self._by_namespace.pop(namespace, None)
            if count:
                gone = [key for (ns, key) in self._entries if ns == namespace]
                self._entries = {name: entry for name, entry in self._entries.items() if name[0] != namespace}
        if count:
            self._tell(namespace, gone)

    def entry(self, namespace: str, key: bytes) -> tuple[int, float] | None:
        """A chunk's live retention, (priority, expiry on `clock`), or None."""
        with self._lock:
            entry = self._entries.get((namespace, key))
            if entry is None or entry[1] <= self._clock():
                return None
            return entry

    def tenant_count(self, namespace: str) -> int:
        """Entries held by the tenant of `namespace`."""
        with self._lock:
            return self._held_by(self._tenant_of(namespace))

    def _share_used(self, tenant: str | None) -> int:
        """Entries that count against `tenant`'s share (callers hold the lock): its own, and
        those of namespaces whose tenant is not known yet (None: a restarted store learns a
        namespace's tenant at its first registration), which may turn out to be its. For
        an unknown tenant, the most any known tenant holds: whichever tenant the namespace
        turns out to be, it holds its share at most (found by the simulation, seed 124)."""
        per_tenant = self._counts_by_tenant()
        unknown = per_tenant.pop(None, 0)
        if tenant is None:
            return unknown + max(per_tenant.values(), default=0)
        return per_tenant.get(tenant, 0) + unknown

    def _held_by(self, tenant: str | None) -> int:
        """Entries of the tenant's namespaces (callers hold the lock)."""
        return self._counts_by_tenant().get(tenant, 0)

    def _counts_by_tenant(self) -> dict[str | None, int]:
        """Entries per tenant, each namespace counted as its tenant's now: a store learns a
        namespace's tenant at its first registration, and retentions that reached it before
        (a restarted store) count in that tenant's share from then on."""
        counts: dict[str | None, int] = {}
        for namespace, count in self._by_namespace.items():
            owner = self._tenant_of(namespace)
            counts[owner] = counts.get(owner, 0) + count
        return counts

    def priority(self, namespace: str, key: bytes) -> int:
        """The live priority of a chunk: 0 when not retained or expired."""
        with self._lock:
            entry = self._entries.get((namespace, key))
            if entry is None:
                return 0
            if entry[1] <= self._clock():
                self._expire()
                return 0
            return entry[0]

    def has(self, namespace: str) -> bool:
        """Whether any retention of the namespace may still be live."""
        return bool(self._by_namespace.get(namespace))

    def expire(self) -> int:
        """Forget entries whose TTL ran out; how many went."""
        with self._lock:
            return self._expire()

    def __len__(self) -> int:
        return len(self._entries)

    def _expire(self) -> int:
        now, gone = self._clock(), 0
        while self._expiries and self._expiries[0][0] <= now:
            until, namespace, key = heapq.heappop(self._expiries)
            entry = self._entries.get((namespace, key))
            if entry is not None and entry[1] == until:  # not renewed since this was pushed
                del self._entries[(namespace, key)]
                self._forgot(namespace)
                gone += 1
        if len(self._expiries) > 4 * max(16, len(self._entries)):  # renewals left stale heap entries
            self._expiries = [(until, ns, key) for (ns, key), (_, until) in self._entries.items()]
            heapq.heapify(self._expiries)
        return gone

    def _forgot(self, namespace: str) -> None:
        left = self._by_namespace.get(namespace, 0) - 1
        if left > 0:
            self._by_namespace[namespace] = left
        else:
            self._by_namespace.pop(namespace, None)

    def _tell(self, namespace: str, keys: list[bytes]) -> None:
        if keys:
            for listener in list(self.listeners):
                listener(namespace, keys)


def retained_last(candidates: Iterable[T], priority_of: Callable[[T], int]) -> Iterator[T]:
    """`candidates` (a tier's eviction order) with the retained ones moved behind, lowest
    priority first, each priority in the order given.

    Lazy for what is not retained: an unretained candidate is yielded as soon as it is
    read, so an eviction that needs one chunk reads past only the retained ones before it.
    """
    deferred: dict[int, list[T]] = {}
    for candidate in candidates:
        priority = priority_of(candidate)
        if priority <= 0:
            yield candidate
        else:
            deferred.setdefault(priority, []).append(candidate)
    for priority in sorted(deferred):
        yield from deferred[priority]
