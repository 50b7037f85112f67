"""Per-step scheduler-side cost of StrataManager vs vLLM's CPUOffloadingManager.

Both managers are driven by the same replayed trace through a small scheduler loop
(lookup scan, prepare_load, prepare_store, completions one step later, request
finish, on_schedule_end). StrataManager talks to a real node-store Ray actor; its
control calls run on its own thread, and the benchmark counts any store call made
from the scheduler thread (the goal is zero). Only time spent inside manager calls on
the scheduler thread is counted.

    python benchmarks/manager_overhead.py [--requests 400] [--prefix-chunks 32]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import tempfile
import threading
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


def make_trace(requests: int, prefixes: int, prefix_chunks: int, unique_chunks: int, seed: int) -> list[list[bytes]]:
    rng = random.Random(seed)

    def k(*parts: object) -> bytes:
        return hashlib.sha256(repr(parts).encode()).digest() + (0).to_bytes(4, "big")

    trace = []
    for r in range(requests):
        p = rng.randrange(prefixes)
        trace.append([k("p", p, i) for i in range(prefix_chunks)] + [k("u", r, i) for i in range(unique_chunks)])
    return trace


class Timer:
    def __init__(self) -> None:
        self.seconds = 0.0

    def __call__(self, fn, *args):
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.seconds += time.perf_counter() - start


def replay(manager, trace: list[list[bytes]], per_step: int, max_steps: int, forward_s: float) -> tuple[float, int, int]:
    """Returns (seconds in manager calls, steps, chunks loaded).

    `forward_s` stands in for the model's forward pass between steps (not counted): in
    vLLM the scheduler runs once per forward pass, which is when replies arrive.
    """
    from kvstrata.connector.compat import LookupResult, ReqContext, ScheduleEndContext

    timer = Timer()
    waiting: list[tuple[ReqContext, list[bytes]]] = []
    in_flight: list[tuple[ReqContext, list[bytes], list[bytes]]] = []
    next_request = 0
    loaded = 0
    steps = 0
    while (next_request < len(trace) or waiting or in_flight) and steps < max_steps:
        steps += 1
        # Completions of last step's transfers arrive first.
        for ctx, loads, stores in in_flight:
            if loads:
                timer(manager.complete_load, loads, ctx)
            if stores:
                timer(manager.complete_store, stores, ctx)
            timer(manager.on_request_finished, ctx)
        in_flight = []
        for _ in range(per_step):
            if next_request < len(trace):
                ctx = ReqContext(req_id=f"r{next_request}")
                timer(manager.on_new_request, ctx)
                waiting.append((ctx, trace[next_request]))
                next_request += 1
        still_waiting = []
        for ctx, keys in waiting:
            hits = 0
            deferred = False
            for key in keys:
                result = timer(manager.lookup, key, ctx)
                if result is LookupResult.HIT:
                    hits += 1
                elif result in (LookupResult.RETRY, LookupResult.HIT_PENDING):
                    deferred = True
                else:
                    break
            if deferred:
                still_waiting.append((ctx, keys))
                continue
            loads = keys[:hits]
            if loads:
                timer(manager.prepare_load, loads, ctx)
                loaded += len(loads)
            out = timer(manager.prepare_store, keys[hits:], ctx)
            stores = list(out.keys_to_store) if out is not None else []
            in_flight.append((ctx, loads, stores))
        waiting = still_waiting
        timer(manager.on_schedule_end, ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
        time.sleep(forward_s)
    return timer.seconds, steps, loaded


class CountingClient:
    """Wraps the Ray client; counts store calls made from the scheduler (main) thread."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.blocking_on_scheduler = 0

    def _check(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self.blocking_on_scheduler += 1

    def register(self, *args):
        return self.inner.register(*args)  # at engine start, not per step

    def step(self, request):
        self._check()
        return self.inner.step(request)

    def release_holder(self, holder):
        return self.inner.release_holder(holder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--per-step", type=int, default=8, help="new requests per step")
    parser.add_argument("--prefixes", type=int, default=20)
    parser.add_argument("--prefix-chunks", type=int, default=32)
    parser.add_argument("--unique-chunks", type=int, default=8)
    parser.add_argument("--arena-chunks", type=int, default=4096)
    parser.add_argument("--forward-ms", type=float, default=5.0, help="simulated forward pass per step")
    args = parser.parse_args()

    import ray
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    from kvstrata.actors.client import RayStoreClient, ensure_node_store, shutdown_node_store
    from kvstrata.config import load_config
    from kvstrata.connector.manager import StrataManager
    from kvstrata.keys import Layout

    trace = make_trace(args.requests, args.prefixes, args.prefix_chunks, args.unique_chunks, seed=0)
    max_steps = 50 * len(trace)

    baseline = CPUOffloadingManager(num_chunks=args.arena_chunks, cache_policy="lru")
    base_s, base_steps, base_loaded = replay(baseline, trace, args.per_step, max_steps, args.forward_ms / 1000)

    slot_bytes = 4096
    layout = Layout("bench", "float16", "", (16,), (0,), 16, 1, slot_bytes, 1, 1, 1, 1, 1, "sha256")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm_dir:
        config = load_config(
            {"tiers": {"cpu": {"capacity": args.arena_chunks * slot_bytes, "shm_dir": shm_dir}}, "engine": {"reserve_slots": 64}}
        )
        ray.init(address="local", num_cpus=2, include_dashboard=False, namespace="kvstrata-bench", log_to_driver=False)
        store = ensure_node_store(config)
        try:
            client = CountingClient(RayStoreClient(store, 30))
            manager = StrataManager(client, layout, config, "bench-engine")
            manager.wait_idle(30)
            ours_s, ours_steps, ours_loaded = replay(manager, trace, args.per_step, max_steps, args.forward_ms / 1000)
            calls = manager._channel.calls
            manager.shutdown()
        finally:
            shutdown_node_store(store)
            ray.shutdown()

    print(
        f"trace: {len(trace)} requests x {args.prefix_chunks + args.unique_chunks} chunks, {args.prefixes} shared "
        f"prefixes, {args.per_step} new requests and a {args.forward_ms} ms forward pass per step"
    )
    print(f"{'manager':<22} {'steps':>6} {'loaded':>8} {'us/step':>9} {'us/request':>11}")
    for name, seconds, steps, loaded in [
        ("vLLM CPUOffloading", base_s, base_steps, base_loaded),
        ("kvstrata StrataManager", ours_s, ours_steps, ours_loaded),
    ]:
        print(f"{name:<22} {steps:>6} {loaded:>8} {seconds / steps * 1e6:>9.1f} {seconds / len(trace) * 1e6:>11.1f}")
    print(f"per-step ratio kvstrata/vLLM: {(ours_s / ours_steps) / (base_s / base_steps):.2f}")
    print(f"per-request ratio kvstrata/vLLM: {ours_s / base_s:.2f}")
    print(f"store calls: {calls} on the control thread, {client.blocking_on_scheduler} blocking on the scheduler thread")


if __name__ == "__main__":
    main()
