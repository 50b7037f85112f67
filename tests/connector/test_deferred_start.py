"""An engine that serves while its weights are fingerprinted (issue #50, item 4): until
kvstrata is on, every lookup is a MISS and nothing is stored; then the manager of the
fingerprinted namespace takes over between two calls, and nothing of the time before
(requests answered meanwhile, a reset meanwhile) leaks into it."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from kvstrata.connector.compat import LookupResult, ScheduleEndContext
from kvstrata.connector.deferred_start import DeferredStart, Starting
from kvstrata.connector.metrics import metric_name
from kvstrata.connector.weight_updates import WeightGenerations
from tests.connector.test_manager import (  # noqa: F401 - fixtures
    SLOT,
    _close_managers,
    clock,
    ctx,
    make_manager,
    managers,
    new_store,
    store_keys,
)
from tests.connector.test_weight_updates import OLD, settled
from tests.utils import key

HIT, MISS = LookupResult.HIT, LookupResult.MISS
WAIT_S = 10


class Build:
    """The first manager's build, held until the test lets it finish; records shutdowns."""

    def __init__(self, store, cfg, fail: bool = False):
        self.store, self.cfg, self.fail = store, cfg, fail
        self.go = threading.Event()
        self.built = []
        self.shut_down = []

    def __call__(self):
        assert self.go.wait(WAIT_S)
        if self.fail:
            raise OSError("the checkpoint could not be read")
        manager = make_manager(self.store, self.cfg, holder="engine-a", lay=OLD)
        shutdown = manager.shutdown
        manager.shutdown = lambda: (self.shut_down.append(manager), shutdown())
        self.built.append(manager)
        return manager

    def finish(self, pending: DeferredStart) -> None:
        self.go.set()
        assert pending.wait(WAIT_S)


def deferred(store, cfg, build: Build) -> tuple[WeightGenerations, DeferredStart]:
    def start(generation: int):
        lay = dataclasses.replace(OLD, model_identity=f"weights-v1-updated-{generation}")
        return make_manager(store, cfg, holder=f"engine-a-g{generation}", lay=lay)

    pending = DeferredStart(build)
    return WeightGenerations(Starting(), start, pending), pending


def counters(engine) -> dict[str, int]:
    stats = engine.get_stats()
    return stats.reduce() if stats is not None else {}


def end_step(engine) -> None:
    engine.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))


def test_the_engine_serves_misses_until_kvstrata_is_on_then_hits(new_store):
    store, cfg = new_store(slots=64)
    other = make_manager(store, cfg, holder="engine-b", lay=OLD)  # the same weights, on already
    store_keys(other, [key(1)])
    build = Build(store, cfg)
    engine, pending = deferred(store, cfg, build)

    engine.on_new_request(ctx("early"))
    assert engine.starting and engine.lookup(key(1), ctx("early")) is MISS  # resident, yet not served
    assert engine.prepare_store([key(2), key(3)], ctx("early")).keys_to_store == []
    end_step(engine)
    assert engine.starting  # still being built: a step end changes nothing

    build.finish(pending)
    engine.on_new_request(ctx("late"))  # the first call after the build: kvstrata is on
    assert not engine.starting and engine.current is build.built[0]
    assert settled(engine, key(1), "late") is HIT
    # A request answered before: its first chunks were never stored, so it stores none.
    assert engine.prepare_store([key(4)], ctx("early")).keys_to_store == []
    store_keys(engine, [key(5)], req="late")
    assert settled(engine, key(5), "after") is HIT

    reported = counters(engine)
    assert reported.get(metric_name("lookups_before_cache_on")) == 1
    assert reported.get(metric_name("stores_skipped_before_cache_on")) == 2
    assert counters(engine).get(metric_name("lookups_before_cache_on"), 0) == 0  # reported once


def test_a_request_that_only_arrived_before_stores_normally(new_store):
    store, cfg = new_store(slots=64)
    build = Build(store, cfg)
    engine, pending = deferred(store, cfg, build)
    engine.on_new_request(ctx("queued"))  # arrived, never looked up nor stored under Starting
    build.finish(pending)
    end_step(engine)
    assert not engine.starting
    assert settled(engine, key(7), "queued") is MISS
    assert store_keys(engine, [key(7)], req="queued").keys_to_store == [key(7)]


def test_a_reset_while_the_fingerprint_is_read_starts_the_generation_instead(new_store):
    """The weights may have changed in place meanwhile: the checkpoint's namespace, with
    another engine's chunks in it, is never this engine's."""
    store, cfg = new_store(slots=64)
    other = make_manager(store, cfg, holder="engine-b", lay=OLD)
    store_keys(other, [key(1)])
    build = Build(store, cfg)
    engine, pending = deferred(store, cfg, build)
    engine.on_new_request(ctx("across"))
    engine.reset_cache()
    build.finish(pending)
    end_step(engine)

    assert not engine.starting and engine.generation == 1
    assert engine.current is not build.built[0] and engine.namespace != other.namespace
    assert settled(engine, key(1), "after") is MISS
    assert engine.prepare_store([key(2)], ctx("across")).keys_to_store == []
    assert engine.wait_retired(WAIT_S) and build.shut_down == build.built  # released, never used


def test_an_engine_stopped_while_its_manager_is_built_releases_it_once_built(new_store):
    store, cfg = new_store(slots=64)
    build = Build(store, cfg)
    engine, pending = deferred(store, cfg, build)
    engine.shutdown()  # returns at once: nothing waits for the read
    build.finish(pending)
    assert build.shut_down == build.built and len(build.built) == 1


def test_a_build_that_fails_leaves_an_engine_that_recomputes(new_store, caplog):
    store, cfg = new_store(slots=64)
    build = Build(store, cfg, fail=True)
    engine, pending = deferred(store, cfg, build)
    with caplog.at_level("ERROR", logger="kvstrata.connector.deferred_start"):
        build.finish(pending)
    assert pending.failed and "recomputes every prompt" in caplog.text
    end_step(engine)
    assert not engine.starting
    engine.on_new_request(ctx("r"))
    assert engine.lookup(key(1), ctx("r")) is MISS and engine.prepare_store([key(1)], ctx("r")) is None
    engine.shutdown()


@pytest.mark.parametrize("limit_hit", [False, True])
def test_the_identity_is_read_at_start_only_within_the_limit(monkeypatch, limit_hit):
    """`StrataSpec.get_manager` asks for the identity with READ_AT_START_BYTES: within it
    the engine starts with its manager, past it with `Starting` and a deferred build."""
    from kvstrata.connector import spec as spec_module
    from kvstrata.identity import LongRead

    calls = []

    def resolve(*args, read_limit=None, **kwargs):
        calls.append(read_limit)
        if limit_hit and read_limit is not None:
            raise LongRead("ckpt", read_limit + 1, read_limit)
        from kvstrata.identity import ModelIdentity

        return ModelIdentity("m", "explicit:v1", {})

    monkeypatch.setattr(spec_module, "resolve_model_identity", resolve)
    built = threading.Event()

    class FakeManager:
        def __init__(self, *args, **kwargs):
            built.set()

        def wait_idle(self, timeout_s):
            return True

        def shutdown(self):
            pass

    monkeypatch.setattr(spec_module, "StrataManager", FakeManager)
    spec = _bare_spec(spec_module, monkeypatch)
    manager = spec.get_manager()
    assert calls[0] == spec_module.READ_AT_START_BYTES
    assert manager.starting is limit_hit
    assert built.wait(WAIT_S) and calls[-1] is None if limit_hit else calls == [spec_module.READ_AT_START_BYTES]
    manager.shutdown()


def _bare_spec(spec_module, monkeypatch):
    """A StrataSpec with just what get_manager reads, joined to no cluster."""
    from types import SimpleNamespace

    from kvstrata.config import load_config
    from tests.utils import layout

    import kvstrata.actors.client as client_module
    import kvstrata.connector.ray_join as ray_join

    monkeypatch.setattr(ray_join, "join_cluster_keeping_signals", lambda address: None)
    monkeypatch.setattr(client_module, "ensure_node_store", lambda cfg: object())
    spec = object.__new__(spec_module.StrataSpec)
    spec.kvstrata_config = load_config({})
    spec.layout = layout(worker_bytes=SLOT)
    spec.config = SimpleNamespace(model=SimpleNamespace(name="m"), engine_id="e")
    spec.kv_events_config = SimpleNamespace(enable_kv_cache_events=False)
    spec._model_settings, spec._model_revision, spec._download_dir = {}, None, None
    spec._async_scheduling, spec._cache_off = False, None
    spec.identity, spec._manager, spec._worker = None, None, None
    return spec
