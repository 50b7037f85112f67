"""The prepared GPU check: one command that answers "does the worker path work on CUDA,
and how close to the link" on a GPU machine lent for a few minutes.

    python scripts/gpu_check.py OUT_DIR            # on a GPU machine, from the repository root
    python scripts/gpu_check.py OUT_DIR --cpu      # the same parts on CPU (what CI runs)

Runs, in order, each part in its own process with its own time limit, and never stops
at a failure (a part that fails or runs out of time is reported and the next starts):

  1. environment  GPU, driver, PCIe link, torch / Triton / cuda-bindings, the
                  cuMemcpyBatchAsync backend found, cudaHostRegister of /dev/shm
  2. pytest       `pytest -m gpu` on the copy engine's GPU tests
  3. harness      the worker's transfer path on every vLLM KV layout, every byte checked
  4. benchmark    benchmarks/gpu_copy.py against the same run's references and goals

Needs only what the GPU image has (Python 3.12, torch, Triton, cuda-bindings, numpy,
fsspec, xxhash, pyyaml, matplotlib, rich, pytest): no vLLM, Ray or pydantic, no network
(tests/test_gpu_check.py runs it with those blocked). Writes at most 8 files, all directly
in OUT_DIR: check.log (every part's output), summary.md, env.json, harness.json and
gpu_copy.{csv,md,png,json}. Ends with one summary table; exits 1 if a part failed.
43-47 s on an H200 (26 Nov 2026); 8 minutes at most, the sum of the limits.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GPU_TESTS = ["tests/connector/test_gpu_copy.py", "tests/connector/test_copy_engine.py", "tests/connector/test_gpu_harness.py"]


@dataclass
class Part:
    name: str
    argv: list[str]
    limit: float  # seconds
    status: str = "not run"
    seconds: float = 0.0
    output: list[str] = field(default_factory=list)


def parts(out: Path, cpu: bool) -> list[Part]:
    py = sys.executable
    device = ["--device", "cpu"] if cpu else []
    bench = ["--device", "cpu", "--max-total-mib", "4", "--pages-kib", "8,64", "--repeats", "1"] if cpu else ["--max-total-mib", "256"]
    return [
        Part("environment", [py, "-m", "kvstrata._dev.gpucheck.environment", "--out", str(out / "env.json")], 60),
        Part("pytest -m gpu", [py, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", "-q", "-rfEs", *GPU_TESTS], 150),
        Part("harness", [py, "-m", "kvstrata._dev.gpucheck.harness", *device, "--out", str(out / "harness.json")], 120),
        Part("benchmark", [py, "benchmarks/gpu_copy.py", *bench, "--out", str(out)], 150),
    ]


def run_part(part: Part, log, scale: float) -> None:
    """Run one part, its output streamed to stdout and the log; kill its process group at the limit."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    header = f"==== {part.name}: {' '.join(part.argv[1:])} (limit {part.limit * scale:.0f} s)"
    print(header, flush=True)
    log.write(header + "\n")
    started = time.monotonic()
    proc = subprocess.Popen(
        part.argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            part.output.append(line.rstrip("\n"))
            sys.stdout.write(line)
            sys.stdout.flush()
            log.write(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=part.limit * scale)
        part.status = "ok" if code == 0 else f"failed (exit {code})"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        part.status = f"timed out ({part.limit * scale:.0f} s)"
    reader.join(timeout=10)
    part.seconds = time.monotonic() - started
    log.write(f"==== {part.name}: {part.status} in {part.seconds:.1f} s\n")
    log.flush()


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def result_of(part: Part, out: Path) -> str:
    """One cell: what the part found, read from its files or its last lines."""
    if part.name == "environment":
        info = _json(out / "env.json")
        if not info:
            return "no env.json"
        sys.path.insert(0, str(ROOT))
        from kvstrata._dev.gpucheck.environment import one_line

        return one_line(info)
    if part.name.startswith("pytest"):
        for line in reversed(part.output):
            if re.search(r"\d+ (passed|failed|skipped|deselected|error)", line):
                return line.strip("= ")
        return "no pytest summary"
    if part.name == "harness":
        data = _json(out / "harness.json")
        if not data:
            return "no harness.json"
        return (
            f"{data['runs']} runs ({data['runs'] - data['failed_runs']} exact), {data['jobs']} jobs, "
            f"{data['chunks_checked']} chunks checked, {data['bytes_moved'] / 2**30:.2f} GiB"
        )
    data = _json(out / "gpu_copy.json")
    if not data:
        return "no gpu_copy.json"
    rows = data.get("rows", [])
    met = [g for g in data.get("goals", []) if g["met"]]
    missed = [g for g in data.get("goals", []) if g["met"] is False]
    return f"{len(rows)} page sizes; goals: {len(met)} met, {len(missed)} missed" if data.get("goals") else f"{len(rows)} page sizes (CPU analogue)"


def summary_rows(steps: list[Part], out: Path) -> tuple[list[list[str]], list[list[str]]]:
    rows = [[p.name, p.status, f"{p.seconds:.1f}", result_of(p, out)] for p in steps]
    goals = []
    for goal in _json(out / "gpu_copy.json").get("goals", []):
        verdict = {True: "met", False: "MISSED", None: "not measured"}[goal["met"]]
        goals.append([goal["goal"], str(goal["measured"]), verdict])
    return rows, goals


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def print_summary(rows: list[list[str]], goals: list[list[str]]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(markdown(["part", "status", "s", "result"], rows))
        if goals:
            print(markdown(["goal", "measured", "verdict"], goals))
        return
    console = Console(width=160)
    table = Table(title="kvstrata GPU check")
    for column in ("part", "status", "s", "result"):
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*row)
    console.print(table)
    if goals:
        goal_table = Table(title="goals (docs/gpu-copy.md)")
        for column in ("goal", "measured", "verdict"):
            goal_table.add_column(column)
        for row in goals:
            goal_table.add_row(*row)
        console.print(goal_table)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder for the results (created; at most 8 files)")
    parser.add_argument("--cpu", action="store_true", help="run every part on CPU (forced where torch sees no GPU)")
    parser.add_argument("--only", default=None, help="comma-separated part names to run (default: all)")
    parser.add_argument("--limit-scale", type=float, default=1.0, help="multiply every part's time limit")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    import torch

    cpu = args.cpu or not torch.cuda.is_available()
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out.resolve()
    steps = parts(out, cpu)
    if args.only:
        wanted = set(args.only.split(","))
        steps = [p for p in steps if p.name.split()[0] in wanted]
    started = time.monotonic()
    with open(out / "check.log", "w") as log:
        log.write(f"kvstrata GPU check ({'CPU mode' if cpu else 'CUDA'}), {time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n")
        for part in steps:
            run_part(part, log, args.limit_scale)
    rows, goals = summary_rows(steps, out)
    total = time.monotonic() - started
    text = f"# kvstrata GPU check ({'CPU mode' if cpu else 'CUDA'}), {total:.0f} s\n\n{markdown(['part', 'status', 's', 'result'], rows)}\n"
    if goals:
        text += f"\n{markdown(['goal', 'measured', 'verdict'], goals)}\n"
    (out / "summary.md").write_text(text)
    print_summary(rows, goals)
    print(f"gpu check: {sum(p.status == 'ok' for p in steps)}/{len(steps)} parts ok in {total:.0f} s; results in {out}")
    return 0 if all(p.status == "ok" for p in steps) else 1


if __name__ == "__main__":
    sys.exit(main())
