"""The directory shard's bookkeeping, without Ray: batched syncs, catching up by
sequence number, full re-sends after a restart, and nodes that leave."""

from __future__ import annotations

from kvstrata.actors.directory import DirectoryShard, shard_of
from tests.utils import key

NS = "ns"


def test_a_store_learns_what_other_nodes_hold_since_it_last_looked():
    shard = DirectoryShard(0)
    epoch, replies = shard.sync("a", {NS: ([(key(1), "CPU", True), (key(2), "CPU", True)], -1, False)})
    assert epoch == shard.epoch
    seq_a, changes, snapshot = replies[NS]
    assert snapshot and sorted(changes) == sorted([(key(1), "a/CPU", True), (key(2), "a/CPU", True)])
    _, replies = shard.sync("b", {NS: ([(key(3), "CPU", True)], -1, False)})
    seq_b = replies[NS][0]
    _, replies = shard.sync("a", {NS: ([(key(2), "CPU", False)], seq_a, False)})  # a evicted key 2
    seq, changes, snapshot = replies[NS]
    assert not snapshot and sorted(changes) == sorted([(key(3), "b/CPU", True), (key(2), "a/CPU", False)])
    _, replies = shard.sync("b", {NS: ([], seq_b, False)})
    assert replies[NS][1] == [(key(2), "a/CPU", False)]


def test_a_full_sync_replaces_what_the_shard_knew_of_that_node():
    shard = DirectoryShard(0)
    shard.sync("a", {NS: ([(key(1), "CPU", True), (key(2), "CPU", True)], -1, False)})
    _, replies = shard.sync("a", {NS: ([(key(2), "CPU", True), (key(4), "CPU", True)], -1, True)})
    assert sorted(replies[NS][1]) == sorted([(key(2), "a/CPU", True), (key(4), "a/CPU", True)])


def test_nodes_that_leave_are_dropped_and_their_peers_hear_of_it():
    shard = DirectoryShard(0)
    shard.sync("a", {NS: ([(key(1), "CPU", True)], -1, False)})
    _, replies = shard.sync("b", {NS: ([(key(1), "CPU", True), (key(2), "CPU", True)], -1, False)})
    seen = replies[NS][0]
    assert shard.drop_nodes(["b", "gone"]) == 2
    _, replies = shard.sync("a", {NS: ([], seen, False)})
    assert sorted(replies[NS][1]) == sorted([(key(1), "b/CPU", False), (key(2), "b/CPU", False)])
    assert shard.stats()["namespaces"] == {NS: 1}


def test_a_sequence_number_from_before_a_restart_gets_a_snapshot():
    shard = DirectoryShard(0)
    shard.sync("a", {NS: ([(key(1), "CPU", True)], -1, False)})
    restarted = DirectoryShard(0)
    assert restarted.epoch != shard.epoch
    _, replies = restarted.sync("b", {NS: ([(key(2), "CPU", True)], 57, False)})
    assert replies[NS][2] and replies[NS][1] == [(key(2), "b/CPU", True)]


def test_keys_spread_over_the_shards():
    counts = [0] * 4
    for i in range(4000):
        counts[shard_of(key(i), 4)] += 1
    assert min(counts) > 800


def test_the_directory_keeps_which_tier_of_a_node_holds_a_chunk():
    shard = DirectoryShard(0)
    shard.sync("a", {NS: ([(key(1), "STORAGE", True)], -1, False)})
    _, replies = shard.sync("b", {NS: ([(key(1), "CPU", True)], -1, False)})
    assert sorted(replies[NS][1]) == sorted([(key(1), "a/STORAGE", True), (key(1), "b/CPU", True)])
    assert shard.drop_nodes(["a"]) == 1


def test_a_store_prefers_peers_holding_a_chunk_in_ram_and_mirrors_them_as_peer():
    from kvstrata.actors.peers import PeerSync
    from kvstrata.config import ClusterConfig
    from kvstrata.tiers.changelog import PEER, ChangeLog

    log = ChangeLog()
    peers = PeerSync("c", ClusterConfig(directory_shards=1), lambda: {NS: log}, lambda shard: None)
    changes = [(key(1), "a/STORAGE", True), (key(1), "b/CPU", True), (key(2), "a/CPU", True), (key(3), "c/CPU", True)]
    peers._apply(0, "epoch-1", {NS: (4, changes, True)}, {NS: log})
    assert peers.holders(NS, key(1)) == ["b", "a"]  # RAM before disk
    assert peers.holders(NS, key(3)) == []  # its own chunk is no peer's
    assert sorted(log.present(PEER)) == sorted([key(1), key(2)])
    peers._apply(0, "epoch-1", {NS: (5, [(key(2), "a/CPU", False)], False)}, {NS: log})
    assert not log.has(key(2), PEER) and log.has(key(1), PEER)


def test_stores_go_to_the_nodes_the_config_selects(monkeypatch):
    import ray

    from kvstrata.actors.cluster import dead_nodes, store_nodes
    from kvstrata.config import ClusterConfig

    nodes = [
        {"NodeID": "n1", "Alive": True, "Resources": {"CPU": 8, "kv": 1}, "Labels": {"tier": "gpu"}},
        {"NodeID": "n2", "Alive": True, "Resources": {"CPU": 8}, "Labels": {"tier": "cpu"}},
        {"NodeID": "n3", "Alive": False, "Resources": {"CPU": 8, "kv": 1}, "Labels": {"tier": "gpu"}},
    ]
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    assert store_nodes(ClusterConfig()) == ["n1", "n2"]
    assert store_nodes(ClusterConfig(node_resource="kv")) == ["n1"]
    assert store_nodes(ClusterConfig(node_label="tier=cpu")) == ["n2"]
    assert dead_nodes() == {"n3"}


def test_a_shard_restarted_between_two_syncs_gets_the_whole_holding_again(monkeypatch):
    import ray

    from kvstrata.actors.peers import PeerSync
    from kvstrata.config import ClusterConfig
    from kvstrata.tiers.changelog import CPU, ChangeLog

    class Call:
        def __init__(self, shard):
            self.shard = shard

        def remote(self, node_id, batches):
            return self.shard.sync(node_id, batches)

    shard = DirectoryShard(0)
    log = ChangeLog()
    peers = PeerSync("a", ClusterConfig(directory_shards=1), lambda: {NS: log}, lambda s: None)
    peers._directory = lambda s: type("Handle", (), {"sync": Call(shard)})()
    # Calls answer at once, in-process: a "reference" is the answer itself.
    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: ref)
    monkeypatch.setattr(ray, "wait", lambda refs, **kwargs: (refs, []))
    log.record(key(1), CPU, True)
    peers.sync_once()
    assert shard.stats()["namespaces"] == {NS: 1}
    shard.__init__(0)  # restarted: empty, new epoch, and nothing failed on our side
    log.record(key(2), CPU, True)
    peers.sync_once()  # sends only key 2, learns the new epoch
    peers.sync_once()  # sends everything
    _, replies = shard.sync("b", {NS: ([], -1, False)})
    assert sorted(replies[NS][1]) == sorted([(key(1), "a/CPU", True), (key(2), "a/CPU", True)])


def test_the_groups_of_one_position_are_separate_entries():
    """A hybrid model's chunks at one position share the block hash, not the key: a node
    that holds the full-attention chunk but dropped the window must not look like it
    holds both."""
    shard = DirectoryShard(0)
    full, window = key(1, group=0), key(1, group=1)
    shard.sync("a", {NS: ([(full, "CPU", True), (window, "CPU", True)], -1, False)})
    _, replies = shard.sync("b", {NS: ([], -1, False)})
    seen = replies[NS][0]
    assert sorted(replies[NS][1]) == sorted([(full, "a/CPU", True), (window, "a/CPU", True)])
    shard.sync("a", {NS: ([(window, "CPU", False)], -1, False)})
    _, replies = shard.sync("b", {NS: ([], seen, False)})
    assert replies[NS][1] == [(window, "a/CPU", False)]


def test_the_bucket_is_one_holder_for_routers_and_never_sent_to_stores_as_a_peer():
    from kvstrata.actors.directory import BUCKET_HOLDER

    shard = DirectoryShard(0)
    shard.sync("a", {NS: ([(key(1), "OBJECT", True), (key(2), "OBJECT", True), (key(1), "CPU", True)], -1, False)})
    _, replies = shard.sync("b", {NS: ([(key(2), "OBJECT", True)], -1, False)})
    assert replies[NS][1] == [(key(1), "a/CPU", True)]  # stores index the bucket themselves
    assert shard.coverage(NS, [key(1), key(2), key(3)]) == {BUCKET_HOLDER: 0b011, "a/CPU": 0b001}
    shard.sync("a", {NS: ([(key(1), "CPU", True)], -1, True)})  # a's full holding: the bucket is not a's to drop
    shard.sync("b", {NS: ([(key(2), "OBJECT", False)], -1, False)})  # a sweep found it gone
    assert shard.coverage(NS, [key(1), key(2)]) == {BUCKET_HOLDER: 0b01, "a/CPU": 0b01}
    assert shard.stats()["bucket"] == {NS: 1}
    assert shard.drop_nodes(["a"]) == 1 and shard.coverage(NS, [key(1)]) == {BUCKET_HOLDER: 0b1}
