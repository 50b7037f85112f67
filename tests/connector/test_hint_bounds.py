"""Hints made safe to take from HTTP clients, on the engine (issue #51, findings 4 and 9): a
hint never raises into vLLM -- the engine keeps stepping after one no double can hold --
and its sizes are capped before any hashing, dropped and counted."""

from __future__ import annotations

import pytest

import kvstrata.connector.hints as hints_module
from kvstrata.store.node_store import LocalStoreClient, NodeStore
from kvstrata.config import load_config
from kvstrata.connector.compat import LookupResult, ReqContext
from kvstrata.connector.manager import StrataManager
from tests.connector.harness import step
from tests.utils import key, layout, store_config

SLOT = 4096
HUGE = 10**400  # an int no double holds: float() raises OverflowError


def action(kind: str, **payload) -> dict:
    return {"action_id": "a", "action_type": kind, "action_version": "1.0", "payload": payload}


def envelope(*actions: dict) -> dict:
    return {"protocol_version": "1.0", "message_id": "m", "actions": list(actions)}


@pytest.fixture
def engine(tmp_path):
    def make(prefetch: dict | None = None):
        cfg = store_config(tmp_path, capacity=16 * SLOT)
        cfg["prefetch"] = prefetch or {}
        store = NodeStore(cfg, "node0")
        manager = StrataManager(LocalStoreClient(store), layout(worker_bytes=SLOT), load_config(cfg), "engine-a")
        assert manager.wait_idle(10)
        made.append((store, manager))
        return store, manager

    made: list[tuple[NodeStore, StrataManager]] = []
    yield make
    for store, manager in made:
        manager.shutdown()
        store.close()


def store_and_hit(manager: StrataManager, keys: list[bytes], req: str) -> None:
    """One request's life: store its chunks, step, find them again (the engine works)."""
    ctx = ReqContext(req_id=req)
    out = manager.prepare_store(keys, ctx)
    assert out is not None and out.keys_to_store == keys
    manager.complete_store(keys, ctx)
    step(manager)
    assert all(manager.lookup(k, ctx) is LookupResult.HIT for k in keys)
    manager.on_request_finished(ctx)
    step(manager)


@pytest.mark.parametrize(
    "bad",
    [
        action("kv.prefetch", token_ids=list(range(64)), deadline_seconds=HUGE),
        action("kv.prefetch", token_ids=list(range(64)), lease_seconds=HUGE),
        action("kv.retain", token_ids=list(range(64)), ttl_seconds=HUGE),
        action("kv.retain", token_ids=list(range(64)), ttl=HUGE),
    ],
)
def test_an_engine_keeps_stepping_after_a_hint_no_double_holds(engine, bad):
    store, manager = engine()
    store_and_hit(manager, [key(1)], "before")
    ctx = ReqContext(req_id="evil", kv_transfer_params={"kv_hints": envelope(bad)})
    manager.on_new_request(ctx)  # vLLM's add_request: must not raise
    assert manager.lookup(key(1), ctx) is LookupResult.HIT
    manager.on_request_finished(ctx)
    step(manager)
    store_and_hit(manager, [key(2), key(3)], "after")
    assert manager.counters()["hints_dropped"] == 1 and manager.counters()["hints_sent"] == 0
    assert store.counters["hints_applied"] == 0


def test_an_envelope_that_is_not_one_is_dropped_not_raised(engine):
    store, manager = engine()

    class Exploding(dict):
        def get(self, *args):
            raise RuntimeError("boom")

    for params in ({"kv_hints": Exploding(actions=[1])}, {"kv_hints": envelope(Exploding())}):
        ctx = ReqContext(req_id="odd", kv_transfer_params=params)
        manager.on_new_request(ctx)
        manager.on_request_finished(ctx)
    assert manager.counters()["hints_dropped"] == 2
    store_and_hit(manager, [key(4)], "after")


def test_hint_sizes_are_capped_before_any_hashing(engine, monkeypatch):
    store, manager = engine()
    hashed: list[int] = []
    real = hints_module.prefix_block_hashes

    def counting(token_ids, *args):
        hashed.append(len(token_ids))
        return real(token_ids, *args)

    monkeypatch.setattr(hints_module, "prefix_block_hashes", counting)
    flood = envelope(*[action("kv.prefetch", token_ids=[7] * 1_000_000) for _ in range(32)])
    manager.on_new_request(ReqContext(req_id="flood", kv_transfer_params={"kv_hints": flood}))
    assert hashed == [] and manager.counters()["hints_dropped"] == 32
    # within the request's budget (131072 token ids by default): hashed; past it: dropped
    fits = envelope(*[action("kv.prefetch", token_ids=list(range(50_000))) for _ in range(3)])
    manager.on_new_request(ReqContext(req_id="fits", kv_transfer_params={"kv_hints": fits}))
    assert hashed == [50_000, 50_000] and manager.counters()["hints_dropped"] == 33


def test_actions_per_request_are_capped_across_its_envelopes(engine):
    store, manager = engine({"hint_max_actions": 4})
    many = envelope(*[action("kv.retain", ttl=60, token_ids=list(range(64))) for _ in range(3)])
    ctx = ReqContext(req_id="r", kv_transfer_params={"kv_hints": many})
    ctx.kv_hints = many  # vLLM 0.31+: the envelope itself, and the same again in kv_transfer_params
    manager.on_new_request(ctx)
    assert manager.counters()["hints_sent"] == 4 and manager.counters()["hints_dropped"] == 2
