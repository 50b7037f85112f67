"""The directory shard's bookkeeping, without Ray: batched syncs, catching up by
sequence number, full re-sends after a restart, and nodes that leave."""

from __future__ import annotations

from kvstrata.actors.directory import DirectoryShard, shard_of
from tests.utils import key

NS = "ns"


def test_a_store_learns_what_other_nodes_hold_since_it_last_looked():
    shard = DirectoryShard(0)
    epoch, replies = shard.sync("a", {NS: ([(key(1), True), (key(2), True)], -1, False)})
    assert epoch == shard.epoch
    seq_a, changes, snapshot = replies[NS]
    assert snapshot and sorted(changes) == sorted([(key(1), "a", True), (key(2), "a", True)])
    _, replies = shard.sync("b", {NS: ([(key(3), True)], -1, False)})
    seq_b = replies[NS][0]
    _, replies = shard.sync("a", {NS: ([(key(2), False)], seq_a, False)})  # a evicted key 2
    seq, changes, snapshot = replies[NS]
    assert not snapshot and sorted(changes) == sorted([(key(3), "b", True), (key(2), "a", False)])
    _, replies = shard.sync("b", {NS: ([], seq_b, False)})
    assert replies[NS][1] == [(key(2), "a", False)]


def test_a_full_sync_replaces_what_the_shard_knew_of_that_node():
    shard = DirectoryShard(0)
    shard.sync("a", {NS: ([(key(1), True), (key(2), True)], -1, False)})
    _, replies = shard.sync("a", {NS: ([(key(2), True), (key(4), True)], -1, True)})
    assert sorted(replies[NS][1]) == sorted([(key(2), "a", True), (key(4), "a", True)])


def test_nodes_that_leave_are_dropped_and_their_peers_hear_of_it():
    shard = DirectoryShard(0)
    shard.sync("a", {NS: ([(key(1), True)], -1, False)})
    _, replies = shard.sync("b", {NS: ([(key(1), True), (key(2), True)], -1, False)})
    seen = replies[NS][0]
    assert shard.drop_nodes(["b", "gone"]) == 2
    _, replies = shard.sync("a", {NS: ([], seen, False)})
    assert sorted(replies[NS][1]) == sorted([(key(1), "b", False), (key(2), "b", False)])
    assert shard.stats()["namespaces"] == {NS: 1}


def test_a_sequence_number_from_before_a_restart_gets_a_snapshot():
    shard = DirectoryShard(0)
    shard.sync("a", {NS: ([(key(1), True)], -1, False)})
    restarted = DirectoryShard(0)
    assert restarted.epoch != shard.epoch
    _, replies = restarted.sync("b", {NS: ([(key(2), True)], 57, False)})
    assert replies[NS][2] and replies[NS][1] == [(key(2), "b", True)]


def test_keys_spread_over_the_shards():
    counts = [0] * 4
    for i in range(4000):
        counts[shard_of(key(i), 4)] += 1
    assert min(counts) > 800
