"""Eviction policies: the order pools evict in, and walking it while evicting."""

from __future__ import annotations

from collections import OrderedDict

from kvstrata.tiers.policies import make_policy


def test_lru_gives_the_least_recently_used_first():
    policy = make_policy("lru")
    for slot in range(5):
        policy.add(slot)
    policy.touch(0)
    policy.remove(3)
    assert list(policy.candidates()) == [1, 2, 4, 0]


def test_lru_candidates_survive_removal_while_walking_and_never_repeat():
    """Pools skip pinned slots and evict the first free one, removing it mid-walk."""
    policy = make_policy("lru")
    for slot in range(100):
        policy.add(slot)
    pinned = set(range(0, 60, 2))
    walked = []
    for slot in policy.candidates():
        walked.append(slot)
        if slot not in pinned:
            policy.remove(slot)  # evicted
    assert walked == list(range(100))
    assert list(policy.candidates()) == sorted(pinned)


class CountingOrder(OrderedDict):
    read = 0

    def __iter__(self):
        for slot in super().__iter__():
            self.read += 1
            yield slot


def test_lru_eviction_reads_only_the_front_of_a_large_order():
    """One eviction from a million records must not walk (or copy) all of them."""
    policy = make_policy("lru")
    policy._order = order = CountingOrder.fromkeys(range(1_000_000))
    walk = policy.candidates()
    assert next(walk) == 0
    policy.remove(0)
    assert next(policy.candidates()) == 1
    assert order.read < 100
