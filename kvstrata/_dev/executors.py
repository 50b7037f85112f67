"""The node store's deterministic executors, for tests and the simulation (not in the wheel).

`ManualExecutor` runs a job only when asked, on the asking thread, each exactly once;
`shutdown(wait=True)` runs what is still queued (including jobs those jobs queue), as a
thread pool does; `shutdown(cancel_futures=True)` cancels it instead. `InlineExecutor`
runs each job when it is submitted. The store's roles and the factory type:
`kvstrata/store/executors.py`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any


class InlineExecutor(Executor):
    """Runs each job when it is submitted, on the submitting thread."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - the future carries it, as a pool's would
            future.set_exception(exc)
        return future


@dataclass(eq=False)  # a job is itself: its arguments may be arrays, which do not compare
class Job:
    """One queued job: `name` is its function's name (`_write_job`, `_upload_job`, ...)."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    future: Future = field(default_factory=Future)

    @property
    def name(self) -> str:
        fn = self.fn.func if isinstance(self.fn, functools.partial) else self.fn
        return getattr(fn, "__name__", repr(fn))

    @property
    def namespace(self) -> str | None:
        """The namespace a store job works on (its first argument), if it names one."""
        first = self.args[0] if self.args else None
        return first if isinstance(first, str) else None


class ManualExecutor(Executor):
    """Queues jobs until the caller runs them, one at a time and in any order.

    `pending` lists what waits; `run(job)` runs one on the calling thread and returns its
    future (an exception stays in the future, as in a pool); `run_all()` drains the queue,
    jobs queued meanwhile included. With `hold` False it runs each job when submitted
    (inline) until a test sets it again: how a test holds the disk tier's checksums of one
    read (never of a write, which waits on them: that would never return).
    """

    def __init__(self, role: str = "", hold: bool = True) -> None:
        self.role = role
        self.hold = hold
        self.pending: list[Job] = []
        self._shut = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        if self._shut:
            raise RuntimeError(f"cannot schedule a job after shutdown ({self.role or 'manual'} executor)")
        job = Job(fn, args, kwargs)
        self.pending.append(job)
        return job.future if self.hold else self.run(job)

    def named(self, name: str) -> list[Job]:
        return [job for job in self.pending if job.name == name]

    def run(self, job: Job | int = 0) -> Future:
        job = self.pending.pop(job) if isinstance(job, int) else self.pending.pop(self.pending.index(job))
        try:
            job.future.set_result(job.fn(*job.args, **job.kwargs))
        except BaseException as exc:  # noqa: BLE001
            job.future.set_exception(exc)
        return job.future

    def run_all(self, limit: int = 100_000) -> int:
        """Run queued jobs, oldest first, until none is left; how many ran."""
        ran = 0
        while self.pending:
            if ran >= limit:
                raise RuntimeError(f"{self.role or 'manual'} executor: still busy after {limit} jobs")
            self.run(0)
            ran += 1
        return ran

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        if cancel_futures:
            for job in self.pending:
                job.future.cancel()
            self.pending.clear()
        elif wait:
            self.run_all()
        self._shut = True


class ManualExecutors:
    """A factory for `NodeStore(executors=...)`: the named roles manual, the rest thread
    pools; `disk-digest` is a `ManualExecutor` that runs jobs inline until a test sets its
    `hold`. `self[role]` is the manual executor of a role."""

    def __init__(self, *roles: str) -> None:
        self.roles = roles or ("disk", "object", "peer")
        self.executors: dict[str, ManualExecutor] = {}

    def __call__(self, role: str, threads: int) -> Executor:
        if role == "disk-digest":
            return self.executors.setdefault(role, ManualExecutor(role, hold=False))
        if role not in self.roles:
            return thread_pools(role, threads)
        return self.executors.setdefault(role, ManualExecutor(role))

    def __getitem__(self, role: str) -> ManualExecutor:
        return self.executors[role]

    def run_all(self, limit: int = 100_000) -> int:
        """Drain every manual role until all are empty (jobs of one may queue jobs of another)."""
        ran = 0
        while any(executor.pending for executor in self.executors.values()):
            for executor in self.executors.values():
                ran += executor.run_all(limit)
        return ran
