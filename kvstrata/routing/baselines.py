"""Serve's own routers, recording into the same ledger as `TierAwareRouter`.

For comparing routers on one deployment (benchmarks/routing.py does): requests per
replica and per node, read back with `ledger.read_ledger`. Routing is exactly the
parent's; only `on_request_completed` adds a ledger entry.
"""

from __future__ import annotations

from typing import Any

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.llm.request_router import PrefixCacheAffinityRouter
from ray.serve.request_router import ReplicaID

from kvstrata.routing.ledger import LedgerWriter, open_ledger


class _Recording:
    _decision = "baseline"

    def _open_ledger(self, flush_seconds: float) -> None:
        deployment = self._deployment_id
        self._ledger = LedgerWriter(lambda: open_ledger(deployment.app_name, deployment.name), flush_seconds)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        replica = self._replicas.get(replica_id)
        self._ledger.add(
            {"replica": replica_id.unique_id, "node": replica.node_id if replica else None, "decision": self._decision}
        )


class RecordedPowerOfTwoChoicesRouter(_Recording, PowerOfTwoChoicesRequestRouter):
    _decision = "power_of_two_choices"

    def initialize_state(self, ledger_flush_seconds: float = 1.0) -> None:
        self._open_ledger(ledger_flush_seconds)


class RecordedPrefixCacheAffinityRouter(_Recording, PrefixCacheAffinityRouter):
    _decision = "prefix_cache_affinity"

    def initialize_state(self, ledger_flush_seconds: float = 1.0, **kwargs: Any) -> None:
        super().initialize_state(**kwargs)
        self._open_ledger(ledger_flush_seconds)
