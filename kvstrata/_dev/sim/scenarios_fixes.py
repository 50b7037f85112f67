"""Fixed interleavings for the protocol fixes of 7659a2b that random runs do not reach
within the CI budget (the mutation check, mutants.py): each drives the real manager and
store through the one timing the fix is about, and keeps every invariant on the fixed
code; with the fix reverted by one line it violates the invariant its story names.

Written as scenarios.py's are (script.py): a story of named actions over a world.
"""

from __future__ import annotations

from collections.abc import Callable

from kvstrata._dev.sim.script import QUIET, Script, run
from kvstrata._dev.sim.world import SimConfig


def reached(condition: bool, timing: str) -> None:
    """The story still reaches the timing it is about (code that moved can make a story
    pass for want of its race: an error then, never a silent pass)."""
    if not condition:
        raise AssertionError(f"the scenario no longer reaches its timing: {timing}")


def reset_releases_stores_in_flight() -> list[str]:
    """#37 finding 5 (mutant `reset-keeps-store-slots-until-flushed`). Engine 0 (vLLM
    0.32's order) prepares the stores of a request; their copies are still running (late
    copies) when a connector reset comes. vLLM flushes them during the step after the
    reset: their slots must stay reserved for engine 0 until that step has ended. Released
    with the first request after the reset, they go back to the pool and are handed out
    again (to the same request's refill of engine 0's stock, or to another node's burst)
    while the flushed copies still write them (the store-write invariant: a worker writes
    only slots reserved for its engine, under the very reservation it was prepared in)."""

    def story(s: Script) -> None:
        s.do("arrive", 0, 5)
        s.step(0)  # computed: its stores prepared, their copies in flight
        s.do("reset", 0)
        s.step(0)  # the step whose execution flushes them: its request goes out
        in_flight = [copy for copy in s.w.copies.values() if copy.kind == "store"]
        reached(bool(in_flight), "store copies in flight after the flush step")
        s.do("crowd", s.w.config.arena_slots)  # another node's burst: every free slot, overwritten
        s.land(0)  # the flushed copies land

    config = SimConfig(engines=1, arena_slots=16, reserve_slots=4, copy_steps=5, copy_seconds=1.5, **QUIET)
    return run(config, story)


def unpin_merged_with_a_new_hold() -> list[str]:
    """Counted pins (mutant `counted-pins`). Request a of engine 0 HITs K and loads it; once
    its load is reported, K's pin is idle and its unpin is queued -- and not sent yet (the channel is
    slow). Request b HITs K from the mirror in the next step: its hold joins the queued
    request, so the store gets `hold (K, X)` and `unpin X` in one call, hold first: two
    pins of engine 0 on X, then one undone. Counted, b's pin stays; uncounted, the unpin
    drops both, pressure evicts K and reuses X, and b's load (a late copy) reads another
    chunk's bytes."""

    def story(s: Script) -> None:
        s.store_prompt(0, 0)
        s.do("arrive", 0, 0)
        s.step(0)  # a: HIT from the mirror; its hold pins X; its load in flight
        s.land(0)
        s.step(0, settle=False)  # a's load reported: its pin idle, `unpin X` queued (not sent)
        s.do("arrive", 0, 0)
        s.step(0, settle=False)  # b: HIT from the mirror, `hold (K, X)` merged into the queued request
        queued = s.w.engines[0].current._channel.outbox.queued
        merged = queued is not None and queued.unpin == [slot for _, slot in queued.hold]
        reached(merged, "a hold and an unpin of one slot in one call")
        s.settle(0)  # one call: hold, then unpin
        s.reuse(0)  # pressure: K evicted if nothing pins X, X reused and overwritten
        s.land(0)  # b's load reads X

    config = SimConfig(engines=1, arena_slots=8, reserve_slots=2, copy_steps=5, copy_seconds=1.5, **QUIET)
    return run(config, story)


def pre_reset_answer_fills_the_mirror() -> list[str]:
    """Answers to requests built before a reset (mutant `pre-reset-answers-add-nothing`).
    Engine 0 stores a prompt's chunks; the request carrying their commits is applied, and
    its answer (K now in the arena, at slot X) is on its way when a connector reset comes:
    the weights changed in place (`reset_weights`), so nothing from before may be served.
    Applied as any answer, it puts K back into the mirror the reset cleared, and the next
    request of that prompt HITs the old weights' bytes (the HIT invariant)."""

    def story(s: Script) -> None:
        s.do("arrive", 0, 0)
        s.step(0)  # computed: its stores prepared
        s.land(0)
        s.step(0, settle=False)  # complete_store: the commits queued
        assert s.do("send", 0)
        s.deliver(0)  # applied: K indexed at X; the answer on its way
        s.do("reset", 0)  # the weights change in place
        manager = s.w.engines[0].current
        sent = manager._channel.outbox.sent
        reached(sent is not None and sent.resets < manager._resets, "an answer to a request built before the reset")
        assert s.do("answer", 0, 0)
        s.do("arrive", 0, 0)
        s.step(0)  # its lookups: K from the mirror, if the old answer filled it

    config = SimConfig(engines=1, arena_slots=16, reserve_slots=4, reset_weights=True, **QUIET)
    return run(config, story)


def pin_arrives_while_storing() -> list[str]:
    """A pin that arrives while its chunk is being stored (mutant `pin-while-storing-kept`,
    found by the simulation before 7659a2b). Engine 1 stores prompt P; engine 0, its last
    answer older than half a lease, may not HIT P's chunks from its mirror and asks the
    store to pin them; the request waits behind a heartbeat in flight. Engine 1 resets:
    the purge empties the namespace, and the heartbeat's answer tells engine 0 the chunks
    are gone, so its request misses them, computes and stores them. Engine 1 stores P again;
    then engine 0's pin request is applied: granted. The pin reaches engine 0 while it is
    storing the same chunks: replaced by the writer's pin at the commit, the store's pin on
    the other slot is forgotten and held for engine 0 for as long as it lives (the leak
    invariant: held a lease, unknown to the engine)."""

    def story(s: Script) -> None:
        s.store_prompt(1, 0)
        s.tick(0.25)
        s.round_trip(0)  # engine 0's mirror: P's chunks in the arena
        s.tick(2.1)  # engine 0's last answer is older than half a lease
        assert s.do("send", 0)  # its heartbeat, in flight
        s.do("arrive", 0, 0)
        s.step(0, settle=False)  # no HIT without the lease proof: pins asked for, queued
        s.do("reset", 1)
        s.step(1)  # its purge empties the namespace
        s.jobs()
        s.deliver(0)
        assert s.do("answer", 0, 0)  # the heartbeat's answer: P's chunks are gone
        s.step(0, settle=False)  # engine 0 misses them: computed, its stores prepared (pins still queued)
        s.store_prompt(1, 0)  # engine 1 stores P again
        s.settle(0)  # engine 0's pins granted, on engine 1's slots
        s.step(0)  # the pins applied (the request finished)
        manager = s.w.engines[0].current
        reached(bool(set(manager._storing) & set(manager._pinned)), "a pin granted while its chunk is being stored")
        s.land(0)
        s.step(0)  # complete_store of the pinned chunks
        for _ in range(12):  # both engines live on for a lease and more
            s.tick(0.5)
            s.step(0)
            s.step(1)
            s.settle(0)
            s.settle(1)

    config = SimConfig(engines=2, arena_slots=16, reserve_slots=4, **QUIET)
    return run(config, story)


FIXES: dict[str, Callable[[], list[str]]] = {
    "reset-releases-stores-in-flight": reset_releases_stores_in_flight,
    "unpin-merged-with-a-new-hold": unpin_merged_with_a_new_hold,
    "pre-reset-answer-fills-the-mirror": pre_reset_answer_fills_the_mirror,
    "pin-arrives-while-storing": pin_arrives_while_storing,
}
