"""Fixed interleavings that reproduce the findings of issue #37, as simulation actions.

Each scenario builds a world, drives it through one timing that used to hand an engine
another chunk's bytes (or leak a slot, or hold a request), and returns the violations the
world's checks recorded: none on a protocol that is safe by construction. They are written
out rather than drawn from a seed so each reads as the story the issue tells; the random
runs (`explore.py`) find their kin. `SCENARIOS` also holds those of scenarios_fixes.py
(the protocol fixes random runs miss) and of scenarios_hints.py (issue #51's fixes random
runs miss); the stories are written with script.py.
"""

from __future__ import annotations

from collections.abc import Callable

from kvstrata._dev.sim.scenarios_fixes import FIXES
from kvstrata._dev.sim.scenarios_hints import HINTS
from kvstrata._dev.sim.scenarios_start import START
from kvstrata._dev.sim.script import QUIET, Script
from kvstrata._dev.sim.script import run as _run
from kvstrata._dev.sim.world import SimConfig


def unpin_overtakes_hold() -> list[str]:
    """Finding 1. Engine 0's pin of K at slot X goes idle: the call carrying `unpin X` times
    out. Meanwhile a new request HITs K from the mirror (still at X) and its `hold (K, X)`
    queues behind. If the failed call's unpin goes out again *after* the hold, the store
    ends with X unpinned under the new request's load; pressure evicts K, X is reused, and
    the load reads the new owner's bytes."""

    def story(s: Script) -> None:
        w = s.w
        s.store_prompt(0, 0)
        s.do("arrive", 0, 0)
        s.step(0)  # request a: HIT from the mirror, its hold pins X
        s.land(0)
        s.step(0, settle=False)  # a's load reported: its pin is idle, `unpin X` queued
        assert s.do("send", 0)  # ... and sent: call R2 (unpin X)
        s.do("arrive", 0, 0)
        s.step(0, settle=False)  # request b: HIT from the mirror, `hold (K, X)` queued (R3)
        assert s.do("timeout", 0, 0)  # R2 times out (the store may still apply it later)
        s.settle(0)  # what the channel sends now, and after
        s.step(0, settle=False)
        s.settle(0)
        s.reuse(0)  # pressure: K evicted if nothing pins X, X reused and overwritten
        s.land(0)  # b's load reads X

    return _run(SimConfig(engines=1, arena_slots=8, reserve_slots=2, **QUIET), story)


def stale_mirror_after_lease() -> list[str]:
    """Finding 2, the engine's side. Engine 0 stores K and then falls silent for longer than
    a lease (paused) while engine 1 keeps the store busy: the store expires engine 0's lease
    and forgets it as a watcher, so K's slot can be reused at once. Engine 0 resumes and a
    new request finds K in its mirror: answering HIT there reads the new owner's bytes."""

    def story(s: Script) -> None:
        w = s.w
        s.store_prompt(0, 0)
        s.do("pause", 0, 6000)
        for _ in range(10):  # engine 1 keeps calling: the store expires engine 0's lease
            s.tick(0.5)
            s.round_trip(1)
        s.reuse(1)  # K's slot reused and overwritten
        s.tick(1.5)  # engine 0 resumes, its mirror as it was
        s.do("arrive", 0, 0)
        s.step(0, settle=False)

    return _run(SimConfig(engines=2, arena_slots=8, reserve_slots=2, **QUIET), story)


def store_stall_expires_leases() -> list[str]:
    """Finding 2, the store's side. Engine 0 HITs K and prepares its load; the store is busy
    in one call for longer than a lease (a purge wiping a large disk tier under its lock).
    The next call, engine 1's, used to find engine 0's lease run out and free K's slot under
    the load in flight: the store's own stall counted against the engines."""

    def story(s: Script) -> None:
        w = s.w
        s.store_prompt(0, 0)
        s.do("arrive", 0, 0)
        s.step(0)  # HIT; its hold pins the slot; the load is in flight
        s.do("stall", 5000)
        s.reuse(1)  # engine 1's calls come first: K's slot is reused if engine 0's lease ran out
        s.land(0)

    return _run(SimConfig(engines=2, arena_slots=8, reserve_slots=2, **QUIET), story)


def lost_reply_leaks_reservations() -> list[str]:
    """Finding 6, leaks. The store reserves slots for engine 0 and the answer is lost: the
    engine never learns of them, asks again, and the store holds both reservations for as
    long as the engine lives."""

    def story(s: Script) -> None:
        w = s.w
        s.do("arrive", 0, 5)
        s.step(0, settle=False)  # its stores take the stock
        s.step(0, settle=False)  # a refill goes out
        assert s.do("send", 0)
        s.deliver(0)
        assert s.do("lose", 0, 0)  # applied, its answer lost
        for _ in range(24):  # the engine lives on, calling the store
            s.tick(0.3)
            s.step(0)
            s.land(0)

    return _run(SimConfig(engines=1, arena_slots=16, reserve_slots=4, **QUIET), story)


def lost_registration_locks_out() -> list[str]:
    """Finding 6, lock-outs. Engine 0's lease ran out; it registers again, the store binds a
    new token and the answer is lost. Registering again with what it knows (the old token)
    was refused as "already registered by another engine" for a whole lease."""

    def story(s: Script) -> None:
        w = s.w
        s.store_prompt(0, 0)
        s.do("pause", 0, 6000)
        for _ in range(10):
            s.tick(0.5)
            s.round_trip(1)
        s.tick(1.5)
        s.do("lose_registration", 0)
        for _ in range(6):  # refused: it registers again (answer lost), then again
            s.tick(0.3)
            if s.do("send", 0):
                s.deliver(0)
                s.do("answer", 0, 0)
            s.step(0, settle=False)

    return _run(SimConfig(engines=2, arena_slots=16, reserve_slots=2, **QUIET), story)


def stalled_store_holds_requests() -> list[str]:
    """Finding 7. Engine 0's call hangs in a stalled store; its view of the store ages past
    `max_view_age_seconds`, so a new request's lookups wait for a fresher one: up to
    `lookup_wait_seconds`, every step of that time, instead of a few steps."""

    def story(s: Script) -> None:
        w = s.w
        s.tick(0.2)
        s.do("arrive", 0, 3)
        s.step(0, settle=False)
        assert s.do("send", 0)  # the call hangs: the store never answers it
        for _ in range(30):
            s.tick(0.02)
            s.do("arrive", 0, 4)
            s.step(0, settle=False)

    return _run(SimConfig(engines=1, arena_slots=16, reserve_slots=2, **QUIET), story)


def generation_retires_before_flush() -> list[str]:
    """Issue #51, finding 1. Engine 0 runs vLLM 0.32's order under `WeightGenerations`: a
    request HITs K and its load is in flight (a late copy) when a connector reset starts a
    new generation. vLLM flushes that load during the next step's execution; the old
    generation must keep K's slot pinned until that step has ended. Retired right after the
    step's schedule (its `release_holder`), the slot goes back, another node's burst takes
    and overwrites it, and the load reads the new owner's bytes."""

    def story(s: Script) -> None:
        s.store_prompt(0, 0)
        s.do("arrive", 0, 0)
        s.step(0)  # HIT from the mirror: the hold pins K's slot, the load is in flight
        s.do("reset", 0)
        s.settle_all(0)
        s.step(0, settle=False)  # the step whose execution flushes the load
        s.settle_all(0)
        while s.do("retire", 0, 0):  # the old generation's retiring thread, if it was started
            pass
        s.tick(0.05)
        s.do("crowd", s.w.config.arena_slots)
        s.land(0)

    config = SimConfig(engines=1, arena_slots=8, reserve_slots=2, generations=(True,), copy_steps=5, copy_seconds=1.5, **QUIET)
    return _run(config, story)


def request_spans_weight_update() -> list[str]:
    """Issue #51, finding 3. A request of engine 0 (`WeightGenerations`) has computed its
    chunks with the old weights and still runs when a connector reset (a weight update)
    comes; vLLM 0.32 offloads a running request's chunks again after the reset, from
    chunk 0. Stored in the new generation, they are the old weights' KV under the new
    weights' name: the next request of that prompt HITs them."""

    def story(s: Script) -> None:
        s.do("arrive", 0, 5)
        s.step(0)  # computed with the old weights, its stores prepared
        s.land(0)
        s.do("reset", 0)  # the request still runs
        s.settle_all(0)  # the new generation registered, its stock reserved
        s.tick(0.05)
        s.settle_all(0)
        s.step(0)  # its chunks offloaded again, into the new generation if nothing stops it
        s.land(0)
        s.step(0)
        s.settle_all(0)
        s.do("arrive", 0, 5)
        s.step(0)
        s.land(0)

    config = SimConfig(engines=1, arena_slots=16, reserve_slots=4, generations=(True,), **QUIET)
    return _run(config, story)


def late_commit_after_purge() -> list[str]:
    """The long run's finding (seed 1220, fixed in f85075c). Engine 0 stores a prompt's
    chunks; the call carrying their commits is sent and the engine crashes before the
    store applies it. A weight update moves the engines to a new namespace and purges the
    old one. Then Ray delivers the crashed engine's call: its commits are of chunks
    stored before the purge, and indexing them puts the purged namespace's chunks back."""

    def story(s: Script) -> None:
        s.do("arrive", 0, 2)
        s.step(0)  # computed: its stores prepared
        s.land(0)
        s.step(0, settle=False)  # complete_store: the commits queued
        assert s.do("send", 0)  # ... and sent, not applied yet
        s.do("crash", 0)
        s.do("update_weights")
        s.do("deliver", 0, 0)  # the crashed engine's call, applied after the purge
        s.jobs()

    config = SimConfig(engines=1, arena_slots=16, reserve_slots=4, purge_and_disk_races=True, **QUIET)
    return _run(config, story)


SCENARIOS: dict[str, Callable[[], list[str]]] = {
    "late-commit-after-purge": late_commit_after_purge,
    "generation-retires-before-flush": generation_retires_before_flush,
    "request-spans-weight-update": request_spans_weight_update,
    "unpin-overtakes-hold": unpin_overtakes_hold,
    "stale-mirror-after-lease": stale_mirror_after_lease,
    "store-stall-expires-leases": store_stall_expires_leases,
    "lost-reply-leaks-reservations": lost_reply_leaks_reservations,
    "lost-registration-locks-out": lost_registration_locks_out,
    "stalled-store-holds-requests": stalled_store_holds_requests,
    **FIXES,
    **HINTS,
    **START,
}
