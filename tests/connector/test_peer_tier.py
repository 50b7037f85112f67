"""Chunks held by another node, seen from the engine: the `PEER` medium in the mirror,
RETRY while the store fetches, then a HIT reported as peer-to-peer; a failed fetch is a
MISS. In-process store with a stand-in for the cluster link (the real one is exercised
on a simulated cluster in tests/actors/test_multinode.py)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from kvstrata.actors.node_store import LocalStoreClient, NodeStore
from kvstrata.config import load_config
from kvstrata.connector.compat import Locality, LookupResult, Medium, load_source
from kvstrata.connector.manager import StrataManager
from kvstrata.tiers.changelog import PEER
from tests.connector.harness import SLOT, ctx, step
from tests.utils import key, layout, store_config

HIT, MISS, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY


class PeersStandIn:
    """What PeerSync offers the store: chunks some other node holds, and fetching them."""

    def __init__(self, chunks: dict[bytes, np.ndarray], fail: bool = False):
        self.chunks, self.fail, self.failed = chunks, fail, False

    def can_fetch(self, namespace, key):
        return not self.failed

    def fetch(self, namespace, pool, items, log):
        if self.fail:
            self.failed = True  # the real link then leaves that peer alone for a while
            return [False] * len(items)
        for chunk_key, slot in items:
            pool.view(slot)[:] = self.chunks[chunk_key]
        return [True] * len(items)

    def stats(self):
        return {}

    def close(self):
        pass


@pytest.fixture
def engine(tmp_path):
    cfg = load_config(store_config(tmp_path, capacity=16 * SLOT, reserve_slots=2))
    store = NodeStore(cfg, "node-c")
    store._peer_io = ThreadPoolExecutor(1)  # what a store with a `cluster` section runs
    manager = StrataManager(LocalStoreClient(store), layout(worker_bytes=SLOT), cfg, "engine", enable_events=True)
    assert manager.wait_idle(10)
    yield store, manager
    manager.shutdown()
    store.close()
    store._peer_io.shutdown(wait=True)


def held_elsewhere(store, manager, chunks, fail=False):
    store.peers = PeersStandIn(chunks, fail)
    log = store._log(manager.namespace)
    for k in chunks:
        log.record(k, PEER, True)  # what a directory sync records
    step(manager)


def load(store, manager, keys, req="r"):
    for _ in range(10):
        answers = [manager.lookup(k, ctx(req)) for k in keys]
        if RETRY not in answers:
            return answers
        step(manager, store)
    return answers


def test_a_chunk_on_another_node_is_fetched_and_reported_as_peer_to_peer(engine):
    store, manager = engine
    chunks = {key(i): np.random.default_rng(i).integers(0, 256, SLOT, dtype=np.uint8) for i in range(3)}
    held_elsewhere(store, manager, chunks)
    assert manager.lookup(key(0), ctx()) is RETRY  # known to be elsewhere: worth waiting for
    assert load(store, manager, list(chunks)) == [HIT] * 3
    spec = manager.prepare_load(list(chunks), ctx())
    pool = store.arena.pools[manager.namespace]
    assert all(np.array_equal(pool.view(int(slot)), chunks[k]) for k, slot in zip(chunks, spec.block_ids))
    assert store.stats()["peer_promotions"] == 3 and manager.counters()["chunks_promoted"] == 3
    if load_source("PEER") is not None:
        assert {manager.get_load_source(k, ctx()) for k in chunks} == {load_source("PEER")}
    remote = [e for e in manager.take_events() if e.medium == Medium.CPU and not e.removed and Locality is not None
              and e.locality == Locality.REMOTE]  # fmt: skip
    assert Locality is None or {k for e in remote for k in e.keys} == set(chunks)


def test_a_failed_peer_fetch_is_a_miss_and_that_peer_is_not_asked_again_at_once(engine):
    store, manager = engine
    held_elsewhere(store, manager, {key(9): np.zeros(SLOT, np.uint8)}, fail=True)
    assert load(store, manager, [key(9)]) == [MISS]
    assert store.stats()["promotion_failures"] == 1
    assert load(store, manager, [key(9)], req="next") == [MISS]  # no second wait on that peer
