"""How the exactness matrix makes one tier the only holder of a cell's chunks, and keeps
one engine's cells from being moved by what earlier engines left in the store.

`force_tier`: arena (as stored), disk and bucket (filler prompts push the chunks down the
cascade), peer (copied into the other node's store, then purged here). `clean_slate`:
before an engine starts, the stopped engines' namespaces are dropped from this node's
store, except the TP 2 chunks the `2>1` cells of a later engine ask about.

These are functions of the `Matrix` (exactness_run.py): its store handles, `snapshot`,
its engine steps (`tick`, `filler`) and its counters (`_moves`, `_retained`).
"""

from __future__ import annotations

import os
import time
from typing import Any

Chunks = set[tuple[str, bytes]]


def force_tier(matrix: Any, llm: Any, tier: str, chunks: Chunks) -> str | None:
    """Make `tier` the only one of this node holding `chunks`; a reason if it could not."""
    if not chunks:
        return None
    if tier == "arena":
        return None if chunks <= matrix.snapshot() else "not all chunks in the arena"
    if tier == "disk":
        on_disk_only = lambda: (chunks & matrix.snapshot("STORAGE")) - matrix.snapshot()  # noqa: E731
        if not fill(matrix, llm, lambda: not chunks & matrix.snapshot(), arrived=on_disk_only):
            return "chunks still in the arena after the fillers"
        return None if chunks <= matrix.snapshot("STORAGE") else "chunks pushed off the disk too"
    if tier == "bucket":
        if not fill(matrix, llm, lambda: not chunks & (matrix.snapshot() | matrix.snapshot("STORAGE")), batches=40):
            return "chunks still in the arena or on disk after the fillers"
        return None if chunks <= matrix.snapshot("OBJECT") else "chunks not in the bucket"
    if tier == "peer":
        return move_to_peer(matrix, llm, chunks)
    raise ValueError(tier)


def fill(matrix: Any, llm: Any, gone: Any, batches: int = 10, arrived: Any = None) -> bool:
    """Filler prompts (7 chunks each, never seen before; 4 a batch) until `gone()` holds,
    checked after each prompt: a batch at once overran the disk behind the arena.

    `arrived()`: the cell's chunks already where they should stay (on disk, no longer in
    the arena). The disk evicts a namespace's own oldest chunks when it cannot grow its
    slabs, and those are the cell's, which left the arena first: each is retained there
    (kvstrata's `kv.retain`, priority 100) as it arrives, so the disk evicts the fillers
    first (28 Nov: the sliding-window model's disk cells lost them); `Matrix.run_cell`
    ends that retention after the cell."""
    import ray

    for _ in range(batches * 4):
        ray.get(matrix.store.wait_io.remote(60))
        if arrived is not None:
            retain(matrix, arrived() - matrix._retained)
        if gone():
            return True
        matrix.filler(llm)
    ray.get(matrix.store.wait_io.remote(60))
    return gone()


def retain(matrix: Any, chunks: Chunks, priority: int = 100) -> None:
    """Retention at `priority` for `chunks` (0 ends it), remembered in `matrix._retained`."""
    import ray

    for namespace in {ns for ns, _ in chunks}:
        ray.get(matrix.store.retain.remote(namespace, [key for ns, key in chunks if ns == namespace], priority, 600.0))
    if priority:
        matrix._retained |= chunks
    else:
        matrix._retained -= chunks


def release_pins(matrix: Any, llm: Any, ticks: int = 20) -> int:
    """Step the engine (one-token prompts of no whole chunk) until no engine on this node
    pins a chunk, at most `ticks` times; the pins left.

    Why: a purge drops a chunk an engine pins only when the engine lets it go (the arena
    keeps a pinned slot's bytes), and the engine still answers HIT from its own pin. An
    engine releases the pins of finished requests at a step's end, once the commits they
    came from are answered: an idle engine keeps them, and answers HIT from them after a
    purge (28 Nov: a peer cell served from this node's arena, no promotion from the peer)."""
    import ray

    left = -1
    for tick in range(ticks + 1):
        ray.get(matrix.store.wait_io.remote(60))
        engines = ray.get(matrix.store.stats.remote()).get("engines", {})
        left = sum(e["pinned"] for holder, e in engines.items() if not holder.startswith("exactness-"))
        if not left or tick == ticks:
            break
        matrix.tick(llm, seed=tick)
    return left


def move_to_peer(matrix: Any, llm: Any, chunks: Chunks) -> str | None:
    """Copy `chunks` into the peer node's store, then purge them here (arena, disk, bucket)."""
    import ray

    from kvstrata._dev.testing import ChunkProbe

    if pinned := release_pins(matrix, llm):
        return f"the engine still pins {pinned} chunks after its steps"
    for namespace in {ns for ns, _ in chunks}:
        keys = [key for ns, key in chunks if ns == namespace]
        found, _, arrays = ray.get(matrix.store.export_chunks.remote(namespace, keys), timeout=60)
        if len(found) != len(keys):
            return f"{len(keys) - len(found)} chunks could not be exported"
        os.environ["KVSTRATA_NODE_ID"] = matrix.peer
        try:
            # No layout: the peer store takes the namespace as named (the head's engine registered it).
            # A holder of its own per move: a second move into the same namespace was
            # refused as another engine's registration (28 Nov 2026).
            matrix._moves += 1
            probe = ChunkProbe(f"exactness-{namespace[:8]}-{matrix._moves}", namespace, int(arrays[0].nbytes), None)
        finally:
            os.environ["KVSTRATA_NODE_ID"] = matrix.head
        try:
            written = 0
            while written < len(found):
                slots = probe._step(reserve=len(found) - written).reserved
                if not slots:
                    return "the peer's arena reserved no slot"
                batch = list(zip(slots, found[written:], arrays[written:]))
                for slot, _, data in batch:
                    probe._view(slot)[:] = data
                probe._step(commit=[(slot, key) for slot, key, _ in batch])
                probe._step(unpin=[slot for slot, _, _ in batch])
                written += len(batch)
        finally:
            probe.close()
        ray.get(matrix.store.purge.remote(namespace))
    namespaces = {ns for ns, _ in chunks}
    deadline = time.monotonic() + 30
    while not chunks <= matrix.snapshot("PEER", namespaces):
        if time.monotonic() > deadline:
            return "this node never learned that the peer holds the chunks"
        time.sleep(0.1)  # the directory syncs every 0.1 s; bounded above
    if chunks & (matrix.snapshot("CPU", namespaces) | matrix.snapshot("STORAGE", namespaces)):
        return "chunks still held on this node after the purge"
    # The engine answers HIT from its mirror until it has seen the purge (the arena keeps a
    # dropped slot's bytes for it meanwhile: deferred slot reuse), and such a hit is served
    # here, not from the peer (28 Nov: three sliding-window peer cells). Its heartbeat
    # acknowledges the purge within IDLE_ACK_SECONDS; its next pass applies it first.
    while any(ray.get(matrix.store.stats.remote())["pools"].get(ns, {}).get("awaiting_reuse", 0) for ns in namespaces):
        if time.monotonic() > deadline:
            return "the engine never acknowledged the purge"
        time.sleep(0.05)  # bounded by the same deadline
    return None


def clean_slate(matrix: Any) -> int:
    """Drop every namespace from this node's store (arena, disk, bucket) except those of
    the chunks `2>1` cells still ask about (`matrix.other_chunks`); the chunks dropped.
    The peer's store is left as it is: each peer cell writes its own chunks there.

    Why: the disk grows a namespace's slabs only while it has room, and evicts the
    namespace's own oldest chunks when it cannot; with the disk full of stopped engines'
    slabs, a later engine's disk cells lost their chunks to their own fillers (28 Nov: the
    sliding-window model's, after the dense model's engines). Each engine now starts on an
    empty store, as a cell's result must not depend on the cells before it."""
    import ray

    keep = {ns for chunks in getattr(matrix, "other_chunks", {}).values() for ns, _ in chunks}
    stats = ray.get(matrix.store.stats.remote())
    dropped = 0
    for namespace in sorted((set(stats.get("pools", {})) | set(stats.get("namespaces", {}))) - keep):
        dropped += ray.get(matrix.store.purge.remote(namespace))
    ray.get(matrix.store.wait_io.remote(60))
    return dropped

