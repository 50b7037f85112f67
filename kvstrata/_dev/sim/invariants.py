"""What must hold after every event of a simulated run (issue #37, rule 8).

- *Bytes*: every HIT an engine answers (from its mirror or a pin) names a slot that holds
  exactly the key's bytes, and every load reads exactly the bytes of its keys
  (`check_hit`, `check_load`). A key's bytes are a function of the key and the weights
  that computed them (`World.expected`): the namespace's generation, which every engine
  of it computes the same (and, in scenarios with `reset_weights`, a plain engine's resets).
- *One owner*: a worker writes only into slots its engine holds reserved under its current
  registration, in the live store's arena, under the very reservation it was prepared in
  (each slot's reservations are numbered: `World.reservation_of`), and nothing writes a
  slot a load in flight reads (`check_store_write`, `World.write`): else two owners write
  one slot.
- *Leases*: the store ends a live engine's lease only after a lease of that engine's
  silence, its own long calls not counted (`check_expiry`).
- *No leaks*: every slot the store holds reserved or pinned for an engine is one that engine
  knows it holds (or will learn of from an answer on its way), or it is released within one
  lease (plus the store's own stalls) -- also after the engine crashed (`check_holdings`).
- *Bounded waits*: a request never waits more than a few of its engine's steps on a store
  that has not answered since it began to wait (`check_wait`).
- The disk index and its records agree, every record counted once (free + indexed +
  being written = allocated) (`check_disk`), and once a purge's work in flight
  has run, no tier holds anything of the namespace it purged, unless engines still serve it
  (`check_purges`; a weight update, with `purge_and_disk_races`, moves the engines to a new
  namespace and purges the old).

Also violations (world.py): an exception out of any call into a manager (it would raise
into vLLM), and a background job that raises or swallows an exception it logs.

A violation is recorded on the world (`World.violation`), never raised: the run stops at the
first and shrinks its trace.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvstrata.store.cascade import CASCADE, UPLOAD
from kvstrata.store.control import STALL_SECONDS
from kvstrata.store.promotion import PROMOTE
from kvstrata.keys import key_name
from kvstrata._dev.sim.hints import check_hints

# The world (world.py) and its engines (engine.py) import this module: named, not imported.
World = SimEngine = Copy = Request = Any

INTERNAL = (CASCADE, UPLOAD, PROMOTE)
WAIT_SLACK_STEPS = 2  # beyond engine.view_wait_steps: a store copy lands within two steps
WAIT_SLACK_FACTOR = 2  # beyond the manager's silence time (a step's length, measured roughly)


def _matches(view: np.ndarray | None, expected: bytes) -> bool:
    return view is not None and view.tobytes() == expected


def check_hit(world: World, engine: SimEngine, key: bytes) -> None:
    manager = engine.current
    pin = manager._pinned.get(key) if manager is not None else None
    if pin is None:
        world.violation(f"{engine.holder}: HIT on {key_name(key)} with no pin")
        return
    view = world.view(manager._geometry.path_template, pin.slot)
    # (engine.weights: the current manager's namespace, or after a plain reset with `reset_weights`)
    if not _matches(view, world.expected(key, engine.weights)):
        world.violation(f"{engine.holder}: HIT on {key_name(key)} names slot {pin.slot}, which holds other bytes")


def check_load(world: World, engine: SimEngine, copy: Copy) -> None:
    for key, slot in zip(copy.keys, copy.slots):
        if not _matches(world.view(copy.path, slot), world.expected(key, copy.weights)):
            world.violation(f"{engine.holder}: load of {key_name(key)} read slot {slot}, which holds other bytes")


def check_store_write(world: World, engine: SimEngine, copy: Copy) -> None:
    store = world.store
    pool = next((p for p in store.arena.pools.values() if p.geometry.path_template == copy.path), None)
    if pool is None:
        return  # the slots of a dead store's arena: nobody else writes there any more
    bound = store._holders.get(copy.holder)
    for slot, reservation in zip(copy.slots, copy.reservations):
        owner = pool._reserved.get(slot)
        if owner != copy.holder or bound != copy.epoch:
            world.violation(
                f"{copy.holder}: its worker writes slot {slot} (prepared in epoch {copy.epoch[:8]}), which the store "
                f"holds for {owner or 'nobody'} (the engine's registration: {(bound or 'none')[:8]})"
            )
        elif world.reservation_of(copy.path, slot) != reservation:
            world.violation(
                f"{copy.holder}: its worker writes slot {slot}, released and reserved for it again since the store "
                f"was prepared (reservation {reservation}, now {world.reservation_of(copy.path, slot)})"
            )


def check_expiry(world: World, holder: str) -> None:
    """The store ends a live engine's lease only after a lease of silence: its own stalls
    (calls longer than `STALL_SECONDS`) do not count against the engine, which could not
    renew meanwhile (without that, every engine loses its pins and stock after a stall)."""
    live = any(engine.alive and m.holder == holder for engine in world.engines for m in engine.live_managers())
    heard = world.heard.get(holder)
    if not live or heard is None:
        return
    # The store's own long calls after it last heard from the engine (a stall that ended as
    # the engine registered gave its lease nothing: seed 50047 of the long run).
    stalled = sum(max(0.0, s.at + s.seconds - max(s.at, heard)) for s in world.stalls if s.seconds > STALL_SECONDS)
    silent = world.clock() - heard - stalled
    if silent < world.config.lease_seconds - 1e-6:
        world.violation(f"the store ended the lease of {holder} after {silent:.2f} s of its silence, less than a lease")


def check_wait(world: World, engine: SimEngine, req: Request) -> None:
    bound = getattr(world.kv_config.engine, "view_wait_steps", 3) + WAIT_SLACK_STEPS
    waited = engine.step_no - req.waiting_since
    # ... and, in time, the store's usual answer (pins.py: steps of an idle engine come fast)
    waited_s = world.clock() - req.waiting_since_t
    if waited > bound and waited_s > WAIT_SLACK_FACTOR * engine.manager._silence_seconds and engine.answers == req.replies_seen:
        world.violation(
            f"{engine.holder}: request {req.id} waited {waited} steps, {waited_s:.3f} s, on a store that has not answered"
        )


def known_slots(world: World, m) -> set[int]:
    """The slots manager `m` (an engine's, of one generation) knows the store holds for it
    (reserved or pinned), or will learn of: its own state, what it queued or sent, and
    answers on their way back to it."""
    slots: set[int] = set(m._stock) | set(m._storing.values()) | set(m._out_release) | set(m._out_unpin)
    slots.update(m._reset_pins)
    slots.update(getattr(m, "_reset_releases", ()))
    slots.update(slot for _, slot in m._to_hold)
    slots.update(slot for slot, _ in m._out_commit)
    slots.update(pin.slot for pin in m._pinned.values() if pin.epoch == m._epoch)
    for _, request, payload, *_ in m._inbox:
        slots.update(_request_slots(request))
        slots.update(getattr(payload, "reserved", ()) or ())
        slots.update((getattr(payload, "pinned", None) or {}).values())
    outbox = m._channel.outbox
    for request in (outbox.queued, outbox.sent):
        if request is not None:
            slots.update(_request_slots(request))
    for call in world.calls.values():
        if call.channel is m._channel and call.reply is not None and (call.awaited or call.state != "done"):
            slots.update(call.reply.reserved)
            slots.update(call.reply.pinned.values())
    session = world.store.control.session(m.holder)
    if session is not None and session.reply is not None and outbox.sent is not None and outbox.sent.rid == session.rid:
        slots.update(session.reply.reserved)  # applied, its answer lost: the resend brings it back
        slots.update(session.reply.pinned.values())
    return slots


def _request_slots(request) -> set[int]:
    return {*request.unpin, *request.release, *(s for s, _ in request.commit), *(s for _, s in request.hold)}


def check_holdings(world: World) -> None:
    """Every slot held for an engine is known to it, or released within one lease."""
    now = world.clock()
    lease = world.config.lease_seconds
    live = {m.holder: m for engine in world.engines if engine.alive for m in engine.live_managers()}
    known: dict[str, set[int]] = {}
    still: dict[tuple[str, int], float] = {}
    held = []
    for pool in world.store.arena.pools.values():
        held += [(slot, holder) for slot, holders in pool._pins.items() for holder in holders]
        held += list(pool._reserved.items())
    for slot, holder in held:
        if holder in INTERNAL:
            continue
        engine = live.get(holder)
        if engine is not None:
            if holder not in known:
                known[holder] = known_slots(world, engine)
            if slot in known[holder]:
                continue
        if engine is not None:
            since = world.unknown_since.get((holder, slot), now)
        else:  # a crashed engine: a lease from the last call of it the store got
            since = max(world.crashed.get(holder, now), world.heard.get(holder, float("-inf")))
        still[(holder, slot)] = since
        # A store expires leases at its calls: held past a lease at the last call is a leak.
        held_for = world.served_at - since
        if held_for > lease + world.stall_seconds_since(since) + 1.0:
            what = "a crashed engine" if engine is None else "an engine that does not know of it"
            world.violation(f"slot {slot} held for {holder} ({what}) for {held_for:.1f}s, more than a lease")
    world.unknown_since = still


def check_disk(world: World) -> None:
    """The disk index and its records agree, and every record is counted once: free,
    indexed, or being written (free + indexed + writing = allocated)."""
    disk = world.store.disk
    if disk is None:
        return
    with disk._lock:
        for namespace, slab in disk._slabs.items():
            free, indexed, writing = set(slab.free), set(slab.index.values()), set(slab.writing.values())
            allocated = slab.num_records - slab.growing
            counted = len(slab.free) + len(indexed | writing)
            if counted != allocated or len(free) != len(slab.free) or free & (indexed | writing):
                world.violation(
                    f"disk records of {namespace}: {len(slab.free)} free + {len(indexed)} indexed + "
                    f"{len(writing - indexed)} being written != {allocated} allocated"
                )
            for key, record in slab.index.items():
                if slab.key_of.get(record) != key:
                    world.violation(f"disk index of {namespace}: {key_name(key)} -> record {record}, which names another key")
            if len(slab.key_of) != len(slab.index):
                world.violation(f"disk index of {namespace}: {len(slab.key_of)} records named, {len(slab.index)} indexed")


def check_purges(world: World) -> None:
    """Once a purge's work in flight has run, nothing of its namespace is left in any tier
    (a weight update purges the old namespace: engines moved on to the new one)."""
    settled = [watch for watch in world.purges if not watch.jobs]
    if not settled:
        return
    world.purges = [watch for watch in world.purges if watch.jobs]
    unsettled = {watch.namespace for watch in world.purges}
    store = world.store
    for namespace in {watch.namespace for watch in settled} - unsettled:
        if namespace in world.namespaces:
            continue  # an engine's reset purged the namespace it still serves: new chunks are its own
        pool = store.arena.pools.get(namespace)
        left = {"arena": len(pool) if pool is not None else 0}
        if store.disk is not None:
            left["disk"] = len(store.disk.keys(namespace))
        if store.object is not None:
            left["bucket"] = len(store.object.list_keys(namespace) or ())
        for tier, count in left.items():
            if count:
                world.violation(f"after a purge of {namespace} settled, the {tier} still holds {count} of its chunks")


def check_world(world: World) -> None:
    check_holdings(world)
    check_hints(world)
    check_disk(world)
    check_purges(world)
