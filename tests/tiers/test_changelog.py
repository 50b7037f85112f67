"""The per-namespace change log engines mirror: ordered, collapsed, bounded."""

from kvstrata.tiers.changelog import CPU, STORAGE, ChangeLog
from tests.utils import key


def test_changes_since_collapse_to_the_final_state():
    log = ChangeLog()
    log.record(key(1), CPU, True)
    start = log.seq
    log.record(key(2), CPU, True)
    log.record(key(1), STORAGE, True)
    log.record(key(2), CPU, False)
    log.record(key(2), CPU, True)
    seq, changes = log.since(start)
    assert seq == log.seq
    assert changes == [(key(1), STORAGE, True), (key(2), CPU, True)]  # in the order of their last change
    assert log.since(log.seq) == (log.seq, [])


def test_repeated_states_are_not_changes():
    log = ChangeLog()
    log.record(key(1), CPU, True)
    log.record(key(1), CPU, True)
    log.record(key(3), CPU, False)
    assert log.seq == 1


def test_a_batch_records_each_key_that_changes_once_in_order():
    log = ChangeLog()
    log.record(key(2), CPU, True)
    start = log.seq
    log.record_many([key(1), key(2), key(3), key(1)], CPU, True)
    assert log.seq == start + 2  # key(2) was there already, key(1) repeats
    assert log.since(start) == (log.seq, [(key(1), CPU, True), (key(3), CPU, True)])
    log.record_many([key(3), key(4)], CPU, False)
    assert log.since(start) == (log.seq, [(key(1), CPU, True), (key(3), CPU, False)])


def test_a_reader_too_far_behind_gets_none_and_takes_a_snapshot():
    log = ChangeLog(length=4)
    for i in range(10):
        log.record(key(i), CPU, True)
    assert log.since(2) is None
    assert log.since(log.seq + 3) is None  # a sequence number from another store epoch
    seq, present = log.snapshot()
    assert seq == 10 and len(present) == 10
    assert log.present(CPU) == [key(i) for i in range(10)]
    assert log.present(STORAGE) == []


def test_counts_per_medium_follow_what_is_present():
    log = ChangeLog()
    log.record_many([key(1), key(2), key(3)], CPU, True)
    log.record_many([key(2), key(9)], CPU, False)  # key(9) was never there: no change
    log.record(key(1), STORAGE, True)
    log.record(key(1), STORAGE, True)
    assert (log.count(CPU), log.count(STORAGE), log.count()) == (2, 1, 3)
    assert log.count(CPU) == len(log.present(CPU)) and log.count(STORAGE) == len(log.present(STORAGE))
