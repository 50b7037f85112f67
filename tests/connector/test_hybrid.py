"""Hybrid models through every tier, at the manager/worker seam vLLM drives.

Two and three KV groups share the engine's KV tensors the way vLLM's hybrid allocator
lays them out: a full-attention group over both tensors, a sliding-window group over
one, and a Mamba-like group whose state page (1536 bytes) is smaller than the padded
page (2048). The scheduler's selection is reproduced: every position of the full
group, the last `WINDOW` positions of the window group, one state at the boundary.
Bytes are compared per group and per layer ref after each trip: arena, disk, object
store, and back.
"""

from __future__ import annotations

import hashlib
import itertools

import numpy as np
import pytest
import torch

from kvstrata.store.node_store import LocalStoreClient, NodeStore
from kvstrata.config import load_config
from kvstrata.connector.compat import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    Locality,
    LookupResult,
    Medium,
    ReqContext,
    load_source,
)
from kvstrata.connector.manager import StrataManager
from kvstrata.connector.spec import StrataSpec
from kvstrata.keys import key_group, key_name, make_key
from kvstrata.tiers.changelog import CPU, OBJECT, STORAGE
from kvstrata.tiers.disk import HEADER_BYTES
from tests.connector.harness import SLOT, offloading_config, step
from tests.utils import crowd_out, flip_disk_payload_bytes, store_config

HIT, MISS, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY
PAGE = 2048  # two tensors of PAGE bytes per block: SLOT (4096) per chunk
STATE = 1536  # the Mamba-like group's un-padded page
WINDOW = 2
NUM_BLOCKS = 64
POSITIONS = 4
# group -> (tensor index, un-padded page bytes) of each of its layers
REFS = {
    2: [[(0, PAGE), (1, PAGE)], [(0, PAGE), (1, PAGE)]],
    3: [[(0, PAGE), (1, PAGE)], [(0, PAGE)], [(1, STATE)]],
}
WINDOWS = {2: (None, WINDOW), 3: (None, WINDOW, 1)}


def selected_positions(group: int, positions: int = POSITIONS) -> list[int]:
    """What vLLM's scheduler stores and loads per group for a prompt of `positions` chunks."""
    if group == 0:
        return list(range(positions))  # full attention: the whole prefix
    if group == 1:
        return list(range(positions - WINDOW, positions))  # the window before the boundary
    return [positions - 1]  # Mamba: the state at the boundary


def chunk_hash(prompt: str, position: int) -> bytes:
    return hashlib.sha256(f"{prompt}/{position}".encode()).digest()


class Engine:
    """One engine's manager and worker over a node store, with CPU KV tensors it fills."""

    def __init__(self, store: NodeStore, cfg: dict, num_groups: int, holder: str):
        config = offloading_config({"config": cfg}, windows=WINDOWS[num_groups], worker_bytes=SLOT, blocks_per_chunk=1)
        spec = StrataSpec(config)
        # vLLM 0.33 says which group is full attention (the store then also evicts a
        # position whole); older versions do not, and the eviction order alone applies.
        assert spec.layout.anchor_groups in (None, (0,))
        self.num_groups = num_groups
        self.manager = StrataManager(LocalStoreClient(store), spec.layout, load_config(cfg), holder, enable_events=True)
        self.tensors = [torch.zeros(NUM_BLOCKS, PAGE, dtype=torch.int8) for _ in range(2)]
        from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCacheTensor

        caches = CanonicalKVCaches(
            tensors=[CanonicalKVCacheTensor(tensor=t, page_size_bytes=PAGE) for t in self.tensors],
            group_data_refs=[[CanonicalKVCacheRef(tensor_idx=t, page_size_bytes=n) for t, n in refs] for refs in REFS[num_groups]],
        )
        self.worker = spec.get_worker(caches)
        self.jobs = itertools.count()
        assert self.manager.wait_idle(10)

    def close(self) -> None:
        self.worker.shutdown()
        self.manager.shutdown()

    # --- what vLLM's scheduler and workers do ------------------------------------------

    def keys(self, prompt: str, positions: int = POSITIONS) -> list[bytes]:
        """The request's keys in vLLM's order: by group, then by position."""
        return [make_key(chunk_hash(prompt, p), g) for g in range(self.num_groups) for p in selected_positions(g, positions)]

    def context(self, req: str, prompt: str, positions: int = POSITIONS) -> ReqContext:
        context = ReqContext(req_id=req)
        if hasattr(context, "set_offload_key_position"):  # 0.32+: where each chunk ends
            for g in range(self.num_groups):
                for p in range(positions):
                    context.set_offload_key_position(make_key(chunk_hash(prompt, p), g), (p + 1) * 32)
        return context

    def gpu_spec(self, keys: list[bytes], first_block: int) -> GPULoadStoreSpec:
        """GPU blocks for `keys` (ordered by group, contiguous positions per group)."""
        sizes = [sum(1 for k in keys if key_group(k) == g) for g in range(self.num_groups)]
        starts = [selected_positions(g)[0] for g in range(self.num_groups)]
        return GPULoadStoreSpec(list(range(first_block, first_block + len(keys))), group_sizes=sizes, block_indices=starts)

    def store(self, prompt: str, req: str = "writer", seed: int = 0) -> dict[bytes, list[np.ndarray]]:
        """Compute (random KV), store every selected chunk, finish the request; returns each
        key's pages as its layers wrote them."""
        keys = self.keys(prompt)
        context = self.context(req, prompt)
        rng = np.random.default_rng(seed)
        for tensor in self.tensors:
            tensor.copy_(torch.from_numpy(rng.integers(-128, 128, tensor.shape, dtype=np.int8)))
        gpu = self.gpu_spec(keys, first_block=0)
        out = self.manager.prepare_store(keys, context)
        assert out is not None and out.keys_to_store == keys
        assert self.worker.submit_store(next(self.jobs), gpu, out.store_spec)
        assert all(result.success for result in self.worker.get_finished())
        self.manager.complete_store(keys, context)
        self.manager.on_request_finished(context)
        return {k: self.pages(block, k) for k, block in zip(keys, gpu.block_ids)}

    def pages(self, block: int, key: bytes) -> list[np.ndarray]:
        return [self.tensors[t][block, :n].numpy().copy() for t, n in REFS[self.num_groups][key_group(key)]]

    def lookup(self, keys: list[bytes], context: ReqContext, store: NodeStore) -> list[LookupResult]:
        """Ask until no answer is RETRY (the store promotes meanwhile), as the scheduler does."""
        for _ in range(20):
            answers = [self.manager.lookup(k, context) for k in keys]
            if RETRY not in answers:
                return answers
            step(self.manager, store)
        raise AssertionError(f"still RETRY after 20 steps: {answers}")

    def load(self, keys: list[bytes], context: ReqContext, first_block: int = 32) -> dict[bytes, list[np.ndarray]]:
        """Load HIT chunks into zeroed GPU blocks; returns what landed, per key and layer."""
        for tensor in self.tensors:
            tensor.zero_()
        gpu = self.gpu_spec(keys, first_block)
        src = self.manager.prepare_load(keys, context)
        assert self.worker.submit_load(next(self.jobs), src, gpu)
        assert all(result.success for result in self.worker.get_finished())
        self.manager.complete_load(keys, context)
        for block, k in zip(gpu.block_ids, keys):
            used = {t: n for t, n in REFS[self.num_groups][key_group(k)]}
            for t, tensor in enumerate(self.tensors):  # nothing beyond the group's un-padded pages
                assert not tensor[block, used.get(t, 0) :].any(), f"{key_name(k)} wrote past its pages in tensor {t}"
        return {k: self.pages(block, k) for k, block in zip(keys, gpu.block_ids)}


def assert_same(loaded: dict[bytes, list[np.ndarray]], stored: dict[bytes, list[np.ndarray]]) -> None:
    assert loaded.keys() == stored.keys()
    for k in stored:
        for layer, (got, want) in enumerate(zip(loaded[k], stored[k])):
            assert np.array_equal(got, want), f"chunk {key_name(k)} layer {layer} differs"


@pytest.fixture
def node(tmp_path, memory_bucket):
    """Node stores and engines (closed afterwards); `disk`/`bucket` add those tiers."""
    made: dict[str, list] = {"stores": [], "engines": []}

    def store(slots=32, disk_dir=None, bucket=False, reserve_slots=8):
        disk = {"path": str(tmp_path / disk_dir), "capacity": 64 * (SLOT + HEADER_BYTES)} if disk_dir else None
        cfg = store_config(tmp_path, capacity=slots * SLOT, reserve_slots=reserve_slots, disk=disk)
        if bucket:
            cfg["tiers"]["object"] = {"url": memory_bucket, "index_refresh_seconds": 0.001}
        node_store = NodeStore(load_config(cfg), "node-a")
        made["stores"].append(node_store)
        return node_store, cfg

    def engine(node_store, cfg, num_groups=3, holder="engine"):
        made["engines"].append(Engine(node_store, cfg, num_groups, holder))
        return made["engines"][-1]

    yield store, engine
    for e in made["engines"]:
        e.close()
    for s in made["stores"]:
        s.close()


@pytest.mark.parametrize("num_groups", [2, 3])
def test_every_group_round_trips_bit_exact_through_the_arena(node, num_groups):
    new_store, new_engine = node
    store, cfg = new_store()
    engine = new_engine(store, cfg, num_groups)
    stored = engine.store("prompt")
    step(engine.manager)
    reader = engine.context("reader", "prompt")
    keys = engine.keys("prompt")
    assert engine.lookup(keys, reader, store) == [HIT] * len(keys)
    assert_same(engine.load(keys, reader), stored)
    # One chunk per selected (position, group), each under its own group's key.
    resident = store.keys(engine.manager.namespace, CPU)
    assert sorted(resident) == sorted(keys)
    assert {key_group(k) for k in resident} == set(range(num_groups))


def push_out_of_the_arena(store: NodeStore, namespace: str) -> None:
    """Another engine takes every slot of the arena, then gives them back empty."""
    pool = store.arena.pools[namespace]
    pool.release("another-engine", crowd_out(pool, evict=len(pool)))
    assert len(pool) == 0


@pytest.mark.parametrize("num_groups", [2, 3])
def test_a_hybrid_prefix_travels_arena_disk_object_and_back_bit_exact(node, num_groups):
    new_store, new_engine = node
    store, cfg = new_store(disk_dir="disk", bucket=True)
    writer = new_engine(store, cfg, num_groups, holder="writer")
    stored = writer.store("prompt")
    step(writer.manager, store)
    step(writer.manager, store)  # the writer's pins are released
    namespace = writer.manager.namespace
    keys = writer.keys("prompt")
    # Every tier holds every group's chunks under the group's own name.
    assert sorted(store.keys(namespace, STORAGE)) == sorted(keys)
    assert sorted(store.keys(namespace, OBJECT)) == sorted(keys)
    for k in keys:
        assert store.object.object_path(namespace, k).endswith(f"-g{key_group(k)}")

    # Evicted from the arena: every group comes back from the disk. (Until the writer
    # hears of the eviction its mirror still says "resident", and deferred reuse keeps the
    # evicted slots' bytes for the HITs it answers meanwhile; here it has heard.)
    push_out_of_the_arena(store, namespace)
    step(writer.manager, store)
    context = writer.context("from-disk", "prompt")
    assert writer.lookup(keys, context, store) == [HIT] * len(keys)
    assert_same(writer.load(keys, context), stored)
    if load_source(STORAGE) is not None:
        assert {writer.manager.get_load_source(k, context) for k in keys} == {load_source(STORAGE)}
    writer.close()
    store.close()

    # A node with an empty disk: they come from the object store, into this node's arena.
    store, cfg = new_store(disk_dir="other-disk", bucket=True)
    engine = new_engine(store, cfg, num_groups, holder="other-node")
    step(engine.manager, store)  # the store listed the bucket
    context = engine.context("from-bucket", "prompt")
    assert engine.lookup(keys, context, store) == [HIT] * len(keys)
    assert_same(engine.load(keys, context), stored)
    if load_source(OBJECT) is not None:
        assert {engine.manager.get_load_source(k, context) for k in keys} == {load_source(OBJECT)}
    # ... and back in the arena for the next request, which finds them resident.
    again = engine.context("again", "prompt")
    assert [engine.manager.lookup(k, again) for k in keys] == [HIT] * len(keys)


def test_a_window_chunk_that_fails_its_checksum_is_a_miss_never_a_hit(node, tmp_path):
    """The full-attention prefix is intact but one window chunk is corrupt: the manager
    must answer MISS for it (vLLM then shortens the hit to a consistent set or
    recomputes); the pins taken for the rest go back when the request ends."""
    new_store, new_engine = node
    store, cfg = new_store(disk_dir="disk")
    writer = new_engine(store, cfg, holder="writer")
    writer.store("prompt")
    step(writer.manager, store)
    writer.close()
    store.close()
    keys = writer.keys("prompt")
    broken = make_key(chunk_hash("prompt", POSITIONS - 1), 1)  # the window's last chunk
    assert flip_disk_payload_bytes(tmp_path / "disk", stride=SLOT, key=broken) == 1

    store, cfg = new_store(disk_dir="disk")
    engine = new_engine(store, cfg, holder="reader")
    context = engine.context("reader", "prompt")
    answers = dict(zip(keys, engine.lookup(keys, context, store)))
    assert answers.pop(broken) is MISS
    assert set(answers.values()) == {HIT}
    assert store.stats()["disk"]["corrupt_chunks"] == 1
    engine.manager.on_request_finished(context)
    step(engine.manager)
    assert store.arena.pools[engine.manager.namespace].stats()["pinned"] == 0


def test_eviction_drops_a_prefix_tail_first_and_each_position_whole(node):
    """A finished request's chunks are ordered tail first: pressure on the arena takes the
    last position (window, state and full-attention chunk together) and leaves a
    shorter prefix that is still a consistent hit in every group."""
    new_store, new_engine = node
    store, cfg = new_store(slots=28)
    engine = new_engine(store, cfg)
    stored = engine.store("prompt")  # 4 full + 2 window + 1 state = 7 chunks
    step(engine.manager)
    step(engine.manager)  # the tail-first touch went out, the writer's pins are released
    pool = store.arena.pools[engine.manager.namespace]
    assert pool.stats()["pinned"] == 0
    # Someone else wants every free slot and three more: the window's and the state's
    # last chunks, then the last full-attention chunk go; positions 0-2 stay whole.
    crowd_out(pool, evict=3)
    last = chunk_hash("prompt", POSITIONS - 1)
    gone = {k for k in stored if k not in pool}
    assert gone == {make_key(last, g) for g in range(3)}

    # The prefix one chunk shorter is still a hit in every group, window included.
    shorter = [make_key(chunk_hash("prompt", p), 0) for p in range(POSITIONS - 1)]
    window = make_key(chunk_hash("prompt", POSITIONS - 2), 1)
    context = engine.context("reader", "prompt")
    assert engine.lookup(shorter + [window], context, store) == [HIT] * POSITIONS


def test_the_event_stream_matches_what_each_tier_holds_per_group(node):
    new_store, new_engine = node
    store, cfg = new_store(slots=28, disk_dir="disk", bucket=True)
    engine = new_engine(store, cfg)
    stored = engine.store("prompt")
    step(engine.manager, store)
    step(engine.manager, store)
    namespace = engine.manager.namespace
    pool = store.arena.pools[namespace]
    crowd_out(pool, evict=len(stored))  # pushes the prompt out
    step(engine.manager, store)

    held: dict[tuple, set[bytes]] = {}
    removal_expected = True
    for event in engine.manager.take_events():
        tier = (event.medium, event.locality, event.ownership)
        keys = held.setdefault(tier, set())
        if event.removed:
            assert set(event.keys) <= keys, f"{tier} removed chunks it never announced"
            keys.difference_update(event.keys)
        else:
            removal_expected &= event.removal_expected
            keys.update(event.keys)
    local = Locality.LOCAL if Locality is not None else None
    remote = Locality.REMOTE if Locality is not None else None
    assert held[(Medium.CPU, local, None)] == set(store.keys(namespace, CPU)) == set()
    assert held[(Medium.STORAGE, local, "kvstrata-disk")] == set(store.keys(namespace, STORAGE)) == set(stored)
    assert held[(Medium.STORAGE, remote, "kvstrata-object")] == set(store.keys(namespace, OBJECT)) == set(stored)
    assert removal_expected  # every tier announces its removals
    assert {key_group(k) for k in held[(Medium.STORAGE, local, "kvstrata-disk")]} == {0, 1, 2}
