"""A busy machine for `manager_overhead.py --busy N`, and where a manager's time goes on it.

`BusyProcesses` starts N CPU-bound processes beside the replay and stops them by their
handles: `spin` is a pure-Python loop that makes no system call (it gives the CPU up
only when the kernel preempts it), `syscall` writes a byte to /dev/null in a loop (it
enters the kernel all the time, as tokenizers, API servers and I/O threads do).

`Breakdown` (with `--breakdown`) instruments one `StrataManager` from outside, through
its private names (a benchmark's licence; the product code carries no probes):
- the manager's lock: how long the scheduler thread waited to take it, and how long the
  control thread held it each time (the scheduler may be waiting meanwhile);
- the scheduler thread's time inside manager calls, wall clock against its own CPU time:
  the difference is time it was not running (waiting for the lock, for the GIL, or
  preempted by the kernel); vLLM's manager in the same run shows preemption alone;
- each reply: its round trip (sent .. received by the control thread) and how late it was
  applied (received .. applied), and on which thread;
- each RETRY, by its cause as the manager's state shows it right after the answer.
"""

from __future__ import annotations

import ctypes
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import Any

BUSY_CODE = {
    "spin": "while True:\n    pass\n",
    "syscall": "import os\nfd = os.open('/dev/null', os.O_WRONLY)\nwhile True:\n    os.write(fd, b'x')\n",
}


def load() -> str:
    """The machine's load average (1, 5, 15 minutes), for every figure printed under load."""
    one, five, fifteen = os.getloadavg()
    return f"load {one:.2f} / {five:.2f} / {fifteen:.2f}"


def _die_with_parent() -> None:
    """In the child, before it runs: the kernel kills it if the benchmark dies first
    (PR_SET_PDEATHSIG), so no busy loop outlives a benchmark that was killed."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


class BusyProcesses:
    """N busy processes of one kind, started on enter and stopped (by handle) on exit."""

    def __init__(self, count: int, kind: str):
        if kind not in BUSY_CODE:
            raise ValueError(f"busy kind {kind!r}: choose one of {sorted(BUSY_CODE)}")
        self.count, self.kind = count, kind
        self.processes: list[subprocess.Popen] = []

    def __enter__(self) -> BusyProcesses:
        for _ in range(self.count):
            self.processes.append(subprocess.Popen([sys.executable, "-c", BUSY_CODE[self.kind]], preexec_fn=_die_with_parent))
        return self

    def __exit__(self, *exc: object) -> None:
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)
        self.processes.clear()


def quantiles_ms(values: list[float]) -> str:
    if not values:
        return "none"
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return (
        f"{len(values)}: p50 {statistics.median(ordered) * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms, "
        f"max {ordered[-1] * 1e3:.2f} ms, sum {sum(ordered) * 1e3:.1f} ms"
    )


class TimedLock:
    """An RLock that times the scheduler's waits for it and the control thread's holds."""

    def __init__(self, scheduler: threading.Thread):
        self._lock = threading.RLock()
        self._scheduler = scheduler
        self._depth = threading.local()
        self.scheduler_waits: list[float] = []  # only waits that found the lock taken
        self.control_holds: list[float] = []
        self._held_since = 0.0

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self._lock.acquire(blocking=False):
            got = True
        else:
            started = time.perf_counter()
            got = self._lock.acquire(blocking, timeout)
            if threading.current_thread() is self._scheduler:
                self.scheduler_waits.append(time.perf_counter() - started)
        if got:
            depth = getattr(self._depth, "n", 0)
            self._depth.n = depth + 1
            if not depth and threading.current_thread() is not self._scheduler:
                self._held_since = time.perf_counter()
        return got

    def release(self) -> None:
        self._depth.n -= 1
        if not self._depth.n and threading.current_thread() is not self._scheduler:
            self.control_holds.append(time.perf_counter() - self._held_since)
        self._lock.release()

    __enter__ = acquire

    def __exit__(self, *exc: object) -> None:
        self.release()


class Breakdown:
    """Probes on one manager (see the module docstring); `attach` before the replay."""

    def __init__(self) -> None:
        self.lock: TimedLock | None = None
        self.round_trips: list[float] = []
        self.late: dict[str, list[float]] = {"control": [], "scheduler": []}
        self.retries: Counter[str] = Counter()
        self.untrusted_passes = 0
        self._received: dict[int, float] = {}
        self._scheduler = threading.main_thread()

    def attach(self, manager: Any) -> None:
        self.lock = manager._lock = TimedLock(self._scheduler)
        receive, apply_reply, answer = manager._receive, manager._apply_reply, manager._answer

        def timed_receive(entry: tuple) -> None:
            now = time.perf_counter()
            self._received[id(entry[1])] = now
            if entry[0] == "reply":
                self.round_trips.append(manager._clock() - entry[3])
            receive(entry)

        def timed_apply(request: Any, *rest: Any) -> None:
            received = self._received.pop(id(request), None)
            if received is not None:
                where = "scheduler" if threading.current_thread() is self._scheduler else "control"
                self.late[where].append(time.perf_counter() - received)
            apply_reply(request, *rest)

        def classified_answer(key: bytes, req_context: Any) -> Any:
            opening = not manager._pass_open
            result = answer(key, req_context)
            if opening and not manager._trusted:
                self.untrusted_passes += 1
            if result.name == "RETRY":
                self.retries[self._cause(manager, key)] += 1
            return result

        manager._receive, manager._apply_reply, manager._answer = timed_receive, timed_apply, classified_answer

    @staticmethod
    def _cause(manager: Any, key: bytes) -> str:
        if not manager._trusted:
            return "lease unproven (no answer for half a lease)"
        if key in manager._mirror and key not in manager._resident:
            return "indexed, its slot not in the mirror yet (a commit's reply or a lower tier)"
        if key in manager._resident:
            return "resident, asked for again (a pin of an older epoch, a miss)"
        return "not in the mirror, which is older than max_view_age_seconds"

    def report(self, off_cpu: tuple[float, float] | None, reference_off_cpu: tuple[float, float] | None) -> list[str]:
        lines = []
        if off_cpu is not None:
            wall, cpu = off_cpu
            lines.append(f"scheduler thread in manager calls: {wall * 1e3:.1f} ms wall, {cpu * 1e3:.1f} ms on CPU, "
                         f"{(wall - cpu) * 1e3:.1f} ms off CPU")  # fmt: skip
        if reference_off_cpu is not None:
            wall, cpu = reference_off_cpu
            lines.append(f"  vLLM's manager, same run: {wall * 1e3:.1f} ms wall, {cpu * 1e3:.1f} ms on CPU, "
                         f"{(wall - cpu) * 1e3:.1f} ms off CPU (preemption alone)")  # fmt: skip
        if self.lock is not None:
            lines.append(f"scheduler waits for the manager's lock: {quantiles_ms(self.lock.scheduler_waits)}")
            lines.append(f"control thread's holds of the lock: {quantiles_ms(self.lock.control_holds)}")
        lines.append(f"round trips (sent .. received): {quantiles_ms(self.round_trips)}")
        for where, values in self.late.items():
            lines.append(f"replies applied on the {where} thread, received .. applied: {quantiles_ms(values)}")
        lines.append(f"scheduling passes opened without a proven lease: {self.untrusted_passes}")
        total = sum(self.retries.values())
        lines.append(f"RETRY answers: {total}")
        for cause, count in self.retries.most_common():
            lines.append(f"  {count:6d}  {cause}")
        return lines
