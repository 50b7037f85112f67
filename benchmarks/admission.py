"""Reuse-aware admission on a trace of mostly one-off prompts: writes saved, hits kept.

    python benchmarks/admission.py [--requests 2000] [--one-off 0.7] [--json out.json]

One in-process node store (no Ray, no engine): a small arena, a disk tier and a `file://`
object store, both `write_through`. Engines are stood in for by direct step calls, as
an engine's manager makes them: each request pins its prompt's chunks in prefix order
(waiting while the store promotes from disk or the bucket), then stores the chunks after
its hit. `--one-off` of the requests are prompts seen once; the rest draw uniformly from
`--repeated` prompts. The same trace runs with `admission.store.disk/object` both
`always`, both `reuse` (min_uses 2), and disk `always` with object `reuse`; the table gives
disk writes, object PUTs and hit tokens of each.

Goal (issue #28): with `reuse`, >= 50 % fewer writes and <= 5 % fewer hit tokens.

The load-or-recompute half (TTFT of `always` vs `break_even` vs no object tier at three
object-store bandwidths on a real engine) is benchmarks/admission_load.py.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from kvstrata.store.node_store import NodeStore
from kvstrata.protocol import StepRequest
from kvstrata.keys import make_key

SLOT = 4096
TOKENS_PER_CHUNK = 32
NAMESPACE = "bench-admission"


def trace(requests: int, one_off: float, repeated: int, chunks: int, seed: int) -> list[list[bytes]]:
    """Each request's chunk keys; a chunk's key names its whole prefix (as vLLM's do)."""
    rng = np.random.default_rng(seed)
    pool = [[make_key(f"r{p}-{c}".encode().ljust(32, b"\0"), 0) for c in range(chunks)] for p in range(repeated)]
    out = []
    for i in range(requests):
        if rng.random() < one_off:
            out.append([make_key(f"o{i}-{c}".encode().ljust(32, b"\0"), 0) for c in range(chunks)])
        else:
            out.append(pool[int(rng.integers(0, repeated))])
    return out


def run(disk: str, bucket: str, requests: list[list[bytes]], workdir: Path, arena_slots: int) -> dict[str, float]:
    config = {
        "tiers": {
            "cpu": {"capacity": arena_slots * SLOT, "segment_size": 16 * SLOT, "shm_dir": str(workdir / "shm"), "prefault": False},
            "disk": {"path": str(workdir / "disk"), "capacity": 1 << 30, "write_policy": "write_through"},
            "object": {"url": f"file://{workdir / 'bucket'}", "write_policy": "write_through", "queue_depth": 4096},
        },
        "engine": {"reserve_slots": 8},
        "admission": {"store": {"disk": disk, "object": bucket, "min_uses": 2}},
    }
    (workdir / "shm").mkdir(parents=True, exist_ok=True)
    store = NodeStore(config, "bench-node")
    try:
        registration = store.register("engine", NAMESPACE, SLOT)
        epoch = registration.epoch
        pool = store.arena.pools[NAMESPACE]

        def step(**fields) -> object:
            return store.step(StepRequest("engine", NAMESPACE, epoch=epoch, **fields))

        hit_chunks = 0
        started = time.perf_counter()
        for keys in requests:
            pinned: dict[bytes, int] = {}
            wanted = list(keys)
            for _ in range(100):  # bounded: a promotion that never lands is a miss
                reply = step(pin=wanted)
                pinned.update(reply.pinned)
                wanted = list(reply.pending)
                if not wanted:
                    break
                store.wait_io(30)
            hit = 0
            while hit < len(keys) and keys[hit] in pinned:
                hit += 1
            hit_chunks += hit
            if pinned:
                step(unpin=list(pinned.values()))
            rest = keys[hit:]
            while rest:
                slots = step(reserve=len(rest)).reserved
                if not slots:
                    break
                for slot in slots:
                    pool.view(slot)[:] = 7
                batch = list(zip(slots, rest))
                step(commit=batch)
                step(unpin=slots)
                rest = rest[len(slots) :]
        store.wait_io(60)
        elapsed = time.perf_counter() - started
        stats = store.stats()
        return {
            "disk_writes": stats["disk_writes_queued"],
            "object_puts": stats["object_uploads_queued"],
            "hit_tokens": hit_chunks * TOKENS_PER_CHUNK,
            "writes_skipped": stats["disk_writes_skipped_reuse"] + stats["object_uploads_skipped_reuse"],
            "seconds": elapsed,
        }
    finally:
        store.close()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--one-off", type=float, default=0.7)
    parser.add_argument("--repeated", type=int, default=100, help="distinct prompts the other requests repeat")
    parser.add_argument("--chunks", type=int, default=8, help="chunks per prompt")
    parser.add_argument("--arena-slots", type=int, default=256)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, help="also write the results here")
    return parser


def main() -> int:
    parser = build_parser()
    args = parser.parse_args()
    requests = trace(args.requests, args.one_off, args.repeated, args.chunks, args.seed)
    results = {}
    for disk, bucket in (("always", "always"), ("reuse", "reuse"), ("always", "reuse")):
        with tempfile.TemporaryDirectory(prefix="kvstrata-bench-admission-") as workdir:
            results[f"disk {disk}, object {bucket}"] = run(disk, bucket, requests, Path(workdir), args.arena_slots)
    always, reuse = results["disk always, object always"], results["disk reuse, object reuse"]
    table = Table(
        title=f"{args.requests} requests x {args.chunks} chunks, {args.one_off:.0%} one-off, arena {args.arena_slots} slots"
    )
    for column in ("admission.store", "disk writes", "object PUTs", "hit tokens", "seconds"):
        table.add_column(column, justify="left" if column == "admission.store" else "right")
    for policy, row in results.items():
        table.add_row(policy, str(row["disk_writes"]), str(row["object_puts"]), str(row["hit_tokens"]), f"{row['seconds']:.1f}")
    def writes(row: dict[str, float]) -> float:
        return row["disk_writes"] + row["object_puts"]

    fewer_writes = 1 - writes(reuse) / max(1, writes(always))
    fewer_hits = 1 - reuse["hit_tokens"] / max(1, always["hit_tokens"])
    console = Console()
    console.print(table)
    console.print(f"reuse vs always: {fewer_writes:.0%} fewer writes, {fewer_hits:.1%} fewer hit tokens")
    mixed = results["disk always, object reuse"]
    console.print(
        f"disk always + object reuse vs always: {1 - mixed['object_puts'] / max(1, always['object_puts']):.0%} fewer PUTs, "
        f"{1 - mixed['hit_tokens'] / max(1, always['hit_tokens']):.1%} fewer hit tokens"
    )
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
