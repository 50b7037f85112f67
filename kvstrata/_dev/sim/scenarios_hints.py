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


def retention_share_before_the_tenant_is_known() -> list[str]:
    """Found by the 10^7-event run (seed 124, shrunk to these 8 actions; mutant
    `retention-share-of-unknown-tenants`). The store restarts; engine 0 resets (a new
    generation: its namespace registers at once, its tenant known) while engine 1's
    namespace is not registered again yet. Both send `kv.retain` hints: engine 1's were
    admitted against no tenant's share, and once its namespace registered the one tenant
    held 13 retentions of a share of 12."""

    def story(s: Script) -> None:
        for action in (("restart",), ("reset", 0), ("hint", 0, 2, 14, 812), ("hints",), ("hint", 0, 3, 2, 906),
                       ("hint", 1, 3, 5, 511), ("hints",), ("hints",)):  # fmt: skip
            s.do(*action)
        reached(len(s.w.store.hints._retention) >= 12, "retentions from two namespaces of one tenant")

    config = SimConfig(
        engines=2, arena_slots=24, disk_records=16, disk_policy="write_back", object_policy="write_through",
        reserve_slots=4, flush_signal=(True, False), purge_and_disk_races=True, generations=(True, False),
        async_scheduling=(False, True), hints=True,
    )  # fmt: skip
    return run(config, story)


HINTS: dict[str, Callable[[], list[str]]] = {
    "hybrid-disk-batch-evicts-several": hybrid_disk_batch_evicts_several,
    "retention-share-before-the-tenant-is-known": retention_share_before_the_tenant_is_known,
}
