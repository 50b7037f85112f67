"""Moves a transfer's descriptors with a Triton copy kernel (pinned host memory <-> GPU).

Why a kernel: for many small rows a few SMs reading or writing mapped host memory beat
the DMA engines, whose cost per descriptor dominates there (measured on an H200 by the
GPU check; the rule lives in choice.py). An executor built with
`directions=("load", "store")` also copies GPU -> host (the engine's does: choice.py
sends transfers of rows under 256 KiB here).

The kernel: a fixed number of programs (a small SM slice) walk the descriptor table
[dst... | src... | sizes...] (int64); each program takes ROWS consecutive rows at a
time (rows pid*ROWS.., then a grid further) and copies them in [ROWS, WORDS] tiles of
int64 words, masked at each row's end. Every size and address must be a multiple of 8 (checked before launch); where all are multiples of 16
the launch says so (ALIGN16) and each access moves 16 bytes (checked: the sm_90 PTX
then has ld/st.global.v2.b64, without it ld/st.global.b64). Host memory must be registered
with CUDA (pinning.py): the kernel reads it through its unified address.

Descriptor tables travel to the GPU from a pool of pinned buffers (`PinnedPool`); a
buffer is handed out again only after the end event of the job that used it fired (the
host -> device copy of the table reads it asynchronously). Jobs share `JobLedger` with
the DMA executor, so kernel and DMA jobs of one direction are ordered on one stream.

No vLLM import; Triton is optional (KernelExecutor refuses to start without it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvstrata.connector.copy.cuda_dma import JobLedger, StreamOps, TorchStreamOps, check_descriptors
from kvstrata.connector.copy.descriptors import WORD_BYTES, Descriptors

try:
    import triton
    import triton.language as tl
except ImportError:  # the DMA executor alone still works
    triton = None
    tl = None

# A small SM slice, each program keeping 16 rows x 8 KiB in flight. Measured on an H200
# (benchmarks/gpu_kernel_sweep.py, 26 Nov 2026): 2 programs x 16 rows moved 43-47 GB/s
# loading and 46-48 storing at 8-256 KiB rows, about what 4-16 programs did, with the
# least cost to GEMMs beside them; 12 programs of one row at a time moved 25-30 GB/s
# loading (a read from host waits ~1-2 us on the link: rows in flight are the knob).
NUM_PROGRAMS = 2
CHUNK_WORDS = 1024  # 8 KiB per row per inner step
ROWS_PER_STEP = 16  # rows a program moves at once: [16, 1024] words, 64 per thread
NUM_WARPS = 8
MIN_TABLE_ROWS = 1024  # pinned buffers hold at least this many rows (3 int64 each)

# launch(table, rows, programs, chunk_words, align16): queue the copy on the current stream.
Launch = Callable[[torch.Tensor, int, int, int, bool], None]


if triton is not None:

    @triton.jit
    def copy_rows_kernel(table, rows, WORDS: tl.constexpr, ALIGN16: tl.constexpr, ROWS: tl.constexpr = 1):
        """Row r copies table[2R + r] bytes from table[R + r] to table[r] (R = rows).

        Each program moves ROWS consecutive rows at once ([ROWS, WORDS] words per step),
        then jumps ahead by the grid: more rows in flight per program is what a load
        from host memory needs (its reads wait ~1-2 us on the link), without taking more
        SMs. ALIGN16 promises every address and size is a multiple of 16 bytes: the
        compiler then moves two words per access (ld/st.global.v2.b64) instead of one.
        """
        offsets = tl.arange(0, WORDS)
        lanes = tl.arange(0, ROWS)
        first_row = tl.program_id(0) * ROWS
        step = tl.num_programs(0) * ROWS
        while first_row < rows:
            row = first_row + lanes
            live = row < rows
            dst = tl.load(table + row, mask=live, other=0).to(tl.pointer_type(tl.int64))
            src = tl.load(table + rows + row, mask=live, other=0).to(tl.pointer_type(tl.int64))
            words = tl.load(table + 2 * rows + row, mask=live, other=0) // 8
            if ALIGN16:
                dst = tl.multiple_of(dst, 16)
                src = tl.multiple_of(src, 16)
                words = tl.multiple_of(words, 2)
            longest = tl.max(words, axis=0)
            for first in range(0, longest, WORDS):
                index = tl.max_contiguous(tl.multiple_of(first + offsets, 2), WORDS)
                inside = index[None, :] < words[:, None]
                values = tl.load(src[:, None] + index[None, :], mask=inside, other=0)
                tl.store(dst[:, None] + index[None, :], values, mask=inside)
            first_row += step


def triton_launch(
    table: torch.Tensor,
    rows: int,
    programs: int,
    chunk_words: int,
    align16: bool = False,
    rows_per_step: int = 1,
    warps: int = 4,
) -> None:
    """Launch `copy_rows_kernel` on the current stream (Triton uses torch's)."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    grid = (max(1, min(programs, -(-rows // rows_per_step))),)
    copy_rows_kernel[grid](table, rows, WORDS=chunk_words, ALIGN16=align16, ROWS=rows_per_step, num_warps=warps)


def reference_copy(table: np.ndarray, rows: int) -> None:
    """What the kernel does, on the CPU (memmove per row): the fake launch in tests."""
    import ctypes

    for row in range(rows):
        ctypes.memmove(int(table[row]), int(table[rows + row]), int(table[2 * rows + row]))


def check_words(desc: Descriptors) -> bool:
    """The kernel moves int64 words: every size and address must be a multiple of 8.
    Returns whether they are all multiples of 16 too (the two-word variant applies)."""
    if desc.rows == 0:
        return False
    bits = int(np.bitwise_or.reduce(desc.sizes) | np.bitwise_or.reduce(desc.dst) | np.bitwise_or.reduce(desc.src))
    if bits % WORD_BYTES:
        raise ValueError("the copy kernel needs every size and address to be a multiple of 8 bytes")
    return bits % 16 == 0


class PinnedPool:
    """int64 buffers for descriptor tables, pinned; a buffer is reused only after `give`.

    Capacities are powers of two (at least MIN_TABLE_ROWS * 3 words) so buffers are
    reusable across transfers of different sizes; at most `keep` idle buffers per
    capacity are kept.
    """

    def __init__(self, alloc: Callable[[int], torch.Tensor] | None = None, keep: int = 4):
        self._alloc = alloc if alloc is not None else _pinned_int64
        self._free: dict[int, list[torch.Tensor]] = {}
        self.keep = keep
        self.allocated = 0
        self.lent = 0

    def take(self, words: int) -> torch.Tensor:
        capacity = max(3 * MIN_TABLE_ROWS, 1 << max(0, words - 1).bit_length())
        free = self._free.get(capacity)
        self.lent += 1
        if free:
            return free.pop()
        self.allocated += 1
        return self._alloc(capacity)

    def give(self, buffer: torch.Tensor) -> None:
        self.lent -= 1
        free = self._free.setdefault(buffer.numel(), [])
        if len(free) < self.keep:
            free.append(buffer)


def _pinned_int64(words: int) -> torch.Tensor:
    return torch.empty(words, dtype=torch.int64, pin_memory=True)


class KernelExecutor:
    """submit / finished / wait / close over the Triton kernel; `directions` it accepts
    (loads only unless asked: the rule in choice.py never sends it a store)."""

    def __init__(
        self,
        device: torch.device | int | str | None = None,
        *,
        ops: StreamOps | None = None,
        ledger: JobLedger | None = None,
        launch: Launch | None = None,
        pool: PinnedPool | None = None,
        programs: int = NUM_PROGRAMS,
        chunk_words: int = CHUNK_WORDS,
        directions: tuple[str, ...] = ("load",),
        rows_per_step: int = ROWS_PER_STEP,
        warps: int = NUM_WARPS,
    ):
        if launch is None and triton is None:
            raise RuntimeError("the Triton copy kernel needs triton installed; use gpu_copy: dma")
        if ledger is None:
            ledger = JobLedger(ops if ops is not None else TorchStreamOps(device))
        self.ledger = ledger
        if device is None:
            device = getattr(ledger.ops, "device", "cuda")
        self.device = torch.device(device)
        if rows_per_step < 1 or rows_per_step & (rows_per_step - 1):
            raise ValueError(f"rows_per_step must be a power of two, got {rows_per_step}")
        self.rows_per_step = rows_per_step
        self.warps = warps
        self._launch = (
            launch if launch is not None else functools.partial(triton_launch, rows_per_step=rows_per_step, warps=warps)
        )
        self.pool = pool if pool is not None else PinnedPool()
        if programs < 1 or chunk_words < 1 or chunk_words & (chunk_words - 1):
            raise ValueError("programs must be >= 1 and chunk_words a power of two")
        self.programs = programs
        self.chunk_words = chunk_words
        self.directions = tuple(directions)

    def submit(self, job_id: int, direction: str, desc: Descriptors) -> None:
        """Queue the transfer on its direction's stream: table to the GPU, then the kernel."""
        if direction not in self.directions:
            raise ValueError(f"this copy kernel executor does {' and '.join(d + 's' for d in self.directions)} only, not {direction}s")
        check_descriptors(desc)
        align16 = check_words(desc)
        rows = desc.rows
        if rows == 0:
            self.ledger.run(job_id, direction, 0, lambda stream: None, hold=(desc,))
            return
        pool = self.pool
        buffer = pool.take(3 * rows)
        table = buffer.numpy()
        table[:rows] = desc.dst
        table[rows : 2 * rows] = desc.src
        table[2 * rows : 3 * rows] = desc.sizes
        staged: list[torch.Tensor] = []
        launch, device, programs, words = self._launch, self.device, self.programs, self.chunk_words

        def enqueue(stream: Any) -> None:
            # Inside the direction's stream context: the copy and the kernel queue there, and
            # the device table is allocated for that stream.
            on_device = buffer[: 3 * rows].to(device, non_blocking=True)
            staged.append(on_device)
            launch(on_device, rows, programs, words, align16)

        self.ledger.run(
            job_id, direction, desc.num_bytes, enqueue, hold=(desc, buffer, staged), release=lambda: pool.give(buffer)
        )

    def finished(self) -> list:
        return self.ledger.finished()

    def wait(self, job_ids: set[int]) -> None:
        self.ledger.wait(job_ids)

    def close(self) -> None:
        self.ledger.close()
