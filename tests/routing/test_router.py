"""`TierAwareRouter` as Serve drives it (`choose_replicas`, `on_request_completed`), with
replicas, node figures and directory shards that answer in-process: a request goes to
the replica whose node holds its prefix, the load bound spills a hot prefix, and a
directory that does not answer (or a request without a prompt) is routed as Serve's
power-of-two-choices router does, counted, within the decision timeout."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
from ray.serve.request_router import PendingRequest

from kvstrata.actors.directory import DirectoryShard
from kvstrata.routing.figures import ClusterFigures, NodeFigures
from kvstrata.routing.keys import KeyScheme, chunks_of_prompt
from kvstrata.routing.prefetch import RoutePrefetcher
from kvstrata.routing.router import TierAwareRouter
from kvstrata.tiers.estimates import Cost

DEPLOYMENT = DeploymentID(name="LLMServer:m", app_name="app")
SCHEME = KeyScheme("ns", 32, (128,), (0,), None, "sha256", 1 << 20)
PROMPT = [(i * 31) % 1000 for i in range(1200)]  # 9 whole chunks of 128 tokens


class Replica:
    """What a router reads of Serve's `RunningReplica`."""

    def __init__(self, name: str, node_id: str):
        self.replica_id = ReplicaID(name, DEPLOYMENT)
        self.node_id = node_id
        self.availability_zone = None
        self.multiplexed_model_ids: set[str] = set()
        self.max_ongoing_requests = 8

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return 0


class Shard:
    """A directory shard's actor handle: `coverage.remote` answers in-process (or never)."""

    def __init__(self, shard: DirectoryShard | None):
        self.shard = shard
        self.coverage = self

    def remote(self, namespace, keys):
        if self.shard is None:
            return asyncio.get_running_loop().create_future()  # a shard that never answers
        answer = asyncio.get_running_loop().create_future()
        answer.set_result(self.shard.coverage(namespace, keys))
        return answer


def figures(shard: DirectoryShard | None) -> ClusterFigures:
    peers = {"peer": Cost(0.005, 0.2e9)}  # as the stores measured their peer fetches
    nodes = {node: NodeFigures(node, {"ns": SCHEME}, {"ns": ("m",)}, peers, 4000.0) for node in ("node-a", "node-b")}
    return ClusterFigures(nodes, [Shard(shard)])


def router(shard: DirectoryShard | None, **kwargs) -> TierAwareRouter:
    made = TierAwareRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
    made.initialize_state(model="m", refresh_seconds=0, ledger=False, **{"seed": 0, **kwargs})
    made.update_replicas([Replica("r-a", "node-a"), Replica("r-b", "node-b")])
    made.set_figures(figures(shard))
    return made


def request(n: int, tokens=PROMPT, **kwargs) -> PendingRequest:
    metadata = RequestMetadata(request_id=f"q{n}", internal_request_id=f"i{n}")
    return PendingRequest(args=[], kwargs={"request_token_ids": list(tokens), **kwargs}, metadata=metadata)


def holding(node: str, chunks: int) -> DirectoryShard:
    shard = DirectoryShard(0)
    keys = chunks_of_prompt(SCHEME, PROMPT).keys[:chunks]
    shard.sync(node, {"ns": ([(k, "CPU", True) for k in keys], -1, False)})
    return shard


async def choose(made: TierAwareRouter, pending: PendingRequest) -> list[str]:
    groups = await made.choose_replicas(list(made.curr_replicas.values()), pending)
    return [replica.node_id for group in groups for replica in group]


def test_a_request_goes_first_to_the_node_holding_its_prefix():
    async def run():
        made = router(holding("node-b", 9))
        assert await choose(made, request(1)) == ["node-b", "node-a"]
        decision, charged = made._decisions["i1"]
        assert decision.kind == "estimate" and charged.unique_id == "r-b"
        assert decision.coverage[charged].servable == 9 * 128
        other = ReplicaID("r-a", DEPLOYMENT)
        assert decision.coverage[other].peer == 9 * 128  # reachable from there too, at the peer's cost
        assert decision.estimates[charged].seconds < decision.estimates[ReplicaID("r-a", DEPLOYMENT)].seconds
        assert made.counters == {"estimate": 1}

    asyncio.run(run())


def test_a_hot_prefix_spills_over_the_load_bound_and_returns_within_it():
    async def run():
        made = router(holding("node-a", 9))
        first = [(await choose(made, request(n)))[0] for n in range(3)]  # none completes meanwhile
        assert first == ["node-a", "node-a", "node-b"]  # a third on a: 3 > ceil(1.25 * (2 + 1) / 2)
        made.on_request_completed(ReplicaID("r-a", DEPLOYMENT), "i0")
        made.on_request_completed(ReplicaID("r-a", DEPLOYMENT), "i1")
        assert (await choose(made, request(3)))[0] == "node-a"  # 3 <= ceil(1.25 * (3 + 1) / 2)
        assert made._in_flight == {ReplicaID("r-a", DEPLOYMENT): 1, ReplicaID("r-b", DEPLOYMENT): 1}

    asyncio.run(run())


def test_requests_sharing_a_new_prefix_follow_the_first_before_the_directory_knows_it():
    async def run():
        made = router(DirectoryShard(0))  # nothing stored anywhere yet
        first = (await choose(made, request(1)))[0]
        follow = [(await choose(made, request(n)))[0] for n in (2, 3)]
        assert follow[0] == first  # the first request's chunks are on their way into that arena
        assert follow[1] != first  # three in flight: the load bound spills the third
        decision, _ = made._decisions["i2"]
        assert decision.coverage[decision.ranking[0]].arena == 9 * 128

    asyncio.run(run())


@pytest.mark.parametrize("seed", range(4))
def test_a_next_turn_follows_its_conversation_past_what_the_directory_sees(seed):
    """Both nodes hold the shared system prompt; the first turn's tail (no whole chunk of
    its own) is only in the engine that computed it: the second turn goes there too."""

    async def run():
        shard = DirectoryShard(0)
        shared = chunks_of_prompt(SCHEME, PROMPT[:400]).keys  # 3 chunks
        for node in ("node-a", "node-b"):
            shard.sync(node, {"ns": ([(k, "CPU", True) for k in shared], -1, False)})
        made = router(shard, seed=seed)
        first = (await choose(made, request(1, tokens=PROMPT[:500])))[0]
        made.on_request_completed(made._decisions["i1"][1], "i1")
        assert (await choose(made, request(2, tokens=PROMPT[:700])))[0] == first
        decision, chosen = made._decisions["i2"]
        assert decision.coverage[chosen].recent == 480 and decision.estimates[chosen].recompute_tokens == 700 - 480

    asyncio.run(run())


@pytest.mark.parametrize(
    "shard, pending, reason",
    [
        (None, request(7), "fallback:directory_unavailable"),  # the directory never answers
        (DirectoryShard(0), request(7, tokens=[]), "fallback:no_prompt_tokens"),  # nothing to look up
    ],
    ids=["silent-directory", "no-prompt"],
)
def test_a_request_the_look_up_cannot_serve_is_routed_as_power_of_two_choices(shard, pending, reason):
    async def run():
        made = router(shard, lookup_timeout_s=0.05, decision_timeout_s=0.5)
        started = time.monotonic()
        chosen = await choose(made, PendingRequest(pending.args, pending.kwargs, pending.metadata))
        assert time.monotonic() - started < 5  # bounded by the timeouts, never a stall
        assert sorted(chosen) == ["node-a", "node-b"] and made.counters == {reason: 1}
        made.on_request_completed(ReplicaID("r-a", DEPLOYMENT), "i7")
        assert sum(made._in_flight.values()) == 0

    asyncio.run(run())


def test_nothing_is_looked_up_before_the_first_figures_arrive():
    async def run():
        made = router(DirectoryShard(0))
        made._figures = None
        assert len(await choose(made, request(1))) == 2
        assert made.counters == {"fallback:warming_up": 1}

    asyncio.run(run())


class FakeStore:
    """A node store's client whose `send_prefetch` records the call."""

    def __init__(self, node: str, calls: list, arrived: threading.Event):
        self.node, self.calls, self.arrived = node, calls, arrived

    def send_prefetch(self, namespace, keys, deadline_s, lease_s):
        self.calls.append((self.node, namespace, list(keys), deadline_s, lease_s))
        self.arrived.set()


def test_the_chosen_node_is_asked_to_prefetch_the_prompts_loadable_chunks():
    calls: list = []
    arrived = threading.Event()

    async def run():
        made = router(holding("node-b", 5), prefetch_lease_s=3.0)
        made._prefetcher = RoutePrefetcher(3.0, store_of=lambda node: FakeStore(node, calls, arrived))
        assert (await choose(made, request(1)))[0] == "node-b"

    asyncio.run(run())  # waits for the executor's job, as it shuts the loop's default executor down
    assert arrived.is_set()
    [(node, namespace, keys, deadline_s, lease_s)] = calls
    assert (node, namespace, lease_s) == ("node-b", "ns", 3.0)
    assert keys == list(chunks_of_prompt(SCHEME, PROMPT).keys)  # all 9 chunks end before the last token
    assert 0 < deadline_s < 10  # the request's estimated time to first token


def test_no_prefetch_when_turned_off_or_when_the_look_up_fell_back():
    calls: list = []

    async def run():
        made = router(holding("node-b", 5), prefetch=False)
        await choose(made, request(1))
        assert made._prefetcher is None
        made = router(None, decision_timeout_s=0.05)  # a shard that never answers: power of two choices
        made._prefetcher = RoutePrefetcher(store_of=lambda node: FakeStore(node, calls, threading.Event()))
        await choose(made, request(2))

    asyncio.run(run())
    assert calls == []


def test_a_store_that_cannot_be_reached_costs_the_request_nothing():
    def unreachable(node):
        raise ConnectionError(f"store on {node} is gone")

    async def run():
        made = router(holding("node-b", 5))
        made._prefetcher = RoutePrefetcher(store_of=unreachable)
        assert (await choose(made, request(1)))[0] == "node-b"  # routed as without prefetch
        return made._prefetcher

    prefetcher = asyncio.run(run())  # waits for the executor's job
    assert prefetcher.counters == {"sent": 0, "chunks": 0, "failed": 1}


def test_a_new_hot_prefix_stays_on_one_home_while_it_has_free_batch_slots():
    """#48, finding 2: a new prefix goes to its rendezvous home, and the requests sharing
    it follow while the home has free batch slots -- no second copy on another node --
    then the bound spills the next. Every router process picks the same home."""

    async def run():
        homes = set()
        for _ in range(2):  # two router processes
            made = router(DirectoryShard(0), batch_slots=4)
            chosen = [(await choose(made, request(n)))[0] for n in range(5)]  # none completes
            assert chosen[:4] == [chosen[0]] * 4 and chosen[4] != chosen[0], chosen
            homes.add(chosen[0])
        assert len(homes) == 1

    asyncio.run(run())
