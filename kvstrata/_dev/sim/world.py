"""The simulated node: one store with its arena, disk and object tiers, 1-3 engines, and
every action the simulation's scheduler may take.

Every action is a method `act_<name>(*args)` whose arguments are small numbers, so a run
is a list of tuples `(name, *args)` that replays exactly (`explore.replay`). Arguments
that pick among things in flight (a call, a job, a copy) are taken modulo how many there
are: an action whose target is gone after a shrink picks another, or does nothing.

The world keeps what the checks need (`invariants.py`): the bytes each key must have (a
key's bytes are a function of the key and the namespace's generation, which a weight
update bumps), the arenas of dead stores (loads of their epoch still read them, as a
worker keeps old segments mapped), the time each engine crashed, store stalls, and the
purges whose jobs in flight have not settled yet.
"""

from __future__ import annotations

import dataclasses
import hashlib
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvstrata.store.node_store import NodeStore
from kvstrata.config import load_config
from kvstrata.keys import Layout, key_hash, make_key
from kvstrata._dev.sim import invariants
from kvstrata._dev.sim.channel import DELIVERED, DONE, PENDING, Call
from kvstrata._dev.sim.disturbances import Disturbances, PurgeWatch, Stall, Swallowed
from kvstrata._dev.sim.engine import Copy, SimEngine
from kvstrata._dev.executors import InlineExecutor
from kvstrata._dev.sim.executors import JobQueue, SimExecutor
from kvstrata._dev.sim.hints import HintActions, HintCall
from kvstrata.tiers.arena import Arena, SlotError
from kvstrata.tiers.records import HEADER_BYTES

SLOT = 4096
COPY_SECONDS = 0.25  # a worker's copy lands at most this long after it was prepared
KEEP_DONE_CALLS = 3  # answered calls kept per engine, that the store may be made to apply again
NAMESPACE_MODEL = "sim-model"
# Hint limits small enough that random runs reach every bound (the checks of hints.py read them back)
HINT_LIMITS = {"prefetch": {
    "pin_sources": ["operator", "request"], "pin_share": 0.25, "max_share": 0.25, "lease_seconds": 2.0,
    "max_lease_seconds": 3.0, "max_deadline_seconds": 1.0, "max_retain_seconds": 6.0, "max_retained_chunks": 24,
    "retain_share": 0.5, "hint_max_actions": 3, "hint_max_tokens": 10,
}}  # fmt: skip


class SimClock:
    """The one clock of a world: the store, its tiers and every manager read it."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += max(0.0, seconds)

    def at_least(self, when: float) -> None:
        self.now = max(self.now, when)


@dataclass(frozen=True)
class SimConfig:
    """What one simulated node looks like; a seed draws one (`explore.config_for`)."""

    engines: int = 2
    arena_slots: int = 24
    disk_records: int = 32
    disk_policy: str = "write_through"
    object_policy: str = "write_back"
    lease_seconds: float = 4.0
    control_timeout_seconds: float = 0.5
    reserve_slots: int = 4
    prefixes: int = 6
    prefix_chunks: int = 4
    prompts: int = 16
    flush_signal: tuple[bool, ...] = (False, True, False)  # per engine: vLLM 0.33's reset order
    # Weight updates (engines move to the model's new namespace, the old one is purged while
    # its work is in flight) and the checks that nothing of a purged namespace survives that
    # work, and that the disk index and its records agree: findings 3 and 4 of issue #37
    # (fixed on the `store-purge` branch). Random runs have them on.
    purge_and_disk_races: bool = False
    # The paths added for issue #51 (random runs have them on): engines that are vLLM's
    # `WeightGenerations` (a connector reset is a weight update), async scheduling, late
    # worker copies, failed stores, preemption, hints (prefetch, pins, retention) from
    # two tenants, hybrid anchor groups.
    generations: tuple[bool, ...] = (False,)  # per engine: wrapped in WeightGenerations
    # per engine (with generations): the first manager is built off the start path, the
    # weights' fingerprint read meanwhile (connector/deferred_start.py): an event lands it
    deferred: tuple[bool, ...] = (False,)
    async_scheduling: tuple[bool, ...] = (False,)  # per engine
    copy_steps: int = 2  # a copy lands before the engine's step this many after it was prepared
    copy_seconds: float = COPY_SECONDS  # ... and at most this long after (late copies: up to half a lease)
    hints: bool = False  # the store's hint calls (prefetch, pin, unpin, retain) as actions
    tenants: int = 1  # engines of 2 tenants (namespace prefixes) share the node
    anchors: bool = False  # a hybrid model: group 1 (sliding window) anchored on group 0
    # admission.store.disk: chain (the default) keeps a reuse sketch, which orders the disk's
    # evictions too; always keeps none (the disk's plain eviction order)
    disk_admission: str = "chain"
    # A plain engine's connector reset is a weight update in place (its namespace stays):
    # what it computes after has new bytes, so a HIT or load of a chunk from before its
    # reset is wrong bytes. For directed scenarios of one engine only: another engine of the
    # namespace still computes the old bytes, and a plain manager is not shown to promise it
    # for a heartbeat answered between its reset and its purge's request (by reading the
    # code: a promotion landing then comes back into the mirror; `WeightGenerations` does).
    reset_weights: bool = False


def config_from_json(fields: dict) -> SimConfig:
    """A `SimConfig` as a trace prints it (JSON turned its tuples into lists)."""
    return SimConfig(**{name: tuple(value) if isinstance(value, list) else value for name, value in fields.items()})


class World(HintActions, Disturbances):
    def __init__(self, config: SimConfig, root: str | Path | None = None):
        self.config = config
        self._own_root = root is None
        self.root = Path(root or tempfile.mkdtemp(prefix="kvstrata-sim-"))
        self.clock = SimClock()
        self.jobs = JobQueue()
        self.calls: dict[int, Call] = {}
        self.copies: dict[int, Copy] = {}
        self._next_call = 0
        self._next_copy = 0
        self.generation = 0
        self.violations: list[str] = []
        self.stalls: list[Stall] = []
        self.crashed: dict[str, float] = {}  # holder of a crashed engine -> when
        self.heard: dict[str, float] = {}  # holder -> when the store last got a call of it
        self.served_at = self.clock()  # when the store last ran a call (leases expire at calls)
        self.purges: list[PurgeWatch] = []
        self.unknown_since: dict[tuple[str, int], float] = {}  # (holder, slot) its engine does not know of
        self.arenas: dict[str, Arena] = {}  # arena epoch -> arena (dead stores' too: old loads read them)
        self._expected: dict[tuple[bytes, str], bytes] = {}
        self.reservations: dict[tuple[str, int], int] = {}  # (pool path, slot) -> times it was reserved
        self.swallowed: list[str] = []  # exceptions a background job logged and swallowed
        self.tenant_of: dict[str, str] = {}  # namespace -> its tenant (`namespace_prefix`)
        self.hint_calls: list[HintCall] = []  # engines' `apply_hints` calls on their way (asynchronous)
        self.raw_config = self._raw_config()
        self.kv_config = load_config(self.raw_config)
        self._set_layout()
        self.prompts = self._make_prompts()
        self.store: NodeStore = self._start_store()
        self._swallowed = Swallowed()  # (after the store: its modules' loggers exist)
        self.incarnations = [0] * config.engines
        self.engines = [self._start_engine(i) for i in range(config.engines)]

    # --- set-up --------------------------------------------------------------------------

    def _set_layout(self) -> None:
        """The engines' layout: the model's weights version is part of its identity, so a
        weight update starts a new namespace (as `model_identity` makes it in production)."""
        hybrid = self.config.anchors  # group 1 (a sliding window) is dead weight without group 0's chunk
        self.layout = Layout(
            model=f"{NAMESPACE_MODEL}-w{self.generation}", dtype="float32", kv_cache_layout="",
            tokens_per_block=(32, 32) if hybrid else (32,), group_ids=(0, 1) if hybrid else (0,), tokens_per_hash=32,
            blocks_per_chunk=1, worker_kv_bytes_per_block=SLOT, world_size=1, tp_size=1, pp_size=1, pcp_size=1,
            dcp_size=1, hash_algo="sha256", anchor_groups=(0,) if hybrid else None,
        )  # fmt: skip
        self.namespace = self.layout.namespace  # the first tenant's
        self.slot_bytes = self.layout.slot_bytes
        self.namespaces = [self.layout_for(t).namespace for t in range(self.config.tenants)]  # each tenant's, served now
        for t, namespace in enumerate(self.namespaces):
            self.tenant_of[namespace] = self.tenant_name(t)

    def tenant_name(self, t: int) -> str:
        """Tenant `t`'s `namespace_prefix` (one tenant: the default, "")."""
        return f"t{t}" if self.config.tenants > 1 else ""

    def layout_for(self, t: int) -> Layout:
        """The layout of tenant `t`'s engines (engine i is of tenant i % tenants)."""
        return dataclasses.replace(self.layout, namespace_prefix=self.tenant_name(t % self.config.tenants))

    def note_namespace(self, namespace: str, t: int) -> None:
        """A namespace an engine of tenant `t` registers (a cache generation's too): for the quota checks."""
        self.tenant_of[namespace] = self.tenant_name(t % self.config.tenants)

    def _raw_config(self) -> dict:
        c = self.config
        (self.root / "shm").mkdir(exist_ok=True)
        return {
            "tiers": {
                "cpu": {"capacity": c.arena_slots * SLOT, "segment_size": c.arena_slots * SLOT // 2,
                        "shm_dir": str(self.root / "shm"), "prefault": False},
                "disk": {"path": str(self.root / "disk"), "capacity": c.disk_records * (SLOT + HEADER_BYTES),
                         "write_policy": c.disk_policy, "direct_io": False, "io_threads": 2, "queue_depth": 16},
                "object": {"url": f"file://{self.root}/bucket/kv", "write_policy": c.object_policy,
                           "index_refresh_seconds": 2.0, "queue_depth": 16, "max_concurrency": 2},
            },
            "engine": {"lease_seconds": c.lease_seconds, "reserve_slots": c.reserve_slots,
                       "control_timeout_seconds": c.control_timeout_seconds, "refresh_seconds": 0.05,
                       "max_view_age_seconds": 0.1, "lookup_wait_seconds": 2.0},
            "admission": {"load": "always", "store": {"disk": c.disk_admission}},
            **(HINT_LIMITS if c.hints else {}),
            **({"quotas": {"t1": {"cpu": c.arena_slots * SLOT // 2}}} if c.tenants > 1 else {}),
        }  # fmt: skip

    def _make_prompts(self) -> list[list[bytes]]:
        c = self.config

        def keys(*parts: object) -> list[bytes]:  # a position's chunks: one per KV group
            digest = hashlib.sha256(repr(parts).encode()).digest()
            return [make_key(digest, group) for group in self.layout.group_ids]

        prompts = []
        for p in range(c.prompts):
            prefix = p % c.prefixes
            length = 1 + (p * 7) % c.prefix_chunks  # prompts share a prefix of varying length
            at = [("prefix", prefix, i) for i in range(length)] + [("own", p, i) for i in range(p % 3)]
            prompts.append([key for parts in at for key in keys(*parts)])
        return prompts

    def block_hashes(self, p: int) -> list[str]:
        """Prompt `p`'s block hashes as a hint names them (hex; one per position, every group's chunk)."""
        return list(dict.fromkeys(key_hash(key).hex() for key in self.prompts[p % len(self.prompts)]))

    def _start_store(self) -> NodeStore:
        store = NodeStore(self.raw_config, "simnode", clock=self.clock, executors=self._executor)
        # The object tier's own pool is joined inside each of its jobs: no concurrency point.
        if store.object is not None:
            store.object._pool.shutdown(wait=True)
            store.object._pool = InlineExecutor()
        self.arenas[store.arena.epoch] = store.arena
        leases, take_expired = store.arena.leases, store.arena.leases.take_expired

        def expiring() -> list[str]:  # every lease the store ends, checked (`invariants.check_expiry`)
            expired = take_expired()
            for holder in expired:
                invariants.check_expiry(self, holder)
            return expired

        leases.take_expired = expiring
        return store

    def _executor(self, role: str, threads: int) -> SimExecutor:
        """The store's executor of a role (store/executors.py): every job an event."""
        if role == "disk-digest":  # a write waits on its checksums; a read's land later, in order
            return SimExecutor(self.jobs, role, queued=lambda name: name == "verify", fifo=True)
        return SimExecutor(self.jobs, role)

    def _start_engine(self, index: int) -> SimEngine:
        self.incarnations[index] += 1
        holder = f"sim-engine-{index}-{self.incarnations[index]:02d}"
        c = self.config
        flush = c.flush_signal[index % len(c.flush_signal)]
        generations = c.generations[index % len(c.generations)]
        async_scheduling = c.async_scheduling[index % len(c.async_scheduling)]
        deferred = generations and c.deferred[index % len(c.deferred)]
        return SimEngine(self, index, holder, flush, generations, async_scheduling, deferred=deferred)

    def close(self) -> None:
        for engine in self.engines:
            engine.crash()
        self.store.close()
        for arena in self.arenas.values():
            arena.close()
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    # --- what engines and checks ask of the world -------------------------------------------

    def expected(self, key: bytes, weights: str) -> bytes:
        """The bytes of `key` computed with `weights` (a namespace: a model's identity, which
        changes with its weights): what every engine of those weights computes."""
        found = self._expected.get((key, weights))
        if found is None:
            digest = hashlib.blake2b(key + weights.encode(), digest_size=64).digest()
            found = self._expected[(key, weights)] = digest * (SLOT // 64)
        return found

    def copy_deadline(self, engine: SimEngine) -> int:
        """The step before which a copy prepared now has landed (late copies: several steps)."""
        return engine.step_no + self.config.copy_steps

    def watch_pools(self) -> None:
        """Count each slot's reservations (`reservation_of`): every pool's `reserve` wrapped once."""
        for pool in self.store.arena.pools.values():
            if "reserve" in pool.__dict__:
                continue
            path, reserve, counts = pool.geometry.path_template, pool.reserve, self.reservations

            def counted(holder: str, count: int, path=path, reserve=reserve) -> list[int]:
                granted = reserve(holder, count)
                for slot in granted:
                    counts[(path, slot)] = counts.get((path, slot), 0) + 1
                return granted

            pool.reserve = counted

    def reservation_of(self, path: str, slot: int) -> int:
        return self.reservations.get((path, slot), 0)

    def view(self, path_template: str, slot: int) -> np.ndarray | None:
        """The bytes of `slot` in the pool whose segments are named by `path_template`."""
        for arena in self.arenas.values():
            for pool in arena.pools.values():
                if pool.geometry.path_template == path_template:
                    try:
                        return pool.view(slot)
                    except SlotError:  # a segment the pool gave back: its bytes are no chunk's
                        return None
        return None

    def next_copy_id(self) -> int:
        self._next_copy += 1
        return self._next_copy

    def violation(self, what: str) -> None:
        self.violations.append(f"t={self.clock():.3f}: {what}")

    def observe_hit(self, engine: SimEngine, key: bytes) -> None:
        invariants.check_hit(self, engine, key)

    def check_wait(self, engine: SimEngine, req) -> None:
        invariants.check_wait(self, engine, req)

    def land(self, copy: Copy) -> None:
        """A worker's copy lands: a load reads its slots, a store writes its chunks' bytes
        (a failed one, garbage)."""
        engine = self.engines[copy.engine]
        if copy.kind == "load":
            invariants.check_load(self, engine, copy)
        else:
            invariants.check_store_write(self, engine, copy)
            for key, slot in zip(copy.keys, copy.slots):
                self.write(copy.path, slot, f"store of {engine.holder}", copy)
                view = self.view(copy.path, slot)
                if view is not None:
                    view[:] = 0x5A if copy.failed else np.frombuffer(self.expected(key, copy.weights), dtype=np.uint8)
        copy.landed = True
        self.copies.pop(copy.id, None)
        engine.copy_landed(copy)

    # --- actions -------------------------------------------------------------------------------

    def apply(self, action: tuple) -> bool:
        """Run one action; False if it could not run now (nothing to act on)."""
        try:
            return bool(getattr(self, f"act_{action[0]}")(*action[1:]))
        except Exception as exc:  # noqa: BLE001 - what raised into vLLM (or the simulation) is a violation
            self.violation(f"{action[0]} raised {exc!r}")
            return True

    def _engine(self, e: int) -> SimEngine | None:
        engine = self.engines[e % len(self.engines)]
        return engine if engine.alive else None

    def act_arrive(self, e: int, p: int) -> bool:
        engine = self._engine(e)
        if engine is None or len(engine.waiting) >= 6:
            return False
        engine.arrive(self.prompts[p % len(self.prompts)])
        return True

    def act_step(self, e: int) -> bool:
        engine = self._engine(e)
        if engine is None or self.clock() < engine.paused_until:
            return False
        engine.step()
        return True

    def write(self, path: str, slot: int, who: str, copy: Copy | None = None) -> None:
        """Something writes a slot: no load in flight may be reading it (its bytes would not be its key's)."""
        for other in self.copies.values():
            if other is not copy and other.kind == "load" and other.path == path and slot in other.slots:
                self.violation(
                    f"{who} writes slot {slot} under a load of {self.engines[other.engine].holder} in flight"
                )

    def act_tick(self, ms: float) -> bool:
        self.advance_to(self.clock() + ms / 1000)
        return True

    def advance_to(self, when: float) -> None:
        """Move the clock on; a worker's copy lands within `COPY_SECONDS` of being prepared
        (the assumption rule 3 rests on: well within half a lease), so those due land first."""
        for copy in sorted(self.copies.values(), key=lambda c: c.prepared_at):
            if copy.prepared_at + self.config.copy_seconds <= when and self.engines[copy.engine].alive:
                self.land(copy)
        self.clock.at_least(when)

    def act_send(self, e: int, c: int = 0) -> bool:
        """A channel of the engine sends its next call (`c` picks among its generations' channels)."""
        engine = self._engine(e)
        if engine is None or self.clock() < engine.paused_until:
            return False
        channels = [channel for channel in engine.channels if not channel.closed]
        for i in range(len(channels)):
            channel = channels[(c + i) % len(channels)]
            request = channel.next_request()
            if request is not None:
                break
        else:
            return False
        self._next_call += 1
        call = Call(self._next_call, engine.index, request, self.clock(), channel=channel)
        self.calls[call.id] = call
        channel.awaiting = call
        return True

    def _call(self, e: int, r: int, states: tuple[str, ...], awaited: bool | None) -> Call | None:
        matching = [
            c for c in self.calls.values()
            if c.engine == e % len(self.engines) and c.state in states and (awaited is None or c.awaited == awaited)
        ]  # fmt: skip
        return matching[r % len(matching)] if matching else None

    def act_deliver(self, e: int, r: int) -> bool:
        call = self._call(e, r, (PENDING,), None)
        if call is None:
            return False
        self._deliver(call)
        return True

    def _deliver(self, call: Call) -> None:
        call.deliveries += 1
        try:
            reply = self.store.step(call.request)
        except Exception as exc:  # noqa: BLE001 - the store's answer is an error: the channel sees it
            call.error = exc
            reply = None
        call.reply = reply if call.reply is None else call.reply
        self.served_at = self.clock()
        applied = reply is not None and reply.epoch == call.request.epoch and not reply.stale and not reply.rejected
        if applied:  # the store renewed the holder's lease
            self.heard[call.request.holder] = self.clock()
        if call.request.purge and applied:  # settled once every job in flight now (its own included) ran
            self.purges.append(PurgeWatch(call.request.namespace, set(self.jobs.pending)))
        if call.state == PENDING:
            if call.awaited:
                call.state = DELIVERED
            else:
                self._done(call)

    def _done(self, call: Call) -> None:
        """The call is over for its channel; only the last few of an engine stay (for duplicates)."""
        call.state = DONE
        done = [c.id for c in self.calls.values() if c.engine == call.engine and c.state == DONE]
        for old in done[:-KEEP_DONE_CALLS]:
            del self.calls[old]

    def act_answer(self, e: int, r: int) -> bool:
        call = self._call(e, r, (DELIVERED,), True)
        if call is None:
            return False
        self._done(call)
        engine = self.engines[call.engine]
        with engine.calls_in():
            if call.error is not None:
                call.channel.failed(call, call.error)
            else:
                engine.answers += call.channel is engine.channel
                call.channel.answered(call)
        return True

    def act_lose(self, e: int, r: int) -> bool:
        """The store applied the call; its answer is lost: the channel times out."""
        call = self._call(e, r, (DELIVERED,), True)
        if call is None:
            return False
        self._done(call)
        self.advance_to(call.sent_at + self.config.control_timeout_seconds)
        with self.engines[call.engine].calls_in():
            call.channel.failed(call, TimeoutError("simulated: answer lost"))
        return True

    def act_timeout(self, e: int, r: int) -> bool:
        """The channel gives up on a call the store has not applied yet; it may still apply it."""
        call = self._call(e, r, (PENDING,), True)
        if call is None:
            return False
        self.advance_to(call.sent_at + self.config.control_timeout_seconds)
        with self.engines[call.engine].calls_in():
            call.channel.failed(call, TimeoutError("simulated: no answer in time"))
        return True

    def act_fail(self, e: int, r: int) -> bool:
        """The call fails at once and never reaches the store (the actor is unreachable)."""
        call = self._call(e, r, (PENDING,), True)
        if call is None:
            return False
        self._done(call)
        with self.engines[call.engine].calls_in():
            call.channel.failed(call, ConnectionError("simulated: store unreachable"))
        return True

    def act_duplicate(self, e: int, r: int) -> bool:
        """The store applies a call it already applied once more (its answer goes nowhere)."""
        call = self._call(e, r, (DELIVERED, DONE), None)
        if call is None or not call.deliveries:
            return False
        before = call.reply, call.state
        self._deliver(call)
        call.reply, call.state = before
        return True

    def act_job(self, r: int) -> bool:
        if not self.jobs.pending:
            return False
        job = list(self.jobs.pending.values())[r % len(self.jobs.pending)]
        if job.owner.fifo:
            job = next(j for j in self.jobs.pending.values() if j.owner is job.owner)
        del self.jobs.pending[job.id]
        before = set(self.jobs.pending)
        with self._swallowed as swallowed:
            exc = job.run()
        if exc is not None:
            self.violation(f"background job {job.name} raised {exc!r}")
        for error, message in swallowed.records:
            self.violation(f"background job {job.name} swallowed {error!r} ({message})")
        spawned = set(self.jobs.pending) - before  # (a bucket purge waits for the uploads before it)
        for watch in self.purges:
            if job.id in watch.jobs:
                watch.jobs.discard(job.id)
                watch.jobs |= spawned
        return True

    def act_land(self, e: int, r: int) -> bool:
        engine = self._engine(e)
        if engine is None or not engine.copies:
            return False
        self.land(list(engine.copies.values())[r % len(engine.copies)])
        return True

    # --- checks ----------------------------------------------------------------------------------

    def check(self) -> None:
        invariants.check_world(self)

    def stall_seconds_since(self, since: float, longer_than: float = 0.0) -> float:
        return sum(s.seconds for s in self.stalls if s.at + s.seconds >= since and s.seconds > longer_than)
