"""The mutation check: each protocol fix reverted by one line, and the simulation must notice.

A mutant (`mutants.py`) names a file of the package, the exact text of one line in it
(indentation aside), the line that replaces it (the same indentation), the fix it
reverts, and what finds it: a directed scenario (`scenario:<name>`, scenarios.py) or
random runs (`random:<events>[@<seed>]`: seeds from 0, or the one named, for at most that
many events in all, `PER_SEED_EVENTS` a seed).

`run` copies the package to a scratch directory per mutant (removed afterwards), applies
the one-line change there and runs the finder on the copy in a child process. The
children are forked from a parent that has imported vLLM already (the import costs tens
of seconds; forking it costs nothing), and import every `kvstrata` module afresh from
their copy: the parent's `kvstrata` modules are dropped in the child first.

Outcomes: `found` (the finder recorded a violation: the reverted fix matters and the
simulation checks it), `MISSED` (it kept every invariant), `stale` (the line is not in
the file, or more than once: the code moved, the list must be re-pointed; never counted
as found), `error` (the child failed or ran past its time). The control run is the
unmutated copy under every finder the list uses: it must record no violation.
"""

from __future__ import annotations

import importlib
import multiprocessing
import shutil
import signal
import sys
import threading
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2]  # the `kvstrata` package the mutants are cut from (kvstrata/_dev/sim/)
PER_SEED_EVENTS = 20_000
CONTROL = "(unmutated)"


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # the file, relative to the repository root: "kvstrata/store/control.py"
    old: str  # the line's exact text without its indentation
    new: str  # what replaces it (indented as the old line)
    fix: str  # the fix it reverts: commit, issue finding
    finder: str  # "scenario:<name>" | "random:<events>"


@dataclass
class Outcome:
    name: str
    status: str  # found | MISSED | stale | error
    detail: str = ""
    events: int = 0
    seconds: float = 0.0

    def line(self) -> str:
        return f"{self.name}: {self.status} ({self.seconds:.1f} s, {self.events} events) {self.detail}".rstrip()


def mutate(source: str, mutant: Mutant) -> str | None:
    """`source` with the mutant's line replaced; None if the line is not there exactly once."""
    lines = source.splitlines(keepends=True)
    at = [i for i, line in enumerate(lines) if line.strip() == mutant.old.strip()]
    if len(at) != 1:
        return None
    line = lines[at[0]]
    indent = line[: len(line) - len(line.lstrip())]
    ending = line[len(line.rstrip("\r\n")) :]
    lines[at[0]] = indent + mutant.new.strip() + ending
    return "".join(lines)


def scratch_copy(mutant: Mutant | None, package: Path = PACKAGE) -> tuple[Path | None, str]:
    """A temporary directory holding a copy of the package, mutated; (None, why) if stale."""
    root = Path(tempfile.mkdtemp(prefix="kvstrata-mutant-"))
    shutil.copytree(package, root / "kvstrata", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    if mutant is None:
        return root, ""
    relative = Path(mutant.path)
    if relative.parts and relative.parts[0] == "kvstrata":
        relative = Path(*relative.parts[1:])
    target = root / "kvstrata" / relative
    mutated = mutate(target.read_text(), mutant) if target.is_file() else None
    if mutated is None:
        where = "no such file" if not target.is_file() else "the line is not in it exactly once"
        shutil.rmtree(root, ignore_errors=True)
        return None, f"{mutant.path}: {where}: {mutant.old.strip()!r}"
    target.write_text(mutated)
    return root, ""


def find(finder: str) -> tuple[list[str], int]:
    """Run a finder on the `kvstrata` this process imports: (violations, events)."""
    import logging

    logging.disable(logging.CRITICAL)
    kind, _, arg = finder.partition(":")
    if kind == "scenario":
        scenarios = importlib.import_module("kvstrata._dev.sim.scenarios").SCENARIOS
        return list(scenarios[arg]()), 0
    if kind != "random":
        raise ValueError(f"unknown finder {finder!r}")
    explore = importlib.import_module("kvstrata._dev.sim.explore")
    budget, seed = _random_range(arg)
    events = 0
    while events < budget:
        result = explore.run_seed(seed, min(PER_SEED_EVENTS, budget - events))
        events += result.events
        if result.violations:
            return [f"seed {seed}: {result.violations[0]}"], events
        seed += 1
    return [], events


def _random_range(arg: str) -> tuple[int, int]:
    """`<events>[@<first seed>]` -> (events, first seed)."""
    events, _, seed = arg.partition("@")
    return int(events), int(seed or 0)


def _control_random(finders: list[str]) -> str | None:
    """One random finder from seed 0 covering every seed and event the mutants' random finders run."""
    ends = []
    for finder in finders:
        if finder.startswith("random:"):
            events, seed = _random_range(finder.split(":", 1)[1])
            ends.append(seed * PER_SEED_EVENTS + events)
    return f"random:{max(ends)}" if ends else None


def _child(root: str, finders: list[str], conn) -> None:
    """In the forked child: forget the parent's kvstrata, import the copy's, run the finders."""
    try:
        for name in [name for name in sys.modules if name == "kvstrata" or name.startswith("kvstrata.")]:
            del sys.modules[name]
        sys.path.insert(0, root)
        importlib.invalidate_caches()
        loaded = importlib.import_module("kvstrata")
        if not str(loaded.__file__).startswith(root):
            raise RuntimeError(f"the copy was not imported: {loaded.__file__}")
        events, found = 0, []
        for finder in finders:
            violations, count = find(finder)
            events += count
            if violations:
                found = [f"{finder}: {violations[0]}"]
                break
        conn.send(("ok", found, events))
    except BaseException:  # noqa: BLE001 - reported to the parent as the mutant's error
        conn.send(("error", [traceback.format_exc(limit=6)], 0))
    finally:
        conn.close()


@dataclass
class _Running:
    name: str
    root: Path
    process: multiprocessing.Process
    conn: object
    started: float
    deadline: float
    control: bool


def run(mutants: list[Mutant], jobs: int = 2, timeout_s: float = 240.0, report=print) -> list[Outcome]:
    """Run every mutant and the control; one `Outcome` each (the control's first), in order done."""
    # vLLM (through the connector's gateway) imported once here, before any fork.
    importlib.import_module("kvstrata.connector.compat")
    context = multiprocessing.get_context("fork")
    finders = sorted({m.finder for m in mutants}, key=lambda f: (f.startswith("random"), f))
    control_finders = [f for f in finders if not f.startswith("random:")]
    if _control_random(finders):
        control_finders.append(_control_random(finders))
    todo: list[tuple[str, Mutant | None, list[str]]] = [(CONTROL, None, control_finders)]
    todo += [(m.name, m, [m.finder]) for m in mutants]
    outcomes: list[Outcome] = []
    running: list[_Running] = []
    # A SIGTERM (a CI timeout) ends the run through `finally`: children killed, copies removed.
    previous = signal.signal(signal.SIGTERM, _terminate) if threading.current_thread() is threading.main_thread() else None
    try:
        while todo or running:
            while todo and len(running) < jobs:
                name, mutant, its_finders = todo.pop(0)
                root, why = scratch_copy(mutant)
                if root is None:
                    outcomes.append(Outcome(name, "stale", why))
                    report(outcomes[-1].line())
                    continue
                parent, child = context.Pipe(duplex=False)
                process = context.Process(target=_child, args=(str(root), its_finders, child), daemon=True)
                process.start()
                child.close()
                now = time.perf_counter()
                limit = timeout_s * (3 if mutant is None else 1)
                running.append(_Running(name, root, process, parent, now, now + limit, mutant is None))
            time.sleep(0.05)  # (polling children: the parent does nothing else)
            for job in list(running):
                outcome = _collect(job)
                if outcome is not None:
                    running.remove(job)
                    outcomes.append(outcome)
                    report(outcome.line())
    finally:
        for job in running:
            job.process.kill()
            job.process.join(5)
            shutil.rmtree(job.root, ignore_errors=True)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return outcomes


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _collect(job: _Running) -> Outcome | None:
    """The job's outcome once it answered, died or ran past its time; None while it runs."""
    seconds = time.perf_counter() - job.started
    message = None
    if job.conn.poll():
        try:
            message = job.conn.recv()
        except EOFError:
            message = ("error", ["the child died without an answer"], 0)
    elif not job.process.is_alive():
        message = ("error", [f"the child exited with {job.process.exitcode} and no answer"], 0)
    elif time.perf_counter() > job.deadline:
        job.process.kill()
        message = ("error", [f"ran past {job.deadline - job.started:.0f} s"], 0)
    if message is None:
        return None
    job.process.join(5)
    shutil.rmtree(job.root, ignore_errors=True)
    kind, found, events = message
    if kind == "error":
        return Outcome(job.name, "error", found[0].strip().splitlines()[-1], events, seconds)
    if job.control:
        return Outcome(job.name, "VIOLATED" if found else "ok", found[0] if found else "", events, seconds)
    return Outcome(job.name, "found" if found else "MISSED", found[0] if found else "", events, seconds)


def passed(outcomes: list[Outcome]) -> bool:
    """Every mutant found, none stale or failed, the control clean."""
    return all(o.status in ("found", "ok") for o in outcomes)


__all__ = ["CONTROL", "Mutant", "Outcome", "find", "mutate", "passed", "run", "scratch_copy"]
