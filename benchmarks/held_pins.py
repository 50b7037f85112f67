"""Scheduler-thread cost of one step while running requests hold many pins.

Why: a busy engine holds a pin for every chunk its running requests hit, and
`on_schedule_end` runs on vLLM's scheduler thread once per step. Its cost must not grow
with the pins held: at 10,000 pins a scan of them all cost 0.9 ms per step here (26
November 2026), every step, whether any request finished or not.

What runs: an in-process node store (no Ray; `LocalStoreClient`) and two managers. A
writer stores N chunks; a reader's N/10 requests each hit 10 of them and stay running,
so the reader holds N pins. Then 100 steps with nothing else to do; each step's wall
time inside `on_schedule_end` is recorded (the control call it starts runs on the
manager's own thread and is waited for outside the clock). The reference is the same
run's step with no pins held (N = 0).

    python benchmarks/held_pins.py [--pins 0 1000 10000] [--steps 100]
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import tempfile
import time

CHUNK_BYTES = 4096


def key(i: int) -> bytes:
    from kvstrata.keys import make_key

    return make_key(hashlib.sha256(str(i).encode()).digest(), 0)


def step_times(pins: int, steps: int, shm_dir: str) -> list[float]:
    """Seconds inside each of `steps` calls of `on_schedule_end` with `pins` pins held."""
    from kvstrata.store.node_store import LocalStoreClient, NodeStore
    from kvstrata.connector.compat import LookupResult, ReqContext, ScheduleEndContext
    from kvstrata.connector.manager import StrataManager
    from kvstrata.keys import Layout

    layout = Layout("bench-held-pins", "float16", "", (16,), (0,), 16, 1, CHUNK_BYTES, 1, 1, 1, 1, 1, "sha256")
    capacity = (pins + 1024) * 2 * layout.slot_bytes
    config = {
        "tiers": {"cpu": {"capacity": capacity, "shm_dir": shm_dir, "prefault": False}},
        "engine": {"reserve_slots": 256, "refresh_seconds": 0},
    }
    store = NodeStore(config, "bench-node")
    managers = [StrataManager(LocalStoreClient(store), layout, store.config, holder) for holder in ("writer", "reader")]
    writer, reader = managers
    end = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())

    def step(manager: StrataManager) -> None:
        manager.on_schedule_end(end)
        assert manager.wait_idle(10), "the node store did not answer within 10 s"

    try:
        stored = 0
        for _ in range(10 * pins // 64 + 100):
            if stored >= pins:
                break
            keys = [key(i) for i in range(stored, min(stored + 64, pins))]
            out = writer.prepare_store(keys, ReqContext(req_id="writer"))
            if out is not None:
                writer.complete_store(out.keys_to_store, ReqContext(req_id="writer"))
                stored += len(out.keys_to_store)
            step(writer)
        assert stored == pins, f"stored {stored} of {pins} chunks"
        for _ in range(3):
            step(writer)
            step(reader)
        for request in range(pins // 10):  # running requests: each holds its 10 chunks' pins
            context = ReqContext(req_id=f"running-{request}")
            answers = {reader.lookup(key(request * 10 + j), context) for j in range(10)}
            assert answers == {LookupResult.HIT}, answers
        step(reader)
        times = []
        for _ in range(steps):
            started = time.perf_counter()
            reader.on_schedule_end(end)
            times.append(time.perf_counter() - started)
            assert reader.wait_idle(10), "the node store did not answer within 10 s"
        return times
    finally:
        for manager in managers:
            manager.shutdown()
        store.close()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pins", type=int, nargs="+", default=[0, 1000, 10000])
    parser.add_argument("--steps", type=int, default=100)
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    if any(n < 0 for n in args.pins) or args.steps < 2:
        parser.error("--pins must not be negative and --steps must be at least 2")
    pins = sorted(set([0, *args.pins]))  # 0: the reference
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="kvstrata-bench-") as shm_dir:
        step_times(0, args.steps, shm_dir)  # a warm-up: the first run pays for imports and first calls
        medians = {}
        for n in pins:
            times = step_times(n, args.steps, shm_dir)
            medians[n] = statistics.median(times)
            p90 = statistics.quantiles(times, n=10)[-1]
            ratio = medians[n] / medians[0]
            print(f"{n:>6} pins held: on_schedule_end median {medians[n] * 1e6:7.1f} us, p90 {p90 * 1e6:7.1f} us, "
                  f"{ratio:.2f}x the step with none held")  # fmt: skip


if __name__ == "__main__":
    main()
