"""Per replica, what vLLM's own prefix cache (GPU memory) holds: a bounded LRU of block hashes.

Why: no directory sees an engine's own prefix cache, and it is the cheapest tier of all
(no load at all). A router that prices it as "whatever I sent there in the last minute"
(the earlier `RecentPrefixes.prefix_blocks`) believes an engine holds prompts it evicted
long ago: vLLM's cache holds what fits in its GPU blocks, often one or two long prompts
under load. So this view keeps, per replica, the block hashes the router sent there, in
the order last used, and forgets the least recently used past the engine's cache size
(`capacity_tokens`: vLLM logs it at start, "GPU KV cache size: N tokens"). That is vLLM's
own eviction order for blocks no running request holds (its free-block queue is LRU), so
the view is right up to requests routed by others and blocks still held by running
requests; an age limit (`max_age_seconds`) drops what has not been used for long, as an
idle engine's cache is usually taken over by then.

KV events: vLLM 0.32 emits `BlockStored` / `BlockRemoved` / `AllBlocksCleared` for its GPU
blocks (`vllm/distributed/kv_events.py`, `medium="GPU"`) over ZMQ when `kv_events_config`
is set. `apply_events` takes them (block hashes as bytes), replacing the guess with the
engine's word for that replica; subscribing to each engine's ZMQ publisher is left to the
deployment (not built: Serve LLM exposes no per-replica endpoint to the router).

Invariants: a replica's entries never exceed its capacity (in tokens); `prefix_blocks`
counts only a contiguous run from the prompt's first block; plain Python, injected clock;
not thread-safe (the router's event loop only).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence


class EngineCacheView:
    def __init__(
        self,
        capacity_tokens: int | None = None,
        max_age_seconds: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        if capacity_tokens is not None and capacity_tokens <= 0:
            raise ValueError(f"kvstrata router: engine_cache_tokens must be > 0, not {capacity_tokens}")
        self._capacity = capacity_tokens
        self._max_age = max_age_seconds
        self._clock = clock
        # replica -> block hash -> (tokens it covers, when last used); least recent first.
        self._blocks: dict[Hashable, OrderedDict[bytes, tuple[int, float]]] = {}
        self._tokens: dict[Hashable, int] = {}
        self.evicted = 0  # blocks dropped for capacity (what a time window would have kept)

    def add(self, replica: Hashable, block_hashes: Sequence[bytes], tokens_per_block: int) -> None:
        """The router sent a prompt with these blocks (in prefix order) to `replica`: its
        engine computes or reuses them, so they are now its most recently used. vLLM frees a
        finished request's blocks tail first, so its prefix is evicted last: the same here."""
        self.stored(replica, list(block_hashes)[::-1], tokens_per_block)

    def stored(self, replica: Hashable, block_hashes: Iterable[bytes], tokens_per_block: int) -> None:
        now = self._clock()
        blocks = self._blocks.setdefault(replica, OrderedDict())
        for block in block_hashes:
            old = blocks.pop(block, None)
            if old is not None:
                self._tokens[replica] -= old[0]
            blocks[block] = (tokens_per_block, now)
            self._tokens[replica] = self._tokens.get(replica, 0) + tokens_per_block
        self._trim(replica, now)

    def removed(self, replica: Hashable, block_hashes: Iterable[bytes]) -> None:
        blocks = self._blocks.get(replica)
        if not blocks:
            return
        for block in block_hashes:
            old = blocks.pop(block, None)
            if old is not None:
                self._tokens[replica] -= old[0]

    def cleared(self, replica: Hashable) -> None:
        self._blocks.pop(replica, None)
        self._tokens.pop(replica, None)

    def apply_events(self, replica: Hashable, events: Iterable[object], tokens_per_block: int) -> None:
        """vLLM KV events of `replica`'s engine (`BlockStored`, `BlockRemoved`,
        `AllBlocksCleared`, or objects with the same fields); events of other media
        (an offloading connector's `CPU` / `STORAGE`) are not this cache's."""
        for event in events:
            kind = type(event).__name__
            medium = getattr(event, "medium", None)
            if medium not in (None, "GPU"):
                continue
            hashes = [_as_bytes(h) for h in getattr(event, "block_hashes", ())]
            if kind == "BlockStored":
                self.stored(replica, hashes, getattr(event, "block_size", tokens_per_block) or tokens_per_block)
            elif kind == "BlockRemoved":
                self.removed(replica, hashes)
            elif kind == "AllBlocksCleared":
                self.cleared(replica)

    def prefix_blocks(self, replica: Hashable, block_hashes: Sequence[bytes]) -> int:
        """How many of the prompt's first blocks `replica`'s engine holds, in a row."""
        blocks = self._blocks.get(replica)
        if not blocks:
            return 0
        since = self._clock() - self._max_age
        count = 0
        for block in block_hashes:
            entry = blocks.get(block)
            if entry is None or entry[1] < since:
                break
            count += 1
        return count

    def tokens(self, replica: Hashable) -> int:
        return self._tokens.get(replica, 0)

    def forget(self, keep: set[Hashable]) -> None:
        for replica in [r for r in self._blocks if r not in keep]:
            self.cleared(replica)

    def _trim(self, replica: Hashable, now: float) -> None:
        blocks = self._blocks[replica]
        since = now - self._max_age
        while blocks:
            oldest = next(iter(blocks))
            tokens, used = blocks[oldest]
            over = self._capacity is not None and self._tokens[replica] > self._capacity
            if not over and used >= since:
                break
            del blocks[oldest]
            self._tokens[replica] -= tokens
            self.evicted += over


def _as_bytes(block_hash: object) -> bytes:
    if isinstance(block_hash, bytes):
        return block_hash
    if isinstance(block_hash, int):  # vLLM's ExternalBlockHash may be an int
        return block_hash.to_bytes(max(1, (block_hash.bit_length() + 7) // 8), "big")
    return bytes(block_hash)  # type: ignore[call-overload]
