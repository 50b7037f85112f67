"""The `kvstrata bench` subcommand: its arguments, the progress bar, the table and the JSON.

What is measured, and against what, is `kvstrata.bench.tiers`; where the scratch copies
live, `kvstrata.bench.scratch`. This module only plans the rows (which tiers, how many
bytes each), runs them under one `ExitStack` that owns every scratch location, and shows
the result. Exit codes: 0 every row measured, 1 some row failed (its reason is printed),
2 bad arguments, 130 interrupted (after the scratch files are removed).
"""

from __future__ import annotations

import argparse
import gc
import json
from contextlib import ExitStack

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvstrata.config import KvstrataConfig, parse_size

DESCRIPTION = (
    "Measure the write and read throughput of this node's configured tiers (cpu arena; disk and object "
    "store when configured) at a few chunk sizes, each beside a reference measured in the same run: "
    "memcpy for the arena, raw file I/O on the same directory for the disk, the raw client on the same "
    "bucket for the object store. Runs on scratch copies next to the live store's files, removed at the end; "
    "needs no running store and no Ray."
)
DEFAULT_CHUNK_SIZES = "256KiB,2MiB,8MiB"
DEFAULT_BYTES = "256MiB"
DEFAULT_ROUNDS = 3
ALIGNMENT = 4096  # O_DIRECT moves whole pages


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `kvstrata bench`, added to its subparser (`run_bench` reads them)."""
    parser.add_argument(
        "--sizes", "--chunk-sizes", dest="sizes", default=DEFAULT_CHUNK_SIZES,
        help=f"comma-separated chunk sizes, multiples of 4 KiB; a plain number is KiB (default: {DEFAULT_CHUNK_SIZES})",
    )  # fmt: skip
    parser.add_argument(
        "--bytes", dest="bench_bytes", default=DEFAULT_BYTES, metavar="SIZE",
        help=f"bytes moved per measurement, capped by the tier's capacity and free space (default: {DEFAULT_BYTES})",
    )  # fmt: skip
    parser.add_argument("--mib", type=int, default=None, help=argparse.SUPPRESS)  # --bytes in MiB (older spelling)
    parser.add_argument(
        "--rounds", type=int, default=DEFAULT_ROUNDS,
        help=f"rounds of side-by-side measurements; figures are medians (default: {DEFAULT_ROUNDS})",
    )  # fmt: skip
    parser.add_argument(
        "--tiers", default=None, help="comma-separated subset of cpu,disk,object (default: every configured tier)"
    )
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")


def run_bench(config: KvstrataConfig, console: Console, args: argparse.Namespace) -> int:
    """Benchmark the configured tiers on this node and print the table (or JSON); the exit code.

    `args` is what `add_bench_arguments`' options parsed to. The progress bar goes to
    `console`, or to stderr with `--json`, so stdout stays machine-readable.
    """
    from kvstrata.bench.tiers import TIERS, chunk_count

    try:
        chunks = [_chunk_size(text) for text in str(args.sizes).split(",") if text.strip()]
        budget = args.mib << 20 if args.mib is not None else parse_size(args.bench_bytes)
        tiers = _tiers(config, args.tiers, TIERS)
        if not chunks or budget <= 0 or args.rounds < 1:
            raise ValueError("--chunk-sizes, --bytes and --rounds must be positive")
    except ValueError as exc:
        Console(stderr=True).print(f"kvstrata bench: {exc}", markup=False, highlight=False)
        return 2
    plan = [(tier, chunk, *chunk_count(config, tier, chunk, budget)) for tier in tiers for chunk in chunks]
    try:
        rows = _run(config, plan, args.rounds, Console(stderr=True) if args.json else console)
    except KeyboardInterrupt:
        console.print("kvstrata bench: interrupted; its scratch files are removed", markup=False, highlight=False)
        return 130
    if args.json:
        console.out(json.dumps([row.as_dict() for row in rows], indent=2), highlight=False)
    else:
        console.print(bench_table(rows, budget, args.rounds))
        for line in _footnotes(rows):
            console.print(line, markup=False, highlight=False)
    return 1 if any(row.error for row in rows) else 0


def _run(config: KvstrataConfig, plan: list, rounds: int, console: Console) -> list:
    """Every row of the plan, one progress task each; the scratch locations are gone when it returns or raises."""
    from kvstrata.bench.scratch import Scratch
    from kvstrata.bench.tiers import BenchRow, measure

    rows: list[BenchRow] = []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    # As the store's actor does after start-up: a full collection of the objects that
    # exist now would stall the I/O threads in the middle of a measurement.
    gc.collect()
    gc.freeze()
    try:
        with ExitStack() as stack, Progress(*columns, console=console, transient=True) as progress:
            scratch = Scratch(config, stack)
            tasks = [progress.add_task(f"{tier:<6} {format_size(chunk):>8}", total=4 * rounds) for tier, chunk, *_ in plan]
            for task, (tier, chunk, count, capped_by) in zip(tasks, plan):
                if count < 1:
                    reason = f"{capped_by} leaves no room for one {format_size(chunk)} chunk"
                    rows.append(BenchRow(tier, chunk, 0, rounds, "", error=reason))
                    continue
                row = measure(tier, config, scratch, chunk, count, rounds, lambda task=task: progress.advance(task))
                if capped_by is not None:
                    row.notes.append(f"{format_size(row.moved_bytes)} per measurement: capped by {capped_by}")
                rows.append(row)
    finally:
        gc.unfreeze()
    return rows


# What "write" and "read" time, per tier (the table's caption names those in its rows).
MEASURED = {
    "cpu": "write = reserve arena slots, copy the chunks in, commit; read = pin, copy out, unpin",
    "disk": "write = cascade committed chunks from the arena to disk; read = promote them back, verified",
    "object": "write = upload committed chunks from the arena; read = download them back into it, verified",
}


def bench_table(rows: list, budget: int, rounds: int) -> Table:
    """The rows as a rich table; the title and caption say what the figures mean."""
    tiers = list(dict.fromkeys(row.tier for row in rows))
    table = Table(
        title=f"kvstrata tier throughput on this node: GB/s (10^9 bytes/s) moving {format_size(budget)} per "
        f"measurement, medians of {rounds} round{'s' if rounds > 1 else ''}; ÷ ref = median of the rounds' "
        "kvstrata ÷ reference (1.00: as fast as the reference)",
        caption="; ".join(f"{tier}: {MEASURED[tier]}" for tier in tiers)
        + ". Each reference moves the same chunks in the same run.",
    )
    for name in ("tier", "chunk", "write GB/s", "ref write GB/s", "write ÷ ref", "read GB/s", "ref read GB/s",
                 "read ÷ ref"):  # fmt: skip
        table.add_column(name, justify="left" if name == "tier" else "right")
    table.add_column("reference")
    for row in rows:
        figures = (row.write_gbps, row.ref_write_gbps, row.write_ratio, row.read_gbps, row.ref_read_gbps, row.read_ratio)
        cells = ["—" if value is None else f"{value:.2f}" for value in figures]
        if row.error:
            cells[0] = "[red]failed[/red]"
        table.add_row(row.tier, format_size(row.chunk_bytes), *cells, row.reference)
    return table


def _footnotes(rows: list) -> list[str]:
    lines = [f"{row.tier} {format_size(row.chunk_bytes)}: failed: {row.error}" for row in rows if row.error]
    seen: set[str] = set()
    for row in rows:
        for note in row.notes:
            line = f"{row.tier}: {note}" if "capped" not in note else f"{row.tier} {format_size(row.chunk_bytes)}: {note}"
            if line not in seen:
                seen.add(line)
                lines.append(line)
    return lines


def format_size(size: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size / (1 << 20):.1f} MiB" if size >= 1 << 20 else f"{size} B"


def _chunk_size(text: str) -> int:
    """A chunk size: `2MiB`, `256KiB`, or a plain number of KiB (`256`)."""
    size = int(text) * 1024 if text.strip().isdigit() else parse_size(text.strip())
    if size <= 0 or size % ALIGNMENT:
        raise ValueError(f"chunk size {text.strip()!r} is not a positive multiple of 4 KiB")
    return size


def _tiers(config: KvstrataConfig, requested: str | None, known: tuple[str, ...]) -> list[str]:
    """The configured tiers, or the requested ones (each must be configured), in the order of `known`."""
    configured = [tier for tier in known if tier == "cpu" or getattr(config.tiers, tier) is not None]
    if requested is None:
        return configured
    wanted = [name.strip() for name in requested.split(",") if name.strip()]
    for name in wanted:
        if name not in known:
            raise ValueError(f"--tiers: unknown tier {name!r} (known: {', '.join(known)})")
        if name not in configured:
            raise ValueError(f"--tiers: the {name} tier is not configured (tiers.{name} in the YAML)")
    return [tier for tier in configured if tier in wanted]
