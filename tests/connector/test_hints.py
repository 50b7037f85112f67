"""KV hints from requests (issue #41): vLLM's envelope and `kv_transfer_params`, parsed,
named as chunk keys and applied by the node store; malformed ones dropped and counted,
never failing the request."""

from __future__ import annotations

import pytest

from kvstrata.store.node_store import LocalStoreClient, NodeStore
from kvstrata.config import load_config
from kvstrata.connector.compat import LookupResult, ReqContext, prefix_block_hashes
from kvstrata.connector.hints import HintError, parse_action, parse_envelope, parse_ttl
from kvstrata.connector.manager import StrataManager
from kvstrata.keys import chunk_keys
from tests.utils import key, layout, store_config

SLOT = 4096
HAS_POSITIONS = hasattr(ReqContext(req_id="x"), "set_offload_key_position")


def action(kind: str, **payload) -> dict:
    return {"action_id": "a", "action_type": kind, "action_version": "1.0", "payload": payload}


def envelope(*actions: dict) -> dict:
    return {"protocol_version": "1.0", "message_id": "m", "actions": list(actions)}


@pytest.mark.parametrize("value, seconds", [(90, 90.0), ("5m", 300.0), ("1h", 3600.0), ("24h", 86400.0), ("2d", 172800.0)])
def test_ttls_as_apis_write_them(value, seconds):
    assert parse_ttl(value) == seconds


@pytest.mark.parametrize(
    "raw, why",
    [
        (action("kv.teleport"), "not one kvstrata serves"),
        ({**action("kv.retain", ttl=60), "action_version": "2.0"}, "version"),
        (action("kv.retain"), "needs ttl_seconds"),
        (action("kv.retain", ttl="forever"), "not seconds"),
        (action("kv.retain", ttl=60, priority=101), "priority"),
        (action("kv.retain", ttl=60, token_range=[10, 5]), "start < end"),
        (action("kv.prefetch"), "needs token_ids"),
        (action("kv.prefetch", token_ids=[1, -2]), "non-negative integers"),
        (action("kv.prefetch", block_hashes=["zz"]), "hex"),
    ],
)
def test_malformed_actions_say_why(raw, why):
    with pytest.raises(HintError, match=why):
        parse_action(raw)


def test_an_envelope_keeps_its_good_actions_and_names_the_bad():
    actions, errors = parse_envelope(envelope(action("kv.retain", ttl="1h", priority=80), action("nope")))
    assert [a.action for a in actions] == ["kv.retain"] and actions[0].ttl_seconds == 3600 and actions[0].priority == 80
    assert len(errors) == 1 and errors[0].startswith("action a:")
    assert parse_envelope({"actions": "x"}) == ([], ["the envelope has no list of actions"])


def test_chunk_keys_name_chunks_as_the_scheduler_does():
    hashes = [bytes([i]) * 32 for i in range(5)]
    named = chunk_keys(hashes, 16, (32, 64), (0, 1))
    # group 0: a chunk every 2 hashes (at hashes 1, 3); group 1: every 4 (at hash 3)
    assert [(k[-1], end) for k, end in named] == [(0, 32), (0, 64), (1, 64)]
    assert named[0][0][:32] == hashes[1] and named[2][0][:32] == hashes[3]


@pytest.fixture
def engine(tmp_path):
    cfg = store_config(tmp_path, capacity=16 * SLOT)
    store = NodeStore(cfg, "node0")
    manager = StrataManager(LocalStoreClient(store), layout(worker_bytes=SLOT), load_config(cfg), "engine-a")
    assert manager.wait_idle(10)
    yield store, manager
    manager.shutdown()
    store.close()


def request(req_id: str, params: dict | None) -> ReqContext:
    return ReqContext(req_id=req_id, kv_transfer_params=params)


@pytest.mark.skipif(not HAS_POSITIONS, reason="token ranges of a request need vLLM 0.31+")
def test_a_retain_in_kv_transfer_params_covers_the_requests_own_chunks_in_its_range(engine):
    store, manager = engine
    ctx = request("r1", {"kv_hints": envelope(action("kv.retain", ttl="1h", priority=70, token_range=[0, 64]))})
    manager.on_new_request(ctx)
    keys = [key(i) for i in range(3)]
    for i, k in enumerate(keys):
        ctx.set_offload_key_position(k, 32 * (i + 1))
    assert manager.lookup(keys[0], ctx) is LookupResult.MISS
    manager.on_request_finished(ctx)
    priorities = [store.retention_priority(manager.namespace, k) for k in keys]
    assert priorities == [70, 70, 0]
    assert manager.counters()["hints_sent"] == 1


def test_a_prefetch_names_another_prompts_chunks_and_reaches_the_store(engine):
    store, manager = engine
    tokens = list(range(100))  # 3 whole chunks of 32 tokens
    manager.on_new_request(request("r2", {"kv_hints": envelope(action("kv.prefetch", token_ids=tokens))}))
    hashes = prefix_block_hashes(tokens, 32, "sha256")
    expected = [k for k, _ in chunk_keys(hashes, 32, (32,), (0,))]
    assert len(expected) == 3
    assert store.counters["prefetch_asked"] == 3 and store.counters["prefetch_refused_absent"] == 3  # nowhere yet
    store.register("engine-b", manager.namespace, SLOT)
    pool = store.arena.pools[manager.namespace]
    slots = pool.reserve("engine-b", 3)
    pool.commit_many("engine-b", list(zip(slots, expected)))
    manager.on_new_request(request("r3", {"kv_hints": envelope(action("kv.prefetch", token_ids=tokens))}))
    assert set(store.prefetch_holds(manager.namespace)) == set(expected)


def test_malformed_hints_are_dropped_and_counted_and_the_request_goes_on(engine):
    store, manager = engine
    bad = {"kv_hints": envelope(action("kv.retain"), action("kv.prefetch", token_ids="abc"), action("kv.unknown"))}
    ctx = request("r4", bad)
    manager.on_new_request(ctx)
    assert manager.lookup(key(9), ctx) is LookupResult.MISS
    manager.on_request_finished(ctx)
    assert manager.counters()["hints_dropped"] == 3 and manager.counters()["hints_sent"] == 0
    assert store.counters["hints_applied"] == 0
