"""`kvstrata bench`: the tier throughput benchmark of this node's configured tiers.

For the CLI (`kvstrata/cli.py`), the whole surface:

    from kvstrata.bench import DESCRIPTION, add_bench_arguments, run_bench

    bench = commands.add_parser("bench", help="measure this node's tiers", description=DESCRIPTION)
    add_bench_arguments(bench)   # --chunk-sizes --bytes --rounds --tiers --json
    ...
    return run_bench(config, console, args)   # config: KvstrataConfig, console: rich Console; the exit code

`run_bench(config: KvstrataConfig, console: rich.console.Console, args: argparse.Namespace) -> int`
needs no running store and no Ray: it builds scratch stores in this process, next to the
live store's files but never in them (`scratch.py`), and removes them when it ends, also on
an error or Ctrl-C. Exit codes: 0 measured, 1 a tier failed (named, with its reason),
2 bad arguments, 130 interrupted.

The package, each module importing only those before it:
- `measure`: timing primitives shared with `benchmarks/tier_throughput.py` (cascade and
  promotion through a store's `step`, the raw file I/O reference);
- `scratch`: where the scratch copies live and how they are removed;
- `tiers`: one row, one tier at one chunk size beside its reference;
- `command`: arguments, progress bar, table and JSON.
"""

from kvstrata.bench.command import DESCRIPTION, add_bench_arguments, run_bench
from kvstrata.bench.measure import cascade, promote, timed  # what benchmarks/tier_throughput.py imports

__all__ = ["DESCRIPTION", "add_bench_arguments", "cascade", "promote", "run_bench", "timed"]
