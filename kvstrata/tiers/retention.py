"""Retention: chunks a client asked to keep, with a priority and a time to live.

Why: an API's prompt cache promises a prefix for a while (Anthropic's `ttl: "1h"`, OpenAI's
`prompt_cache_retention: "24h"`); plain LRU loses a system prompt to a burst of one-off
prompts. A `kv.retain` hint names chunks, a priority (0-100) and a TTL: until it runs out,
eviction in the arena and on disk takes every chunk of lower priority first, unretained
ones (priority 0) first of all, in each tier's own order among equals.

How: a `RetentionTable` per node store, (namespace, key) -> (priority, expiry on the
store's clock). It is kept by key, present or not: a chunk retained before it is stored
(the request's own prompt, stored as it is computed) is protected from its commit on.
Eviction orders are wrapped, never rewritten: `retained_last` reorders any tier's
candidates (the disk index's records, the arena policy's slots), and `RetentionOrder` wraps
an arena pool's policy once its namespace has a retention.

Invariants: a retention protects only while it lives (`expires_at` > now): an expired
one is forgotten at the next read, and its chunk is evicted like any other; among
candidates of one priority the tier's own order is kept; `retained_last` yields every
candidate it is given exactly once. The table is bounded (`max_entries`): a retention
beyond it is refused, never makes room by forgetting another.
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

from kvstrata.tiers.policies.base import EvictionPolicy

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

    def __init__(self, clock: Callable[[], float] = time.monotonic, max_entries: int = 1_000_000):
        self._clock = clock
        self._lock = threading.RLock()
        self.max_entries = max_entries
        self._entries: dict[Name, tuple[int, float]] = {}
        self._by_namespace: dict[str, int] = {}  # namespace -> live entries (a fast "none here")
        self._expiries: list[tuple[float, str, bytes]] = []  # heap: forget expired entries in order

    def retain(self, namespace: str, keys: Iterable[bytes], priority: int, ttl_seconds: float) -> int:
        """Keep `keys` at `priority` for `ttl_seconds` from now; a key already retained keeps
        the higher priority and the later expiry of the two. Returns how many keys were
        refused because the table is full."""
        if not 0 <= priority <= MAX_PRIORITY:
            raise ValueError(f"retention priority must be 0 to {MAX_PRIORITY}, got {priority!r}")
        if not ttl_seconds > 0:
            raise ValueError(f"retention ttl must be positive seconds, got {ttl_seconds!r}")
        with self._lock:
            self._expire()
            until = self._clock() + ttl_seconds
            refused = 0
            for key in keys:
                name = (namespace, key)
                known = self._entries.get(name)
                if known is None:
                    if len(self._entries) >= self.max_entries:
                        refused += 1
                        continue
                    self._by_namespace[namespace] = self._by_namespace.get(namespace, 0) + 1
                    entry = (priority, until)
                else:
                    entry = (max(priority, known[0]), max(until, known[1]))
                self._entries[name] = entry
                heapq.heappush(self._expiries, (entry[1], namespace, key))
            return refused

    def release(self, namespace: str, keys: Iterable[bytes]) -> None:
        """Stop retaining `keys` before their TTL runs out."""
        with self._lock:
            for key in keys:
                if self._entries.pop((namespace, key), None) is not None:
                    self._forgot(namespace)

    def forget_namespace(self, namespace: str) -> None:
        """Drop every retention of a namespace (it was purged: its chunks are gone)."""
        with self._lock:
            if self._by_namespace.pop(namespace, None):
                self._entries = {name: entry for name, entry in self._entries.items() if name[0] != namespace}

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


class RetentionOrder(EvictionPolicy):
    """An arena pool's policy with retained chunks evicted last (`retained_last`).

    Wraps the pool's own policy (its recency is kept as is: adds, touches and removals go
    through), so installing it on a live pool loses no order. `key_at(slot)` is the key a
    committed slot holds, `priority(key)` its live retention priority.
    """

    def __init__(self, inner: EvictionPolicy, key_at: Callable[[int], bytes | None], priority: Callable[[bytes], int]):
        self.inner = inner
        self._key_at = key_at
        self._priority = priority

    def add(self, slot: int) -> None:
        self.inner.add(slot)

    def touch(self, slot: int) -> None:
        self.inner.touch(slot)

    def remove(self, slot: int) -> None:
        self.inner.remove(slot)

    def candidates(self) -> Iterator[int]:
        def priority_of(slot: int) -> int:
            key = self._key_at(slot)
            return 0 if key is None else self._priority(key)

        return retained_last(self.inner.candidates(), priority_of)
