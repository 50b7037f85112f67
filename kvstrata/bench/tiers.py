"""One row of `kvstrata bench`: a tier's write and read GB/s at one chunk size, beside its reference.

- cpu (the arena): an engine's store and load of the chunks through a scratch `Arena` --
  reserve slots, copy the chunks in, commit; pin, copy them out, unpin -- against numpy
  copies of the same chunks between the same two kinds of memory (the chunks' own
  memory and shared memory in the same `shm_dir`): memcpy speed.
- disk and object: the node store's own path (`kvstrata.bench.measure`: committed chunks
  cascaded to the tier by the store's I/O threads, then promoted back, verified, into the
  arena) in a scratch store that has only that tier, against raw I/O of the same chunks:
  `pwrite`/`preadv` by `io_threads` threads into files in the same directory (O_DIRECT when
  the tier got it), or the tier's own chunk client PUTting/GETting objects of the same
  size (header included) with `max_concurrency` requests in flight.

Method (that of `benchmarks/tier_throughput.py`): each round measures kvstrata and its
reference side by side (the order alternating), writes then reads; GB/s are medians over
the rounds, and every ratio is the median of the rounds' ratios, never a ratio of medians.
On disk the first round writes into new files (kvstrata: a new slab), later rounds over
them (kvstrata: records freed by evicting the last round's chunks).
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field

import numpy as np

from kvstrata.store.node_store import NodeStore
from kvstrata.bench.measure import (
    HOLDER,
    BenchError,
    RawFileIO,
    chunk_key,
    promote,
    timed,
)
from kvstrata.bench.measure import cascade as cascade_chunks
from kvstrata.bench.scratch import Scratch, bench_node_id
from kvstrata.config import KvstrataConfig, TiersConfig
from kvstrata.tiers.arena import Arena
from kvstrata.tiers.disk import record_disk_bytes
from kvstrata.tiers.records import HEADER_BYTES
from kvstrata.tiers.shm import SharedMemoryFile

TIERS = ("cpu", "disk", "object")
MEMCPY = "numpy memcpy, same chunks into shared memory"
STAGING_SLOTS = 4  # spare arena slots beside a fill in the disk and object stores
Tick = Callable[[], None]  # called after each of a round's four measurements


@dataclass
class BenchRow:
    """GB/s of one tier at one chunk size; figures are None when `error` says why there are none."""

    tier: str
    chunk_bytes: int
    chunks: int  # per measurement
    rounds: int
    reference: str
    write_gbps: float | None = None
    ref_write_gbps: float | None = None
    write_ratio: float | None = None  # kvstrata ÷ reference
    read_gbps: float | None = None
    ref_read_gbps: float | None = None
    read_ratio: float | None = None
    notes: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def moved_bytes(self) -> int:
        return self.chunk_bytes * self.chunks

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "moved_bytes": self.moved_bytes}


@dataclass
class Rounds:
    """Seconds of each round's four measurements."""

    write: list[float] = field(default_factory=list)
    ref_write: list[float] = field(default_factory=list)
    read: list[float] = field(default_factory=list)
    ref_read: list[float] = field(default_factory=list)

    def fill(self, row: BenchRow) -> BenchRow:
        gbps = lambda seconds: row.moved_bytes / statistics.median(seconds) / 1e9  # noqa: E731
        row.write_gbps, row.ref_write_gbps = gbps(self.write), gbps(self.ref_write)
        row.read_gbps, row.ref_read_gbps = gbps(self.read), gbps(self.ref_read)
        row.write_ratio = statistics.median(r / k for r, k in zip(self.ref_write, self.write))
        row.read_ratio = statistics.median(r / k for r, k in zip(self.ref_read, self.read))
        return row


def chunk_count(config: KvstrataConfig, tier: str, chunk: int, budget: int) -> tuple[int, str | None]:
    """How many chunks one measurement moves: `budget` bytes, within the tier's capacity and
    the room the scratch copies need; and what capped it, if anything did."""
    cpu = config.tiers.cpu
    limits = {"--bytes": budget // chunk}
    shm_free = _free_bytes(cpu.shm_dir)
    if tier == "cpu":
        limits["tiers.cpu.capacity"] = cpu.capacity // chunk
        limits[f"free space in {cpu.shm_dir}"] = shm_free // 2 // (2 * chunk)  # arena + reference
    else:
        limits["tiers.cpu.capacity"] = cpu.capacity // chunk - STAGING_SLOTS  # the fill passes through the arena
        limits[f"free space in {cpu.shm_dir}"] = shm_free // 2 // (2 * chunk) - STAGING_SLOTS
    if tier == "disk":
        disk = config.tiers.disk
        limits["tiers.disk.capacity"] = disk.capacity // record_disk_bytes(chunk)
        per_chunk = record_disk_bytes(chunk) + chunk  # the tier's record and the raw file's copy
        limits[f"free space in {disk.path}"] = _free_bytes(disk.path) // 2 // per_chunk
    if tier == "object" and config.tiers.object.capacity is not None:
        limits["tiers.object.capacity"] = config.tiers.object.capacity // (chunk + HEADER_BYTES)
    by = min(limits, key=limits.get)
    count = max(0, limits[by])
    return count, None if by == "--bytes" else by


def measure(
    tier: str, config: KvstrataConfig, scratch: Scratch, chunk: int, count: int, rounds: int, tick: Tick
) -> BenchRow:
    """The row of `tier` at `chunk` bytes; a failure is the row's `error`, not an exception."""
    measure_tier = {"cpu": measure_cpu, "disk": measure_disk, "object": measure_object}[tier]
    try:
        return measure_tier(config, scratch, chunk, count, rounds, tick)
    except Exception as exc:  # noqa: BLE001 - one tier failing must not hide the others' figures
        reason = str(exc) if isinstance(exc, BenchError) else f"{type(exc).__name__}: {exc}"
        reference = {"cpu": MEMCPY, "disk": "raw pwrite/preadv", "object": "the tier's client, put/get"}[tier]
        return BenchRow(tier, chunk, count, rounds, reference, error=reason)


def run_rounds(
    rounds: int,
    tick: Tick,
    write: Callable[[int], float],
    ref_write: Callable[[int], float],
    read: Callable[[int], float],
    ref_read: Callable[[int], float],
    after_round: Callable[[int], None] = lambda round_: None,
) -> Rounds:
    """Each round: both writes, then both reads (each a callable of the round giving its
    seconds), kvstrata first in even rounds and the reference first in odd ones."""
    samples = Rounds()
    for round_ in range(rounds):
        for pair in (
            [(samples.write, write), (samples.ref_write, ref_write)],
            [(samples.read, read), (samples.ref_read, ref_read)],
        ):
            for seconds, work in pair if round_ % 2 == 0 else pair[::-1]:
                seconds.append(work(round_))
                tick()
        after_round(round_)
    return samples


def measure_cpu(config: KvstrataConfig, scratch: Scratch, chunk: int, count: int, rounds: int, tick: Tick) -> BenchRow:
    cpu = config.tiers.cpu
    size = chunk * count
    row = BenchRow("cpu", chunk, count, rounds, MEMCPY)
    with ExitStack() as stack:
        arena = Arena(
            shm_dir=scratch.shm_dir, node_tag=bench_node_id(), capacity=size, segment_size=cpu.segment_size,
            lease_seconds=3600.0, eviction_policy=cpu.eviction_policy, prefault=True,
        )  # fmt: skip
        stack.callback(arena.close)
        pool = arena.pool(f"bench-{chunk}", chunk)
        source = np.frombuffer(np.random.default_rng(chunk).bytes(size), dtype=np.uint8)  # an engine's KV memory
        out = np.ones(size, dtype=np.uint8)  # every page touched before any timing
        # The reference's copies land in the same kind of memory as the arena's.
        reference = SharedMemoryFile.create(os.path.join(scratch.shm_dir, f"reference-{chunk}"), size)
        stack.callback(reference.close)
        shared = reference.array
        pieces = [slice(i * chunk, (i + 1) * chunk) for i in range(count)]
        keys = [chunk_key(i) for i in range(count)]
        # The arena's segments are created (and their memory allocated) before any timing,
        # as a running arena's are: allocation is not a store's cost.
        pool.release(HOLDER, pool.reserve(HOLDER, count))

        def store(round_: int) -> float:
            start = time.perf_counter()
            slots = pool.reserve(HOLDER, count)
            if len(slots) < count:
                raise BenchError(f"the scratch arena gave {len(slots)} of {count} slots of {chunk} bytes")
            for piece, slot in zip(pieces, slots):
                pool.view(slot)[:] = source[piece]
            _, refused = pool.commit_many(HOLDER, list(zip(slots, keys)))
            seconds = time.perf_counter() - start
            if refused:
                raise BenchError(refused[0])
            return seconds

        def load(round_: int) -> float:
            start = time.perf_counter()
            pinned = pool.pin(HOLDER, keys)
            for piece, key in zip(pieces, keys):
                out[piece] = pool.view(pinned[key])
            pool.unpin(HOLDER, list(pinned.values()))
            seconds = time.perf_counter() - start
            if not np.array_equal(out[pieces[-1]], source[pieces[-1]]):
                raise BenchError("a chunk loaded from the arena differs from the one stored")
            return seconds

        def ref_store(round_: int) -> float:
            start = time.perf_counter()
            for piece in pieces:
                shared[piece] = source[piece]
            return time.perf_counter() - start

        def ref_load(round_: int) -> float:
            start = time.perf_counter()
            for piece in pieces:
                out[piece] = shared[piece]
            return time.perf_counter() - start

        def forget(round_: int) -> None:
            pool.drop_holder(HOLDER)
            pool.purge()

        samples = run_rounds(rounds, tick, store, ref_store, load, ref_load, forget)
        _note_pages(row, pool.stats())
        if not reference.huge_pages and pool.stats()["huge_page_segments"]:
            row.notes.append("the reference's memory got 4 KiB pages, the arena's 2 MiB pages: not like for like")
    return samples.fill(row)


def measure_disk(config: KvstrataConfig, scratch: Scratch, chunk: int, count: int, rounds: int, tick: Tick) -> BenchRow:
    disk = config.tiers.disk
    threads = disk.io_threads
    row = BenchRow("disk", chunk, count, rounds, f"raw pwrite/preadv, {threads} threads, O_DIRECT")
    namespace = f"bench-{chunk}"
    with ExitStack() as stack:
        tier_dir = os.path.join(scratch.disk_dir, f"tier-{chunk}")
        stack.callback(shutil.rmtree, tier_dir, ignore_errors=True)
        scratch_disk = disk.model_copy(
            update={
                "path": tier_dir,
                "capacity": record_disk_bytes(chunk) * count,  # one fill: the next one evicts it
                "queue_depth": max(count, disk.queue_depth),
                "write_policy": "write_through",
            }
        )
        store = _scratch_store(config, scratch, chunk, count, TiersConfig(disk=scratch_disk), stack)
        if store.disk is None:
            raise BenchError(f"the disk tier cannot start: {store.disk_error}")
        raw_dir = os.path.join(scratch.disk_dir, f"raw-{chunk}")
        os.makedirs(raw_dir, exist_ok=True)
        stack.callback(shutil.rmtree, raw_dir, ignore_errors=True)
        raw: list[RawFileIO] = []

        def write(round_: int) -> float:
            before = store.stats()["disk"]
            seconds, _ = cascade_chunks(store, namespace, chunk, count, first_key=round_ * count)
            after = store.stats()["disk"]
            if after["stored"] - before["stored"] != count:
                raise BenchError(
                    f"the disk tier stored {after['stored'] - before['stored']} of {count} chunks "
                    f"(write errors {after['write_errors']}, admitting {after['admitting']})"
                )
            return seconds

        def ref_write(round_: int) -> float:
            if not raw:  # the reference opens its files as the tier opened its own (round 0 writes the tier first)
                direct = all(store.stats()["disk"]["direct_io"].values())
                if not direct:
                    row.reference = f"raw pwrite/preadv, {threads} threads, buffered"
                    row.notes.append("buffered I/O (no O_DIRECT on this filesystem): reads may come from the page cache")
                raw.append(RawFileIO(raw_dir, scratch.shm_dir, chunk, count, threads, stack, direct=direct))
            return raw[0].write_once()

        def read(round_: int) -> float:
            seconds = promote(store, namespace, [chunk_key(i) for i in range(round_ * count, (round_ + 1) * count)])
            if store.stats()["disk"]["corrupt_chunks"]:
                raise BenchError("the disk tier found corrupt chunks")
            return seconds

        samples = run_rounds(rounds, tick, write, ref_write, read, lambda round_: raw[0].read())
        _note_pages(row, store.stats()["pools"][namespace])
    return samples.fill(row)


def measure_object(config: KvstrataConfig, scratch: Scratch, chunk: int, count: int, rounds: int, tick: Tick) -> BenchRow:
    live = config.tiers.object
    row = BenchRow("object", chunk, count, rounds, "")
    namespace = f"bench-{chunk}"
    with ExitStack() as stack:
        scratch_object = scratch.object_tier().model_copy(update={"queue_depth": max(count, live.queue_depth)})
        store = _scratch_store(config, scratch, chunk, count, TiersConfig(object=scratch_object), stack)
        tier = store.object
        client = tier.fs if tier.client.name == "fsspec" else tier.client.fs
        row.reference = f"{tier.client.name} {type(client).__name__} put/get, {live.max_concurrency} in flight"
        requests = stack.enter_context(ThreadPoolExecutor(live.max_concurrency))
        body = np.random.default_rng(chunk).bytes(HEADER_BYTES + chunk)  # the size of the tier's objects
        paths = lambda round_: [f"{tier.root}/raw-{chunk}-{round_}/{i:06d}" for i in range(count)]  # noqa: E731

        def counted(name: str) -> int:
            return store.stats()["object"][name]

        def write(round_: int) -> float:  # new keys each round: chunks the bucket holds are not uploaded again
            before = counted("puts")
            seconds, _ = cascade_chunks(store, namespace, chunk, count, first_key=round_ * count)
            if counted("puts") - before != count:
                raise BenchError(f"{counted('puts') - before} of {count} uploads landed ({tier.last_error or 'no error'})")
            return seconds

        def read(round_: int) -> float:
            seconds = promote(store, namespace, [chunk_key(i) for i in range(round_ * count, (round_ + 1) * count)])
            if counted("corrupt_chunks"):
                raise BenchError("the object tier found corrupt chunks")
            return seconds

        def ref_write(round_: int) -> float:
            return timed(lambda: list(requests.map(lambda path: tier.client.put(path, body), paths(round_))))

        def ref_read(round_: int) -> float:
            sizes: list[int] = []  # each body is dropped once counted, as the tier drops it once copied
            get = lambda path: len(tier.client.get(path, len(body)))  # noqa: E731
            seconds = timed(lambda: sizes.extend(requests.map(get, paths(round_))))
            if sizes != [len(body)] * count:
                raise BenchError("a raw GET returned other than the bytes PUT")
            return seconds

        def forget(round_: int) -> None:  # the bucket holds at most one round of the bench's objects
            tier.purge(namespace)
            tier.fs.rm(f"{tier.root}/raw-{chunk}-{round_}", recursive=True)

        samples = run_rounds(rounds, tick, write, ref_write, read, ref_read, forget)
    return samples.fill(row)


def _scratch_store(
    config: KvstrataConfig, scratch: Scratch, chunk: int, count: int, tiers: TiersConfig, stack: ExitStack
) -> NodeStore:
    """A node store in this process with the scratch arena and the one tier under test.

    No `cluster` section (it publishes nothing and fetches from no peer), leases that
    outlast the measurement; the arena is the configured one's kind, sized for one fill.
    """
    cpu = config.tiers.cpu.model_copy(
        update={"capacity": chunk * (count + STAGING_SLOTS), "shm_dir": scratch.shm_dir, "prefault": True}
    )
    scratch_config = KvstrataConfig(
        tiers=tiers.model_copy(update={"cpu": cpu}),
        engine=config.engine.model_copy(update={"lease_seconds": 3600.0}),
    )
    store = NodeStore(scratch_config, bench_node_id())
    stack.callback(store.close)
    return store


def _note_pages(row: BenchRow, pool_stats: dict[str, int]) -> None:
    if pool_stats["huge_page_segments"] < pool_stats["segments"]:
        row.notes.append("arena in 4 KiB pages: the kernel gave no 2 MiB pages (copies and O_DIRECT I/O into it are slower)")


def _free_bytes(path: str) -> int:
    """Free bytes of the filesystem that holds `path` (or would: its nearest existing parent)."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    return shutil.disk_usage(existing).free
