"""The systems `trace_replay.py policy` drives, each request as an engine's scheduler would.

Every system answers one call per request, `serve(index, keys, positions)`: look the
request's chunks up in order until the first miss, load the hits, store the rest, finish.
It returns the tier each hit came from, in order (`cpu`, `disk`, `object`); the
accounting (tokens, gaps, ceiling) is the replay's, the same for every system.

- `VllmSystem`: vLLM's own `CPUOffloadingManager` (vllm.v1.kv_offload.cpu) with the LRU
  or ARC policy, host memory only, driven through its public calls (lookup, prepare_load,
  complete_load, prepare_store, complete_store, on_request_finished).
- `StrataSystem`: kvstrata's real `NodeStore` in this process, no Ray: its arena (shared
  memory files in a temporary directory), its disk tier and optionally its object tier
  over `file://`, every background job run right after the step that queued it (the
  executor seam kvstrata/_dev/sim uses), on a fake clock the replay moves to each request's time. The engine
  side is the control protocol itself (actors/protocol.py), as a manager sends it: one
  step pins the hit prefix (what the store's index says is in some tier) and reserves
  slots for the rest; chunks not in the arena come back `pending` while they are
  promoted, and the next step pins them (a RETRY that became a HIT, counted from the tier
  it was promoted from); a last step commits the computed chunks with their positions
  and unpins everything. Evictions are read from the store's change log.

Owns: each system's counters. Must not: know the trace's format (trace_replay.py does).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from kvstrata._dev.executors import InlineExecutor, ManualExecutors
from kvstrata.store.node_store import NodeStore
from kvstrata.protocol import StepRequest
from kvstrata.keys import Layout
from kvstrata.tiers.changelog import CPU, OBJECT, STORAGE
from kvstrata.tiers.records import HEADER_BYTES

HOLDER = "trace-engine"
RETRY_ROUNDS = 8  # steps a request waits for promotions at most


class FakeClock:
    """The store's clock: the replay sets it to each request's (compressed) arrival."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def _empty_counters() -> dict[str, int]:
    return {
        "disk_writes": 0, "disk_write_bytes": 0, "object_puts": 0, "object_put_bytes": 0,
        "object_gets": 0, "cpu_evictions": 0, "disk_evictions": 0, "object_evictions": 0,
    }  # fmt: skip


class VllmSystem:
    """vLLM's CPUOffloadingManager with `policy` (lru, arc) over `chunks` host chunks."""

    def __init__(self, policy: str, chunks: int, slot_bytes: int):
        from vllm.v1.kv_offload.base import ReqContext
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

        self.name = f"vllm-{policy}"
        self._context = ReqContext
        self._manager = CPUOffloadingManager(num_chunks=chunks, cache_policy=policy, enable_events=True)
        self.counters = _empty_counters()

    def serve(self, index: int, keys: list[bytes], positions: list[int]) -> list[str]:
        from vllm.v1.kv_offload.base import LookupResult

        manager = self._manager
        ctx = self._context(req_id=f"r{index}")
        for key, position in zip(keys, positions):
            ctx.set_offload_key_position(key, position)
        manager.on_new_request(ctx)
        hits: list[bytes] = []
        for key in keys:
            if manager.lookup(key, ctx) is not LookupResult.HIT:
                break  # every store completes before the next request: no HIT_PENDING here
            hits.append(key)
        if hits:
            manager.prepare_load(hits, ctx)
            manager.complete_load(hits, ctx)
        rest = keys[len(hits) :]
        if rest:
            out = manager.prepare_store(rest, ctx)
            if out is not None and out.keys_to_store:
                manager.complete_store(list(out.keys_to_store), ctx)
        manager.on_request_finished(ctx)
        for event in manager.take_events():
            if event.removed:
                self.counters["cpu_evictions"] += len(event.keys)
        return ["cpu"] * len(hits)

    def close(self) -> None:
        pass


class StrataSystem:
    """kvstrata's node store (arena + disk [+ object over file://]) with one disk admission.

    `admit`: replaces the store's eviction-time admission by a predicate of the key (the
    replay's oracle); None keeps the configured one.
    """

    def __init__(
        self,
        name: str,
        slot_bytes: int,
        dram_chunks: int,
        disk_chunks: int,
        object_chunks: int | None,
        admission: str,
        head_tokens: int,
        disk_policy: str = "write_back",
        admit: Callable[[bytes], bool] | None = None,
    ):
        self.name = name
        self.root = Path(tempfile.mkdtemp(prefix="kvstrata-trace-"))
        self.clock = FakeClock()
        self.counters = _empty_counters()
        self.slot_bytes = slot_bytes
        (self.root / "shm").mkdir()
        tiers: dict = {
            "cpu": {"capacity": dram_chunks * slot_bytes, "segment_size": max(1, dram_chunks // 4) * slot_bytes,
                    "shm_dir": str(self.root / "shm"), "prefault": False},
            "disk": {"path": str(self.root / "disk"), "capacity": disk_chunks * (slot_bytes + HEADER_BYTES),
                     "write_policy": disk_policy, "direct_io": False, "io_threads": 1, "queue_depth": 1 << 20},
        }  # fmt: skip
        if object_chunks is not None:
            tiers["object"] = {
                "url": f"file://{self.root}/bucket/kv", "write_policy": "write_back", "queue_depth": 1 << 20,
                "index_refresh_seconds": 1e9, "max_concurrency": 1, "capacity": object_chunks * slot_bytes,
            }  # fmt: skip
        store_admission = {"disk": admission, "object": admission, "head_tokens": head_tokens, "window": 1 << 20}
        if admission == "oracle":
            store_admission.update(disk="always", object="always")
        config = {
            "tiers": tiers,
            "engine": {"lease_seconds": 1e6, "reserve_slots": 32, "control_timeout_seconds": 5, "refresh_seconds": 0},
            "admission": {"load": "always", "store": store_admission},
        }
        # Background jobs queue as in production and run right after the step that queued
        # them (a job run inside the call that queues it would unpin before the pin).
        self.jobs = ManualExecutors("disk", "object", "peer")
        self.store = NodeStore(config, "trace-node", clock=self.clock, executors=self.jobs)
        if self.store.object is not None:  # its own pool too: every job runs when queued
            self.store.object._pool.shutdown(wait=True)
            self.store.object._pool = InlineExecutor()
        if admit is not None:
            original = self.store.admission.admit_eviction

            def oracle(namespace: str, key: bytes, tiers: list) -> list:
                return original(namespace, key, tiers) if admit(key) else []

            self.store.admission.admit_eviction = oracle
        layout = Layout(
            model="trace-replay", dtype="bfloat16", kv_cache_layout="", tokens_per_block=(16,), group_ids=(0,),
            tokens_per_hash=16, blocks_per_chunk=1, worker_kv_bytes_per_block=slot_bytes, world_size=1,
            tp_size=1, pp_size=1, pcp_size=1, dcp_size=1, hash_algo="sha256",
        )  # fmt: skip
        self.namespace = layout.namespace
        registration = self.store.register(HOLDER, self.namespace, slot_bytes)
        self.epoch, self.seq = registration.epoch, registration.seq
        self.log = self.store.ctx.log(self.namespace)
        self.stock: list[int] = []

    def _step(self, **fields) -> object:
        reply = self.store.step(StepRequest(HOLDER, self.namespace, epoch=self.epoch, known_seq=self.seq, **fields))
        if reply.rejected:
            raise RuntimeError(f"{self.name}: the store rejected a step: {reply.rejected}")
        if not reply.snapshot:
            for _, medium, present in reply.changes:
                if not present:
                    self.counters[{CPU: "cpu_evictions", STORAGE: "disk_evictions", OBJECT: "object_evictions"}[medium]] += 1
        self.seq = reply.seq
        self.stock.extend(reply.reserved)
        self.jobs.run_all()
        return reply

    def _where(self, key: bytes) -> str | None:
        log = self.log
        if log.has(key, CPU):
            return "cpu"
        if log.has(key, STORAGE):
            return "disk"
        if log.has(key, OBJECT):
            return "object"
        return None

    def serve(self, index: int, keys: list[bytes], positions: list[int]) -> list[str]:
        where: list[str] = []
        for key in keys:  # the engine's mirror of the store's index: the prefix some tier holds
            tier = self._where(key)
            if tier is None:
                break
            where.append(tier)
        prefix = keys[: len(where)]
        want = sum(1 for key in keys[len(where) :] if not self.log.has(key, CPU))
        reply = self._step(pin=prefix, reserve=max(0, want - len(self.stock)))
        pinned = dict(reply.pinned)
        pending = list(reply.pending)
        # Being promoted: the engine answers RETRY and asks again next step (the jobs queued
        # ran in between), until HIT or MISS. A promotion that needs a slot a write-back
        # still holds waits for that write, so it may take a few rounds; bounded as the
        # engine's wait is (`engine.lookup_wait_seconds`), after which it is a miss.
        for _ in range(RETRY_ROUNDS):
            if not pending:
                break
            again = self._step(pin=pending)
            pinned.update(again.pinned)
            pending = list(again.pending)
        hits = 0
        while hits < len(prefix) and prefix[hits] in pinned:
            hits += 1
        unpin = list(pinned.values())
        touch: list[bytes] = []
        to_store: list[bytes] = []
        to_position: dict[bytes, int] = {}
        for key, position in zip(keys[hits:], positions[hits:]):
            if key in pinned or self.log.has(key, CPU):
                touch.append(key)  # resident already: recency only (as prepare_store does)
            elif key not in to_position:
                to_store.append(key)
                to_position[key] = position
        while to_store:
            # A slot whose chunk is being written back frees when its write lands (the jobs
            # run between steps): the engine asks again, a few steps at most.
            for _ in range(RETRY_ROUNDS):
                if self.stock:
                    break
                self._step(reserve=len(to_store), unpin=unpin, touch=touch)
                unpin, touch = [], []
            if not self.stock:
                break  # no slot to be had: the rest is not stored (vLLM's prepare_store -> None)
            batch, to_store = to_store[: len(self.stock)], to_store[len(self.stock) :]
            slots, self.stock = self.stock[: len(batch)], self.stock[len(batch) :]
            commit = list(zip(slots, batch))
            # The store keeps the writer's pin at commit; the engine lets go when it finishes.
            self._step(commit=commit, positions=[(key, to_position[key]) for key in batch], unpin=unpin + slots, touch=touch)
            unpin, touch = [], []
        if unpin or touch:
            self._step(unpin=unpin, touch=touch)
        return where[:hits]

    def finish(self) -> dict[str, int]:
        """Counters from the store's own meters (written chunks landed, not queued)."""
        meter = self.store.io_meter
        disk, put, get = meter.totals("disk", "write"), meter.totals("object", "write"), meter.totals("object", "read")
        self.counters.update(
            disk_writes=disk.chunks, disk_write_bytes=disk.bytes, object_puts=put.chunks, object_put_bytes=put.bytes,
            object_gets=get.chunks, disk_writes_dropped=self.store.counters["disk_writes_dropped"],
            object_uploads_dropped=self.store.counters["object_uploads_dropped"],
        )  # fmt: skip
        return self.counters

    def close(self) -> None:
        try:
            if self.stock:
                self._step(release=self.stock)
            self.store.close()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
