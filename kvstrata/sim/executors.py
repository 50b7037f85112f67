"""Background jobs as events: executors the simulation runs one job at a time, when it chooses.

`SimExecutor` stands in for a store's thread pools (disk I/O, object jobs): `submit`
queues the job and returns its future; the job runs only when the simulation's scheduler
picks it (`World.run_job`), whole, on the simulation's thread. `InlineExecutor` stands in
for pools that are joined inside the job that uses them (the disk tier's digest threads,
the object tier's fan-out): they are no concurrency point of their own, so they run at
`submit`.

Invariants: a job runs at most once; a job of an executor that was shut down (a store
that crashed) never runs; a job that raises is recorded, never swallowed.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class SimJob:
    id: int
    executor: str  # the pool's name, e.g. "kvstrata-disk"
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    owner: object = None  # the SimExecutor it was submitted to
    future: Future = field(default_factory=Future)

    @property
    def name(self) -> str:
        return getattr(self.fn, "__name__", repr(self.fn))

    def run(self) -> BaseException | None:
        """Run the job; the exception it raised, if any (its future carries it too)."""
        if not self.future.set_running_or_notify_cancel():
            return None
        try:
            self.future.set_result(self.fn(*self.args, **self.kwargs))
        except BaseException as exc:  # noqa: BLE001 - recorded by the caller as a violation
            self.future.set_exception(exc)
            return exc
        return None


class JobQueue:
    """Every queued background job of a world, by id (ids grow: a trace names jobs by id)."""

    def __init__(self) -> None:
        self.pending: dict[int, SimJob] = {}
        self._next = 0

    def add(self, owner: "SimExecutor", fn: Callable[..., Any], args: tuple, kwargs: dict) -> SimJob:
        self._next += 1
        job = SimJob(self._next, owner.name, fn, args, kwargs, owner)
        self.pending[job.id] = job
        return job


class SimExecutor(Executor):
    def __init__(self, queue: JobQueue, name: str):
        self.queue = queue
        self.name = name
        self.closed = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        if self.closed:
            raise RuntimeError(f"cannot schedule new futures after shutdown ({self.name})")
        return self.queue.add(self, fn, args, kwargs).future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """A store that goes away: its queued jobs never run (as in a crash)."""
        self.closed = True
        for job in [job for job in self.queue.pending.values() if job.owner is self]:
            del self.queue.pending[job.id]
            job.future.cancel()


class InlineExecutor(Executor):
    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - the caller's future carries it
            future.set_exception(exc)
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        pass
