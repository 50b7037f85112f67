"""Throughput of a kvstrata tier through the node store, beside references measured in the
same run on the same directory or server.

    python benchmarks/tier_throughput.py --tier disk [--path /mnt/nvme/bench] [--total-mib 512] [--threads 4] [--rounds 3]
    python benchmarks/tier_throughput.py --tier object [--total-mib 256] [--concurrency 16] [--rounds 3]

Besides the printed table, each run writes tier_throughput-<tier>.csv, .md and .png
(GB/s against chunk size, the references beside kvstrata) into --out (benchmarks/results/).

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
      installed; every store creates its file, so it has no warm case. Its reads are
      also measured with kvstrata's check added (`vllm+x`: each chunk's xxh3-128 on the
      same number of digest threads while the next chunk loads): what reading *verified*
      bytes costs the same I/O on this machine. Both spread the chunks evenly over the
      threads, as vLLM's tier does only when enough requests load at once; `vllm1j` is
      its tier loading the fill as one request does (`FileSystemTierManager.submit_load`:
      one job of one task, all the request's chunks read on one of its threads), as
      kvstrata's figure promotes the fill with one `step`.
Each round writes all three (in an order that rotates every round), then reads each
`--reads` times back to back, alternating; every timed phase starts on a flushed disk
(`os.sync()`). This VM's disk drifts by tens of percent within a minute, so every ratio
is the median of ratios of measurements taken side by side (one round's writes; one
set of back-to-back reads), and the range of the read ratios is printed after the table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import numpy as np
from plotting import Line, Panel, Results, add_out_argument, run_title, write_results

from kvstrata.actors.node_actor import freeze_startup_heap
from kvstrata.store.node_store import NodeStore
from kvstrata.bench.measure import RawFileIO, cascade, chunk_key, huge_page_probe, promote, reference_memory, rotated, split, timed
from kvstrata.tiers.disk import DIGEST_THREADS, record_disk_bytes
from kvstrata.tiers.records import chunk_digest

SIZES_KIB = [256, 1024, 2048, 8192, 32768]
VERIFIED = "vllm+xxh3"  # the read reference (b) with kvstrata's check added
ONE_JOB = "vllm 1 job"  # the read reference (b) as vLLM's tier loads one request
VLLM_READS = ("vllm", VERIFIED, ONE_JOB)


class VllmFs:
    """Reference (b): vLLM's `fs` tier I/O, one file per chunk, the chunks spread over the threads."""

    def __init__(self, directory: str, shm_dir: str, chunk: int, count: int, threads: int, stack: ExitStack):
        from vllm.v1.kv_offload.tiering.fs import io

        self.io, self.chunk, self.threads = io, chunk, threads
        root = os.path.join(directory, "vllm")
        self.paths = [os.path.join(root, f"{i % 256:02x}", f"chunk-{i}") for i in range(count)]
        self.direct = io.probe_o_direct(directory)
        self.view = stack.enter_context(reference_memory(shm_dir, chunk * count, seed=1))
        self.pool = stack.enter_context(ThreadPoolExecutor(threads))
        self.digests = stack.enter_context(ThreadPoolExecutor(DIGEST_THREADS))
        self.expected: list[bytes] | None = None
        stack.callback(shutil.rmtree, root, ignore_errors=True)

    def write(self) -> tuple[float]:
        """Every store creates its file: there is no warm case."""
        return (timed(lambda: self._each_thread(self.io.batch_store_block)),)

    def read(self) -> float:
        return timed(lambda: self._each_thread(self.io.batch_load_block))

    def read_verified(self) -> float:
        """vLLM's loads with the check kvstrata makes on every read: each chunk's xxh3-128,
        computed on `DIGEST_THREADS` threads while its loading thread loads the next chunk
        (one `batch_load_block` call per chunk, so a digest starts as soon as its chunk has
        landed), compared with the digest taken when the chunk was made."""
        if self.expected is None:
            self.expected = [chunk_digest("bench", chunk_key(i), self._chunk(i)) for i in range(len(self.paths))]

        def run(indices: list[int]) -> list[tuple[int, Future]]:
            checks = []
            for i in indices:
                self.io.batch_load_block([self.paths[i]], self.view, [i * self.chunk], self.chunk, self.direct)
                checks.append((i, self.digests.submit(chunk_digest, "bench", chunk_key(i), self._chunk(i))))
            return checks

        def load_and_verify() -> None:
            per_thread = self.pool.map(run, split(list(range(len(self.paths))), self.threads))
            for i, check in [check for checks in per_thread for check in checks]:
                assert check.result() == self.expected[i], f"vLLM's load of chunk {i} should read back what it stored"

        return timed(load_and_verify)

    def read_one_job(self) -> float:
        """vLLM's tier loading the fill as one request's promotion: `submit_load` makes a
        request's chunks one job of one task, `batch_load_block` over all of them, which one
        of its threads runs (and the job is done when that call returns)."""
        offsets = [i * self.chunk for i in range(len(self.paths))]
        return timed(lambda: self.io.batch_load_block(self.paths, self.view, offsets, self.chunk, self.direct))

    def _chunk(self, i: int) -> memoryview:
        return self.view[i * self.chunk : (i + 1) * self.chunk]

    def _each_thread(self, call: Callable) -> None:
        def run(indices: list[int]) -> None:
            call(
                [self.paths[i] for i in indices],
                self.view,
                [i * self.chunk for i in indices],
                self.chunk,
                self.direct,
            )

        list(self.pool.map(run, split(list(range(len(self.paths))), self.threads)))


class KvstrataDisk:
    """The disk tier through the node store's public `step` call.

    The disk holds one fill: the second fill evicts the first and reuses its records, as a
    tier that has been running does. Reads promote that fill into the arena (which forgot it).
    """

    def __init__(self, directory: str, shm_dir: str, chunk: int, count: int, threads: int, stack: ExitStack):
        self.chunk, self.count = chunk, count
        disk_dir = os.path.join(directory, "kvstrata")
        config = {
            "tiers": {
                "cpu": {"capacity": chunk * (count + 4), "segment_size": 256 << 20, "shm_dir": shm_dir},
                "disk": {
                    "path": disk_dir,
                    "capacity": record_disk_bytes(chunk) * count,
                    "io_threads": threads,
                    "queue_depth": count,
                },
            }
        }
        stack.callback(shutil.rmtree, disk_dir, ignore_errors=True)
        self.store = NodeStore(config, "bench-node")
        stack.callback(self.store.close)
        freeze_startup_heap()  # as the store's actor does once it is up (this process is its stand-in)
        self.keys: list[bytes] = []
        self.reads = 0

    def write(self) -> tuple[float, float]:
        """Cold write (into a new slab) and warm write (into records the first fill left), in seconds."""
        cold_s, _ = cascade(self.store, "bench", self.chunk, self.count)
        warm_s, self.keys = cascade(self.store, "bench", self.chunk, self.count, first_key=self.count)
        stats = self.store.stats()["disk"]
        assert stats["evicted"] == self.count, "the second fill should reuse the first one's records"
        return cold_s, warm_s

    def read(self) -> float:
        seconds = promote(self.store, "bench", self.keys)
        self.reads += 1
        stats = self.store.stats()
        assert stats["promotions"] == self.reads * self.count and stats["disk"]["corrupt_chunks"] == 0
        return seconds

    def facts(self) -> tuple[bool, bool]:
        """Whether the disk was opened with O_DIRECT, and whether the arena got 2 MiB pages."""
        stats = self.store.stats()
        pool = stats["pools"]["bench"]
        return all(stats["disk"]["direct_io"].values()), pool["huge_page_segments"] == pool["segments"]


def cascade_and_promote(store: NodeStore, namespace: str, chunk: int, count: int) -> tuple[float, float]:
    write_s, keys = cascade(store, namespace, chunk, count)
    return write_s, promote(store, namespace, keys)


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


def object_main(total_mib: int, concurrency: int, rounds: int, out: Path, title: str) -> None:
    from kvstrata._dev.s3_server import LocalS3Server

    columns = ["chunk KiB", "PUT GB/s", "GET GB/s", "raw PUT GB/s", "raw GET GB/s", "PUT/raw", "GET/raw",
               "raw best PUT", "raw best GET"]  # fmt: skip
    results = Results("tier_throughput-object", title, columns)

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
                results.rows.append([chunk >> 10, gb(kw), gb(kr), gb(rw), gb(rr), rw / kw, rr / kr, at_w, at_r])
                results.sizes_bytes.append(chunk)
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
        shutil.rmtree(shm_dir, ignore_errors=True)
    raw = "raw client (best of s3fs/pyarrow at 8/16/32)"
    results.panels = [
        Panel(f"PUT (upload), tier at {concurrency} in flight", [
            Line("kvstrata", results.column("PUT GB/s")), Line(raw, results.column("raw PUT GB/s"), reference=True)]),
        Panel("GET (promote: GET, verify, commit)", [
            Line("kvstrata", results.column("GET GB/s")), Line(raw, results.column("raw GET GB/s"), reference=True)]),
    ]  # fmt: skip
    write_results(results, out)


def median_speedup(reference: list[tuple[float, ...]], measured: list[tuple[float, ...]], column: int) -> float:
    """The median over rounds of reference seconds / measured seconds in `column`: each
    ratio compares two measurements of the same round."""
    return statistics.median(r[column] / m[column] for r, m in zip(reference, measured))


def disk_figures(
    moved: int, writes: dict[str, list[tuple[float, ...]]], reads: list[dict[str, float]]
) -> tuple[list[float], list[float], str]:
    """GB/s (medians), the ratios of the table, and the range of the read ratios.

    Every ratio is the median of ratios between measurements taken side by side (writes of
    one round, reads of one back-to-back set), never a ratio of medians taken minutes apart.
    """
    med = statistics.median
    kvstrata, raw = writes["kvstrata"], writes["raw"]
    seconds = [med(w[0] for w in kvstrata), med(w[1] for w in kvstrata), med(r["kvstrata"] for r in reads)]
    seconds += [med(w[0] for w in raw), med(w[1] for w in raw), med(r["raw"] for r in reads)]
    read_raw = [r["raw"] / r["kvstrata"] for r in reads]
    ratios = [median_speedup(raw, kvstrata, 0), median_speedup(raw, kvstrata, 1), med(read_raw)]
    spread = f"read/raw {min(read_raw):.2f}-{max(read_raw):.2f}"
    if "vllm" in writes:
        seconds.append(med(w[0] for w in writes["vllm"]))
        vllm = [(w[0], w[0]) for w in writes["vllm"]]  # its one kind of store against kvstrata's cold and warm
        ratios += [median_speedup(vllm, kvstrata, 0), median_speedup(vllm, kvstrata, 1)]
        for name in VLLM_READS:
            read_ratios = [r[name] / r["kvstrata"] for r in reads]
            seconds.append(med(r[name] for r in reads))
            ratios.append(med(read_ratios))
            spread += f", read/{name} {min(read_ratios):.2f}-{max(read_ratios):.2f}"
    else:
        seconds += [float("inf")] * (1 + len(VLLM_READS))
        ratios += [float("nan")] * (2 + len(VLLM_READS))
    return [moved / s / 1e9 for s in seconds], ratios, spread


def disk_panels(results: Results, vllm: bool) -> list[Panel]:
    """The disk run's GB/s as three panels: cold writes, warm writes, reads."""
    column = {name: results.column(name) for name in results.columns}
    raw = "raw O_DIRECT"
    cold = [Line("kvstrata", column["kv cold"]), Line(raw, column["raw cold"], reference=True)]
    warm = [Line("kvstrata", column["kv warm"]), Line(raw, column["raw warm"], reference=True)]
    read = [Line("kvstrata", column["kv read"]), Line(raw, column["raw read"], reference=True)]
    if vllm:
        cold.append(Line("vLLM fs tier", column["vllm w"], reference=True))
        warm.append(Line("vLLM fs tier", column["vllm w"], reference=True))
        read += [
            Line("vLLM fs tier", column["vllm r"], reference=True),
            Line("vLLM fs tier + xxh3 check", column["vllm+x r"], reference=True),
            Line("vLLM fs tier, 1 job", column["vllm1j r"], reference=True),
        ]
    return [
        Panel("write, cold (new slab / new files)", cold),
        Panel("write, warm (kvstrata: reused records;\nvLLM: every store creates its file)", warm),
        Panel("read (kvstrata: read, verify, commit into the arena)", read),
    ]


def disk_main(
    path: str | None, total_mib: int, threads: int, rounds: int, reads: int, sizes_kib: list[int], out: Path, title: str
) -> None:
    directory = tempfile.mkdtemp(prefix="kvstrata-bench-", dir=path or "/var/tmp")
    shm_dir = tempfile.mkdtemp(prefix="kvstrata-bench-", dir="/dev/shm")
    try:
        print(f"disk tier in {directory}, {total_mib} MiB per measurement, {threads} I/O threads, "
              f"{rounds} rounds of writes, each followed by {reads} back-to-back reads of each; GB/s (medians), "
              "then medians of the ratios of measurements taken side by side")  # fmt: skip
        print("  cold: writes into new files (kvstrata: a new slab; vLLM: every store creates its file)")
        print("  warm: writes over blocks written before (kvstrata: records freed by eviction)")
        print(
            "  w/vllm: kvstrata cold vs vLLM; warm/vllm: a running kvstrata tier vs vLLM, whose stores always create files"
        )
        print("  vllm+x: vLLM's reads, each chunk then checked against its xxh3-128 as kvstrata checks every read")
        print("  vllm r, vllm+x r: the chunks spread evenly over the threads (vLLM's tier, with enough requests at once)")
        print("  vllm1j r: vLLM's tier loading the fill as one request (one job: one batch_load_block on one thread)")
        pages = "2 MiB pages" if huge_page_probe(shm_dir) else "4 KiB pages (no MADV_COLLAPSE here)"
        print(f"  memory: the arena and both references use shared memory in {pages}")
        subjects: dict[str, type] = {"kvstrata": KvstrataDisk, "raw": RawFileIO}
        try:
            import vllm.v1.kv_offload.tiering.fs.io  # noqa: F401
        except ImportError:
            print("  vLLM is not installed: no vLLM reference")
        else:
            subjects["vllm"] = VllmFs
        columns = ["kv cold", "kv warm", "kv read", "raw cold", "raw warm", "raw read", "vllm w", "vllm r", "vllm+x r",
                   "vllm1j r", "cold/raw", "warm/raw", "read/raw", "w/vllm", "warm/vllm", "r/vllm", "r/vllm+x",
                   "r/vllm1j"]  # fmt: skip
        print(f"{'chunk':>9} " + " ".join(f"{c:>8}" for c in columns))
        spreads = []
        rows: list[list[float]] = []
        for size_kib in sizes_kib:
            chunk = size_kib * 1024
            count = max(threads, total_mib * 1024 * 1024 // chunk)
            writes: dict[str, list[tuple[float, ...]]] = {name: [] for name in subjects}
            read_s: list[dict[str, float]] = []
            for round_ in range(rounds):
                # The disk drifts by tens of percent within a minute: compare measurements
                # taken side by side, never one shot each. Reads leave the disk as it was, so
                # each round's are repeated back to back, the readers alternating. The order
                # rotates: the root filesystem here is mounted with `discard`, so whatever runs
                # right after the last round's files are deleted shares the disk with their discards.
                with ExitStack() as stack:
                    made = {
                        name: make(directory, shm_dir, chunk, count, threads, stack) for name, make in subjects.items()
                    }
                    for name in rotated(list(made), round_):
                        writes[name].append(made[name].write())
                    readers = {name: subject.read for name, subject in made.items()}
                    if "vllm" in made:
                        readers[VERIFIED] = made["vllm"].read_verified
                        readers[ONE_JOB] = made["vllm"].read_one_job
                    for read in range(reads):
                        read_s.append({name: readers[name]() for name in rotated(list(readers), round_ + read)})
                    direct, huge = made["kvstrata"].facts()
            figures, ratios, spread = disk_figures(chunk * count, writes, read_s)
            spreads.append(f"{size_kib:>6}KiB {spread}")
            print(
                f"{size_kib:>6}KiB " + " ".join(f"{f:>8.2f}" for f in figures + ratios)
                + ("" if direct else "  (buffered: no O_DIRECT here)")
                + ("" if huge else "  (arena in 4 KiB pages)")
            )  # fmt: skip
            rows.append([size_kib, *figures, *ratios])
        print(f"range of the {rounds * reads} side-by-side read ratios:")
        print("\n".join(spreads))
        results = Results("tier_throughput-disk", title, ["chunk KiB", *columns], rows, [s << 10 for s in sizes_kib])
        results.panels = disk_panels(results, "vllm" in subjects)
        write_results(results, out)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
        shutil.rmtree(shm_dir, ignore_errors=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tier", choices=["disk", "object"], default="disk")
    parser.add_argument("--concurrency", type=int, default=16, help="object tier: max_concurrency")
    parser.add_argument("--path", default=None, help="directory on the disk to measure (default: a temp dir in /var/tmp)")
    parser.add_argument("--total-mib", type=int, default=512)
    parser.add_argument("--threads", type=int, default=4, help="disk tier: io_threads (and the references' threads)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians)")
    parser.add_argument("--reads", type=int, default=3, help="disk tier: back-to-back reads of each per round")
    parser.add_argument(
        "--sizes", default=",".join(map(str, SIZES_KIB)), help="disk tier: chunk sizes in KiB, comma-separated"
    )
    add_out_argument(parser)
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    if args.tier == "object":
        total_mib = args.total_mib if args.total_mib != 512 else 256
        title = run_title("tier_throughput.py", argparse.Namespace(
            tier="object", total_mib=total_mib, concurrency=args.concurrency, rounds=args.rounds))  # fmt: skip
        object_main(total_mib, args.concurrency, args.rounds, args.out, title)
        return

    title = run_title("tier_throughput.py", argparse.Namespace(
        tier="disk", total_mib=args.total_mib, threads=args.threads, rounds=args.rounds, reads=args.reads,
        sizes=args.sizes, path=args.path))  # fmt: skip
    sizes_kib = [int(size) for size in args.sizes.split(",")]
    disk_main(args.path, args.total_mib, args.threads, args.rounds, args.reads, sizes_kib, args.out, title)


if __name__ == "__main__":
    main()
