"""Issue #37's findings 1, 2, 6 and 7 as fixed interleavings of the simulation
(kvstrata/_dev/sim/scenarios.py): each keeps every invariant of kvstrata/_dev/sim/invariants.py.
So do the interleavings of the protocol fixes random runs miss (scenarios_fixes.py), each
of which violates its invariant with its fix reverted (`scripts/simulate.py --mutants`).

Proof that they test something: each failed on commit 297d87f (the simulation before the
protocol fixes) with the violation the issue describes, and passes from 7659a2b on:

    git checkout 297d87f && PYTHONPATH=$PWD python scripts/simulate.py --scenarios
    unpin-overtakes-hold: ... load of 7a1a...-g0 read slot 0, which holds other bytes
    stale-mirror-after-lease: ... HIT on 7a1a...-g0 names slot 0, which holds other bytes
    store-stall-expires-leases: ... load of 7a1a...-g0 read slot 0, which holds other bytes
    lost-reply-leaks-reservations: ... slot 4 held for sim-engine-0-01 (an engine that does
        not know of it) for 5.1s, more than a lease
    lost-registration-locks-out: ... locked out of its own holder name (holder ... is
        already registered by another engine on this node store ...)
    stalled-store-holds-requests: ... request e0-01-r1 waited 6 steps on a store that has
        not answered
"""

from __future__ import annotations

import logging

import pytest

from kvstrata._dev.sim.scenarios import SCENARIOS


@pytest.fixture(autouse=True)
def _quiet_store():
    logging.disable(logging.CRITICAL)  # the store logs the refusals the stories provoke
    yield
    logging.disable(logging.NOTSET)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_interleaving_of_the_finding_keeps_every_invariant(name):
    assert SCENARIOS[name]() == []
