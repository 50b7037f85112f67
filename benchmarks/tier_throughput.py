"""Throughput of a kvstrata tier through the node store, beside references measured in the
same run on the same directory or server.

    python benchmarks/tier_throughput.py --tier disk [--path /mnt/nvme/bench] [--total-mib 512] [--threads 4] [--rounds 3]
    python benchmarks/tier_throughput.py --tier object [--total-mib 256] [--concurrency 16] [--rounds 3]

object: a SeaweedFS S3 server on 127.0.0.1 (started here, warmed up first); chunks
committed to the arena are uploaded (write-through, `max_concurrency` requests in
flight) and promoted back (GET, verify, commit into the arena). Reference: the server's
ceiling in the same run -- the best of the raw s3fs and pyarrow clients PUTting/GETting
the same chunk-size objects from a thread pool at 8/16/32 in flight. Rounds alternate
tier and reference; the table shows medians (loopback S3 on 2 cores is noisy).

disk: chunks committed to the arena are cascaded to disk (write-through, `io_threads`
I/O threads) and promoted back (read, verify, commit into the arena) through the node
store's public `step` call; the clock stops when the store reports no I/O in flight.
Writes are measured cold (into a new slab file) and warm (into records freed by
eviction, as in a tier that has run for a while). References, with the same thread
count, chunk size and random bytes in the same kind of memory as the arena (a
shared-memory file in `shm_dir`, in 2 MiB pages where the kernel allows: the physical
pieces of the memory decide how finely O_DIRECT requests are split):
  (a) raw O_DIRECT: each thread pwrite()s / pread()s chunk after chunk sequentially into
      its own file (no checksums, no metadata), cold (new files) and warm (again);
  (b) vLLM's own `fs` secondary tier I/O (`vllm.v1.kv_offload.tiering.fs.io`
      batch_store_block / batch_load_block: one file per chunk, O_DIRECT), if vLLM is
      installed; every store creates its file, so it has no warm case.
Rounds alternate the three, in an order that rotates every round, and every timed phase
starts on a flushed disk (`os.sync()`); the table shows medians (this VM's disk drifts by
tens of percent within a minute).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np

from kvstrata.actors.node_store import NodeStore
from kvstrata.actors.protocol import StepRequest
from kvstrata.keys import make_key
from kvstrata.tiers.disk import record_stride
from kvstrata.tiers.shm import SharedMemoryFile

SIZES_KIB = [256, 1024, 2048, 8192, 32768]


def split(items: list, parts: int) -> list[list]:
    return [items[i::parts] for i in range(parts)]


@contextmanager
def reference_memory(shm_dir: str, size: int, seed: int) -> Iterator[memoryview]:
    """Random bytes in the same kind of memory as the arena, every page allocated before any timing."""
    segment = SharedMemoryFile.create(os.path.join(shm_dir, f"reference-{seed}"), size)
    try:
        segment.array[:] = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
        with memoryview(segment.array) as view:
            yield view
    finally:
        segment.close()


def huge_page_probe(shm_dir: str) -> bool:
    """Whether shared memory in `shm_dir` gets 2 MiB pages (the arena and the references alike)."""
    probe = SharedMemoryFile.create(os.path.join(shm_dir, "probe"), 4 << 20)
    probe.close()
    return probe.huge_pages


def raw_o_direct(directory: str, shm_dir: str, chunk: int, count: int, threads: int) -> tuple[float, float, float]:
    """Cold write (new files), warm write (the same files again) and read, in seconds.

    Each thread pwrite()s / pread()s its chunks, one at a time, into its own file. Every
    chunk has its own place in memory, as in any tier: on this VM, O_DIRECT reads into
    one reused buffer run at about half the speed of reads into distinct memory, which
    would make the reference look slower than the disk is.
    """
    paths = [os.path.join(directory, f"raw-{t}.bin") for t in range(threads)]
    per_thread = split(list(range(count)), threads)
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0)

    def write(t: int) -> None:
        fd = os.open(paths[t], flags, 0o600)
        try:
            for i, c in enumerate(per_thread[t]):
                os.pwrite(fd, view[c * chunk : (c + 1) * chunk], i * chunk)
        finally:
            os.close(fd)

    def read(t: int) -> None:
        fd = os.open(paths[t], flags, 0o600)
        try:
            for i, c in enumerate(per_thread[t]):
                os.preadv(fd, [view[c * chunk : (c + 1) * chunk]], i * chunk)
        finally:
            os.close(fd)

    with reference_memory(shm_dir, chunk * count, seed=2) as view, ThreadPoolExecutor(threads) as pool:

        def timed(work: Callable[[int], None]) -> float:
            os.sync()
            start = time.perf_counter()
            list(pool.map(work, range(threads)))
            return time.perf_counter() - start

        cold_s, warm_s, read_s = timed(write), timed(write), timed(read)
    for path in paths:
        os.remove(path)
    return cold_s, warm_s, read_s


def vllm_fs(directory: str, shm_dir: str, chunk: int, count: int, threads: int) -> tuple[float, float] | None:
    try:
        from vllm.v1.kv_offload.tiering.fs.io import batch_load_block, batch_store_block, probe_o_direct
    except ImportError:
        return None
    direct = probe_o_direct(directory)
    paths = [os.path.join(directory, "vllm", f"{i % 256:02x}", f"chunk-{i}") for i in range(count)]
    groups = split(list(range(count)), threads)

    def store(indices: list[int]) -> None:
        batch_store_block([paths[i] for i in indices], view, [i * chunk for i in indices], chunk, direct)

    def load(indices: list[int]) -> None:
        batch_load_block([paths[i] for i in indices], view, [i * chunk for i in indices], chunk, direct)

    with reference_memory(shm_dir, chunk * count, seed=1) as view, ThreadPoolExecutor(threads) as pool:
        os.sync()
        start = time.perf_counter()
        list(pool.map(store, groups))
        write_s = time.perf_counter() - start
        os.sync()
        start = time.perf_counter()
        list(pool.map(load, groups))
        read_s = time.perf_counter() - start
    shutil.rmtree(os.path.join(directory, "vllm"))
    return write_s, read_s


def cascade_and_promote(
    store: NodeStore, namespace: str, chunk: int, count: int, first_key: int = 0
) -> tuple[float, float]:
    """Seconds to cascade `count` committed chunks out of the arena, and to promote them back.

    Both clocks stop when the store reports no I/O in flight; the arena forgets the
    chunks in between, so every one is read back from the tier under test.
    """
    store.register("bench", namespace, chunk)
    assert store.wait_io(60)  # manifests and first listings are not part of the figure
    pool = store.arena.pools[namespace]
    slots = pool.reserve("bench", count)
    rng = np.random.default_rng(0)
    for slot in slots:
        pool.view(slot)[:] = rng.integers(0, 256, chunk, dtype=np.uint8)
    keys = [make_key(i.to_bytes(32, "big"), 0) for i in range(first_key, first_key + count)]
    # Like an engine, which catches up on the change log at every step, the timed steps
    # carry the sequence number the engine has seen: replaying the whole log is not part
    # of a cascade or a promotion.
    seq = store.step(StepRequest("bench", namespace)).seq
    os.sync()  # the last measurement's writeback must not slow this one
    start = time.perf_counter()
    store.step(StepRequest("bench", namespace, commit=list(zip(slots, keys)), known_seq=seq))
    assert store.wait_io(600)
    write_s = time.perf_counter() - start
    pool.drop_holder("bench")
    pool.purge()  # the arena forgets them; the tier keeps them
    seq = store.step(StepRequest("bench", namespace)).seq
    os.sync()
    start = time.perf_counter()
    reply = store.step(StepRequest("bench", namespace, pin=keys, known_seq=seq))
    assert len(reply.pending) == count, "every chunk should be promoted from the tier"
    assert store.wait_io(600)
    read_s = time.perf_counter() - start
    pool.purge()
    return write_s, read_s


def kvstrata_disk(
    directory: str, shm_dir: str, chunk: int, count: int, threads: int
) -> tuple[float, float, float, bool, bool]:
    """Cold write (into a new slab), warm write (into records the first fill left) and read,
    whether the disk was opened with O_DIRECT, and whether the arena got 2 MiB pages.

    The disk holds one fill: the second fill evicts the first and reuses its records, as
    a tier that has been running does.
    """
    disk_dir = os.path.join(directory, "kvstrata")
    config = {
        "tiers": {
            "cpu": {"capacity": chunk * (count + 4), "segment_size": 256 << 20, "shm_dir": shm_dir},
            "disk": {
                "path": disk_dir,
                "capacity": record_stride(chunk) * count,
                "io_threads": threads,
                "queue_depth": count,
            },
        }
    }
    store = NodeStore(config, "bench-node")
    try:
        cold_s, _ = cascade_and_promote(store, "bench", chunk, count)
        warm_s, read_s = cascade_and_promote(store, "bench", chunk, count, first_key=count)
        stats = store.stats()
        assert stats["promotions"] == 2 * count and stats["disk"]["corrupt_chunks"] == 0
        assert stats["disk"]["evicted"] == count, "the second fill should reuse the first one's records"
        direct = all(stats["disk"]["direct_io"].values())
        pool = stats["pools"]["bench"]
        huge = pool["huge_page_segments"] == pool["segments"]
    finally:
        store.close()
        shutil.rmtree(disk_dir, ignore_errors=True)
    return cold_s, warm_s, read_s, direct, huge


def kvstrata_object(
    server, shm_dir: str, namespace: str, chunk: int, count: int, concurrency: int
) -> tuple[float, float]:
    config = {
        "tiers": {
            "cpu": {"capacity": chunk * (count + 4), "segment_size": 256 << 20, "shm_dir": shm_dir},
            "object": {
                "url": "s3://bench/kvstrata",
                "endpoint_url": server.endpoint_url,
                "storage_options": server.storage_options(),
                "max_concurrency": concurrency,
                "queue_depth": count,
                "timeouts": {"read_seconds": 30},
            },
        }
    }
    store = NodeStore(config, "bench-node")
    try:
        write_s, read_s = cascade_and_promote(store, namespace, chunk, count)
        stats = store.stats()
        assert stats["object"]["puts"] == count, f"every chunk should be uploaded: {stats['object']}"
        assert stats["object_promotions"] == count and stats["object"]["corrupt_chunks"] == 0, stats["object"]
    finally:
        store.close()
    return write_s, read_s


def raw_clients(server) -> dict[str, tuple[Callable, Callable]]:
    """PUT and GET of whole objects with each raw client, no kvstrata in between."""
    import pyarrow.fs as pafs

    fs = server.filesystem(config_kwargs={"max_pool_connections": 64, "read_timeout": 30})
    options = server.storage_options()
    scheme, _, host = server.endpoint_url.rpartition("://")
    pa = pafs.S3FileSystem(
        access_key=options["key"], secret_key=options["secret"], endpoint_override=host, scheme=scheme,
        request_timeout=30, allow_delayed_open=True,
    )  # fmt: skip

    def pa_put(path: str, body: bytes) -> None:
        with pa.open_output_stream(path, metadata={}) as stream:
            stream.write(body)

    def pa_get(path: str) -> object:
        with pa.open_input_file(path) as source:
            return source.read()

    return {"s3fs": (fs.pipe_file, fs.cat_file), "pyarrow": (pa_put, pa_get)}


def raw_round(server, clients: dict, chunk: int, count: int) -> dict[str, tuple[float, float]]:
    """PUT and GET seconds of each raw client at 8/16/32 requests in flight."""
    fs = server.filesystem()
    body = os.urandom(chunk)
    seconds: dict[str, tuple[float, float]] = {}
    for name, (put, get) in clients.items():
        for concurrency in (8, 16, 32):
            prefix = f"bench/raw-{chunk}-{name}-{concurrency}"
            paths = [f"{prefix}/{i:06d}" for i in range(count)]
            with ThreadPoolExecutor(concurrency) as pool:
                os.sync()  # the last measurement's writeback must not slow this one
                start = time.perf_counter()
                list(pool.map(lambda p: put(p, body), paths))
                write_s = time.perf_counter() - start
                start = time.perf_counter()
                list(pool.map(get, paths))
                seconds[f"{name}/{concurrency}"] = (write_s, time.perf_counter() - start)
            fs.rm(prefix, recursive=True)
    return seconds


def ceiling(rounds: list[dict[str, tuple[float, float]]], column: int) -> tuple[float, str]:
    """The best client/concurrency by its median over the rounds (a best-of-every-sample
    reference would be biased upwards by noise), and that median."""
    medians = {config: statistics.median(r[config][column] for r in rounds) for config in rounds[0]}
    best = min(medians, key=medians.get)
    return medians[best], best


def object_main(total_mib: int, concurrency: int, rounds: int) -> None:
    from kvstrata.s3_server import LocalS3Server

    data_dir = tempfile.mkdtemp(prefix="kvstrata-bench-s3-", dir="/var/tmp")
    shm_dir = tempfile.mkdtemp(prefix="kvstrata-bench-", dir="/dev/shm")
    try:
        with LocalS3Server(data_dir) as server:
            server.filesystem().mkdir("bench")
            clients = raw_clients(server)
            raw_round(server, clients, 2 << 20, 16)  # warm-up: the server grows its volumes on first writes
            print(f"object tier on SeaweedFS at {server.endpoint_url}, {total_mib} MiB per measurement, "
                  f"tier concurrency {concurrency}, medians of {rounds} interleaved rounds")  # fmt: skip
            print(f"{'chunk':>9} {'PUT GB/s':>9} {'GET GB/s':>9} {'raw PUT':>8} {'raw GET':>8} {'PUT/raw':>8} {'GET/raw':>8}")
            for size_mib in (2, 8, 32):
                chunk = size_mib << 20
                count = max(4, total_mib // size_mib)
                tier, raw = [], []
                for round_ in range(rounds):
                    namespace = f"bench-{size_mib}-{round_}"  # fresh: chunks already in the bucket are not re-uploaded
                    tier.append(kvstrata_object(server, shm_dir, namespace, chunk, count, concurrency))
                    raw.append(raw_round(server, clients, chunk, count))
                kw, kr = (statistics.median(column) for column in zip(*tier))
                (rw, at_w), (rr, at_r) = ceiling(raw, 0), ceiling(raw, 1)
                gb = lambda s: chunk * count / s / 1e9  # noqa: E731
                print(
                    f"{size_mib:>6}MiB {gb(kw):>9.3f} {gb(kr):>9.3f} {gb(rw):>8.3f} {gb(rr):>8.3f}"
                    f" {rw / kw:>8.2f} {rr / kr:>8.2f}   (raw best: PUT {at_w}, GET {at_r})"
                )
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
        shutil.rmtree(shm_dir, ignore_errors=True)


def disk_main(path: str | None, total_mib: int, threads: int, rounds: int) -> None:
    directory = tempfile.mkdtemp(prefix="kvstrata-bench-", dir=path or "/var/tmp")
    shm_dir = tempfile.mkdtemp(prefix="kvstrata-bench-", dir="/dev/shm")
    try:
        print(f"disk tier in {directory}, {total_mib} MiB per measurement, {threads} I/O threads, "
              f"medians of {rounds} interleaved rounds; GB/s, then ratios")  # fmt: skip
        print("  cold: writes into new files (kvstrata: a new slab; vLLM: every store creates its file)")
        print("  warm: writes over blocks written before (kvstrata: records freed by eviction)")
        print("  w/vllm: kvstrata cold vs vLLM; warm/vllm: a running kvstrata tier vs vLLM, whose stores always create files")
        pages = "2 MiB pages" if huge_page_probe(shm_dir) else "4 KiB pages (no MADV_COLLAPSE here)"
        print(f"  memory: the arena and both references use shared memory in {pages}")
        columns = ["kv cold", "kv warm", "kv read", "raw cold", "raw warm", "raw read", "vllm w", "vllm r",
                   "cold/raw", "warm/raw", "read/raw", "w/vllm", "warm/vllm", "r/vllm"]  # fmt: skip
        print(f"{'chunk':>9} " + " ".join(f"{c:>8}" for c in columns))
        for size_kib in SIZES_KIB:
            chunk = size_kib * 1024
            count = max(threads, total_mib * 1024 * 1024 // chunk)
            samples: dict[str, list[tuple[float, ...]]] = {"kvstrata": [], "raw": [], "vllm": []}
            direct = huge = True
            # The disk drifts by tens of percent within a minute: alternate the three and
            # compare medians, not one shot each. The order rotates every round: the root
            # filesystem here is mounted with `discard`, so whatever runs right after another
            # measurement's files are deleted shares the disk with their discards.
            runs = {
                "kvstrata": lambda: kvstrata_disk(directory, shm_dir, chunk, count, threads),
                "raw": lambda: raw_o_direct(directory, shm_dir, chunk, count, threads),
                "vllm": lambda: vllm_fs(directory, shm_dir, chunk, count, threads),
            }
            order = list(runs)
            for round_ in range(rounds):
                for name in order[round_ % 3 :] + order[: round_ % 3]:
                    result = runs[name]()
                    if name == "kvstrata":
                        *result, direct, huge = result
                    if result is not None:
                        samples[name].append(tuple(result))
            gb = lambda s: chunk * count / s / 1e9  # noqa: E731
            med = {name: [gb(statistics.median(column)) for column in zip(*rows)] for name, rows in samples.items()}
            kc, kw, kr = med["kvstrata"]
            rc, rw, rr = med["raw"]
            vw, vr = med["vllm"] or [float("nan")] * 2
            figures = [kc, kw, kr, rc, rw, rr, vw, vr, kc / rc, kw / rw, kr / rr, kc / vw, kw / vw, kr / vr]
            print(
                f"{size_kib:>6}KiB " + " ".join(f"{f:>8.2f}" for f in figures)
                + ("" if direct else "  (buffered: no O_DIRECT here)")
                + ("" if huge else "  (arena in 4 KiB pages)")
            )
    finally:
        shutil.rmtree(directory, ignore_errors=True)
        shutil.rmtree(shm_dir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tier", choices=["disk", "object"], default="disk")
    parser.add_argument("--concurrency", type=int, default=16, help="object tier: max_concurrency")
    parser.add_argument("--path", default=None, help="directory on the disk to measure (default: a temp dir in /var/tmp)")
    parser.add_argument("--total-mib", type=int, default=512)
    parser.add_argument("--threads", type=int, default=4, help="disk tier: io_threads (and the references' threads)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians)")
    args = parser.parse_args()
    if args.tier == "object":
        object_main(args.total_mib if args.total_mib != 512 else 256, args.concurrency, args.rounds)
        return

    disk_main(args.path, args.total_mib, args.threads, args.rounds)


if __name__ == "__main__":
    main()
