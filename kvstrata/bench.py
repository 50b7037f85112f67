"""`kvstrata bench`: how fast the configured tiers of this node move chunks, beside a reference.

For each configured tier and chunk size, kvstrata's own code path writes a fill of
chunks into the tier and reads it back, and a reference moves the same bytes the plain
way, in the same run:
- cpu arena: chunks copied into arena slots and out again, against numpy's memcpy of the
  same chunks between two private buffers;
- disk: committed chunks cascaded to the disk tier and promoted back into the arena (the
  node store's `step` call, checksums verified on read), against O_DIRECT `pwrite` /
  `preadv` of the same chunks to one file;
- object store: the same cascade and promotion through the object tier, against the
  tier's own fsspec filesystem writing and reading whole objects with as many threads.

Scratch space only, removed at the end, also on failure or Ctrl-C: an arena under a
node tag of its own (`bench-<pid>`), a directory beside the disk tier's
(`<path>.kvstrata-bench-<pid>`), and a prefix beside the object root
(`<url>-kvstrata-bench-<pid>`, or under the root when the URL is a bare bucket). The
node's running store and its chunks are never touched. `benchmarks/tier_throughput.py`
is the deeper benchmark (rounds, vLLM's tiers as references); it shares `cascade` and
`promote` from here.

Must not: run inside a store, or leave anything behind.
"""

from __future__ import annotations

import argparse
import json
import logging
import mmap
import os
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvstrata.actors.node_store import NodeStore
from kvstrata.actors.protocol import StepRequest
from kvstrata.config import KvstrataConfig
from kvstrata.keys import make_key
from kvstrata.tiers.disk import record_disk_bytes
from kvstrata.tiers.object_store import open_filesystem

logger = logging.getLogger(__name__)
NAMESPACE = "bench"
HOLDER = "kvstrata-bench"


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default="256,2048,8192", help="chunk sizes in KiB, comma-separated (default 256,2048,8192)")
    parser.add_argument("--mib", type=int, default=128, help="MiB moved per measurement (default 128)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")


def run_bench(config: KvstrataConfig, console: Console, args: argparse.Namespace) -> int:
    """Measure every configured tier at every size; print the table (or JSON). Exit code."""
    sizes = [int(kib) * 1024 for kib in str(args.sizes).split(",")]
    tiers = ["cpu"] + [name for name in ("disk", "object") if getattr(config.tiers, name) is not None]
    rows: list[dict[str, Any]] = []
    with Progress(console=console, transient=True, disable=args.json) as progress:
        bar = progress.add_task("kvstrata bench", total=len(tiers) * len(sizes))
        for tier in tiers:
            for size in sizes:
                count = max(2, args.mib * 2**20 // size)
                progress.update(bar, description=f"{tier}, {count} chunks of {size // 1024} KiB")
                rows.append({"tier": tier, "chunk_bytes": size, "chunks": count, **MEASURE[tier](config, size, count)})
                progress.advance(bar)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        console.print(bench_table(rows, args.mib))
    return 0


def bench_table(rows: list[dict[str, Any]], mib: int) -> Table:
    table = Table(title=f"kvstrata bench: GB/s, {mib} MiB per measurement, reference of the same run", title_justify="left")
    for column in ("tier", "chunk", "write", "ref write", "÷ ref", "read", "ref read", "÷ ref", "reference"):
        table.add_column(column, justify="left" if column in ("tier", "reference") else "right")
    for row in rows:
        table.add_row(
            row["tier"],
            f"{row['chunk_bytes'] // 1024} KiB",
            f"{row['write_gbps']:.2f}",
            f"{row['ref_write_gbps']:.2f}",
            f"{row['write_gbps'] / row['ref_write_gbps']:.2f}",
            f"{row['read_gbps']:.2f}",
            f"{row['ref_read_gbps']:.2f}",
            f"{row['read_gbps'] / row['ref_read_gbps']:.2f}",
            row["reference"],
        )
    return table


# --- kvstrata's path: a store of its own, driven through its `step` call --------------


def cascade(store: NodeStore, namespace: str, chunk: int, count: int, first_key: int = 0) -> tuple[float, list[bytes]]:
    """Seconds to cascade `count` new committed chunks out of the arena, and their keys.

    The clock stops when the store reports no I/O in flight; then the arena forgets the
    chunks, so only the tier under test holds them.
    """
    store.register(HOLDER, namespace, chunk)
    assert store.wait_io(60)  # manifests and first listings are not part of the figure
    pool = store.arena.pools[namespace]
    slots = pool.reserve(HOLDER, count)
    assert len(slots) == count, f"the bench arena gave {len(slots)} of {count} slots"
    rng = np.random.default_rng(first_key)
    for slot in slots:
        pool.view(slot)[:] = rng.integers(0, 256, chunk, dtype=np.uint8)
    keys = [make_key(i.to_bytes(32, "big"), 0) for i in range(first_key, first_key + count)]
    # Like an engine, which catches up on the change log every step, the timed step carries
    # the sequence it has seen: replaying the whole log is not part of a cascade.
    seq = store.step(StepRequest(HOLDER, namespace)).seq

    def commit() -> None:
        store.step(StepRequest(HOLDER, namespace, commit=list(zip(slots, keys)), known_seq=seq))
        assert store.wait_io(600)

    seconds = timed(commit)
    pool.drop_holder(HOLDER)
    pool.purge()
    return seconds, keys


def promote(store: NodeStore, namespace: str, keys: list[bytes]) -> float:
    """Seconds to promote chunks only the tier holds back into the arena, which forgets them after."""
    pool = store.arena.pools[namespace]
    seq = store.step(StepRequest(HOLDER, namespace)).seq

    def pin() -> None:
        reply = store.step(StepRequest(HOLDER, namespace, pin=keys, known_seq=seq))
        assert len(reply.pending) == len(keys), "every chunk should be promoted from the tier"
        assert store.wait_io(600)

    seconds = timed(pin)
    stats = store.stats()
    assert stats["promotion_failures"] == 0, "a chunk failed its promotion (corrupt or unreadable)"
    pool.drop_holder(HOLDER)
    pool.purge()
    return seconds


def timed(work: Callable[[], object]) -> float:
    """Seconds `work` takes, started on a flushed disk (an earlier phase's writeback must not slow it)."""
    os.sync()
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def _arena(config: KvstrataConfig, chunk: int, count: int) -> dict[str, Any]:
    return {
        "capacity": chunk * (count + 4),
        "segment_size": max(chunk, min(256 << 20, chunk * (count + 4))),
        "shm_dir": config.tiers.cpu.shm_dir,
        "prefault": config.tiers.cpu.prefault,
    }


@contextmanager
def _bench_store(tiers: dict[str, Any]) -> Iterator[NodeStore]:
    store = NodeStore({"tiers": tiers}, f"bench-{os.getpid()}")
    try:
        yield store
    finally:
        store.close()


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / max(seconds, 1e-9) / 1e9


# --- one function per tier --------------------------------------------------------------


def measure_cpu(config: KvstrataConfig, chunk: int, count: int) -> dict[str, Any]:
    data = np.random.default_rng(1).integers(0, 256, chunk * count, dtype=np.uint8)
    out = np.ones_like(data)  # written now: page faults are not part of any figure
    ref = np.ones_like(data)
    with _bench_store({"cpu": _arena(config, chunk, count)}) as store:
        store.register(HOLDER, NAMESPACE, chunk)
        pool = store.arena.pools[NAMESPACE]
        views = [pool.view(slot) for slot in pool.reserve(HOLDER, count)]
        assert len(views) == count, f"the bench arena gave {len(views)} of {count} slots"
        pieces = [data[i * chunk : (i + 1) * chunk] for i in range(count)]
        write_s = _clock(lambda: [np.copyto(view, piece) for view, piece in zip(views, pieces)], warm_up=True)
        read_s = _clock(lambda: [np.copyto(out[i * chunk : (i + 1) * chunk], view) for i, view in enumerate(views)], warm_up=True)
        assert np.array_equal(out, data), "arena bytes differ from what was written"
        del views
    ref_pieces = [ref[i * chunk : (i + 1) * chunk] for i in range(count)]
    ref_write_s = _clock(lambda: [np.copyto(dst, src) for dst, src in zip(ref_pieces, pieces)], warm_up=True)
    ref_read_s = _clock(lambda: [np.copyto(out[i * chunk : (i + 1) * chunk], src) for i, src in enumerate(ref_pieces)], warm_up=True)
    return _row(chunk * count, write_s, read_s, ref_write_s, ref_read_s, "numpy memcpy, 1 thread")


def measure_disk(config: KvstrataConfig, chunk: int, count: int) -> dict[str, Any]:
    disk = config.tiers.disk
    scratch = f"{disk.path.rstrip('/')}.kvstrata-bench-{os.getpid()}"
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, scratch, ignore_errors=True)
        tier = {"path": scratch, "capacity": record_disk_bytes(chunk) * count, "io_threads": disk.io_threads,
                "direct_io": disk.direct_io, "queue_depth": count}  # fmt: skip
        with _bench_store({"cpu": _arena(config, chunk, count), "disk": tier}) as store:
            write_s, keys = cascade(store, NAMESPACE, chunk, count)
            read_s = promote(store, NAMESPACE, keys)
        ref_write_s, ref_read_s = _raw_file(os.path.join(scratch, "raw.bin"), chunk, count, disk.direct_io)
    return _row(chunk * count, write_s, read_s, ref_write_s, ref_read_s, "raw pwrite/preadv, one file" + (", O_DIRECT" if disk.direct_io else ""))


def measure_object(config: KvstrataConfig, chunk: int, count: int) -> dict[str, Any]:
    source = config.tiers.object
    url = source.url.rstrip("/")
    bare_bucket = "/" not in url.split("://", 1)[1]
    scratch_url = f"{url}/.kvstrata-bench-{os.getpid()}" if bare_bucket else f"{url}-kvstrata-bench-{os.getpid()}"
    tier = {**source.model_dump(), "url": scratch_url, "queue_depth": count, "write_policy": "write_through",
            "capacity": None, "ttl_seconds": None}  # fmt: skip
    fs, root = open_filesystem(source.model_copy(update={"url": scratch_url}))
    with ExitStack() as stack:
        stack.callback(_remove_tree, fs, root)
        with _bench_store({"cpu": _arena(config, chunk, count), "object": tier}) as store:
            write_s, keys = cascade(store, NAMESPACE, chunk, count)
            read_s = promote(store, NAMESPACE, keys)
        payload = np.random.default_rng(2).integers(0, 256, chunk, dtype=np.uint8).tobytes()
        paths = [f"{root}/raw/{i}" for i in range(count)]
        with ThreadPoolExecutor(source.max_concurrency) as pool:
            ref_write_s = _clock(lambda: list(pool.map(lambda path: fs.pipe_file(path, payload), paths)))
            ref_read_s = _clock(lambda: list(pool.map(fs.cat_file, paths)))
    reference = f"fsspec {type(fs).__name__} put/get, {source.max_concurrency} threads"
    return _row(chunk * count, write_s, read_s, ref_write_s, ref_read_s, reference)


MEASURE: dict[str, Callable[[KvstrataConfig, int, int], dict[str, Any]]] = {
    "cpu": measure_cpu,
    "disk": measure_disk,
    "object": measure_object,
}


def _row(nbytes: int, write_s: float, read_s: float, ref_write_s: float, ref_read_s: float, reference: str) -> dict[str, Any]:
    return {
        "write_gbps": _gbps(nbytes, write_s),
        "read_gbps": _gbps(nbytes, read_s),
        "ref_write_gbps": _gbps(nbytes, ref_write_s),
        "ref_read_gbps": _gbps(nbytes, ref_read_s),
        "reference": reference,
    }


def _clock(work: Callable[[], object], warm_up: bool = False) -> float:
    """Seconds `work` takes; with `warm_up`, of its second run (memory copies: the first one
    pays page faults and cold caches, which neither a running arena nor memcpy pays)."""
    if warm_up:
        work()
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def _raw_file(path: str, chunk: int, count: int, direct: bool) -> tuple[float, float]:
    """O_DIRECT (where asked and supported) writes then reads of `count` chunks, page-aligned
    memory; no fsync, as the disk tier does none (O_DIRECT writes bypass the page cache)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    buffer = mmap.mmap(-1, chunk * count)  # anonymous maps are page-aligned, as O_DIRECT needs
    view = memoryview(buffer)
    try:
        view[:] = np.random.default_rng(3).integers(0, 256, chunk * count, dtype=np.uint8).tobytes()
        flags = os.O_RDWR | os.O_CREAT | (getattr(os, "O_DIRECT", 0) if direct else 0)
        try:
            fd = os.open(path, flags, 0o600)
        except OSError:  # a filesystem without O_DIRECT (tmpfs): buffered, as the tier falls back
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            pieces = [view[i * chunk : (i + 1) * chunk] for i in range(count)]
            write_s = timed(lambda: [os.pwrite(fd, piece, i * chunk) for i, piece in enumerate(pieces)])
            read_s = timed(lambda: [os.preadv(fd, [piece], i * chunk) for i, piece in enumerate(pieces)])
            del pieces
        finally:
            os.close(fd)
    finally:
        view.release()
        buffer.close()
        if os.path.exists(path):
            os.remove(path)
    return write_s, read_s


def _remove_tree(fs: Any, root: str) -> None:
    try:
        if fs.exists(root):
            fs.rm(root, recursive=True)
    except Exception as exc:  # noqa: BLE001 - the operator is told what to remove by hand
        logger.warning("kvstrata bench: could not remove its scratch objects under %s: %s", root, type(exc).__name__)
