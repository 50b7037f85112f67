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

Owns: the engine's requests and copies; what it observes goes to the world's checks
(`World.observe_hit`, `World.observe_load`, `World.observe_store_write`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvstrata.protocol import Registration, StepRequest
from kvstrata.connector.compat import LookupResult, ReqContext, ScheduleEndContext
from kvstrata.connector.manager import StrataManager
from kvstrata.sim.channel import SimChannel

World = Any  # kvstrata.sim.world.World, which imports this module

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
    generation: int  # the bytes a store writes: the namespace's generation when prepared
    prepared_at: float = 0.0
    reported: bool = True  # False once a reset made vLLM forget the job (no completion)
    landed: bool = False


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
        if self.lose_next_registration:
            self.lose_next_registration = False
            raise TimeoutError("simulated: the registration was applied, its answer lost")
        return registration

    def step(self, request: StepRequest):  # never called: the channel's calls are events
        raise AssertionError("a simulated manager's calls go through its SimChannel")

    def release_holder(self, holder: str, epoch: str) -> None:
        self.world.store.release_holder(holder, epoch)


@dataclass(eq=False)
class SimEngine:
    world: World
    index: int
    holder: str
    flush_signal: bool  # vLLM 0.33's call order (on_reset_flushed), else 0.32's
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

    def __post_init__(self) -> None:
        self.client = SimClient(self.world, self)
        self.channel: SimChannel | None = None
        world = self.world
        self.manager = StrataManager(
            self.client, world.layout, world.kv_config, self.holder, clock=world.clock, channel=self._channel
        )
        self.manager._reset_flush_signal = self.flush_signal  # which vLLM's call order this engine follows

    def _channel(self, **kwargs) -> SimChannel:
        self.channel = SimChannel(**kwargs)
        return self.channel

    # --- what the world asks of it ------------------------------------------------------------

    def arrive(self, keys: list[bytes]) -> None:
        self.requests_made += 1
        req = Request(f"e{self.index}-{self.holder[-2:]}-r{self.requests_made}", keys, ReqContext(req_id=""), self.step_no)
        req.ctx = ReqContext(req_id=req.id)
        self.manager.on_new_request(req.ctx)
        self.waiting.append(req)

    def step(self) -> None:
        self.step_no += 1
        for copy in [c for c in self.copies.values() if c.deadline_step <= self.step_no]:
            self.world.land(copy)
        self._report()
        scheduled = [chosen for req in list(self.waiting) if (chosen := self._schedule(req)) is not None]
        finished = [req for req in self.running if req.scheduled_step < self.step_no and not req.loads]
        new = [req.id for req, _ in scheduled]
        self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=new, preempted_req_ids=()))
        for req, computed in scheduled:
            if computed:
                self._prepare_store(req, computed)
        for req in finished:
            self.manager.on_request_finished(req.ctx)
            self.running.remove(req)

    def reset(self) -> None:
        """vLLM's reset_prefix_cache(reset_connector=True): the jobs in flight are flushed
        (they land, vLLM forgets them: no completion), the manager resets."""
        for copy in [*self.copies.values(), *self.landed]:
            copy.reported = False
        self.landed.clear()
        self.flushing = set(self.copies)
        self.flush_owed = self.flush_signal
        for req in self.running:
            req.loads = 0
        self.manager.reset_cache()

    def pause(self, seconds: float) -> None:
        for copy in list(self.copies.values()):
            self.world.land(copy)
        self.paused_until = self.world.clock() + seconds

    def crash(self) -> None:
        self.alive = False
        self.copies.clear()
        if self.channel is not None:
            self.channel.close()

    def shut_down(self) -> None:
        """A clean shutdown: the store gets its slots back at once (`release_holder`)."""
        self.manager.shutdown()
        self.crash()

    def copy_landed(self, copy: Copy) -> None:
        del self.copies[copy.id]
        self.flushing.discard(copy.id)
        if copy.reported:
            self.landed.append(copy)

    # --- one step's parts ----------------------------------------------------------------------

    def _report(self) -> None:
        landed, self.landed = self.landed, []
        for copy in landed:
            if copy.kind == "load":
                self.manager.complete_load(copy.keys, copy.request.ctx)
                copy.request.loads -= 1
            else:
                self.manager.complete_store(copy.keys, copy.request.ctx)
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
            self.world.check_wait(self, req)
            return None
        self.waiting.remove(req)
        req.scheduled_step = self.step_no
        self.running.append(req)
        hits = [key for key, _ in results]
        if hits:
            spec = self.manager.prepare_load(hits, req.ctx)
            self._copy("load", req, hits, [int(s) for s in spec.block_ids], spec.geometry, self.step_no + 2)
            req.loads += 1
        return req, req.keys[len(hits) :]

    def _prepare_store(self, req: Request, computed: list[bytes]) -> None:
        out = self.manager.prepare_store(computed, req.ctx)
        if out is not None and out.keys_to_store:
            slots = [int(s) for s in out.store_spec.block_ids]
            self._copy("store", req, list(out.keys_to_store), slots, out.store_spec.geometry, self.step_no + 2)

    def _copy(self, kind: str, req: Request, keys: list[bytes], slots: list[int], geometry, deadline: int) -> None:
        copy = Copy(
            self.world.next_copy_id(), self.index, kind, req, keys, slots, self.manager._epoch,
            geometry.path_template, deadline, self.world.generation, self.world.clock(),
        )  # fmt: skip
        self.copies[copy.id] = copy
        self.world.copies[copy.id] = copy
