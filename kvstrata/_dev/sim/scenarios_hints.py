"""Fixed interleavings for the fixes of issue #51's findings 4-12 that random runs do not
reach within the CI budget (the mutation check, mutants.py): each drives the real manager,
store and tiers through the one situation the fix is about, keeps every invariant on the
fixed code, and violates the one its story names with the fix reverted by one line.

Written as scenarios.py's are (script.py): a story of named actions over a world.
"""

from __future__ import annotations

from collections.abc import Callable

from kvstrata._dev.sim.scenarios_fixes import reached
from kvstrata._dev.sim.script import QUIET, Script, run
from kvstrata._dev.sim.world import SimConfig


def hybrid_disk_batch_evicts_several() -> list[str]:
    """#51 finding 12 (mutant `disk-eviction-skips-dropped-dependents`). A hybrid model
    (group 1, a sliding window, anchored on group 0) writes through to a disk of 9 records;
    each prompt's commit is one write batch of up to 12 chunks, so the batch evicts several
    positions: evicting an anchor drops its dependent too, and the eviction order must not
    hand out that dependent's record again (with no reuse sketch: `admission.store.disk:
    always`; the sketch's eviction order checks each record again). Handed out, the disk's allocation raises
    KeyError in the cascade's job (the batch's records leak, the namespace's disk tier
    empties for good): a background job's exception, and records no longer accounted."""

    def story(s: Script) -> None:
        for prompt in (5, 1, 2, 9, 10, 3):  # 6, 5, 5, 4, 4 and 2 positions: a batch each
            s.store_prompt(0, prompt)
            s.jobs()
        disk = s.w.store.disk.stats()
        reached(disk["evicted_with_anchor"] >= 2, "write batches that evict several anchored positions")

    config = SimConfig(
        engines=1, arena_slots=32, reserve_slots=4, disk_records=9, anchors=True, disk_admission="always",
        **dict(QUIET, disk_policy="write_through"),
    )
    return run(config, story)


HINTS: dict[str, Callable[[], list[str]]] = {
    "hybrid-disk-batch-evicts-several": hybrid_disk_batch_evicts_several,
}
