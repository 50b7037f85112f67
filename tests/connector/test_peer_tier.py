"""Chunks held by another node, seen from the engine: the `PEER` medium in the mirror,
RETRY while the store fetches, then a HIT reported as peer-to-peer; a failed fetch is a
MISS. In-process stores: this node's store runs the real `PeerSync` (holders, the
suspect list after a failure, digest checks), fetching from a real second store whose
`export_chunks` answers in-process instead of through a Ray call (the Ray transport is
exercised on a simulated cluster in tests/actors/test_multinode.py)."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pytest
import ray

from kvstrata.actors.store_client import RayStoreClient
from kvstrata.actors.directory import holder_label
from kvstrata.store.node_store import LocalStoreClient, NodeStore
from kvstrata.actors.peers import PeerSync
from kvstrata.protocol import StepRequest
from kvstrata.config import ClusterConfig, load_config
from kvstrata.connector.compat import Locality, LookupResult, Medium, load_source
from kvstrata.connector.manager import StrataManager
from kvstrata.tiers.changelog import CPU
from tests.connector.harness import SLOT, ctx, step
from tests.utils import key, layout, store_config

HIT, MISS, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY
PEER_NODE = "node-a"


class InProcessPeer:
    """A peer store's actor handle: `export_chunks.remote` runs the real store's call
    (or fails as a dead peer does) and returns a finished future for `ray.get`."""

    def __init__(self, store: NodeStore, dead: bool = False, tamper: bool = False):
        self.store, self.dead, self.tamper, self.calls = store, dead, tamper, 0
        self.export_chunks = self

    def remote(self, namespace, keys):
        self.calls += 1
        if self.dead:
            raise ray.exceptions.RayActorError()
        found, digests, chunks = self.store.export_chunks(namespace, keys)
        if self.tamper:
            chunks = [np.bitwise_xor(chunk, 1) for chunk in chunks]
        answer = Future()
        answer.set_result((found, digests, [np.array(chunk) for chunk in chunks]))
        return answer


@pytest.fixture
def engine(tmp_path, monkeypatch):
    real_get = ray.get
    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: ref.result() if isinstance(ref, Future) else real_get(ref, timeout=timeout))
    (tmp_path / "c").mkdir()
    (tmp_path / "a").mkdir()
    cfg = load_config(store_config(tmp_path / "c", capacity=16 * SLOT, reserve_slots=2))
    store = NodeStore(cfg, "node-c")
    peer_io = ThreadPoolExecutor(1)  # what a store with a `cluster` section runs
    store.attach_peers(PeerSync("node-c", ClusterConfig(directory_shards=1), lambda: dict(store.ctx.logs), lambda shard: None), peer_io)
    peer_store = NodeStore(load_config(store_config(tmp_path / "a", capacity=16 * SLOT)), PEER_NODE)
    manager = StrataManager(LocalStoreClient(store), layout(worker_bytes=SLOT), cfg, "engine", enable_events=True)
    assert manager.wait_idle(10)
    yield store, manager, peer_store
    manager.shutdown()
    store.peers = None  # its sync thread never ran
    store.close()
    peer_io.shutdown(wait=True)
    peer_store.close()


def held_elsewhere(store, manager, peer_store, chunks, **peer):
    """`chunks` committed in the peer's arena, and the directory's word that it holds them."""
    namespace = manager.namespace
    epoch = peer_store.register("peer-engine", namespace, SLOT).epoch
    pool = peer_store.arena.pools[namespace]
    slots = pool.reserve("peer-engine", len(chunks))
    for slot, data in zip(slots, chunks.values()):
        pool.view(slot)[:] = data
    peer_store.step(StepRequest("peer-engine", namespace, epoch=epoch, commit=list(zip(slots, chunks))))
    handle = InProcessPeer(peer_store, **peer)
    store.peers._stores[PEER_NODE] = RayStoreClient(handle, 30.0)  # how peers reach a store
    changes = [(k, holder_label(PEER_NODE, CPU), True) for k in chunks]
    store.peers._apply(0, "directory-epoch", {namespace: (len(changes), changes, False)}, dict(store.ctx.logs))
    step(manager)
    return handle


def load(store, manager, keys, req="r"):
    for _ in range(10):
        answers = [manager.lookup(k, ctx(req)) for k in keys]
        if RETRY not in answers:
            return answers
        step(manager, store)
    return answers


def test_a_chunk_on_another_node_is_fetched_and_reported_as_peer_to_peer(engine):
    store, manager, peer_store = engine
    chunks = {key(i): np.random.default_rng(i).integers(0, 256, SLOT, dtype=np.uint8) for i in range(3)}
    peer = held_elsewhere(store, manager, peer_store, chunks)
    assert manager.lookup(key(0), ctx()) is RETRY  # known to be elsewhere: worth waiting for
    assert load(store, manager, list(chunks)) == [HIT] * 3
    spec = manager.prepare_load(list(chunks), ctx())
    pool = store.arena.pools[manager.namespace]
    assert all(np.array_equal(pool.view(int(slot)), chunks[k]) for k, slot in zip(chunks, spec.block_ids))
    assert store.stats()["peer_promotions"] == 3 and manager.counters()["chunks_promoted"] == 3
    assert peer.calls >= 1 and store.peers.stats()["chunks_fetched"] == 3
    if load_source("PEER") is not None:
        assert {manager.get_load_source(k, ctx()) for k in chunks} == {load_source("PEER")}
    # Announced as another node's (remote storage, never this node's host memory), then,
    # once fetched, as this node's arena.
    peer_events = [e for e in manager.take_events() if e.ownership == "kvstrata-peer" and not e.removed]
    assert {k for e in peer_events for k in e.keys} == set(chunks)
    assert {(e.medium, e.locality) for e in peer_events} == {(Medium.STORAGE, Locality and Locality.REMOTE)}


def test_a_failed_peer_fetch_is_a_miss_and_that_peer_is_not_asked_again_at_once(engine):
    store, manager, peer_store = engine
    peer = held_elsewhere(store, manager, peer_store, {key(9): np.zeros(SLOT, np.uint8)}, dead=True)
    assert load(store, manager, [key(9)]) == [MISS]
    assert store.stats()["promotion_failures"] == 1 and peer.calls == 1
    assert load(store, manager, [key(9)], req="next") == [MISS]  # no second wait on that peer
    assert peer.calls == 1 and store.peers.stats()["fetch_failures"] == 1


def test_a_chunk_damaged_in_transfer_is_a_miss_never_a_hit(engine):
    store, manager, peer_store = engine
    peer = held_elsewhere(store, manager, peer_store, {key(5): np.full(SLOT, 7, np.uint8)}, tamper=True)
    assert load(store, manager, [key(5)]) == [MISS]
    assert peer.calls == 1 and store.peers.stats()["corrupt_transfers"] == 1
