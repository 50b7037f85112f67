"""The mutation check (kvstrata/_dev/sim/mutation.py, the list in kvstrata/_dev/sim/mutants.py): each
protocol fix reverted by one line in a scratch copy of the package must be found by its
finder (a directed scenario, or random runs within 100,000 events), and the unmutated
copy must keep every invariant under every finder the list uses.

The whole check forks one child per mutant (after one vLLM import) and runs two at a
time: `scripts/simulate.py --mutants` prints each outcome as it comes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kvstrata._dev.sim import mutation
from kvstrata._dev.sim.mutants import MUTANTS, UNFOUND
from kvstrata._dev.sim.mutation import Mutant, mutate, scratch_copy

CI_EVENTS = 100_000  # the most events a random finder may need


def test_a_mutant_replaces_exactly_its_line_keeping_the_indentation():
    source = "def f(x):\n    if x > 1:\n        return 1\n    return 0\n"
    mutant = Mutant("m", "kvstrata/x.py", "if x > 1:", "if False:", "fix", "scenario:s")
    assert mutate(source, mutant) == "def f(x):\n    if False:\n        return 1\n    return 0\n"


def test_a_line_that_moved_or_repeats_is_stale_not_found():
    mutant = Mutant("m", "kvstrata/x.py", "if x > 2:", "if False:", "fix", "scenario:s")
    assert mutate("if x > 1:\n    pass\n", mutant) is None
    assert mutate("if x > 2:\n    pass\nif x > 2:\n    pass\n", mutant) is None
    root, why = scratch_copy(Mutant("m", "kvstrata/_dev/sim/mutation.py", "no such line at all", "x", "fix", "scenario:s"))
    assert root is None and "not in it exactly once" in why


def test_every_mutant_names_a_line_of_the_code_and_a_finder_within_the_ci_budget():
    names = [mutant.name for mutant in MUTANTS + UNFOUND]
    assert len(names) == len(set(names))
    from kvstrata._dev.sim.scenarios import SCENARIOS

    for mutant in MUTANTS + UNFOUND:
        root, why = scratch_copy(mutant)
        assert root is not None, f"{mutant.name} is stale: {why}"
        shutil.rmtree(root)
        kind, _, arg = mutant.finder.partition(":")
        if kind == "scenario":
            assert arg in SCENARIOS, mutant.name
        else:
            assert kind == "random" and mutation._random_range(arg)[0] <= CI_EVENTS, mutant.name


def test_scratch_copies_are_removed(tmp_path):
    root, _ = scratch_copy(None)
    assert (Path(root) / "kvstrata" / "_dev" / "sim" / "mutants.py").is_file()
    shutil.rmtree(root)


@pytest.mark.slow
def test_every_mutant_is_found_and_the_unmutated_code_keeps_every_invariant():
    outcomes = mutation.run(MUTANTS, jobs=2, report=lambda line: None)
    lines = "\n".join(outcome.line() for outcome in outcomes)
    assert mutation.passed(outcomes), lines
    assert {o.name for o in outcomes} == {m.name for m in MUTANTS} | {mutation.CONTROL}
