"""The CUDA copy executors on a CPU: the device and the driver copy replaced by fakes.

FakeDevice models CUDA streams as queues of operations that run only when a test (or a
synchronize) drives them, so the tests see ordering: a stream that waited on the
compute stream cannot run past compute work queued before the wait; an event is done
once everything queued before it on its stream ran. The fake copies are real memmoves
between numpy buffers, done when the stream gets to them, reading the descriptors at
that moment (as the DMA engine or the kernel would).

Also here: the dma/kernel rule, pinning's piece split and rollback, and the Triton
kernel under TRITON_INTERPRET=1 (a subprocess, as the variable must be set before
Triton is imported).
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import subprocess
import sys
import weakref
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from kvstrata.connector.copy import choice, pinning
from kvstrata.connector.copy.choice import CudaCopyRouter, choose
from kvstrata.connector.copy.cuda_dma import CudaDmaExecutor, JobLedger
from kvstrata.connector.copy.descriptors import Descriptors
from kvstrata.connector.copy.triton_copy import KernelExecutor, PinnedPool, reference_copy

KIB = 1024
GIB = 1 << 30


# --- the fake device -------------------------------------------------------------------


class FakeStream:
    def __init__(self, device: FakeDevice, name: str):
        self.device = device
        self.name = name
        self.ops: list = []  # ("run", fn) | ("wait", stream, count)
        self.done = 0

    def step(self) -> None:
        """Run the next operation; a wait first drives the stream it waits on."""
        kind, *args = self.ops[self.done]
        if kind == "wait":
            other, count = args
            other.run_to(count)
        else:
            args[0]()
        self.ops[self.done] = ("ran",)  # a device keeps no reference to what it copied
        self.done += 1

    def run_to(self, count: int) -> None:
        while self.done < count:
            self.step()

    def run_all(self) -> None:
        self.run_to(len(self.ops))


class FakeEvent:
    def __init__(self, stream: FakeStream):
        self.stream = stream
        self.count = len(stream.ops)

    @property
    def done(self) -> bool:
        return self.stream.done >= self.count


class FakeDevice:
    """StreamOps plus the BatchCopy and kernel launch that queue onto its streams."""

    def __init__(self):
        self.compute = FakeStream(self, "compute")
        self.streams: dict[int, FakeStream] = {}
        self.active: FakeStream | None = None
        self.copies: list[tuple[str, bool, int]] = []  # (stream, src_order_any, rows) per batch call
        self.waits: list[tuple[str, int]] = []  # (stream, compute ops it waited for)
        self.fail_next = False
        self.align16: list[bool] = []  # per kernel launch

    # StreamOps
    def new_stream(self, direction):
        stream = FakeStream(self, direction)
        self.streams[id(stream)] = stream
        return stream

    def handle(self, stream):
        return id(stream)

    def wait_current(self, stream):
        self.waits.append((stream.name, len(self.compute.ops)))
        stream.ops.append(("wait", self.compute, len(self.compute.ops)))

    def record(self, stream):
        return FakeEvent(stream)

    def query(self, event):
        return event.done

    def synchronize(self, event):
        event.stream.run_to(event.count)

    def seconds(self, start, end):
        return 0.001

    @contextmanager
    def activate(self, stream):
        self.active = stream
        try:
            yield
        finally:
            self.active = None

    # the copies
    def batch_copy(self, dst, src, sizes, handle, src_order_any):
        stream = self.streams[handle]
        self.copies.append((stream.name, src_order_any, len(sizes)))
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("CUDA_ERROR_INVALID_VALUE (fake)")

        def run():
            for d, s, n in zip(dst.tolist(), src.tolist(), sizes.tolist()):
                ctypes.memmove(d, s, n)

        stream.ops.append(("run", run))

    def launch(self, table, rows, programs, chunk_words, align16):
        assert self.active is not None, "the kernel must be launched inside the load stream's context"
        self.copies.append((self.active.name, True, rows))
        self.align16.append(align16)
        self.active.ops.append(("run", lambda: reference_copy(table.numpy(), rows)))

    def on_compute(self, fn) -> None:
        """Queue work on the compute stream (a forward pass writing KV)."""
        self.compute.ops.append(("run", fn))


def descriptors(dst: np.ndarray, dst_off, src: np.ndarray, src_off, sizes) -> Descriptors:
    dst_base, src_base = dst.ctypes.data, src.ctypes.data
    return Descriptors(
        np.ascontiguousarray(dst_base + np.asarray(dst_off, dtype=np.int64)),
        np.ascontiguousarray(src_base + np.asarray(src_off, dtype=np.int64)),
        np.ascontiguousarray(np.asarray(sizes, dtype=np.int64)),
    )


def buffers(nbytes=64 * KIB, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, nbytes, dtype=np.uint8), np.zeros(nbytes, dtype=np.uint8)


def pages(job: int, count: int = 4, page: int = 1 * KIB):
    """Offsets of `count` non-adjacent pages of job `job` (each job its own region)."""
    base = job * 2 * count * page
    offs = [base + 2 * i * page for i in range(count)]
    return offs, [page] * count


@pytest.fixture
def device():
    return FakeDevice()


def dma(device):
    return CudaDmaExecutor(ops=device, batch_copy=device.batch_copy)


# --- sequencing ------------------------------------------------------------------------


@pytest.mark.parametrize("direction", ["store", "load"])
def test_jobs_of_one_direction_complete_in_submission_order(device, direction):
    src, dst = buffers()
    ex = dma(device)
    for job in (1, 2, 3):
        offs, sizes = pages(job)
        ex.submit(job, direction, descriptors(dst, offs, src, offs, sizes))
    assert ex.finished() == []  # nothing ran yet: no job may be reported
    stream = ex.ledger.streams[direction]
    end_of_job1 = 2  # the fake queues two operations per job: the wait on compute, the copy
    stream.run_to(end_of_job1)
    assert [c.job_id for c in ex.finished()] == [1]
    stream.run_all()
    done = ex.finished()
    assert [c.job_id for c in done] == [2, 3]
    assert all(c.success and c.num_bytes == 4 * KIB for c in done)
    for job in (1, 2, 3):
        offs, sizes = pages(job)
        for off, n in zip(offs, sizes):
            np.testing.assert_array_equal(dst[off : off + n], src[off : off + n])


def test_wait_returns_only_once_the_named_job_is_done(device):
    src, dst = buffers()
    ex = dma(device)
    for job in (1, 2):
        offs, sizes = pages(job)
        ex.submit(job, "load", descriptors(dst, offs, src, offs, sizes))
    offs1, _ = pages(1)
    offs2, _ = pages(2)
    assert not dst[offs1[0] : offs1[0] + KIB].any()
    ex.wait({1})
    np.testing.assert_array_equal(dst[offs1[0] : offs1[0] + KIB], src[offs1[0] : offs1[0] + KIB])
    assert not dst[offs2[0] : offs2[0] + KIB].any(), "wait({1}) ran job 2 as well: the fake would hide a bug"
    ex.wait({2, 99})  # a job not in flight (unknown or already reported) returns at once
    np.testing.assert_array_equal(dst[offs2[0] : offs2[0] + KIB], src[offs2[0] : offs2[0] + KIB])
    assert [c.job_id for c in ex.finished()] == [1, 2]


def test_store_waits_for_compute_queued_before_it(device):
    """A store issued right after the forward pass wrote the page sees the written bytes."""
    src, dst = buffers()
    ex = dma(device)
    device.on_compute(lambda: src.__setitem__(slice(0, KIB), 7))  # queued, not yet run
    ex.submit(1, "store", descriptors(dst, [0], src, [0], [KIB]))
    ex.wait({1})
    assert (dst[:KIB] == 7).all()
    assert device.waits == [("store", 1)]


def test_load_does_not_overtake_compute_queued_on_its_blocks(device):
    src, dst = buffers()
    ex = dma(device)
    device.on_compute(lambda: dst.__setitem__(slice(0, KIB), 0xFF))  # e.g. zeroing the block
    ex.submit(1, "load", descriptors(dst, [0], src, [0], [KIB]))
    ex.wait({1})
    np.testing.assert_array_equal(dst[:KIB], src[:KIB])  # the load landed after, not before
    assert device.waits == [("load", 1)]


def test_directions_use_their_own_streams_and_source_order(device):
    src, dst = buffers()
    ex = dma(device)
    ex.submit(1, "store", descriptors(dst, [0], src, [0], [KIB]))
    ex.submit(2, "load", descriptors(dst, [4 * KIB], src, [4 * KIB], [KIB]))
    assert device.copies == [("store", False, 1), ("load", True, 1)]
    # the load can finish while the store is still queued
    ex.ledger.streams["load"].run_all()
    assert [c.job_id for c in ex.finished()] == [2]
    ex.close()
    assert ex.ledger.in_flight == 0


def test_descriptors_are_held_until_completion_then_released(device):
    src, dst = buffers()
    ex = dma(device)
    desc = descriptors(dst, [0, 2 * KIB], src, [0, 2 * KIB], [KIB, KIB])
    refs = [weakref.ref(a) for a in desc]
    ex.submit(1, "store", desc)
    del desc
    gc.collect()
    assert all(r() is not None for r in refs), "descriptor arrays released while the copy may still read them"
    assert ex.ledger.holds(1)
    ex.ledger.streams["store"].run_all()
    assert [c.job_id for c in ex.finished()] == [1]
    gc.collect()
    assert all(r() is None for r in refs), "descriptor arrays kept after the job completed"
    assert ex.ledger.holds(1) == ()


def test_a_refused_copy_completes_unsuccessfully_after_its_end_event(device, caplog):
    src, dst = buffers()
    ex = dma(device)
    device.fail_next = True
    with caplog.at_level(logging.ERROR):
        ex.submit(1, "store", descriptors(dst, [0], src, [0], [KIB]))
    assert "could not be queued" in caplog.text
    assert ex.finished() == []  # not before its end event
    ex.wait({1})
    (done,) = ex.finished()
    assert (done.job_id, done.success, done.num_bytes) == (1, False, 0)


def test_submit_refuses_a_job_already_in_flight_and_bad_arrays(device):
    src, dst = buffers()
    ex = dma(device)
    ex.submit(1, "store", descriptors(dst, [0], src, [0], [KIB]))
    with pytest.raises(ValueError, match="already in flight"):
        ex.submit(1, "store", descriptors(dst, [0], src, [0], [KIB]))
    bad = Descriptors(np.zeros(2, np.int32), np.zeros(2, np.int64), np.ones(2, np.int64))
    with pytest.raises(ValueError, match="int64"):
        ex.submit(2, "store", bad)
    with pytest.raises(ValueError, match="direction"):
        ex.submit(3, "sideways", descriptors(dst, [0], src, [0], [KIB]))


def test_empty_transfer_completes_in_order_with_zero_bytes(device):
    src, dst = buffers()
    ex = dma(device)
    ex.submit(1, "load", descriptors(dst, [0], src, [0], [KIB]))
    empty = np.zeros(0, np.int64)
    ex.submit(2, "load", Descriptors(empty, empty.copy(), empty.copy()))
    assert ex.finished() == []
    ex.ledger.streams["load"].run_all()
    assert [(c.job_id, c.num_bytes) for c in ex.finished()] == [(1, KIB), (2, 0)]
    assert device.copies == [("load", True, 1)]  # no driver call for an empty transfer


# --- the kernel executor and the router --------------------------------------------------


def kernel(device, pool=None, ledger=None):
    return KernelExecutor(
        "cpu",
        ledger=ledger if ledger is not None else JobLedger(device),
        launch=device.launch,
        pool=pool if pool is not None else PinnedPool(alloc=lambda n: torch.empty(n, dtype=torch.int64)),
    )


def test_kernel_executor_copies_in_order_and_reuses_a_table_only_after_completion(device):
    src, dst = buffers(256 * KIB)
    ex = kernel(device)
    offs1, sizes1 = pages(1, count=32)
    offs2, sizes2 = pages(2, count=32)
    ex.submit(1, "load", descriptors(dst, offs1, src, offs1, sizes1))
    ex.submit(2, "load", descriptors(dst, offs2, src, offs2, sizes2))
    # both tables are in flight: the second job must not have been handed the first's buffer
    assert ex.pool.allocated == 2 and ex.pool.lent == 2
    ex.wait({1})
    assert [c.job_id for c in ex.finished()] == [1]
    assert ex.pool.lent == 1
    offs3, sizes3 = pages(3, count=32)
    ex.submit(3, "load", descriptors(dst, offs3, src, offs3, sizes3))
    assert ex.pool.allocated == 2, "the completed job's table was not reused"
    ex.close()
    for offs, sizes in ((offs1, sizes1), (offs2, sizes2), (offs3, sizes3)):
        for off, n in zip(offs, sizes):
            np.testing.assert_array_equal(dst[off : off + n], src[off : off + n])


def test_kernel_executor_refuses_stores_and_unaligned_rows(device):
    src, dst = buffers()
    ex = kernel(device)
    with pytest.raises(ValueError, match="loads only"):
        ex.submit(1, "store", descriptors(dst, [0], src, [0], [KIB]))
    with pytest.raises(ValueError, match="multiple of 8"):
        ex.submit(2, "load", descriptors(dst, [0], src, [0], [KIB + 4]))
    with pytest.raises(ValueError, match="multiple of 8"):
        ex.submit(3, "load", descriptors(dst, [4], src, [0], [KIB]))


def test_a_kernel_executor_built_for_stores_copies_them_on_the_store_stream(device):
    """The rule sends stores of small rows here (DMA pays per row); they run on the store stream."""
    src, dst = buffers()
    ex = KernelExecutor(
        "cpu",
        ledger=JobLedger(device),
        launch=device.launch,
        pool=PinnedPool(alloc=lambda n: torch.empty(n, dtype=torch.int64)),
        directions=("load", "store"),
    )
    offs, sizes = pages(0, count=8)
    ex.submit(1, "store", descriptors(dst, offs, src, offs, sizes))
    ex.wait({1})
    (done,) = ex.finished()
    assert done.success and done.num_bytes == sum(sizes)
    for off, size in zip(offs, sizes):
        assert np.array_equal(dst[off : off + size], src[off : off + size])
    assert not dst[KIB : 2 * KIB].any()  # between the pages: untouched


def test_router_sends_small_loads_to_the_kernel_and_keeps_one_load_order(device):
    src, dst = buffers(512 * KIB)
    ledger = JobLedger(device)
    router = CudaCopyRouter(
        "auto",
        CudaDmaExecutor(ledger=ledger, batch_copy=device.batch_copy),
        kernel(device, ledger=ledger),
        host_pinned=lambda: True,
    )
    offs_small, sizes_small = pages(0, count=16, page=2 * KIB)  # 16 small rows: kernel
    offs_big, sizes_big = pages(1, count=2, page=64 * KIB)  # 2 rows: too few, DMA
    router.submit(1, "load", descriptors(dst, offs_small, src, offs_small, sizes_small))
    router.submit(2, "load", descriptors(dst, offs_big, src, offs_big, sizes_big))
    router.submit(3, "store", descriptors(dst, [500 * KIB], src, [500 * KIB], [KIB]))
    assert router.counts == {"dma": 2, "kernel": 1}
    assert [name for name, _, _ in device.copies] == ["load", "load", "store"]  # one load stream for both
    router.wait({2})
    assert [c.job_id for c in router.finished()] == [1, 2]
    router.close()


# --- the rule --------------------------------------------------------------------------


def rows(n: int, size: int, align: int = 0) -> Descriptors:
    base = 1 << 20
    dst = np.arange(n, dtype=np.int64) * (2 * size + 64) + base + align
    return Descriptors(dst, dst + (1 << 30), np.full(n, size, dtype=np.int64))


@pytest.mark.parametrize(
    "gpu_copy, direction, desc, pinned, expected",
    [
        ("auto", "store", rows(64, 8 * KIB), True, "kernel"),  # small stores: DMA pays per row
        ("auto", "store", rows(64, 256 * KIB), True, "dma"),  # a row of 256 KiB is not under 256 KiB
        ("auto", "store", rows(64, 256 * KIB - 8), True, "kernel"),
        ("auto", "store", rows(64, 8 * KIB), False, "dma"),  # pageable host memory
        ("kernel", "store", rows(2, 2 << 20), True, "kernel"),  # forced: both ways
        ("dma", "store", rows(64, 8 * KIB), True, "dma"),
        ("auto", "load", rows(16, 8 * KIB), True, "kernel"),  # the kernel's case
        ("auto", "load", rows(15, 8 * KIB), True, "dma"),  # too few rows
        ("auto", "load", rows(64, 256 * KIB), True, "dma"),  # a row of 256 KiB is not under 256 KiB
        ("auto", "load", rows(64, 256 * KIB - 8), True, "kernel"),
        ("auto", "load", rows(64, 8 * KIB + 4), True, "dma"),  # size not a multiple of 8
        ("auto", "load", rows(64, 8 * KIB, align=4), True, "dma"),  # address not a multiple of 8
        ("auto", "load", rows(64, 8 * KIB), False, "dma"),  # pageable host memory
        ("kernel", "load", rows(2, 2 << 20), True, "kernel"),  # forced: any count, any size
        ("kernel", "load", rows(2, 8 * KIB + 4), True, "dma"),  # forced but impossible
        ("kernel", "load", rows(64, 8 * KIB), False, "dma"),
        ("dma", "load", rows(64, 8 * KIB), True, "dma"),
        ("auto", "load", rows(0, 8), True, "dma"),
    ],
)
def test_choice_rule(gpu_copy, direction, desc, pinned, expected):
    assert choose(gpu_copy, direction, desc, pinned) == expected


def test_choice_rejects_unknown_settings():
    with pytest.raises(ValueError, match="gpu_copy"):
        choose("fast", "load", rows(1, 8), True)
    with pytest.raises(ValueError, match="direction"):
        choose("auto", "up", rows(1, 8), True)
    assert choice.KERNEL_MAX_ROW_BYTES == {"load": 256 * KIB, "store": 256 * KIB} and choice.KERNEL_MIN_ROWS == 16


# --- pinning ---------------------------------------------------------------------------


class FakeCudart:
    def __init__(self, fail_on_call: int | None = None, code: int = 2):
        self.calls: list[tuple[int, int, int]] = []
        self.registered: set[int] = set()
        self.unregistered: list[int] = []
        self.fail_on_call = fail_on_call
        self.code = code
        self.cleared = 0

    def register(self, ptr, nbytes, flags):
        self.calls.append((ptr, nbytes, flags))
        if self.fail_on_call is not None and len(self.calls) % self.fail_on_call == 0:
            return self.code
        self.registered.add(ptr)
        return 0

    def unregister(self, ptr):
        self.registered.discard(ptr)
        self.unregistered.append(ptr)
        return 0

    def clear(self):
        self.cleared += 1

    def cudart(self) -> pinning.Cudart:
        return pinning.Cudart(self.register, self.unregister, lambda code: "out of memory", self.clear)


def test_pinning_registers_in_pieces_of_at_most_64_gib_and_unregisters_them_on_close():
    fake = FakeCudart()
    pins = pinning.Pinning(fake.cudart())
    base = 0x7F0000000000
    assert pins.register_range(base, 150 * GIB)
    assert fake.calls == [(base, 64 * GIB, 0), (base + 64 * GIB, 64 * GIB, 0), (base + 128 * GIB, 22 * GIB, 0)]
    assert pins.register_range(base, 150 * GIB)  # once per range
    assert len(fake.calls) == 3
    assert pins.registered_bytes == 150 * GIB
    pins.close()
    assert fake.registered == set() and len(fake.unregistered) == 3
    assert pins.registered_bytes == 0


def test_pinning_rolls_back_the_pieces_done_when_one_fails_and_logs_once(caplog):
    fake = FakeCudart(fail_on_call=2)  # every second call fails
    pins = pinning.Pinning(fake.cudart())
    base = 0x7F0000000000
    with caplog.at_level(logging.DEBUG, logger="kvstrata.connector.copy.pinning"):
        assert pins.register_range(base, 150 * GIB) is False
        assert fake.registered == set() and fake.unregistered == [base]  # the first piece, undone
        assert pins.register_range(base + 200 * GIB, 100 * GIB) is False
    assert pins.failures == 2
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "cudaErrorMemoryAllocation (2)" in warnings[0].getMessage()
    assert "out of memory" in warnings[0].getMessage()
    assert fake.cleared >= 2  # the runtime's last error is cleared for torch's sake
    assert not pins.is_registered(base)


def test_register_range_raises_naming_the_error_and_pinning_accepts_a_tensor():
    fake = FakeCudart(fail_on_call=1, code=712)
    with pytest.raises(pinning.HostRegisterError, match="cudaErrorHostMemoryAlreadyRegistered"):
        pinning.register_range(fake.cudart(), 0x1000, 4096)
    ok = FakeCudart()
    tensor = torch.zeros(4096, dtype=torch.int8)
    pins = pinning.Pinning(ok.cudart(), flags=pinning.HOST_REGISTER_PORTABLE)
    assert pins.register(tensor)
    assert ok.calls == [(tensor.data_ptr(), 4096, 1)]
    assert pinning.split_pieces(0, 10, 4) == [(0, 4), (4, 4), (8, 2)]


def test_a_page_aligned_range_is_registered_in_whole_pages():
    """CUDA refused a 30,720-byte arena segment (cudaErrorInvalidValue, H200, driver 580):
    a mapping covers whole pages, so the length is rounded up to the next page."""
    fake = FakeCudart()
    pins = pinning.Pinning(fake.cudart())
    page = pinning.HOST_PAGE
    assert pins.register_range(16 * page, 7 * page + page // 2)
    assert pins.register_range(64 * page + 64, 100)  # not page-aligned (a tensor): as given
    assert fake.calls == [(16 * page, 8 * page, 0), (64 * page + 64, 100, 0)]
    pins.close()


# --- the Triton kernel under the interpreter --------------------------------------------

_INTERPRETED = r"""
import numpy as np, torch
from kvstrata.connector.copy import triton_copy
rng = np.random.default_rng(5)
raw_src = rng.integers(0, 256, (1 << 20) + 64, dtype=np.uint8)
raw_dst = np.zeros_like(raw_src)
src = raw_src[-raw_src.ctypes.data % 16:][: 1 << 20]   # 16-byte aligned views
dst = raw_dst[-raw_dst.ctypes.data % 16:][: 1 << 20]
n = 40
for align16, unit, shift, rows_per_step in ((False, 8, 8, 1), (True, 16, 16, 1), (False, 8, 8, 4), (True, 16, 16, 8)):
    dst[:] = 0
    sizes = rng.integers(1, 300, n).astype(np.int64) * unit   # up to 4.8 KiB, multiples of unit
    dst_off = rng.permutation(n).astype(np.int64) * 8192     # scattered, non-overlapping rows
    src_off = rng.permutation(n).astype(np.int64) * 8192 + shift
    table = torch.from_numpy(np.concatenate([dst.ctypes.data + dst_off, src.ctypes.data + src_off, sizes]))
    triton_copy.triton_launch(table, n, programs=3, chunk_words=64, align16=align16, rows_per_step=rows_per_step)
    expect = np.zeros_like(dst)
    for d, s, k in zip(dst_off, src_off, sizes):
        expect[d:d + k] = src[s:s + k]
    assert (dst == expect).all(), f"byte mismatch (align16={align16}, rows_per_step={rows_per_step})"
    print("EXACT", align16, rows_per_step, int(sizes.sum()))
"""


def test_triton_kernel_copies_random_descriptors_byte_exact_under_the_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run(
        [sys.executable, "-c", _INTERPRETED], capture_output=True, text=True, timeout=600, env=env, cwd=os.getcwd()
    )
    assert out.returncode == 0, out.stderr[-3000:]
    for variant in ("False 1", "True 1", "False 4", "True 8"):
        assert f"EXACT {variant} " in out.stdout, out.stdout


def test_triton_kernel_compiles_for_sm90_with_16_byte_accesses_only_when_aligned(tmp_path, monkeypatch):
    """No GPU needed: Triton's NVIDIA backend and its bundled ptxas build the cubin."""
    triton = pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # not ~/.triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvstrata.connector.copy.triton_copy import copy_rows_kernel

    accesses = {}
    for align16, rows_per_step in ((False, 1), (True, 1), (False, 4), (True, 4)):
        source = ASTSource(
            fn=copy_rows_kernel,
            signature={"table": "*i64", "rows": "i32", "WORDS": "constexpr", "ALIGN16": "constexpr", "ROWS": "constexpr"},
            constexprs={"WORDS": 512, "ALIGN16": align16, "ROWS": rows_per_step},
        )
        try:
            compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
        except Exception as exc:  # noqa: BLE001 - e.g. a Triton without the NVIDIA backend or ptxas
            pytest.skip(f"cannot compile for sm_90 here: {exc}")
        assert compiled.asm["cubin"]
        ptx = compiled.asm["ptx"]
        found = {w for line in ptx.splitlines() for w in line.split() if w.startswith(("ld.global", "st.global"))}
        accesses[align16, rows_per_step] = found
    for rows_per_step in (1, 4):
        aligned, unaligned = accesses[True, rows_per_step], accesses[False, rows_per_step]
        assert "st.global.v2.b64" in aligned and "ld.global.v2.b64" in aligned, (rows_per_step, aligned)
        assert "st.global.b64" in unaligned and not any(".v2." in a for a in unaligned), (rows_per_step, unaligned)


def test_kernel_executor_launches_the_16_byte_variant_only_when_every_row_allows_it(device):
    src, dst = buffers(256 * KIB + 64)
    base_src, base_dst = -src.ctypes.data % 16, -dst.ctypes.data % 16
    ex = kernel(device)
    ex.submit(1, "load", descriptors(dst, [base_dst, base_dst + 4 * KIB], src, [base_src, base_src + 16], [KIB, 32]))
    ex.submit(2, "load", descriptors(dst, [base_dst, base_dst + 4 * KIB], src, [base_src, base_src + 8], [KIB, 32]))
    ex.submit(3, "load", descriptors(dst, [base_dst, base_dst + 4 * KIB], src, [base_src, base_src + 16], [KIB, 24]))
    assert device.align16 == [True, False, False]
    ex.close()


# --- the driver call's ABI, against a ctypes stand-in for cuMemcpyBatchAsync ----------------


def test_batch_copy_calls_the_cuda_12_8_signature_with_one_attribute_per_direction():
    from kvstrata.connector.copy import cuda_dma

    calls = []

    @cuda_dma._BATCH_FN
    def fake_driver(dsts, srcs, sizes, count, attrs, attrs_idxs, num_attrs, fail_idx, stream):
        attr = cuda_dma._CUmemcpyAttributes.from_address(attrs)
        first = ctypes.c_size_t.from_address(attrs_idxs).value
        calls.append((count, attr.srcAccessOrder, first, num_attrs, stream))
        d = (ctypes.c_int64 * count).from_address(dsts)
        s = (ctypes.c_int64 * count).from_address(srcs)
        n = (ctypes.c_size_t * count).from_address(sizes)
        if count == 3:  # refuse this batch, naming row 1
            ctypes.c_size_t.from_address(fail_idx).value = 1
            return 1
        for i in range(count):
            ctypes.memmove(d[i], s[i], n[i])
        return 0

    pointer = ctypes.cast(fake_driver, ctypes.c_void_p).value
    copy = cuda_dma.batch_copy_from_pointer(pointer, lambda rc: "CUDA_ERROR_INVALID_VALUE")
    src, dst = buffers()
    desc = descriptors(dst, [0, 4 * KIB], src, [8 * KIB, 100], [KIB, 24])
    copy(desc.dst, desc.src, desc.sizes, 0xBEEF, True)
    np.testing.assert_array_equal(dst[:KIB], src[8 * KIB : 9 * KIB])
    np.testing.assert_array_equal(dst[4 * KIB : 4 * KIB + 24], src[100:124])
    copy(desc.dst, desc.src, desc.sizes, 0xBEEF, False)
    assert calls == [(2, 3, 0, 1, 0xBEEF), (2, 1, 0, 1, 0xBEEF)]  # ANY=3 for loads, STREAM=1 for stores
    bad = descriptors(dst, [0, 2 * KIB, 4 * KIB], src, [0, 2 * KIB, 4 * KIB], [8, 8, 8])
    with pytest.raises(cuda_dma.CudaCopyError, match=r"3 rows failed at row 1: CUDA_ERROR_INVALID_VALUE \(1\)"):
        copy(bad.dst, bad.src, bad.sizes, 0xBEEF, False)
    with pytest.raises(cuda_dma.CudaCopyError, match="legacy default stream"):
        copy(desc.dst, desc.src, desc.sizes, 0, False)
    assert ctypes.sizeof(cuda_dma._CUmemcpyAttributes) == 24  # as in CUDA 12.8's cuda.h
