"""kvstrata's KV events as a router receives them: the manager's `OffloadingEvent`s turned
into vLLM's `BlockStored` / `BlockRemoved` by vLLM's own `OffloadingEventsTracker` (what
the connector publishes on its ZMQ stream). A chunk held by another node is announced
as remote storage, never as this node's host memory; fetched into the arena it becomes
`CPU`/`LOCAL`; when the other node drops it, its announcement is withdrawn."""

from __future__ import annotations

import numpy as np
import pytest

from kvstrata.actors.directory import holder_label
from kvstrata.connector.compat import Locality, LookupResult, make_event
from kvstrata.connector.kv_events import TIER_EVENTS, event_fields
from kvstrata.tiers.changelog import CPU
from tests.connector.harness import SLOT, step
from tests.connector.test_peer_tier import PEER_NODE, engine, held_elsewhere, load  # noqa: F401 - the fixture
from tests.utils import key


def published(events) -> list:
    """What vLLM's connector publishes for these manager events (vLLM's tracker: 0.32+)."""
    events_module = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.offloading.events")
    OffloadingEventsTracker = events_module.OffloadingEventsTracker
    from vllm.v1.kv_offload.base import OffloadingKVEventsConfig

    tracker = OffloadingEventsTracker(OffloadingKVEventsConfig(enable_kv_cache_events=True, self_describing_kv_events=False))
    return list(tracker.take_events(events))


def test_no_tier_but_the_arena_claims_to_be_this_node_s_host_memory():
    for tier, fields in TIER_EVENTS.items():
        event = make_event([key(1)], removed=False, medium=tier)
        assert (event.medium.value, event.ownership) == (fields.medium, fields.ownership)
        if Locality is not None:
            assert event.locality.value == fields.locality
        assert (fields.medium == "CPU" and fields.locality == "LOCAL") == (tier == CPU)
    assert event_fields("CPU").ownership is None  # vLLM's primary tier: its tracker pairs stores and removals on it
    with pytest.raises(ValueError, match="no KV-event mapping for tier 'GPU'"):
        event_fields("GPU")


def test_the_stream_follows_a_chunk_from_another_node_into_the_arena_and_out_of_the_peer(engine):  # noqa: F811
    store, manager, peer_store = engine
    manager.take_events()  # what registering announced
    chunks = {key(i): np.random.default_rng(i).integers(0, 256, SLOT, dtype=np.uint8) for i in range(2)}
    held_elsewhere(store, manager, peer_store, chunks)
    assert load(store, manager, list(chunks)) == [LookupResult.HIT] * 2
    changes = [(k, holder_label(PEER_NODE, CPU), False) for k in chunks]  # the other node evicted them
    store.peers._apply(0, "directory-epoch", {manager.namespace: (99, changes, False)}, dict(store.ctx.logs))
    step(manager)

    held: dict[tuple, set[int]] = {}
    for event in published(manager.take_events()):
        tier = (event.medium, event.locality, event.ownership)
        hashes = set(event.block_hashes)
        if type(event).__name__ == "BlockRemoved":
            assert hashes <= held.get(tier, set()), f"{tier} withdrew what it never announced"
            held[tier] -= hashes
        else:
            held.setdefault(tier, set()).update(hashes)
    locality = (lambda name: name) if Locality is not None else (lambda name: None)
    in_arena = held[("CPU", locality("LOCAL"), None)]
    assert len(in_arena) == 2  # fetched: now this node's
    assert held[("STORAGE", locality("REMOTE"), "kvstrata-peer")] == set()  # announced, then withdrawn
    assert not any(medium == "CPU" and owner == "kvstrata-peer" for medium, _, owner in held)
