"""How often a chunk was used lately: a count-min sketch with aging (TinyLFU-style).

Why: with `admission.store: reuse` a chunk is written to disk or the object store only
when it has been used at least `min_uses` times within the last `window` uses of its
namespace. Most one-off prompts then cost no disk write and no PUT, and they do not
evict chunks that will be read again. Counting exactly would cost memory per distinct
key; the sketch costs a fixed `depth x width` bytes however many keys pass through.

How: `depth` rows of `width` 8-bit saturating counters; a key (digested to 64 bits)
bumps one counter per row, chosen by a multiply-shift hash with a per-row odd multiplier; its count is the smallest of its counters. Every `window`
additions all counters halve (the TinyLFU reset), so old popularity fades.

Invariants: memory is `depth * width` bytes from construction on; `count(k)` never
under-counts the uses of `k` since the last reset but by halving (never 0 for a key
used twice since the last halving, never more than 255); `add_many` and `counts` are
vectorised (numpy), so a million keys cost milliseconds. Not thread-safe: the node
store calls it under its lock. Must not: import Ray or vLLM.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

# Odd 64-bit multipliers, one per row (from splitmix64's constants and their products).
_MULTIPLIERS = np.array(
    [0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0xD6E8FEB86659FD93,
     0xA0761D6478BD642F, 0xE7037ED1A0B428DB, 0x8EBC6AF09C88C6E3, 0x589965CC75374CC3],
    dtype=np.uint64,
)  # fmt: skip


_MASK64 = (1 << 64) - 1
SCALAR_KEYS = 4  # at most this many keys are counted in plain Python (`FrequencySketch.counts`)


def keys_to_u64(keys: Sequence[bytes]) -> np.ndarray:
    """Each whole key (block hash and group) digested to a uint64.

    Not just the key's first bytes: a hybrid model's groups share their block hash, and
    one use of a position would then count once per group.
    """
    raw = b"".join(hashlib.blake2b(key, digest_size=8).digest() for key in keys)
    return np.frombuffer(raw, dtype="<u8") if raw else np.zeros(0, dtype=np.uint64)


class FrequencySketch:
    """Count-min sketch of uint64 keys with 8-bit counters that halve every `window` additions."""

    def __init__(self, window: int, depth: int = 4):
        if not 1 <= depth <= len(_MULTIPLIERS):
            raise ValueError(f"depth must be 1..{len(_MULTIPLIERS)}")
        # About one counter per use in a window per row: collisions stay rare.
        self.bits = max(10, int(window - 1).bit_length())
        self.width = 1 << self.bits
        self.window = window
        self._table = np.zeros((depth, self.width), dtype=np.uint8)
        self._rows = np.arange(depth)[:, None]
        self._multipliers = _MULTIPLIERS[:depth, None]
        self._since_reset = 0

    @property
    def nbytes(self) -> int:
        return self._table.nbytes

    def _index(self, hashed: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            return ((hashed[None, :] * self._multipliers) >> np.uint64(64 - self.bits)).astype(np.intp)

    def add_many(self, hashed: np.ndarray) -> None:
        """One use of each key (uint64 hashes; see `keys_to_u64`), in order, halving every `window`."""
        start = 0
        while start < len(hashed):
            take = min(len(hashed) - start, self.window - self._since_reset)
            self._add(hashed[start : start + take])
            start += take
            self._since_reset += take
            if self._since_reset >= self.window:
                self._table >>= 1
                self._since_reset = 0

    def _add(self, hashed: np.ndarray) -> None:
        flat = (self._index(hashed) + self._rows * self.width).ravel()
        table = self._table.reshape(-1)
        # A key used twice in one batch counts twice; counters saturate at 255.
        if len(flat) * 8 < table.size:  # a step's few chunks: touch only their cells
            cells, times = np.unique(flat, return_counts=True)
            table[cells] = np.minimum(table[cells].astype(np.int64) + times, 255).astype(np.uint8)
        else:  # a bulk load: one pass over the table beats sorting the batch
            table[:] = np.minimum(table + np.bincount(flat, minlength=table.size), 255)

    def counts(self, hashed: np.ndarray) -> np.ndarray:
        """Estimated uses of each key since the last halvings (never fewer, bar halving)."""
        if len(hashed) == 0:
            return np.zeros(0, dtype=np.uint8)
        if len(hashed) <= SCALAR_KEYS:
            # One chunk evicted, one written: a handful of numpy calls cost ~20x the
            # arithmetic (benchmarks/trace_replay.py: the write-back path asks per chunk).
            shift, table = 64 - self.bits, self._table
            rows = list(enumerate(self._multipliers[:, 0].tolist()))
            found = [min(int(table[row, ((key * odd) & _MASK64) >> shift]) for row, odd in rows) for key in hashed.tolist()]
            return np.array(found, dtype=np.uint8)
        index = self._index(hashed)
        return self._table[np.broadcast_to(self._rows, index.shape), index].min(axis=0)


class ReuseCounter:
    """Uses of chunks per namespace, and which were used often enough to write down.

    Why per namespace: namespaces (models, tenants) have their own traffic; one busy
    namespace's one-offs must not age out another's reused prefixes. Memory is one
    sketch (`depth x width` bytes) per namespace that ever counted a use.
    """

    def __init__(self, window: int, min_uses: int, depth: int = 4):
        self.window = window
        self.min_uses = min_uses
        self.depth = depth
        self._sketches: dict[str, FrequencySketch] = {}

    @property
    def nbytes(self) -> int:
        return sum(sketch.nbytes for sketch in self._sketches.values())

    def note(self, namespace: str, keys: Sequence[bytes]) -> list[bool]:
        """Count one use of each key; whether each has now been used `min_uses` times."""
        if not keys:
            return []
        sketch = self._sketches.get(namespace)
        if sketch is None:
            sketch = self._sketches[namespace] = FrequencySketch(self.window, self.depth)
        hashed = keys_to_u64(keys)
        sketch.add_many(hashed)
        return (sketch.counts(hashed) >= self.min_uses).tolist()

    def estimate(self, namespace: str, keys: Sequence[bytes]) -> list[int]:
        """Each key's estimated uses lately (counts nothing; 0 in a namespace never seen).

        Read by the disk's and the object tier's evictions from their own threads (outside
        the store lock): a count read while the
        store adds to the sketch is at worst one use stale, which only reorders ties.
        """
        sketch = self._sketches.get(namespace)
        if sketch is None or not keys:
            return [0] * len(keys)
        return sketch.counts(keys_to_u64(keys)).tolist()

    def reused(self, namespace: str, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key has been used `min_uses` times lately (counts nothing)."""
        sketch = self._sketches.get(namespace)
        if sketch is None or not keys:
            return [False] * len(keys)
        return (sketch.counts(keys_to_u64(keys)) >= self.min_uses).tolist()
