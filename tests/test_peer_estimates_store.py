"""A node store's estimates per peer (issue #28), without Ray: this store runs the real
`PeerSync` fetch against two fake peer stores whose answers arrive when a simulated link
says so (a fake `ray.wait` that hands out answers in arrival order and moves the fetch's
clock to each one's arrival). A slow and a fast peer get separate estimates at their own
rates, a chunk both hold comes from the fast one (an unmeasured one is tried first), the
engines' step payload keeps only `disk`/`object`/`peer`, and `kvstrata status` (JSON,
text, metrics) lists each peer."""

from __future__ import annotations

import json

import numpy as np
import pytest
import ray
from rich.console import Console

from kvstrata.actors.directory import holder_label
from kvstrata.actors.store_client import RayStoreClient
from kvstrata.store.node_store import NodeStore
from kvstrata.actors.peers import PeerSync
from kvstrata.store.promotion import PROMOTE
from kvstrata.actors.store_metrics import metric_samples
from kvstrata.cli.status_view import render_store
from kvstrata.config import ClusterConfig, load_config
from kvstrata.tiers.changelog import CPU
from kvstrata.tiers.records import chunk_digest
from tests.utils import FakeClock, key, store_config

SLOT = 64 * 1024
NS = "peer-estimates"
MB = 1 << 20
# (latency seconds, bytes per second) of each simulated link. Named so that without
# estimates (holders in RAM by node id) the slow one would be asked, and the new one last.
LINKS = {"a-slow": (0.020, 20 * MB), "b-fast": (0.002, 800 * MB), "c-new": (0.002, 800 * MB)}


class Answer:
    """A fetch call's answer, due at `ready_at` on the fetch's clock."""

    def __init__(self, value, ready_at: float):
        self.value, self.ready_at = value, ready_at


class FakePeer:
    """A peer store's actor handle: `export_chunks.remote` answers with the chunks it holds,
    due after its link's latency plus the bytes over its bandwidth."""

    def __init__(self, node_id: str, chunks: dict[bytes, np.ndarray], timer: FakeClock):
        self.latency, self.bandwidth = LINKS[node_id]
        self.chunks, self.timer, self.asked = chunks, timer, []
        self.export_chunks = self

    def remote(self, namespace, keys):
        self.asked.extend(keys)
        found = [k for k in keys if k in self.chunks]
        value = (found, [chunk_digest(NS, k, self.chunks[k]) for k in found], [self.chunks[k].copy() for k in found])
        return Answer(value, self.timer() + self.latency + len(found) * SLOT / self.bandwidth)


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    timer = FakeClock(0.0)

    def fake_wait(refs, num_returns=1, timeout=None):
        first = min(refs, key=lambda ref: ref.ready_at)
        timer.now = max(timer.now, first.ready_at)  # time passes until the next answer is here
        return [first], [ref for ref in refs if ref is not first]

    monkeypatch.setattr(ray, "wait", fake_wait)
    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: ref.value)
    # The store's clock (estimates' ages) stands still: ages are 0 unless a test moves it.
    store = NodeStore(load_config(store_config(tmp_path, capacity=64 * SLOT)), "node-here", clock=FakeClock())
    store.peers = PeerSync("node-here", ClusterConfig(directory_shards=1), lambda: dict(store.ctx.logs), lambda s: None, timer)
    store.register("engine", NS, SLOT)
    data = {key(i): np.random.default_rng(i).integers(0, 256, SLOT, dtype=np.uint8) for i in range(40)}
    peers = {node: FakePeer(node, data, timer) for node in LINKS}
    store.peers._stores.update({node: RayStoreClient(peer, 30.0) for node, peer in peers.items()})  # peers' clients
    yield store, peers, data
    store.peers = None  # its sync thread never ran
    store.close()


def hold(store, node: str, keys) -> None:
    """The directory's word that `node` holds `keys` in RAM."""
    changes = [(k, holder_label(node, CPU), True) for k in keys]
    store.peers._apply(0, "directory-epoch", {NS: (len(changes), changes, False)}, dict(store.ctx.logs))


def fetch(store, data, keys) -> None:
    """The store's peer fetch of `keys` into reserved slots (released after): all arrive intact."""
    pool = store.arena.pools[NS]
    slots = pool.reserve(PROMOTE, len(keys))
    assert len(slots) == len(keys)
    try:
        items = list(zip(keys, slots))
        assert store.peers.fetch(NS, pool, items, store.ctx.log(NS), store.tier_estimates, 30.0) == [True] * len(keys)
        assert all(np.array_equal(pool.view(slot), data[k]) for k, slot in items)
    finally:
        pool.release(PROMOTE, slots)


def measure_both(store, data) -> None:
    """Batches asking both peers at once, of varying sizes, the slow one's keys first."""
    slow_keys, fast_keys = list(data)[:10], list(data)[10:20]
    hold(store, "a-slow", slow_keys)
    hold(store, "b-fast", fast_keys)
    for n in range(1, 11):
        fetch(store, data, slow_keys[:n] + fast_keys[: 11 - n])


def test_a_slow_and_a_fast_peer_get_their_own_estimates_at_their_own_rates(cluster):
    store, peers, data = cluster
    measure_both(store, data)
    costs = store.tier_estimates.costs()
    slow, fast = costs["peer:a-slow"], costs["peer:b-fast"]
    # The fast peer is not charged the slow one's wait, though both were asked at once.
    assert slow.bytes_per_second == pytest.approx(20 * MB, rel=0.01)
    assert slow.latency_seconds == pytest.approx(0.020, abs=0.001)
    assert fast.bytes_per_second == pytest.approx(800 * MB, rel=0.01)
    assert fast.latency_seconds == pytest.approx(0.002, abs=0.001)


def test_a_chunk_both_hold_comes_from_the_fast_peer_and_a_new_holder_is_tried_first(cluster):
    store, peers, data = cluster
    measure_both(store, data)
    both = list(data)[20:26]
    hold(store, "a-slow", both)
    hold(store, "b-fast", both)
    peers["a-slow"].asked.clear()
    peers["b-fast"].asked.clear()
    fetch(store, data, both)
    assert peers["b-fast"].asked == both and peers["a-slow"].asked == []
    # A third holder never measured: asked first (that is what measures it).
    hold(store, "c-new", both)
    fetch(store, data, both)
    assert peers["c-new"].asked == both and peers["a-slow"].asked == []


def test_engines_get_the_aggregate_only_and_status_lists_each_peer(cluster):
    store, peers, data = cluster
    measure_both(store, data)
    pool = store.arena.pools[NS]
    for batch in (list(data)[30:33], list(data)[33:38]):  # two promotions: the aggregate `peer`
        hold(store, "b-fast", batch)
        with store.ctx.lock:
            assert store.promotion.promote(NS, pool, batch) == dict.fromkeys(batch, True)
        assert store.wait_io(10)
    assert store.counters["peer_promotions"] == 8
    payload = store.admission.tier_costs()  # what rides on every step reply
    assert set(payload) == {"peer"}
    peer = store.tier_estimates.costs()["peer"]
    assert payload["peer"] == (peer.latency_seconds, peer.bytes_per_second, peer.age_seconds)

    stats = json.loads(json.dumps(store.stats(), default=str))  # what `kvstrata status --json` prints
    admission = stats["report"]["admission"]
    assert set(admission["estimates"]) == {"peer"}
    assert set(admission["peer_estimates"]) == {"a-slow", "b-fast"}
    assert admission["peer_estimates"]["a-slow"]["bytes_per_second"] == pytest.approx(20 * MB, rel=0.01)
    assert admission["peer_estimates"]["b-fast"]["bytes_per_second"] == pytest.approx(800 * MB, rel=0.01)

    console = Console(record=True, width=400)
    console.print(render_store(stats))
    text = console.export_text()
    assert "per peer: node a-slow delivers 0.021 GB/s after 20.0 ms" in text
    assert "node b-fast delivers 0.839 GB/s after 2.0 ms" in text

    samples = {(name, labels["tier"]): value for name, labels, value in metric_samples(stats) if "tier" in labels}
    assert samples[("kvstrata_tier_estimate_bytes_per_second", "peer:a-slow")] == pytest.approx(20 * MB, rel=0.01)
    assert samples[("kvstrata_tier_estimate_bytes_per_second", "peer:b-fast")] == pytest.approx(800 * MB, rel=0.01)
    assert ("kvstrata_tier_estimate_bytes_per_second", "peer") in samples
