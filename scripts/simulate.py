"""Run the deterministic simulation of engines, store and tiers (kvstrata/_dev/sim, issue #37).

    PYTHONPATH=$PWD .venv/bin/python scripts/simulate.py --minutes 1 [--seed 7]
    PYTHONPATH=$PWD .venv/bin/python scripts/simulate.py --replay trace.json
    PYTHONPATH=$PWD .venv/bin/python scripts/simulate.py --scenarios
    PYTHONPATH=$PWD .venv/bin/python scripts/simulate.py --mutants [--only NAME]

Seeds run one after another from `--seed` (each draws its own world: 1-3 engines, tier
policies, sizes) for at most `--events-per-seed` actions, until `--minutes` (or `--events`)
are spent. After every action the invariants are checked (kvstrata/_dev/sim/invariants.py).
A violation stops the run: the script prints it, shrinks the run to a short trace, prints
that trace as one JSON line (replay it with `--replay`) and exits 1. The last line is
always `N events, E events/s, V violations`.

`--scenarios` runs the fixed interleavings of the issue's findings instead
(kvstrata/_dev/sim/scenarios.py) and prints what each violates (nothing, once fixed).
`--mutants` runs the mutation check (kvstrata/_dev/sim/mutation.py): each protocol fix of
kvstrata/_dev/sim/mutants.py reverted by one line in a scratch copy of the package, the
simulation run on it in a child process; every mutant must be found and the unmutated
copy must keep every invariant (a mutant whose line moved is reported `stale`).
Iteration over sets of bytes depends on PYTHONHASHSEED: the script fixes it (re-executing
itself) so a trace replays the same in any process.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
# `--minutes` is the whole run's wall clock: importing vLLM (through the connector) takes
# 5-15 s on a loaded 2-core machine, so the budget starts here, not after the imports.
PROCESS_STARTED = time.perf_counter()


def build_parser() -> argparse.ArgumentParser:
    """The command line (importable without running anything: tests/docs checks the docs' commands)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=1.0, help="wall-clock budget (default 1)")
    parser.add_argument("--events", type=int, default=None, help="stop after this many events instead")
    parser.add_argument("--seed", type=int, default=0, help="first seed (default 0)")
    parser.add_argument("--events-per-seed", type=int, default=20_000)
    parser.add_argument("--shrink-seconds", type=float, default=120.0)
    parser.add_argument("--progress", action="store_true", help="a line after each seed (long runs in the background)")
    parser.add_argument(
        "--no-purge-races", action="store_true",
        help="leave out weight updates (purges racing the work in flight) and the disk index check (#37, 3 and 4)",
    )  # fmt: skip
    parser.add_argument("--replay", help="a trace printed by a failing run (a file, or the JSON itself)")
    parser.add_argument("--scenarios", action="store_true", help="run the fixed interleavings of issue #37")
    parser.add_argument(
        "--mutants", action="store_true",
        help="the mutation check: each protocol fix reverted (kvstrata/_dev/sim/mutants.py) must be found",
    )  # fmt: skip
    parser.add_argument("--only", action="append", default=[], help="with --mutants: run this mutant only (repeatable)")
    parser.add_argument("--jobs", type=int, default=2, help="with --mutants: mutants run at once (default 2)")
    parser.add_argument("--timeout", type=float, default=600.0, help="with --mutants: seconds one mutant may run")
    return parser


def main() -> int:
    args = build_parser().parse_args()
    logging.disable(logging.CRITICAL)  # the store logs what it refuses: the checks say what matters

    from kvstrata._dev.sim.explore import replay, run_seed, shrink
    from kvstrata._dev.sim.scenarios import SCENARIOS
    from kvstrata._dev.sim.world import config_from_json

    if args.mutants:
        return run_mutants(args)
    if args.scenarios:
        failed = 0
        for name, scenario in SCENARIOS.items():
            violations = scenario()
            failed += bool(violations)
            print(f"{name}: {violations[0] if violations else 'ok'}")
        print(f"{len(SCENARIOS)} scenarios, {failed} with violations")
        return 1 if failed else 0
    if args.replay:
        text = Path(args.replay).read_text() if os.path.exists(args.replay) else args.replay
        trace = json.loads(text)
        config = config_from_json(trace["config"])
        started = time.perf_counter()
        violations = replay(config, [tuple(action) for action in trace["actions"]])
        seconds = time.perf_counter() - started
        for violation in violations[:5]:
            print(f"violation: {violation}")
        events = len(trace["actions"])
        print(f"{events} events, {events / max(seconds, 1e-9):.0f} events/s, {len(violations)} violations")
        return 1 if violations else 0

    deadline = PROCESS_STARTED + args.minutes * 60
    started = time.perf_counter()
    events, seed = 0, args.seed
    while time.perf_counter() < deadline and (args.events is None or events < args.events):
        budget = args.events_per_seed if args.events is None else min(args.events_per_seed, args.events - events)
        result = run_seed(seed, budget, deadline, not args.no_purge_races)
        events += result.events
        if result.violations:
            seconds = time.perf_counter() - started
            print(f"seed {seed}: violation after {result.events} events: {result.violations[0]}")
            small = shrink(result.config, result.actions, result.violations[0], args.shrink_seconds)
            print(f"shrunk to {len(small)} actions; replay with --replay '<the JSON line below>':")
            result.actions = small
            print(result.trace())
            print(f"{events} events, {events / seconds:.0f} events/s, 1 violations")
            return 1
        if args.progress:
            seconds = time.perf_counter() - started
            print(f"seed {seed}: {events} events, {events / seconds:.0f} events/s, 0 violations", flush=True)
        seed += 1
    seconds = time.perf_counter() - started
    print(f"seeds {args.seed}..{seed - 1}")
    print(f"{events} events, {events / seconds:.0f} events/s, 0 violations")
    return 0


def run_mutants(args: argparse.Namespace) -> int:
    """Each mutant on a scratch copy in a child process; exit 1 unless all are found and the control is clean."""
    from kvstrata._dev.sim import mutation
    from kvstrata._dev.sim.mutants import MUTANTS, UNFOUND

    chosen = [m for m in MUTANTS + UNFOUND if m.name in args.only] if args.only else MUTANTS
    unknown = set(args.only) - {m.name for m in MUTANTS + UNFOUND}
    if unknown:
        print(f"unknown mutants: {', '.join(sorted(unknown))}")
        return 2
    started = time.perf_counter()
    outcomes = mutation.run(chosen, jobs=args.jobs, timeout_s=args.timeout, report=lambda line: print(line, flush=True))
    found = sum(o.status == "found" for o in outcomes)
    print(f"{found} of {len(chosen)} mutants found; {time.perf_counter() - started:.0f} s")
    return 0 if mutation.passed(outcomes) else 1


if __name__ == "__main__":
    if os.environ.get("PYTHONHASHSEED") != "0":  # one hash seed: traces replay the same in every process
        os.environ["PYTHONHASHSEED"] = "0"
        os.execv(sys.executable, [sys.executable, *sys.argv])
    sys.exit(main())
