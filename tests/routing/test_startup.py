"""The router's start-up order, on a fake clock, as Serve drives it (#48, finding 4): the
figures are read as soon as Serve names the replicas, the app's readiness probe loads no
replica, and a conversation's second turn goes to the node holding its first, whichever
replica the probe went to.

On 9033d95 this failed (checked with the real clock, which that code had no seam for): the
router read figures only from its first request on (the probe went by the fallback, and
nothing was read when Serve named the replicas), and counted every request routed in the
last minute as load, so probe + first turn on the holder passed the bound and the second
turn went to the other node: (probe, first, second) = (node-b fallback, node-b, node-a)."""

from __future__ import annotations

import asyncio

import pytest
from ray.serve._private.common import DeploymentHandleSource

import kvstrata.connector.compat  # noqa: F401 - vLLM's hashing imported before any decision is timed
from kvstrata.actors.directory import DirectoryShard
from kvstrata.routing.keys import chunks_of_prompt
from kvstrata.routing.router import TierAwareRouter
from tests.routing.test_router import DEPLOYMENT, PROMPT, SCHEME, Replica, figures, request
from tests.utils import FakeClock

PROBE = PROMPT[:12]  # the readiness probe: a short completion, no whole block
TURN1 = PROMPT[:700]  # system prompt + first user turn: 5 whole chunks of 128 tokens
TURN2 = PROMPT[:1100]  # ... + the reply and the next user turn


def patch_router(monkeypatch, read_cluster) -> None:
    """The stores' figures from `read_cluster`; no tokenizer to warm up. Patched in the
    globals each method reads them from: Serve's RequestRouterConfig cloudpickles the
    router class (tests/routing/test_figures.py makes one), which gives the class's
    methods globals of their own, apart from the module's."""
    monkeypatch.setitem(TierAwareRouter._refresh_forever.__globals__, "read_cluster", read_cluster)
    monkeypatch.setitem(TierAwareRouter._warm_up.__globals__, "_warm_up", lambda tokenizers: None)


async def settle() -> None:
    """Let the loop run what is ready (the router's tasks whose awaits complete at once)."""
    for _ in range(20):
        await asyncio.sleep(0)


@pytest.mark.parametrize("probe_to", ["node-a", "node-b"])
def test_the_second_turn_goes_to_the_first_turns_node_after_a_readiness_probe(monkeypatch, probe_to):
    shard = DirectoryShard(0)
    reads: list[set[str]] = []

    async def read_cluster(nodes, previous, timeout_s):
        reads.append(set(nodes))
        return figures(shard)

    async def power_of_two(self, candidates, pending_request=None):  # the probe's replica, chosen by the test
        by_node = {r.node_id: r for r in candidates}
        return [[by_node[probe_to], *[r for r in candidates if r.node_id != probe_to]]]

    patch_router(monkeypatch, read_cluster)
    pow_2 = TierAwareRouter._fallback.__globals__["PowerOfTwoChoicesRequestRouter"]
    monkeypatch.setattr(pow_2, "choose_replicas", power_of_two)
    clock = FakeClock()

    async def route(made: TierAwareRouter, n: int, tokens: list[int], seconds: float):
        """Serve routes request n, sends it to the first replica offered, and it completes after `seconds`."""
        pending = request(n, tokens=tokens)
        groups = await made.choose_replicas(list(made.curr_replicas.values()), pending)
        went = groups[0][0]
        made.on_request_routed(pending, went.replica_id, None)
        decision = made._decisions[f"i{n}"][0]
        clock.advance(seconds)
        made.on_request_completed(went.replica_id, f"i{n}")
        return went.node_id, decision.kind

    async def run():
        made = TierAwareRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
        made.initialize_state(
            model="m", refresh_seconds=3600, ledger=False, prefetch=False, clock=clock,
            decision_timeout_s=60, lookup_timeout_s=60,  # not tested here: a busy machine must not force a fallback
        )  # fmt: skip
        made.update_replicas([Replica("r-a", "node-a"), Replica("r-b", "node-b")])
        await settle()
        probe = await route(made, 0, PROBE, 0.2)  # Serve LLM's readiness check, as the app comes up
        clock.advance(1.0)
        first = await route(made, 1, TURN1, 2.0)
        holder = first[0]
        # Its engine stored the first turn's chunks; the directory hears of them.
        keys = chunks_of_prompt(SCHEME, TURN1).keys
        shard.sync(holder, {"ns": ([(k, "CPU", True) for k in keys], -1, False)})
        clock.advance(10.0)  # past pending_seconds: the directory's word stands
        second = await route(made, 2, TURN2, 1.0)
        return reads, probe, first, second, holder, made

    reads, probe, first, second, holder, made = asyncio.run(run())
    assert second == (holder, "estimate"), (probe, first, second)
    assert first[1] == "estimate"  # figures were there before the first turn, not read because of it
    assert reads and reads[0] == {"node-a", "node-b"}  # read as soon as Serve named the replicas
    assert sum(made._in_flight.values()) == 0  # nothing completed is load


def test_a_replica_on_a_new_node_has_its_figures_read_at_once(monkeypatch):
    reads: list[set[str]] = []

    async def read_cluster(nodes, previous, timeout_s):
        reads.append(set(nodes))
        return figures(DirectoryShard(0))

    patch_router(monkeypatch, read_cluster)

    async def run():
        made = TierAwareRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
        made.initialize_state(model="m", refresh_seconds=3600, ledger=False, prefetch=False, clock=FakeClock())
        made.update_replicas([Replica("r-a", "node-a")])
        await settle()
        made.update_replicas([Replica("r-a", "node-a"), Replica("r-b", "node-b")])  # figures know node-b
        await settle()
        assert len(reads) == 1  # nothing new: no read before the period ends
        made.update_replicas([Replica("r-a", "node-a"), Replica("r-b", "node-b"), Replica("r-c", "node-c")])
        await settle()
        made._refresher.cancel()

    asyncio.run(run())
    assert reads == [{"node-a"}, {"node-a", "node-b", "node-c"}]
