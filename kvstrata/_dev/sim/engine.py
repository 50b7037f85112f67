"""A vLLM engine as the simulation runs it: a scheduler over a real `StrataManager`, and
workers whose copies are plain byte copies between the arena and nowhere.

One `step` is one scheduler step of vLLM's offloading connector (0.32's order, see
`tests/connector/harness.py` and `benchmarks/scheduler_replay.py`): the outputs of the last
step (`complete_load` / `complete_store`, and on vLLM 0.33 `on_reset_flushed` once every
copy in flight at a reset has landed), then each waiting request scans its chunks with
`lookup` (a RETRY keeps scanning, the first MISS stops; any RETRY or HIT_PENDING leaves it
waiting), a request scheduled loads its HITs (`prepare_load`), then `on_schedule_end`, then
`prepare_store` of what it computed, then `on_request_finished` of the requests that ran.

A worker's copy is its own event (`Copy`), run by the simulation's scheduler between
steps, at the latest before the second step after the one that prepared it: a load may
take longer than a step (vLLM keeps the request waiting for it while other requests run),
vLLM submits stores a step late, and it flushes in-flight jobs a step after a reset. A paused engine's workers finish what they
were given first (the assumption the protocol states: a copy lands within half a lease
of its engine's last answer); a crashed engine's copies never land.

An engine may be vLLM's real wrapper, `WeightGenerations` (a new cache generation, with
new weights, at every connector reset; its old managers retire once flushed): then it
has a manager and a control channel per generation in flight, and a reset changes the
bytes its requests compute. Async scheduling (a reset's flush a step later) is drawn per
engine; a store copy may fail (`complete_store(success=False)`, its slots written with
garbage), a running request may be preempted (back to waiting, its lookups again).

Owns: the engine's requests and copies; what it observes goes to the world's checks
(`World.observe_hit`, `World.observe_load`, `World.observe_store_write`).
"""

from __future__ import annotations

import dataclasses
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from kvstrata.connector import deferred_start, weight_updates
from kvstrata.protocol import Registration, StepRequest
from kvstrata.connector.compat import LookupResult, ReqContext, ScheduleEndContext
from kvstrata.connector.manager import StrataManager
from kvstrata.connector.deferred_start import DeferredStart, Starting
from kvstrata.connector.weight_updates import WeightGenerations
from kvstrata._dev.sim.channel import SimChannel

World = Any  # kvstrata._dev.sim.world.World, which imports this module

HIT, MISS, RETRY, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY, LookupResult.HIT_PENDING


@dataclass(eq=False)
class Request:
    id: str
    keys: list[bytes]
    ctx: ReqContext
    arrived_step: int
    scheduled_step: int | None = None
    loads: int = 0  # load copies not reported complete yet
    # The step since which the request waits for the store (a view or a pin), and whether a
    # reply was applied since: the bound of finding 7 (`World.check_waits`).
    waiting_since: int | None = None
    waiting_since_t: float = 0.0  # the clock then
    replies_seen: int = 0
    weights: str = ""  # the weights (a namespace's bytes) its KV was computed with, once scheduled
    reoffload: bool = False  # running across a connector reset: vLLM 0.32 offloads its chunks again


@dataclass(eq=False)
class Copy:
    """A worker's transfer: reads (load) or writes (store) `slots` of the pool named by `geometry`."""

    id: int
    engine: int
    kind: str  # "load" | "store"
    request: Request
    keys: list[bytes]
    slots: list[int]
    epoch: str  # the store epoch (holder epoch) the slots belong to
    path: str  # the pool's segment path template: which arena
    deadline_step: int  # lands before the engine's step of this number
    weights: str  # a load: the namespace whose bytes it must read; a store: the bytes it writes
    prepared_at: float = 0.0
    holder: str = ""  # the manager (generation) that prepared it
    manager: Any = None
    reservations: tuple[int, ...] = ()  # a store: each slot's reservation number when prepared
    reported: bool = True  # False once a reset made vLLM forget the job (no completion)
    landed: bool = False
    failed: bool = False  # a store whose transfer failed: garbage in its slots, reported unsuccessful


class SimClient:
    """The blocking calls a manager makes itself (registration, release), straight to the
    world's current store; a registration can be set to lose its answer (finding 6)."""

    def __init__(self, world: World, engine: "SimEngine"):
        self.world = world
        self.engine = engine
        self.lose_next_registration = False

    def register(self, holder, namespace, slot_bytes, layout=None, watch=False, epoch="", *args) -> Registration:
        try:
            registration = self.world.store.register(holder, namespace, slot_bytes, layout, watch, epoch, *args)
        except ValueError as exc:
            if self.engine.alive and "already registered" in str(exc):
                self.world.violation(f"{holder}: locked out of its own holder name ({exc})")
            raise
        self.world.heard[holder] = self.world.clock()  # (registering starts its lease)
        if self.lose_next_registration:
            self.lose_next_registration = False
            raise TimeoutError("simulated: the registration was applied, its answer lost")
        return registration

    def step(self, request: StepRequest):  # never called: the channel's calls are events
        raise AssertionError("a simulated manager's calls go through its SimChannel")

    def release_holder(self, holder: str, epoch: str) -> None:
        self.world.store.release_holder(holder, epoch)

    def apply_hints(self, namespace: str, actions) -> None:
        """The connector's KV hints (connector/hints.py), an asynchronous call in production:
        queued here, applied by the store at a later event (`World.act_hints`)."""
        self.world.send_hints(self.engine, namespace, list(actions))


class _RetireThread:
    """`WeightGenerations` retires an old generation on a thread, and `DeferredStart` builds
    the first manager on one; in the simulation the thread's run is an event of its own
    (`World.act_retire`, `World.act_identity`), or runs when joined."""

    def __init__(self, engine: "SimEngine", queue: list, target, args=(), name: str = "", daemon: bool = True):
        self.engine, self.queue, self.target, self.args, self.done = engine, queue, target, args, False

    def start(self) -> None:
        self.queue.append(self)

    def run(self) -> None:
        if not self.done:
            self.done = True
            if self in self.queue:
                self.queue.remove(self)
            self.target(*self.args)

    def is_alive(self) -> bool:
        return not self.done

    def join(self, timeout: float | None = None) -> None:
        with self.engine.calls_in():
            self.run()


class _SimThreading:
    """What `weight_updates` (and `deferred_start`) see as `threading` while a simulated
    engine calls them: a thread started is queued in `queue`, run at an event."""

    RLock = staticmethod(threading.RLock)
    Lock = staticmethod(threading.Lock)

    def __init__(self, engine: "SimEngine", queue: list):
        self.engine, self.queue = engine, queue

    def Thread(self, target, args=(), name: str = "", daemon: bool = True) -> _RetireThread:  # noqa: N802
        return _RetireThread(self.engine, self.queue, target, args, name, daemon)


@dataclass(eq=False)
class SimEngine:
    world: World
    index: int
    holder: str
    flush_signal: bool  # vLLM 0.33's call order (on_reset_flushed), else 0.32's
    generations: bool = False  # vLLM's manager is `WeightGenerations` (a new generation per reset)
    async_scheduling: bool = False  # a reset's jobs are flushed a step later
    waiting: list[Request] = field(default_factory=list)
    running: list[Request] = field(default_factory=list)
    copies: dict[int, Copy] = field(default_factory=dict)  # not landed
    landed: list[Copy] = field(default_factory=list)  # landed, not reported yet
    flushing: set[int] = field(default_factory=set)  # copies in flight at a reset (0.33: until flushed)
    flush_owed: bool = False  # vLLM 0.33 owes this engine an on_reset_flushed
    answers: int = 0  # replies the manager got
    step_no: int = 0
    paused_until: float = float("-inf")
    alive: bool = True
    requests_made: int = 0
    preempted: list[str] = field(default_factory=list)  # request ids for the next on_schedule_end
    retirements: list[_RetireThread] = field(default_factory=list)  # old generations waiting to retire
    resets: int = 0
    deferred: bool = False  # the first manager is built off the start path (deferred_start.py)
    identity_builds: list[_RetireThread] = field(default_factory=list)  # that build, until it runs

    def __post_init__(self) -> None:
        self.client = SimClient(self.world, self)
        self.channels: list[SimChannel] = []
        self.strata: list[StrataManager] = []  # every manager (generation) this engine built, oldest first
        layout = self.world.layout_for(self.index)
        if self.deferred:  # served by `Starting` until `World.act_identity` runs the build
            saved = deferred_start.threading
            deferred_start.threading = _SimThreading(self, self.identity_builds)
            try:
                pending = DeferredStart(lambda: self._start(layout, self.holder), clock=self.world.clock)
            finally:
                deferred_start.threading = saved
            self.manager = WeightGenerations(Starting(), self._start_generation, pending)
            self.weights = layout.namespace
            return
        first = self._start(layout, self.holder)
        self.manager = WeightGenerations(first, self._start_generation) if self.generations else first
        self.weights = first.namespace

    def _start(self, layout, holder: str) -> StrataManager:
        world = self.world
        manager = StrataManager(
            self.client, layout, world.kv_config, holder, clock=world.clock, channel=self._channel,
            async_scheduling=self.async_scheduling,
        )  # fmt: skip
        manager._reset_flush_signal = self.flush_signal  # which vLLM's call order this engine follows
        world.note_namespace(manager.namespace, self.index)
        self.strata.append(manager)
        world.watch_pools()
        return manager

    def _start_generation(self, generation: int) -> StrataManager:
        """As spec.py's: the namespace of the updated identity, unique to this engine process."""
        layout = self.world.layout_for(self.index)
        layout = dataclasses.replace(layout, model=f"{layout.model}-{self.holder}-g{generation}")
        return self._start(layout, f"{self.holder}-g{generation}")

    def _channel(self, **kwargs) -> SimChannel:
        channel = SimChannel(**kwargs)
        self.channels.append(channel)
        return channel

    @property
    def channel(self) -> SimChannel | None:
        """The current generation's channel (the first engine's only one; None before any)."""
        if self.current is not None:
            return self.current._channel
        return self.channels[-1] if self.channels else None

    @property
    def current(self) -> StrataManager | None:
        """The manager that answers now (None: a generation that could not start, `Misses`)."""
        manager = self.manager.current if isinstance(self.manager, WeightGenerations) else self.manager
        return manager if isinstance(manager, StrataManager) else None

    def live_managers(self) -> list[StrataManager]:
        """The managers that still hold slots on this engine's behalf: the current one and
        the old generations not retired yet."""
        return [m for m in self.strata if not m._channel.closed]

    @contextmanager
    def calls_in(self):
        """Around every call into `WeightGenerations`: its retiring thread is an event."""
        if not self.generations:
            yield
            return
        saved = weight_updates.threading
        weight_updates.threading = _SimThreading(self, self.retirements)
        try:
            yield
        finally:
            weight_updates.threading = saved

    # --- what the world asks of it ------------------------------------------------------------

    def arrive(self, keys: list[bytes], params: dict | None = None) -> None:
        """A request arrives (`params`: its `kv_transfer_params`, e.g. KV hints from its HTTP client)."""
        self.requests_made += 1
        req = Request(f"e{self.index}-{self.holder[-2:]}-r{self.requests_made}", keys, ReqContext(req_id=""), self.step_no)
        req.ctx = ReqContext(req_id=req.id, kv_transfer_params=params)
        with self.calls_in():
            self.manager.on_new_request(req.ctx)
        self.waiting.append(req)

    def step(self) -> None:
        self.step_no += 1
        for copy in [c for c in self.copies.values() if c.deadline_step <= self.step_no]:
            self.world.land(copy)
        with self.calls_in():
            self._report()
            scheduled = [chosen for req in list(self.waiting) if (chosen := self._schedule(req)) is not None]
            finished = [req for req in self.running if req.scheduled_step < self.step_no and not req.loads]
            again = [req for req in self.running if req.reoffload]  # (those finishing now ran at this schedule)
            new = [req.id for req, _ in scheduled]
            preempted, self.preempted = tuple(self.preempted), []
            self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=new, preempted_req_ids=preempted))
            for req, computed in scheduled:
                if computed:
                    self._prepare_store(req, computed)
            for req in again:  # vLLM 0.32 offloads a running request's chunks again after a reset, from chunk 0
                req.reoffload = False
                self._prepare_store(req, list(req.keys))
            for req in finished:
                self.manager.on_request_finished(req.ctx)
                self.running.remove(req)

    def reset(self) -> None:
        """vLLM's reset_prefix_cache(reset_connector=True): the jobs in flight are flushed
        (they land, vLLM forgets them: no completion; before 0.33 within the next step, a
        step later with async scheduling), the manager resets. Running requests go on
        (`reset_running_requests=False`, the default). With `WeightGenerations` the reset
        is a weight update: what is computed from now on has the new generation's bytes."""
        flush_by = self.step_no + (3 if self.async_scheduling else 2)
        for copy in [*self.copies.values(), *self.landed]:
            copy.reported = False
            copy.deadline_step = min(copy.deadline_step, flush_by)
        self.landed.clear()
        self.flushing = set(self.copies)
        self.flush_owed = self.flush_signal
        for req in self.running:
            req.loads = 0
            req.reoffload = True
        self.resets += 1
        with self.calls_in():
            self.manager.reset_cache()
        current = self.current
        if self.generations:
            for req in self.waiting:  # a new manager: its bound on waiting for a silent store starts again
                req.waiting_since = None
            self.weights = current.namespace if current is not None else f"{self.holder}-misses-{self.resets}"
        elif self.world.config.reset_weights:  # a plain engine's weights updated in place (world.py)
            self.weights = f"{current.namespace}-reset{self.resets}"

    def pause(self, seconds: float) -> None:
        for copy in list(self.copies.values()):
            self.world.land(copy)
        self.paused_until = self.world.clock() + seconds

    def crash(self) -> None:
        self.alive = False
        self.copies.clear()
        self.retirements.clear()  # (the retiring thread dies with the process)
        self.identity_builds.clear()  # (and a fingerprint being read)
        for channel in self.channels:
            channel.close()

    def shut_down(self) -> None:
        """A clean shutdown: the store gets its slots back at once (`release_holder`)."""
        with self.calls_in():
            self.manager.shutdown()
        self.crash()

    def copy_landed(self, copy: Copy) -> None:
        del self.copies[copy.id]
        self.flushing.discard(copy.id)
        if copy.reported:
            self.landed.append(copy)

    def preempt(self, r: int) -> bool:
        """vLLM preempts a running request (its GPU blocks are needed): it waits again and
        looks its chunks up again; its stores in flight go on. Not one with a load in flight."""
        candidates = [req for req in self.running if not req.loads and req.scheduled_step < self.step_no]
        if not candidates:
            return False
        req = candidates[r % len(candidates)]
        self.running.remove(req)
        req.scheduled_step, req.waiting_since, req.reoffload = None, None, False
        self.waiting.insert(0, req)
        self.preempted.append(req.id)
        return True

    def fail_copy(self, r: int) -> bool:
        """A store transfer fails: its slots hold garbage, vLLM reports it unsuccessful."""
        stores = [copy for copy in self.copies.values() if copy.kind == "store"]
        if not stores:
            return False
        copy = stores[r % len(stores)]
        copy.failed = True
        self.world.land(copy)
        return True

    # --- one step's parts ----------------------------------------------------------------------

    def _report(self) -> None:
        landed, self.landed = self.landed, []
        for copy in landed:
            if copy.kind == "load":
                self.manager.complete_load(copy.keys, copy.request.ctx)
                copy.request.loads -= 1
            else:
                self.manager.complete_store(copy.keys, copy.request.ctx, not copy.failed)
        if self.flush_owed and not self.flushing:
            self.flush_owed = False
            self.manager.on_reset_flushed()

    def _schedule(self, req: Request) -> tuple[Request, list[bytes]] | None:
        results: list[tuple[bytes, LookupResult]] = []
        for key in req.keys:
            result = self.manager.lookup(key, req.ctx)
            if result is MISS:
                break
            if result is HIT:
                self.world.observe_hit(self, key)
            results.append((key, result))
        if any(result is not HIT for _, result in results):
            if req.waiting_since is None:
                req.waiting_since, req.replies_seen = self.step_no, self.answers
                req.waiting_since_t = self.world.clock()
            if any(result is RETRY for _, result in results):
                # Only a RETRY waits on the store. HIT_PENDING waits for this engine's own
                # store in flight, its worker's copy, which no silence of the store delays
                # (seed 408 of the 10^7-event run: a request re-offloaded after a reset).
                self.world.check_wait(self, req)
            return None
        self.waiting.remove(req)
        req.scheduled_step = self.step_no
        req.weights = self.weights  # its KV: computed (or loaded) under the weights of now
        self.running.append(req)
        hits = [key for key, _ in results]
        if hits:
            spec = self.manager.prepare_load(hits, req.ctx)
            self._copy("load", req, hits, [int(s) for s in spec.block_ids], spec.geometry, self.world.copy_deadline(self))
            req.loads += 1
        return req, req.keys[len(hits) :]

    def _prepare_store(self, req: Request, computed: list[bytes]) -> None:
        out = self.manager.prepare_store(computed, req.ctx)
        if out is not None and out.keys_to_store:
            slots = [int(s) for s in out.store_spec.block_ids]
            self._copy("store", req, list(out.keys_to_store), slots, out.store_spec.geometry, self.world.copy_deadline(self))

    def _copy(self, kind: str, req: Request, keys: list[bytes], slots: list[int], geometry, deadline: int) -> None:
        manager = self.current
        weights = self.weights if kind == "load" else req.weights
        copy = Copy(
            self.world.next_copy_id(), self.index, kind, req, keys, slots, manager._epoch, geometry.path_template,
            deadline, weights, self.world.clock(), manager.holder, manager,
            tuple(self.world.reservation_of(geometry.path_template, slot) for slot in slots) if kind == "store" else (),
        )  # fmt: skip
        self.copies[copy.id] = copy
        self.world.copies[copy.id] = copy
