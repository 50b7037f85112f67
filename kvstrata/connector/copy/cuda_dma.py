"""Moves a transfer's descriptors on CUDA with one batched driver call (cuMemcpyBatchAsync).

Two parts:
  * `JobLedger`: the stream / event bookkeeping every CUDA executor shares. One stream
    per direction; before a job, its stream waits on the current (compute) stream:
    stores read KV the forward pass just wrote, loads must not overtake work still
    queued on their destination blocks. Jobs of one direction therefore complete in
    submission order. Each job is bracketed by a start and an end event; `finished()`
    polls end events, `wait()` synchronizes them (the GPU blocks are reusable after).
    Whatever a job's copies read at execution time (descriptor arrays, pinned tables)
    is held by its ledger entry until the end event fired, then released.
  * `CudaDmaExecutor`: submits each transfer as ONE batched copy on its direction's
    stream. The backend is resolved once per process and logged once:
      (a) cuMemcpyBatchAsync (driver >= 12.8), found with cuGetProcAddress (through
          cuda-bindings when installed, else libcuda through ctypes), called with the
          CUDA 12.8 ABI (with failIdx) through ctypes on the raw int64 arrays;
      (b) otherwise one cuMemcpyAsync per row (libcuda, ctypes).
    Source access order: STREAM for stores (the compute stream writes the source),
    ANY for loads (the source is arena memory no stream writes while a load of it is
    in flight: the manager pins a slot for the load's lifetime).

The device is behind a small seam (`StreamOps`) and the copy behind another
(`BatchCopy`), so the sequencing is tested on a CPU with fakes of both.
No vLLM import; torch, numpy and optional cuda-bindings only.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from kvstrata.connector.copy import Completed
from kvstrata.connector.copy.descriptors import DIRECTIONS, Descriptors

logger = logging.getLogger(__name__)


# batch_copy(dst, src, sizes, stream_handle, src_order_any): enqueue every row on the
# stream; raise (CudaCopyError) when the driver refuses. The arrays are read during the
# call only for the driver backends; callers keep them alive until completion anyway.
BatchCopy = Callable[[np.ndarray, np.ndarray, np.ndarray, int, bool], None]


class CudaCopyError(RuntimeError):
    """A driver copy call returned an error; the message names it."""


# --- the device seam -----------------------------------------------------------------


class StreamOps(Protocol):
    """What the ledger needs from the device; `TorchStreamOps` is the real one."""

    def new_stream(self, direction: str) -> Any: ...
    def handle(self, stream: Any) -> int: ...
    def wait_current(self, stream: Any) -> None: ...
    def record(self, stream: Any) -> Any: ...
    def query(self, event: Any) -> bool: ...
    def synchronize(self, event: Any) -> None: ...
    def seconds(self, start: Any, end: Any) -> float: ...
    def activate(self, stream: Any) -> AbstractContextManager: ...


class TorchStreamOps:
    """torch.cuda streams and timing events on one device."""

    def __init__(self, device: torch.device | int | str | None = None):
        device = torch.device("cuda") if device is None else torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"CUDA copy executors need a CUDA device, not {device}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device

    def new_stream(self, direction: str) -> torch.cuda.Stream:
        return torch.cuda.Stream(device=self.device)

    def handle(self, stream: torch.cuda.Stream) -> int:
        return int(stream.cuda_stream)

    def wait_current(self, stream: torch.cuda.Stream) -> None:
        stream.wait_stream(torch.cuda.current_stream(self.device))

    def record(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def query(self, event: torch.cuda.Event) -> bool:
        return bool(event.query())

    def synchronize(self, event: torch.cuda.Event) -> None:
        event.synchronize()

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end) / 1000.0

    def activate(self, stream: torch.cuda.Stream) -> AbstractContextManager:
        return torch.cuda.stream(stream)


# --- the ledger ----------------------------------------------------------------------


@dataclass
class _Job:
    job_id: int
    start: Any
    end: Any
    num_bytes: int
    success: bool
    hold: tuple  # what the job's copies read while they run; dropped on completion
    release: Callable[[], None] | None


class JobLedger:
    """Streams, events and in-flight jobs of one worker's CUDA copies.

    Thread-safe: a job's operations (wait on compute, start, copies, end) are queued
    under one lock so two submitting threads cannot interleave them on a stream;
    `wait` blocks outside the lock.
    """

    def __init__(self, ops: StreamOps):
        self.ops = ops
        self.streams = {direction: ops.new_stream(direction) for direction in DIRECTIONS}
        self._queues: dict[str, deque[_Job]] = {direction: deque() for direction in DIRECTIONS}
        self._jobs: dict[int, _Job] = {}
        self._closed = False
        self._lock = threading.Lock()

    @property
    def in_flight(self) -> int:
        return len(self._jobs)

    def holds(self, job_id: int) -> tuple:
        """What a job in flight keeps alive (empty once it completed)."""
        job = self._jobs.get(job_id)
        return job.hold if job is not None else ()

    def run(
        self,
        job_id: int,
        direction: str,
        num_bytes: int,
        enqueue: Callable[[Any], None],
        hold: tuple = (),
        release: Callable[[], None] | None = None,
    ) -> None:
        """Queue one job: wait on compute, start event, `enqueue(stream)`, end event.

        An exception from `enqueue` does not escape: it is logged and the job completes
        (after its end event, which also covers any rows that were queued) unsuccessful.
        """
        if direction not in self.streams:
            raise ValueError(f"direction must be store or load, not {direction!r}")
        with self._lock:
            self._run_locked(job_id, direction, num_bytes, enqueue, hold, release)

    def _run_locked(self, job_id, direction, num_bytes, enqueue, hold, release) -> None:
        if self._closed:
            raise RuntimeError("this copy executor is closed")
        if job_id in self._jobs:
            raise ValueError(f"copy job {job_id} is already in flight")
        ops = self.ops
        stream = self.streams[direction]
        ops.wait_current(stream)
        start = ops.record(stream)
        success = True
        try:
            with ops.activate(stream):
                enqueue(stream)
        except Exception:
            success = False
            logger.exception("kvstrata %s copy job %d could not be queued on the GPU", direction, job_id)
        end = ops.record(stream)
        job = _Job(job_id, start, end, num_bytes, success, hold, release)
        self._queues[direction].append(job)
        self._jobs[job_id] = job

    def finished(self) -> list[Completed]:
        """Jobs whose end event fired, in submission order per direction (polls only)."""
        done = []
        with self._lock:
            for queue in self._queues.values():
                while queue and self.ops.query(queue[0].end):
                    done.append(self._complete(queue.popleft()))
        return done

    def wait(self, job_ids: Iterable[int]) -> None:
        """Return once the named jobs' copies are done (their GPU blocks are reusable)."""
        with self._lock:
            ends = [job.end for job in (self._jobs.get(job_id) for job_id in job_ids) if job is not None]
        for end in ends:
            self.ops.synchronize(end)

    def close(self) -> None:
        """Wait for every job in flight, then release what they held."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for queue in self._queues.values():
                while queue:
                    job = queue.popleft()
                    self.ops.synchronize(job.end)
                    self._complete(job)

    def _complete(self, job: _Job):
        del self._jobs[job.job_id]
        seconds = self.ops.seconds(job.start, job.end) if job.success else 0.0
        job.hold = ()
        if job.release is not None:
            job.release()
            job.release = None
        return Completed(job.job_id, job.success, job.num_bytes if job.success else 0, seconds)


def check_descriptors(desc: Descriptors) -> None:
    """Refuse arrays a raw-pointer copy would misread (wrong dtype, layout or length)."""
    n = len(desc.sizes)
    for name, array in zip(("dst", "src", "sizes"), desc):
        if not isinstance(array, np.ndarray) or array.dtype != np.int64 or not array.flags.c_contiguous:
            raise ValueError(f"descriptor {name} must be a C-contiguous int64 numpy array")
        if len(array) != n:
            raise ValueError(f"descriptor {name} has {len(array)} rows, sizes has {n}")
    if n and int(desc.sizes.min()) <= 0:
        raise ValueError("descriptor sizes must be positive")


# --- driver backends -----------------------------------------------------------------

_CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1
_CU_MEMCPY_SRC_ACCESS_ORDER_ANY = 3
_BATCH_ABI_VERSION = 12080  # the cuMemcpyBatchAsync signature with failIdx (CUDA 12.8)
_SIZE_MAX = ctypes.c_size_t(-1).value


class _CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _CUmemcpyAttributes(ctypes.Structure):
    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _CUmemLocation),
        ("dstLocHint", _CUmemLocation),
        ("flags", ctypes.c_uint),
    ]


_BATCH_FN = ctypes.CFUNCTYPE(
    ctypes.c_int,  # CUresult
    ctypes.c_void_p,  # CUdeviceptr *dsts
    ctypes.c_void_p,  # CUdeviceptr *srcs
    ctypes.c_void_p,  # size_t *sizes
    ctypes.c_size_t,  # count
    ctypes.c_void_p,  # CUmemcpyAttributes *attrs
    ctypes.c_void_p,  # size_t *attrsIdxs
    ctypes.c_size_t,  # numAttrs
    ctypes.c_void_p,  # size_t *failIdx
    ctypes.c_void_p,  # CUstream
)


class _Libcuda:
    """The few libcuda entry points used here, through ctypes (no cuda-bindings needed)."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.lib.cuInit.argtypes = [ctypes.c_uint]
        self.lib.cuInit(0)  # torch has done it; idempotent

    def error_name(self, code: int) -> str:
        name = ctypes.c_char_p()
        fn = self.lib.cuGetErrorName
        fn.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        if fn(code, ctypes.byref(name)) == 0 and name.value:
            return name.value.decode()
        return f"CUresult {code}"

    def driver_version(self) -> int:
        version = ctypes.c_int(0)
        self.lib.cuDriverGetVersion(ctypes.byref(version))
        return version.value

    def proc_address(self, symbol: bytes, version: int) -> tuple[int, str]:
        """(function pointer or 0, through what it was looked up)."""
        try:
            from cuda.bindings import driver as drv  # optional
        except ImportError:
            drv = None
        if drv is not None:
            try:
                err, ptr, _status = drv.cuGetProcAddress(symbol, version, 0)
                if err == drv.CUresult.CUDA_SUCCESS and int(ptr):
                    return int(ptr), "cuda-bindings"
                return 0, "cuda-bindings"
            except Exception:  # noqa: BLE001 - an older cuda-python signature: ask libcuda
                pass
        fn = getattr(self.lib, "cuGetProcAddress_v2", None)
        if fn is None:
            return 0, "libcuda"
        fn.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_uint64, ctypes.POINTER(ctypes.c_int)]
        pfn = ctypes.c_void_p()
        status = ctypes.c_int(0)
        if fn(symbol, ctypes.byref(pfn), version, 0, ctypes.byref(status)) != 0:
            return 0, "libcuda"
        return pfn.value or 0, "libcuda"


def batch_copy_from_pointer(fn_ptr: int, error_name: Callable[[int], str]) -> BatchCopy:
    """A BatchCopy calling cuMemcpyBatchAsync (CUDA 12.8 ABI) at `fn_ptr`."""
    fn = _BATCH_FN(fn_ptr)
    attrs = {
        True: _CUmemcpyAttributes(srcAccessOrder=_CU_MEMCPY_SRC_ACCESS_ORDER_ANY),
        False: _CUmemcpyAttributes(srcAccessOrder=_CU_MEMCPY_SRC_ACCESS_ORDER_STREAM),
    }

    def batch_copy(dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, stream: int, src_order_any: bool) -> None:
        count = len(sizes)
        if count == 0:
            return
        if not stream:
            raise CudaCopyError("cuMemcpyBatchAsync refuses the legacy default stream")
        attrs_idx = ctypes.c_size_t(0)  # one attribute entry, applying from row 0 on
        fail_idx = ctypes.c_size_t(_SIZE_MAX)
        rc = fn(
            dst.ctypes.data,
            src.ctypes.data,
            sizes.ctypes.data,
            count,
            ctypes.addressof(attrs[bool(src_order_any)]),
            ctypes.addressof(attrs_idx),
            1,
            ctypes.addressof(fail_idx),
            stream,
        )
        if rc != 0:
            where = "" if fail_idx.value == _SIZE_MAX else f" at row {fail_idx.value}"
            raise CudaCopyError(f"cuMemcpyBatchAsync of {count} rows failed{where}: {error_name(rc)} ({rc})")

    return batch_copy


def row_copy_from_libcuda(lib: _Libcuda) -> BatchCopy:
    """A BatchCopy issuing one cuMemcpyAsync per row (drivers before CUDA 12.8)."""
    fn = lib.lib.cuMemcpyAsync
    fn.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
    fn.restype = ctypes.c_int

    def row_copy(dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, stream: int, src_order_any: bool) -> None:
        for row, (d, s, n) in enumerate(zip(dst.tolist(), src.tolist(), sizes.tolist())):
            rc = fn(d, s, n, stream)
            if rc != 0:
                raise CudaCopyError(f"cuMemcpyAsync of row {row} ({n} bytes) failed: {lib.error_name(rc)} ({rc})")

    return row_copy


_resolved: dict[str, tuple[BatchCopy, str]] = {}
_resolve_lock = threading.Lock()


def resolve_batch_copy(backend: str = "auto") -> tuple[BatchCopy, str]:
    """(copy function, description) for "auto" | "batch" | "rows"; resolved and logged
    once per process (a worker is a process)."""
    if backend not in ("auto", "batch", "rows"):
        raise ValueError(f"backend must be auto, batch or rows, not {backend!r}")
    with _resolve_lock:
        if backend in _resolved:
            return _resolved[backend]
        lib = _Libcuda()
        version = lib.driver_version()
        result: tuple[BatchCopy, str] | None = None
        if backend != "rows":
            ptr, via = lib.proc_address(b"cuMemcpyBatchAsync", _BATCH_ABI_VERSION)
            if ptr:
                result = (batch_copy_from_pointer(ptr, lib.error_name), f"cuMemcpyBatchAsync (found through {via})")
            elif backend == "batch":
                raise RuntimeError(f"cuMemcpyBatchAsync is not available (driver CUDA version {version}; needs 12080)")
        if result is None:
            why = "as asked" if backend == "rows" else f"cuMemcpyBatchAsync needs driver CUDA 12080, this one is {version}"
            result = (row_copy_from_libcuda(lib), f"one cuMemcpyAsync per row ({why})")
        logger.info("kvstrata GPU copies use %s", result[1])
        _resolved[backend] = result
        return result


# --- the executor --------------------------------------------------------------------


class CudaDmaExecutor:
    """submit / finished / wait / close over DMA: one batched driver call per transfer."""

    def __init__(
        self,
        device: torch.device | int | str | None = None,
        *,
        ops: StreamOps | None = None,
        ledger: JobLedger | None = None,
        batch_copy: BatchCopy | None = None,
        backend: str = "auto",
        loads_src_order_any: bool = True,
    ):
        if ledger is None:
            ledger = JobLedger(ops if ops is not None else TorchStreamOps(device))
        self.ledger = ledger
        self.backend = "injected"
        if batch_copy is None:
            batch_copy, self.backend = resolve_batch_copy(backend)
        self._batch_copy = batch_copy
        self.loads_src_order_any = loads_src_order_any

    def submit(self, job_id: int, direction: str, desc: Descriptors) -> None:
        """Queue the transfer on its direction's stream; returns before the bytes move."""
        check_descriptors(desc)
        src_order_any = direction == "load" and self.loads_src_order_any
        handle = self.ledger.ops.handle
        batch_copy = self._batch_copy

        def enqueue(stream: Any) -> None:
            if desc.rows:
                batch_copy(desc.dst, desc.src, desc.sizes, handle(stream), src_order_any)

        self.ledger.run(job_id, direction, desc.num_bytes, enqueue, hold=(desc,))

    def finished(self) -> list:
        return self.ledger.finished()

    def wait(self, job_ids: set[int]) -> None:
        self.ledger.wait(job_ids)

    def close(self) -> None:
        self.ledger.close()
