"""Drives the worker's real transfer path without vLLM, and checks every byte.

What runs is what `StrataWorker` runs: `CopyEngine.from_canonical` on a layout's
canonical view, then `store(job, geometry, block_ids, group_sizes, block_indices,
slots)` and `load(...)` with the arguments `submit_store` / `submit_load` pass, into a
real arena (shared-memory segments in a private folder under /dev/shm, registered with
cudaHostRegister by the engine as a worker's are).

A seeded run interleaves, per layout and `engine.gpu_copy` mode:
  * stores right after a compute kernel wrote their blocks through the backend's own
    shape (the compute stream is kept busy first, so a store that did not wait for it
    would read old bytes); several stores and loads in flight at once;
  * loads into blocks a compute kernel scrambled just before (the load must land after
    it), some starting in the middle of a chunk, some spanning chunks of several stores,
    and hybrid layouts' Mamba group storing and loading only a chunk's last block;
  * after each load completes (through `wait`, as vLLM's synchronous loads, or by
    polling `finished`, as its asynchronous ones), a kernel on the compute stream reading
    the blocks through the backend's shape;
  * a reset in the middle (every job flushed, every slot released and reused for new
    chunks) and, at the end, a second engine (a restarted worker: new KV caches, its own
    registration of the same segments) loading every chunk stored since the reset.

Checked: the arena bytes of every stored chunk (against the pages the compute kernel
wrote), every loaded page and every logical value read back, that padding a group does
not copy and every block a load does not name are untouched, that each job is reported
once, in order per direction, successful and with its byte count, and that the arena
was registered without a failure. Mismatches are collected (not raised) so one run
reports them all.

    python -m kvstrata._dev.gpucheck.harness [--device cuda|cpu] [--rounds N] [--out FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from kvstrata.connector.copy_engine import CopyEngine
from kvstrata._dev.gpucheck.layouts import CPU_DIMS, GPU_DIMS, LAYOUTS, Dims, KVLayout, build
from kvstrata.tiers.arena import Arena, SlotPool

HOLDER = "gpucheck"
MAX_IN_FLIGHT = 4
MAX_FAILURES = 20  # per run: enough to see a pattern, short enough to read
SLOT_PADDING = 1032
SLEEP_CYCLES = 1_000_000  # ~0.5 ms of a busy compute stream before each write


@dataclass
class Chunk:
    """One stored chunk of one group: its slot, the sub-blocks it holds, and what it must
    read back as: per ref the canonical page bytes `(len(sub_blocks), ref_bytes)`, per
    view the logical values (block dimension of length len(sub_blocks))."""

    group: int
    slot: int
    sub_blocks: tuple[int, ...]
    pages: list[torch.Tensor]
    values: list[torch.Tensor]


@dataclass
class Job:
    job_id: int
    direction: str
    num_bytes: int
    blocks: list[int]  # GPU blocks it reads (store) or writes (load): busy until done
    chunks: list[Chunk] = field(default_factory=list)  # store: what it publishes
    check: object = None  # load: what to verify once it completed
    by_wait: bool = False


@dataclass
class RunReport:
    layout: str
    gpu_copy: str
    device: str
    pages: str
    slot_mib: float
    stores: int = 0
    loads: int = 0
    chunks_checked: int = 0
    stored_bytes: int = 0
    loaded_bytes: int = 0
    store_gbps: float = 0.0
    load_gbps: float = 0.0
    kernel_jobs: int = 0  # loads the router sent to the Triton kernel
    dma_jobs: int = 0  # stores, and loads it sent by DMA
    registered_mib: float = 0.0
    pin_failures: int = 0
    resets: int = 0
    restarts: int = 0
    seconds: float = 0.0
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


class WorkerHarness:
    """One layout, one gpu_copy mode, one seeded interleaving (see the module docstring)."""

    def __init__(self, layout_name: str, dims: Dims, device: str, gpu_copy: str, seed: int, shm_root: str):
        self.layout_name = layout_name
        self.dims = dims
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.gpu_copy = gpu_copy
        self.rng = np.random.default_rng(seed)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.shm_root = shm_root
        self.job_ids = itertools.count(1)
        self.keys = itertools.count()
        self.layout: KVLayout = build(layout_name, dims, self.device)
        self.pool: SlotPool | None = None
        self.copy_seconds = {"store": 0.0, "load": 0.0}  # GPU time of the copies, from their events
        self.report = RunReport(layout_name, gpu_copy, str(self.device), self.layout.page_summary, 0.0)

    # --- the run -----------------------------------------------------------------------

    def run(self, rounds: int) -> RunReport:
        started = time.perf_counter()
        folder = tempfile.mkdtemp(prefix="kvstrata-gpucheck-", dir=self.shm_root)
        arena = None
        try:
            # A slot a little longer than this rank's part, 8- but not 16-byte aligned: every
            # other slot then starts off 16, and segments (3 slots) are not whole host pages,
            # as with padded pages or a world size that does not divide evenly.
            slot_bytes = self.layout.rank_bytes + SLOT_PADDING
            self.report.slot_mib = slot_bytes / 2**20
            capacity_slots = 6 * MAX_IN_FLIGHT + 8
            arena = Arena(folder, "gpucheck", capacity_slots * slot_bytes, 3 * slot_bytes, lease_seconds=3600, prefault=False)
            self.pool = arena.pool("gpucheck", slot_bytes)
            self._run_engines(self.pool, rounds)
        except Exception as exc:  # noqa: BLE001 - a report names it; the next run goes on
            self._fail(f"aborted: {type(exc).__name__}: {exc}")
        finally:
            if arena is not None:
                arena.close()
            shutil.rmtree(folder, ignore_errors=True)
            self.report.seconds = time.perf_counter() - started
        return self.report

    def _run_engines(self, pool: SlotPool, rounds: int) -> None:
        engine = self._engine(self.layout)
        try:
            stored = self._interleave(engine, pool, rounds)
            self._account(engine)
        finally:
            engine.close()
        # A restarted worker: new KV caches, its own mapping and registration of the segments.
        self.layout = build(self.layout_name, self.dims, self.device)
        self.report.restarts += 1
        second = self._engine(self.layout)
        try:
            state = _State(stored, busy=set())
            for batch in _batches([c for c in stored if c.group == 0], 3):
                self._load(second, pool, state, batch, self._side_chunk(stored), by_wait=True)
                self._drain(second, state, everything=True)
            self._account(second)
        finally:
            second.close()

    def _engine(self, layout: KVLayout) -> CopyEngine:
        return CopyEngine.from_canonical(
            layout.canonical, layout.dims.blocks_per_chunk, rank=0, rank_stride=layout.rank_bytes, gpu_copy=self.gpu_copy
        )

    def _interleave(self, engine: CopyEngine, pool: SlotPool, rounds: int) -> list[Chunk]:
        state = _State([], busy=set())
        rng = self.rng
        for round_ in range(rounds):
            if round_ == rounds // 2:
                self._reset(engine, pool, state)
            if rng.random() < 0.7:
                self._store(engine, pool, state, chunks=int(rng.integers(1, 4)))
            loadable = [c for c in state.stored if c.group == 0]
            if loadable and rng.random() < 0.7:
                picks = rng.choice(len(loadable), size=min(len(loadable), int(rng.integers(1, 4))), replace=False)
                self._load(engine, pool, state, [loadable[i] for i in picks], self._side_chunk(state.stored), rng.random() < 0.5)
            if len(state.jobs) > MAX_IN_FLIGHT or rng.random() < 0.3:
                self._drain(engine, state, everything=False)
            elif rng.random() < 0.5:
                self._poll(engine, state)
        self._drain(engine, state, everything=True)
        return state.stored

    # --- actions -------------------------------------------------------------------------

    def _store(self, engine: CopyEngine, pool: SlotPool, state: _State, chunks: int) -> None:
        layout, bpc = self.layout, self.dims.blocks_per_chunk
        groups = len(layout.views)
        counts = [chunks * bpc if subs is None else len(subs) for subs in layout.stored_sub_blocks]
        blocks = self._free_blocks(state, sum(counts))
        slots_wanted = sum(chunks if subs is None else 1 for subs in layout.stored_sub_blocks)
        if blocks is None:
            return
        slots = pool.reserve(HOLDER, slots_wanted)
        if len(slots) < slots_wanted:
            pool.release(HOLDER, slots)
            return
        self._busy_compute()
        per_group = _split(blocks, counts)
        new_chunks: list[Chunk] = []
        block_indices, slot_iter = [], iter(slots)
        for g in range(groups):
            index = torch.tensor(per_group[g], dtype=torch.int64, device=self.device)
            values = [view.write(index, self.generator) for view in layout.views[g]]  # the forward pass
            pages = [self._rows(ref.tensor_idx).index_select(0, index)[:, : ref.page_size_bytes].clone() for ref in layout.canonical.group_data_refs[g]]
            subs = layout.stored_sub_blocks[g]
            if subs is None:
                block_indices.append(0)
                for i in range(chunks):
                    part = slice(i * bpc, (i + 1) * bpc)
                    new_chunks.append(Chunk(g, next(slot_iter), tuple(range(bpc)), [p[part] for p in pages],
                                            [_narrow(v, view, part) for v, view in zip(values, layout.views[g])]))  # fmt: skip
            else:
                block_indices.append(subs[0])
                new_chunks.append(Chunk(g, next(slot_iter), subs, pages, values))
        job = Job(next(self.job_ids), "store", self._bytes(per_group), blocks, chunks=new_chunks)
        # StrataWorker.submit_store: engine.store(job, geometry, src.block_ids, src.group_sizes, src.block_indices, dst.block_ids)
        engine.store(job.job_id, pool.geometry, np.array(blocks, dtype=np.int32), counts, block_indices, np.array(slots, dtype=np.int64))
        state.submit(job)

    def _load(self, engine: CopyEngine, pool: SlotPool, state: _State, chunks: list[Chunk], side: Chunk | None, by_wait: bool) -> None:
        layout, bpc = self.layout, self.dims.blocks_per_chunk
        skip = int(self.rng.integers(0, bpc)) if self.rng.random() < 0.4 else 0
        loaded = [(0, chunks, skip)]
        if side is not None:
            loaded.append((1, [side], side.sub_blocks[0]))
        counts = [len(cs) * bpc - skip_ if g == 0 else 1 for g, cs, skip_ in loaded]
        blocks = self._free_blocks(state, sum(counts))
        if blocks is None:
            return
        self._busy_compute()
        per_group = _split(blocks, counts)
        for index in per_group:  # a kernel writing the destination blocks just before the load
            dst = torch.tensor(index, dtype=torch.int64, device=self.device)
            for t, entry in enumerate(layout.canonical.tensors):
                rows = self._rows(t)
                noise = torch.randint(-128, 127, (len(index), rows.shape[1]), dtype=torch.int8, device=self.device, generator=self.generator)
                rows.index_copy_(0, dst, noise)
        before = [self._rows(t).clone() for t in range(len(layout.canonical.tensors))]
        slots = [c.slot for _, cs, _ in loaded for c in cs]
        group_sizes = counts + [0] * (len(layout.views) - len(counts))
        block_indices = [first for _, _, first in loaded] + [0] * (len(layout.views) - len(counts))
        check = _LoadCheck(loaded, per_group, before)
        job = Job(next(self.job_ids), "load", self._bytes(per_group), blocks, check=check, by_wait=by_wait)
        # StrataWorker.submit_load: engine.load(job, geometry, src.block_ids (slots), dst.block_ids, dst.group_sizes, dst.block_indices)
        engine.load(job.job_id, pool.geometry, np.array(slots, dtype=np.int64), np.array(blocks, dtype=np.int32), group_sizes, block_indices)
        state.submit(job)
        if by_wait:  # a synchronous load: the forward pass waits, then reads at once
            engine.wait({job.job_id})
            self._poll(engine, state, until=job.job_id)

    def _reset(self, engine: CopyEngine, pool: SlotPool, state: _State) -> None:
        """As vLLM's reset: flush every job, then every slot is free for new chunks."""
        self._drain(engine, state, everything=True)
        pool.release(HOLDER, [c.slot for c in state.stored])
        state.stored.clear()
        self.report.resets += 1

    # --- completion --------------------------------------------------------------------

    def _poll(self, engine: CopyEngine, state: _State, until: int | None = None) -> None:
        deadline = time.monotonic() + 60
        while True:
            for done in engine.finished():
                self._complete(state, done)
            if until is None or until not in state.jobs:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {until} was not reported finished within 60 s of its wait()")
            time.sleep(0.0005)

    def _drain(self, engine: CopyEngine, state: _State, everything: bool) -> None:
        if not state.jobs:
            return
        ids = set(state.jobs) if everything else {min(state.jobs)}
        engine.wait(ids)
        for job_id in sorted(ids):
            self._poll(engine, state, until=job_id)

    def _complete(self, state: _State, done) -> None:
        job = state.jobs.pop(done.job_id, None)
        if job is None:
            self._fail(f"job {done.job_id} reported finished twice or never submitted")
            return
        order = state.order[job.direction]
        if order[0] != job.job_id:
            self._fail(f"{job.direction} job {job.job_id} finished before job {order[0]} of the same direction")
        order.remove(job.job_id)
        if not done.success or done.num_bytes != job.num_bytes:
            self._fail(f"{job.direction} job {job.job_id}: success={done.success}, {done.num_bytes} bytes, expected {job.num_bytes}")
        self.copy_seconds[job.direction] += done.seconds
        state.busy.difference_update(job.blocks)
        if job.direction == "store":
            self.report.stores += 1
            self.report.stored_bytes += job.num_bytes
            for chunk in job.chunks:
                self._check_slot(chunk)
            state.stored.extend(job.chunks)
        else:
            self.report.loads += 1
            self.report.loaded_bytes += job.num_bytes
            self._check_load(job)
        self.report.store_gbps = _gbps(self.report.stored_bytes, self.copy_seconds["store"])
        self.report.load_gbps = _gbps(self.report.loaded_bytes, self.copy_seconds["load"])

    def _check_slot(self, chunk: Chunk) -> None:
        """The arena bytes of a stored chunk: slot = tensor regions of bpc pages each."""
        pool_view = self.pool.view(chunk.slot)
        bpc = self.dims.blocks_per_chunk
        page_bytes = [t.page_size_bytes for t in self.layout.canonical.tensors]
        region_start = np.concatenate(([0], np.cumsum(page_bytes) * bpc))
        sub = list(chunk.sub_blocks)
        for ref, want in zip(self.layout.canonical.group_data_refs[chunk.group], chunk.pages):
            t, size = ref.tensor_idx, ref.page_size_bytes
            region = pool_view[region_start[t] : region_start[t] + bpc * page_bytes[t]].reshape(bpc, page_bytes[t])
            got = region[sub, :size].view(np.int8)
            expect = want.cpu().numpy()
            if not np.array_equal(got, expect):
                where = np.argwhere(got != expect)[0]
                self._fail(f"slot {chunk.slot} (group {chunk.group}, tensor {t}): sub-block {sub[where[0]]} byte {where[1]} "
                           f"is {int(got[tuple(where)])}, the page held {int(expect[tuple(where)])}")  # fmt: skip
        self.report.chunks_checked += 1

    def _check_load(self, job: Job) -> None:
        check: _LoadCheck = job.check
        layout = self.layout
        touched: dict[int, list[int]] = {}
        self.report.chunks_checked += sum(len(cs) for _, cs, _ in check.loaded)
        for (g, chunks, skip), dst in zip(check.loaded, check.per_group):
            index = torch.tensor(dst, dtype=torch.int64, device=self.device)
            start = skip if g == 0 else 0
            for r, ref in enumerate(layout.canonical.group_data_refs[g]):
                t, size = ref.tensor_idx, ref.page_size_bytes
                want = torch.cat([c.pages[r] for c in chunks])[start:]
                got = self._rows(t).index_select(0, index)
                if not torch.equal(got[:, :size], want):
                    self._fail(f"load job {job.job_id}: group {g} tensor {t} pages differ from what was stored")
                if size < got.shape[1] and not torch.equal(got[:, size:], check.before[t].index_select(0, index)[:, size:]):
                    self._fail(f"load job {job.job_id}: group {g} tensor {t} padding past {size} bytes was written")
                touched.setdefault(t, []).extend(dst)
            for v, view in enumerate(layout.views[g]):  # a kernel reading the blocks right after
                want = torch.cat([c.values[v] for c in chunks], dim=view.block_dim)
                want = want.narrow(view.block_dim, start, want.shape[view.block_dim] - start)
                if not torch.equal(view.read(index), want):
                    self._fail(f"load job {job.job_id}: {view.name} reads other values than were written")
        if not job.by_wait:
            # Polled loads complete while later rounds write other blocks: only a load
            # checked right after its wait() can prove it wrote nothing else.
            return
        for t, before in enumerate(check.before):
            mask = torch.ones(before.shape[0], dtype=torch.bool, device=self.device)
            mask[torch.tensor(touched.get(t, []), dtype=torch.int64, device=self.device)] = False
            if not torch.equal(self._rows(t)[mask], before[mask]):
                self._fail(f"load job {job.job_id}: tensor {t} changed in blocks the load did not name")

    # --- helpers -----------------------------------------------------------------------

    def _account(self, engine: CopyEngine) -> None:
        if engine.pinning is not None:
            self.report.registered_mib += engine.pinning.registered_bytes / 2**20
            self.report.pin_failures += engine.pinning.failures
            if engine.pinning.failures:
                self._fail(f"cudaHostRegister failed {engine.pinning.failures} time(s) on the arena")
        counts = getattr(engine.executor, "counts", None)
        if counts:
            self.report.kernel_jobs += counts.get("kernel", 0)
            self.report.dma_jobs += counts.get("dma", 0)

    def _rows(self, t: int) -> torch.Tensor:
        return self.layout.canonical.tensors[t].tensor

    def _busy_compute(self) -> None:
        if self.cuda:
            torch.cuda._sleep(SLEEP_CYCLES)

    def _free_blocks(self, state: _State, count: int) -> list[int] | None:
        """Blocks no job in flight uses: half the time one consecutive run (rows merge),
        else scattered in random order (nothing merges)."""
        free = np.array(sorted(set(range(self.dims.num_blocks)) - state.busy), dtype=np.int64)
        if len(free) < count:
            return None
        if self.rng.random() < 0.5:
            runs = [i for i in range(len(free) - count + 1) if free[i + count - 1] - free[i] == count - 1]
            if runs:
                first = runs[int(self.rng.integers(len(runs)))]
                return free[first : first + count].tolist()
        return self.rng.choice(free, size=count, replace=False).tolist()

    def _side_chunk(self, stored: list[Chunk]) -> Chunk | None:
        side = [c for c in stored if c.group == 1]
        return side[int(self.rng.integers(len(side)))] if side else None

    def _bytes(self, per_group: list[list[int]]) -> int:
        refs = self.layout.canonical.group_data_refs
        return sum(len(blocks) * sum(r.page_size_bytes for r in refs[g]) for g, blocks in enumerate(per_group))

    def _fail(self, message: str) -> None:
        if len(self.report.failures) < MAX_FAILURES:
            self.report.failures.append(f"{self.layout_name} [{self.gpu_copy}]: {message}")


@dataclass
class _State:
    stored: list[Chunk]
    busy: set[int]
    jobs: dict[int, Job] = field(default_factory=dict)
    order: dict[str, list[int]] = field(default_factory=lambda: {"store": [], "load": []})

    def submit(self, job: Job) -> None:
        self.jobs[job.job_id] = job
        self.order[job.direction].append(job.job_id)
        self.busy.update(job.blocks)


@dataclass
class _LoadCheck:
    loaded: list[tuple[int, list[Chunk], int]]  # (group, chunks, first block index)
    per_group: list[list[int]]  # destination blocks per loaded group
    before: list[torch.Tensor]  # every canonical tensor just before the load


def _split(blocks: list[int], counts: list[int]) -> list[list[int]]:
    out, start = [], 0
    for count in counts:
        out.append(blocks[start : start + count])
        start += count
    return out


def _narrow(values: torch.Tensor, view, part: slice) -> torch.Tensor:
    return values.narrow(view.block_dim, part.start, part.stop - part.start)


def _batches(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


# --- the command -------------------------------------------------------------------------


def run_all(device: str, layouts: list[str], modes: list[str], rounds: int, seed: int, shm_root: str) -> list[RunReport]:
    """Every layout under every mode, one seeded run each; never raises for a mismatch."""
    dims = GPU_DIMS if device == "cuda" else CPU_DIMS
    reports = []
    for i, (name, mode) in enumerate(itertools.product(layouts, modes)):
        report = WorkerHarness(name, dims, device, mode, seed + i, shm_root).run(rounds)
        reports.append(report)
        verdict = "ok" if report.ok else f"{len(report.failures)} FAILURE(S)"
        print(
            f"  {name:22s} {mode:6s} pages {report.pages:>14s}: {report.stores:3d} stores {report.store_gbps:6.2f} GB/s, "
            f"{report.loads:3d} loads {report.load_gbps:6.2f} GB/s (jobs by kernel {report.kernel_jobs}, by DMA {report.dma_jobs}), "
            f"{report.chunks_checked} chunks checked, {report.seconds:5.1f} s: {verdict}",
            flush=True,
        )
        for failure in report.failures:
            print(f"    {failure}", flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
    return reports


def default_shm_root() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated <backend>/<dtype>")
    parser.add_argument("--modes", default=None, help="engine.gpu_copy modes (default: auto,dma,kernel on CUDA, auto on CPU)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds per run (default 16 on CUDA, 10 on CPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shm-root", default=default_shm_root(), help="where the private arena folder is made")
    parser.add_argument("--out", default=None, help="write the reports as JSON here")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here; --device cpu runs the same harness on CPU tensors")
    cuda = args.device == "cuda"
    modes = (args.modes or ("auto,dma,kernel" if cuda else "auto")).split(",")
    rounds = args.rounds or (16 if cuda else 10)
    layouts = args.layouts.split(",")
    print(f"worker harness on {args.device}: {len(layouts)} layouts x {len(modes)} modes, {rounds} rounds each", flush=True)
    reports = run_all(args.device, layouts, modes, rounds, args.seed, args.shm_root)
    failed = [r for r in reports if not r.ok]
    summary = {
        "device": args.device,
        "runs": len(reports),
        "failed_runs": len(failed),
        "jobs": sum(r.stores + r.loads for r in reports),
        "chunks_checked": sum(r.chunks_checked for r in reports),
        "bytes_moved": sum(r.stored_bytes + r.loaded_bytes for r in reports),
        "reports": [asdict(r) for r in reports],
    }
    if args.out:
        with open(args.out, "w") as file:
            json.dump(summary, file, indent=1)
    print(
        f"harness: {summary['runs']} runs, {summary['jobs']} jobs, {summary['chunks_checked']} chunks checked, "
        f"{summary['bytes_moved'] / 2**30:.2f} GiB moved: "
        + ("every byte exact" if not failed else f"{len(failed)} run(s) FAILED"),
        flush=True,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
