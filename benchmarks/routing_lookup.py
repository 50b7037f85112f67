"""The router's directory look-up: its latency, what one directory shard serves, and the
bytes it moves; the figures behind docs/routing.md's paper model.

    python benchmarks/routing_lookup.py [--rounds 200] [--shards 4] [--json out.json]

One local Ray cluster (loopback). The directory's shards are real actors holding what
2, 8 or 64 simulated nodes published: node i of n holds the first (i+1)/n of the prompt's
chunks, half in its arena, half on its disk; the bucket holds all; besides, each node
holds 5,000 chunks of other prompts. The prompt is a chat request of 1k or 8k tokens
rendered through the model's tokenizer (the test model's: one token per character, so
tokenizing is cheap here; a BPE tokenizer costs more per token, see the table's
tokenize+hash column), named in 256-token chunks with sha256 (vLLM's default).

- Latency: `plan_prompt` (tokenize, hash, name the keys) then `cluster_coverages` (one
  `coverage` call per shard, all in flight, and the per-node merge), medians of
  `--rounds`; then, apart, what the router does after it: an estimate for each of 8
  replicas per node and the ranking (at 64 nodes: 512 replicas). Reference, same run: one no-op call (`ping`) to every shard, in flight
  together -- the floor of any one-round look-up.
- Throughput of one shard: `coverage` calls for the 8k prompt with all its keys in one
  call (the worst case: with S shards each call carries 1/S of them), 64 in flight from
  the driver, for `--seconds`; reference: `ping` calls the same way. The driver and the
  shard share this machine's 2 cores, so both are lower bounds.
- Bytes: pickled request and reply of one look-up, per shard and in all, when 2, 8 or
  64 nodes hold the prompt (64: every node holds all of it, the largest reply).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pickle
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import ray

from kvstrata.actors.directory import DirectoryShard, shard_of
from kvstrata.routing.estimate import DEFAULT_COSTS, ReplicaRates, estimate_ttft, rank_replicas
from kvstrata.routing.figures import ClusterFigures, NodeFigures
from kvstrata.routing.keys import KeyScheme, chunks_of_prompt
from kvstrata.routing.plan import cluster_coverages, plan_prompt
from kvstrata.routing.prompt import Tokenizers, render_token_ids
from kvstrata._dev.testing import build_tiny_llama, local_ray

NS = "bench-routing"
MODEL = "bench-model"
SCHEME = KeyScheme(NS, 32, (256,), (0,), None, "sha256", 512 << 10)
NOISE = 5000
REPLICAS_PER_NODE = 8


def choose(coverage: Any, prompt_tokens: int, per_node: int) -> list:
    """What the router does per request once it has the coverage: every replica's estimate, the ranking."""
    rates = ReplicaRates(5000.0, DEFAULT_COSTS)
    replicas = [(node, r) for node in coverage.nodes for r in range(per_node)]
    estimates = {(node, r): estimate_ttft(prompt_tokens, coverage.of(node), SCHEME.slot_bytes, rates, 0.1 * r, r)
                 for node, r in replicas}  # fmt: skip
    return rank_replicas(replicas, {k: e.seconds for k, e in estimates.items()}, {k: k[1] for k in replicas}, 1.25)


def chat(tokens: int) -> Any:
    """A chat request whose rendered prompt is about `tokens` tokens (one per character)."""
    text = "".join(f"turn {i}: the router names every chunk as the engine does. " for i in range(tokens // 40 + 1))
    return SimpleNamespace(messages=[{"role": "system", "content": text[: tokens - 30]}, {"role": "user", "content": "go"}])


def node_ids(count: int) -> list[str]:
    return [f"{i:056x}" for i in range(count)]


def publish(shards: list[Any], keys: tuple[bytes, ...], nodes: list[str]) -> None:
    """What `nodes` stores would have told the directory about these keys (and noise)."""
    calls = []
    for i, node in enumerate(nodes):
        held = keys[: len(keys) * (i + 1) // len(nodes)]
        updates = [(k, "CPU", True) for k in held[: len(held) // 2]] + [(k, "STORAGE", True) for k in held[len(held) // 2 :]]
        noise = [(bytes([n % 256]) + f"{node}-{n}".encode()[:31] + b"\0\0\0\0", "CPU", True) for n in range(NOISE)]
        if i == 0:
            updates += [(k, "OBJECT", True) for k in keys]
        per_shard: dict[int, list] = {}
        for update in updates + noise:
            per_shard.setdefault(shard_of(update[0], len(shards)), []).append(update)
        calls += [shards[s].sync.remote(node, {NS: (batch, -1, False)}) for s, batch in per_shard.items()]
    ray.get(calls, timeout=120)


def figures(nodes: list[str], shards: list[Any]) -> ClusterFigures:
    return ClusterFigures({n: NodeFigures(n, {NS: SCHEME}, {NS: (MODEL,)}, {}, 5000.0) for n in nodes}, shards)


async def ping_all(shards: list[Any]) -> list[str]:
    return await asyncio.gather(*(shard.ping.remote() for shard in shards))


def latency(args: argparse.Namespace, tokenizers: Tokenizers, loop: asyncio.AbstractEventLoop) -> list[dict[str, Any]]:
    rows = []
    for node_count in (2, 8, 64):
        shards = [ray.remote(DirectoryShard).options(num_cpus=0).remote(s) for s in range(args.shards)]
        nodes = node_ids(node_count)
        for tokens in (1024, 8192):
            body = chat(tokens)
            keys = chunks_of_prompt(SCHEME, render_token_ids(tokenizers.get(), body)).keys
            publish(shards, keys, nodes)
            seen = figures(nodes, shards)
            plan_s, directory_s, floor_s = [], [], []
            for _ in range(args.rounds):
                started = time.perf_counter()
                plan = plan_prompt([body], {}, tokenizers, seen, nodes, MODEL)
                planned = time.perf_counter()
                coverage = loop.run_until_complete(cluster_coverages(plan, seen, 10.0))
                done = time.perf_counter()
                loop.run_until_complete(ping_all(shards))
                floor_s.append(time.perf_counter() - done)
                plan_s.append(planned - started)
                directory_s.append(done - planned)
            servable = max(c.servable for c in coverage[NS].nodes.values())
            choose_s = []
            for _ in range(max(5, args.rounds // 10)):  # the router's per-request work after the look-up
                started = time.perf_counter()
                choose(coverage[NS], plan.prompt_tokens, REPLICAS_PER_NODE)
                choose_s.append(time.perf_counter() - started)
            rows.append({
                "nodes": node_count, "prompt_tokens": plan.prompt_tokens, "keys": len(keys),
                "tokenize_hash_ms": statistics.median(plan_s) * 1e3,
                "directory_merge_ms": statistics.median(directory_s) * 1e3,
                "total_ms": statistics.median(p + d for p, d in zip(plan_s, directory_s)) * 1e3,
                "p90_total_ms": sorted(p + d for p, d in zip(plan_s, directory_s))[int(0.9 * args.rounds)] * 1e3,
                "reference_ping_all_shards_ms": statistics.median(floor_s) * 1e3,
                "estimate_and_rank_ms": statistics.median(choose_s) * 1e3,
                "replicas": node_count * REPLICAS_PER_NODE,
                "servable_tokens_best_node": servable,
            })  # fmt: skip
            print(
                f"{node_count:>3} nodes {plan.prompt_tokens:>5} tokens ({len(keys)} keys): look-up "
                f"{rows[-1]['total_ms']:.2f} ms (tokenize+hash {rows[-1]['tokenize_hash_ms']:.2f}, directory+merge "
                f"{rows[-1]['directory_merge_ms']:.2f}); estimate+rank of {node_count * REPLICAS_PER_NODE} replicas "
                f"{rows[-1]['estimate_and_rank_ms']:.2f} ms; reference ping of {args.shards} shards "
                f"{rows[-1]['reference_ping_all_shards_ms']:.2f} ms"
            )
        for shard in shards:
            ray.kill(shard)
    return rows


def pump(call, seconds: float, window: int = 64) -> float:
    """Calls per second with `window` in flight for `seconds`."""
    in_flight = [call() for _ in range(window)]
    done = 0
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        ready, in_flight = ray.wait(in_flight, num_returns=1)
        done += len(ready)
        in_flight.append(call())
    elapsed = time.perf_counter() - started
    ray.get(in_flight)
    return done / elapsed


def throughput(args: argparse.Namespace, tokenizers: Tokenizers) -> dict[str, float]:
    shard = ray.remote(DirectoryShard).options(num_cpus=0).remote(0)
    body = chat(8192)
    keys = list(chunks_of_prompt(SCHEME, render_token_ids(tokenizers.get(), body)).keys)
    publish([shard], tuple(keys), node_ids(8))
    out = {
        "coverage_per_s_8k_prompt_all_keys": pump(lambda: shard.coverage.remote(NS, keys), args.seconds),
        "coverage_per_s_8k_prompt_quarter_keys": pump(lambda: shard.coverage.remote(NS, keys[::4]), args.seconds),
        "reference_ping_per_s": pump(lambda: shard.ping.remote(), args.seconds),
        "keys_all": len(keys),
    }
    ray.kill(shard)
    print(
        f"one shard: {out['coverage_per_s_8k_prompt_all_keys']:.0f} look-ups/s ({len(keys)} keys each), "
        f"{out['coverage_per_s_8k_prompt_quarter_keys']:.0f}/s ({len(keys[::4])} keys); "
        f"reference ping {out['reference_ping_per_s']:.0f}/s"
    )
    return out


def wire_bytes(tokenizers: Tokenizers, shards: int) -> list[dict[str, Any]]:
    """Pickled bytes of one look-up's requests and replies (in-process shards, no Ray)."""
    rows = []
    for node_count in (2, 8, 64):
        body = chat(8192)
        keys = chunks_of_prompt(SCHEME, render_token_ids(tokenizers.get(), body)).keys
        local = [DirectoryShard(s) for s in range(shards)]
        nodes = node_ids(node_count)
        for i, node in enumerate(nodes):
            held = keys if node_count == 64 else keys[: len(keys) * (i + 1) // node_count]
            for s, shard in enumerate(local):
                mine = [k for k in held if shard_of(k, shards) == s]
                shard.sync(node, {NS: ([(k, "CPU", True) for k in mine] + [(k, "STORAGE", True) for k in mine], -1, False)})
        request = reply = 0
        started = time.perf_counter()
        for s, shard in enumerate(local):
            mine = [k for k in keys if shard_of(k, shards) == s]
            request += len(pickle.dumps((NS, mine)))
            reply += len(pickle.dumps(shard.coverage(NS, mine)))
        rows.append({"nodes": node_count, "request_bytes": request, "reply_bytes": reply,
                     "coverage_cpu_ms": (time.perf_counter() - started) * 1e3,
                     "holders": sum(len(s.coverage(NS, keys)) for s in local[:1])})  # fmt: skip
        print(f"{node_count:>3} nodes holding: {request} B out, {reply} B back per 8k-token look-up over {shards} shards")
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--json", type=Path)
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    results: dict[str, Any] = {"args": vars(args) | {"json": str(args.json)}, "date": time.strftime("%Y-%m-%d")}
    with tempfile.TemporaryDirectory(prefix="kvstrata-bench-routing-") as scratch:
        tokenizers = Tokenizers(str(build_tiny_llama(Path(scratch) / "model")))
        with local_ray("kvstrata-bench-routing-lookup"):
            loop = asyncio.new_event_loop()
            try:
                results["latency"] = latency(args, tokenizers, loop)
                results["one_shard"] = throughput(args, tokenizers)
            finally:
                loop.close()
        results["bytes"] = wire_bytes(tokenizers, args.shards)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
