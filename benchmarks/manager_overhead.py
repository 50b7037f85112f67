"""Scheduler-side cost of StrataManager beside vLLM's CPUOffloadingManager, per request.

What it measures. Each trace is replayed, in the same run, through vLLM 0.32's
`CPUOffloadingManager` (LRU: the reference, answering from its own process memory)
and through kvstrata's `StrataManager` against a real node-store Ray actor (a fresh
one per trace), by a loop that calls both managers as vLLM 0.32's offloading connector
does, step by step (`scheduler_replay.py`): lookups scan each waiting request (RETRY
does not stop the scan, the first MISS does; RETRY or HIT_PENDING makes the request
wait a step), then prepare_load, on_schedule_end, prepare_store, on_request_finished,
a forward pass, then complete_load / complete_store. The forward pass is a
`time.sleep` (not counted): the node store (its own process) and the manager's control
thread run concurrently with the scheduler, so a reply that takes longer than a step
makes a request wait more steps, as in an engine. Only wall time inside manager calls
on the scheduler thread counts; the store calls are counted after the control thread
went quiet, so those the last steps started are in. kvstrata's view of the store is
refreshed (one on_schedule_end, off the clock) just before the first request, as in an
engine that has been stepping: an idle engine's first lookups RETRY once, by design.

Why per request, not per step: a manager that makes requests wait more steps spreads
its cost over more steps and looks cheaper per step; the engine pays per request, in
latency (steps waited) and in scheduler time.

Traces (chunks of 32 KiB; a request = its prefix's chunks, then chunks of its own):
  overlapping    8 new requests a step over 20 shared 32-chunk prefixes: a prefix that
                 comes back is often held by a request still running
  one-at-a-time  one request in flight over 4 shared 64-chunk prefixes (80 chunks a
                 request): the next arrives the step after the previous finished, so no
                 running request holds the prefix it reuses
  distinct       60 prefixes seen 4 times each, spread so that a prefix comes back
                 long after its previous request finished (pins rarely held)
Both managers get an arena of the same size in chunks, by default large enough for
every distinct chunk of the trace plus kvstrata's reserved stock (`engine.reserve_slots`:
four steps of stores, at most a quarter of the arena), so shared prefixes stay resident
and nothing is evicted; `--arena-chunks N` makes it smaller (LRU eviction, and
kvstrata's deferred slot reuse where the store has it).

Columns (per trace and manager):
  requests         requests replayed to the end (scheduled and finished)
  hit req          requests whose scan found at least one HIT when they were scheduled
  waited/hit req   steps from a request's arrival to the step whose scan had no RETRY
                   or HIT_PENDING and scheduled it, averaged over `hit req`
  waited/resident  the same over the hit requests whose whole shared prefix had been
                   stored (complete_store) and none of it was being stored again when
                   they arrived: arena-resident prefixes
  hit chunks       chunks loaded (prepare_load), all requests together
  steps            scheduler steps the replay took
  us/req           wall time inside manager calls on the scheduler thread / requests
  store calls      kvstrata: node-store calls while the trace ran, made on the control
                   thread / made from the scheduler thread (blocking)
  awaiting reuse   kvstrata: arena slots kept from reuse until every engine saw their
                   chunk leave, at peak (at the end), from the store's stats(); n/a
                   where the store does not report them
  waited/req       steps waited, averaged over every scheduled request
  us/req p99       the 99th percentile of a request's manager time (its own calls and
                   an equal share of each step end that scanned it)
Goals, per trace: <= 0.05 steps waited per request with an arena-resident prefix,
<= 1.5x vLLM's us per request, 0 blocking calls; with --busy N also p99 <= 2x vLLM's
and hit chunks within 0.5 % of vLLM's (issue #49).

A busy machine (`--busy N`, busy_load.py): N CPU-bound processes run beside both
managers' replays (started before vLLM's, stopped after kvstrata's, by their handles):
`--busy-kind spin`, pure-Python loops that make no system call, or `syscall`, loops that
write to /dev/null. The load average is printed with every table. `--breakdown` adds
where kvstrata's time goes (lock waits and holds, time off CPU beside vLLM's, reply
round trips and how late they were applied, RETRYs by cause). The reference, vLLM's manager, answers
HIT at the first lookup for a chunk in its arena: it waits 0 steps on these traces.

    PYTHONPATH=$PWD python benchmarks/manager_overhead.py [--trace {overlapping,
        one-at-a-time,distinct,all}] [--quick] [--requests N] [--forward-ms 2]
        [--arena-chunks N] [--plain] [--busy N [--busy-kind {spin,syscall}]] [--breakdown]

It starts a local Ray instance of its own (2 CPUs) and takes it down at the end.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import random
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from busy_load import Breakdown, BusyProcesses, load  # noqa: E402
from scheduler_replay import CountingClient, Result, replay  # noqa: E402

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

CHUNK_BYTES = 32 * 1024
MIN_ARENA_CHUNKS = 8192
GOAL_WAIT, GOAL_RATIO, GOAL_P99_RATIO, GOAL_HIT_LOSS = 0.05, 1.5, 2.0, 0.005


@dataclass(frozen=True)
class TraceSpec:
    name: str
    requests: int
    prefixes: int
    prefix_chunks: int
    unique_chunks: int
    per_step: int  # new requests a step; 0: one request in flight at a time
    spread: bool = False  # each prefix comes back about `prefixes` requests later

    def describe(self) -> str:
        arrivals = "one request in flight at a time" if not self.per_step else f"{self.per_step} new requests a step"
        order = ", spread out" if self.spread else ", drawn at random"
        return (
            f"{self.requests} requests x {self.prefix_chunks + self.unique_chunks} chunks of {CHUNK_BYTES // 1024} KiB, "
            f"{self.prefixes} shared {self.prefix_chunks}-chunk prefixes{order}, {arrivals}"
        )

    def distinct_chunks(self) -> int:
        return self.prefixes * self.prefix_chunks + self.requests * self.unique_chunks

    def reserve_slots(self) -> int:
        """kvstrata's stock of reserved slots: four steps of stores, so that a stock
        refilled a round trip later rarely drops a store vLLM's manager makes."""
        return 4 * max(1, self.per_step) * (self.prefix_chunks + self.unique_chunks)

    def arena_chunks(self) -> int:
        """Every distinct chunk, plus kvstrata's stock (taken from the same arena)."""
        return max(MIN_ARENA_CHUNKS, self.distinct_chunks() + 2 * self.reserve_slots())


TRACES = {
    "overlapping": TraceSpec("overlapping", 400, 20, 32, 8, per_step=8),
    "one-at-a-time": TraceSpec("one-at-a-time", 200, 4, 64, 16, per_step=0),
    "distinct": TraceSpec("distinct", 240, 60, 32, 8, per_step=4, spread=True),
}
QUICK_REQUESTS = {"overlapping": 64, "one-at-a-time": 40, "distinct": 48}
VISITS = 4  # distinct: times each prefix is seen


def sized(spec: TraceSpec, requests: int) -> TraceSpec:
    if spec.spread:
        prefixes = max(2, requests // VISITS)
        return replace(spec, requests=prefixes * VISITS, prefixes=prefixes)
    return replace(spec, requests=requests)


def make_trace(spec: TraceSpec, seed: int) -> list[list[bytes]]:
    from kvstrata.keys import make_key

    rng = random.Random(seed)

    def key(*parts: object) -> bytes:
        return make_key(hashlib.sha256(repr((spec.name, *parts)).encode()).digest(), 0)

    if spec.spread:
        # Rounds over every prefix; a prefix stays in its half of the round, so it comes
        # back more than half a round (prefixes / 2 requests) later.
        halves = [list(range(spec.prefixes // 2)), list(range(spec.prefixes // 2, spec.prefixes))]
        order = []
        while len(order) < spec.requests:
            for half in halves:
                rng.shuffle(half)
                order.extend(half)
    else:
        order = [rng.randrange(spec.prefixes) for _ in range(spec.requests)]
    return [
        [key("p", p, i) for i in range(spec.prefix_chunks)] + [key("u", r, i) for i in range(spec.unique_chunks)]
        for r, p in enumerate(order[: spec.requests])
    ]


def run_vllm(spec: TraceSpec, trace: list[list[bytes]], arena_chunks: int, forward_s: float, cpu_time: bool = False) -> Result:
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    manager = CPUOffloadingManager(num_chunks=arena_chunks, cache_policy="lru")
    gc.collect()
    result = replay(manager, "vLLM CPUOffloading", trace, spec.prefix_chunks, spec.per_step, forward_s, cpu_time)
    result.notes.append(load())
    return result


def run_kvstrata(
    spec: TraceSpec,
    trace: list[list[bytes]],
    arena_chunks: int,
    forward_s: float,
    shm_dir: str,
    breakdown: Breakdown | None = None,
) -> Result:
    import ray

    from kvstrata.actors.client import RayStoreClient, ensure_node_store, shutdown_node_store
    from kvstrata.config import load_config
    from kvstrata.connector.compat import ScheduleEndContext
    from kvstrata.connector.manager import StrataManager
    from kvstrata.keys import Layout

    layout = Layout(f"bench-{spec.name}", "float16", "", (16,), (0,), 16, 1, CHUNK_BYTES, 1, 1, 1, 1, 1, "sha256")
    config = load_config(
        {
            "tiers": {"cpu": {"capacity": arena_chunks * layout.slot_bytes, "shm_dir": shm_dir}},
            "engine": {"reserve_slots": min(spec.reserve_slots(), max(1, arena_chunks // 4))},
        }
    )
    store = ensure_node_store(config)  # a fresh store (and arena) per trace
    try:
        ray.get(store.ping.remote(), timeout=300)  # started (a busy machine starts a worker slowly)
        client = CountingClient(RayStoreClient(store, 30))
        manager = StrataManager(client, layout, config, f"bench-{spec.name}")
        try:
            settled = client.settle()  # its first reservation has landed
            gc.collect()
            # As in an engine that has been stepping, the view of the store is fresh when
            # the first request arrives (an idle one's first lookups RETRY once, by design).
            answered = client.done
            manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
            settled &= client.settle(quiet_s=0.01, done=answered + 1)
            channel = getattr(manager, "_channel", None)
            calls_before = getattr(channel, "calls", None)
            if breakdown is not None:
                breakdown.attach(manager)
            client.counting = True
            result = replay(
                manager, "kvstrata StrataManager", trace, spec.prefix_chunks, spec.per_step, forward_s,
                breakdown is not None,
            )  # fmt: skip
            result.notes.append(load())
            settled &= client.settle()  # the calls the last steps started are counted
            client.counting = False
            result.calls = (client.on_control, client.on_scheduler)
            calls_after = getattr(channel, "calls", None)
            if calls_before is not None and calls_after is not None and calls_after - calls_before != client.on_control:
                result.notes.append(f"the control channel counted {calls_after - calls_before} calls")
            if not settled:
                result.notes.append("the node store did not go quiet within 30 s")
            result.notes.append(f"control calls' round trip: {client.round_trip_ms()}")
            pool = ray.get(store.stats.remote(), timeout=30).get("pools", {}).get(layout.namespace, {})
            if "awaiting_reuse_peak" in pool:
                result.awaiting_reuse = f"{pool['awaiting_reuse_peak']} ({pool.get('awaiting_reuse', '?')} at end)"
        finally:
            manager.shutdown()
    finally:
        shutdown_node_store(store)
    return result


def fmt(value: float | None, spec: str = ".2f") -> str:
    return "n/a" if value is None else format(value, spec)


HEADERS = ["manager", "requests", "hit req", "waited/req", "waited/hit req", "waited/resident", "hit chunks",
           "steps", "us/req", "us/req p99", "store calls ctl/blk", "awaiting reuse"]  # fmt: skip


def row(result: Result) -> list[str]:
    calls = "-" if result.calls is None else f"{result.calls[0]} / {result.calls[1]}"
    awaiting = "-" if result.calls is None else result.awaiting_reuse
    return [result.manager, str(result.requests), str(result.hit_requests), fmt(result.waited_per_request()),
            fmt(result.waited(False)), fmt(result.waited(True)), str(result.hit_chunks), str(result.steps),
            f"{result.us_per_request():.1f}", fmt(result.request_us(0.99), ".1f"), calls, awaiting]  # fmt: skip


def print_table(rows: list[list[str]], plain: bool) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # rich ships with ray[default]; a bare ray lacks it
        plain = True
    if plain:
        widths = [max(len(cell) for cell in column) for column in zip(HEADERS, *rows)]
        for cells in [HEADERS, *rows]:
            print("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(cells, widths))))
        return
    table = Table()
    for i, header in enumerate(HEADERS):
        table.add_column(header, justify="left" if i == 0 else "right")
    for cells in rows:
        table.add_row(*cells)
    Console(width=160).print(table)


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else "PASS" if ok else "FAIL"


def report(
    spec: TraceSpec, arena_chunks: int, forward_ms: float, base: Result, ours: Result, plain: bool, busy: str = ""
) -> None:
    print(f"\n{spec.name}: {spec.describe()}; {forward_ms:g} ms forward pass; arena of {arena_chunks} chunks in both{busy}")
    print_table([row(base), row(ours)], plain)
    for result in (base, ours):
        for note in result.notes:
            print(f"note ({result.manager}): {note}")
    if ours.stored_chunks != base.stored_chunks:
        print(f"note: chunks prepare_store accepted: vLLM {base.stored_chunks}, kvstrata {ours.stored_chunks}")
    ratio = ours.us_per_request() / base.us_per_request() if base.us_per_request() else None
    print(f"kvstrata/vLLM us per request: {fmt(ratio)}x")
    waited = ours.waited(True)
    blocking = None if ours.calls is None else ours.calls[1]
    print(
        f"goals: steps waited per request with an arena-resident prefix {fmt(waited)} <= {GOAL_WAIT} "
        f"{verdict(None if waited is None else waited <= GOAL_WAIT)}; "
        f"us per request {fmt(ratio)}x vLLM <= {GOAL_RATIO}x {verdict(None if ratio is None else ratio <= GOAL_RATIO)}; "
        f"blocking calls {fmt(blocking, 'd')} = 0 {verdict(None if blocking is None else blocking == 0)}"
    )
    base_p99, our_p99 = base.request_us(0.99), ours.request_us(0.99)
    p99_ratio = our_p99 / base_p99 if base_p99 and our_p99 is not None else None
    waited_all = ours.waited_per_request()
    lost = (base.hit_chunks - ours.hit_chunks) / base.hit_chunks if base.hit_chunks else None
    print(
        f"goals (#49): steps waited per request {fmt(waited_all)} <= {GOAL_WAIT} "
        f"{verdict(None if waited_all is None else waited_all <= GOAL_WAIT)}; "
        f"p99 of a request {fmt(our_p99, '.1f')} us, {fmt(p99_ratio)}x vLLM's {fmt(base_p99, '.1f')} us <= {GOAL_P99_RATIO}x "
        f"{verdict(None if p99_ratio is None else p99_ratio <= GOAL_P99_RATIO)}; "
        f"hit chunks {ours.hit_chunks} vs {base.hit_chunks}, {fmt(None if lost is None else 100 * lost)} % lost "
        f"<= {100 * GOAL_HIT_LOSS:g} % {verdict(None if lost is None else lost <= GOAL_HIT_LOSS)}"
    )


def patient_ray_start(seconds: float = 180.0) -> None:
    """Ray gives its raylet 30 s to register (a constant in `ray._private.node`); at a load
    average of 30 (measured here, 27 Nov 2026) it needs longer. Its registration check
    (`services.get_node`) is retried for up to `seconds` instead."""
    import time

    import ray._private.services as services

    get_node = services.get_node

    def patient(*args, **kwargs):
        deadline = time.monotonic() + seconds
        while True:
            try:
                return get_node(*args, **kwargs)
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    services.get_node = patient


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", choices=[*TRACES, "all"], default="all")
    parser.add_argument("--requests", type=int, help="requests per trace (default: 400 / 200 / 240)")
    parser.add_argument("--forward-ms", type=float, default=2.0, help="simulated forward pass per step")
    parser.add_argument("--arena-chunks", type=int, help="arena of both managers, in chunks (default: the whole trace)")
    parser.add_argument("--quick", action="store_true", help="small traces: a smoke run of under a minute")
    parser.add_argument("--plain", action="store_true", help="plain text tables even where rich is installed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--busy", type=int, default=0, help="CPU-bound processes run beside the replays (default 0)")
    parser.add_argument("--busy-kind", choices=["spin", "syscall"], default="spin",
                        help="spin: pure-Python loops, no system calls; syscall: loops writing to /dev/null")  # fmt: skip
    parser.add_argument("--breakdown", action="store_true", help="where kvstrata's time goes (busy_load.Breakdown)")
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    if (args.requests is not None and args.requests < 1) or (args.arena_chunks is not None and args.arena_chunks < 1):
        parser.error("--requests and --arena-chunks must be positive")
    if args.forward_ms < 0:
        parser.error("--forward-ms must not be negative")
    if args.busy < 0:
        parser.error("--busy must not be negative")

    import ray

    specs = []
    for name, spec in TRACES.items():
        if args.trace in (name, "all"):
            requests = args.requests or (QUICK_REQUESTS[name] if args.quick else spec.requests)
            specs.append(sized(spec, requests))
    forward_s = args.forward_ms / 1000
    patient_ray_start()
    for attempt in range(3):  # a loaded machine's raylet may miss Ray's 30 s start-up limit
        try:
            ray.init(address="local", num_cpus=2, include_dashboard=False, namespace="kvstrata-bench", log_to_driver=False)
            break
        except Exception as exc:  # noqa: BLE001 - Ray raises a bare Exception for this
            ray.shutdown()
            if attempt == 2:
                raise
            print(f"note: Ray did not start ({exc}); trying again ({load()})")
    try:
        with tempfile.TemporaryDirectory(dir="/dev/shm") as shm_dir:
            busy = f"; {args.busy} busy process(es) ({args.busy_kind}) beside it" if args.busy else ""
            for spec in specs:
                trace = make_trace(spec, args.seed)
                arena = args.arena_chunks or spec.arena_chunks()
                breakdown = Breakdown() if args.breakdown else None
                with BusyProcesses(args.busy, args.busy_kind):
                    base = run_vllm(spec, trace, arena, forward_s, args.breakdown)
                    ours = run_kvstrata(spec, trace, arena, forward_s, shm_dir, breakdown)
                report(spec, arena, args.forward_ms, base, ours, args.plain, busy)
                if breakdown is not None:
                    seconds = [None if r.manager_cpu_ns is None else (r.manager_ns / 1e9, r.manager_cpu_ns / 1e9)
                               for r in (ours, base)]  # fmt: skip
                    for line in breakdown.report(*seconds):
                        print(f"breakdown (kvstrata): {line}")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
