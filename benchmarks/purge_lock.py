"""How long a purge holds the node store's lock, against the per-chunk wipe it replaced.

    python benchmarks/purge_lock.py [--chunks 20000] [--json out.json]

One in-process node store (no Ray, no engine) with a disk tier. Two namespaces get the same
number of chunks on disk. The reference is the purge of issue #37's finding: one header
wipe per chunk (`DiskTier.remove`, what `_purge` did under the store lock), run on the
first namespace; then `NodeStore.purge` of the second, which holds the store lock for all
of its run. Every engine's control call waits that long; the issue measured ~109 us per
chunk, 30 s for a 276k-chunk disk tier, past the default lease.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from kvstrata.store.node_store import NodeStore
from kvstrata.keys import make_key

SLOT = 4096
BATCH = 1024


def fill(store: NodeStore, namespace: str, chunks: int) -> list[bytes]:
    store.register(f"bench-{namespace}", namespace, SLOT)
    keys = [make_key(f"{namespace}-{i}".encode().ljust(32, b"\0"), 0) for i in range(chunks)]
    payload = np.arange(SLOT, dtype=np.uint8)
    for start in range(0, chunks, BATCH):
        stored = store.disk.write_many(namespace, [(k, payload) for k in keys[start : start + BATCH]])
        assert all(stored), "the disk tier refused chunks: raise its capacity"
    return keys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=20000)
    parser.add_argument("--json", type=Path)
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvstrata-purge-bench-") as tmp:
        work = Path(tmp)
        config = {
            "tiers": {
                "cpu": {"capacity": 64 * SLOT, "segment_size": 16 * SLOT, "shm_dir": str(work / "shm"), "prefault": False},
                "disk": {"path": str(work / "disk"), "capacity": 4 * args.chunks * 2 * SLOT},
            },
        }
        (work / "shm").mkdir()
        store = NodeStore(config, "bench")
        try:
            old_keys = fill(store, "bench-reference", args.chunks)
            fill(store, "bench-purged", args.chunks)
            started = time.perf_counter()
            with store._lock:  # what the last design did under the store lock
                wiped = sum(store.disk.remove("bench-reference", k) for k in old_keys)
            reference = time.perf_counter() - started
            started = time.perf_counter()
            purged = store.purge("bench-purged")
            now = time.perf_counter() - started
            assert wiped == purged == args.chunks and store.disk.keys("bench-purged") == []
        finally:
            store.close()
    row = {
        "chunks": args.chunks,
        "reference_s": reference,
        "reference_us_per_chunk": reference / args.chunks * 1e6,
        "purge_s": now,
        "purge_us_per_chunk": now / args.chunks * 1e6,
        "speedup": reference / now,
    }
    print(
        f"{args.chunks} disk chunks: per-chunk header wipe {reference:.3f} s ({row['reference_us_per_chunk']:.1f} us/chunk); "
        f"NodeStore.purge {now:.3f} s ({row['purge_us_per_chunk']:.2f} us/chunk), {row['speedup']:.0f}x shorter under the store lock"
    )
    if args.json:
        args.json.write_text(json.dumps(row, indent=2))


if __name__ == "__main__":
    main()
