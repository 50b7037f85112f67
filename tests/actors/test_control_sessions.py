"""The store's side of the control protocol (issue #37), in-process: each request id of an
engine is applied once (a repeat gets the answer kept for it, an older id nothing), an
engine registering again is known by its nonce, and a call during which the store stalled
does not count against the engines' leases."""

from __future__ import annotations

import pytest

from kvstrata.store.node_store import NodeStore
from kvstrata.protocol import StepRequest
from kvstrata.config import load_config
from tests.utils import FakeClock, store_config

SLOT = 4096
NS = "sessions-ns"


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def store(tmp_path, clock):
    node_store = NodeStore(load_config(store_config(tmp_path, capacity=16 * SLOT, lease_seconds=10)), "node0", clock=clock)
    yield node_store
    node_store.close()


def register(store, holder, nonce="n1", epoch=""):
    return store.register(holder, NS, SLOT, None, True, epoch, nonce).epoch


def test_a_repeated_request_id_gets_the_kept_answer_and_is_applied_once(store):
    epoch = register(store, "engine")
    request = StepRequest("engine", NS, epoch=epoch, reserve=3, rid=1)
    first = store.step(request)
    again = store.step(request)  # sent again: the answer was lost
    assert again is first and len(first.reserved) == 3
    assert store.arena.pools[NS].holdings("engine") == (0, 3)  # not reserved twice


def test_an_older_request_id_is_applied_never(store):
    epoch = register(store, "engine")
    store.step(StepRequest("engine", NS, epoch=epoch, reserve=1, rid=1))
    store.step(StepRequest("engine", NS, epoch=epoch, rid=2))
    late = store.step(StepRequest("engine", NS, epoch=epoch, reserve=5, rid=1))  # Ray ran it late
    assert late.stale and not late.reserved
    assert store.arena.pools[NS].holdings("engine") == (0, 1)


def test_a_late_call_does_not_renew_the_lease_of_an_engine_that_is_gone(store, clock):
    epoch = register(store, "engine")
    store.step(StepRequest("engine", NS, epoch=epoch, reserve=1, rid=2))
    register(store, "other")
    clock.advance(9)
    store.step(StepRequest("engine", NS, epoch=epoch, rid=1))  # stale: no sign of life
    clock.advance(2)
    store.step(StepRequest("other", NS, epoch=store._holders["other"]))
    assert "engine" not in store._holders


def test_registering_again_with_the_same_nonce_gets_the_same_binding(store):
    first = register(store, "engine", nonce="mine")
    assert register(store, "engine", nonce="mine") == first  # (its first answer was lost)
    with pytest.raises(ValueError, match="already registered by another engine"):
        register(store, "engine", nonce="someone-else")


def test_a_call_during_which_the_store_stalled_does_not_count_against_leases(store, clock):
    """A purge wiping a large disk tier under the store's lock, a hung disk read: no engine
    could renew meanwhile, so the stall is given back to every lease."""
    epoch = register(store, "engine")
    store.step(StepRequest("engine", NS, epoch=epoch, reserve=2))
    with store.serving():
        clock.advance(35)  # 3.5 leases inside one call
    register(store, "other")
    assert store._holders.get("engine") == epoch
    assert store.arena.pools[NS].holdings("engine") == (0, 2)


def test_silence_outside_the_stores_calls_still_ends_a_lease(store, clock):
    register(store, "engine")
    clock.advance(11)
    register(store, "other")
    assert "engine" not in store._holders


def test_commits_sent_before_the_engine_heard_of_a_purge_are_not_indexed_after_it(store):
    """A call carrying commits of chunks stored before a purge, applied after it (Ray ran it
    late; its engine crashed): the chunks stay out of every tier, and the slots stay the
    engine's pins. Once the engine has an answer from after the purge, its commits count
    again (found by the simulation's long run: seed 1220, a crashed engine's call delivered
    after a weight update's purge)."""
    epoch = register(store, "engine")
    first, second = store.step(StepRequest("engine", NS, epoch=epoch, reserve=2, rid=1)).reserved
    store.purge(NS)  # `kvstrata purge`, or another engine's reset
    late = store.step(StepRequest("engine", NS, epoch=epoch, commit=[(first, b"k-before")], rid=2))
    pool = store.arena.pools[NS]
    assert not late.rejected and b"k-before" not in pool and len(pool) == 0
    assert pool.holdings("engine") == (1, 1)  # the engine's pin of the slot it wrote
    store.step(StepRequest("engine", NS, epoch=epoch, commit=[(second, b"k-after")], rid=3))
    assert pool.lookup(b"k-after") == second
