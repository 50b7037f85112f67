"""The in-process store client: a NodeStore called directly, without Ray (tests, benchmarks).

Owns: `LocalStoreClient`, the twin of `client.RayStoreClient`.
Invariants: it mirrors `RayStoreClient` call for call (register, step, release_holder)
and adds nothing: no timeout, no retry, no state.
Must not: import Ray or node_store.py (node_store.py re-exports this class); it knows the
store only by its control surface.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvstrata.protocol import Registration, StepReply, StepRequest
from kvstrata.store.control import StoreControl


class LocalStoreClient:
    """A store client that calls a NodeStore in this process (tests, benchmarks).

    It has the same surface as `client.RayStoreClient`, so the manager and worker never
    know which one they hold.
    """

    def __init__(self, store: StoreControl):
        self.store = store

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

    def apply_hints(self, namespace: str, actions: list[dict[str, object]]) -> None:
        self.store.apply_hints(namespace, actions)
