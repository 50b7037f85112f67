"""The node store's own cost per step, against another checkout's store, in the same run.

Why: issue #46 rebuilt the node store from parts (plain components over one
`StoreContext`, lower tiers behind `tiers/base.py`) and asks that it cost nothing. The
engine waits for the store twice: on the scheduler thread (manager calls, measured by
`manager_overhead.py` through a Ray actor) and on every step the manager's control thread
sends, whose time is the store's own. This benchmark calls a `NodeStore` in the process
(`LocalStoreClient`, no Ray in between), so a step's round trip is the store's work: its
lock, its bookkeeping, the contention of its background jobs.

What runs. The traces of `manager_overhead.py` (same generator, seed and arena sizing)
are replayed by `scheduler_replay.replay` through a `StrataManager` whose client calls
the store directly. Each (checkout, trace) pair runs in a child process whose PYTHONPATH
is that checkout, so both import their own `kvstrata`; the checkouts alternate within a
round and swap order between rounds (A B, B A, ...) so that drift on the machine lands
on both alike. The benchmark's own code (this file, the trace generator, the replay
loop) is the same for both.

Columns, per trace and checkout (the median over rounds, and the spread across them):
  step CPU p50 / p99  the store's own CPU time in one step call (the calling thread's
                   CPU clock): its work, whatever else the machine runs
  store CPU us/req those summed / finished requests
  step p50 / p99   a control-thread store call's wall time, us (step, and the rare
                   register): what a step's reply waits for, GIL and lock waits included
  store us/req     all those calls' time / finished requests
  sched us/req     time inside manager calls on the scheduler thread / requests
  steps, hit chunks  what the replay did (these must match: the same work)

    PYTHONPATH=$PWD python benchmarks/store_step.py --against ../kvstrata-before [--rounds 3] [--quick]

`--against` is a checkout (a git worktree) whose `kvstrata` package is imported as is;
its compiled `kvstrata/connector/_rowcopy*.so` must be there (copy it from this one).
A checkout from before the store moved to `kvstrata/store/` is found at
`kvstrata/actors/` (the constructor of `NodeStore` did not change).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from manager_overhead import QUICK_REQUESTS, TRACES, make_trace, sized  # noqa: E402
from scheduler_replay import CountingClient, replay  # noqa: E402

COLUMNS = (
    "cpu_p50_us", "cpu_p99_us", "store_cpu_us_per_req", "step_p50_us", "step_p99_us", "store_us_per_req",
    "sched_us_per_req", "steps", "hit_chunks",
)  # fmt: skip


def _store_classes():
    """This checkout's NodeStore and in-process client, wherever it keeps them."""
    try:
        from kvstrata.store.local_client import LocalStoreClient
        from kvstrata.store.node_store import NodeStore
    except ImportError:  # before the store from parts (#46): both lived in kvstrata/actors/
        from kvstrata.actors.local_client import LocalStoreClient
        from kvstrata.actors.node_store import NodeStore
    return NodeStore, LocalStoreClient


def run_child(trace_name: str, requests: int, forward_ms: float, seed: int) -> dict[str, float]:
    """One replay against this process's `kvstrata`; the figures as a dict."""
    import gc

    from kvstrata.config import load_config
    from kvstrata.connector.compat import ScheduleEndContext
    from kvstrata.connector.manager import StrataManager
    from kvstrata.keys import Layout

    from manager_overhead import CHUNK_BYTES

    node_store, local_client = _store_classes()
    cpu_ns: list[int] = []

    class TimedClient(local_client):
        """The store's own CPU time per step, on the thread that calls it: waits for the
        GIL or the store lock are not in it, so it does not move with the machine's load."""

        def step(self, request):
            began = time.thread_time_ns()
            try:
                return super().step(request)
            finally:
                cpu_ns.append(time.thread_time_ns() - began)

    spec = sized(TRACES[trace_name], requests)
    trace = make_trace(spec, seed)
    arena_chunks = spec.arena_chunks()
    layout = Layout(f"bench-{spec.name}", "float16", "", (16,), (0,), 16, 1, CHUNK_BYTES, 1, 1, 1, 1, 1, "sha256")
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="kvstrata-bench-") as shm_dir:
        config = {
            "tiers": {"cpu": {"capacity": arena_chunks * layout.slot_bytes, "shm_dir": shm_dir}},
            "engine": {"reserve_slots": min(spec.reserve_slots(), max(1, arena_chunks // 4))},
        }
        store = node_store(config, "bench-node")
        try:
            client = CountingClient(TimedClient(store))
            manager = StrataManager(client, layout, load_config(config), f"bench-{spec.name}")
            try:
                client.settle()
                answered = client.done
                manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
                client.settle(quiet_s=0.01, done=answered + 1)
                gc.collect()
                client.counting = True
                first_counted = len(cpu_ns)  # the settling calls (the arena's first segment) are not steps
                result = replay(manager, "kvstrata", trace, spec.prefix_chunks, spec.per_step, forward_ms / 1000)
                client.settle()
                client.counting = False
            finally:
                manager.shutdown()
        finally:
            store.close()
    trips = sorted(client.round_trips)
    cpu = sorted(cpu_ns[first_counted:]) or [0]
    centile = statistics.quantiles(trips, n=100) if len(trips) > 1 else [trips[0] if trips else 0.0] * 99
    return {
        "cpu_p50_us": statistics.median(cpu) / 1e3,
        "cpu_p99_us": cpu[min(len(cpu) - 1, int(0.99 * len(cpu)))] / 1e3,
        "store_cpu_us_per_req": sum(cpu) / 1e3 / max(1, result.requests),
        "step_p50_us": statistics.median(trips) * 1e6 if trips else 0.0,
        "step_p99_us": centile[98] * 1e6,
        "store_us_per_req": sum(trips) * 1e6 / max(1, result.requests),
        "sched_us_per_req": result.us_per_request(),
        "steps": result.steps,
        "hit_chunks": result.hit_chunks,
        "requests": result.requests,
    }


def run_in(tree: Path, trace_name: str, requests: int, forward_ms: float, seed: int, timeout_s: float) -> dict:
    """Run this file's child mode with `tree` first on the path; its JSON line back."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(HERE)])}
    command = [sys.executable, str(Path(__file__).resolve()), "--child", trace_name,
               "--requests", str(requests), "--forward-ms", str(forward_ms), "--seed", str(seed)]  # fmt: skip
    done = subprocess.run(command, env=env, cwd=tree, capture_output=True, text=True, timeout=timeout_s, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"the replay in {tree} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1])


def describe(tree: Path) -> str:
    head = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True)  # fmt: skip
    return (head.stdout.strip() or tree.name) + ("+changes" if dirty.stdout.strip() else "")


def summary(runs: list[dict]) -> dict[str, str]:
    cells = {}
    for column in COLUMNS:
        values = [run[column] for run in runs]
        middle = statistics.median(values)
        if column in ("steps", "hit_chunks"):
            cells[column] = f"{middle:.0f}" + ("" if min(values) == max(values) else f" ({min(values):.0f}-{max(values):.0f})")
        else:
            cells[column] = f"{middle:.1f} ({min(values):.1f}-{max(values):.1f})"
    return cells


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", type=Path, help="another checkout to compare with (e.g. a worktree of the old main)")
    parser.add_argument("--trace", choices=[*TRACES, "all"], default="all")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, help="requests per trace (default: manager_overhead's)")
    parser.add_argument("--quick", action="store_true", help="manager_overhead's --quick sizes")
    parser.add_argument("--forward-ms", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per replay")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_child(args.child, args.requests, args.forward_ms, args.seed)))
        return
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    trees = [HERE.parent] + ([args.against.resolve()] if args.against else [])
    labels = [describe(tree) for tree in trees]
    names = [name for name in TRACES if args.trace in (name, "all")]
    results: dict[tuple[str, int], list[dict]] = {}
    for round_index in range(args.rounds):
        order = list(range(len(trees)))
        if round_index % 2:
            order.reverse()
        for name in names:
            requests = args.requests or (QUICK_REQUESTS[name] if args.quick else TRACES[name].requests)
            for index in order:
                figures = run_in(trees[index], name, requests, args.forward_ms, args.seed, args.timeout)
                results.setdefault((name, index), []).append(figures)
                print(f"round {round_index + 1} {name} {labels[index]}: " + json.dumps(figures), flush=True)
    print(f"\nstore step cost, median over {args.rounds} round(s) (min-max), forward pass {args.forward_ms} ms, "
          f"load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    header = ["trace", "checkout", "step CPU p50 us", "step CPU p99 us", "store CPU us/req", "step p50 us",
              "step p99 us", "store us/req", "sched us/req", "steps", "hit chunks"]  # fmt: skip
    print(" | ".join(header))
    for name in names:
        for index, label in enumerate(labels):
            cells = summary(results[(name, index)])
            print(" | ".join([name, label, *(cells[column] for column in COLUMNS)]))


if __name__ == "__main__":
    main()
