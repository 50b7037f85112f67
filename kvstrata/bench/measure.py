"""Timing primitives shared by `kvstrata bench` and `benchmarks/tier_throughput.py`.

Moved here from the benchmark so the command an operator runs and the benchmark the docs
quote measure the tiers the same way: chunks committed to an in-process node store's arena
are cascaded to the tier under test through the store's public `step` call (the clock
stops when the store reports no I/O in flight) and promoted back (read, verify, commit),
beside raw file I/O of the same chunks on the same directory.

Invariants: every timed phase starts on a flushed disk (`timed`); a store call that does
not do what the figure claims (a dropped write, a chunk that could not be promoted, I/O
that never ends) raises `BenchError` instead of yielding a figure.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING

import numpy as np

from kvstrata.protocol import StepRequest
from kvstrata.keys import make_key
from kvstrata.tiers.shm import SharedMemoryFile

if TYPE_CHECKING:
    from kvstrata.store.node_store import NodeStore

HOLDER = "bench"  # the engine a benchmark stands in for
IO_WAIT_S = 600.0  # bound on one measurement's I/O


class BenchError(RuntimeError):
    """A measurement that did not measure what it claims; the message says what went wrong."""


def chunk_key(i: int) -> bytes:
    """The key of the benchmark's chunk number `i` (group 0)."""
    return make_key(i.to_bytes(32, "big"), 0)


def split(items: list, parts: int) -> list[list]:
    return [items[i::parts] for i in range(parts)]


def rotated(items: list, by: int) -> list:
    return items[by % len(items) :] + items[: by % len(items)]


def timed(work: Callable[[], object]) -> float:
    """Seconds `work` takes, started on a flushed disk: the last phase's writeback must not slow it."""
    os.sync()
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


@contextmanager
def reference_memory(shm_dir: str, size: int, seed: int) -> Iterator[memoryview]:
    """Random bytes in the same kind of memory as the arena, every page allocated before any timing."""
    segment = SharedMemoryFile.create(os.path.join(shm_dir, f"reference-{seed}"), size)
    try:
        segment.array[:] = np.frombuffer(np.random.default_rng(seed).bytes(size), dtype=np.uint8)
        with memoryview(segment.array) as view:
            yield view
    finally:
        segment.close()


def huge_page_probe(shm_dir: str) -> bool:
    """Whether shared memory in `shm_dir` gets 2 MiB pages (the arena and the references alike)."""
    probe = SharedMemoryFile.create(os.path.join(shm_dir, "probe"), 4 << 20)
    probe.close()
    return probe.huge_pages


class RawFileIO:
    """The disk reference: each thread pwrite()s / pread()s its chunks, one at a time, into its own file.

    O_DIRECT when `direct` (as the disk tier opens its files where the filesystem allows),
    buffered otherwise. Every chunk has its own place in memory, as in any tier: on this
    VM, O_DIRECT reads into one reused buffer run at about half the speed of reads into
    distinct memory, which would make the reference look slower than the disk is.
    """

    def __init__(
        self,
        directory: str,
        shm_dir: str,
        chunk: int,
        count: int,
        threads: int,
        stack: ExitStack,
        direct: bool = True,
    ):
        self.chunk, self.threads = chunk, threads
        self.flags = os.O_RDWR | os.O_CREAT | (getattr(os, "O_DIRECT", 0) if direct else 0)
        self.paths = [os.path.join(directory, f"raw-{t}.bin") for t in range(threads)]
        self.per_thread = split(list(range(count)), threads)
        self.view = stack.enter_context(reference_memory(shm_dir, chunk * count, seed=2))
        self.pool = stack.enter_context(ThreadPoolExecutor(threads))
        stack.callback(lambda: [os.remove(path) for path in self.paths if os.path.exists(path)])

    def write(self) -> tuple[float, float]:
        """Cold (new files) and warm (the same files again) write, in seconds."""
        return self.write_once(), self.write_once()

    def write_once(self) -> float:
        """One write of every chunk: into new files the first time, over them after."""
        return timed(lambda: self._each_thread(os.pwrite))

    def read(self) -> float:
        return timed(lambda: self._each_thread(lambda fd, view, offset: os.preadv(fd, [view], offset)))

    def _each_thread(self, call: Callable[[int, memoryview, int], int]) -> None:
        def run(t: int) -> None:
            fd = os.open(self.paths[t], self.flags, 0o600)
            try:
                for i, c in enumerate(self.per_thread[t]):
                    call(fd, self.view[c * self.chunk : (c + 1) * self.chunk], i * self.chunk)
            finally:
                os.close(fd)

        list(self.pool.map(run, range(self.threads)))


def cascade(
    store: NodeStore, namespace: str, chunk: int, count: int, first_key: int = 0
) -> tuple[float, list[bytes]]:
    """Seconds to cascade `count` new committed chunks out of the arena, and their keys.

    The clock stops when the store reports no I/O in flight; then the arena forgets the
    chunks, so only the tier under test holds them.
    """
    epoch = store.register(HOLDER, namespace, chunk).epoch
    wait_io(store, 60.0, "the store's start-up listing")  # manifests and first listings are not part of the figure
    pool = store.arena.pools[namespace]
    slots = pool.reserve(HOLDER, count)
    if len(slots) < count:
        pool.release(HOLDER, slots)
        raise BenchError(f"the scratch arena gave {len(slots)} of {count} slots of {chunk} bytes")
    rng = np.random.default_rng(first_key)
    for slot in slots:
        pool.view(slot)[:] = np.frombuffer(rng.bytes(chunk), dtype=np.uint8)
    keys = [chunk_key(i) for i in range(first_key, first_key + count)]
    # Like an engine, which catches up on the change log at every step, the timed steps
    # carry the sequence number the engine has seen: replaying the whole log is not part
    # of a cascade or a promotion.
    seq = store.step(StepRequest(HOLDER, namespace, epoch=epoch)).seq

    def commit() -> None:
        store.step(StepRequest(HOLDER, namespace, epoch=epoch, commit=list(zip(slots, keys)), known_seq=seq))
        wait_io(store, IO_WAIT_S, f"writing {count} chunks")

    seconds = timed(commit)
    store.release_holder(HOLDER, epoch)  # its pins go (a holder is bound to one registration)
    pool.purge()
    return seconds, keys


def promote(store: NodeStore, namespace: str, keys: list[bytes]) -> float:
    """Seconds to promote chunks only the tier holds back into the arena, which forgets them after."""
    pool = store.arena.pools[namespace]
    epoch = store.register(HOLDER, namespace, pool.geometry.slot_bytes).epoch
    seq = store.step(StepRequest(HOLDER, namespace, epoch=epoch)).seq
    before = store.stats()["promotions"]

    def pin() -> None:
        reply = store.step(StepRequest(HOLDER, namespace, epoch=epoch, pin=keys, known_seq=seq))
        if len(reply.pending) != len(keys):
            raise BenchError(f"only {len(reply.pending)} of {len(keys)} chunks could be promoted from the tier")
        wait_io(store, IO_WAIT_S, f"promoting {len(keys)} chunks")

    seconds = timed(pin)
    store.release_holder(HOLDER, epoch)
    pool.purge()
    promoted = store.stats()["promotions"] - before
    if promoted != len(keys):
        raise BenchError(f"{promoted} of {len(keys)} chunks came back from the tier verified")
    return seconds


def cascade_and_promote(store: NodeStore, namespace: str, chunk: int, count: int) -> tuple[float, float]:
    write_s, keys = cascade(store, namespace, chunk, count)
    return write_s, promote(store, namespace, keys)


def wait_io(store: NodeStore, timeout_s: float, what: str) -> None:
    if not store.wait_io(timeout_s):
        raise BenchError(f"{what}: the store's I/O did not finish within {timeout_s:.0f} s")
