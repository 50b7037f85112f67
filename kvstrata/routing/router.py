"""`TierAwareRouter`: a Ray Serve request router that sends each request where its KV is cheapest.

Select it in a Serve LLM config:

    deployment_config:
      request_router_config:
        request_router_class: kvstrata.routing:TierAwareRouter
        request_router_kwargs: {model: /models/llama}   # the name the engines load

For each request it (1) takes the prompt's token ids (`prompt`), (2) names its chunks as
the engines do (`keys`), (3) asks the cluster directory, in one batched call, which node
holds which chunk in its arena or on its disk, and which the bucket holds (`lookup`,
`coverage`), adding what it just routed where itself (`RecentPrefixes`: the directory
hears of chunks only after engines stored them) and what each replica's own prefix cache
holds (`EngineCacheView`: what was sent there, bounded by the engine's cache size),
(4) estimates every candidate replica's time to first token from its node's measured
prefill rate and tier costs plus the work already queued there (`estimate`), and (5)
offers Serve the replicas in that order, those with a free batch slot or within the load
bound on requests in flight first (near-equal estimates ordered by how much of the
prefix the node holds itself, then by the prefix's rendezvous order: one home per new
prefix).
Steps 1-3 run under `decision_timeout_s`; anything that fails or is late (no tokenizer,
no directory, no figures yet, a slow shard) routes the request as Serve's
`PowerOfTwoChoicesRequestRouter` does, and counts why. A request is never failed or held
by this router beyond that timeout.

What is visible: one DEBUG line per request (`kvstrata.routing.router`: the replica, its
estimate and parts, the others' estimates); counters `ray_kvstrata_router_decisions`
(by `decision`: `estimate` or `fallback:<why>`) and `ray_kvstrata_router_covered_tokens`;
and the deployment's ledger (`ledger.read_ledger`), with requests per replica and the
latest decisions.

Start-up order: the node stores' figures are read as soon as Serve names the replicas
(`update_replicas`), and again at once when a replica on a new node appears, not from the
first request on; loading the tokenizer runs beside that read, never before it. A request
routed before any figure arrived (the app's readiness probe, typically) is routed as
power of two choices and is not counted as load: only requests routed by estimate and not
yet completed are.

Invariants: state is touched only from Serve's router event loop (no locks); work that
blocks (tokenizing, hashing, loading a tokenizer, reading stores) runs on threads; the
per-request state of a request is dropped when Serve reports it completed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import LocalityMixin, MultiplexMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvstrata.routing.coverage import ARENA, DISK, NodeCoverage, RecentPrefixes
from kvstrata.routing.engine_cache import EngineCacheView
from kvstrata.routing.estimate import (
    DEFAULT_COSTS,
    DEFAULT_PREFILL_TOKENS_PER_SECOND,
    Backlog,
    ReplicaRates,
    TtftEstimate,
    estimate_ttft,
    rank_replicas,
    rendezvous_order,
)
from kvstrata.routing.figures import ClusterFigures, read_cluster
from kvstrata.routing.ledger import LedgerWriter, open_ledger
from kvstrata.routing.plan import NoCoverage, NodeView, PromptPlan, covered_by_node, own_cache_tokens, plan_prompt
from kvstrata.routing.prefetch import RoutePrefetcher, prefetch_keys
from kvstrata.routing.prompt import Tokenizers

logger = logging.getLogger(__name__)
MAX_DECISIONS = 100_000  # requests routed and not reported completed, kept at most
STARTING_REFRESH_SECONDS = 0.5  # how often figures are read while a replica's engine has no layout yet


@dataclass
class Decision:
    """What the router decided for one request, kept until Serve reports it completed."""

    ranking: list[ReplicaID]
    kind: str  # "estimate" or "fallback:<why>"
    estimates: dict[ReplicaID, TtftEstimate]
    coverage: dict[ReplicaID, NodeCoverage]
    prompt_tokens: int
    lookup_seconds: float
    request_id: str = ""  # Serve's (an HTTP request's `x-request-id`)
    blocks: tuple[bytes, ...] = ()  # the prompt's block hashes, in every hashing looked up
    tokens_per_block: int = 0  # tokens per block hash (the first hashing's)
    plan: PromptPlan | None = None  # its chunk keys per namespace (route-time prefetch)


class TierAwareRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """Routes by estimated time to first token; see the module's docstring."""

    def initialize_state(
        self,
        model: str | None = None,
        tokenizer: str | None = None,
        trust_remote_code: bool = False,
        load_factor: float = 1.25,
        margin: float = 0.1,
        decision_timeout_s: float = 0.25,
        lookup_timeout_s: float = 0.1,
        refresh_seconds: float = 5.0,
        default_prefill_tokens_per_second: float = DEFAULT_PREFILL_TOKENS_PER_SECOND,
        hash_seed: str | None = None,
        lora_paths: Mapping[str, str] | None = None,
        ledger: bool = True,
        ledger_flush_seconds: float = 1.0,
        pending_seconds: float = 5.0,
        recent_seconds: float = 60.0,
        batch_slots: int = 1,
        engine_cache_tokens: int | None = None,
        seed: int | None = None,
        prefetch: bool = True,
        prefetch_lease_s: float | None = None,
        namespace_prefix: str | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        """Kwargs of `request_router_kwargs`:

        model: the model as the engines name it (`model_source`); picks its namespaces
            in the node stores (all of them when not given). tokenizer: where to load the
            tokenizer from (default: `model`). load_factor: past its free batch slots, a
            replica may hold at most this times the mean requests in flight (+1).
            batch_slots: requests an engine runs at once (its `max_num_seqs`): a replica
            with fewer in flight is never excluded by the bound. margin: estimates within
            this fraction of the best count as equal, and the replica whose node holds more
            of the prefix wins among them. decision_timeout_s: the whole
            look-up's budget; lookup_timeout_s: the directory call's. refresh_seconds:
            how often node figures are read (0: never; `set_figures` gives them). default_prefill_tokens_per_second: until an
            engine has measured its own. hash_seed: the engines' PYTHONHASHSEED where
            they set one. lora_paths: adapter name -> the path engines load it from
            (part of vLLM's block hash). ledger: send decisions to the deployment's
            ledger. pending_seconds: how long a routed request's chunks count as in its
            node's arena before the directory says where they are. recent_seconds: how
            long a prompt unused since counts as in the engine's own cache.
            engine_cache_tokens: the engine's own prefix cache size in tokens (vLLM logs
            "GPU KV cache size: N tokens"; None: bounded by `recent_seconds` only).
            seed: unused (ties go in rendezvous order); kept for configs that set it.
            prefetch: ask the chosen node's store to bring the prompt's covered chunks into its arena while the request is on its way (prefetch.py);
            prefetch_lease_s: how long they are held past the expected first lookup
            (None: the store's `prefetch.lease_seconds`). namespace_prefix: the tenant
            the deployment's engines serve (their `namespace_prefix`): coverage and
            route-time prefetch use its namespaces only (None: every tenant's of `model`).
            clock: monotonic seconds (tests).
        """
        if load_factor < 1.0:
            raise ValueError(f"kvstrata router: load_factor must be >= 1, not {load_factor}")
        if batch_slots < 0:
            raise ValueError(f"kvstrata router: batch_slots must be >= 0, not {batch_slots}")
        clock = clock or time.monotonic
        self._model = model
        self._tenant = namespace_prefix
        self._tokenizers = Tokenizers(tokenizer or model, trust_remote_code)
        self._load_factor = load_factor
        self._margin = margin
        self._decision_timeout_s = decision_timeout_s
        self._lookup_timeout_s = lookup_timeout_s
        self._refresh_seconds = refresh_seconds
        self._default_rate = default_prefill_tokens_per_second
        self._hash_seed = hash_seed
        self._lora_paths = dict(lora_paths or {})
        self._batch_slots = batch_slots
        self._figures: ClusterFigures | None = None
        self._refresher: asyncio.Task | None = None
        self._refresh_now: asyncio.Event | None = None  # set: read the stores before the period ends
        self._warmer: asyncio.Task | None = None
        self._backlog = Backlog(clock)
        self._recent = RecentPrefixes(pending_seconds, recent_seconds, clock)
        self._engine_caches = EngineCacheView(engine_cache_tokens, recent_seconds, clock)
        # Requests routed by estimate and not completed, by the replica they went to.
        self._in_flight: dict[ReplicaID, int] = {}
        # internal request id -> (decision, replica its request is counted on; None: not counted).
        self._decisions: dict[str, tuple[Decision, ReplicaID | None]] = {}
        self.counters: dict[str, int] = {}
        self._failing: set[str] = set()  # fallback reasons logged since the last estimate
        deployment = getattr(self, "_deployment_id", None)
        opener = None
        if ledger and deployment is not None:
            opener = lambda: open_ledger(deployment.app_name, deployment.name)  # noqa: E731
        self._ledger = LedgerWriter(opener, ledger_flush_seconds)
        self._metrics = _Metrics(deployment.name if deployment is not None else "")
        self._prefetcher = RoutePrefetcher(prefetch_lease_s) if prefetch else None

    # --- Serve's calls ------------------------------------------------------------------

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if pending_request is None:
            return await self._fallback(candidate_replicas, None, "no_request")
        self._ensure_refreshing()
        request_id = pending_request.metadata.internal_request_id
        known = self._decisions.get(request_id)
        if known is not None:  # Serve asks again: the replicas offered first were full
            by_id = {r.replica_id: r for r in candidate_replicas}
            ranked = [[by_id[rid]] for rid in known[0].ranking if rid in by_id]
            return ranked or await PowerOfTwoChoicesRequestRouter.choose_replicas(self, candidate_replicas, pending_request)
        candidates = self._eligible(candidate_replicas, pending_request)
        started = time.perf_counter()
        try:
            decision = await asyncio.wait_for(self._decide(candidates, pending_request), self._decision_timeout_s)
        except asyncio.TimeoutError:
            return await self._fallback(candidate_replicas, pending_request, "timeout")
        except NoCoverage as why:
            return await self._fallback(candidate_replicas, pending_request, why.reason)
        except Exception:  # noqa: BLE001 - a bug here must not cost the request
            logger.exception("kvstrata router: routing by estimate failed; routing as power of two choices")
            return await self._fallback(candidate_replicas, pending_request, "error")
        decision.lookup_seconds = time.perf_counter() - started
        decision.request_id = pending_request.metadata.request_id
        self._commit(request_id, decision)
        by_id = {r.replica_id: r for r in candidates}
        return [[by_id[rid]] for rid in decision.ranking]

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        known = self._decisions.pop(internal_request_id, None)
        if known is None:
            return
        decision, charged = known
        if charged is not None:
            self._in_flight[charged] = max(0, self._in_flight.get(charged, 0) - 1)
        replica = self._replicas.get(replica_id)
        estimate = decision.estimates.get(replica_id)
        coverage = decision.coverage.get(replica_id)
        self._ledger.add(
            {
                "request_id": decision.request_id,
                "replica": replica_id.unique_id,
                "node": replica.node_id if replica is not None else None,
                "decision": decision.kind,
                "first_choice": decision.ranking[0] == replica_id if decision.ranking else None,
                "prompt_tokens": decision.prompt_tokens,
                "covered_tokens": coverage.servable if coverage is not None else None,
                "sources": dict(coverage.tokens_by_source) if coverage is not None else None,
                "estimate_seconds": estimate.seconds if estimate is not None else None,
                "estimate": estimate.parts() if estimate is not None else None,
                "lookup_seconds": decision.lookup_seconds,
            }
        )

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        """Serve sent the request to `replica_id`: count it there (the first choice was full)."""
        super().on_request_routed(pending_request, replica_id, result)
        known = self._decisions.get(pending_request.metadata.internal_request_id)
        if known is None or known[1] is None or known[1] == replica_id:
            return
        decision, charged = known
        self._in_flight[charged] = max(0, self._in_flight.get(charged, 0) - 1)
        self._in_flight[replica_id] = self._in_flight.get(replica_id, 0) + 1
        self._decisions[pending_request.metadata.internal_request_id] = (decision, replica_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        if not hasattr(self, "_engine_caches"):  # before initialize_state: nothing of ours yet
            return
        live = {r.replica_id for r in replicas}
        self._backlog.forget(live)
        self._engine_caches.forget(live)
        for replica_id in [r for r in self._in_flight if r not in live]:
            del self._in_flight[replica_id]
        # Figures from the moment replicas are known, and at once for a node not read yet.
        known = self._figures.nodes if self._figures is not None else {}
        if self._refresh_now is not None and any(r.node_id not in known for r in replicas):
            self._refresh_now.set()
        try:
            self._ensure_refreshing()
        except RuntimeError:  # no running event loop (a tool calling it directly): the first request starts it
            pass

    # --- the decision ----------------------------------------------------------------------

    def _eligible(self, candidates: list[RunningReplica], pending_request: PendingRequest) -> list[RunningReplica]:
        """All candidates; for a LoRA request, those Serve's multiplexing prefers (as pow-2 does)."""
        if not pending_request.metadata.multiplexed_model_id:
            return list(candidates)
        preferred = self.apply_multiplex_routing(pending_request=pending_request)
        return [r for r in candidates if r.replica_id in preferred] or list(candidates)

    async def _decide(self, candidates: list[RunningReplica], pending_request: PendingRequest) -> Decision:
        figures = self._figures
        if figures is None:
            raise NoCoverage("warming_up")
        if not candidates:
            raise NoCoverage("no_candidates")
        lora = self._lora(pending_request)
        body = pending_request.args[0] if pending_request.args else None
        plan: PromptPlan = await asyncio.to_thread(
            plan_prompt,
            list(pending_request.args),
            dict(pending_request.kwargs),
            self._tokenizers,
            figures,
            sorted({r.node_id for r in candidates}),
            self._model,
            self._hash_seed,
            lora,
            getattr(body, "cache_salt", None),
            tenant=self._tenant,
        )
        coverage = await covered_by_node(plan, figures, self._lookup_timeout_s, self._recent)
        estimates: dict[ReplicaID, TtftEstimate] = {}
        per_replica: dict[ReplicaID, NodeCoverage] = {}
        for replica in candidates:
            view: NodeView | None = coverage.get(replica.node_id)
            node_coverage, slot_bytes = (view.coverage, view.slot_bytes) if view else (NodeCoverage(0, 0, 0, 0), 0)
            if view is not None:  # this replica's own prefix cache (no directory sees it)
                cached = self._engine_caches.prefix_blocks(replica.replica_id, plan.blocks(view.namespace))
                node_coverage = replace(node_coverage, recent=own_cache_tokens(plan, view, cached))
            per_replica[replica.replica_id] = node_coverage
            rates = ReplicaRates(
                figures.prefill_rate(replica.node_id, self._default_rate), figures.costs(replica.node_id, DEFAULT_COSTS)
            )
            estimates[replica.replica_id] = estimate_ttft(
                plan.prompt_tokens,
                node_coverage,
                slot_bytes,
                rates,
                self._backlog.wait(replica.replica_id),
                self._in_flight.get(replica.replica_id, 0),
            )
        # Ties in the prefix's rendezvous order: a new prefix has one home, in every router.
        first_blocks = [hashes[0] for hashes in plan.hashes.values() if hashes]
        order = rendezvous_order(first_blocks[0] if first_blocks else b"", [r.replica_id for r in candidates],
                                 lambda rid: rid.unique_id)  # fmt: skip
        local = {
            rid: max(c.recent, c.tokens_by_source.get(ARENA, 0) + c.tokens_by_source.get(DISK, 0))
            for rid, c in per_replica.items()
        }
        ranking = rank_replicas(
            order,
            {rid: e.seconds for rid, e in estimates.items()},
            {rid: self._in_flight.get(rid, 0) for rid in order},
            self._load_factor,
            local,
            self._margin,
            {rid: self._batch_slots for rid in order},
        )
        blocks = tuple(block for hashes in plan.hashes.values() for block in hashes)
        tokens_per_block = next(iter(plan.hashes))[0] if plan.hashes else 0
        return Decision(
            ranking, "estimate", estimates, per_replica, plan.prompt_tokens, 0.0,
            blocks=blocks, tokens_per_block=tokens_per_block, plan=plan,
        )  # fmt: skip

    def _commit(self, request_id: str, decision: Decision) -> None:
        chosen = decision.ranking[0]
        estimate = decision.estimates[chosen]
        self._in_flight[chosen] = self._in_flight.get(chosen, 0) + 1
        self._backlog.add(chosen, estimate.recompute_seconds + estimate.load_seconds)
        replica = self._replicas.get(chosen)
        if replica is not None:  # its engine computes these: the next request sharing them knows now
            self._recent.add(replica.node_id, decision.blocks)
            self._engine_caches.add(chosen, decision.blocks, decision.tokens_per_block)
        if replica is not None and self._prefetcher is not None and decision.plan is not None:
            self._prefetcher.send(replica.node_id, prefetch_keys(decision.plan, replica.node_id), estimate.seconds)
        self._remember(request_id, decision, chosen)
        self._count("estimate")
        self._metrics.covered(decision.coverage[chosen].servable)
        if self._failing:
            logger.info("kvstrata router: routing by estimate again (after %s)", ", ".join(sorted(self._failing)))
            self._failing.clear()
        if logger.isEnabledFor(logging.DEBUG):
            others = ", ".join(
                f"{rid.unique_id[-8:]} {decision.estimates[rid].seconds * 1000:.1f} ms" for rid in decision.ranking[1:]
            )
            logger.debug(
                "kvstrata router: request %s (%d tokens, %d covered) -> replica %s on node %s: %s; others: %s; "
                "look-up %.1f ms",
                request_id, decision.prompt_tokens, decision.coverage[chosen].servable, chosen.unique_id[-8:],
                (replica.node_id if replica is not None else "?")[:12], estimate.parts(), others or "none",
                decision.lookup_seconds * 1000,
            )  # fmt: skip

    def _remember(self, request_id: str, decision: Decision, charged: ReplicaID | None) -> None:
        """Keep a decision until Serve reports its request completed; a request Serve
        dropped before sending it never is, so the oldest go past `MAX_DECISIONS`."""
        self._decisions[request_id] = (decision, charged)
        while len(self._decisions) > MAX_DECISIONS:
            oldest = next(iter(self._decisions))
            _, replica = self._decisions.pop(oldest)
            if replica is not None:
                self._in_flight[replica] = max(0, self._in_flight.get(replica, 0) - 1)

    def _lora(self, pending_request: PendingRequest) -> tuple[str, str] | None:
        name = pending_request.metadata.multiplexed_model_id
        if not name:
            return None
        path = self._lora_paths.get(name)
        if path is None:
            raise NoCoverage("lora_path_unknown")
        return name, path

    async def _fallback(
        self, candidates: list[RunningReplica], pending_request: PendingRequest | None, reason: str
    ) -> list[list[RunningReplica]]:
        """Route as Serve's default router does, and count why."""
        kind = f"fallback:{reason}"
        self._count(kind)
        if reason not in self._failing and reason not in ("no_request", "warming_up", "no_prompt_tokens"):
            self._failing.add(reason)
            logger.warning("kvstrata router: routing as power of two choices (%s) until estimates work again", reason)
        chosen = await PowerOfTwoChoicesRequestRouter.choose_replicas(self, candidates, pending_request)
        if pending_request is not None and chosen and chosen[0]:
            # Not counted as load: Serve picks between the two by their own queue lengths,
            # and a request the router knows nothing about (a readiness probe) must not
            # push a later one off the replica holding its prefix.
            decision = Decision([r.replica_id for r in chosen[0]], kind, {}, {}, 0, 0.0, pending_request.metadata.request_id)
            self._remember(pending_request.metadata.internal_request_id, decision, None)
        return chosen

    def _count(self, kind: str) -> None:
        self.counters[kind] = self.counters.get(kind, 0) + 1
        self._metrics.decision(kind)

    # --- figures ----------------------------------------------------------------------------

    def _ensure_refreshing(self) -> None:
        if self._refresh_seconds <= 0:
            return
        loop = asyncio.get_running_loop()
        if self._warmer is None:
            # What the first look-up would otherwise pay inside its budget: loading the
            # tokenizer and importing vLLM's hashing (seconds, once per process) -- beside
            # the first read of the figures, never before it.
            self._warmer = loop.create_task(self._warm_up())
        if self._refresher is None or self._refresher.done():
            self._refresh_now = asyncio.Event()
            self._refresher = loop.create_task(self._refresh_forever(self._refresh_now))

    async def _warm_up(self) -> None:
        try:
            await asyncio.to_thread(_warm_up, self._tokenizers)
        except Exception as exc:  # noqa: BLE001 - the first look-up loads it (or falls back) instead
            logger.warning("kvstrata router: warming up the tokenizer failed: %s: %s", type(exc).__name__, exc)

    async def _refresh_forever(self, now: asyncio.Event) -> None:
        while True:
            now.clear()
            try:
                nodes = {r.node_id for r in self._replicas.values()}
                self._figures = await read_cluster(nodes, self._figures or ClusterFigures(), self._refresh_seconds)
            except Exception:  # noqa: BLE001 - keep the last figures; try again next period
                logger.exception("kvstrata router: reading the node stores failed")
            period = self._refresh_seconds
            if not self._every_node_has_a_layout():  # engines still starting: look again soon
                period = min(period, STARTING_REFRESH_SECONDS)
            try:  # the period, or at once when a replica on a node not read yet appears
                await asyncio.wait_for(now.wait(), period)
            except asyncio.TimeoutError:
                pass

    def _every_node_has_a_layout(self) -> bool:
        nodes = self._figures.nodes if self._figures is not None else {}
        return all(r.node_id in nodes and nodes[r.node_id].schemes for r in self._replicas.values())

    def set_figures(self, figures: ClusterFigures) -> None:
        """Use these figures (tests, tools); a running refresh replaces them in its next period."""
        self._figures = figures


def _warm_up(tokenizers: Tokenizers) -> None:
    tokenizers.get()
    import kvstrata.connector.compat  # noqa: F401 - vLLM's hashing, for the first request's keys


class _Metrics:
    """Prometheus counters (`ray_kvstrata_router_*`), where Ray's metrics work (a Ray process)."""

    def __init__(self, deployment: str):
        self._decisions = self._covered = None
        try:
            from ray.util.metrics import Counter

            self._decisions = Counter(
                "kvstrata_router_decisions",
                description="Requests routed by the kvstrata router, by decision (estimate, fallback:<why>).",
                tag_keys=("deployment", "decision"),
            ).set_default_tags({"deployment": deployment})
            self._covered = Counter(
                "kvstrata_router_covered_tokens",
                description="Prompt tokens the chosen replica's node could serve from kvstrata, by the directory.",
                tag_keys=("deployment",),
            ).set_default_tags({"deployment": deployment})
        except Exception:  # noqa: BLE001 - outside Ray (tests): no metrics, routing unchanged
            pass

    def decision(self, kind: str) -> None:
        if self._decisions is not None:
            self._decisions.inc(tags={"decision": kind})

    def covered(self, tokens: int) -> None:
        if self._covered is not None and tokens:
            self._covered.inc(tokens)
