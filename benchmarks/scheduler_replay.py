"""A scheduler loop that calls an `OffloadingManager` as vLLM 0.32's offloading connector
does, and a node-store client that counts the calls a manager makes; for
`manager_overhead.py`.

One engine step of `replay`:

    new requests: on_new_request
    schedule:     each waiting request scans its chunks with `lookup` -- RETRY does not
                  stop the scan, the first MISS does; any RETRY or HIT_PENDING leaves the
                  request waiting for the next step -- else it is scheduled: prepare_load
                  of its hits
    connector:    on_schedule_end; prepare_store of the scheduled requests' other chunks;
                  on_request_finished of the requests that finished last step
    forward pass: time.sleep(forward_s), not counted: the node store (its own process)
                  and the manager's control thread run meanwhile, as beside a GPU
    outputs:      complete_load / complete_store of this step's transfers; the requests
                  are prefill-only and finish here

Only the manager's public interface is used.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, field

TOKENS_PER_CHUNK = 16
STEPS_PER_REQUEST_BOUND = 50  # a replay stops after this many steps per request


@dataclass
class Result:
    manager: str
    requests: int = 0  # finished (on_request_finished)
    unfinished: int = 0
    steps: int = 0
    hit_requests: int = 0
    waited_hit: int = 0  # steps waited, summed over hit requests
    resident: int = 0  # hit requests whose whole prefix was stored when they arrived
    waited_resident: int = 0
    hit_chunks: int = 0
    stored_chunks: int = 0  # accepted by prepare_store
    manager_ns: int = 0
    manager_cpu_ns: int | None = None  # the scheduler thread's CPU time in those calls (cpu_time=True)
    request_ns: list[int] = field(default_factory=list)  # each finished request's manager time
    waited_all: int = 0  # steps waited, summed over every scheduled request
    scheduled: int = 0
    calls: tuple[int, int] | None = None  # node-store calls: (control thread, scheduler thread)
    awaiting_reuse: str = "n/a"
    notes: list[str] = field(default_factory=list)

    def us_per_request(self) -> float:
        return self.manager_ns / 1000 / max(1, self.requests)

    def request_us(self, quantile: float) -> float | None:
        """A quantile (0.5, 0.99) of a request's manager time, in us."""
        if not self.request_ns:
            return None
        ordered = sorted(self.request_ns)
        return ordered[min(len(ordered) - 1, int(quantile * len(ordered)))] / 1000

    def waited_per_request(self) -> float | None:
        return self.waited_all / self.scheduled if self.scheduled else None

    def waited(self, resident: bool) -> float | None:
        total, count = (self.waited_resident, self.resident) if resident else (self.waited_hit, self.hit_requests)
        return total / count if count else None


@dataclass(eq=False)
class _Request:
    ctx: object
    keys: list[bytes]
    arrived: int
    resident: bool
    hits: int = 0
    stores: list[bytes] = field(default_factory=list)
    ns: int = 0  # manager time spent on this request's calls (and its share of step ends)


def replay(
    manager,
    label: str,
    trace: list[list[bytes]],
    prefix_chunks: int,
    per_step: int,
    forward_s: float,
    cpu_time: bool = False,
) -> Result:
    """Drive `manager` through `trace` (each request's keys, its shared prefix's first).

    `per_step` new requests arrive each step; 0: one request in flight at a time (the
    next arrives the step after the previous one finished). Bounded by
    `STEPS_PER_REQUEST_BOUND` steps per request. `cpu_time`: also count the scheduler
    thread's CPU time inside manager calls (read outside the timed span).
    """
    from kvstrata.connector.compat import LookupResult, ReqContext, ScheduleEndContext

    HIT, HIT_PENDING, MISS = LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.MISS
    result = Result(label)
    clock = time.perf_counter_ns
    spent = 0

    cpu_clock = time.thread_time_ns if cpu_time else None
    cpu_spent = 0

    def call(fn, *args, request=None):
        nonlocal spent, cpu_spent
        cpu_start = cpu_clock() if cpu_clock else 0
        start = clock()
        try:
            return fn(*args)
        finally:
            took = clock() - start
            if cpu_clock:
                cpu_spent += cpu_clock() - cpu_start
            spent += took
            if request is not None:
                request.ns += took

    stored: set[bytes] = set()  # complete_store'd by this manager
    storing: set[bytes] = set()  # between prepare_store and complete_store
    waiting: list[_Request] = []
    finishing: list[_Request] = []  # finished in the last forward pass
    next_request, step = 0, 0
    max_steps = STEPS_PER_REQUEST_BOUND * len(trace) + 100
    while (next_request < len(trace) or waiting or finishing) and step < max_steps:
        arrivals = per_step or (0 if waiting or finishing else 1)
        for _ in range(min(arrivals, len(trace) - next_request)):
            keys = trace[next_request]
            ctx = ReqContext(req_id=f"r{next_request}")
            set_position = getattr(ctx, "set_offload_key_position", None)  # vLLM 0.32+
            for i, key in enumerate(keys if set_position else ()):
                set_position(key, (i + 1) * TOKENS_PER_CHUNK)
            resident = all(k in stored and k not in storing for k in keys[:prefix_chunks])
            waiting.append(_Request(ctx, keys, step, resident))
            call(manager.on_new_request, ctx, request=waiting[-1])
            next_request += 1

        scheduled, still_waiting = [], []
        for request in waiting:
            hits, deferred = 0, False
            for key in request.keys:
                answer = call(manager.lookup, key, request.ctx, request=request)
                if answer is HIT:
                    hits += 1
                elif answer is HIT_PENDING:  # counted as vLLM does, but the request waits
                    hits += 1
                    deferred = True
                elif answer is MISS:
                    break
                else:  # RETRY: the scan goes on, so the manager can ask for every chunk at once
                    deferred = True
            if deferred:
                still_waiting.append(request)
                continue
            request.hits = hits
            result.scheduled += 1
            result.waited_all += step - request.arrived
            if hits:
                call(manager.prepare_load, request.keys[:hits], request.ctx, request=request)
                waited = step - request.arrived
                result.hit_requests += 1
                result.hit_chunks += hits
                result.waited_hit += waited
                if request.resident:
                    result.resident += 1
                    result.waited_resident += waited
            scheduled.append(request)
        waiting = still_waiting

        ids = [request.ctx.req_id for request in scheduled]
        before = spent
        call(manager.on_schedule_end, ScheduleEndContext(new_req_ids=ids, preempted_req_ids=()))
        share = scheduled + waiting  # a step's end is shared by the requests it scanned
        for request in share:
            request.ns += (spent - before) // len(share)
        for request in scheduled:
            if request.hits < len(request.keys):
                out = call(manager.prepare_store, request.keys[request.hits :], request.ctx, request=request)
                request.stores = list(out.keys_to_store) if out is not None else []
                result.stored_chunks += len(request.stores)
                storing.update(request.stores)
        for request in finishing:
            call(manager.on_request_finished, request.ctx, request=request)
            result.request_ns.append(request.ns)
        result.requests += len(finishing)

        time.sleep(forward_s)  # the forward pass
        for request in scheduled:
            if request.hits:
                call(manager.complete_load, request.keys[: request.hits], request.ctx, request=request)
            if request.stores:
                call(manager.complete_store, request.stores, request.ctx, request=request)
                storing.difference_update(request.stores)
                stored.update(request.stores)
        finishing = scheduled
        step += 1
    result.steps, result.manager_ns = step, spent
    if cpu_time:
        result.manager_cpu_ns = cpu_spent
    result.unfinished = len(trace) - result.requests
    if result.unfinished:
        result.notes.append(f"stopped at {max_steps} steps with {result.unfinished} requests unfinished")
    return result


class CountingClient:
    """The node-store client, counting the calls made while `counting` is set.

    A call from the scheduler (main) thread blocks scheduling: the goal is none. Every
    method is passed through, so whatever the manager calls is counted; the round trips
    of the control thread's calls are kept.
    """

    def __init__(self, inner) -> None:
        self._inner = inner
        self._lock = threading.Lock()
        self.counting = False
        self.on_scheduler = 0
        self.on_control = 0
        self.round_trips: list[float] = []
        self.done = 0  # calls answered (or failed), counted or not
        self._in_flight = 0
        self._last_activity = time.monotonic()

    def __getattr__(self, name: str):
        target = getattr(self._inner, name)
        if not callable(target):
            return target

        def counted(*args, **kwargs):
            on_scheduler = threading.current_thread() is threading.main_thread()
            with self._lock:
                self._in_flight += 1
                self._last_activity = start = time.monotonic()
                counting = self.counting
                if counting and on_scheduler:
                    self.on_scheduler += 1
                elif counting:
                    self.on_control += 1
            try:
                return target(*args, **kwargs)
            finally:
                with self._lock:
                    self._in_flight -= 1
                    self.done += 1
                    self._last_activity = time.monotonic()
                    if counting and not on_scheduler:
                        self.round_trips.append(self._last_activity - start)

        return counted

    def settle(self, quiet_s: float = 0.1, timeout_s: float = 30.0, done: int = 0) -> bool:
        """Wait (off the clock) until at least `done` calls were answered, none is in
        flight and none started for `quiet_s`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if self.done >= done and not self._in_flight and time.monotonic() - self._last_activity >= quiet_s:
                    return True
            time.sleep(0.01)
        return False

    def round_trip_ms(self) -> str:
        if len(self.round_trips) < 2:
            return "n/a"
        centiles = statistics.quantiles(self.round_trips, n=100)
        return (
            f"p50 {statistics.median(self.round_trips) * 1e3:.2f} ms, p90 {centiles[89] * 1e3:.2f} ms, "
            f"p99 {centiles[98] * 1e3:.2f} ms ({len(self.round_trips)} calls)"
        )
