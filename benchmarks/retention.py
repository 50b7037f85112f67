"""A retained system prompt against a flood of one-off prompts ten times the arena (kv.retain).

    python benchmarks/retention.py [--arena-chunks 64] [--system-chunks 8] [--flood-x 10]

A node store in this process (its arena in a temporary directory of /dev/shm, no other
tier), an engine's calls made directly: a system prompt of `--system-chunks` chunks is
stored, then one-off prompts worth `--flood-x` arenas, 4 chunks each, with no request
using the system prompt meanwhile (a burst of other traffic; a prompt used between
every one-off stays recent and LRU keeps it anyway). After every one-off we look whether
a request for the system prompt would be a hit: all its chunks still in the arena
(vLLM's lookup is a prefix); looking does not touch it. Three cases
in one run, on the same flood: no hint (plain LRU, the reference), `kv.retain` (priority
80, a TTL longer than the run), and a retention whose TTL runs out half-way (the store's
clock is advanced). Printed: the share of moments in each half of the flood at which it would have been a hit.
"""

from __future__ import annotations

import argparse
import hashlib
import tempfile
from typing import Any

from kvstrata.store.node_store import NodeStore
from kvstrata.protocol import StepRequest
from kvstrata.config import load_config
from kvstrata.keys import make_key

SLOT = 64 * 1024


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def key(name: str) -> bytes:
    return make_key(hashlib.sha256(name.encode()).digest(), 0)


def run(case: str, args: argparse.Namespace) -> dict[str, Any]:
    clock = Clock()
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="kvstrata-bench-retention-") as shm:
        raw = {"tiers": {"cpu": {"capacity": args.arena_chunks * SLOT, "segment_size": args.arena_chunks * SLOT,
                                 "shm_dir": shm, "prefault": False}}, "engine": {"lease_seconds": 1e6}}  # fmt: skip
        store = NodeStore(load_config(raw), "bench", clock=clock)
        try:
            namespace = "bench-ns"
            epoch = store.register("engine", namespace, SLOT).epoch
            pool = store.arena.pools[namespace]

            def stored(keys: list[bytes]) -> None:
                slots = pool.reserve("engine", len(keys))
                store.step(StepRequest("engine", namespace, epoch=epoch, commit=list(zip(slots, keys))))
                store.step(StepRequest("engine", namespace, epoch=epoch, unpin=slots))

            system = [key(f"system-{i}") for i in range(args.system_chunks)]
            stored(system)
            prompts = args.flood_x * args.arena_chunks // 4
            if case != "lru":
                ttl = prompts / 2 + 0.5 if case == "expiring" else 10 * prompts  # one clock second per prompt
                store.retain(namespace, system, 80, ttl)
            hits = []
            for n in range(prompts):
                clock.now += 1.0
                stored([key(f"one-off-{n}-{i}") for i in range(4)])
                hits.append(all(k in pool for k in system))  # looked at, not used: no request touches it meanwhile
        finally:
            store.close()
    half = len(hits) // 2
    return {"first_half": sum(hits[:half]) / half, "second_half": sum(hits[half:]) / (len(hits) - half), "prompts": prompts}


def build_parser() -> argparse.ArgumentParser:
    """The command line (tests/docs/test_doc_commands.py checks the docs' commands against it)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arena-chunks", type=int, default=64)
    parser.add_argument("--system-chunks", type=int, default=8)
    parser.add_argument("--flood-x", type=int, default=10)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    for case in ("lru", "retained", "expiring"):
        result = run(case, args)
        print(f"{case:9s} system prompt hit rate over a flood of {result['prompts']} one-off prompts "
              f"({args.flood_x}x the arena): first half {result['first_half']:.0%}, second half {result['second_half']:.0%}")  # fmt: skip


if __name__ == "__main__":
    main()
