"""The in-process store client: a NodeStore called directly, without Ray (tests, benchmarks).

Owns: `LocalStoreClient`, the twin of `actors.client.RayStoreClient`: both satisfy
`kvstrata.protocol.StoreClient`.
Invariants: it mirrors `RayStoreClient` call for call and adds nothing: no timeout, no
retry, no state.
Must not: import Ray or node_store.py (node_store.py re-exports this class); it knows the
store only by the calls it answers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvstrata.protocol import HintAction, Registration, StepReply, StepRequest


class LocalStoreClient:
    """A store client that calls a NodeStore in this process (tests, benchmarks).

    It has the same surface as `client.RayStoreClient`, so the manager and worker never
    know which one they hold.
    """

    def __init__(self, store: Any):
        self.store = store  # a kvstrata.store.NodeStore (or anything with its calls)

    def register(
        self,
        holder: str,
        namespace: str,
        slot_bytes: int,
        layout: Mapping[str, object] | None = None,
        watch: bool = False,
        epoch: str = "",
        nonce: str = "",
    ) -> Registration:
        return self.store.register(holder, namespace, slot_bytes, layout, watch, epoch, nonce)

    def step(self, request: StepRequest) -> StepReply:
        return self.store.step(request)

    def release_holder(self, holder: str, epoch: str) -> None:
        self.store.release_holder(holder, epoch)

    def apply_hints(self, namespace: str, actions: Sequence[HintAction]) -> None:
        self.store.apply_hints(namespace, actions)

    def prefetch(
        self, namespace: str, keys: Sequence[bytes], deadline_s: float = 0.0, lease_s: float | None = None
    ) -> dict[str, int]:
        return self.store.prefetch(namespace, keys, deadline_s, lease_s)

    def send_prefetch(
        self, namespace: str, keys: Sequence[bytes], deadline_s: float = 0.0, lease_s: float | None = None
    ) -> None:
        self.store.prefetch(namespace, keys, deadline_s, lease_s)

    def pin_chunks(self, namespace: str, keys: Sequence[bytes]) -> dict[str, int]:
        return self.store.pin_chunks(namespace, keys)

    def retain(self, namespace: str, keys: Sequence[bytes], priority: int, ttl_s: float) -> dict[str, int]:
        return self.store.retain(namespace, keys, priority, ttl_s)

    def prefetch_holds(self, namespace: str) -> dict[bytes, float]:
        return self.store.prefetch_holds(namespace)

    def prefetch_pending(self, namespace: str) -> int:
        return self.store.prefetch_pending(namespace)

    def ping(self) -> str:
        return self.store.ping()

    def stats(self) -> dict[str, object]:
        return self.store.stats()

    async def stats_async(self) -> dict[str, object]:
        return self.store.stats()

    def purge(self, namespace: str | None = None) -> int:
        return self.store.purge(namespace)
