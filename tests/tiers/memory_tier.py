"""A test-only lower tier: chunks in a dict. It plugs into the node store by registration
alone (tiers/base.py), with no edit to the store's cascade, promotion or purges."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from kvstrata.tiers.base import Done, Items, LowerTierBase, register_lower_tier
from kvstrata.tiers.changelog import STORAGE

MEMORY = "kvstrata:memory"  # the arena pin holder of copies on their way here


class MemoryTier(LowerTierBase):
    name = "memory"
    local = True
    medium = STORAGE
    holder = MEMORY
    counter = "memory_writes"
    write_policy = "write_through"
    queue_depth = 64

    def __init__(self, ctx):
        self._ctx = ctx
        self.io = ctx.executors("memory", 1)
        self.chunks: dict[tuple[str, bytes], bytes] = {}

    def present(self, namespace: str, keys: Sequence[bytes]) -> set[bytes]:
        return {key for key in keys if (namespace, key) in self.chunks}

    def start_reads(self, namespace: str, pool, items: Items, done: Done) -> None:
        self.io.submit(self._read, namespace, pool, items, done)

    def _read(self, namespace: str, pool, items: Items, done: Done) -> None:
        ok = []
        for key, slot in items:
            data = self.chunks.get((namespace, key))
            if data is not None:
                pool.view(slot)[:] = np.frombuffer(data, dtype=np.uint8)
            ok.append(data is not None)
        done(items, ok, 0.001)

    def submit_writes(self, namespace: str, pool, items: Items, generation: int, done: Done) -> None:
        self.io.submit(self._write, namespace, pool, items, generation, done)

    def _write(self, namespace: str, pool, items: Items, generation: int, done: Done) -> None:
        with self._ctx.lock:  # a purge since the copy was queued: nothing lands
            landed = not self._ctx.generations.purged_since(namespace, generation)
            for key, slot in items if landed else ():
                self.chunks[(namespace, key)] = pool.view(slot).tobytes()
            self._ctx.log(namespace).record_many([key for key, _ in items] if landed else [], STORAGE, True)
        done(items, [landed] * len(items), 0.001)

    def discard(self, namespace: str, keys: Iterable[bytes]) -> None:
        keys = list(keys)
        for key in keys:
            self.chunks.pop((namespace, key), None)
        self._ctx.log(namespace).record_many(list(keys), STORAGE, False)

    def read_many(self, namespace: str, chunks) -> list[bool]:
        ok = []
        for key, buffer in chunks:
            data = self.chunks.get((namespace, key))
            if data is not None:
                buffer[:] = np.frombuffer(data, dtype=np.uint8)
            ok.append(data is not None)
        return ok

    def purge(self, namespace: str, generation: int) -> int:
        gone = [key for ns, key in self.chunks if ns == namespace]
        for key in gone:
            del self.chunks[(namespace, key)]
        self._ctx.log(namespace).record_many(gone, STORAGE, False)
        return len(gone)

    def shutdown(self) -> None:
        self.io.shutdown(wait=True)


register_lower_tier("memory", MemoryTier)
