"""The manager sends each committed chunk's position (vLLM's end token for it) with its
commits, so the store's `chain` admission can tell a prefix's head from its tail; a chunk
whose position vLLM did not record is sent without one (the store then admits it)."""

from __future__ import annotations

import pytest

from kvstrata.connector.compat import ReqContext
from kvstrata.store.node_store import LocalStoreClient, NodeStore
from kvstrata.config import load_config
from kvstrata.connector.manager import StrataManager
from kvstrata.tiers.disk import HEADER_BYTES
from tests.connector.harness import SLOT, ctx, step
from tests.utils import key, layout, store_config


@pytest.mark.skipif(
    not hasattr(ReqContext, "set_offload_key_position"), reason="vLLM < 0.32 records no chunk positions (compat.key_position)"
)
def test_commits_carry_their_positions_to_the_chain_admission(tmp_path):
    disk = {"path": str(tmp_path / "disk"), "capacity": 64 * (SLOT + HEADER_BYTES)}
    raw = store_config(tmp_path, capacity=16 * SLOT, reserve_slots=4, disk=disk)
    raw["admission"] = {"store": {"disk": "chain", "head_tokens": 1024}}
    store = NodeStore(load_config(raw), "node0")
    manager = StrataManager(LocalStoreClient(store), layout(worker_bytes=SLOT), load_config(raw), "writer")
    try:
        assert manager.wait_idle(10)
        request = ctx("w")
        request.set_offload_key_position(key(0), 512)
        request.set_offload_key_position(key(1), 1024)  # key(2)'s is not recorded
        keys = [key(0), key(1), key(2)]
        out = manager.prepare_store(keys, request)
        assert out is not None and list(out.keys_to_store) == keys
        manager.complete_store(keys, request)
        step(manager, store)
        assert store.wait_io(10)
        assert [store.admission.chain.position(k) for k in keys] == [512, 1024, None]
        assert [store.admission.chain.in_head(k) for k in keys] == [True, True, True]  # None: admitted
    finally:
        manager.shutdown()
        store.close()
