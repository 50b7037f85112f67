"""A busy machine must not slow the scheduler's calls (#49): the control thread never takes
the scheduler's lock, heartbeats acknowledge no view the scheduler could still answer HITs
without, idle answers do not pile up, a chunk this engine stored is found again with no
round trip, and a view is as fresh as the store's round trips allow.

Interleavings are forced with events and bounded joins, or driven without threads through
the manager's channel seam (the simulation's `SimChannel`), never with sleeps."""

from __future__ import annotations

import threading

import pytest

from kvstrata.store.local_client import LocalStoreClient
from kvstrata.connector.compat import LookupResult, ScheduleEndContext
from kvstrata.connector.inbox import merge_idle_replies
from kvstrata.connector.manager import StrataManager
from kvstrata._dev.sim.channel import SimChannel
from tests.connector.harness import HangingClient, ctx, step
from tests.connector.test_manager import make_manager, make_store, store_keys
from tests.connector.test_manager import _close_managers, clock, managers, new_store, store_and_config  # noqa: F401
from tests.utils import key, layout

HIT, MISS, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY
SLOT = 4096
END = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def threadless_manager(store, cfg, holder="reader", clock=None) -> StrataManager:
    """A manager whose control calls nobody makes: the test delivers answers itself."""
    kwargs = {"clock": clock} if clock is not None else {}
    manager = StrataManager(
        LocalStoreClient(store), layout(worker_bytes=SLOT), cfg, holder, channel=SimChannel, **kwargs
    )
    managers.append(manager)
    return manager


def deliver(store, manager) -> int:
    """One heartbeat of `manager`, answered by the store and received as the control thread
    would receive it; returns the answer's sequence."""
    request = manager._heartbeat_request()
    reply = LocalStoreClient(store).step(request)
    assert manager._receive_reply(request, reply, manager._clock()) is True
    return reply.seq


def test_a_control_thread_stuck_with_a_reply_does_not_block_a_lookup(store_and_config):
    """The control thread is held mid-way through a reply (where it applied replies under the
    scheduler's lock before #49); a lookup on another thread still answers, from the mirror."""
    store, cfg = store_and_config
    writer = make_manager(store, cfg, holder="writer")
    store_keys(writer, [key(1)])
    reader = make_manager(store, cfg, holder="reader")
    entered, gate = threading.Event(), threading.Event()
    on_control = lambda: threading.current_thread().name.startswith("kvstrata-control")  # noqa: E731
    receive, apply_reply = reader._receive, reader._apply_reply

    def stuck_receive(entry):
        receive(entry)
        if on_control():
            entered.set()
            assert gate.wait(30)

    def stuck_apply(*args):
        if on_control():  # (the old design applied here, holding the scheduler's lock)
            entered.set()
            assert gate.wait(30)
        apply_reply(*args)

    reader._receive, reader._apply_reply = stuck_receive, stuck_apply
    answers: list[LookupResult] = []
    scheduler = threading.Thread(target=lambda: answers.append(reader.lookup(key(1), ctx("a"))))
    try:
        reader._channel.submit(reader._heartbeat_request())
        assert entered.wait(10)  # the control thread holds its reply
        scheduler.start()
        scheduler.join(10)
        assert not scheduler.is_alive(), "the scheduler's lookup waited for the control thread"
        assert answers == [HIT]
    finally:
        gate.set()
        scheduler.join(10) if scheduler.is_alive() else None
    reader._receive, reader._apply_reply = receive, apply_reply
    assert reader.wait_idle(10)


def test_a_heartbeat_acknowledges_no_view_newer_than_the_open_pass(store_and_config, clock):
    """During a pass a heartbeat acknowledges the view the pass answers from (its HITs' holds
    go out with the step's request); between passes, the newest received, which the next
    pass applies before its first HIT."""
    store, cfg = store_and_config
    reader = threadless_manager(store, cfg, clock=clock)
    writer = make_manager(store, cfg, holder="writer")
    opened = reader._seq
    assert reader.lookup(key(9), ctx("a")) is MISS  # a pass is open
    store_keys(writer, [key(1)])
    newer = deliver(store, reader)
    assert newer > opened
    assert reader._heartbeat_request().known_seq == opened
    assert reader._heartbeat_request().hold == []
    reader.on_schedule_end(END)  # applies it, queues the holds, closes the pass
    assert reader._seq == newer and reader._heartbeat_request().known_seq == newer
    store_keys(writer, [key(2)])
    step(writer)  # the writer's own pin of key(2) goes
    newest = deliver(store, reader)
    # Between passes: acknowledged before it is applied ...
    assert reader._seq == newer and reader._heartbeat_request().known_seq == newest
    # ... and the next pass applies it before it answers.
    assert reader.lookup(key(2), ctx("b")) is HIT
    assert reader._seq == newest


def test_answers_to_heartbeats_of_an_idle_engine_fold_into_one_entry(store_and_config):
    store, cfg = store_and_config
    reader = threadless_manager(store, cfg)
    writer = make_manager(store, cfg, holder="writer")
    for i in range(40):
        store_keys(writer, [key(i)])
        deliver(store, reader)
    assert len(reader._inbox) == 1
    reader.on_schedule_end(END)
    pool = store.arena.pools[reader.namespace]
    resident = {key(i): pool.lookup(key(i)) for i in range(40)}  # (16 slots: most were evicted meanwhile)
    assert reader._resident == {k: slot for k, slot in resident.items() if slot is not None}


def test_folding_keeps_the_last_change_of_a_key_and_starts_over_at_a_snapshot(store_and_config):
    from kvstrata.protocol import StepReply, StepRequest

    request = StepRequest(holder="h", namespace="n", epoch="e")
    first = ("reply", request, StepReply(epoch="e", seq=1, changes=[(b"a", "CPU", True)], slots={b"a": 3}), 1.0, 0.1)
    second = ("reply", request, StepReply(epoch="e", seq=2, changes=[(b"a", "CPU", False)]), 2.0, 0.2)
    folded = merge_idle_replies(first, second)
    assert folded[2].seq == 2 and folded[2].changes == [(b"a", "CPU", False)] and folded[3] == 2.0
    snapshot = ("reply", request, StepReply(epoch="e", seq=3, changes=[(b"b", "CPU", True)], snapshot=True), 3.0, 0.1)
    assert merge_idle_replies(folded, snapshot) is snapshot
    granted = ("reply", request, StepReply(epoch="e", seq=4, reserved=[5]), 4.0, 0.1)
    assert merge_idle_replies(snapshot, granted) is None  # an answer that grants something stays itself


def test_a_chunk_stored_here_hits_at_once_while_its_commit_is_unanswered(store_and_config):
    """The request that stored a chunk finished; the store answers the commit late (a busy
    machine: hundreds of ms). The chunk's pin stays until the answer gives the mirror its
    slot, so the next request HITs at its first lookup instead of asking the store."""
    store, cfg = store_and_config
    client = HangingClient(store)
    writer = make_manager(store, cfg, holder="writer", client=client)
    out = writer.prepare_store([key(1)], ctx("a"))
    writer.complete_store(out.keys_to_store, ctx("a"))
    client.release.clear()
    try:
        writer.on_request_finished(ctx("a"))
        writer.on_schedule_end(END)  # the commit goes out; the store does not answer yet
        writer.on_schedule_end(END)
        assert writer.lookup(key(1), ctx("b")) is HIT
        assert writer.counters()["lookups_retried"] == 0
    finally:
        client.release.set()
    assert writer.wait_idle(10)
    spec = writer.prepare_load([key(1)], ctx("b"))
    assert list(spec.block_ids) == list(out.store_spec.block_ids)
    writer.complete_load([key(1)], ctx("b"))
    writer.on_request_finished(ctx("b"))
    step(writer)
    step(writer)
    pool = store.arena.pools[writer.namespace]
    assert pool.stats()["pinned"] == 0  # answered, idle: let go
    assert writer.lookup(key(1), ctx("c")) is HIT  # from the mirror now


@pytest.mark.parametrize("configured", [0.1, 0.0])
def test_a_view_is_fresh_enough_within_two_of_the_stores_round_trips(tmp_path, clock, configured):
    """Round trips of 0.5 s: a view 0.6 s old is as fresh as this engine can hold one, and a
    cold chunk is a MISS at once; with max_view_age_seconds 0 it still asks."""
    store, cfg = make_store(tmp_path, clock)
    cfg = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"max_view_age_seconds": configured})})
    try:
        reader = threadless_manager(store, cfg, clock=clock)
        for _ in range(3):
            reader._measure_round_trip(0.5)
        clock.advance(0.6)
        assert reader.lookup(key(7), ctx("a")) is (MISS if configured else RETRY)
    finally:
        store.close()


def test_a_view_is_fresh_enough_within_two_of_the_longest_recent_round_trips(tmp_path, clock):
    """Round trips that vary (0.1, 0.1, 0.5 s: a busy machine's p50 and p90, #49): a view
    0.8 s old is one this engine holds between two replies while it steps, so a cold chunk
    is a MISS at once, not a wait for a view the store cannot deliver sooner. A view older
    than that (the engine sat idle) still asks."""
    store, cfg = make_store(tmp_path, clock)
    cfg = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"max_view_age_seconds": 0.1})})
    try:
        reader = threadless_manager(store, cfg, clock=clock)
        for seconds in (0.1, 0.1, 0.5):
            reader._measure_round_trip(seconds)
        clock.advance(0.8)
        assert reader.lookup(key(7), ctx("a")) is MISS
        clock.advance(0.5)  # 1.3 s: older than two of the longest round trips
        assert reader.lookup(key(8), ctx("b")) is RETRY
    finally:
        store.close()
