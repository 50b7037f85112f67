"""Fixed interleavings of an engine whose first manager is built off its start path
(connector/deferred_start.py, issue #50 item 4) that random runs reach too rarely for the
CI budget of the mutation check (mutants.py). Written as scenarios.py's are (script.py)."""

from __future__ import annotations

from collections.abc import Callable

from kvstrata._dev.sim.scenarios_fixes import reached
from kvstrata._dev.sim.script import QUIET, Script, run
from kvstrata._dev.sim.world import SimConfig


def reset_while_the_fingerprint_is_read() -> list[str]:
    """Mutant `deferred-start-reset-starts-the-generation`. Engine 0 starts serving while
    its weights are fingerprinted; a connector reset comes before the fingerprint lands
    (the weights may have changed in place: here they did, as `WeightGenerations` assumes).
    The manager built for the checkpoint's namespace must not be used: engine 1, on the
    checkpoint's weights in that namespace, would load engine 0's new-weights chunks as
    its own (a HIT on other bytes)."""

    def story(s: Script) -> None:
        engine = s.w.engines[0]
        reached(engine.manager.starting and bool(engine.identity_builds), "a reset while the first manager is built")
        s.do("reset", 0)
        s.do("identity", 0)
        s.step(0)  # the hand-over, at the step's end
        s.settle(0)
        s.store_prompt(0, 3)
        s.jobs()
        s.acknowledge(1)  # engine 1's view: what is in its namespace now
        s.store_prompt(1, 3)  # engine 1's lookups of the same prompt: a HIT would be engine 0's bytes
        s.jobs()

    config = SimConfig(engines=2, arena_slots=32, reserve_slots=4, generations=(True, False), deferred=(True, False), **QUIET)
    return run(config, story)


START: dict[str, Callable[[], list[str]]] = {
    "reset-while-the-fingerprint-is-read": reset_while_the_fingerprint_is_read,
}
