"""Retention (`kv.retain`): eviction takes lower priorities first, in the arena and on disk,
and an expired retention stops protecting its chunk."""

from __future__ import annotations

import numpy as np
import pytest

from kvstrata.tiers.disk import HEADER_BYTES, DiskTier
from kvstrata.tiers.retention import RetentionTable, retained_last
from tests.utils import FakeClock, key

CHUNK = 16384
NS = "ns0"


def test_the_table_keeps_the_higher_priority_and_the_later_end_and_forgets_at_the_end():
    clock = FakeClock()
    table = RetentionTable(clock)
    table.retain(NS, [key(1)], 30, 10)
    table.retain(NS, [key(1)], 10, 60)  # lower priority, later end: both the best of the two
    assert table.priority(NS, key(1)) == 30
    clock.advance(59)
    assert table.priority(NS, key(1)) == 30 and table.has(NS)
    clock.advance(1)
    assert table.priority(NS, key(1)) == 0 and not table.has(NS) and len(table) == 0


def test_a_full_table_refuses_new_retentions_and_keeps_the_old():
    table = RetentionTable(FakeClock(), max_entries=2)
    assert table.retain(NS, [key(1), key(2), key(3)], 50, 10) == 1
    assert table.priority(NS, key(1)) == 50 and table.priority(NS, key(3)) == 0
    assert table.retain(NS, [key(1)], 60, 10) == 0  # a renewal takes no new entry


@pytest.mark.parametrize("priority, ttl", [(-1, 10), (101, 10), (5, 0), (5, float("nan"))])
def test_bad_retentions_are_named(priority, ttl):
    with pytest.raises(ValueError, match="priority|ttl"):
        RetentionTable(FakeClock()).retain(NS, [key(1)], priority, ttl)


def test_retained_candidates_go_last_lowest_priority_first_each_in_the_order_given():
    priorities = {"a": 0, "b": 50, "c": 0, "d": 10, "e": 50, "f": 0}
    assert list(retained_last("abcdef", priorities.get)) == ["a", "c", "f", "d", "b", "e"]


def test_the_disk_evicts_unretained_records_first_and_an_expired_retention_protects_nothing(tmp_path):
    clock = FakeClock()
    table = RetentionTable(clock)
    record = HEADER_BYTES + CHUNK
    tier = DiskTier(tmp_path, 4 * record)
    try:
        tier.use_retention(table)
        data = np.full(CHUNK, 7, dtype=np.uint8)
        tier.write_many(NS, [(key(i), data) for i in range(4)])
        table.retain(NS, [key(0)], 80, 60)
        table.retain(NS, [key(1)], 20, 60)
        tier.write_many(NS, [(key(i), data) for i in range(10, 12)])  # evicts two: key(2), key(3)
        assert sorted(tier.keys(NS)) == sorted([key(0), key(1), key(10), key(11)])
        tier.write_many(NS, [(key(i), data) for i in range(20, 23)])  # then key(10), key(11), then key(1)
        assert sorted(tier.keys(NS)) == sorted([key(0), key(20), key(21), key(22)])
        clock.advance(61)  # the retention ran out: key(0) is just the oldest record
        tier.write_many(NS, [(key(30), data)])
        assert key(0) not in tier.keys(NS)
    finally:
        tier.close()
