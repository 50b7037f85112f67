"""The manager's metrics: their names and documentation, and the stats vLLM collects.

`StrataSpec.build_metric_definitions` declares every name here to vLLM (in the API
server, where no manager exists); the manager counts into a dict keyed by
`COUNTER_NAMES` and hands vLLM each counter's growth since it last asked (every
counter at its first report, zeros included, so each has a series from the start).

Invariants: a counter only grows, and each unit of growth is reported exactly once;
a name reaches vLLM only through `metric_name`, so declared and reported names agree.

This module knows nothing of the manager's state: it must not import it, nor call the
store.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # vLLM is imported by `take_stats` only: the names above are read without it (scripts/gen_docs.py)
    from kvstrata.connector.compat import OffloadingConnectorStats

COUNTER_NAMES = {
    "chunks_loaded": "Chunks loaded from the kvstrata node arena into the KV cache.",
    "chunks_stored": "Chunks written into the kvstrata node arena and committed.",
    "stores_dropped_no_slot": "Chunks not stored because no reserved arena slot was free.",
    "stores_failed": "Chunk stores the engine reported as failed.",
    "pins_missed": "Chunks believed resident that were gone when the pin arrived (misses).",
    "chunks_promoted": "Hits that waited for the node store to bring the chunk from disk into the arena.",
    "control_failures": "Control calls to the node store that failed or timed out.",
    "lookups_timed_out": "Lookups answered MISS because the store did not pin the chunk, or refresh a stale view, within lookup_wait_seconds.",
    "lookups_retried": "Lookups answered RETRY: the request waits a step for the store (promotion, a stale view).",
    "hits_without_round_trip": "Arena-resident chunks answered HIT at their first lookup, with no store call.",
    "holds_refused": "HITs whose pin the node store refused (never expected; each is logged).",
    "loads_skipped_disk": "Chunks on the node's disk recomputed because loading them was slower (admission.load).",
    "loads_skipped_peer": "Chunks on another node recomputed because loading them was slower (admission.load).",
    "loads_skipped_object": "Chunks in the object store recomputed because loading them was slower (admission.load).",
    "chunks_probed": "Lower-tier chunks promoted in the background, no request waiting, to measure a tier with no "
    "estimate yet or one gone stale while it still said recompute (admission.load).",
    "requests_waited_then_recomputed": "Requests that waited lookup_wait_seconds for chunks and then recomputed "
    "them anyway (the stall admission.load avoids; expected 0).",
    "requests_hit_at_first_lookup": "Requests whose first lookup found their first chunk in the node arena (a HIT, no wait).",
    "requests_retried_at_first_lookup": "Requests whose first lookup waited (RETRY) for a chunk being promoted or a fresher view.",
    "requests_missed_at_first_lookup": "Requests whose first lookup found nothing kvstrata could serve (MISS).",
    "hints_sent": "KV hint actions (kv.prefetch, kv.retain, pin, unpin) sent to the node store.",
    "hints_dropped": "KV hint actions dropped: malformed, unsupported on this vLLM, or not deliverable (logged once per kind).",
    "lookups_store_silent": "Lookups answered MISS after view_wait_steps of the engine's steps, and 8 of the store's "
    "usual round trips, waiting on a store that did not answer meanwhile.",
    "lease_unproven": "Chunks not stored because the engine's last answer from the store was older than half a "
    "lease (its reserved slots may have gone to another engine).",
    "lookups_before_cache_on": "Lookups answered MISS because kvstrata was not on yet for this engine (the weights' "
    "fingerprint of a large checkpoint, computed while the engine serves).",
    "stores_skipped_before_cache_on": "Chunks not stored because kvstrata was not on yet for this engine (the "
    "weights' fingerprint of a large checkpoint, computed while the engine serves).",
    "lookups_cache_off": "Lookups answered MISS because kvstrata is off for this engine: its attention cannot "
    "compute over a loaded prefix (vLLM's CPU MLA backend), so a hit would be a wrong answer.",
}
GAUGE_NAMES = {
    "reserved_slots": "Free arena slots reserved by this engine for upcoming stores.",
    "pinned_chunks": "Arena chunks pinned by this engine.",
    "recompute_tokens_per_second": "This engine's prefill rate that admission.load weighs loads against: "
    "configured, else measured from its steps (0 until measured).",
}


def metric_name(name: str) -> str:
    return f"kvstrata:{name}"


def take_stats(counters: dict[str, int], reported: dict[str, int], gauges: dict[str, int]) -> OffloadingConnectorStats:
    """vLLM's stats since the last call: each counter's growth since `reported` (which
    is brought up to date), and the gauges (`GAUGE_NAMES`) as they are now.

    A counter absent from `reported` (start with it empty) is reported even at zero:
    vLLM creates a Prometheus series only for a name it is sent, so without this a
    counter that never grew (`stores_failed`, ...) would have no sample on `/metrics`
    and `rate()` or an alert on it would see nothing instead of 0.
    """
    from kvstrata.connector.compat import OffloadingConnectorStats

    stats = OffloadingConnectorStats()
    for name, value in counters.items():
        previous = reported.get(name)
        if previous is None or value != previous:
            stats.increase_counter(metric_name(name), value - (previous or 0))
            reported[name] = value
    for name, value in gauges.items():
        stats.set_gauge(metric_name(name), value)
    return stats
