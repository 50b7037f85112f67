"""`admission.load: break_even` behind the manager: a prefix split across the arena and a
slow tier loads its arena part and recomputes the rest -- whole chunks, in prefix order,
and no group beyond its anchor -- while a fast tier or `always` loads everything; a tier
never measured or already queued past the break-even is recomputed at once (probed in
the background when unmeasured), and a request that waited lookup_wait_seconds and
recomputed anyway is counted. In-process node store with a disk tier whose measured
speed the test sets."""

from __future__ import annotations

import dataclasses
import time

import pytest

from kvstrata.store.node_store import LocalStoreClient, NodeStore
from kvstrata.config import load_config
from kvstrata.connector.compat import LookupResult, ReqContext
from kvstrata.connector.manager import StrataManager
from kvstrata.tiers.disk import HEADER_BYTES
from tests.connector.harness import SLOT, step, store_chunks
from tests.utils import FakeClock, key, layout, store_config

HIT, MISS, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY
TOKENS = 32  # per chunk (tests.utils.layout)
RECOMPUTE = 1000.0  # tokens/s: two chunks recompute in 64 ms


@pytest.fixture
def env(tmp_path):
    made = {"stores": [], "managers": []}

    def store(load: str = "break_even"):
        disk = {"path": str(tmp_path / "disk"), "capacity": 64 * (SLOT + HEADER_BYTES), "write_policy": "write_through"}
        raw = store_config(tmp_path, capacity=12 * SLOT, reserve_slots=2, disk=disk)
        raw["admission"] = {"load": load, "safety_margin": 0.2}
        raw["engine"]["recompute_tokens_per_second"] = RECOMPUTE
        node_store = NodeStore(load_config(raw), "node0")
        made["stores"].append(node_store)
        return node_store

    def manager(node_store, holder, hybrid=False, clock=time.monotonic):
        kv = layout(worker_bytes=SLOT)
        if hybrid:  # group 0 full attention (the anchor), group 1 a sliding window
            kv = dataclasses.replace(kv, group_ids=(0, 1), tokens_per_block=(TOKENS, TOKENS), anchor_groups=(0,))
        m = StrataManager(LocalStoreClient(node_store), kv, node_store.config, holder, enable_events=True, clock=clock)
        made["managers"].append(m)
        assert m.wait_idle(10)
        return m

    yield store, manager
    for m in made["managers"]:
        m.shutdown()
    for s in made["stores"]:
        s.close()


def split_prefix(store, writer, keys_on_disk, keys_in_arena):
    """`keys_on_disk` end up on disk only, `keys_in_arena` in the arena (and on disk)."""
    store_chunks(store, writer, keys_on_disk, settle=True)
    pool = store.arena.pools[writer.namespace]
    filler = 100
    while any(pool.lookup(k) is not None for k in keys_on_disk):
        store_chunks(store, writer, [key(filler), key(filler + 1)], seed=filler, settle=True)
        step(writer, store)
        filler += 2
        assert filler < 200
    for i in range(0, len(keys_in_arena), 2):  # two at a time: the writer's stock of slots
        store_chunks(store, writer, keys_in_arena[i : i + 2], seed=7 + i, settle=True)
        step(writer, store)
    assert all(pool.lookup(k) is not None for k in keys_in_arena)


def request(positions: dict[bytes, int]) -> ReqContext:
    """A request whose chunks vLLM has recorded (as its scheduler does before lookups)."""
    if not hasattr(ReqContext, "set_offload_key_position"):
        # break_even then loads everything (docs/admission.md, "When it loads anyway").
        pytest.skip("vLLM < 0.32 records no chunk positions: break_even has nothing to decide")
    context = ReqContext(req_id="prompt")
    for k, end_token in positions.items():
        context.set_offload_key_position(k, end_token)
    return context


def measured(store, reader, bytes_per_second: float) -> None:
    """The disk tier's promotions delivered `bytes_per_second`; the reader hears it."""
    for size in (SLOT, 4 * SLOT, 16 * SLOT):
        store.tier_estimates.observe("disk", size, size / bytes_per_second)
    step(reader, store)
    assert "disk" in reader._load_admission.costs


def test_arena_part_loads_and_the_slow_rest_is_recomputed(env):
    make_store, make_manager = env
    store = make_store()
    writer = make_manager(store, "writer")
    # Chunks 1, 2 in the arena; 3, 4 only on a disk delivering 4 KB/s: 2 s to load, 64 ms to recompute.
    split_prefix(store, writer, [key(3), key(4)], [key(1), key(2)])
    reader = make_manager(store, "reader")
    measured(store, reader, 4096.0)
    context = request({key(i): i * TOKENS for i in (1, 2, 3, 4)})
    assert [reader.lookup(key(i), context) for i in (1, 2, 3, 4)] == [HIT, HIT, MISS, MISS]
    assert reader.prepare_load([key(1), key(2)], context) is not None  # the arena part loads
    assert reader._counters["loads_skipped_disk"] == 2
    estimate = store.stats()["report"]["admission"]["estimates"]["disk"]  # what `kvstrata status` shows
    assert estimate["bytes_per_second"] == pytest.approx(4096.0)
    # The decision holds for the whole request, even on a later scheduling pass.
    assert reader.lookup(key(3), context) is MISS
    reader.on_request_finished(context)


@pytest.mark.parametrize(
    ("load", "bytes_per_second"),
    [("break_even", 1e9), ("always", 4096.0)],
    ids=["fast-tier", "always"],
)
def test_a_fast_tier_or_always_loads_the_rest(env, load, bytes_per_second):
    make_store, make_manager = env
    store = make_store(load)
    writer = make_manager(store, "writer")
    split_prefix(store, writer, [key(3), key(4)], [key(1), key(2)])
    reader = make_manager(store, "reader")
    measured(store, reader, bytes_per_second)
    context = request({key(i): i * TOKENS for i in (1, 2, 3, 4)})
    # On disk only: RETRY while the store promotes it (the load path).
    assert [reader.lookup(key(i), context) for i in (1, 2, 3)] == [HIT, HIT, RETRY]
    assert reader._counters["loads_skipped_disk"] == 0


def test_a_tier_never_measured_is_recomputed_at_once_and_probed_in_the_background(env):
    """#48, finding 1: a request whose rest sits on a tier this engine has no figure for
    does not wait on it (up to lookup_wait_seconds, then recompute anyway): it recomputes
    now, and the chunks go to the store as probes, whose promotion measures the tier."""
    make_store, make_manager = env
    store = make_store()
    writer = make_manager(store, "writer")
    split_prefix(store, writer, [key(3), key(4)], [key(1), key(2)])
    reader = make_manager(store, "reader")
    assert "disk" not in reader._load_admission.costs  # nothing read from this disk yet
    context = request({key(i): i * TOKENS for i in (1, 2, 3, 4)})
    assert [reader.lookup(key(i), context) for i in (1, 2, 3, 4)] == [HIT, HIT, MISS, MISS]  # no RETRY
    assert reader._counters["loads_skipped_disk"] == 2 and reader._counters["chunks_probed"] == 2
    assert reader._counters["requests_waited_then_recomputed"] == 0
    reader.prepare_load([key(1), key(2)], context)
    reader.complete_load([key(1), key(2)], context)
    reader.on_request_finished(context)
    for _ in range(20):  # the probe's promotion: a step asks, the store reads the disk, a step collects
        step(writer)  # (evicted slots are reused once every engine saw their chunks go)
        step(reader, store)
        if not reader._pin_waiters:
            break
    assert not reader._pin_waiters, reader._pin_waiters
    assert store.tier_estimates._tiers["disk"].batches >= 1  # the disk read was measured
    step(reader, store)
    again = request({key(i): i * TOKENS for i in (1, 2, 3, 4)})
    assert [reader.lookup(key(i), again) for i in (1, 2, 3, 4)] == [HIT] * 4  # probed into the arena
    reader.on_request_finished(again)


def test_a_tier_whose_queue_exceeds_the_break_even_is_recomputed():
    """Measured fast enough for this request alone (2 chunks: 16 ms against 64 ms of
    recompute), but 8 chunks this engine already waits on from it are ahead in the
    store's queue: 80 ms of reading before the last of its own lands, past the margin."""
    from kvstrata.config import AdmissionConfig
    from kvstrata.connector.load_admission import LoadAdmission
    from kvstrata.tiers.changelog import STORAGE

    counters = {"loads_skipped_disk": 0, "loads_skipped_peer": 0, "loads_skipped_object": 0, "chunks_probed": 0}
    admission = LoadAdmission(AdmissionConfig(load="break_even", safety_margin=0.2), RECOMPUTE, SLOT, counters)
    admission.receive_costs({"disk": (0.0, SLOT / 0.008, 0.0)}, now=100.0)  # 8 ms a chunk
    queued = [key(100 + i) for i in range(8)]
    mirror = {k: {STORAGE} for k in [key(1), key(2), *queued]}
    positions = {key(1): TOKENS, key(2): 2 * TOKENS}

    def recomputes(req_id: str, waiting) -> bool:
        return admission.decide(req_id, TOKENS, positions, mirror, (), lambda k: 0, 100.0, waiting)

    assert not recomputes("alone", [])
    assert not recomputes("own keys are not a queue", [key(1), key(2)])
    assert recomputes("behind eight", queued)
    assert counters["loads_skipped_disk"] == 2 and counters["chunks_probed"] == 0  # measured: no probe


def test_a_request_that_waited_out_lookup_wait_seconds_is_counted_once(env):
    make_store, make_manager = env
    store = make_store("always")
    writer = make_manager(store, "writer")
    split_prefix(store, writer, [key(3), key(4)], [key(1), key(2)])
    reader = make_manager(store, "reader")
    now = [1000.0]
    reader._clock = lambda: now[0]
    context = request({key(i): i * TOKENS for i in (1, 2, 3, 4)})
    assert [reader.lookup(key(i), context) for i in (1, 2, 3)] == [HIT, HIT, RETRY]
    now[0] += reader._lookup_wait + 0.1  # the promotion did not land in time
    assert [reader.lookup(key(i), context) for i in (3, 4)] == [MISS, MISS]
    assert reader._counters["requests_waited_then_recomputed"] == 1  # one request, however many chunks
    reader.on_request_finished(context)


def test_no_group_is_loaded_beyond_its_anchor(env):
    make_store, make_manager = env
    store = make_store()
    writer = make_manager(store, "writer", hybrid=True)
    # The anchor group's chunks 3, 4 are on the slow disk only; the window group's chunks
    # at every position are in the arena. Recomputing from chunk 3 must recompute the
    # window group there too: vLLM scans the window group from the end, so a HIT at 4
    # would otherwise load a window without the full-attention chunks it belongs to.
    split_prefix(store, writer, [key(3), key(4)], [key(1), key(2), key(1, 1), key(2, 1), key(3, 1), key(4, 1)])
    reader = make_manager(store, "reader", hybrid=True)
    measured(store, reader, 4096.0)
    positions = {key(i, g): i * TOKENS for i in (1, 2, 3, 4) for g in (0, 1)}
    context = request(positions)
    assert [reader.lookup(key(i), context) for i in (1, 2, 3)] == [HIT, HIT, MISS]
    # The window group, scanned from the end: nothing at or after the cut.
    assert [reader.lookup(key(i, 1), context) for i in (4, 3, 2)] == [MISS, MISS, HIT]


def test_an_estimate_goes_stale_on_the_engine_too():
    """The engine ages what the store sent by the time since it arrived. A tier measured
    slow long ago is still recomputed, and measured again in the background: its chunks
    are handed out as probes, once per tier per `stale_seconds`. A stale tier measured
    fast is loaded (which measures it)."""
    from kvstrata.config import AdmissionConfig
    from kvstrata.connector.load_admission import LoadAdmission, source_tier
    from kvstrata.tiers.changelog import OBJECT, PEER, STORAGE

    counters = {"loads_skipped_disk": 0, "loads_skipped_peer": 0, "loads_skipped_object": 0, "chunks_probed": 0}
    admission = LoadAdmission(AdmissionConfig(load="break_even", stale_seconds=30), 1000.0, SLOT, counters)
    admission.receive_costs({"object": (0.0, 4096.0, 5.0)}, now=100.0)  # measured 5 s before it arrived
    mirror = {key(1): {OBJECT}, key(2): {OBJECT}}
    positions = {key(1): TOKENS, key(2): 2 * TOKENS}

    def recomputes(req_id: str, now: float) -> bool:
        return admission.decide(req_id, TOKENS, positions, mirror, (), lambda k: 0, now)

    assert recomputes("fresh", now=110.0)  # 15 s old: trusted, 2 s of loading vs 64 ms
    assert counters["loads_skipped_object"] == 2 and admission.take_probes() == []
    assert recomputes("stale", now=130.0)  # 35 s old: still recomputed, and probed
    assert admission.take_probes() == [key(1), key(2)] and counters["chunks_probed"] == 2
    assert recomputes("stale again", now=140.0)  # the probe is out: no second one
    assert admission.take_probes() == [] and counters["chunks_probed"] == 2
    assert recomputes("probe lost", now=161.0)  # stale_seconds after it: probed again
    assert admission.take_probes() == [key(1), key(2)]
    admission.receive_costs({"object": (0.0, 1e9, 40.0)}, now=200.0)  # measured fast, 40 s ago
    assert not recomputes("stale but fast", now=200.0)  # loads, and that measures it
    assert admission.take_probes() == []
    assert source_tier({STORAGE, OBJECT}) == "disk" and source_tier({PEER, OBJECT}) == "peer"


def test_a_stale_slow_tier_is_probed_in_the_background_and_the_request_does_not_wait(env):
    """The store's disk estimate says slow and is older than `stale_seconds`: the request
    recomputes at once (no RETRY), and the chunks it skipped are promoted with no request
    waiting -- which renews the estimate, releases their pins, counts no promoted hit, and
    leaves them in the arena for the next request."""
    from kvstrata.tiers.estimates import TierEstimates

    make_store, make_manager = env
    store = make_store()
    writer = make_manager(store, "writer")
    split_prefix(store, writer, [key(3), key(4)], [key(1), key(2)])
    reader = make_manager(store, "reader")
    now = [1000.0]
    store.ctx.tier_estimates = TierEstimates(clock=lambda: now[0])  # the estimate's age, set by the test
    measured(store, reader, 4096.0)
    now[0] += 60.0  # stale_seconds is 30
    step(reader, store)
    assert reader._load_admission.costs["disk"].age_seconds == pytest.approx(60.0)
    context = request({key(i): i * TOKENS for i in (1, 2, 3, 4)})
    assert [reader.lookup(key(i), context) for i in (1, 2, 3, 4)] == [HIT, HIT, MISS, MISS]
    assert reader._counters["loads_skipped_disk"] == 2 and reader._counters["chunks_probed"] == 2
    reader.prepare_load([key(1), key(2)], context)
    reader.complete_load([key(1), key(2)], context)
    reader.on_request_finished(context)
    pool = store.arena.pools[reader.namespace]
    for _ in range(20):  # the probe's promotion: a step asks, the store reads the disk, a step collects
        step(writer)  # (evicted slots are reused once every engine saw their chunks go)
        step(reader, store)
        if not reader._pin_waiters:
            break
    assert not reader._pin_waiters, reader._pin_waiters
    step(reader, store)  # the probe's pins, held by no request, released
    step(reader, store)
    assert reader._load_admission.costs["disk"].age_seconds < 1.0  # measured again
    assert pool.stats()["pinned"] == 0 and reader._counters["chunks_promoted"] == 0
    assert all(pool.lookup(k) is not None for k in (key(3), key(4)))
    again = request({key(i): i * TOKENS for i in (1, 2, 3, 4)})
    assert [reader.lookup(key(i), again) for i in (1, 2, 3, 4)] == [HIT] * 4  # from the arena now
    assert reader._counters["chunks_probed"] == 2
    reader.on_request_finished(again)


def test_a_request_newer_than_the_view_decides_on_a_fresh_one(env):
    """A cut is final for the request, so it is taken on a view as fresh as a MISS needs:
    chunks promoted into the arena since the engine's last view (a probe, another engine's
    pin) are loaded, not recomputed because the stale view still had them on a slow tier
    (the break-even e2e test on a loaded machine, 28 Nov 2026: a probed prompt, promoted,
    was recomputed)."""
    make_store, make_manager = env
    store = make_store()
    writer = make_manager(store, "writer")
    split_prefix(store, writer, [key(3), key(4)], [key(1), key(2)])
    clock = FakeClock()
    reader = make_manager(store, "reader", clock=clock)
    measured(store, reader, 4096.0)  # the disk is slow: its chunks would be recomputed
    # An operator's pin (`kvstrata warm --pin`) brings 3 and 4 into the arena; the reader has not heard.
    for _ in range(20):  # asked again until they landed, as `kvstrata warm` does
        outcome = store.pin_chunks(reader.namespace, [key(3), key(4)])
        step(writer, store)  # the store moves promotions on at an engine's step
        if "waiting" not in outcome:
            break
    assert store.arena.pools[reader.namespace].lookup(key(4)) is not None, outcome
    assert "cpu" not in reader._mirror[key(4)]  # the reader's view is from before the promotion
    clock.advance(store.config.engine.max_view_age_seconds + 1)  # a request newer than that view
    context = request({key(i): i * TOKENS for i in (1, 2, 3, 4)})
    assert [reader.lookup(key(i), context) for i in (1, 2, 3)] == [HIT, HIT, RETRY]  # a fresher view first
    step(reader)
    assert [reader.lookup(key(i), context) for i in (3, 4)] == [HIT, HIT]  # then loaded, all of it
    assert reader._counters["loads_skipped_disk"] == 0
    reader.on_request_finished(context)
