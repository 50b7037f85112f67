"""Which chunks a namespace holds in which tier, as an ordered log engines catch up on.

Engines mirror this (key -> media) map to answer lookups locally; each reply carries
the changes since the engine's last seen sequence number, or a snapshot when the log
no longer reaches back that far. Entries are (key, medium, present). The log has its
own lock and calls nothing, so tiers may record into it from I/O threads while
holding their own locks.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable

CPU = "CPU"
STORAGE = "STORAGE"  # this node's disk
OBJECT = "OBJECT"  # the object store every node shares
PEER = "PEER"  # another node's arena or disk (learned from the cluster directory)
LOG_LENGTH = 65536

Change = tuple[bytes, str, bool]


class ChangeLog:
    def __init__(self, length: int = LOG_LENGTH):
        self._lock = threading.Lock()
        self._seq = 0
        self._log: deque[tuple[int, bytes, str, bool]] = deque(maxlen=length)
        self._present: dict[tuple[bytes, str], None] = {}
        self._counts: dict[str, int] = {}  # medium -> entries of `_present` in it

    @property
    def seq(self) -> int:
        with self._lock:
            return self._seq

    def record(self, key: bytes, medium: str, present: bool) -> None:
        self.record_many((key,), medium, present)

    def record_many(self, keys: Iterable[bytes], medium: str, present: bool) -> None:
        """Record one change for many keys under one lock (a batch commit or a disk write)."""
        with self._lock:
            known, log, seq = self._present, self._log, self._seq
            first = seq
            for key in keys:
                entry = (key, medium)
                if present == (entry in known):
                    continue
                if present:
                    known[entry] = None
                else:
                    del known[entry]
                seq += 1
                log.append((seq, key, medium, present))
            self._counts[medium] = self._counts.get(medium, 0) + (seq - first if present else first - seq)
            self._seq = seq

    def snapshot(self) -> tuple[int, list[Change]]:
        with self._lock:
            return self._seq, [(key, medium, True) for key, medium in self._present]

    def since(self, seq: int) -> tuple[int, list[Change]] | None:
        """Final state of every (key, medium) changed after `seq`; None if too old to tell."""
        with self._lock:
            if seq == self._seq:
                return self._seq, []
            if seq > self._seq or not self._log or self._log[0][0] > seq + 1:
                return None
            # From the newest back to `seq`: an engine that keeps up costs its few changes,
            # not a walk over the whole log (up to LOG_LENGTH entries) on every step.
            latest: dict[tuple[bytes, str], bool] = {}
            for entry_seq, key, medium, present in reversed(self._log):
                if entry_seq <= seq:
                    break
                latest.setdefault((key, medium), present)
            # In the order of each entry's last change, oldest first.
            return self._seq, [(key, medium, present) for (key, medium), present in reversed(latest.items())]

    def has(self, key: bytes, medium: str) -> bool:
        with self._lock:
            return (key, medium) in self._present

    def count(self, medium: str | None = None) -> int:
        """Entries in `medium` (every medium: None), without walking them (status and metrics ask often)."""
        with self._lock:
            return len(self._present) if medium is None else self._counts.get(medium, 0)

    def present(self, medium: str) -> list[bytes]:
        with self._lock:
            return [key for key, m in self._present if m == medium]
