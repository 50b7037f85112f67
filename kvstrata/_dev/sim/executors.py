"""Background jobs as events: executors the simulation runs one job at a time, when it chooses.

The node store asks an `ExecutorFactory` for one executor per role (store/executors.py:
`disk`, `object`, `peer`, `disk-digest`). The simulation gives it `SimExecutor`s: `submit`
queues the job and returns its future; the job runs only when the simulation's scheduler
picks it (`World.act_job`), whole, on the simulation's thread. All roles share one
`JobQueue`, so a job is picked among every job in flight. The `disk-digest` role runs a
disk write's checksums when submitted (the write waits on them) and queues a read's
(`verify`): a promotion's read and its commit are then two events, with anything between
them; its queue runs oldest first (a read's pieces are checked in order, each waiting on
the one before). The object tier's own fan-out pool, joined inside each of its jobs, runs
inline (`InlineExecutor`).

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
    """`queued`: which jobs wait to be picked (the rest run when submitted); `fifo`: the
    scheduler runs this executor's oldest job whichever it picked."""

    def __init__(self, queue: JobQueue, name: str, queued: Callable[[str], bool] = lambda name: True, fifo: bool = False):
        self.queue = queue
        self.name = name
        self.queued = queued
        self.fifo = fifo
        self.closed = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        if self.closed:
            raise RuntimeError(f"cannot schedule new futures after shutdown ({self.name})")
        job = self.queue.add(self, fn, args, kwargs)
        if not self.queued(job.name):
            del self.queue.pending[job.id]
            job.run()
        return job.future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """A store that goes away: its queued jobs never run (as in a crash)."""
        self.closed = True
        for job in [job for job in self.queue.pending.values() if job.owner is self]:
            del self.queue.pending[job.id]
            job.future.cancel()
