"""What a leaking row holds: `scripts/fault_matrix.py --diagnose-leaks`.

The leak check (probes.growth_problems) says a store grew; this says by what. Descriptors
are read from /proc (probes.fd_kinds, always: cheap). Memory is traced inside the store
actor (`__ray_call__` runs a function on the actor itself): tracemalloc starts at the
row's baseline, and after recovery the allocation sites that grew most and the object
types whose counts grew most are reported. Tracing slows the store; a row run with it
measures what holds memory, not how fast anything recovers.
"""

from __future__ import annotations

import contextlib
from typing import Any

TOP = 8


def _type_counts() -> dict[str, int]:
    import gc
    from collections import Counter

    return dict(Counter(type(o).__qualname__ for o in gc.get_objects()))


def _native() -> str:
    """glibc's heap (in use, and free but kept) and pyarrow's pool (allocated, its peak)."""
    import ctypes
    import sys

    parts = []
    with contextlib.suppress(Exception):

        fields = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")

        class MallInfo2(ctypes.Structure):
            _fields_ = [(name, ctypes.c_size_t) for name in fields]

        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = MallInfo2
        info = libc.mallinfo2()
        parts.append(
            f"malloc in use {info.uordblks >> 20} MiB, free kept {info.fordblks >> 20} MiB, mmapped {info.hblkhd >> 20} MiB"
        )
    if "pyarrow" in sys.modules:
        with contextlib.suppress(Exception):
            pool = sys.modules["pyarrow"].default_memory_pool()
            allocated, peak = pool.bytes_allocated() >> 20, pool.max_memory() >> 20
            parts.append(f"pyarrow {pool.backend_name} allocated {allocated} MiB, peak {peak} MiB")
    return "; ".join(parts)


def _start(store: Any) -> None:
    import tracemalloc

    if not tracemalloc.is_tracing():
        tracemalloc.start(8)
    store._fault_diagnosis = (tracemalloc.take_snapshot(), _type_counts())


def _growth(store: Any, top: int, stop: bool) -> list[str]:
    import tracemalloc

    snapshot, types = store._fault_diagnosis
    now = tracemalloc.take_snapshot()
    current, peak = tracemalloc.get_traced_memory()
    lines = [f"Python allocations traced {current >> 20} MiB, peak {peak >> 20} MiB; {_native()}"]
    for stat in now.compare_to(snapshot, "traceback")[:top]:
        frames = " < ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno}" for f in stat.traceback[:4])
        lines.append(f"{stat.size_diff / 2**20:+.1f} MiB ({stat.count_diff:+d} blocks) at {frames}")
    counts = _type_counts()
    grown = sorted(((counts[k] - types.get(k, 0), k) for k in counts), reverse=True)[:top]
    lines.append("objects: " + ", ".join(f"{k} {n:+d}" for n, k in grown if n > 0))
    if stop:
        tracemalloc.stop()
    return lines


def start_tracing() -> None:
    """Start tracing the node store's allocations (its baseline is now)."""
    import ray

    from kvstrata.actors.client import get_node_store

    with contextlib.suppress(Exception):
        ray.get(get_node_store().__ray_call__.remote(_start), timeout=60)


def memory_growth(top: int = TOP, stop: bool = True) -> list[str]:
    """The store's allocation sites and object types that grew most since start_tracing
    (empty if it was not started, or the store restarted since); `stop`: end the tracing."""
    import ray

    from kvstrata.actors.client import get_node_store

    with contextlib.suppress(Exception):
        return ray.get(get_node_store().__ray_call__.remote(_growth, top, stop), timeout=120)
    return []


class PeakSampler:
    """The store's RSS and descriptors every `interval_s` on a thread, while a row runs:
    its peak, and the phase (`phase`, set by the harness) it was reached in."""

    def __init__(self, pid_of: Any, interval_s: float = 0.25):
        import threading

        self.phase = "start"
        self.peak: tuple[int, int, str] = (0, 0, "")  # RSS, fds, phase
        self._pid_of = pid_of
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fault-peak-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from kvstrata._dev.faults.probes import sample_process

        pid = None
        while not self._stop.wait(self._interval):
            with contextlib.suppress(Exception):
                pid = pid or self._pid_of()
                sample = sample_process(pid)
                if sample is None:
                    pid = None
                elif sample.rss_bytes > self.peak[0]:
                    self.peak = (sample.rss_bytes, sample.fds, self.phase)

    def close(self) -> str:
        self._stop.set()
        self._thread.join(timeout=5)
        rss, fds, phase = self.peak
        return f"store peak RSS {rss >> 20} MiB ({fds} fds) during {phase}"
