"""Would a compiled loop let verified disk reads and sealed writes reach the disk's speed? A probe.

vLLM's `fs` tier reads in C++ (`fs_io_C`, the GIL released for a whole batch) and does not
verify what it reads; kvstrata's disk tier reads from Python I/O threads and checks every
chunk's xxh3-128 on digest threads. This probe reads the tier's own slab, at the tier's own
offsets, into the arena's own slots, from a C loop compiled here and called through ctypes
(the GIL released for each thread's whole share of the records):

  C loop         one `preadv` of [header | body] per record, nothing else (what vLLM does)
  C loop + xxh3  the same, hashing namespace ‖ key ‖ payload as each record lands (what a
                 native verified read does); the digests are then checked against the
                 records' headers, so the loop hashes exactly what the tier verifies

beside the tier through the node store, raw O_DIRECT and vLLM's `fs` tier, set up and timed
as in tier_throughput.py (same threads, chunks and memory; ratios of side-by-side reads).
And writes, warm (over blocks written before), into a file laid out as the tier's slab:

  C write         the tier's records and runs (neighbours in one `pwritev`), headers as packed
  C seal + write  the same, hashing each payload into its header just before its run goes out
                  (what a native sealed write does); every header is then checked

beside the tier's warm cascade and raw O_DIRECT warm writes of the same round. Reaches into
the tier's private state for offsets and header fields: a probe, not an API.

    python benchmarks/native_loop_probe.py [--sizes 256,1024,8192] [--rounds 3] [--reads 3]

Needs a C compiler (`cc`) and the xxHash header pyarrow vendors; says so and exits otherwise.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tier_throughput as bench  # noqa: E402

from kvstrata.keys import align_up, make_key  # noqa: E402
from kvstrata.tiers.disk import MAX_RUN, WRITE_RUN_BYTES, payload_alignment, record_stride  # noqa: E402
from kvstrata.tiers.records import _FIELDS, HEADER_BYTES, RecordHeader, record_matches, recorded_digest  # noqa: E402

NAMESPACE = "bench"
DIGEST_AT = _FIELDS.size  # where a record header holds its digest
READERS = ("kvstrata", "C loop", "C loop + xxh3", "raw", "vLLM fs")
WRITERS = ("kvstrata warm", "C write", "C seal + write", "raw warm")
C_SOURCE = r"""
#define XXH_INLINE_ALL
#include "xxhash.h"
#include <sys/uio.h>

/* Reads n records [header | body]; with `hash`, the xxh3-128 of prefix ‖ body[:payload] of each.
   Returns the bytes read, or -1 on the first failed read. */
long long read_records(int fd, int n, const long long *offsets, void **headers, void **bodies,
                       long long body_bytes, long long payload_bytes, const void **prefixes,
                       const long long *prefix_bytes, int hash, unsigned char *digests) {
    long long total = 0;
    XXH3_state_t state;
    for (int i = 0; i < n; i++) {
        struct iovec iov[2] = {{headers[i], 4096}, {bodies[i], (size_t)body_bytes}};
        ssize_t got = preadv(fd, iov, 2, offsets[i]);
        if (got < 0) return -1;
        total += got;
        if (hash) {
            XXH3_128bits_reset(&state);
            XXH3_128bits_update(&state, prefixes[i], (size_t)prefix_bytes[i]);
            XXH3_128bits_update(&state, bodies[i], (size_t)payload_bytes);
            XXH128_canonicalFromHash((XXH128_canonical_t *)(digests + 16 * i), XXH3_128bits_digest(&state));
        }
    }
    return total;
}

/* Writes n records [header | body], neighbours on disk (up to max_run) in one pwritev; with `hash`,
   first seals each header: the xxh3-128 of prefix ‖ body[:payload] at header + digest_at.
   Returns the bytes written, or -1 on the first failed or short write. */
long long write_records(int fd, int n, const long long *offsets, void **headers, void **bodies,
                        long long body_bytes, long long payload_bytes, const void **prefixes,
                        const long long *prefix_bytes, int hash, long long digest_at, int max_run) {
    long long total = 0;
    XXH3_state_t state;
    struct iovec iov[1024];
    if (max_run > 512) max_run = 512;
    for (int i = 0; i < n;) {
        int end = i + 1;
        while (end < n && end - i < max_run && offsets[end] == offsets[end - 1] + 4096 + body_bytes) end++;
        long long want = 0;
        for (int k = i; k < end; k++) {
            if (hash) {
                XXH3_128bits_reset(&state);
                XXH3_128bits_update(&state, prefixes[k], (size_t)prefix_bytes[k]);
                XXH3_128bits_update(&state, bodies[k], (size_t)payload_bytes);
                XXH128_canonicalFromHash((XXH128_canonical_t *)((char *)headers[k] + digest_at),
                                         XXH3_128bits_digest(&state));
            }
            iov[2 * (k - i)].iov_base = headers[k];
            iov[2 * (k - i)].iov_len = 4096;
            iov[2 * (k - i) + 1].iov_base = bodies[k];
            iov[2 * (k - i) + 1].iov_len = (size_t)body_bytes;
            want += 4096 + body_bytes;
        }
        ssize_t got = pwritev(fd, iov, 2 * (end - i), offsets[i]);
        if (got != want) return -1;
        total += got;
        i = end;
    }
    return total;
}
"""


def build(workdir: Path) -> ctypes.CDLL:
    import pyarrow

    header_dir = Path(pyarrow.get_include()) / "arrow" / "vendored" / "xxhash"
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None or not (header_dir / "xxhash.h").exists():
        raise SystemExit(f"native_loop_probe: needs a C compiler (found {compiler}) and {header_dir / 'xxhash.h'}")
    source, library = workdir / "record_loop.c", workdir / "librecord_loop.so"
    source.write_text(C_SOURCE)
    subprocess.run([compiler, "-O2", "-shared", "-fPIC", f"-I{header_dir}", str(source), "-o", str(library)], check=True)
    loop = ctypes.CDLL(str(library))  # ctypes releases the GIL for the whole call
    p, ll = ctypes.c_void_p, ctypes.c_longlong
    loop.read_records.argtypes = [ctypes.c_int, ctypes.c_int, p, p, p, ll, ll, p, p, ctypes.c_int, p]
    loop.read_records.restype = ll
    loop.write_records.argtypes = [ctypes.c_int, ctypes.c_int, p, p, p, ll, ll, p, p, ctypes.c_int, ll, ctypes.c_int]
    loop.write_records.restype = ll
    return loop


def contiguous_shares(items: list, parts: int) -> list[list]:
    """`items` cut into `parts` runs of neighbours, one per thread, as the tier's jobs are."""
    return [items[t * len(items) // parts : (t + 1) * len(items) // parts] for t in range(parts)]


def record_arguments(offsets: list[int], headers: list[int], bodies: list[int], prefixes: list[bytes]) -> tuple:
    """One thread's per-record arguments of the C loop: (n, offsets, headers, bodies, prefixes, prefix lengths)."""
    n = len(offsets)
    return (
        n,
        (ctypes.c_longlong * n)(*offsets),
        (ctypes.c_void_p * n)(*headers),
        (ctypes.c_void_p * n)(*bodies),
        (ctypes.c_char_p * n)(*prefixes),
        (ctypes.c_longlong * n)(*map(len, prefixes)),
    )


class NativeReads:
    """Reads what the tier of `kv` holds with the C loop, each thread a contiguous share of the records."""

    def __init__(self, loop: ctypes.CDLL, kv: bench.KvstrataDisk, threads: int, stack: ExitStack):
        self.loop, self.kv, self.threads = loop, kv, threads
        self.pool = kv.store.arena.pools[NAMESPACE]
        headers = mmap.mmap(-1, HEADER_BYTES * kv.count)  # page-aligned, as O_DIRECT wants
        stack.callback(headers.close)
        self.headers = np.frombuffer(headers, np.uint8)
        stack.callback(lambda: setattr(self, "headers", None))  # runs first: no view may outlive the mmap
        self.workers = stack.enter_context(ThreadPoolExecutor(threads))

    def read(self, verify: bool) -> float:
        """Seconds to read every chunk into fresh arena slots (and hash it, with `verify`)."""
        slab = self.kv.store.disk._slabs[NAMESPACE]
        keys = self.kv.keys
        shares = contiguous_shares(sorted((slab.index[key], i) for i, key in enumerate(keys)), self.threads)
        slots = self.pool.reserve("probe", len(keys))
        try:
            bodies = [self.pool.view(slot) for slot in slots]
            prefixes = [NAMESPACE.encode() + key for key in keys]
            digests = np.zeros((len(keys), 16), np.uint8)
            calls = [
                record_arguments(
                    [slab.offset(record) for record, _ in share],
                    [self.headers[HEADER_BYTES * i :].ctypes.data for _, i in share],
                    [bodies[i].ctypes.data for _, i in share],
                    [prefixes[i] for _, i in share],
                ) + (np.zeros((len(share), 16), np.uint8),)
                for share in shares
            ]

            def run(call: tuple) -> None:
                n, offsets, headers, body_ptrs, prefix_ptrs, prefix_bytes, out = call
                got = self.loop.read_records(
                    slab.fd, n, offsets, headers, body_ptrs, slab.record_bytes - HEADER_BYTES, slab.payload_bytes,
                    prefix_ptrs, prefix_bytes, int(verify), out.ctypes.data,
                )  # fmt: skip
                if got != n * slab.record_bytes:
                    raise OSError(f"C loop: read {got} of {n * slab.record_bytes} bytes")

            seconds = bench.timed(lambda: list(self.workers.map(run, calls)))
            if verify:
                for share, call in zip(shares, calls):
                    digests[[i for _, i in share]] = call[-1]
                for i, key in enumerate(keys):
                    header = memoryview(self.headers[HEADER_BYTES * i : HEADER_BYTES * (i + 1)])
                    if recorded_digest(header, NAMESPACE, key, slab.payload_bytes) != digests[i].tobytes():
                        raise AssertionError(f"C loop: chunk {i} does not match its record header")
            return seconds
        finally:
            self.pool.drop_holder("probe")
            self.pool.purge()


class NativeWrites:
    """Writes chunks with the C loop into a file laid out as the tier's slab for this chunk size.

    The same offsets, runs (neighbours share a `pwritev` up to the tier's run size) and
    headers as the tier writes; the threads take contiguous shares, as the tier's jobs do.
    The file is written once before it is timed: a warm write, as into a running tier.
    """

    def __init__(self, loop: ctypes.CDLL, directory: str, shm_dir: str, chunk: int, count: int, threads: int,
                 stack: ExitStack):  # fmt: skip
        self.loop, self.chunk, self.count, self.threads = loop, chunk, count, threads
        alignment = payload_alignment(chunk)
        self.stride, self.lead = record_stride(chunk, alignment), alignment - HEADER_BYTES
        self.body_bytes = align_up(chunk)
        self.packed = self.stride == HEADER_BYTES + self.body_bytes
        path = os.path.join(directory, "probe.slab")
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
        stack.callback(os.remove, path)
        stack.callback(os.close, self.fd)
        os.posix_fallocate(self.fd, 0, self.stride * count)
        memory = stack.enter_context(bench.reference_memory(shm_dir, chunk * count, seed=3))
        self.bodies = np.frombuffer(memory, np.uint8).reshape(count, chunk)
        headers = mmap.mmap(-1, HEADER_BYTES * count)
        stack.callback(headers.close)
        self.headers = np.frombuffer(headers, np.uint8).reshape(count, HEADER_BYTES)
        stack.callback(lambda: setattr(self, "headers", None))
        stack.callback(lambda: setattr(self, "bodies", None))
        self.keys = [make_key(i.to_bytes(32, "big"), 0) for i in range(count)]
        for key, header in zip(self.keys, self.headers):
            RecordHeader(key, NAMESPACE, chunk, bytes(16)).pack(memoryview(header))
        self.prefixes = [NAMESPACE.encode() + key for key in self.keys]
        self.workers = stack.enter_context(ThreadPoolExecutor(threads))
        self.write(seal=False)  # allocate every block once: the timed writes are warm

    def write(self, seal: bool) -> float:
        """Seconds to write every record (sealing each header first, with `seal`)."""
        max_run = min(MAX_RUN, WRITE_RUN_BYTES // (HEADER_BYTES + self.body_bytes)) if self.packed else 1
        calls = [
            record_arguments(
                [i * self.stride + self.lead for i in share],
                [self.headers[i].ctypes.data for i in share],
                [self.bodies[i].ctypes.data for i in share],
                [self.prefixes[i] for i in share],
            )
            for share in contiguous_shares(list(range(self.count)), self.threads)
        ]

        def run(call: tuple) -> None:
            n, *arrays = call
            want = n * (HEADER_BYTES + self.body_bytes)
            got = self.loop.write_records(
                self.fd, n, *arrays[:3], self.body_bytes, self.chunk, *arrays[3:], int(seal), DIGEST_AT, max_run
            )
            if got != want:
                raise OSError(f"C loop: wrote {got} of {want} bytes")

        seconds = bench.timed(lambda: list(self.workers.map(run, calls)))
        if seal:
            for key, header, body in zip(self.keys, self.headers, self.bodies):
                if not record_matches(memoryview(header), NAMESPACE, key, body):
                    raise AssertionError(f"C loop: the header of chunk {key.hex()[:16]} does not match its payload")
        return seconds


def probe(loop: ctypes.CDLL, directory: str, shm_dir: str, chunk: int, threads: int, rounds: int, reads: int) -> dict:
    """Seconds of every reader and writer, in rounds side by side: {name: [seconds, ...]}."""
    count = (512 << 20) // chunk
    seconds: dict[str, list[float]] = {name: [] for name in READERS + WRITERS}
    for r in range(rounds):
        with ExitStack() as stack:
            kv = bench.KvstrataDisk(directory, shm_dir, chunk, count, threads, stack)
            raw = bench.RawODirect(directory, shm_dir, chunk, count, threads, stack)
            vllm = bench.VllmFs(directory, shm_dir, chunk, count, threads, stack)
            seconds["kvstrata warm"].append(kv.write()[1])
            seconds["raw warm"].append(raw.write()[1])
            vllm.write()
            native_writes = NativeWrites(loop, directory, shm_dir, chunk, count, threads, stack)
            seconds["C write"].append(native_writes.write(seal=False))
            seconds["C seal + write"].append(native_writes.write(seal=True))
            native = NativeReads(loop, kv, threads, stack)
            readers = {
                "kvstrata": kv.read,
                "C loop": lambda: native.read(verify=False),
                "C loop + xxh3": lambda: native.read(verify=True),
                "raw": raw.read,
                "vLLM fs": vllm.read,
            }
            for k in range(reads):
                turn = (r + k) % len(READERS)
                for name in READERS[turn:] + READERS[:turn]:  # every reader takes every place in the order
                    seconds[name].append(readers[name]())
    return seconds



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="256,1024,8192", help="chunk sizes in KiB, comma-separated")
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reads", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="kvstrata-probe-") as directory, \
            tempfile.TemporaryDirectory(dir="/dev/shm", prefix="kvstrata-probe-") as shm_dir:  # fmt: skip
        loop = build(Path(directory))
        print(f"512 MiB per measurement, {args.threads} threads, {args.rounds} rounds; GB/s (medians), "
              "then medians of ratios of measurements taken side by side")  # fmt: skip
        for size in map(int, args.sizes.split(",")):
            seconds = probe(loop, directory, shm_dir, size << 10, args.threads, args.rounds, args.reads)
            print(f"{size} KiB chunks")
            report(seconds, READERS, ("raw", "vLLM fs"))
            report(seconds, WRITERS, ("raw warm",))


def report(seconds: dict[str, list[float]], names: tuple[str, ...], references: tuple[str, ...]) -> None:
    for name in names:
        rate = statistics.median((512 << 20) / s / 1e9 for s in seconds[name])
        ratios = "  ".join(
            f"{statistics.median(b / a for a, b in zip(seconds[name], seconds[reference])):.2f}x {reference}"
            for reference in references
        )
        print(f"  {name:16s} {rate:6.2f} GB/s  {ratios}", flush=True)

if __name__ == "__main__":
    main()
