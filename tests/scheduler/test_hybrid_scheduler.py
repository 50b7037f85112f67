"""kvstrata under vLLM's own scheduler on hybrid KV caches: sliding window + full
attention, and sliding window + full attention + Mamba (prefix-cached, "align" mode).

A real `Scheduler` with vLLM's `OffloadingConnector` and `StrataSpec`, on the
`KVCacheConfig` vLLM's hybrid allocator builds for such a model (64-token window). The workers are emulated by `StrataWorker` over
CPU tensors laid out like vLLM's (two tensors, each shared by one layer of each group):
the "forward pass" writes each block's KV as a function of the block's prefix hash, so
every byte a load brings back can be checked against what the prefix must hold.

This is vLLM's `RequestRunner` idea (tests/v1/kv_connector/unit/offloading_connector)
rebuilt for a real manager and store; it runs on the installed vLLM (the CPU build).
"""

from __future__ import annotations

import hashlib
import itertools

import numpy as np
import pytest
import torch

from kvstrata.store.node_store import LocalStoreClient, NodeStore
from kvstrata.config import load_config
from kvstrata.connector.compat import CanonicalKVCaches
from kvstrata.connector.manager import StrataManager
from kvstrata.connector.spec import StrataSpec
from kvstrata.connector.worker import StrataWorker
from kvstrata.keys import key_group, key_hash, make_key
from kvstrata._dev.testing import build_tiny_llama
from tests.utils import crowd_out

BLOCK = 32  # tokens per block and per chunk
WINDOW_TOKENS = 64
NUM_BLOCKS = 128
PROMPT = 200  # 6 full chunks and 8 tokens


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory):
    from vllm.config import KVEventsConfig, KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    model = build_tiny_llama(tmp_path_factory.mktemp("model"), num_layers=4)
    transfer = KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        kv_connector_extra_config={
            "spec_name": "StrataSpec",
            "spec_module_path": "kvstrata.connector",
            "self_describing_kv_events": True,
        },
    )
    args = EngineArgs(
        model=str(model),
        block_size=BLOCK,
        max_model_len=1024,
        dtype="float32",
        enforce_eager=True,
        enable_prefix_caching=True,
        mamba_cache_mode="align",  # Mamba states at chunk boundaries, as prefix caching needs
        kv_transfer_config=transfer,
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
    )
    config = args.create_engine_config()
    config.cache_config.kv_cache_layout = "LBNHC"  # the engine core resolves this; we have none
    return config


LAYOUTS = {"window+full": 2, "window+full+mamba": 3}  # kinds of layer, two layers of each


def hybrid_kv_cache_config(vllm_config, layout: str):
    """What vLLM's hybrid allocator makes of the layers: a 64-token window, full
    attention and (with three kinds) Mamba, in turn."""
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config, get_kv_cache_configs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    attention = dict(block_size=BLOCK, num_kv_heads=4, head_size=32, dtype=torch.float32)
    page = FullAttentionSpec(**attention).page_size_bytes
    kinds = [
        SlidingWindowSpec(**attention, sliding_window=WINDOW_TOKENS),
        FullAttentionSpec(**attention),
        # a 16 KiB state on a page padded to the attention page, as vLLM pads it
        MambaSpec(block_size=BLOCK, shapes=((16, 256),), dtypes=(torch.float32,), page_size_padded=page,
                  mamba_cache_mode="align"),
    ]  # fmt: skip
    count = LAYOUTS[layout]
    specs = {f"model.layers.{i}.self_attn.attn": kinds[i % count] for i in range(2 * count)}
    (worker_config,) = get_kv_cache_configs(vllm_config, [specs], [NUM_BLOCKS * count * 2 * page])
    return generate_scheduler_kv_cache_config([worker_config]), page


def kv_bytes(prefix_hash: bytes, group: int, tensor: int, page: int) -> np.ndarray:
    """The KV a layer holds for a block: a function of everything before the block's end."""
    seed = int.from_bytes(hashlib.sha256(prefix_hash + bytes([group, tensor])).digest()[:8], "little")
    return np.random.default_rng(seed).integers(-128, 128, page, dtype=np.int8)


class HybridRunner:
    """Scheduler steps with kvstrata's manager, and emulated workers doing the copies."""

    def __init__(self, vllm_config, layout: str, store: NodeStore, monkeypatch):
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCacheTensor
        from vllm.v1.structured_output import StructuredOutputManager
        from vllm.utils.hashing import sha256

        made: list[StrataManager] = []

        def get_manager(
            spec: StrataSpec,
        ) -> StrataManager:  # the store in this process, not Ray's
            if spec._manager is None:
                spec._manager = StrataManager(
                    LocalStoreClient(store),
                    spec.layout,
                    spec.kvstrata_config,
                    "engine",
                    enable_events=True,
                )
                made.append(spec._manager)
            return spec._manager

        monkeypatch.setattr(StrataSpec, "get_manager", get_manager)
        kv_cache_config, self.page = hybrid_kv_cache_config(vllm_config, layout)
        vllm_config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
        self.groups = [type(group.kv_cache_spec).__name__ for group in kv_cache_config.kv_cache_groups]
        self.scheduler = Scheduler(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=BLOCK,
            log_stats=True,
        )
        (self.manager,) = made
        self.published: list[object] = []  # every KV event the scheduler publishes
        self.scheduler.kv_event_publisher.publish = lambda batch: self.published.extend(batch.events)
        assert self.manager.wait_idle(10)
        self.store = store
        # Two tensors, each shared by one layer of each group (as vLLM lays out the e2e model).
        self.tensors = [torch.zeros(kv_cache_config.num_blocks, self.page, dtype=torch.int8) for _ in range(2)]
        caches = CanonicalKVCaches(
            tensors=[CanonicalKVCacheTensor(tensor=t, page_size_bytes=self.page) for t in self.tensors],
            group_data_refs=[
                [CanonicalKVCacheRef(tensor_idx=t, page_size_bytes=self.page) for t in range(2)] for _ in self.groups
            ],
        )
        self.worker = StrataWorker(caches, self.manager.layout, rank=0)
        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(BLOCK, sha256)
        self._ids = itertools.count()
        self.requests: dict[str, object] = {}
        self.loads: list[dict[int, list[int]]] = []  # per load job: group -> logical block indices
        self.stored: list[bytes] = []  # keys of completed store jobs

    def close(self) -> None:
        self.scheduler.shutdown()
        self.worker.shutdown()

    def group_of(self, kind: str) -> int | None:
        return self.groups.index(kind) if kind in self.groups else None

    def run(self, prompt: list[int], max_tokens: int = 2) -> object:
        """One request from arrival to finish; returns the finished `Request`."""
        from vllm import SamplingParams
        from vllm.v1.request import Request

        request = Request(
            f"req-{next(self._ids)}",
            prompt,
            SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            None,
            block_hasher=self._hasher,
        )
        self.requests[request.request_id] = request
        self.scheduler.add_request(request)
        for _ in range(200):
            if not self.scheduler.requests and not self.scheduler.has_unfinished_requests():
                break
            self.step()
            if not self.scheduler.requests and not self.manager.has_pending_work():
                break
        else:
            raise AssertionError("the request did not finish in 200 steps")
        for _ in range(3):  # let the last stores complete and reach the store
            self.step()
        assert self.manager.wait_idle(10)
        self.step()  # the pins of stored chunks go once their commits were answered (#49) ...
        assert self.manager.wait_idle(10)  # ... and the store has their unpins
        return request

    def step(self) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
            OffloadingWorkerMetadata,
        )
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        output = self.scheduler.schedule()
        meta = output.kv_connector_metadata
        done = OffloadingWorkerMetadata()
        loaded: set[str] = set()  # requests whose KV arrived: they may run now
        for job_id, job in meta.load_jobs.items():
            assert self.worker.submit_load(job_id, job.src_spec, job.dst_spec)
            self._check_loaded(job.req_id, job.dst_spec)
            done.mark_completed(job_id)
            loaded.add(job.req_id)
        for req_id, count in output.num_scheduled_tokens.items():
            self._forward(req_id, count)
        for job_id, job in meta.store_jobs.items():
            assert self.worker.submit_store(job_id, job.src_spec, job.dst_spec)
            done.mark_completed(job_id)
            self.stored.extend(self._job_keys(job_id))
        self.worker.get_finished()
        ids = list(output.num_scheduled_tokens)
        self.scheduler.update_from_output(
            output,
            ModelRunnerOutput(
                req_ids=ids,
                req_id_to_index={req_id: i for i, req_id in enumerate(ids)},
                sampled_token_ids=[[7] for _ in ids],
                kv_connector_output=KVConnectorOutput(finished_recving=loaded, kv_connector_worker_meta=done),
            ),
        )

    def _job_keys(self, job_id: int) -> list[bytes]:
        connector = self.scheduler.connector.connector_scheduler
        status = connector._jobs.get(job_id)
        return [] if status is None else list(status.keys)

    def _forward(self, req_id: str, num_tokens: int) -> None:
        """The model computes `num_tokens` more tokens: write the KV of every block they complete."""
        request = self.requests[req_id]
        end = request.num_computed_tokens  # schedule() already counted this step's tokens
        start = end - num_tokens
        end = min(end, len(request.block_hashes) * BLOCK)
        block_ids = self.scheduler.kv_cache_manager.get_block_ids(req_id)
        for group, blocks in enumerate(block_ids):
            for index in range(start // BLOCK, end // BLOCK):
                if index < len(blocks) and blocks[index] != 0:
                    for t, tensor in enumerate(self.tensors):
                        tensor[blocks[index]] = torch.from_numpy(
                            kv_bytes(request.block_hashes[index], group, t, self.page)
                        )

    def _check_loaded(self, req_id: str, gpu_spec) -> None:
        """Every loaded block holds the KV of its own prefix position, in every layer."""
        request = self.requests[req_id]
        loaded: dict[int, list[int]] = {}
        position = 0
        for group, (count, first) in enumerate(zip(gpu_spec.group_sizes, gpu_spec.block_indices)):
            indices = list(range(first, first + count))
            loaded[group] = indices
            for index, block in zip(indices, gpu_spec.block_ids[position : position + count]):
                for t, tensor in enumerate(self.tensors):
                    want = kv_bytes(request.block_hashes[index], group, t, self.page)
                    assert np.array_equal(tensor[int(block)].numpy(), want), f"group {group} block {index} tensor {t}"
            position += count
        self.loads.append(loaded)


def start(vllm_config, layout: str, tmp_path, monkeypatch, disk: bool = False):
    cfg = {"tiers": {"cpu": {"capacity": "16MiB", "shm_dir": str(tmp_path), "prefault": False}},
           "engine": {"refresh_seconds": 0}}  # fmt: skip
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config
    extra.pop("block_size", None)
    if disk:  # and two blocks per chunk: an event then names two block hashes, a placeholder one
        cfg["tiers"]["disk"] = {"path": str(tmp_path / "disk"), "capacity": "64MiB"}
        extra["block_size"] = 2 * BLOCK
    extra["config"] = cfg
    store = NodeStore(load_config(cfg), "node-a")
    return store, HybridRunner(vllm_config, layout, store, monkeypatch)


@pytest.fixture(params=list(LAYOUTS))
def runner(request, vllm_config, tmp_path, monkeypatch):
    store, runner = start(vllm_config, request.param, tmp_path, monkeypatch)
    yield runner
    runner.close()
    store.close()


@pytest.fixture
def runner_with_disk(vllm_config, tmp_path, monkeypatch):
    store, runner = start(vllm_config, "window+full", tmp_path, monkeypatch, disk=True)
    yield runner
    runner.close()
    store.close()


def tokens(seed: int, count: int = PROMPT) -> list[int]:
    return list(np.random.default_rng(seed).integers(3, 120, count))


def groups(runner) -> tuple[int, int, int | None]:
    """Full-attention, sliding-window and (if any) Mamba group indexes."""
    return tuple(runner.group_of(kind) for kind in ("FullAttentionSpec", "SlidingWindowSpec", "MambaSpec"))


def test_the_scheduler_stores_every_full_attention_chunk_the_window_and_one_state(runner):
    full, window, mamba = groups(runner)
    request = runner.run(tokens(0))
    chunks = PROMPT // BLOCK
    hashes = [bytes(h) for h in request.block_hashes[:chunks]]
    stored: dict[int, set[int]] = {}
    for k in runner.stored:
        stored.setdefault(key_group(k), set()).add(hashes.index(key_hash(k)))
    assert stored[full] == set(range(chunks))  # the whole prefix
    assert {chunks - 2, chunks - 1} <= stored[window] < set(range(chunks))  # the window before the end
    if mamba is not None:
        assert stored[mamba] == {chunks - 1}  # one state, at the boundary
    # The node store holds exactly those chunks, each under its group's key.
    assert set(runner.store.keys(runner.manager.namespace)) == set(runner.stored)


def test_a_repeated_prompt_loads_a_consistent_set_of_groups_bit_exact(runner):
    full, window, mamba = groups(runner)
    prompt = tokens(1)
    runner.run(prompt)
    assert runner.scheduler.reset_prefix_cache()  # the GPU cache forgets: only kvstrata has it
    runner.run(prompt)
    (load,) = runner.loads  # bytes were checked block by block as they landed
    assert load[full] == list(range(6))  # the whole prefix of full attention...
    assert load[window] == [4, 5]  # ...the window that ends where it ends...
    if mamba is not None:
        assert load[mamba] == [5]  # ...and the state at that boundary


def test_a_prefix_whose_window_was_never_stored_is_recomputed_not_half_loaded(runner):
    """A shorter prompt sharing the first 4 chunks: their full-attention chunks are in
    kvstrata, the window before chunk 4 is not (only the window before the first
    prompt's end was stored). vLLM must not load full attention alone: nothing loads."""
    full, _, _ = groups(runner)
    prompt = tokens(2)
    first = runner.run(prompt)
    shorter = prompt[: 4 * BLOCK] + tokens(3, 40)
    for h in first.block_hashes[:4]:
        assert make_key(bytes(h), full) in runner.store.keys(runner.manager.namespace)
    assert runner.scheduler.reset_prefix_cache()
    runner.run(shorter)
    assert runner.loads == []


def test_stored_events_name_each_group_and_describe_full_attention_chunks(runner):
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    full, window, mamba = groups(runner)
    request = runner.run(tokens(4))
    events = [e for e in runner.published if isinstance(e, BlockStored) and e.medium == "CPU"]
    announced = {(e.group_idx, e.block_hashes[-1]) for e in events}
    stored = {(key_group(k), maybe_convert_block_hash(key_hash(k))) for k in runner.stored}
    assert announced == stored  # one event per chunk stored, under its own group
    assert {group for group, _ in announced} == {full, window} | ({mamba} if mamba is not None else set())
    hashes = [maybe_convert_block_hash(bytes(h)) for h in request.block_hashes]
    for event in events:
        if event.group_idx == full:  # self-describing: the chunk's own tokens and parent
            index = hashes.index(event.block_hashes[-1])
            assert event.token_ids == list(request.all_token_ids[index * BLOCK : (index + 1) * BLOCK])
            assert event.parent_block_hash == (hashes[index - 1] if index else None)

    # Pushed out of the arena: each removal names the same group and hashes as its store.
    pool = runner.store.arena.pools[runner.manager.namespace]
    crowd_out(pool, evict=len(stored))
    runner.step()
    assert runner.manager.wait_idle(10)
    runner.step()
    removed = {
        (e.group_idx, h)
        for e in runner.published
        if isinstance(e, BlockRemoved) and e.medium == "CPU"
        for h in e.block_hashes
    }
    assert removed == {(e.group_idx, h) for e in events for h in e.block_hashes}


def test_disk_events_keep_their_payload_until_the_disk_drops_the_chunk(runner_with_disk):
    """The arena drops a chunk before the disk does: vLLM's tracker must still describe
    the disk's removal in full, which it does only because every store event says that
    a removal will follow (and names its tier)."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    runner = runner_with_disk
    full, _, _ = groups(runner)
    runner.run(tokens(5))
    assert runner.store.wait_io(10)
    runner.step()
    assert runner.manager.wait_idle(10)
    runner.step()

    def announced(kind, medium: str) -> list:
        """Block hashes of the full-attention group's events (a placeholder has one per chunk)."""
        return sorted(
            h
            for event in runner.published
            if isinstance(event, kind) and event.medium == medium and event.group_idx == full
            for h in event.block_hashes
        )

    on_disk = announced(BlockStored, "STORAGE")
    assert len(on_disk) == PROMPT // (2 * BLOCK) * 2  # every block hash of every chunk
    pool = runner.store.arena.pools[runner.manager.namespace]
    crowd_out(pool, evict=len(runner.stored))  # out of the arena, still on disk
    runner.step()
    assert runner.manager.wait_idle(10)
    runner.step()
    assert announced(BlockRemoved, "CPU") == on_disk
    runner.store.purge(runner.manager.namespace)  # and now off the disk too
    runner.step()
    assert runner.manager.wait_idle(10)
    runner.step()
    removed = announced(BlockRemoved, "STORAGE")
    assert removed == on_disk  # same chunks, same hashes: not placeholders
    # ... and each stored event carried the chunk's own tokens (self-describing payload).
    assert all(e.token_ids for e in runner.published if isinstance(e, BlockStored) and e.medium == "STORAGE"
               and e.group_idx == full)  # fmt: skip
