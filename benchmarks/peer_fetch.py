"""Cross-node peer fetch throughput, beside Ray's own object transfer in the same run.

    python benchmarks/peer_fetch.py [--total-mib 128] [--rounds 3] [--out DIR]

Two simulated nodes (`ray.cluster_utils.Cluster`, loopback). Node A's store holds the
chunks (written through a worker-level probe); node B's store is asked to pin them, so
it fetches them from A (one Ray call per `fetch_batch_bytes`), verifies each chunk's
xxh3-128 and commits it into its arena; the clock stops when B reports no promotion in
flight. Reference: the same bytes, in the same batch sizes, `ray.put` by an actor on A
that holds them in memory and `ray.get` by a task on B (Ray's object store and transfer,
no lookups, no verification), timed from the first put to the last byte on B.
A warm-up round per chunk size first (arenas map and touch their segments once, as a
long-running store has); then medians of interleaved rounds. Besides the printed table it
writes peer_fetch.csv, .md and .png (GB/s against chunk size, the reference beside
kvstrata) into --out (benchmarks/results/).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np
import ray
from plotting import Line, Panel, Results, add_out_argument, run_title, write_results
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from kvstrata.actors.client import get_node_store
from kvstrata.actors.cluster import down, up
from kvstrata.protocol import StepRequest
from kvstrata.config import load_config
from kvstrata.keys import make_key
from kvstrata._dev.testing import ChunkProbe

BATCH = 64 << 20


def on(node_id: str) -> dict:
    return {"num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)}


class BytesOnNode:
    """Bytes resident in one process on node A, like a store's arena."""

    def __init__(self, nbytes: int):
        self.data = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)

    def put_batches(self, sizes: list[int]) -> list:
        refs, offset = [], 0
        for size in sizes:
            refs.append(ray.put(self.data[offset : offset + size]))
            offset += size
        return refs


@ray.remote
def get_batches(refs: list) -> int:
    return sum(array.nbytes for array in ray.get(refs))


def ray_transfer(source, node_b: str, total: int) -> float:
    """ray.put on node A, then ray.get on node B, of the same bytes in the same batches."""
    sizes = [min(BATCH, total - offset) for offset in range(0, total, BATCH)]
    start = time.perf_counter()
    refs = ray.get(source.put_batches.remote(sizes))
    assert ray.get(get_batches.options(**on(node_b)).remote(refs)) == total
    return time.perf_counter() - start


def peer_fetch(writer, node_a: str, node_b: str, namespace: str, chunk: int, count: int, round_: int) -> float:
    keys = [make_key((round_ * 1_000_000 + i).to_bytes(32, "big"), 0) for i in range(count)]
    ray.get(writer.store_chunks.remote(keys, round_))
    reader_store = get_node_store(node_b)
    registration = ray.get(reader_store.register.remote("bench-reader", namespace, chunk))
    deadline = time.monotonic() + 60
    while not set(keys) <= set(ray.get(reader_store.keys.remote(namespace, "PEER"))):  # B learns A's chunks
        assert time.monotonic() < deadline, f"node B never learned node A's chunks: {ray.get(reader_store.stats.remote())['peers']}"
        time.sleep(0.05)
    epoch = registration.epoch
    start = time.perf_counter()
    reply = ray.get(reader_store.step.remote(StepRequest("bench-reader", namespace, epoch=epoch, pin=keys)))
    assert len(reply.pending) == count, "every chunk should be fetched from the peer"
    assert ray.get(reader_store.wait_io.remote(120))
    elapsed = time.perf_counter() - start
    pinned = ray.get(reader_store.step.remote(StepRequest("bench-reader", namespace, epoch=epoch, pin=keys))).pinned
    assert len(pinned) == count, "fetched chunks should be resident on node B"
    ray.get(reader_store.step.remote(StepRequest("bench-reader", namespace, epoch=epoch, unpin=list(pinned.values()))))
    # Both arenas forget them; their segments stay mapped and warm, as in a long-running store.
    ray.get([reader_store.purge.remote(namespace), get_node_store(node_a).purge.remote(namespace)])
    return elapsed


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total-mib", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    add_out_argument(parser)
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    columns = ["chunk KiB", "kvstrata GB/s", "ray put+get GB/s", "ratio"]
    results = Results("peer_fetch", run_title("peer_fetch.py", args), columns)
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    total = args.total_mib << 20
    with tempfile.TemporaryDirectory(prefix="kvstrata-bench-", dir="/dev/shm") as shm_dir:
        config = load_config(
            {
                "tiers": {"cpu": {"capacity": 3 * total + (256 << 20), "segment_size": 256 << 20, "shm_dir": shm_dir}},
                "cluster": {"directory_shards": 2, "sync_seconds": 0.05, "fetch_batch_bytes": BATCH, "call_timeout_seconds": 60},
                "engine": {"reserve_slots": 1024},
            }
        )
        # Object stores big enough that the reference never spills (measured: it does at 256 MiB
        # with the defaults, and drops to ~0.1 GB/s).
        store_memory = max(1 << 30, 4 * total)
        sim = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 2, "include_dashboard": False, "object_store_memory": store_memory},
        )
        try:
            sim.add_node(num_cpus=1, object_store_memory=store_memory)
            ray.init(address=sim.address, log_to_driver=False)
            sim.wait_for_nodes()
            node_a, node_b = up(config)["nodes"]
            print(f"peer fetch between 2 simulated nodes, {args.total_mib} MiB per measurement, "
                  f"{BATCH >> 20} MiB per fetch call, medians of {args.rounds} rounds")  # fmt: skip
            print(f"{'chunk':>8} {'kvstrata GB/s':>14} {'ray put+get GB/s':>17} {'ratio':>6}")
            source = ray.remote(BytesOnNode).options(**on(node_a)).remote(total)
            for size_mib in (2, 8, 32):
                chunk = size_mib << 20
                count = total // chunk
                namespace = f"bench-{size_mib}"
                writer = ray.remote(ChunkProbe).options(**on(node_a)).remote("bench-writer", namespace, chunk)
                peer_fetch(writer, node_a, node_b, namespace, chunk, count, 0)  # warm-up: arenas grow their segments
                ours, ref = [], []
                for round_ in range(1, args.rounds + 1):
                    ours.append(peer_fetch(writer, node_a, node_b, namespace, chunk, count, round_))
                    ref.append(ray_transfer(source, node_b, count * chunk))
                ray.kill(writer)
                gb = lambda s: count * chunk / s / 1e9  # noqa: E731
                k, r = statistics.median(ours), statistics.median(ref)
                print(f"{size_mib:>5}MiB {gb(k):>14.2f} {gb(r):>17.2f} {r / k:>6.2f}")
                results.rows.append([chunk >> 10, gb(k), gb(r), r / k])
                results.sizes_bytes.append(chunk)
        finally:
            down(config)
            ray.shutdown()
            sim.shutdown()
    results.panels = [
        Panel("node B fetches node A's chunks", [
            Line("kvstrata (lookup, transfer, verify, commit)", results.column("kvstrata GB/s")),
            Line("ray.put on A + ray.get on B", results.column("ray put+get GB/s"), reference=True)]),
    ]  # fmt: skip
    write_results(results, args.out)


if __name__ == "__main__":
    main()
