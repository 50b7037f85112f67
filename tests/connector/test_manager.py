"""StrataManager driven only through vLLM's OffloadingManager calls, over an in-process
node store. Mirrors the behaviours vLLM's own tests/v1/kv_offload/cpu/test_manager.py
expects of any manager, plus what sharing a store between engines adds."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvstrata.store.node_store import LocalStoreClient, NodeStore
from kvstrata.config import load_config
from kvstrata.connector.compat import LookupResult, ReqContext, ScheduleEndContext
from kvstrata.connector.manager import StrataManager
from kvstrata.connector.manager_state import SILENCE_FLOOR_SECONDS
from tests.connector.harness import HangingClient, step
from tests.utils import FakeClock, key, layout, store_config

SLOT = 4096
HIT, MISS, RETRY, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY, LookupResult.HIT_PENDING


@pytest.fixture
def clock():
    return FakeClock()


def make_store(tmp_path, clock, slots=16, reserve_slots=4, lease_seconds=30.0):
    cfg = store_config(tmp_path, capacity=slots * SLOT, lease_seconds=lease_seconds, reserve_slots=reserve_slots)
    return NodeStore(cfg, "node0", clock=clock), load_config(cfg)


@pytest.fixture
def new_store(tmp_path, clock):
    """Builds node stores for a test and closes every one of them afterwards."""
    made = []

    def build(**kwargs):
        store, cfg = make_store(tmp_path, clock, **kwargs)
        made.append(store)
        return store, cfg

    yield build
    for store in made:
        store.close()


@pytest.fixture
def store_and_config(new_store):
    return new_store()


managers: list[StrataManager] = []


def make_manager(store, cfg, holder="engine-a", lay=None, client=None, clock=time.monotonic):
    manager = StrataManager(
        client or LocalStoreClient(store), lay or layout(worker_bytes=SLOT), cfg, holder, enable_events=True, clock=clock
    )
    managers.append(manager)
    assert manager.wait_idle(10)
    return manager


@pytest.fixture(autouse=True)
def _close_managers():
    yield
    while managers:
        managers.pop().shutdown()


def ctx(req_id="r1"):
    return ReqContext(req_id=req_id)


def store_keys(manager, keys, req="w"):
    out = manager.prepare_store(keys, ctx(req))
    assert out is not None
    manager.complete_store(out.keys_to_store, ctx(req))
    step(manager)
    return out


def test_unknown_key_is_a_miss_without_a_round_trip(store_and_config):
    manager = make_manager(*store_and_config)
    calls = manager._channel.calls
    assert manager.lookup(key(1), ctx()) is MISS
    assert manager._channel.calls == calls


def test_pending_until_complete_store_then_hit(store_and_config):
    manager = make_manager(*store_and_config)
    out = manager.prepare_store([key(1), key(2)], ctx())
    assert out.keys_to_store == [key(1), key(2)]
    assert manager.lookup(key(1), ctx()) is PENDING
    manager.complete_store([key(1), key(2)], ctx())
    assert manager.lookup(key(1), ctx()) is HIT
    assert manager.lookup(key(2), ctx()) is HIT


def test_prepare_store_filters_keys_already_stored_or_in_flight(store_and_config):
    manager = make_manager(*store_and_config)
    store_keys(manager, [key(1)])
    manager.prepare_store([key(2)], ctx())
    out = manager.prepare_store([key(1), key(2), key(3)], ctx())
    assert out.keys_to_store == [key(3)]
    assert manager.prepare_store([key(1)], ctx()).keys_to_store == []


def test_prepare_store_returns_none_when_nothing_can_be_stored(new_store):
    store, cfg = new_store(slots=4, reserve_slots=4)
    hog = make_manager(store, cfg, holder="hog")
    # The hog stores three chunks and keeps them pinned for a running request; with
    # its one reserved slot (an engine may reserve a quarter of the pool) that is all four.
    for i in range(3):
        out = hog.prepare_store([key(10 + i)], ctx("h"))
        hog.complete_store(out.keys_to_store, ctx("h"))
        assert hog.lookup(key(10 + i), ctx("reader")) is HIT
        step(hog)
    manager = make_manager(store, cfg, holder="engine-b")
    assert manager.prepare_store([key(1)], ctx()) is None
    assert manager.counters()["stores_dropped_no_slot"] == 1
    step(manager)
    assert manager.prepare_store([key(1)], ctx()) is None


def test_one_engine_never_reserves_more_than_a_quarter_of_the_pool(new_store):
    store, cfg = new_store(slots=16, reserve_slots=64)
    manager = make_manager(store, cfg)
    assert len(manager._stock) == 4
    store_keys(manager, [key(i) for i in range(4)])
    assert store.arena.pools[manager.namespace].stats()["resident"] == 4


def test_partial_stock_stores_the_head_of_the_offer(new_store):
    store, cfg = new_store(slots=16, reserve_slots=2)
    manager = make_manager(store, cfg)
    out = manager.prepare_store([key(i) for i in range(5)], ctx())
    assert out.keys_to_store == [key(0), key(1)]
    assert manager.counters()["stores_dropped_no_slot"] == 3
    manager.complete_store(out.keys_to_store, ctx())
    step(manager)  # the stock grows to cover the demand it saw (up to a quarter of the pool)
    assert len(manager.prepare_store([key(i) for i in range(2, 5)], ctx()).keys_to_store) == 3


def test_stored_chunks_are_never_evicted_for_the_current_offer(new_store):
    store, cfg = new_store(slots=4, reserve_slots=1)
    manager = make_manager(store, cfg)
    for i in range(3):
        store_keys(manager, [key(i)])
        step(manager)
    # The arena is full: three chunks and one reserved slot.
    out = manager.prepare_store([key(0), key(3)], ctx())
    assert out.keys_to_store == [key(3)] and out.evicted_keys == []
    manager.complete_store(out.keys_to_store, ctx())
    step(manager)
    assert store.arena.pools[manager.namespace].lookup(key(0)) is not None


def test_prepare_load_follows_key_order(store_and_config):
    store, cfg = store_and_config
    manager = make_manager(store, cfg)
    keys = [key(i) for i in range(4)]
    out = manager.prepare_store(keys, ctx())
    pool = store.arena.pools[manager.namespace]
    for i, slot in enumerate(out.store_spec.block_ids):
        pool.view(int(slot))[:] = i
    manager.complete_store(keys, ctx())
    order = [keys[2], keys[0], keys[3]]
    for k in order:
        assert manager.lookup(k, ctx("reader")) is HIT
    spec = manager.prepare_load(order, ctx("reader"))
    assert [int(pool.view(int(s))[0]) for s in spec.block_ids] == [2, 0, 3]


def test_failed_store_drops_the_chunks(store_and_config):
    store, cfg = store_and_config
    manager = make_manager(store, cfg)
    out = manager.prepare_store([key(1)], ctx())
    manager.complete_store(out.keys_to_store, ctx(), success=False)
    assert manager.lookup(key(1), ctx()) is MISS
    step(manager)
    assert store.keys(manager.namespace) == []
    assert manager.counters()["stores_failed"] == 1


def test_another_engine_hits_at_once_with_the_same_bytes_and_no_store_call(store_and_config):
    store, cfg = store_and_config
    writer = make_manager(store, cfg, holder="writer")
    out = writer.prepare_store([key(1)], ctx())
    pool = store.arena.pools[writer.namespace]
    payload = np.arange(SLOT, dtype=np.uint64).astype(np.uint8)
    pool.view(int(out.store_spec.block_ids[0]))[:] = payload
    writer.complete_store([key(1)], ctx())
    step(writer)  # the commit goes out; its answer gives the writer's mirror the slot
    step(writer)  # ... so the writer's own pin goes

    reader = make_manager(store, cfg, holder="reader")
    calls = reader._channel.calls
    assert reader.lookup(key(1), ctx()) is HIT  # resident in the arena: as vLLM's CPU manager
    assert reader.lookup(key(2), ctx()) is MISS
    spec = reader.prepare_load([key(1)], ctx())
    assert reader._channel.calls == calls and not reader.has_pending_work()
    assert np.array_equal(pool.view(int(spec.block_ids[0])), payload)
    assert reader.counters()["hits_without_round_trip"] == 1
    step(reader)  # the hold reaches the store with the step's request
    assert pool.stats()["holds"] == 1 and pool.stats()["pinned"] == 1
    reader.complete_load([key(1)], ctx())
    reader.on_request_finished(ctx())
    step(reader)
    assert pool.stats()["pinned"] == 0


@pytest.mark.parametrize("finished_first", [False, True], ids=["load-then-finish", "finish-then-load"])
def test_pins_are_released_when_requests_are_done(store_and_config, finished_first):
    store, cfg = store_and_config
    writer = make_manager(store, cfg, holder="writer")
    store_keys(writer, [key(1)])
    step(writer)
    pool = store.arena.pools[writer.namespace]
    assert pool.stats()["pinned"] == 0

    reader = make_manager(store, cfg, holder="reader")
    reader.lookup(key(1), ctx("a"))
    step(reader)
    assert reader.lookup(key(1), ctx("a")) is HIT
    reader.prepare_load([key(1)], ctx("a"))
    step(reader)
    assert pool.stats()["pinned"] == 1  # load in flight
    if finished_first:  # (vLLM aborted the request): the load in flight still holds the pin
        reader.on_request_finished(ctx("a"))
        step(reader)
        assert pool.stats()["pinned"] == 1
    reader.complete_load([key(1)], ctx("a"))
    reader.on_request_finished(ctx("a"))
    step(reader)
    assert pool.stats()["pinned"] == 0


def test_evicted_chunk_becomes_a_miss_and_an_event(new_store):
    store, cfg = new_store(slots=2, reserve_slots=1)
    manager = make_manager(store, cfg)
    store_keys(manager, [key(0, group=3)])
    step(manager)
    store_keys(manager, [key(1, group=3)])
    step(manager)
    store_keys(manager, [key(2, group=3)])  # evicts key(0) to refill the stock
    step(manager)
    assert manager.lookup(key(0, group=3), ctx()) is MISS
    events = list(manager.take_events())
    stored = [k for e in events if not e.removed for k in e.keys]
    removed = [k for e in events if e.removed for k in e.keys]
    assert key(0, group=3) in stored and key(0, group=3) in removed
    assert all(k.endswith((3).to_bytes(4, "big")) for k in stored + removed)  # group kept


def test_an_idle_engine_finds_chunks_stored_while_it_was_idle(store_and_config, clock):
    store, cfg = store_and_config
    reader = make_manager(store, cfg, holder="reader", clock=clock)
    writer = make_manager(store, cfg, holder="writer")
    store_keys(writer, [key(1)])  # the reader has not heard of it
    clock.advance(cfg.engine.max_view_age_seconds + 1)
    # A request newer than the reader's view: ask the store before answering MISS.
    assert reader.lookup(key(1), ctx("late")) is RETRY
    assert reader.has_pending_work()
    step(reader)
    assert reader.lookup(key(1), ctx("late")) is HIT  # now known, and resident
    # With a fresh view, a cold key is a MISS at once, without another call.
    calls = reader._channel.calls
    assert reader.lookup(key(2), ctx("late")) is MISS
    assert reader._channel.calls == calls


def test_a_request_waits_at_most_lookup_wait_seconds(store_and_config, clock):
    store, cfg = store_and_config
    client = HangingClient(store)
    reader = make_manager(store, cfg, holder="reader", client=client, clock=clock)
    writer = make_manager(store, cfg, holder="writer")
    store_keys(writer, [key(1)])
    step(writer)  # its own pin goes back
    clock.advance(cfg.engine.max_view_age_seconds + 1)  # the reader's view predates key(1)
    client.release.clear()
    try:
        assert reader.lookup(key(1), ctx()) is RETRY
        reader.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
        clock.advance(cfg.engine.lookup_wait_seconds / 2)
        assert reader.lookup(key(1), ctx()) is RETRY
        clock.advance(cfg.engine.lookup_wait_seconds)
        assert reader.lookup(key(1), ctx()) is MISS
        assert reader.counters()["lookups_timed_out"] == 1
    finally:
        client.release.set()
    # The answer that arrives late serves the next request at once.
    assert reader.wait_idle(10)
    reader.on_request_finished(ctx())
    assert reader.lookup(key(1), ctx("next")) is HIT


def test_engines_with_different_layouts_never_share_chunks(store_and_config):
    store, cfg = store_and_config
    a = make_manager(store, cfg, holder="a", lay=layout(model="model-a", worker_bytes=SLOT))
    b = make_manager(store, cfg, holder="b", lay=layout(model="model-b", worker_bytes=SLOT))
    assert a.namespace != b.namespace
    store_keys(a, [key(1)])
    step(b)
    assert b.lookup(key(1), ctx()) is MISS
    assert b.prepare_store([key(1)], ctx()).keys_to_store == [key(1)]


def test_dead_engine_pins_expire_with_its_lease(new_store, clock):
    store, cfg = new_store(slots=4, reserve_slots=1, lease_seconds=10)
    dead = make_manager(store, cfg, holder="dead")
    for i in range(3):  # three pinned chunks and one reserved slot: the whole pool
        out = dead.prepare_store([key(10 + i)], ctx("d"))
        dead.complete_store(out.keys_to_store, ctx("d"))
        assert dead.lookup(key(10 + i), ctx("running")) is HIT
        step(dead)
    dead._channel.close()  # the engine died: no more renewals, no clean release
    alive = make_manager(store, cfg, holder="alive")
    assert alive.prepare_store([key(1)], ctx()) is None
    clock.advance(11)
    step(alive)  # alive renews; the store notices dead's lease ran out
    step(alive)
    assert alive.prepare_store([key(1)], ctx()) is not None


class FlakyClient(LocalStoreClient):
    """A store that can be down (every call fails), or fail its next calls: before applying
    them (unreachable) or after (applied, the answer lost: a timeout)."""

    def __init__(self, store):
        super().__init__(store)
        self.down = False
        self.fail_next = 0
        self.apply_then_fail = False
        self.gate = threading.Event()  # a failing call waits for it first (a slow call)
        self.gate.set()
        self.failed = threading.Event()  # set once a call failed
        self.steps: list = []  # every request that reached the store, repeats included

    def step(self, request):
        if self.down:
            self.failed.set()
            raise ConnectionError("store unreachable")
        if self.fail_next:
            self.failed.set()
            self.fail_next -= 1
            assert self.gate.wait(30)
            if self.apply_then_fail:
                self.steps.append(request)
                super().step(request)
            raise TimeoutError("no answer in time")
        self.steps.append(request)
        return super().step(request)


def end_step(manager) -> None:
    """End a scheduler step without waiting for its call (the store may not answer)."""
    manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))


def test_a_silent_store_holds_a_request_a_few_steps_then_it_recomputes(store_and_config, clock):
    """Issue #37, finding 7: a request waits for a store that does not answer at most
    `engine.view_wait_steps` of its engine's steps (it waited up to lookup_wait_seconds,
    every step of it, before), then its lookups answer from what the engine knows.
    Steps alone are not silence: an idle engine ends its steps faster than a store
    answers, so the wait also lasts SILENCE_ROUND_TRIPS of the store's usual round trip
    (the e2e tests' hits from disk and the bucket turned into recomputes without it)."""
    store, cfg = store_and_config
    client = FlakyClient(store)
    reader = make_manager(store, cfg, holder="reader", client=client, clock=clock)
    writer = make_manager(store, cfg, holder="writer")
    store_keys(writer, [key(1)])
    clock.advance(cfg.engine.max_view_age_seconds + 1)  # the reader's view predates key(1)
    client.down = True
    for _ in range(3 * cfg.engine.view_wait_steps):  # fast steps, no time passes: still waiting
        assert reader.lookup(key(1), ctx()) is RETRY
        end_step(reader)
        assert client.failed.wait(10)
    usual = reader._silence_seconds
    assert SILENCE_FLOOR_SECONDS <= usual < cfg.engine.lookup_wait_seconds  # measured from its answers
    clock.advance(usual / 2)
    assert reader.lookup(key(1), ctx()) is RETRY
    clock.advance(usual)
    assert reader.lookup(key(1), ctx()) is MISS  # no answer for its steps: what it knows is all there is
    assert reader.counters()["lookups_store_silent"] == 1
    assert reader.counters()["lookups_timed_out"] == 0  # (lookup_wait_seconds never passed)
    client.down = False
    assert reader.wait_idle(10)  # the same call, sent again, is answered
    assert reader.counters()["control_failures"] >= 1
    store_keys(writer, [key(2)])
    clock.advance(cfg.engine.max_view_age_seconds + 1)
    assert reader.lookup(key(2), ctx("later")) is RETRY
    step(reader)
    assert reader.lookup(key(2), ctx("later")) is HIT


def reader_of_a_stored_chunk(store, cfg, client):
    """key(1) stored by another engine, and a reader through `client`: (reader, pool, slot)."""
    writer = make_manager(store, cfg, holder="writer")
    store_keys(writer, [key(1)])
    step(writer)
    reader = make_manager(store, cfg, holder="reader", client=client)
    pool = store.arena.pools[reader.namespace]
    return reader, pool, pool.lookup(key(1))


@pytest.mark.parametrize("applied", [False, True], ids=["call-lost", "answer-lost"])
def test_a_failed_call_is_sent_again_as_itself_and_applied_once(store_and_config, applied):
    """A HIT answered from the mirror whose control call fails, lost on its way or after
    the store applied it: the channel sends the same request (same id) again, so the hold
    reaches the store before any later acknowledgement, and is applied once."""
    store, cfg = store_and_config
    client = FlakyClient(store)
    reader, pool, slot = reader_of_a_stored_chunk(store, cfg, client)
    assert reader.lookup(key(1), ctx()) is HIT
    reader.prepare_load([key(1)], ctx())
    client.fail_next, client.apply_then_fail = 1, applied
    step(reader)  # fails once, then goes again and is answered
    held = [r for r in client.steps if r.hold]
    assert len(held) == 1 + applied and len({r.rid for r in held}) == 1
    assert pool._pins[slot] == {"reader": 1}  # applied once
    assert reader.counters()["control_failures"] == 1
    reader.complete_load([key(1)], ctx())
    reader.on_request_finished(ctx())
    step(reader)
    assert slot not in pool._pins


def test_a_failed_calls_unpin_does_not_undo_a_later_hold_of_the_same_slot(store_and_config):
    """Issue #37, finding 1: a pin goes idle and the call carrying its unpin fails (the
    store may have applied it); meanwhile a new request HITs the same chunk from the mirror.
    The unpin used to be queued again *behind* the new hold and undid it. Now the failed
    call goes again as itself, before the hold, and the slot stays pinned under the HIT."""
    store, cfg = store_and_config
    client = FlakyClient(store)
    reader, pool, slot = reader_of_a_stored_chunk(store, cfg, client)
    assert reader.lookup(key(1), ctx("a")) is HIT
    reader.prepare_load([key(1)], ctx("a"))
    step(reader)  # the hold reaches the store
    assert pool._pins[slot] == {"reader": 1}
    reader.complete_load([key(1)], ctx("a"))
    reader.on_request_finished(ctx("a"))
    client.fail_next, client.apply_then_fail = 1, True
    client.gate.clear()
    end_step(reader)  # R2: `unpin slot`, slow, then applied with its answer lost
    assert reader.lookup(key(1), ctx("b")) is HIT  # from the mirror: a new hold
    reader.prepare_load([key(1)], ctx("b"))
    end_step(reader)  # R3, queued behind R2
    client.gate.set()
    assert reader.wait_idle(10)
    unpins = [r for r in client.steps if slot in r.unpin]
    assert len(unpins) == 2 and unpins[0].rid == unpins[1].rid  # R2 twice, as itself
    assert pool._pins[slot] == {"reader": 1}, "the slot under request b's load was unpinned"
    reader.complete_load([key(1)], ctx("b"))
    reader.on_request_finished(ctx("b"))
    step(reader)
    assert slot not in pool._pins


def test_store_restart_drops_old_state_and_serves_again(new_store):
    store, cfg = new_store()
    client = LocalStoreClient(store)
    manager = make_manager(store, cfg, client=client)
    store_keys(manager, [key(1)])
    old_epoch = store.arena.epoch
    store.close()
    client.store, _ = new_store()  # Ray restarted the actor: empty, new epoch
    step(manager)  # reply carries the new epoch; the manager re-registers
    step(manager)
    assert manager.lookup(key(1), ctx("new")) is MISS
    assert client.store.arena.epoch != old_epoch
    store_keys(manager, [key(2)])
    assert client.store.keys(manager.namespace) == [key(2)]


def test_reset_cache_purges_the_namespace(store_and_config):
    store, cfg = store_and_config
    manager = make_manager(store, cfg)
    store_keys(manager, [key(1), key(2)])
    manager.reset_cache()
    assert manager.lookup(key(1), ctx()) is MISS
    step(manager)
    assert store.keys(manager.namespace) == []
    if manager._reset_flush_signal:  # vLLM 0.33 reports the flush after every reset; the stored chunks' pins wait for it
        manager.on_reset_flushed()
    step(manager)
    assert store.arena.pools[manager.namespace].stats()["pinned"] == 0


def test_reset_keeps_slots_of_inflight_loads_until_vllm_flushed_them(store_and_config):
    from kvstrata.connector.compat import HAS_RESET_FLUSHED

    store, cfg = store_and_config
    manager = make_manager(store, cfg)
    store_keys(manager, [key(1)])
    step(manager)
    manager.lookup(key(1), ctx())
    step(manager)
    assert manager.lookup(key(1), ctx()) is HIT
    manager.prepare_load([key(1)], ctx())  # the load is in flight when the reset comes
    manager.reset_cache()
    pool = store.arena.pools[manager.namespace]
    step(manager)
    assert store.keys(manager.namespace) == []
    assert pool.stats()["orphans"] == 1  # purged from the index, bytes still pinned
    if HAS_RESET_FLUSHED:
        step(manager)
        assert pool.stats()["orphans"] == 1
        manager.on_reset_flushed()
    step(manager)
    assert pool.stats()["orphans"] == 0 and pool.stats()["pinned"] == 0


def test_lock_is_a_real_lock_held_across_threads(store_and_config):
    manager = make_manager(*store_and_config)
    acquired = []
    with manager.lock:
        t = threading.Thread(target=lambda: acquired.append(manager.lock.acquire(timeout=0.05)))
        t.start()
        t.join(5)
    assert acquired == [False]


def test_stats_report_declared_metrics(store_and_config):
    from kvstrata.connector.spec import StrataSpec

    manager = make_manager(*store_and_config)
    store_keys(manager, [key(1)])
    declared = StrataSpec.build_metric_definitions({})
    reduced = manager.get_stats().reduce()
    assert reduced["kvstrata:chunks_stored"] == 1
    assert set(reduced) <= set(declared)


def test_first_stats_give_every_counter_a_series_then_only_growth(store_and_config):
    """vLLM creates a Prometheus series only for a name it is sent: a counter that never
    grows must still be sent once, at zero, or `/metrics` has no sample for it."""
    from kvstrata.connector.metrics import COUNTER_NAMES, GAUGE_NAMES, metric_name

    manager = make_manager(*store_and_config)
    first = manager.get_stats().reduce()
    assert set(first) == set(map(metric_name, [*COUNTER_NAMES, *GAUGE_NAMES]))
    assert all(first[metric_name(name)] == 0 for name in COUNTER_NAMES)
    store_keys(manager, [key(1)])
    second = manager.get_stats().reduce()
    grown = {name for name in map(metric_name, COUNTER_NAMES) if name in second}
    assert grown == {metric_name("chunks_stored")} and second[metric_name("chunks_stored")] == 1
    third = manager.get_stats().reduce()
    assert set(third) == set(map(metric_name, GAUGE_NAMES))  # nothing grew: gauges only


def test_reply_received_during_the_forward_pass_serves_the_next_pass(store_and_config, clock):
    store, cfg = store_and_config
    reader = make_manager(store, cfg, holder="reader", clock=clock)
    writer = make_manager(store, cfg, holder="writer")
    store_keys(writer, [key(1)])
    clock.advance(cfg.engine.max_view_age_seconds + 1)  # the reader's view predates key(1)
    assert reader.lookup(key(1), ctx()) is RETRY
    reader.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
    assert reader._channel.wait_idle(10)  # the reply came while no pass was open
    calls = reader._channel.calls
    assert reader.lookup(key(1), ctx()) is HIT  # the next pass is served from it
    assert reader._channel.calls == calls


def test_replies_are_not_applied_between_a_hit_and_its_prepare_load(store_and_config):
    store, cfg = store_and_config
    writer = make_manager(store, cfg, holder="writer")
    out = writer.prepare_store([key(1)], ctx("w"))
    pool = store.arena.pools[writer.namespace]
    pool.view(int(out.store_spec.block_ids[0]))[:] = 42
    writer.complete_store([key(1)], ctx("w"))
    step(writer)
    step(writer)  # its commit answered, the writer's own pin goes
    reader = make_manager(store, cfg, holder="reader")
    reader.lookup(key(1), ctx())
    step(reader)
    assert reader.lookup(key(1), ctx()) is HIT
    # Mid-pass, an operator purges the namespace and a reply reporting it arrives.
    store.purge(reader.namespace)
    reader._channel.submit(reader._heartbeat_request())
    assert reader._channel.wait_idle(10)
    # The pass that saw HIT still loads the pinned bytes.
    spec = reader.prepare_load([key(1)], ctx())
    assert (pool.view(int(spec.block_ids[0])) == 42).all()
    reader.complete_load([key(1)], ctx())
    reader.on_request_finished(ctx())
    step(reader)
    assert reader.lookup(key(1), ctx("later")) is MISS
    step(reader)
    assert pool.stats()["orphans"] == 0 and pool.stats()["pinned"] == 0


def test_a_slot_released_and_hit_again_while_the_store_is_busy_stays_pinned(store_and_config):
    """A pin released, then its chunk hit again from the mirror while a call is in flight:
    the requests merge into one that holds and unpins the slot (holds apply first). The slot
    must stay pinned under the second HIT (#29 measured a promotion written over it)."""
    store, cfg = store_and_config
    client = HangingClient(store)
    reader, pool, slot = reader_of_a_stored_chunk(store, cfg, client)
    assert reader.lookup(key(1), ctx("a")) is HIT  # from the mirror: held with the next call
    step(reader)
    assert "reader" in pool._pins.get(slot, ())
    client.release.clear()
    reader.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))  # in flight, hangs
    reader.prepare_load([key(1)], ctx("a"))
    reader.complete_load([key(1)], ctx("a"))
    reader.on_request_finished(ctx("a"))
    reader.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))  # queued: unpin
    assert reader.lookup(key(1), ctx("b")) is HIT  # from the mirror again: a new hold
    reader.prepare_load([key(1)], ctx("b"))
    reader.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))  # merged: unpin + hold
    client.release.set()
    assert reader.wait_idle(10)
    assert "reader" in pool._pins.get(slot, ()), "the slot under request b's load was unpinned"
    reader.complete_load([key(1)], ctx("b"))
    reader.on_request_finished(ctx("b"))
    step(reader)
    assert "reader" not in pool._pins.get(slot, ())  # and nothing is left pinned after


def test_an_engine_whose_lease_ran_out_registers_again_and_drops_its_old_pins(new_store, clock):
    """Silent for a whole lease, it lost its pins: its next call is refused, it starts over."""
    store, cfg = new_store(lease_seconds=10)
    manager = make_manager(store, cfg, holder="sleepy")
    store_keys(manager, [key(1)])
    pool = store.arena.pools[manager.namespace]
    first = manager._epoch
    clock.advance(11)
    step(manager)  # refused: the reply's epoch is not its own
    assert manager._epoch != first and not manager._pinned
    assert pool.stats()["pinned"] == 0
    assert manager.lookup(key(1), ctx("again")) is HIT  # resident: answered from the new mirror
    manager.prepare_load([key(1)], ctx("again"))
    step(manager)
    assert pool.stats()["pinned"] == 1  # held under the new registration
