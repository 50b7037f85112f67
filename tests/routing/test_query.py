"""Mooncake RFC #1403 `/query` and `/query_by_hash` answered from the cluster directory: the
request and reply shapes (token ids or vLLM block hashes in; per tenant, per instance,
cumulative per-tier prefix tokens out; Dynamo's `instances` form too), bad input named,
a silent directory a 503, and the HTTP server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest

from kvstrata.actors.directory import DirectoryShard
from kvstrata.routing.keys import block_hashes, chunks_of_prompt
from kvstrata.routing.query import QueryError, QueryUnavailable, answer_query, parse_query
from kvstrata.routing.query_server import QueryServer
from tests.routing.test_router import PROMPT, SCHEME, figures

CHUNK = 128  # SCHEME: 4 blocks of 32 tokens per chunk


def cluster() -> DirectoryShard:
    """node-a: chunks 0-1 in its arena, 2-3 on its disk; node-b: chunks 4-5 in its arena; the bucket: 0-6."""
    keys = chunks_of_prompt(SCHEME, PROMPT).keys
    shard = DirectoryShard(0)
    shard.sync("node-a", {"ns": ([(k, "CPU", True) for k in keys[:2]] + [(k, "STORAGE", True) for k in keys[2:4]], -1, False)})
    shard.sync("node-b", {"ns": ([(k, "CPU", True) for k in keys[4:6]] + [(k, "OBJECT", True) for k in keys[:7]], -1, False)})
    return shard


def ask(body, by_hash=False, **kwargs):
    return asyncio.run(answer_query(parse_query(body, by_hash), figures(cluster()), **kwargs))


def test_by_token_ids_each_instance_gets_its_cumulative_tier_prefixes():
    reply = ask({"model": "m", "token_ids": PROMPT, "block_size": 32})
    assert reply == {
        "default": {
            # arena 2 chunks, + disk 4, + node-b's arena 6, + the bucket 7 (chunk 7 is nowhere)
            "node-a": {"longest_matched": 7 * CHUNK, "GPU": 0, "CPU": 2 * CHUNK, "DISK": 4 * CHUNK,
                       "REMOTE": 6 * CHUNK, "OBJECT": 7 * CHUNK, "DP": {"0": 7 * CHUNK}},
            # its own arena starts at chunk 4: nothing of its own from the first token; with node-a's, 6
            "node-b": {"longest_matched": 7 * CHUNK, "GPU": 0, "CPU": 0, "DISK": 0,
                       "REMOTE": 6 * CHUNK, "OBJECT": 7 * CHUNK, "DP": {"0": 7 * CHUNK}},
        }
    }  # fmt: skip


def test_by_block_hash_the_same_answer_and_instances_named_as_the_caller_knows_them():
    hashes = block_hashes(PROMPT[: 6 * CHUNK], 32, "sha256")
    body = {"model": "m", "block_hashes": [h.hex() for h in hashes], "tenant_id": "t1", "instance_id": "vllm-a-0"}
    reply = ask(body, by_hash=True, instances={"node-a": ["vllm-a-0", "vllm-a-1"], "node-b": ["vllm-b-0"]})
    assert list(reply) == ["t1"] and list(reply["t1"]) == ["vllm-a-0"]  # one instance asked for
    assert reply["t1"]["vllm-a-0"]["longest_matched"] == 6 * CHUNK  # the 24 blocks given: 6 chunks
    assert reply["t1"]["vllm-a-0"]["CPU"] == 2 * CHUNK


def test_dynamos_form_of_the_same_figures():
    reply = ask({"model": "m", "token_ids": PROMPT, "format": "dynamo"})
    assert reply["instances"]["node-a"] == {"longest_matched": 7 * CHUNK, "gpu": 0, "cpu": 2 * CHUNK,
                                            "disk": 7 * CHUNK, "dp": {"0": 7 * CHUNK}}  # fmt: skip


def test_an_unknown_model_has_no_instances():
    assert ask({"model": "other", "token_ids": PROMPT}) == {"default": {}}


@pytest.mark.parametrize(
    "body, by_hash, field",
    [
        ({"token_ids": [1, 2]}, False, "model"),
        ({"model": "m", "token_ids": "1 2 3"}, False, "token_ids"),
        ({"model": "m", "token_ids": [1, -2]}, False, "token_ids"),
        ({"model": "m"}, True, "block_hashes"),
        ({"model": "m", "seq_hashes": [1234567890]}, True, "seq_hashes"),  # Mooncake's XXH3 ints
        ({"model": "m", "token_ids": [1], "block_size": 0}, False, "block_size"),
        ({"model": "m", "token_ids": [1], "format": "xml"}, False, "format"),
        ({"model": "m", "token_ids": [1], "tenant_id": 3}, False, "tenant_id"),
        ([1, 2, 3], False, "body"),
    ],
)
def test_bad_input_names_the_field(body, by_hash, field):
    with pytest.raises(QueryError) as raised:
        parse_query(body, by_hash)
    assert raised.value.field == field


def test_a_block_size_the_engines_do_not_use_and_an_unknown_adapter_are_refused():
    with pytest.raises(QueryError, match=r"block_size: the engines of m hash every \[32\] tokens, not 16"):
        ask({"model": "m", "token_ids": PROMPT, "block_size": 16})
    with pytest.raises(QueryError, match="lora_name"):
        ask({"model": "m", "token_ids": PROMPT, "lora_name": "sql"})


def test_a_directory_that_does_not_answer_is_unavailable_not_a_partial_answer():
    with pytest.raises(QueryUnavailable):
        asyncio.run(answer_query(parse_query({"model": "m", "token_ids": PROMPT}), figures(None), timeout_s=0.05))


def post(address, path, body: bytes):
    request = urllib.request.Request(f"http://{address[0]}:{address[1]}{path}", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_the_http_server_answers_both_endpoints_and_refuses_bad_input():
    shard = cluster()
    ready = {"figures": None}
    server = QueryServer(lambda: ready["figures"], port=0).start()
    try:
        assert server.address[0] == "127.0.0.1"
        body = json.dumps({"model": "m", "token_ids": PROMPT}).encode()
        assert post(server.address, "/query", body)[0] == 503  # no figures read yet
        ready["figures"] = figures(shard)
        status, reply = post(server.address, "/query", body)
        assert status == 200 and reply["default"]["node-a"]["DISK"] == 4 * CHUNK
        hashes = [h.hex() for h in block_hashes(PROMPT, 32, "sha256")]
        status, reply = post(server.address, "/query_by_hash", json.dumps({"model": "m", "block_hashes": hashes}).encode())
        assert status == 200 and reply["default"]["node-b"]["REMOTE"] == 6 * CHUNK
        assert post(server.address, "/query", b"{not json")[0] == 400
        status, reply = post(server.address, "/query", json.dumps({"model": "m"}).encode())
        assert status == 400 and reply["field"] == "token_ids"
        assert post(server.address, "/dump", b"{}")[0] == 404
    finally:
        server.stop()
